//! Device pools: the engine's paged KV memory, which kvtier copies blocks into and out of.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use kvtier_core::{Dtype, KvGeometry};
use kvtier_store::{Prefault, ShmRegion, StoreError};

use crate::TransferError;

/// The engine's KV memory: per layer, `num_slots` slots of one block each. The engine owns slot
/// allocation; kvtier only copies whole block-layers in and out.
///
/// Implementations: [`CpuDevicePool`] (shared memory both processes map); a CUDA pool registered
/// by IPC handle follows the same contract.
pub trait DevicePool: Send + Sync + fmt::Debug {
    /// The KV geometry of every slot.
    fn geometry(&self) -> &KvGeometry;
    /// Number of slots per layer.
    fn num_slots(&self) -> u32;
    /// Copies one block-layer from `host` at `host_offset` into `slot` of `layer`
    /// (host → device).
    ///
    /// # Errors
    /// [`TransferError::SlotOutOfRange`], a layer or host range out of bounds.
    fn copy_in(
        &self,
        slot: u32,
        layer: u32,
        host: &ShmRegion,
        host_offset: usize,
    ) -> Result<(), TransferError>;
    /// Copies one block-layer from `slot` of `layer` into `host` at `host_offset`
    /// (device → host).
    ///
    /// # Errors
    /// As [`DevicePool::copy_in`].
    fn copy_out(
        &self,
        slot: u32,
        layer: u32,
        host: &ShmRegion,
        host_offset: usize,
    ) -> Result<(), TransferError>;

    /// Checks that the pool's memory is still the memory that was registered (its owner may
    /// have truncated, replaced or freed it). Called before every request on the pool.
    ///
    /// # Errors
    /// [`TransferError::PoolUnusable`] saying what changed.
    fn check_usable(&self) -> Result<(), TransferError>;

    /// Checks that `slot` exists.
    ///
    /// # Errors
    /// [`TransferError::SlotOutOfRange`].
    fn check_slot(&self, slot: u32) -> Result<(), TransferError> {
        if slot >= self.num_slots() {
            return Err(TransferError::SlotOutOfRange {
                slot,
                num_slots: self.num_slots(),
            });
        }
        Ok(())
    }
}

const POOL_MAGIC: &[u8; 8] = b"KVTPOOL\0";
const POOL_VERSION: u32 = 1;
/// Bytes before the first layer: the header, padded so slots stay 4 KiB aligned.
pub const POOL_HEADER_BYTES: usize = 4096;

/// A device pool in shared memory: the CPU stand-in for an engine's HBM.
///
/// File layout: a 4 KiB header (magic `KVTPOOL\0`, version, geometry, slot count, all little
/// endian), then per layer `num_slots` block-layers laid out `[slot][K|V][token][head][dim]`.
/// The engine creates the file; the sidecar opens it by path and checks the header against the
/// geometry the engine registered, so a mismatch is an error, never misread KV.
#[derive(Debug)]
pub struct CpuDevicePool {
    region: ShmRegion,
    geometry: KvGeometry,
    num_slots: u32,
    layer_stride: usize,
}

impl CpuDevicePool {
    /// Bytes of the pool file for `num_slots` slots of `geometry`.
    pub fn file_bytes(geometry: &KvGeometry, num_slots: u32) -> usize {
        POOL_HEADER_BYTES + geometry.layers() as usize * num_slots as usize * geometry.bytes_per_block_layer()
    }

    /// Creates a pool: a new file at `path` (the engine side; removed when the pool drops), or
    /// anonymous shared memory for `None` (in-process use). Every page is touched once.
    ///
    /// # Errors
    /// [`TransferError::NoSlots`]; file errors naming the path (it must not exist yet).
    pub fn create(path: Option<&Path>, geometry: KvGeometry, num_slots: u32) -> Result<Self, TransferError> {
        if num_slots == 0 {
            return Err(TransferError::NoSlots);
        }
        let len = Self::file_bytes(&geometry, num_slots);
        let region = match path {
            Some(p) => ShmRegion::create_file(p, len, Prefault::Touch)?,
            None => ShmRegion::create_anonymous("kvtier-device-pool", len, Prefault::Touch)?,
        };
        region.write(0, &encode_header(&geometry, num_slots))?;
        Ok(Self::from_region(region, geometry, num_slots))
    }

