//! The host-memory tier: index, two-phase inserts, pins and eviction over a [`HostArena`].
//!
//! Concurrency protocol (the reason each lock exists):
//! - The index (`DashMap` key → page) is what matches and pins read; a pin increments the page's
//!   count while holding the index shard's read lock, and eviction removes the index entry under
//!   the shard's write lock only if the count is still zero. So a pinned page is never evicted,
//!   and a page is never pinned after its eviction started.
//! - Everything that changes which pages exist (allocation, commit, eviction, removal) runs under
//!   one allocation mutex, which also owns the eviction policy and the parent/child links. Lock
//!   order: allocation mutex, then index shard; never the reverse.
//! - A page becomes visible to matches and pins only when its writer commits (state `READY`), so
//!   no reader ever sees a half-written block.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use kvtier_core::{BlockKey, ByteSize, KvGeometry, NamespaceFingerprint};
use serde::{Deserialize, Serialize};

use crate::StoreError;
use crate::eviction::{EvictionKind, EvictionPolicy};
use crate::host_arena::{ArenaBacking, HostArena, PageId};
use crate::key_hasher::KeyHasherBuilder;
use crate::removal_feed::{DropHook, HookSlot};
use crate::shm_region::{Prefault, ShmRegion};

const FREE: u8 = 0;
const WRITING: u8 = 1;
const READY: u8 = 2;

/// Configuration of a host tier (plain data; defaults documented per field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HostTierConfig {
    /// Bytes of shared memory for block pages (default `4GiB`), rounded down to whole pages.
    pub capacity: ByteSize,
    /// File to back the arena (e.g. under `/dev/shm`), making it shareable; `None` (default)
    /// uses `backing` (`"off"` in TOML).
    #[serde(with = "kvtier_core::optional_setting")]
    pub shm_path: Option<PathBuf>,
    /// Memory of the arena when `shm_path` is not set (default `private`).
    pub backing: HostBacking,
    /// Eviction policy (default `s3fifo`).
    pub eviction: EvictionKind,
    /// Touch every page at start-up so no transfer pays first-touch faults (default `true`).
    pub prefault: bool,
}

impl Default for HostTierConfig {
    fn default() -> Self {
        Self {
            capacity: ByteSize::gib(4),
            shm_path: None,
            backing: HostBacking::default(),
            eviction: EvictionKind::default(),
            prefault: true,
        }
    }
}

/// Memory of the host arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostBacking {
    /// Process-private anonymous memory. The default: only kvtier maps its host arena, and
    /// O_DIRECT disk reads into private memory ran ~30% faster than into shared memory here
    /// (1.45 against 1.1 GiB/s with 4 reads in flight).
    #[default]
    Private,
    /// An anonymous memfd: shared memory another process could map through its descriptor.
    Memfd,
}

type Index = DashMap<BlockKey, PageId, KeyHasherBuilder>;

/// Per-page state read without the allocation lock.
#[derive(Debug, Default)]
struct PageMeta {
    state: AtomicU8,
    pins: AtomicU32,
    /// Matches that found the block since it became resident (the disk admission filter).
    hits: AtomicU32,
    key: [AtomicU64; 2],
    ns: [AtomicU64; 2],
}

fn split(v: u128) -> [u64; 2] {
    [v as u64, (v >> 64) as u64]
}

impl PageMeta {
    fn key(&self) -> BlockKey {
        BlockKey(
            u128::from(self.key[0].load(Ordering::Relaxed))
                | u128::from(self.key[1].load(Ordering::Relaxed)) << 64,
        )
    }
    fn ns(&self) -> NamespaceFingerprint {
        NamespaceFingerprint(
            u128::from(self.ns[0].load(Ordering::Relaxed))
                | u128::from(self.ns[1].load(Ordering::Relaxed)) << 64,
        )
    }
    fn set_identity(&self, ns: NamespaceFingerprint, key: BlockKey) {
        let [k0, k1] = split(key.0);
        let [n0, n1] = split(ns.0);
        self.key[0].store(k0, Ordering::Relaxed);
        self.key[1].store(k1, Ordering::Relaxed);
        self.ns[0].store(n0, Ordering::Relaxed);
        self.ns[1].store(n1, Ordering::Relaxed);
    }
    fn holds(&self, ns: NamespaceFingerprint, key: BlockKey) -> bool {
        self.state.load(Ordering::Acquire) == READY && self.key() == key && self.ns() == ns
    }
}

