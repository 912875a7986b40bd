//! Loads win over stores on the disk too: disk writes wait while disk reads are in flight,
//! for a bounded time, so a load's time to first token does not pay for another request's
//! persistence, and persistence still always progresses.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::transfer_job::lock;

/// Counts disk reads queued or running; writers wait for it to reach zero.
#[derive(Debug, Default)]
pub(crate) struct DiskIoGate {
    reads: Mutex<usize>,
    idle: Condvar,
}

impl DiskIoGate {
    /// Registers `n` reads about to be queued; they are counted out one by one, or all at
    /// once when the returned guard drops.
    pub(crate) fn reads(self: &Arc<Self>, n: usize) -> PendingReads {
        *lock(&self.reads) += n;
        PendingReads {
            gate: Arc::clone(self),
            left: AtomicUsize::new(n),
        }
    }

    fn finished(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut r = lock(&self.reads);
        *r = r.saturating_sub(n);
        if *r == 0 {
            self.idle.notify_all();
        }
    }

    /// Blocks while reads are pending, until `deadline` at the latest.
    pub(crate) fn wait_for_reads(&self, deadline: Instant) {
        let mut r = lock(&self.reads);
        while *r > 0 {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            r = self
                .idle
                .wait_timeout(r, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Reads pending now.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        *lock(&self.reads)
    }
}

/// Reads one job registered; whatever it did not count out is counted out when it drops (a
/// cancelled or discarded job).
#[derive(Debug)]
pub(crate) struct PendingReads {
    gate: Arc<DiskIoGate>,
    left: AtomicUsize,
}

impl PendingReads {
    /// One read finished (or was skipped).
    pub(crate) fn one_done(&self) {
        if self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| l.checked_sub(1))
            .is_ok()
        {
            self.gate.finished(1);
        }
    }
}

impl Drop for PendingReads {
    fn drop(&mut self) {
        self.gate.finished(self.left.swap(0, Ordering::AcqRel));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn writers_wait_for_reads_and_never_past_the_deadline() {
        let gate = Arc::new(DiskIoGate::default());
        let reads = gate.reads(2);
        let g = Arc::clone(&gate);
        let waiter = std::thread::spawn(move || {
            g.wait_for_reads(Instant::now() + Duration::from_secs(30));
            g.pending()
        });
        reads.one_done();
        reads.one_done();
        assert_eq!(waiter.join().unwrap(), 0, "released when the reads were done");
        // A dropped job counts its remaining reads out.
        let reads = gate.reads(5);
        reads.one_done();
        drop(reads);
        assert_eq!(gate.pending(), 0);
        // With reads pending forever, the deadline still lets the writer through.
        let _stuck = gate.reads(1);
        gate.wait_for_reads(Instant::now());
        assert_eq!(gate.pending(), 1);
    }
}
