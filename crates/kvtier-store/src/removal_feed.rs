//! Blocks leaving kvtier, for clients that report them (an engine's `BlockRemoved` KV events):
//! the host tier's evictions of blocks the disk tier does not hold, the disk tier's reclaimed
//! entries the host tier does not hold, and clears. [`crate::TieredStore`] wires the tiers to
//! one feed; each watcher subscribes. Nothing is sent while nobody watches.

use std::fmt;
use std::sync::OnceLock;

use kvtier_core::{BlockKey, NamespaceFingerprint};
use tokio::sync::broadcast;

/// One thing a watcher hears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    /// Block `key` of namespace `ns` is in neither the host nor the disk tier any more.
    Block(NamespaceFingerprint, BlockKey),
    /// A clear removed blocks without naming them.
    Cleared,
}

/// A broadcast of [`Removed`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RemovalFeed {
    tx: broadcast::Sender<Removed>,
}

/// Removals a watcher may fall behind by before it hears it lagged.
const BACKLOG: usize = 1 << 16;

impl RemovalFeed {
    /// An empty feed.
    pub fn new() -> Self {
        Self {
            tx: broadcast::channel(BACKLOG).0,
        }
    }

    /// A watcher: it hears every removal from now on, or `Lagged` if it falls more than 65,536
    /// behind.
    pub fn subscribe(&self) -> broadcast::Receiver<Removed> {
        self.tx.subscribe()
    }

    /// Whether anyone watches (the hooks skip their lookups otherwise).
    pub(crate) fn watched(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    /// Tells the watchers, if any.
    pub(crate) fn send(&self, removed: Removed) {
        if self.watched() {
            let _ = self.tx.send(removed);
        }
    }
}

impl Default for RemovalFeed {
    fn default() -> Self {
        Self::new()
    }
}

/// What a tier calls for each block it drops: the host tier once its allocation lock is gone,
/// the disk tier under its region lock (so it must be quick and must not call back into the
/// disk tier).
pub(crate) type DropHook = Box<dyn Fn(NamespaceFingerprint, BlockKey) + Send + Sync>;

/// A tier's [`DropHook`], set once.
#[derive(Default)]
pub(crate) struct HookSlot(OnceLock<DropHook>);

impl HookSlot {
    /// Sets the hook (a second call keeps the first).
    pub(crate) fn set(&self, hook: DropHook) {
        let _ = self.0.set(hook);
    }

    /// Calls the hook, if set.
    pub(crate) fn call(&self, ns: NamespaceFingerprint, key: BlockKey) {
        if let Some(hook) = self.0.get() {
            hook(ns, key);
        }
    }
}

impl fmt::Debug for HookSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "HookSlot(set)"
        } else {
            "HookSlot(unset)"
        })
    }
}
