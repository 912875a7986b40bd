//! Region files: the log the tier appends to (one fixed-size entry per block), how a slot is
//! reserved and finished, the index file written when a region is full, and reclaiming whole
//! regions oldest first.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::StoreError;
use crate::aligned_buf::AlignedBuf;
use crate::disk_format::{HEADER_BYTES, IndexRecord, RegionHeader, encode_index};

use super::{Inner, Region, is_full, lock_poisoned};

pub(super) fn region_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("region-{id:016x}.kvt"))
}

pub(super) fn parse_region_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("region-")?.strip_suffix(".kvt")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok())?
}

impl Region {
    pub(super) fn records(&self) -> MutexGuard<'_, Vec<IndexRecord>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn index_path(&self) -> PathBuf {
        self.path.with_extension("idx")
    }
}

impl Inner {
    /// The next free slot of the active region, starting a new region (and reclaiming the
    /// oldest) when it is full.
    pub(super) fn reserve_slot(&self) -> Result<(Arc<Region>, u32), StoreError> {
        let mut a = lock_poisoned(self.active.lock());
        if let Some(r) = a.region.clone()
            && a.next_slot < r.slots
        {
            let slot = a.next_slot;
            a.next_slot += 1;
            return Ok((r, slot));
        }
        let now = Instant::now();
        if !a.full.may_try(now) {
            return Err(StoreError::DiskFull {
                path: self.dir.clone(),
                source: io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        let id = a.next_id;
        loop {
            let oldest = {
                let regions = lock_poisoned(self.regions.read());
                if regions.len() < self.max_regions {
                    break;
                }
                regions.keys().next().copied()
            };
            match oldest {
                Some(old) => self.reclaim(old),
                None => break,
            }
        }
        let created = match self.create_region(id) {
            // The file system holds less than the capacity: one region out, one in, so the tier
            // keeps to what fits.
            Err(StoreError::DiskFull { .. }) if self.reclaim_oldest() => self.create_region(id),
            r => r,
        };
        let region = match created {
            Ok(r) => {
                if let Some(spell) = a.full.found_room(now) {
                    tracing::info!(
                        dir = %self.dir.display(),
                        full_ms = spell.as_millis() as u64,
                        "disk tier writes resumed"
                    );
                }
                Arc::new(r)
            }
            Err(e) => {
                if let StoreError::DiskFull { path, .. } = &e {
                    self.note_full(&mut a.full, path);
                }
                return Err(e);
            }
        };
        lock_poisoned(self.regions.write()).insert(id, Arc::clone(&region));
        a.next_id = id + 1;
        a.region = Some(Arc::clone(&region));
        a.next_slot = 1;
        Ok((region, 0))
    }

    pub(super) fn create_region(&self, id: u64) -> Result<Region, StoreError> {
        let path = region_path(&self.dir, id);
        let full_or = |e: io::Error, op| {
            if is_full(&e) {
                StoreError::DiskFull {
                    path: path.clone(),
                    source: e,
                }
            } else {
                StoreError::io(op, &path, e)
            }
        };
        let file = self
            .open_options()
            .create_new(true)
            .open(&path)
            .map_err(|e| full_or(e, "create"))?;
        let len = HEADER_BYTES as u64 + u64::from(self.slots_per_region) * self.entry_stride;
        let fail = |e: io::Error, op| {
            let _ = std::fs::remove_file(&path);
            full_or(e, op)
        };
        // Reserve the whole region now: a full disk fails here, not in the middle of a block.
        // SAFETY: fallocate on an open descriptor with a valid range.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                file.set_len(len).map_err(|e| fail(e, "ftruncate"))?;
            } else {
                return Err(fail(e, "fallocate"));
            }
        }
        let mut header = AlignedBuf::new(HEADER_BYTES);
        RegionHeader {
            geometry: self.geometry,
            slots: self.slots_per_region,
            entry_stride: self.entry_stride,
            region_id: id,
        }
        .encode(&mut header);
        file.write_all_at(&header, 0).map_err(|e| fail(e, "write"))?;
        tracing::debug!(region = id, path = %path.display(), "disk region created");
        Ok(Region {
            id,
            path,
            file,
            slots: self.slots_per_region,
            records: Mutex::new(Vec::new()),
            finished: AtomicU32::new(0),
        })
    }

    /// Records a finished slot; the one that completes a full region writes its index.
    pub(super) fn finish_slot(&self, region: &Region, record: Option<IndexRecord>) {
        if let Some(r) = record {
            region.records().push(r);
        }
        if region.finished.fetch_add(1, Ordering::AcqRel) + 1 == region.slots
            && let Err(e) = self.write_index(region)
        {
            tracing::warn!(region = region.id, error = %e, "could not write region index; a restart will scan it");
        }
    }

    pub(super) fn write_index(&self, region: &Region) -> Result<(), StoreError> {
        let records = region.records().clone();
        self.write_index_records(region, &records)
    }

    pub(super) fn write_index_records(
        &self,
        region: &Region,
        records: &[IndexRecord],
    ) -> Result<(), StoreError> {
        let path = region.index_path();
        let tmp = path.with_extension("idx.tmp");
        let bytes = encode_index(region.id, records);
        let write = || -> io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_data()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| StoreError::io("write index", &path, e))
    }

    /// Reclaims the oldest region; whether there was one.
    pub(super) fn reclaim_oldest(&self) -> bool {
        let oldest = lock_poisoned(self.regions.read()).keys().next().copied();
        oldest.inspect(|&id| self.reclaim(id)).is_some()
    }

    /// Drops region `id`: its entries leave the index, its files are deleted (readers that
    /// still hold it finish from the open descriptor).
    pub(super) fn reclaim(&self, id: u64) {
        self.drop_region(id, true);
    }

    /// Removes region `id` and its index entries; `notify`: each entry dropped goes to the
    /// reclaim hook (evictions name their blocks; a clear says `Cleared` once instead).
    pub(super) fn drop_region(&self, id: u64, notify: bool) {
        let Some(region) = lock_poisoned(self.regions.write()).remove(&id) else {
            return;
        };
        let mut dropped = 0;
        for r in region.records().iter() {
            if self.index.remove_if(&r.key, |_, l| l.region == id).is_some() {
                dropped += 1;
                if notify {
                    self.on_reclaim.call(r.ns, r.key);
                }
            }
        }
        let _ = std::fs::remove_file(&region.path);
        let _ = std::fs::remove_file(region.index_path());
        self.counters.reclaimed_regions.fetch_add(1, Ordering::Relaxed);
        self.counters
            .reclaimed_entries
            .fetch_add(dropped, Ordering::Relaxed);
        tracing::debug!(region = id, entries = dropped, "disk region reclaimed");
    }
}
