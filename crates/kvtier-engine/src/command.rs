//! The calls the [`crate::Engine`] handle sends to the scheduler thread, each with the channel
//! its answer comes back on.

use std::sync::mpsc;
use std::time::Instant;

use kvtier_core::Tier;
use tokio::sync::mpsc::UnboundedSender;

use crate::{EngineError, EngineStats, GenRequest, KvReuse, SeqEvent};

/// A call on the [`crate::Engine`] handle, answered by the scheduler thread.
pub(crate) enum Command {
    Submit(Box<GenRequest>, UnboundedSender<SeqEvent>, Instant),
    Stats(mpsc::Sender<EngineStats>),
    ClearDeviceCache(mpsc::Sender<()>),
    ClearTier(Option<Tier>, mpsc::Sender<Result<(u64, u64), EngineError>>),
    SetReuse(KvReuse, mpsc::Sender<()>),
    SidecarStats(mpsc::Sender<Result<String, EngineError>>),
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Submit(..) => "Submit",
            Command::Stats(_) => "Stats",
            Command::ClearDeviceCache(_) => "ClearDeviceCache",
            Command::ClearTier(..) => "ClearTier",
            Command::SetReuse(..) => "SetReuse",
            Command::SidecarStats(_) => "SidecarStats",
        })
    }
}
