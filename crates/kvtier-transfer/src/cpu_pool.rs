//! The CPU device pool: an engine's KV in shared memory both processes map, in kvtier's own
//! pool file format or in any [`PoolLayout`] the engine registers.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use kvtier_core::{Dtype, KvGeometry, LayoutError, LayoutKind, PoolLayout, xxh3_64};
use kvtier_store::{CopyKind, Prefault, ShmRegion, StoreError};

use crate::{CopyDirection, CopyTicket, DevicePool, SlotCopy, TransferError};

const POOL_MAGIC: &[u8; 8] = b"KVTPOOL\0";
const POOL_VERSION: u32 = 1;
/// Bytes before the first layer: the header, padded so slots stay 4 KiB aligned.
pub const POOL_HEADER_BYTES: usize = 4096;

/// A device pool in shared memory: the CPU stand-in for an engine's HBM.
///
/// kvtier's pool file: a 4 KiB header (magic `KVTPOOL\0`, version, geometry, slot count, all
/// little endian), then per layer `num_slots` block-layers laid out `[slot][K|V][token][head]
/// [dim]`. The engine creates the file; the sidecar opens it by path and checks the header
/// against the geometry the engine registered, so a mismatch is an error, never misread KV.
///
/// A pool registered with a [`PoolLayout`] (vLLM's, SGLang's or any other) is a plain shared
/// memory file, no header: the layout says where each slot's K and V are, and is checked against
/// the file's length.
#[derive(Debug)]
pub struct CpuDevicePool {
    region: ShmRegion,
    geometry: KvGeometry,
    num_slots: u32,
    layout: PoolLayout,
    /// kvtier's pool file (with its header), rather than headerless memory in a layout.
    pool_file: bool,
}

impl CpuDevicePool {
    /// Bytes of kvtier's pool file for `num_slots` slots of `geometry`.
    pub fn file_bytes(geometry: &KvGeometry, num_slots: u32) -> usize {
        POOL_HEADER_BYTES + geometry.layers() as usize * num_slots as usize * geometry.bytes_per_block_layer()
    }

    /// Creates a pool in kvtier's file format: a new file at `path` (the engine side; removed
    /// when the pool drops), or anonymous shared memory for `None` (in-process use). Every page
    /// is touched once.
    ///
    /// # Errors
    /// [`TransferError::NoSlots`]; file errors naming the path (it must not exist yet).
    pub fn create(path: Option<&Path>, geometry: KvGeometry, num_slots: u32) -> Result<Self, TransferError> {
        if num_slots == 0 {
            return Err(TransferError::NoSlots);
        }
        let region = Self::new_region(path, Self::file_bytes(&geometry, num_slots))?;
        region.write(0, &encode_header(&geometry, num_slots))?;
        let layout = PoolLayout::of_kind(LayoutKind::Kvtier, &geometry, num_slots, POOL_HEADER_BYTES as u64);
        Ok(Self::from_region(region, geometry, num_slots, layout, true))
    }

    /// Creates a headerless pool of `bytes` bytes holding `num_slots` slots of `geometry` as
    /// `layout` says (an engine with its own layout, in tests and benchmarks: see
    /// [`PoolLayout::of_kind`]); `path` as for [`CpuDevicePool::create`].
    ///
    /// # Errors
    /// [`TransferError::NoSlots`], [`TransferError::Layout`]; file errors naming the path.
    pub fn create_with_layout(
        path: Option<&Path>,
        geometry: KvGeometry,
        num_slots: u32,
        layout: PoolLayout,
        bytes: usize,
    ) -> Result<Self, TransferError> {
        if num_slots == 0 {
            return Err(TransferError::NoSlots);
        }
        layout.validate(&geometry, num_slots, &[bytes as u64])?;
        let region = Self::new_region(path, bytes)?;
        Ok(Self::from_region(region, geometry, num_slots, layout, false))
    }

