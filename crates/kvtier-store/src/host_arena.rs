//! The host arena: one shared-memory mapping cut into equal pages of one block each.

use std::path::Path;

use kvtier_core::KvGeometry;

use crate::StoreError;
use crate::shm_region::{Prefault, ShmRegion};

/// Pages are aligned to 4 KiB so that a page can be read from or written to disk with O_DIRECT.
pub const PAGE_ALIGN: usize = 4096;

/// Most pages one arena indexes (page ids are `u32`, one value is reserved).
const MAX_PAGES: u64 = u32::MAX as u64 - 1;

/// What memory an arena is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaBacking<'a> {
    /// Process-private anonymous memory.
    Private,
    /// An anonymous memfd (shareable by passing its descriptor).
    Memfd,
    /// A new file at this path (e.g. under `/dev/shm`), removed when the arena drops.
    File(&'a Path),
}

/// Index of a page in the host arena (one block per page).
pub type PageId = u32;

/// A memory region of `num_pages` pages; page `p` holds one block of every layer,
/// layer-major (`[layer][K|V][token][head][dim]`), so each (block, layer) is one contiguous
/// range and one copy.
#[derive(Debug)]
pub struct HostArena {
    region: ShmRegion,
    geometry: KvGeometry,
    page_stride: usize,
    num_pages: u32,
}

impl HostArena {
    /// Maps an arena of at most `capacity_bytes` (rounded down to whole pages) and prefaults it.
    ///
    /// # Errors
    /// [`StoreError::CapacityTooSmall`] when not even one page fits,
    /// [`StoreError::CapacityTooLarge`] past 2^32 pages, or the mapping's errors.
    pub fn new(
        geometry: KvGeometry,
        capacity_bytes: u64,
        backing: ArenaBacking<'_>,
        prefault: Prefault,
    ) -> Result<Self, StoreError> {
        let page_stride = geometry.bytes_per_block().next_multiple_of(PAGE_ALIGN);
        let pages = capacity_bytes / page_stride as u64;
        if pages == 0 {
            return Err(StoreError::CapacityTooSmall {
                capacity_bytes,
                page_bytes: page_stride as u64,
            });
        }
        if pages > MAX_PAGES {
            return Err(StoreError::CapacityTooLarge {
                capacity_bytes,
                pages,
                max_pages: MAX_PAGES,
            });
        }
        let len = usize::try_from(pages * page_stride as u64).map_err(|_| StoreError::CapacityTooLarge {
            capacity_bytes,
            pages,
            max_pages: MAX_PAGES,
        })?;
        let region = match backing {
            ArenaBacking::File(p) => ShmRegion::create_file(p, len, prefault)?,
            ArenaBacking::Memfd => ShmRegion::create_anonymous("kvtier-host-arena", len, prefault)?,
            ArenaBacking::Private => ShmRegion::create_private("kvtier-host-arena", len, prefault)?,
        };
        Ok(Self {
            region,
            geometry,
            page_stride,
            num_pages: pages as u32,
        })
    }

    /// The mapping (for copies to and from device pools and disk).
    pub fn region(&self) -> &ShmRegion {
        &self.region
    }

    /// The geometry every page follows.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Number of pages.
    pub fn num_pages(&self) -> u32 {
        self.num_pages
    }

    /// Distance between pages: one block, rounded up to 4 KiB.
    pub fn page_stride(&self) -> usize {
        self.page_stride
    }

    /// Byte offset of the start of `page`.
    pub fn page_offset(&self, page: PageId) -> usize {
        page as usize * self.page_stride
    }

    /// Byte range `(offset, len)` of `layer` of `page`.
    ///
    /// # Errors
    /// [`StoreError::LayerOutOfRange`] for a layer past the geometry.
    pub fn layer_range(&self, page: PageId, layer: u32) -> Result<(usize, usize), StoreError> {
        if layer >= self.geometry.layers() {
            return Err(StoreError::LayerOutOfRange {
                layer,
                layers: self.geometry.layers(),
            });
        }
        let bl = self.geometry.bytes_per_block_layer();
        Ok((self.page_offset(page) + layer as usize * bl, bl))
    }
}
