//! Recovery: rebuilding the index from the region files at open — one index file per sealed
//! region, a scan of every header and payload for a region without one — and what it found.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::StoreError;
use crate::aligned_buf::AlignedBuf;
use crate::disk_format::{EntryHeader, FormatError, HEADER_BYTES, IndexRecord, RegionHeader, decode_index};

use super::region::{parse_region_name, region_path};
use super::{Inner, Loc, RECOVERY_THREADS, Region, RegionRecovery, lock_poisoned};

/// What opening a disk tier found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RecoveryReport {
    /// Region files opened.
    pub regions: usize,
    /// Blocks recovered into the index.
    pub entries: u64,
    /// Regions whose index file was used.
    pub regions_from_index: usize,
    /// Regions whose entries were scanned (no usable index file).
    pub regions_scanned: usize,
    /// Entries dropped because a header or payload failed its checksum.
    pub corrupt: u64,
    /// Entries cut short by the end of a truncated file.
    pub torn: u64,
    /// Entries or regions of another format version, skipped.
    pub skipped_other_version: u64,
    /// Regions whose header was unreadable and that held no entry that verifies, skipped.
    pub unreadable_regions: usize,
    /// Regions whose header was damaged but whose entries were scanned with this tier's
    /// geometry: every entry that verifies is recovered, and the header is rewritten.
    pub regions_salvaged: usize,
    /// Wall time of the recovery.
    #[serde(serialize_with = "ser_secs")]
    pub elapsed: Duration,
}

impl RecoveryReport {
    fn merge(&mut self, o: &RecoveryReport) {
        self.regions_from_index += o.regions_from_index;
        self.regions_scanned += o.regions_scanned;
        self.corrupt += o.corrupt;
        self.torn += o.torn;
        self.skipped_other_version += o.skipped_other_version;
        self.unreadable_regions += o.unreadable_regions;
        self.regions_salvaged += o.regions_salvaged;
    }
}

