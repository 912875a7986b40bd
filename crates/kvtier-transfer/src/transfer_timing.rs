//! Timing records of transfers, kept by the workers that do the copies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When and how long one transfer (one request, one direction) copied.
///
/// The seed benchmark's figures derive from it: span = first copy started → last copy
/// finished; active sum = the sum of the copies' own durations (over all threads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferTiming {
    /// When the request was accepted by its queue.
    pub submitted: Instant,
    /// When the first copy of the request started (`None` if nothing was copied).
    pub first_copy_start: Option<Instant>,
    /// When the last copy of the request finished (`None` if nothing was copied).
    pub last_copy_end: Option<Instant>,
    /// Sum of the durations of the request's copies, across all worker threads.
    pub active: Duration,
    /// Number of copy calls (each covers one or more block-layers).
    pub copy_calls: u64,
}

impl TransferTiming {
    /// First copy started → last copy finished (zero if nothing was copied).
    pub fn span(&self) -> Duration {
        match (self.first_copy_start, self.last_copy_end) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        }
    }
    /// Submission → last copy finished (zero if nothing was copied).
    pub fn latency(&self) -> Duration {
        self.last_copy_end
            .map_or(Duration::ZERO, |e| e.saturating_duration_since(self.submitted))
    }
}

/// Lock-free accumulation of a [`TransferTiming`] by several workers.
#[derive(Debug)]
pub(crate) struct TimingRecorder {
    epoch: Instant,
    submitted: Instant,
    first_start_ns: AtomicU64,
    last_end_ns: AtomicU64,
    active_ns: AtomicU64,
    copy_calls: AtomicU64,
}

impl TimingRecorder {
    pub(crate) fn new(submitted: Instant) -> Self {
        Self {
            epoch: submitted,
            submitted,
            first_start_ns: AtomicU64::new(u64::MAX),
            last_end_ns: AtomicU64::new(0),
            active_ns: AtomicU64::new(0),
            copy_calls: AtomicU64::new(0),
        }
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Records one copy call that ran from `start` to `end`.
    pub(crate) fn record(&self, start: Instant, end: Instant) {
        let (s, e) = (self.ns(start), self.ns(end));
        self.first_start_ns.fetch_min(s, Ordering::Relaxed);
        self.last_end_ns.fetch_max(e, Ordering::Relaxed);
        self.active_ns.fetch_add(e.saturating_sub(s), Ordering::Relaxed);
        self.copy_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> TransferTiming {
        let first = self.first_start_ns.load(Ordering::Relaxed);
        let calls = self.copy_calls.load(Ordering::Relaxed);
        let at = |ns: u64| self.epoch + Duration::from_nanos(ns);
        TransferTiming {
            submitted: self.submitted,
            first_copy_start: (calls > 0 && first != u64::MAX).then(|| at(first)),
            last_copy_end: (calls > 0).then(|| at(self.last_end_ns.load(Ordering::Relaxed))),
            active: Duration::from_nanos(self.active_ns.load(Ordering::Relaxed)),
            copy_calls: calls,
        }
    }
}
