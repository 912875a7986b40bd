//! Periodic fsync of the disk tier (`fsync_interval_ms`, like Redis's `appendfsync everysec`):
//! a power cut loses at most the blocks written in the last interval. Region files written since
//! the last pass are `fdatasync`ed by one background thread; it ends within one interval of the
//! tier being dropped.

use std::sync::Weak;
use std::time::Duration;

use super::Inner;

/// Starts the thread. It holds the tier only while it syncs, so dropping the tier is not
/// delayed by it.
pub(super) fn spawn(inner: Weak<Inner>, interval: Duration) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("disk-fsync".into())
        .spawn(move || {
            loop {
                std::thread::sleep(interval);
                let Some(inner) = inner.upgrade() else { return };
                sync_written(&inner);
            }
        })
        .map(drop)
}

/// `fdatasync`s every region file written since the last pass; a failure is logged (its
/// blocks stay counted as unsynced and are retried next pass).
pub(super) fn sync_written(inner: &Inner) {
    if let Err(e) = inner.sync_dirty() {
        tracing::warn!(error = %e, "disk tier fsync failed");
    }
}
