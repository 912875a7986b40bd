//! Handles on one page of the host tier: [`PinnedPage`] (a pin on a resident block) and
//! [`PageWriter`] (exclusive write access to a reserved page until commit), both reading their
//! page through a [`HostPage`].

use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvtier_core::BlockKey;

use super::{FREE, Inner, READY};
use crate::StoreError;
use crate::host_arena::PageId;
use crate::shm_region::ShmRegion;

/// One page of the host tier and the block it is for: where its bytes are. Reached through a
/// [`PinnedPage`] or a [`PageWriter`], which decide what may be done with it.
#[derive(Debug)]
pub struct HostPage {
    inner: Arc<Inner>,
    page: PageId,
    key: BlockKey,
}

impl HostPage {
    pub(super) fn new(inner: Arc<Inner>, page: PageId, key: BlockKey) -> Self {
        Self { inner, page, key }
    }

    /// The block's key.
    pub fn key(&self) -> BlockKey {
        self.key
    }
    /// The page.
    pub fn page(&self) -> PageId {
        self.page
    }
    /// The arena region the page lives in.
    pub fn region(&self) -> &ShmRegion {
        self.inner.arena.region()
    }
    /// `(offset, len)` of `layer` of this page in [`HostPage::region`].
    ///
    /// # Errors
    /// [`StoreError::LayerOutOfRange`].
    pub fn layer_range(&self, layer: u32) -> Result<(usize, usize), StoreError> {
        self.inner.arena.layer_range(self.page, layer)
    }

    fn pins_add(&self) {
        self.inner.meta[self.page as usize]
            .pins
            .fetch_add(1, Ordering::AcqRel);
    }

    fn another(&self) -> Self {
        Self::new(Arc::clone(&self.inner), self.page, self.key)
    }
}

/// A pin on one resident block: while it lives, the page is neither evicted nor removed.
/// Dropping it releases the pin (so a transfer whose requester vanished releases its pages as
/// soon as the transfer is dropped).
#[derive(Debug)]
pub struct PinnedPage(HostPage);

impl PinnedPage {
    /// Takes over a pin already counted on `page`.
    pub(super) fn new(page: HostPage) -> Self {
        Self(page)
    }

    /// Copies `layer` of the block into `dst` (exactly one block-layer long).
    ///
    /// # Errors
    /// [`StoreError::LayerOutOfRange`], [`StoreError::BufferSize`].
    pub fn read_layer(&self, layer: u32, dst: &mut [u8]) -> Result<(), StoreError> {
        self.region().read_range(self.layer_range(layer)?, dst)
    }
    /// `xxh3_64` of `layer` of the block (verification without a copy).
    ///
    /// # Errors
    /// [`StoreError::LayerOutOfRange`].
    pub fn layer_xxh3(&self, layer: u32) -> Result<u64, StoreError> {
        let (off, len) = self.layer_range(layer)?;
        self.region().xxh3_64(off, len)
    }
}

impl Deref for PinnedPage {
    type Target = HostPage;
    fn deref(&self) -> &HostPage {
        &self.0
    }
}

impl Clone for PinnedPage {
    /// Another pin on the same page.
    fn clone(&self) -> Self {
        self.0.pins_add();
        Self(self.0.another())
    }
}

impl Drop for PinnedPage {
    fn drop(&mut self) {
        self.0.inner.meta[self.0.page as usize]
            .pins
            .fetch_sub(1, Ordering::AcqRel);
    }
}

/// Exclusive write access to a reserved page. The block becomes visible only on
/// [`PageWriter::commit`]; dropping the writer without committing frees the page and forgets
/// the key, so a failed or abandoned store leaves nothing half-written behind.
#[derive(Debug)]
pub struct PageWriter {
    page: HostPage,
    parent: Option<BlockKey>,
    committed: bool,
}

impl PageWriter {
    pub(super) fn new(page: HostPage, parent: Option<BlockKey>) -> Self {
        Self {
            page,
            parent,
            committed: false,
        }
    }

    /// Copies one block-layer from `src` into the page.
    ///
    /// # Errors
    /// [`StoreError::LayerOutOfRange`], [`StoreError::BufferSize`].
    pub fn write_layer(&self, layer: u32, src: &[u8]) -> Result<(), StoreError> {
        self.region().write_range(self.layer_range(layer)?, src)
    }

    /// Publishes the block: from now on matches and pins see it. The caller asserts every layer
    /// was written.
    pub fn commit(mut self) {
        self.publish();
    }

    /// Publishes the block and returns a pin on it, so it cannot be evicted before the caller
    /// uses it (a block promoted from disk on its way to a device).
    pub fn commit_pinned(mut self) -> PinnedPage {
        self.page.pins_add();
        self.publish();
        PinnedPage(self.page.another())
    }

    fn publish(&mut self) {
        let inner = &self.page.inner;
        let mut st = inner.lock_alloc();
        let page = self.page.page;
        if let Some(parent) = self.parent
            && let Some(pp) = inner.index.get(&parent).map(|p| *p)
            && pp != page
            && inner.meta[pp as usize].state.load(Ordering::Acquire) != FREE
        {
            let generation = st.links[pp as usize].generation;
            st.links[pp as usize].children += 1;
            st.links[page as usize].parent = Some((pp, generation));
        }
        inner.meta[page as usize].state.store(READY, Ordering::Release);
        st.policy.on_insert(page, self.page.key);
        inner.counters.inserts.fetch_add(1, Ordering::Relaxed);
        self.committed = true;
        drop(st);
        inner.notify_settled();
    }
}

impl Deref for PageWriter {
    type Target = HostPage;
    fn deref(&self) -> &HostPage {
        &self.page
    }
}

impl Drop for PageWriter {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let inner = &self.page.inner;
        let mut st = inner.lock_alloc();
        let (page, key) = (self.page.page, self.page.key);
        inner.index.remove_if(&key, |_, p| *p == page);
        inner.meta[page as usize].state.store(FREE, Ordering::Release);
        Inner::release_links(&mut st.links, page);
        st.free.push(page);
        inner.counters.aborted_writes.fetch_add(1, Ordering::Relaxed);
        drop(st);
        inner.notify_settled();
    }
}