    fn new_region(path: Option<&Path>, len: usize) -> Result<ShmRegion, TransferError> {
        Ok(match path {
            Some(p) => ShmRegion::create_file(p, len, Prefault::Touch)?,
            None => ShmRegion::create_anonymous("kvtier-device-pool", len, Prefault::Touch)?,
        })
    }

    /// Opens a pool in kvtier's file format another process created at `path`, which must
    /// hold `num_slots` slots of `geometry` (the sidecar side; the file is left in place on
    /// drop).
    ///
    /// # Errors
    /// [`StoreError::FileNotFound`] (as [`TransferError::Store`]), [`TransferError::NotAPool`],
    /// [`TransferError::GeometryMismatch`], [`TransferError::SlotCountMismatch`], or
    /// [`StoreError::WrongSize`] when the file is not as long as its header says.
    pub fn open(path: &Path, geometry: KvGeometry, num_slots: u32) -> Result<Self, TransferError> {
        let mut header = [0u8; POOL_HEADER_BYTES];
        let mut file = open_file(path)?;
        let mut got = 0;
        while got < header.len() {
            match file.read(&mut header[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) => {
                    return Err(StoreError::Io {
                        op: "read",
                        path: path.to_owned(),
                        source: e,
                    }
                    .into());
                }
            }
        }
        if got < header.len() {
            return Err(TransferError::NotAPool {
                path: path.to_owned(),
                reason: format!("{got} bytes, shorter than the {POOL_HEADER_BYTES}-byte header"),
            });
        }
        let (found, found_slots) = decode_header(&header).map_err(|reason| TransferError::NotAPool {
            path: path.to_owned(),
            reason,
        })?;
        if found != geometry {
            return Err(TransferError::GeometryMismatch {
                expected: geometry,
                actual: found,
            });
        }
        if found_slots != num_slots {
            return Err(TransferError::SlotCountMismatch {
                path: path.to_owned(),
                expected: num_slots,
                actual: found_slots,
            });
        }
        let region = ShmRegion::open_file(path, Self::file_bytes(&geometry, num_slots), Prefault::Populate)?;
        let layout = PoolLayout::of_kind(LayoutKind::Kvtier, &geometry, num_slots, POOL_HEADER_BYTES as u64);
        Ok(Self::from_region(region, geometry, num_slots, layout, true))
    }

    /// Opens a headerless pool another process created at `path`: `num_slots` slots of
    /// `geometry` where `layout` says, inside the file's length (the sidecar side of a pool
    /// registered with a layout).
    ///
    /// # Errors
    /// [`TransferError::NoSlots`], [`TransferError::Layout`] naming the field that does not
    /// fit the file, file errors naming the path.
    pub fn open_with_layout(
        path: &Path,
        geometry: KvGeometry,
        num_slots: u32,
        layout: PoolLayout,
    ) -> Result<Self, TransferError> {
        if num_slots == 0 {
            return Err(TransferError::NoSlots);
        }
        let len = open_file(path)?
            .metadata()
            .map_err(|e| StoreError::Io {
                op: "stat",
                path: path.to_owned(),
                source: e,
            })?
            .len();
        layout
            .validate(&geometry, num_slots, &[len])
            .map_err(|e| LayoutError {
                reason: format!("{} (file {})", e.reason, path.display()),
                ..e
            })?;
        let region = ShmRegion::open_file(path, len as usize, Prefault::Populate)?;
        Ok(Self::from_region(region, geometry, num_slots, layout, false))
    }

    /// A fault or change of this pool's own memory is the pool's error (the engine's to fix);
    /// anything else (the host page's region) stays what it is.
    fn copy_error(&self, e: StoreError) -> TransferError {
        match e {
            StoreError::RegionUnusable { region, reason } if region == self.region.name() => {
                TransferError::PoolUnusable { pool: region, reason }
            }
            e => e.into(),
        }
    }

    fn from_region(
        region: ShmRegion,
        geometry: KvGeometry,
        num_slots: u32,
        layout: PoolLayout,
        pool_file: bool,
    ) -> Self {
        Self {
            pool_file,
            region,
            geometry,
            num_slots,
            layout,
        }
    }