/// Parent/child bookkeeping, under the allocation lock. A page whose block is the prefix of
/// another resident block (`children > 0`) is not evicted: suffixes go before their prefixes.
#[derive(Debug, Clone, Copy, Default)]
struct Link {
    /// Parent page and the parent's generation when the link was made.
    parent: Option<(PageId, u32)>,
    children: u32,
    /// Bumped every time the page is freed, so stale links from children are ignored.
    generation: u32,
}

#[derive(Debug)]
struct AllocState {
    free: Vec<PageId>,
    policy: Box<dyn EvictionPolicy>,
    links: Vec<Link>,
}

#[derive(Debug, Default)]
struct Counters {
    inserts: AtomicU64,
    evictions: AtomicU64,
    removals: AtomicU64,
    aborted_writes: AtomicU64,
    lookups: AtomicU64,
    hits: AtomicU64,
    no_space: AtomicU64,
}

/// A [`HostTier`] that is not kept alive by this reference.
#[derive(Debug, Clone)]
pub(crate) struct WeakHostTier(std::sync::Weak<Inner>);

impl WeakHostTier {
    /// The tier, while it lives.
    pub(crate) fn upgrade(&self) -> Option<HostTier> {
        self.0.upgrade().map(|inner| HostTier { inner })
    }
}

#[derive(Debug)]
struct Inner {
    /// Notified whenever a written page is committed or abandoned (see `pin_waiting`).
    settled: (Mutex<()>, Condvar),
    arena: HostArena,
    index: Index,
    meta: Box<[PageMeta]>,
    alloc: Mutex<AllocState>,
    counters: Counters,
    /// Told of each block evicted (see `TieredStore`'s removal feed).
    on_evict: HookSlot,
}

/// A snapshot of a host tier's counters and gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostTierStats {
    /// Pages in the arena.
    pub capacity_pages: u32,
    /// Bytes one page occupies (one block, 4 KiB aligned).
    pub page_bytes: u64,
    /// Pages holding a committed block or being written.
    pub used_pages: u32,
    /// Pages holding a committed block.
    pub resident_blocks: u64,
    /// Pages with at least one pin.
    pub pinned_pages: u32,
    /// Blocks committed since start.
    pub inserts_total: u64,
    /// Blocks evicted to make room.
    pub evictions_total: u64,
    /// Blocks removed on request (clear, remove).
    pub removals_total: u64,
    /// Reservations abandoned before commit.
    pub aborted_writes_total: u64,
    /// Keys looked up by matches.
    pub lookups_total: u64,
    /// Keys matched.
    pub hits_total: u64,
    /// Reservations refused because no page could be freed.
    pub no_space_total: u64,
}

/// Result of [`HostTier::reserve`].
#[derive(Debug)]
pub enum Reservation {
    /// A page is reserved for the block: write every layer, then [`PageWriter::commit`].
    Writer(PageWriter),
    /// The block is already resident; nothing to write.
    AlreadyStored,
    /// Another writer is storing the same block right now.
    InFlight,
}

/// What [`HostTier::remove`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// The block was removed and its page freed.
    Removed,
    /// The block was not resident (in this namespace).
    Absent,
    /// The block is pinned by a transfer or a user pin and was kept.
    Pinned,
}

/// The host-memory tier. Cheap to clone (an `Arc`).
#[derive(Debug, Clone)]
pub struct HostTier {
    inner: Arc<Inner>,
}

