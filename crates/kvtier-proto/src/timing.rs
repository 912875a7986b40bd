//! Transfer timings on the wire.

use std::time::Duration;

use crate::proto;

/// When one transfer copied, relative to when its queue accepted it: what `TransferTiming`
/// carries on the wire (microsecond resolution). The sidecar derives it from its queues'
/// instants (`kvtier_transfer::TransferTiming`); a client places it on its own clock from when
/// it sent the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireTiming {
    /// Accepted → first copy started (zero if nothing was copied).
    pub queue: Duration,
    /// Accepted → last copy finished (zero if nothing was copied).
    pub latency: Duration,
    /// First copy started → last copy finished.
    pub span: Duration,
    /// Sum of the copies' own durations, across worker threads.
    pub active: Duration,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl From<WireTiming> for proto::TransferTiming {
    /// Truncates to whole microseconds (saturating at `u64::MAX` µs).
    fn from(t: WireTiming) -> Self {
        proto::TransferTiming {
            queue_us: micros(t.queue),
            latency_us: micros(t.latency),
            span_us: micros(t.span),
            active_us: micros(t.active),
        }
    }
}

impl From<&proto::TransferTiming> for WireTiming {
    fn from(t: &proto::TransferTiming) -> Self {
        WireTiming {
            queue: Duration::from_micros(t.queue_us),
            latency: Duration::from_micros(t.latency_us),
            span: Duration::from_micros(t.span_us),
            active: Duration::from_micros(t.active_us),
        }
    }
}

impl From<proto::TransferTiming> for WireTiming {
    fn from(t: proto::TransferTiming) -> Self {
        Self::from(&t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_at_microseconds() {
        let t = WireTiming {
            queue: Duration::from_micros(3),
            latency: Duration::from_micros(1_500),
            span: Duration::from_micros(1_497),
            active: Duration::from_micros(2_900),
        };
        let p = proto::TransferTiming::from(t);
        assert_eq!(
            (p.queue_us, p.latency_us, p.span_us, p.active_us),
            (3, 1_500, 1_497, 2_900)
        );
        assert_eq!(WireTiming::from(&p), t);
        // Below a microsecond is truncated, never rounded up.
        let fine = WireTiming {
            queue: Duration::from_nanos(1_999),
            ..t
        };
        assert_eq!(
            WireTiming::from(proto::TransferTiming::from(fine)).queue,
            Duration::from_micros(1)
        );
    }
}