    /// The shared-memory region (the engine reads and writes KV through it).
    pub fn region(&self) -> &ShmRegion {
        &self.region
    }

    /// Whether the pool is kvtier's pool file (a header, then the KV in kvtier's layout), which
    /// registers without a layout; headerless pools register with theirs.
    pub fn is_pool_file(&self) -> bool {
        self.pool_file
    }

    /// The backing file, `None` for anonymous memory.
    pub fn path(&self) -> Option<&Path> {
        self.region.path()
    }

    /// The pieces of block-layer (`slot`, `layer`) in the pool's one buffer.
    /// `(offset, len)` of block-layer (`slot`, `layer`) in [`CpuDevicePool::region`], for a
    /// pool whose V follows K (kvtier's format: the engine's forward pass writes there).
    ///
    /// # Errors
    /// [`TransferError::SlotOutOfRange`], [`StoreError::LayerOutOfRange`], and
    /// [`TransferError::Layout`] for a layer whose K and V are apart.
    pub fn slot_layer_range(&self, slot: u32, layer: u32) -> Result<(usize, usize), TransferError> {
        match self.slot_pieces(slot, layer)?.single() {
            Some(p) => Ok((p.offset as usize, p.len)),
            None => Err(LayoutError {
                field: format!("layout.layers[{layer}]"),
                reason: "K and V are apart: the block-layer is not one range".into(),
            }
            .into()),
        }
    }

    /// Writes one block-layer of KV, given in kvtier's `[K|V]` order, into (`slot`, `layer`),
    /// as the engine's forward pass does.
    ///
    /// # Errors
    /// Range errors; [`StoreError::BufferSize`] if `src` is not one block-layer.
    pub fn write_slot_layer(&self, slot: u32, layer: u32, src: &[u8]) -> Result<(), TransferError> {
        let bl = self.geometry.bytes_per_block_layer();
        if src.len() != bl {
            return Err(StoreError::BufferSize {
                expected_bytes: bl,
                actual_bytes: src.len(),
            }
            .into());
        }
        for p in self.slot_pieces(slot, layer)? {
            self.region.write(p.offset as usize, &src[p.at..p.at + p.len])?;
        }
        Ok(())
    }

    /// Reads one block-layer of KV from (`slot`, `layer`) in kvtier's `[K|V]` order.
    ///
    /// # Errors
    /// Range errors; [`StoreError::BufferSize`] if `dst` is not one block-layer.
    pub fn read_slot_layer(&self, slot: u32, layer: u32, dst: &mut [u8]) -> Result<(), TransferError> {
        let bl = self.geometry.bytes_per_block_layer();
        if dst.len() != bl {
            return Err(StoreError::BufferSize {
                expected_bytes: bl,
                actual_bytes: dst.len(),
            }
            .into());
        }
        for p in self.slot_pieces(slot, layer)? {
            self.region
                .read(p.offset as usize, &mut dst[p.at..p.at + p.len])?;
        }
        Ok(())
    }

    /// Sets every byte of (`slot`, `layer`)'s K and V to `byte`.
    ///
    /// # Errors
    /// Range errors.
    pub fn fill_slot_layer(&self, slot: u32, layer: u32, byte: u8) -> Result<(), TransferError> {
        for p in self.slot_pieces(slot, layer)? {
            self.region.fill(p.offset as usize, p.len, byte)?;
        }
        Ok(())
    }

    /// `xxh3_64` of (`slot`, `layer`) in kvtier's `[K|V]` order (without a copy where V
    /// follows K; a layout with K and V apart copies one block-layer to hash it).
    ///
    /// # Errors
    /// Range errors.
    pub fn slot_layer_xxh3(&self, slot: u32, layer: u32) -> Result<u64, TransferError> {
        match self.slot_pieces(slot, layer)?.single() {
            Some(p) => Ok(self.region.xxh3_64(p.offset as usize, p.len)?),
            None => {
                let mut buf = vec![0u8; self.geometry.bytes_per_block_layer()];
                self.read_slot_layer(slot, layer, &mut buf)?;
                Ok(xxh3_64(&buf))
            }
        }
    }
}

