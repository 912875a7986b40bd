//! A load's events as they arrive, and everything a finished load reported.

use kvtier_core::BlockKey;
use kvtier_proto::proto;

use crate::{ClientError, LoadDone, LoadEvent};

/// Everything a load reported.
#[derive(Debug, Clone, Default)]
pub struct LoadOutcome {
    /// Layers announced ready, in order.
    pub layers_ready: Vec<u32>,
    /// Blocks announced missing before the layers (disk reads that failed).
    pub missing_announced: Vec<BlockKey>,
    /// The final report.
    pub done: LoadDone,
}

/// A load's events as they arrive ([`Client::load`]), decoded: keys unpacked, timings as
/// [`WireTiming`].
///
/// Dropping it before [`LoadEvent::Done`] cancels the load: the sidecar sees the stream go
/// away, skips the copies that have not started and releases the load's pins. Copies already
/// running finish, so the load's slots may be partly written: treat them as garbage.
#[derive(Debug)]
pub struct LoadStream {
    pub(crate) events: tonic::Streaming<proto::LoadEvent>,
}

impl LoadStream {
    /// The next event; `None` when the stream has ended (after [`LoadEvent::Done`], or early:
    /// a sidecar that went away mid-load ends the stream without a report). Messages with no
    /// event set (an event kind newer than this client) are skipped. Waits on the network;
    /// allocates the keys of `Missing` and `Done`.
    ///
    /// # Errors
    /// The sidecar's status (`DEADLINE_EXCEEDED` when the load's deadline passed, …);
    /// [`ClientError::Proto`] for an event that does not decode.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the returned future (in a `select!`, a timeout) loses no event;
    /// the next call returns it. Only dropping the [`LoadStream`] cancels the load.
    pub async fn next(&mut self) -> Result<Option<LoadEvent>, ClientError> {
        while let Some(m) = self.events.message().await? {
            if let Some(e) = LoadEvent::from_proto(m)? {
                return Ok(Some(e));
            }
        }
        Ok(None)
    }
}
