//! Where a transfer's events go: the channel behind a blocking ticket, or a callback the caller
//! supplies (an async runtime's channel, a completion queue).

use std::fmt;
use std::sync::Arc;
use std::sync::mpsc;

/// A transfer's event destination. The callback runs on a transfer worker thread, once per
/// event, in event order; it must not block (hand the event on and return). Cheap to clone.
pub struct EventSink<E>(Arc<dyn Fn(E) + Send + Sync>);

impl<E> EventSink<E> {
    /// Events are passed to `f`.
    pub fn new(f: impl Fn(E) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Events are sent into `tx` (dropped once its receiver is gone).
    pub fn channel(tx: mpsc::Sender<E>) -> Self
    where
        E: Send + 'static,
    {
        Self::new(move |e| {
            let _ = tx.send(e);
        })
    }

    pub(crate) fn send(&self, e: E) {
        (self.0)(e);
    }
}

impl<E> Clone for EventSink<E> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<E> fmt::Debug for EventSink<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EventSink")
    }
}