fn open_file(path: &Path) -> Result<File, TransferError> {
    File::open(path).map_err(|e| {
        match e.kind() {
            std::io::ErrorKind::NotFound => StoreError::FileNotFound {
                path: path.to_owned(),
            },
            _ => StoreError::Io {
                op: "open",
                path: path.to_owned(),
                source: e,
            },
        }
        .into()
    })
}

impl DevicePool for CpuDevicePool {
    fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }
    fn num_slots(&self) -> u32 {
        self.num_slots
    }
    fn layout(&self) -> &PoolLayout {
        &self.layout
    }
    fn device_kind(&self) -> &'static str {
        "cpu"
    }
    /// Copies the batch before returning: each block-layer as one [`ShmRegion::copy_ranges`]
    /// (one piece where V follows K; K and V apart, or split per token and head, otherwise).
    fn submit(
        &self,
        direction: CopyDirection,
        layer: u32,
        host: &ShmRegion,
        copies: &[SlotCopy],
    ) -> Result<CopyTicket, TransferError> {
        let to_device = direction == CopyDirection::HostToDevice;
        let (src, dst) = if to_device {
            (host, &self.region)
        } else {
            (&self.region, host)
        };
        for c in copies {
            let ranges = self.slot_pieces(c.slot, layer)?.map(|p| {
                let (slot, page) = (p.offset as usize, c.host_offset + p.at);
                if to_device {
                    (page, slot, p.len)
                } else {
                    (slot, page, p.len)
                }
            });
            ShmRegion::copy_ranges(CopyKind::Streaming, src, dst, ranges).map_err(|e| self.copy_error(e))?;
        }
        Ok(CopyTicket::done())
    }
    fn check_usable(&self) -> Result<(), TransferError> {
        self.region.check_backing().map_err(|e| self.copy_error(e))
    }
}

fn encode_header(g: &KvGeometry, num_slots: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(64);
    h.extend_from_slice(POOL_MAGIC);
    for v in [
        POOL_VERSION,
        POOL_HEADER_BYTES as u32,
        g.layers(),
        g.kv_heads(),
        g.head_dim(),
        g.dtype().code(),
        g.block_tokens(),
        num_slots,
    ] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h
}

