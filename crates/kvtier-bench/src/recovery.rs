//! `kvtier bench recovery`: how long reopening a disk tier takes, and what it finds.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvtier_core::{BlockHasher, ByteSize, Dtype, KvGeometry, Namespace};
use kvtier_store::{DirectIo, DiskTier, DiskTierConfig, Prefault, ShmRegion};
use serde::Serialize;

use crate::BenchError;
use crate::baselines::gib_s;

/// Parameters of the recovery benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryConfig {
    /// KV geometry of the blocks (default: the offload benchmark's, 128 KiB per block).
    pub geometry: KvGeometry,
    /// Bytes of blocks to write before reopening.
    pub bytes: ByteSize,
    /// Directory whose disk to use (a fresh subdirectory is made and removed); `None` for the
    /// system's temporary directory.
    pub dir: Option<PathBuf>,
    /// Region file size.
    pub region_size: ByteSize,
    /// Writer threads while filling.
    pub writers: usize,
    /// Also time a reopen with every index file removed (every header and payload scanned).
    pub scan: bool,
    /// Page-cache bypass.
    pub direct_io: DirectIo,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        Self {
            geometry: KvGeometry::new(1, 4, 128, Dtype::Bf16, 64).expect("valid default geometry"),
            bytes: ByteSize::gib(1),
            dir: None,
            region_size: ByteSize::mib(256),
            writers: 2,
            scan: false,
            direct_io: DirectIo::Auto,
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryReport {
    /// The configuration that ran.
    pub config: RecoveryConfig,
    /// Blocks written.
    pub blocks: u64,
    /// GiB/s while filling.
    pub fill_gib_s: f64,
    /// Blocks the reopen found.
    pub recovered_entries: u64,
    /// Region files.
    pub regions: usize,
    /// Reopen time with index files, ms.
    pub reopen_ms: f64,
    /// Reopen time scanning every region, ms (with `scan`).
    pub scan_reopen_ms: Option<f64>,
    /// Blocks the scanning reopen found (with `scan`).
    pub scan_entries: Option<u64>,
}

impl RecoveryReport {
    /// Output lines.
    pub fn lines(&self) -> Vec<String> {
        let mut v = vec![
            format!("recovery_bytes={}", self.config.bytes),
            format!(
                "recovery_blocks={} fill_gib_s={:.2}",
                self.blocks, self.fill_gib_s
            ),
            format!("recovery_regions={}", self.regions),
            format!("recovered_entries={}", self.recovered_entries),
            format!("reopen_ms={:.1}", self.reopen_ms),
        ];
        if let (Some(ms), Some(n)) = (self.scan_reopen_ms, self.scan_entries) {
            v.push(format!("scan_reopen_ms={ms:.1} scan_entries={n}"));
        }
        v
    }
}

/// Fills a disk tier, drops it, and times reopening it; `progress(done, total)` reports blocks
/// written.
///
/// # Errors
/// Tier errors; [`BenchError::InvalidConfig`] when a reopen does not find every block.
pub fn run_recovery(
    config: &RecoveryConfig,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RecoveryReport, BenchError> {
    let g = config.geometry;
    let parent = config.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = parent.join(format!("kvtier-recovery-{}", std::process::id()));
    let _cleanup = RemoveOnDrop(dir.clone());
    let disk_config = DiskTierConfig {
        dir: dir.clone(),
        capacity: ByteSize(config.bytes.bytes() * 2 + 2 * config.region_size.bytes()),
        region_size: config.region_size,
        direct_io: config.direct_io,
        create_dir: true,
        ..DiskTierConfig::default()
    };
    let blocks = (config.bytes.bytes() / g.bytes_per_block() as u64).max(1);
    let ns = Namespace::single("kvtier-bench/recovery", g)?.fingerprint();
    let block_tokens = g.block_tokens() as usize;
    let fill = Instant::now();
    {
        let (disk, _) = DiskTier::open(g, &disk_config)?;
        let page = g.bytes_per_block().next_multiple_of(kvtier_store::PAGE_ALIGN);
        let src = Arc::new(ShmRegion::create_private(
            "kvtier-recovery-src",
            page,
            Prefault::Touch,
        )?);
        src.fill(0, page, 0x3c)?;
        let writers = config.writers.max(1) as u64;
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        std::thread::scope(|s| -> Result<(), BenchError> {
            let handles: Vec<_> = (0..writers)
                .map(|w| {
                    let (disk, src, done) = (disk.clone(), Arc::clone(&src), Arc::clone(&done));
                    s.spawn(move || -> Result<(), BenchError> {
                        let mut hasher = BlockHasher::new(ns, block_tokens as u32);
                        let mut tokens = vec![0u32; block_tokens];
                        for b in (w..blocks).step_by(writers as usize) {
                            tokens[0] = b as u32;
                            tokens[1] = (b >> 32) as u32;
                            let key = hasher.key(None, &tokens).expect("one block of tokens");
                            disk.append(ns, key, &src, 0)?;
                            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Ok(())
                    })
                })
                .collect();
            loop {
                let finished = handles.iter().all(|h| h.is_finished());
                progress(done.load(std::sync::atomic::Ordering::Relaxed), blocks);
                if finished {
                    break;
                }
                std::thread::park_timeout(std::time::Duration::from_millis(200));
            }
            for h in handles {
                h.join()
                    .map_err(|_| BenchError::InvalidConfig("a writer thread panicked".into()))??;
            }
            Ok(())
        })?;
        disk.flush()?;
    }
    let fill_gib_s = gib_s(blocks * g.bytes_per_block() as u64, fill.elapsed());
    let start = Instant::now();
    let (disk, report) = DiskTier::open(g, &disk_config)?;
    let reopen_ms = start.elapsed().as_secs_f64() * 1e3;
    if report.entries != blocks {
        return Err(BenchError::InvalidConfig(format!(
            "reopen found {} of {blocks} blocks",
            report.entries
        )));
    }
    drop(disk);
    let (scan_reopen_ms, scan_entries) = if config.scan {
        for e in std::fs::read_dir(&dir).map_err(|e| io(&dir, e))? {
            let p = e.map_err(|e| io(&dir, e))?.path();
            if p.extension().is_some_and(|x| x == "idx") {
                std::fs::remove_file(&p).map_err(|e| io(&p, e))?;
            }
        }
        let start = Instant::now();
        let (_disk, r) = DiskTier::open(g, &disk_config)?;
        (Some(start.elapsed().as_secs_f64() * 1e3), Some(r.entries))
    } else {
        (None, None)
    };
    Ok(RecoveryReport {
        config: config.clone(),
        blocks,
        fill_gib_s,
        recovered_entries: report.entries,
        regions: report.regions,
        reopen_ms,
        scan_reopen_ms,
        scan_entries,
    })
}

fn io(path: &std::path::Path, e: std::io::Error) -> BenchError {
    BenchError::Store(kvtier_store::StoreError::Io {
        op: "list",
        path: path.to_owned(),
        source: e,
    })
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_tier_is_refilled_found_and_scanned() {
        let cfg = RecoveryConfig {
            geometry: KvGeometry::new(1, 1, 64, Dtype::Bf16, 16).unwrap(),
            bytes: ByteSize::mib(4),
            region_size: ByteSize::mib(1),
            scan: true,
            ..RecoveryConfig::default()
        };
        let r = run_recovery(&cfg, &mut |_, _| {}).unwrap();
        assert_eq!(r.blocks, 1024);
        assert_eq!(r.recovered_entries, 1024);
        assert_eq!(r.scan_entries, Some(1024));
        assert!(r.regions >= 4);
        assert_eq!(r.lines().len(), 6);
    }
}