impl HostTier {
    /// Maps and prefaults the arena and builds an empty tier.
    ///
    /// Cost: allocates `capacity` bytes of shared memory and, with `prefault`, writes one byte
    /// per 4 KiB page of it (a few hundred milliseconds per GiB).
    ///
    /// # Errors
    /// [`StoreError::CapacityTooSmall`] when one block does not fit; mapping errors naming the
    /// path.
    pub fn new(geometry: KvGeometry, config: &HostTierConfig) -> Result<Self, StoreError> {
        let prefault = if config.prefault {
            Prefault::Touch
        } else {
            Prefault::Lazy
        };
        let backing = match (&config.shm_path, config.backing) {
            (Some(p), _) => ArenaBacking::File(p),
            (None, HostBacking::Private) => ArenaBacking::Private,
            (None, HostBacking::Memfd) => ArenaBacking::Memfd,
        };
        let arena = HostArena::new(geometry, config.capacity.bytes(), backing, prefault)?;
        let pages = arena.num_pages();
        let meta = (0..pages).map(|_| PageMeta::default()).collect();
        // Pop from the end: hand out low page numbers first.
        let free = (0..pages).rev().collect();
        tracing::info!(
            capacity_bytes = arena.region().len(),
            pages,
            page_bytes = arena.page_stride(),
            backing = arena.region().name(),
            eviction = ?config.eviction,
            "host tier ready"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                index: Index::with_capacity_and_hasher(pages as usize, Default::default()),
                meta,
                alloc: Mutex::new(AllocState {
                    free,
                    policy: config.eviction.build(pages),
                    links: vec![Link::default(); pages as usize],
                }),
                counters: Counters::default(),
                settled: (Mutex::new(()), Condvar::new()),
                arena,
                on_evict: HookSlot::default(),
            }),
        })
    }

    /// The geometry of every block in this tier.
    pub fn geometry(&self) -> &KvGeometry {
        self.inner.arena.geometry()
    }

    /// The arena's shared-memory region (source and destination of every host copy).
    pub fn region(&self) -> &ShmRegion {
        self.inner.arena.region()
    }

    /// Number of pages (= blocks the tier can hold).
    pub fn capacity_pages(&self) -> u32 {
        self.inner.arena.num_pages()
    }

    /// Reserves a page for block `key` of namespace `ns`, whose prefix block is `parent`
    /// (`None` for the first block of a sequence). Evicts if no page is free.
    ///
    /// Cost: O(1) amortized under the allocation lock; no bytes are copied.
    ///
    /// # Errors
    /// [`StoreError::NoSpace`] when every page is pinned, being written, or a prefix of a
    /// resident block.
    pub fn reserve(
        &self,
        ns: NamespaceFingerprint,
        key: BlockKey,
        parent: Option<BlockKey>,
    ) -> Result<Reservation, StoreError> {
        let inner = &self.inner;
        if let Some(r) = self.existing(key) {
            return Ok(r);
        }
        let mut st = inner.lock_alloc();
        // The block evicted for this page, if any: the hook hears of it once the lock is gone.
        let (page, evicted) = match st.free.pop() {
            Some(p) => (p, None),
            None => match inner.evict_one(&mut st) {
                Some((p, gone)) => (p, Some(gone)),
                None => {
                    inner.counters.no_space.fetch_add(1, Ordering::Relaxed);
                    return Err(StoreError::NoSpace {
                        capacity_pages: inner.arena.num_pages(),
                    });
                }
            },
        };
        let meta = &inner.meta[page as usize];
        meta.set_identity(ns, key);
        meta.pins.store(0, Ordering::Relaxed);
        meta.hits.store(0, Ordering::Relaxed);
        meta.state.store(WRITING, Ordering::Release);
        st.links[page as usize].parent = None;
        st.links[page as usize].children = 0;
        let inserted = match inner.index.entry(key) {
            dashmap::Entry::Occupied(_) => false,
            dashmap::Entry::Vacant(v) => {
                v.insert(page);
                true
            }
        };
        // The entry (a write lock on the index shard) is gone here: `existing` below reads
        // that shard, and reading it under the entry deadlocked this thread on itself.
        if inserted {
            drop(st);
            if let Some((ns, gone)) = evicted {
                inner.on_evict.call(ns, gone);
            }
            return Ok(Reservation::Writer(PageWriter::new(
                HostPage::new(Arc::clone(inner), page, key),
                parent,
            )));
        }
        // Raced with another reserve of the same key between the check and the lock.
        meta.state.store(FREE, Ordering::Release);
        st.free.push(page);
        drop(st);
        if let Some((ns, gone)) = evicted {
            inner.on_evict.call(ns, gone);
        }
        Ok(self.existing(key).unwrap_or(Reservation::InFlight))
    }

    fn existing(&self, key: BlockKey) -> Option<Reservation> {
        let page = *self.inner.index.get(&key)?;
        Some(
            match self.inner.meta[page as usize].state.load(Ordering::Acquire) {
                READY => Reservation::AlreadyStored,
                _ => Reservation::InFlight,
            },
        )
    }

    /// The leading run of `keys` that is resident in namespace `ns`, as pages (a hole or a
    /// block still being written ends the run). Marks the matched blocks as used, the prefix
    /// last so that it is the most recently used.
    ///
    /// Cost: one index lookup per key up to the first miss, then one lock to record the use.
    /// Pins nothing: a block may be evicted right after; [`HostTier::pin`] it to load it.
    pub fn match_prefix(&self, ns: NamespaceFingerprint, keys: &[BlockKey]) -> Vec<PageId> {
        self.match_prefix_counting(ns, keys, []).0
    }

    /// [`HostTier::match_prefix`], also returning, for each of `thresholds`, the indices (into
    /// `keys`) of the blocks whose hit count reached exactly that threshold with this match
    /// (0: none) — the blocks a "hit at least N times" admission filter admits now (one
    /// threshold per filter: the disk's and the remote tier's).
    pub fn match_prefix_counting<const N: usize>(
        &self,
        ns: NamespaceFingerprint,
        keys: &[BlockKey],
        thresholds: [u32; N],
    ) -> (Vec<PageId>, [Vec<usize>; N]) {
        let inner = &self.inner;
        let mut pages = Vec::with_capacity(keys.len());
        let mut reached: [Vec<usize>; N] = std::array::from_fn(|_| Vec::new());
        for (i, &key) in keys.iter().enumerate() {
            let Some(page) = inner.index.get(&key).map(|p| *p) else {
                break;
            };
            let meta = &inner.meta[page as usize];
            if !meta.holds(ns, key) {
                break;
            }
            let hits = meta.hits.fetch_add(1, Ordering::Relaxed) + 1;
            for (t, r) in thresholds.iter().zip(reached.iter_mut()) {
                if hits == *t {
                    r.push(i);
                }
            }
            pages.push(page);
        }
        let c = &inner.counters;
        c.lookups.fetch_add(
            (pages.len() + usize::from(pages.len() < keys.len())) as u64,
            Ordering::Relaxed,
        );
        c.hits.fetch_add(pages.len() as u64, Ordering::Relaxed);
        if !pages.is_empty() {
            let mut st = inner.lock_alloc();
            for &p in pages.iter().rev() {
                st.policy.on_access(p);
            }
        }
        (pages, reached)
    }

    /// Like [`HostTier::pin`], but if the block is being written right now (stored from a
    /// device or promoted from disk), waits up to `timeout` for the writer to commit or give up.
    ///
    /// # Blocking
    /// Blocks the calling thread; never call it from an async runtime or a transfer worker.
    pub fn pin_waiting(
        &self,
        ns: NamespaceFingerprint,
        key: BlockKey,
        timeout: Duration,
    ) -> Option<PinnedPage> {
        let deadline = Instant::now() + timeout;
        let inner = &self.inner;
        let mut guard = inner.settled.0.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(p) = self.pin(ns, key) {
                return Some(p);
            }
            let now = Instant::now();
            if !self.is_writing(key) || now >= deadline {
                // The writer may have committed between the failed pin and this check (it
                // publishes before it takes `settled`): one more pin sees that.
                return self.pin(ns, key);
            }
            guard = inner
                .settled
                .1
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether block `key` is being written into a page right now (stored from a device or
    /// promoted from disk): a pin would succeed once the writer commits.
    pub fn is_writing(&self, key: BlockKey) -> bool {
        let inner = &self.inner;
        inner
            .index
            .get(&key)
            .is_some_and(|p| inner.meta[*p as usize].state.load(Ordering::Acquire) == WRITING)
    }

    /// Calls `hook` with each block the tier evicts, after the eviction, outside the tier's
    /// allocation lock (so the hook may look at other tiers, or at this one); by then the
    /// block may be back (set once; a second hook is ignored).
    pub(crate) fn set_eviction_hook(&self, hook: DropHook) {
        self.inner.on_evict.set(hook);
    }

    /// A reference that does not keep the tier alive (for the other tiers' hooks).
    pub(crate) fn downgrade(&self) -> WeakHostTier {
        WeakHostTier(Arc::downgrade(&self.inner))
    }

    /// Whether block `key` of `ns` is resident and readable.
    pub fn contains(&self, ns: NamespaceFingerprint, key: BlockKey) -> bool {
        self.inner
            .index
            .get(&key)
            .is_some_and(|p| self.inner.meta[*p as usize].holds(ns, key))
    }

    /// Pins block `key` of `ns` so it cannot be evicted until the returned guard drops.
    /// `None` if it is not resident (or still being written) in that namespace: the key and
    /// namespace recorded with the page are checked, so a mismatch is a miss, never wrong KV.
    pub fn pin(&self, ns: NamespaceFingerprint, key: BlockKey) -> Option<PinnedPage> {
        let guard = self.inner.index.get(&key)?;
        let page = *guard;
        let meta = &self.inner.meta[page as usize];
        if !meta.holds(ns, key) {
            return None;
        }
        // Incremented under the index shard's read lock: eviction cannot run concurrently.
        meta.pins.fetch_add(1, Ordering::AcqRel);
        drop(guard);
        // The pin just taken is the handle's to release.
        Some(PinnedPage::new(HostPage::new(Arc::clone(&self.inner), page, key)))
    }

    /// Pins every key, or none.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] naming the first key that is not resident.
    pub fn pin_all(
        &self,
        ns: NamespaceFingerprint,
        keys: &[BlockKey],
    ) -> Result<Vec<PinnedPage>, StoreError> {
        keys.iter()
            .map(|&key| {
                self.pin(ns, key)
                    .ok_or(StoreError::NotFound { key, tier: "host" })
            })
            .collect()
    }

    /// Removes block `key` of `ns` unless it is pinned.
    pub fn remove(&self, ns: NamespaceFingerprint, key: BlockKey) -> Removal {
        let inner = &self.inner;
        let mut st = inner.lock_alloc();
        let Some(page) = inner.index.get(&key).map(|p| *p) else {
            return Removal::Absent;
        };
        if !inner.meta[page as usize].holds(ns, key) {
            return Removal::Absent;
        }
        if inner.try_free(&mut st, page, false) {
            st.policy.on_remove(page);
            st.free.push(page);
            inner.counters.removals.fetch_add(1, Ordering::Relaxed);
            Removal::Removed
        } else {
            Removal::Pinned
        }
    }

    /// Removes every unpinned block of namespace `ns` (or of all namespaces for `None`).
    /// Returns `(removed, kept_pinned)`.
    ///
    /// Cost: a walk over every page under the allocation lock.
    pub fn clear(&self, ns: Option<NamespaceFingerprint>) -> (u64, u64) {
        let inner = &self.inner;
        let mut st = inner.lock_alloc();
        let (mut removed, mut kept) = (0, 0);
        for page in 0..inner.arena.num_pages() {
            let meta = &inner.meta[page as usize];
            if meta.state.load(Ordering::Acquire) != READY || ns.is_some_and(|n| meta.ns() != n) {
                continue;
            }
            if inner.try_free(&mut st, page, false) {
                st.policy.on_remove(page);
                st.free.push(page);
                removed += 1;
            } else {
                kept += 1;
            }
        }
        inner.counters.removals.fetch_add(removed, Ordering::Relaxed);
        (removed, kept)
    }

    /// A snapshot of counters and gauges. Cost: a walk over page states (O(pages)).
    pub fn stats(&self) -> HostTierStats {
        let inner = &self.inner;
        let used = inner.arena.num_pages() - inner.lock_alloc().free.len() as u32;
        let (mut resident, mut pinned) = (0u64, 0u32);
        for m in inner.meta.iter() {
            resident += u64::from(m.state.load(Ordering::Relaxed) == READY);
            pinned += u32::from(m.pins.load(Ordering::Relaxed) > 0);
        }
        let c = &inner.counters;
        HostTierStats {
            capacity_pages: inner.arena.num_pages(),
            page_bytes: inner.arena.page_stride() as u64,
            used_pages: used,
            resident_blocks: resident,
            pinned_pages: pinned,
            inserts_total: c.inserts.load(Ordering::Relaxed),
            evictions_total: c.evictions.load(Ordering::Relaxed),
            removals_total: c.removals.load(Ordering::Relaxed),
            aborted_writes_total: c.aborted_writes.load(Ordering::Relaxed),
            lookups_total: c.lookups.load(Ordering::Relaxed),
            hits_total: c.hits.load(Ordering::Relaxed),
            no_space_total: c.no_space.load(Ordering::Relaxed),
        }
    }
}

impl Inner {
    fn notify_settled(&self) {
        let _g = self.settled.0.lock().unwrap_or_else(|e| e.into_inner());
        self.settled.1.notify_all();
    }

    fn lock_alloc(&self) -> MutexGuard<'_, AllocState> {
        // A panic while holding the lock leaves the state consistent at every await-free step
        // boundary we have; keep serving rather than poisoning the whole tier.
        self.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks the policy for a victim and frees it; the page is returned for immediate reuse,
    /// with the block it held (for the eviction hook, which the caller calls once it has let
    /// the allocation lock go).
    fn evict_one(&self, st: &mut AllocState) -> Option<(PageId, (NamespaceFingerprint, BlockKey))> {
        let AllocState { policy, links, .. } = st;
        let page = policy.evict(&mut |p| self.try_free_links(links, p, true))?;
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        // The page is not reused before this returns (the allocation lock is held).
        let meta = &self.meta[page as usize];
        Some((page, (meta.ns(), meta.key())))
    }

    fn try_free(&self, st: &mut AllocState, page: PageId, require_leaf: bool) -> bool {
        self.try_free_links(&mut st.links, page, require_leaf)
    }

    /// Frees `page` if it is committed, unpinned (and a leaf when `require_leaf`): removes it
    /// from the index, unlinks it from its parent. Does not touch the policy or the free list.
    fn try_free_links(&self, links: &mut [Link], page: PageId, require_leaf: bool) -> bool {
        let meta = &self.meta[page as usize];
        if meta.state.load(Ordering::Acquire) != READY
            || meta.pins.load(Ordering::Acquire) != 0
            || (require_leaf && links[page as usize].children != 0)
        {
            return false;
        }
        let key = meta.key();
        // Re-check the pin count under the shard's write lock: a pin holds the read lock.
        let removed = self
            .index
            .remove_if(&key, |_, p| *p == page && meta.pins.load(Ordering::Acquire) == 0)
            .is_some();
        if !removed {
            return false;
        }
        meta.state.store(FREE, Ordering::Release);
        Self::release_links(links, page);
        true
    }

    fn release_links(links: &mut [Link], page: PageId) {
        let link = &mut links[page as usize];
        let parent = link.parent.take();
        link.children = 0;
        link.generation = link.generation.wrapping_add(1);
        if let Some((pp, generation)) = parent {
            let pl = &mut links[pp as usize];
            if pl.generation == generation {
                pl.children = pl.children.saturating_sub(1);
            }
        }
    }
}

mod page_handles;

pub use page_handles::{HostPage, PageWriter, PinnedPage};

#[cfg(test)]
mod tests;