fn decode_header(h: &[u8]) -> Result<(KvGeometry, u32), String> {
    if &h[..8] != POOL_MAGIC {
        return Err("bad magic (expected KVTPOOL)".into());
    }
    let word = |i: usize| u32::from_le_bytes([h[8 + 4 * i], h[9 + 4 * i], h[10 + 4 * i], h[11 + 4 * i]]);
    if word(0) != POOL_VERSION {
        return Err(format!(
            "format version {} (this kvtier reads {POOL_VERSION})",
            word(0)
        ));
    }
    if word(1) as usize != POOL_HEADER_BYTES {
        return Err(format!("header size {} (expected {POOL_HEADER_BYTES})", word(1)));
    }
    let dtype = Dtype::from_code(word(5)).ok_or_else(|| format!("unknown dtype code {}", word(5)))?;
    let g = KvGeometry::new(word(2), word(3), word(4), dtype, word(6)).map_err(|e| e.to_string())?;
    Ok((g, word(7)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> KvGeometry {
        KvGeometry::new(3, 2, 8, Dtype::F16, 4).unwrap()
    }

    /// The sample header published in docs/api.md is what kvtier writes (and the page says so).
    #[test]
    fn the_documented_sample_header_is_what_kvtier_writes() {
        let g = KvGeometry::new(48, 4, 128, Dtype::Bf16, 64).unwrap();
        let hex: Vec<String> = encode_header(&g, 1024)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let sample = hex.join(" ");
        assert_eq!(
            sample,
            "4b 56 54 50 4f 4f 4c 00 01 00 00 00 00 10 00 00 30 00 00 00 04 00 00 00 80 00 00 00 03 00 00 00 40 00 00 00 00 04 00 00"
        );
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api.md")).unwrap();
        assert!(
            doc.contains(&sample),
            "docs/api.md's sample header is out of date"
        );
        assert_eq!(CpuDevicePool::file_bytes(&g, 1024), 6_442_455_040);
        assert_eq!(decode_header(&encode_header(&g, 1024)), Ok((g, 1024)));
    }

    #[test]
    fn the_engine_creates_and_the_sidecar_opens_by_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let engine = CpuDevicePool::create(Some(&path), geo(), 5).unwrap();
        let kv: Vec<u8> = (0..256).map(|i| i as u8).collect();
        engine.write_slot_layer(4, 2, &kv).unwrap();
        let sidecar = CpuDevicePool::open(&path, geo(), 5).unwrap();
        let mut out = vec![0u8; 256];
        sidecar.read_slot_layer(4, 2, &mut out).unwrap();
        assert_eq!(out, kv);
        assert_eq!(sidecar.slot_layer_range(0, 1).unwrap(), (4096 + 5 * 256, 256));
    }

    #[test]
    fn bad_opens_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let _engine = CpuDevicePool::create(Some(&path), geo(), 5).unwrap();
        let other = KvGeometry::new(3, 2, 8, Dtype::Bf16, 4).unwrap();
        let e = CpuDevicePool::open(&path, other, 5).unwrap_err();
        assert!(matches!(e, TransferError::GeometryMismatch { .. }), "{e}");
        assert!(
            e.to_string().contains("dtype=bf16") && e.to_string().contains("dtype=f16"),
            "{e}"
        );
        let e = CpuDevicePool::open(&path, geo(), 6).unwrap_err();
        assert!(
            matches!(
                e,
                TransferError::SlotCountMismatch {
                    expected: 6,
                    actual: 5,
                    ..
                }
            ),
            "{e}"
        );
        let e = CpuDevicePool::open(&dir.path().join("missing"), geo(), 5).unwrap_err();
        assert!(
            matches!(e, TransferError::Store(StoreError::FileNotFound { .. })),
            "{e}"
        );
        let junk = dir.path().join("junk");
        std::fs::write(&junk, vec![1u8; 8192]).unwrap();
        let e = CpuDevicePool::open(&junk, geo(), 5).unwrap_err();
        assert!(matches!(e, TransferError::NotAPool { .. }), "{e}");
        std::fs::write(&junk, b"short").unwrap();
        assert!(matches!(
            CpuDevicePool::open(&junk, geo(), 5),
            Err(TransferError::NotAPool { .. })
        ));
        // A valid header on a truncated file.
        let mut header = encode_header(&geo(), 5);
        header.resize(POOL_HEADER_BYTES + 100, 0);
        std::fs::write(&junk, &header).unwrap();
        let e = CpuDevicePool::open(&junk, geo(), 5).unwrap_err();
        assert!(
            matches!(e, TransferError::Store(StoreError::WrongSize { .. })),
            "{e}"
        );
        assert!(matches!(
            CpuDevicePool::create(None, geo(), 0),
            Err(TransferError::NoSlots)
        ));
    }

    #[test]
    fn out_of_range_slots_and_layers_are_errors() {
        let pool = CpuDevicePool::create(None, geo(), 2).unwrap();
        assert!(matches!(
            pool.slot_layer_range(2, 0),
            Err(TransferError::SlotOutOfRange {
                slot: 2,
                num_slots: 2
            })
        ));
        assert!(matches!(
            pool.slot_layer_range(0, 3),
            Err(TransferError::Store(StoreError::LayerOutOfRange {
                layer: 3,
                layers: 3
            }))
        ));
        assert!(pool.write_slot_layer(0, 0, &[0u8; 7]).is_err());
    }
    /// Each named layout puts a slot's K and V where that engine's own tensor indexing does.
    #[test]
    fn layouts_put_kv_where_each_engine_indexes_it() {
        let g = geo(); // 3 layers, 4 tokens × 2 heads × 8 dim × f16: K (or V) of a slot 128 bytes
        let (n, half) = (5u32, 128usize);
        for kind in [
            LayoutKind::Vllm,
            LayoutKind::VllmLbnhc,
            LayoutKind::VllmLbhnc,
            LayoutKind::Sglang,
        ] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("pool");
            let bytes = PoolLayout::kind_bytes(&g, n, 0) as usize;
            let engine = CpuDevicePool::create_with_layout(
                Some(&path),
                g,
                n,
                PoolLayout::of_kind(kind, &g, n, 0),
                bytes,
            )
            .unwrap();
            let kv: Vec<u8> = (0..2 * half).map(|i| (i * 7 + 1) as u8).collect();
            engine.write_slot_layer(3, 2, &kv).unwrap();
            let mut raw = vec![0u8; bytes];
            engine.region().read(0, &mut raw).unwrap();
            // The engine's element offset of (K or V, token, head) of layer l, slot s, from its
            // tensor shapes; each head is 8 elements of 2 bytes.
            let (l, s, n, tokens, heads, dim) = (2usize, 3usize, n as usize, 4usize, 2usize, 8usize);
            let elem = |v: usize, t: usize, h: usize| match kind {
                // per layer [2, num_blocks, block_size, heads, dim], layers stacked
                LayoutKind::Vllm => ((((l * 2 + v) * n + s) * tokens + t) * heads + h) * dim,
                // per layer [num_blocks, block_size, heads, K‖V]
                LayoutKind::VllmLbnhc => (((l * n + s) * tokens + t) * heads + h) * 2 * dim + v * dim,
                // per layer [num_blocks, heads, block_size, K‖V]
                LayoutKind::VllmLbhnc => (((l * n + s) * heads + h) * tokens + t) * 2 * dim + v * dim,
                // k_buffer[layer] then v_buffer[layer], each [slots × block_size, heads, dim]
                _ => ((((v * 3 + l) * n + s) * tokens + t) * heads + h) * dim,
            };
            for v in 0..2 {
                for t in 0..tokens {
                    for h in 0..heads {
                        let (e, src) = (elem(v, t, h) * 2, v * half + (t * heads + h) * dim * 2);
                        assert_eq!(
                            &raw[e..e + 2 * dim],
                            &kv[src..src + 2 * dim],
                            "{kind} {v} {t} {h}"
                        );
                    }
                }
            }
            assert_eq!(
                raw.iter().filter(|&&b| b != 0).count(),
                kv.iter().filter(|&&b| b != 0).count()
            );
            // The sidecar opens it with the layout; a copy out gives kvtier's [K|V] order.
            let sidecar =
                CpuDevicePool::open_with_layout(&path, g, 5, PoolLayout::of_kind(kind, &g, 5, 0)).unwrap();
            let host = ShmRegion::create_anonymous("host", 4096, Prefault::Touch).unwrap();
            let copies = [SlotCopy {
                slot: 3,
                host_offset: 512,
            }];
            sidecar
                .submit(CopyDirection::DeviceToHost, 2, &host, &copies)
                .unwrap()
                .wait()
                .unwrap();
            let mut out = vec![0u8; 2 * half];
            host.read(512, &mut out).unwrap();
            assert_eq!(out, kv);
            assert!(matches!(
                sidecar.slot_layer_range(3, 2),
                Err(TransferError::Layout(_))
            ));
            // A layout that needs more than the file: the field and the file are named.
            let e = CpuDevicePool::open_with_layout(&path, g, 6, PoolLayout::of_kind(kind, &g, 6, 0))
                .unwrap_err();
            assert!(
                matches!(&e, TransferError::Layout(l) if l.field.starts_with("layout.layers[") && l.reason.contains("past the end")),
                "{e}"
            );
            assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        }
    }
}