    /// Opens a pool another process created at `path`, which must hold `num_slots` slots of
    /// `geometry` (the sidecar side; the file is left in place on drop).
    ///
    /// # Errors
    /// [`StoreError::FileNotFound`] (as [`TransferError::Store`]), [`TransferError::NotAPool`],
    /// [`TransferError::GeometryMismatch`], [`TransferError::SlotCountMismatch`], or
    /// [`StoreError::WrongSize`] when the file is not as long as its header says.
    pub fn open(path: &Path, geometry: KvGeometry, num_slots: u32) -> Result<Self, TransferError> {
        let mut header = [0u8; POOL_HEADER_BYTES];
        let mut file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => StoreError::FileNotFound {
                path: path.to_owned(),
            },
            _ => StoreError::Io {
                op: "open",
                path: path.to_owned(),
                source: e,
            },
        })?;
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
        Ok(Self::from_region(region, geometry, num_slots))
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

    fn from_region(region: ShmRegion, geometry: KvGeometry, num_slots: u32) -> Self {
        Self {
            layer_stride: num_slots as usize * geometry.bytes_per_block_layer(),
            region,
            geometry,
            num_slots,
        }
    }

    /// The shared-memory region (the engine reads and writes KV through it).
    pub fn region(&self) -> &ShmRegion {
        &self.region
    }

    /// The backing file, `None` for anonymous memory.
    pub fn path(&self) -> Option<&Path> {
        self.region.path()
    }

    /// `(offset, len)` of block-layer (`slot`, `layer`) in [`CpuDevicePool::region`].
    ///
    /// # Errors
    /// [`TransferError::SlotOutOfRange`], [`StoreError::LayerOutOfRange`].
    pub fn slot_layer_range(&self, slot: u32, layer: u32) -> Result<(usize, usize), TransferError> {
        self.check_slot(slot)?;
        if layer >= self.geometry.layers() {
            return Err(StoreError::LayerOutOfRange {
                layer,
                layers: self.geometry.layers(),
            }
            .into());
        }
        let bl = self.geometry.bytes_per_block_layer();
        Ok((
            POOL_HEADER_BYTES + layer as usize * self.layer_stride + slot as usize * bl,
            bl,
        ))
    }

    /// Writes one block-layer of KV into (`slot`, `layer`), as the engine's forward pass does.
    ///
    /// # Errors
    /// Range errors; [`StoreError::BufferSize`] if `src` is not one block-layer.
    pub fn write_slot_layer(&self, slot: u32, layer: u32, src: &[u8]) -> Result<(), TransferError> {
        Ok(self
            .region
            .write_range(self.slot_layer_range(slot, layer)?, src)?)
    }

    /// Reads one block-layer of KV from (`slot`, `layer`).
    ///
    /// # Errors
    /// Range errors; [`StoreError::BufferSize`] if `dst` is not one block-layer.
    pub fn read_slot_layer(&self, slot: u32, layer: u32, dst: &mut [u8]) -> Result<(), TransferError> {
        Ok(self.region.read_range(self.slot_layer_range(slot, layer)?, dst)?)
    }

    /// Sets every byte of (`slot`, `layer`) to `byte`.
    ///
    /// # Errors
    /// Range errors.
    pub fn fill_slot_layer(&self, slot: u32, layer: u32, byte: u8) -> Result<(), TransferError> {
        let (off, len) = self.slot_layer_range(slot, layer)?;
        Ok(self.region.fill(off, len, byte)?)
    }

    /// `xxh3_64` of (`slot`, `layer`), for verification without a copy.
    ///
    /// # Errors
    /// Range errors.
    pub fn slot_layer_xxh3(&self, slot: u32, layer: u32) -> Result<u64, TransferError> {
        let (off, len) = self.slot_layer_range(slot, layer)?;
        Ok(self.region.xxh3_64(off, len)?)
    }
}

impl DevicePool for CpuDevicePool {
    fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }
    fn num_slots(&self) -> u32 {
        self.num_slots
    }
    fn copy_in(
        &self,
        slot: u32,
        layer: u32,
        host: &ShmRegion,
        host_offset: usize,
    ) -> Result<(), TransferError> {
        let (off, len) = self.slot_layer_range(slot, layer)?;
        ShmRegion::copy(host, host_offset, &self.region, off, len).map_err(|e| self.copy_error(e))
    }
    fn copy_out(
        &self,
        slot: u32,
        layer: u32,
        host: &ShmRegion,
        host_offset: usize,
    ) -> Result<(), TransferError> {
        let (off, len) = self.slot_layer_range(slot, layer)?;
        ShmRegion::copy(&self.region, off, host, host_offset, len).map_err(|e| self.copy_error(e))
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
}