fn ser_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Inner {
    /// Rebuilds the index from the region files.
    pub(super) fn recover(&self) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        let mut ids: Vec<u64> = std::fs::read_dir(&self.dir)
            .map_err(|e| StoreError::io("read_dir", &self.dir, e))?
            .filter_map(|e| e.ok()?.file_name().to_str().and_then(parse_region_name))
            .collect();
        ids.sort_unstable();
        let cleared = lock_poisoned(self.cleared.lock()).clone();
        // Regions are independent: open (and, without an index, scan) several at once, which
        // also keeps several reads in flight for the disk.
        let next = std::sync::atomic::AtomicUsize::new(0);
        let threads = ids.len().clamp(1, RECOVERY_THREADS);
        let mut found: Vec<(u64, RegionRecovery)> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&id) = ids.get(i) else { return out };
                            let mut local = RecoveryReport::default();
                            let r = self.recover_region(id, &mut local);
                            out.push((id, (r, local)));
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_default())
                .collect()
        });
        found.sort_by_key(|(id, _)| *id);
        let mut max_seq = 0;
        for (id, (result, local)) in found {
            report.merge(&local);
            self.counters.corrupt.fetch_add(local.corrupt, Ordering::Relaxed);
            let Some((region, records)) = result? else {
                continue;
            };
            report.regions += 1;
            for rec in records {
                if cleared.get(&rec.ns).is_some_and(|&upto| rec.seq <= upto) {
                    continue;
                }
                max_seq = max_seq.max(rec.seq);
                let loc = Loc {
                    region: id,
                    slot: rec.slot,
                    seq: rec.seq,
                    ns: rec.ns,
                };
                self.index
                    .entry(rec.key)
                    .and_modify(|l| {
                        if l.seq < loc.seq {
                            *l = loc;
                        }
                    })
                    .or_insert(loc);
                region.records().push(rec);
            }
            lock_poisoned(self.regions.write()).insert(id, Arc::new(region));
        }
        report.entries = self.index.len() as u64;
        self.seq.store(
            max_seq.max(cleared.values().copied().max().unwrap_or(0)),
            Ordering::Relaxed,
        );
        lock_poisoned(self.active.lock()).next_id = ids.last().map_or(1, |l| l + 1);
        // A smaller capacity than last time: drop the oldest regions.
        loop {
            let oldest = {
                let regions = lock_poisoned(self.regions.read());
                if regions.len() <= self.max_regions {
                    break;
                }
                regions.keys().next().copied()
            };
            match oldest {
                Some(old) => self.reclaim(old),
                None => break,
            }
        }
        Ok(report)
    }

    /// Opens one region file and lists its valid entries (from its index file, or by scanning).
    /// `None` for a region that is skipped (unreadable header or other format version).
    pub(super) fn recover_region(
        &self,
        id: u64,
        report: &mut RecoveryReport,
    ) -> Result<Option<(Region, Vec<IndexRecord>)>, StoreError> {
        let path = region_path(&self.dir, id);
        let file = self
            .open_options()
            .open(&path)
            .map_err(|e| StoreError::io("open", &path, e))?;
        let len = file
            .metadata()
            .map_err(|e| StoreError::io("stat", &path, e))?
            .len();
        let mut header = AlignedBuf::new(HEADER_BYTES);
        let decoded = if len < HEADER_BYTES as u64 {
            Err(FormatError::Invalid(format!(
                "{len} bytes, shorter than its header"
            )))
        } else {
            file.read_exact_at(&mut header, 0)
                .map_err(|e| StoreError::io("read", &path, e))?;
            RegionHeader::decode(&header)
        };
        let rh = match decoded {
            Ok(h) => h,
            Err(FormatError::Version(v)) if !is_damaged_version(&header) => {
                tracing::warn!(path = %path.display(), version = v, "skipping disk region of another format version");
                report.skipped_other_version += 1;
                return Ok(None);
            }
            Err(e) => return self.salvage_region(id, path, file, len, &e, report),
        };
        if rh.geometry != self.geometry {
            return Err(StoreError::DiskGeometryMismatch {
                path,
                expected: self.geometry,
                found: rh.geometry,
            });
        }
        if rh.entry_stride != self.entry_stride || rh.region_id != id {
            tracing::warn!(path = %path.display(), "skipping disk region with an inconsistent header");
            report.unreadable_regions += 1;
            return Ok(None);
        }
        let full_len = HEADER_BYTES as u64 + u64::from(rh.slots) * rh.entry_stride;
        let region = Region {
            id,
            path: path.clone(),
            file,
            slots: rh.slots,
            records: Mutex::new(Vec::new()),
            finished: AtomicU32::new(rh.slots),
        };
        if len >= full_len
            && let Ok(bytes) = std::fs::read(region.index_path())
        {
            match decode_index(&bytes, id) {
                Ok(records) if records.iter().all(|r| r.slot < rh.slots) => {
                    report.regions_from_index += 1;
                    return Ok(Some((region, records)));
                }
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "region index names slots past the region; scanning")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unusable region index; scanning")
                }
            }
        }
        if len < full_len {
            tracing::warn!(path = %path.display(), bytes = len, expected_bytes = full_len, "disk region truncated; recovering the entries before the cut");
        }
        let records = self.scan_region(&region, rh.slots, len, report)?;
        report.regions_scanned += 1;
        if len >= full_len {
            // Next time, read the index instead of scanning.
            let _ = self.write_index_records(&region, &records);
        }
        Ok(Some((region, records)))
    }

    /// A region whose header does not decode (a flipped byte, a torn first write): its entries
    /// carry their own checksums, so scan them as if the header said this tier's geometry and
    /// keep every entry that verifies (an entry of another geometry fails its length or
    /// checksum, and its key is of another namespace anyway). With at least one, the header is
    /// rewritten so the next start reads it; with none the region is skipped as unreadable.
    fn salvage_region(
        &self,
        id: u64,
        path: std::path::PathBuf,
        file: std::fs::File,
        len: u64,
        why: &FormatError,
        report: &mut RecoveryReport,
    ) -> Result<Option<(Region, Vec<IndexRecord>)>, StoreError> {
        let slots =
            (len.saturating_sub(HEADER_BYTES as u64) / self.entry_stride).min(u64::from(u32::MAX)) as u32;
        let region = Region {
            id,
            path: path.clone(),
            file,
            slots,
            records: Mutex::new(Vec::new()),
            finished: AtomicU32::new(slots),
        };
        let mut local = RecoveryReport::default();
        let records = self.scan_region(&region, slots, len, &mut local)?;
        if records.is_empty() {
            tracing::warn!(path = %path.display(), error = %why, "skipping unreadable disk region: no entry verifies");
            report.unreadable_regions += 1;
            return Ok(None);
        }
        // Entries that failed here were counted by the scan; the region itself is kept.
        report.merge(&local);
        report.regions_salvaged += 1;
        tracing::warn!(
            path = %path.display(),
            error = %why,
            entries = records.len(),
            "disk region header damaged; recovered every entry that verifies"
        );
        let mut header = AlignedBuf::new(HEADER_BYTES);
        RegionHeader {
            geometry: self.geometry,
            slots,
            entry_stride: self.entry_stride,
            region_id: id,
        }
        .encode(&mut header);
        let repaired = region
            .file
            .write_all_at(&header, 0)
            .and_then(|()| region.file.sync_data());
        if let Err(e) = repaired {
            tracing::warn!(path = %path.display(), error = %e, "could not rewrite the damaged region header");
        } else {
            let _ = self.write_index_records(&region, &records);
        }
        Ok(Some((region, records)))
    }

    /// Reads every entry header of a region and verifies each payload.
    pub(super) fn scan_region(
        &self,
        region: &Region,
        slots: u32,
        len: u64,
        report: &mut RecoveryReport,
    ) -> Result<Vec<IndexRecord>, StoreError> {
        // One read per entry: header and payload together.
        let mut entry = AlignedBuf::new(self.entry_stride as usize);
        let mut records = Vec::new();
        let mut other_version = false;
        for slot in 0..slots {
            let off = HEADER_BYTES as u64 + u64::from(slot) * self.entry_stride;
            if off + self.entry_stride > len {
                if off < len {
                    report.torn += 1;
                }
                break;
            }
            region
                .file
                .read_exact_at(&mut entry, off)
                .map_err(|e| StoreError::io("read", &region.path, e))?;
            let h = match EntryHeader::decode(&entry[..HEADER_BYTES]) {
                Ok(h) => h,
                Err(FormatError::Empty) => continue,
                Err(FormatError::Version(_)) => {
                    other_version = true;
                    report.skipped_other_version += 1;
                    continue;
                }
                Err(_) => {
                    report.corrupt += 1;
                    continue;
                }
            };
            let payload = &entry[HEADER_BYTES..];
            if h.payload_len != self.geometry.bytes_per_block() as u64
                || kvtier_core::xxh3_64(&payload[..h.payload_len as usize]) != h.payload_xxh3
            {
                report.corrupt += 1;
                continue;
            }
            records.push(IndexRecord {
                slot,
                ns: h.ns,
                key: h.key,
                seq: h.seq,
                payload_xxh3: h.payload_xxh3,
            });
        }
        if other_version {
            tracing::warn!(path = %region.path.display(), "skipped disk entries of another format version");
        }
        Ok(records)
    }
}

/// Whether a header that names another format version is ours with its version word damaged:
/// with the version put back, its checksum matches.
fn is_damaged_version(header: &[u8]) -> bool {
    let mut fixed = header[..HEADER_BYTES].to_vec();
    fixed[8..12].copy_from_slice(&crate::disk_format::FORMAT_VERSION.to_le_bytes());
    RegionHeader::decode(&fixed).is_ok()
}
