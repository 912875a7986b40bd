//! The session with the sidecar: opened on connect, kept open by a task that reads its
//! heartbeats, ended (the sidecar releases the session's pins and pools) when the task stops.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvtier_core::KvGeometry;
use kvtier_proto::geometry_from_proto;
use kvtier_proto::proto;

use crate::{ClientError, Stub};

/// The task that keeps the session stream open.
#[derive(Debug)]
pub(crate) struct SessionTask(tokio::task::JoinHandle<()>);

impl Drop for SessionTask {
    fn drop(&mut self) {
        // Ends the session stream: the sidecar releases this session's pins and pools.
        self.0.abort();
    }
}

/// An open session: its id, the geometry the sidecar serves, and the task holding it open.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) id: u64,
    pub(crate) geometry: KvGeometry,
    pub(crate) task: SessionTask,
    /// Cleared when the session stream ends (the sidecar stopped, restarted or dropped it).
    pub(crate) open: Arc<AtomicBool>,
}

/// Opens a session on `rpc` and spawns the task that keeps it open.
///
/// # Cancel safety
/// Dropping the future before it resolves drops the session stream: a session the sidecar
/// had already opened ends with it.
pub(crate) async fn open(rpc: &mut Stub, client_name: &str) -> Result<Session, ClientError> {
    let mut events = rpc
        .open_session(proto::OpenSessionRequest {
            client_name: client_name.to_owned(),
            watch_removals: false,
        })
        .await?
        .into_inner();
    let first = events
        .message()
        .await?
        .and_then(|e| e.event)
        .ok_or_else(|| ClientError::Protocol("the session stream ended before it opened".into()))?;
    let proto::session_event::Event::Opened(opened) = first else {
        return Err(ClientError::Protocol(
            "the session stream did not start with Opened".into(),
        ));
    };
    let geometry = geometry_from_proto(opened.geometry.as_ref())?;
    // Keep the session stream open (heartbeats) for the client's lifetime.
    let open = Arc::new(AtomicBool::new(true));
    let flag = Arc::clone(&open);
    let task = tokio::spawn(async move {
        while let Ok(Some(_)) = events.message().await {}
        flag.store(false, Ordering::Release);
        tracing::debug!("kvtier session stream ended");
    });
    Ok(Session {
        id: opened.session_id,
        geometry,
        task: SessionTask(task),
        open,
    })
}
