//! A device pool in GPU memory: the engine's KV buffers opened by CUDA IPC handle (or, for the
//! benchmark and tests, allocated here), copied to and from kvtier's host pages on two streams —
//! loads on a high-priority host-to-device stream, stores on a device-to-host stream — one
//! batch per layer, each completed by one event.
//!
//! Copies go by `cuMemcpyAsync` (one per block-layer where V follows K, one per K and per V
//! where they are apart, one per run where the layout splits them per token and head;
//! neighbours that are contiguous on both sides merged) or by the copy kernels of
//! `kernels/kv_copy.cu` (reading or writing the pinned host pages through their device
//! mapping): `kvtier_copy_runs` for layers split per token and head (one launch per 240 slot
//! planes, [`crate::run_copies`]), `kvtier_copy_pieces` otherwise (one launch per 128 pieces). [`CopyMethod::Auto`] takes the kernel where the layout splits
//! K from V, `cuMemcpyAsync` where it does not; `KVTIER_CUDA_COPY=memcpy|kernel|auto`
//! overrides it for a process.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use kvtier_core::{KvGeometry, LayoutError, LayoutKind, PoolLayout};
use kvtier_store::{ShmRegion, StoreError};
use kvtier_transfer::{CopyDirection, CopyTicket, DevicePool, PendingCopies, SlotCopy, TransferError};

use crate::copy_kernels::{CopyKernel, Piece};
use crate::driver::{CUDA, CudaContext, Event, Stream, check, error_text, unavailable, uuid_text};
use crate::host_pinning::mapped_base;
use crate::run_copies;

/// How a pool moves a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CopyMethod {
    /// The kernel where K and V are apart, `cuMemcpyAsync` where V follows K.
    Auto,
    /// `cuMemcpyAsync` per contiguous piece.
    Memcpy,
    /// The copy kernel (falls back to `cuMemcpyAsync` for host pages that are not pinned).
    Kernel,
}

impl CopyMethod {
    /// Every method, for help texts.
    pub const ALL: [CopyMethod; 3] = [CopyMethod::Auto, CopyMethod::Memcpy, CopyMethod::Kernel];

    /// `auto`, `memcpy`, `kernel`.
    pub const fn name(self) -> &'static str {
        match self {
            CopyMethod::Auto => "auto",
            CopyMethod::Memcpy => "memcpy",
            CopyMethod::Kernel => "kernel",
        }
    }

    /// `KVTIER_CUDA_COPY` if set (an unknown value is logged and ignored), else `Auto`.
    pub fn from_env() -> CopyMethod {
        match std::env::var("KVTIER_CUDA_COPY") {
            Ok(v) => v.parse().unwrap_or_else(|e| {
                tracing::warn!("KVTIER_CUDA_COPY: {e}; using auto");
                CopyMethod::Auto
            }),
            Err(_) => CopyMethod::Auto,
        }
    }
}

impl fmt::Display for CopyMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CopyMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CopyMethod::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown copy method {s:?} (expected auto, memcpy or kernel)"))
    }
}

/// One buffer of an engine's pool, as `RegisterPoolRequest.cuda.buffers[i]` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaBufferSpec {
    /// `cudaIpcMemHandle_t` of the allocation (64 bytes).
    pub ipc_handle: Vec<u8>,
    /// Where the buffer starts in that allocation.
    pub offset_bytes: u64,
    /// The buffer's length.
    pub size_bytes: u64,
}

/// An engine's pool in GPU memory, as `RegisterPoolRequest.cuda` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaPoolSpec {
    /// The GPU's ordinal in the sidecar's process.
    pub device_ordinal: u32,
    /// The GPU's UUID, checked when given (empty: not checked).
    pub device_uuid: Vec<u8>,
    /// The buffers the layout indexes.
    pub buffers: Vec<CudaBufferSpec>,
}

fn layout_error(field: String, reason: String) -> TransferError {
    TransferError::Layout(LayoutError { field, reason })
}

/// One allocation a pool holds.
#[derive(Debug)]
enum Memory {
    /// `cuMemAlloc`ed here, freed on drop.
    Allocated(u64),
    /// Opened from an IPC handle (shared with other pools of the same allocation), closed when
    /// the last of them is dropped.
    Ipc([u8; 64]),
}

/// The device memory a pool holds, freed or closed when dropped (the pool drains its streams
/// first), so every early return of a constructor releases what it had opened.
#[derive(Debug)]
struct DeviceMemory {
    ctx: Arc<CudaContext>,
    parts: Vec<Memory>,
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        for m in &self.parts {
            match m {
                Memory::Allocated(p) => {
                    // SAFETY: allocated by this pool; no copy is pending.
                    let _ = unsafe { sys::cuMemFree_v2(*p) };
                }
                Memory::Ipc(h) => ipc_close(h),
            }
        }
    }
}

/// IPC allocations open in this process: a handle opens once per process (the driver refuses a
/// second open), however many pools use it.
static IPC_OPEN: Mutex<Vec<([u8; 64], u64, usize)>> = Mutex::new(Vec::new());

fn ipc_open(handle: &[u8; 64]) -> Result<u64, sys::CUresult> {
    let mut open = IPC_OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = open.iter_mut().find(|e| &e.0 == handle) {
        e.2 += 1;
        return Ok(e.1);
    }
    let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in raw.reserved.iter_mut().zip(handle) {
        *d = *s as std::ffi::c_char;
    }
    let mut base = 0;
    // SAFETY: a valid out-pointer; the driver validates the handle.
    let r = unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut base,
            raw,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(r);
    }
    open.push((*handle, base, 1));
    Ok(base)
}

fn ipc_close(handle: &[u8; 64]) {
    let mut open = IPC_OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = open.iter().position(|e| &e.0 == handle) {
        open[i].2 -= 1;
        if open[i].2 == 0 {
            let (_, base, _) = open.swap_remove(i);
            // SAFETY: opened by `ipc_open`; no copy of any pool is pending on it (pools
            // synchronize their streams before releasing memory).
            let _ = unsafe { sys::cuIpcCloseMemHandle(base) };
        }
    }
}

/// A [`DevicePool`] in GPU memory (see the module docs).
#[derive(Debug)]
pub struct CudaDevicePool {
    ctx: Arc<CudaContext>,
    geometry: KvGeometry,
    num_slots: u32,
    layout: PoolLayout,
    /// Device address of each buffer the layout indexes.
    buffers: Vec<u64>,
    h2d: Stream,
    d2h: Stream,
    kernel: Option<Arc<CopyKernel>>,
    method: CopyMethod,
    /// Last: released after the pool's Drop drained the streams.
    _memory: DeviceMemory,
}

impl CudaDevicePool {
    /// Allocates a pool of `num_slots` slots on GPU `ordinal` in the named layout (one
    /// allocation, zeroed), for in-process use: the benchmark and tests.
    ///
    /// # Errors
    /// [`TransferError::DeviceUnavailable`] without CUDA or that GPU, [`TransferError::NoSlots`],
    /// [`TransferError::Device`] when the allocation fails.
    pub fn allocate(
        ordinal: u32,
        geometry: KvGeometry,
        num_slots: u32,
        kind: LayoutKind,
        method: CopyMethod,
    ) -> Result<Self, TransferError> {
        if num_slots == 0 {
            return Err(TransferError::NoSlots);
        }
        let ctx = CudaContext::get(ordinal)?;
        ctx.bind()?;
        let bytes = PoolLayout::kind_bytes(&geometry, num_slots, 0) as usize;
        let mut ptr = 0;
        // SAFETY: valid out-pointer, context current.
        unsafe {
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, bytes))?;
        }
        let memory = DeviceMemory {
            ctx: ctx.clone(),
            parts: vec![Memory::Allocated(ptr)],
        };
        // SAFETY: `ptr` is `bytes` long, just allocated.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) })?;
        let layout = PoolLayout::of_kind(kind, &geometry, num_slots, 0);
        Self::assemble(ctx, geometry, num_slots, layout, vec![ptr], memory, method)
    }

    /// Opens an engine's pool from its IPC handles on the GPU it names, checking the GPU's
    /// UUID, each buffer against its allocation, and the layout against the buffers.
    ///
    /// # Errors
    /// [`TransferError::DeviceUnavailable`] without CUDA, that GPU, or with another GPU's UUID;
    /// [`TransferError::Layout`] naming the request field at fault (`cuda.buffers[1].ipc_handle`
    /// for a handle that does not open, `cuda.buffers[0].size_bytes` past its allocation,
    /// `layout.layers[3].v_offset` …); [`TransferError::NoSlots`].
    pub fn open_ipc(
        spec: &CudaPoolSpec,
        geometry: KvGeometry,
        num_slots: u32,
        layout: PoolLayout,
        method: CopyMethod,
    ) -> Result<Self, TransferError> {
        if num_slots == 0 {
            return Err(TransferError::NoSlots);
        }
        if !spec.device_uuid.is_empty() && spec.device_uuid.len() != 16 {
            return Err(layout_error(
                "cuda.device_uuid".into(),
                format!("{} bytes; a GPU UUID is 16", spec.device_uuid.len()),
            ));
        }
        if spec.buffers.is_empty() {
            return Err(layout_error(
                "cuda.buffers".into(),
                "no buffers: give the allocation(s) holding the KV".into(),
            ));
        }
        let mut handles = Vec::with_capacity(spec.buffers.len());
        for (i, b) in spec.buffers.iter().enumerate() {
            let h: [u8; 64] = b.ipc_handle.as_slice().try_into().map_err(|_| {
                layout_error(
                    format!("cuda.buffers[{i}].ipc_handle"),
                    format!("{} bytes; a cudaIpcMemHandle_t is 64", b.ipc_handle.len()),
                )
            })?;
            handles.push(h);
        }
        let ctx = CudaContext::get(spec.device_ordinal)?;
        if spec.device_uuid.len() == 16 && spec.device_uuid.as_slice() != ctx.info().uuid {
            let mut theirs = [0u8; 16];
            theirs.copy_from_slice(&spec.device_uuid);
            return Err(unavailable(format!(
                "GPU {} of this sidecar is {}; the pool is on {} (align CUDA_VISIBLE_DEVICES of engine and sidecar)",
                spec.device_ordinal,
                uuid_text(&ctx.info().uuid),
                uuid_text(&theirs)
            )));
        }
        ctx.bind()?;
        let mut memory = DeviceMemory {
            ctx: ctx.clone(),
            parts: Vec::new(),
        };
        let mut buffers = Vec::with_capacity(handles.len());
        let mut sizes = Vec::with_capacity(handles.len());
        for (i, (h, b)) in handles.iter().zip(&spec.buffers).enumerate() {
            let opened = ipc_open(h).map_err(|r| {
                layout_error(
                    format!("cuda.buffers[{i}].ipc_handle"),
                    format!(
                        "does not open on GPU {}: {} (a handle of another GPU, of a freed allocation, or not an IPC handle)",
                        spec.device_ordinal,
                        error_text(r)
                    ),
                )
            })?;
            memory.parts.push(Memory::Ipc(*h));
            let (mut alloc_base, mut alloc_size) = (0, 0usize);
            // SAFETY: `opened` is a live device address of the current context.
            let r = unsafe { sys::cuMemGetAddressRange_v2(&mut alloc_base, &mut alloc_size, opened) };
            check("cuMemGetAddressRange", r)?;
            let avail = (alloc_base + alloc_size as u64).saturating_sub(opened);
            if b.offset_bytes
                .checked_add(b.size_bytes)
                .is_none_or(|end| end > avail)
            {
                return Err(layout_error(
                    format!("cuda.buffers[{i}].size_bytes"),
                    format!(
                        "offset {} + size {} runs past the allocation's {avail} bytes",
                        b.offset_bytes, b.size_bytes
                    ),
                ));
            }
            buffers.push(opened + b.offset_bytes);
            sizes.push(b.size_bytes);
        }
        layout.validate(&geometry, num_slots, &sizes)?;
        Self::assemble(ctx, geometry, num_slots, layout, buffers, memory, method)
    }

    fn assemble(
        ctx: Arc<CudaContext>,
        geometry: KvGeometry,
        num_slots: u32,
        layout: PoolLayout,
        buffers: Vec<u64>,
        memory: DeviceMemory,
        method: CopyMethod,
    ) -> Result<Self, TransferError> {
        let (h2d, d2h) = (Stream::new(&ctx, true)?, Stream::new(&ctx, false)?);
        let kernel = match method {
            CopyMethod::Memcpy => None,
            _ => match CopyKernel::get(&ctx) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(error = %e, "copy kernel unavailable; copying with cuMemcpyAsync");
                    None
                }
            },
        };
        Ok(Self {
            ctx,
            geometry,
            num_slots,
            layout,
            buffers,
            _memory: memory,
            h2d,
            d2h,
            kernel,
            method,
        })
    }

    /// The GPU.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// How batches are copied, and where the kernel came from (`kernel (nvrtc)`).
    pub fn method_description(&self) -> String {
        match &self.kernel {
            Some(k) => format!("{} (kernel from {})", self.method, k.origin),
            None => format!("{} (cuMemcpyAsync)", self.method),
        }
    }

    /// Writes one block-layer of KV, given in kvtier's `[K|V]` order, into (`slot`, `layer`)
    /// synchronously, as an engine's forward pass would (tests and the benchmark's untimed
    /// part; never the data path).
    ///
    /// # Errors
    /// Range errors; [`StoreError::BufferSize`] if `src` is not one block-layer;
    /// [`TransferError::Device`].
    pub fn write_slot_layer(&self, slot: u32, layer: u32, src: &[u8]) -> Result<(), TransferError> {
        self.check_block_layer(slot, layer, src.len())?;
        for (dev, at, len) in self.slot_pieces(layer, slot) {
            // SAFETY: `dev..dev+len` lies in a validated buffer; `src[at..at+len]` is in bounds.
            let r = unsafe { sys::cuMemcpyHtoD_v2(dev, src[at..].as_ptr().cast(), len) };
            check("cuMemcpyHtoD", r)?;
        }
        Ok(())
    }

    /// Reads one block-layer of KV from (`slot`, `layer`) in kvtier's `[K|V]` order,
    /// synchronously (tests and checks).
    ///
    /// # Errors
    /// As [`CudaDevicePool::write_slot_layer`].
    pub fn read_slot_layer(&self, slot: u32, layer: u32, dst: &mut [u8]) -> Result<(), TransferError> {
        self.check_block_layer(slot, layer, dst.len())?;
        for (dev, at, len) in self.slot_pieces(layer, slot) {
            // SAFETY: as in `write_slot_layer`, into `dst`.
            let r = unsafe { sys::cuMemcpyDtoH_v2(dst[at..].as_mut_ptr().cast(), dev, len) };
            check("cuMemcpyDtoH", r)?;
        }
        Ok(())
    }

    /// Sets every byte of (`slot`, `layer`)'s K and V to `byte`, synchronously.
    ///
    /// # Errors
    /// Range errors, [`TransferError::Device`].
    pub fn fill_slot_layer(&self, slot: u32, layer: u32, byte: u8) -> Result<(), TransferError> {
        self.check_block_layer(slot, layer, self.geometry.bytes_per_block_layer())?;
        for (dev, _, len) in self.slot_pieces(layer, slot) {
            // SAFETY: `dev..dev+len` lies in a validated buffer.
            check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(dev, byte, len) })?;
        }
        Ok(())
    }

    /// Checks a slot, a layer and a buffer of `len` bytes for one block-layer, and binds the
    /// context.
    fn check_block_layer(&self, slot: u32, layer: u32, len: usize) -> Result<(), TransferError> {
        self.check_slot(slot)?;
        self.check_layer(layer)?;
        let bl = self.geometry.bytes_per_block_layer();
        if len != bl {
            return Err(StoreError::BufferSize {
                expected_bytes: bl,
                actual_bytes: len,
            }
            .into());
        }
        self.ctx.bind()
    }

    /// (device address, offset in the block-layer, len) of (`layer`, `slot`)'s pieces.
    fn slot_pieces(&self, layer: u32, slot: u32) -> impl Iterator<Item = (u64, usize, usize)> {
        let buffers = &self.buffers;
        self.layout
            .slot_pieces(&self.geometry, layer, slot)
            .map(move |p| (buffers[p.buffer as usize] + p.offset, p.at, p.len))
    }

    /// The batch's pieces, `src`/`dst` as `(device address, host offset)` pairs in the
    /// direction's order, neighbours contiguous on both sides merged.
    fn batch_pieces(
        &self,
        direction: CopyDirection,
        layer: u32,
        host_base: u64,
        copies: &[SlotCopy],
    ) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::with_capacity(copies.len() * 2);
        for c in copies {
            for (dev, at, len) in self.slot_pieces(layer, c.slot) {
                let host = host_base + (c.host_offset + at) as u64;
                let (src, dst) = match direction {
                    CopyDirection::HostToDevice => (host, dev),
                    CopyDirection::DeviceToHost => (dev, host),
                };
                match out.last_mut() {
                    Some(p) if p.src + p.bytes == src && p.dst + p.bytes == dst => p.bytes += len as u64,
                    _ => out.push(Piece {
                        src,
                        dst,
                        bytes: len as u64,
                    }),
                }
            }
        }
        out
    }

    fn enqueue(
        &self,
        direction: CopyDirection,
        layer: u32,
        host: &ShmRegion,
        copies: &[SlotCopy],
        stream: &Stream,
    ) -> Result<(), TransferError> {
        let host_ptr = host.dma_address(0, host.len())? as u64;
        let mapped = mapped_base(&self.ctx, host);
        let split = !self.layout.kv_adjacent(layer, &self.geometry);
        let kernel = match (&self.kernel, mapped, self.method) {
            (Some(k), Some(base), CopyMethod::Kernel) => Some((k, base)),
            (Some(k), Some(base), CopyMethod::Auto) if split => Some((k, base)),
            _ => None,
        };
        if let Some((k, device_base)) = kernel {
            // K and V split per token and head: one plane entry per slot's K or V, the kernel
            // walks the runs; otherwise (or misaligned) one piece per contiguous range.
            let runs = run_copies::plan(
                &self.layout,
                &self.geometry,
                &self.buffers,
                layer,
                direction,
                device_base,
                copies,
            );
            if let Some(batches) = runs {
                return k.launch_runs(stream, &batches);
            }
            let pieces = self.batch_pieces(direction, layer, device_base, copies);
            return k.launch(stream, &pieces);
        }
        for p in self.batch_pieces(direction, layer, host_ptr, copies) {
            // SAFETY: device ranges lie in validated buffers; host ranges were checked against
            // the region, which the caller keeps alive until the batch's event (the ticket
            // waits on drop).
            let r = unsafe {
                match direction {
                    CopyDirection::HostToDevice => sys::cuMemcpyHtoDAsync_v2(
                        p.dst,
                        p.src as *const std::ffi::c_void,
                        p.bytes as usize,
                        stream.raw,
                    ),
                    CopyDirection::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(
                        p.dst as *mut std::ffi::c_void,
                        p.src,
                        p.bytes as usize,
                        stream.raw,
                    ),
                }
            };
            check("cuMemcpyAsync", r)?;
        }
        Ok(())
    }
}

impl Drop for CudaDevicePool {
    fn drop(&mut self) {
        // Every ticket waits on drop, but a submit that failed part-way may have left copies
        // queued: let both streams drain before the memory (the last field) goes.
        let _ = self.h2d.synchronize();
        let _ = self.d2h.synchronize();
    }
}

/// A batch on a stream, done when its event is.
#[derive(Debug)]
struct CudaPending {
    event: Event,
}

impl PendingCopies for CudaPending {
    fn wait(&mut self) -> Result<(), TransferError> {
        self.event.synchronize()
    }
}

impl DevicePool for CudaDevicePool {
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
        CUDA
    }

    /// Puts the batch on the direction's stream (loads on the high-priority one) and records
    /// an event after it. A copy the driver refuses fails the batch after the stream drained
    /// what was queued, so nothing of it is still moving when the caller drops its pages.
    fn submit(
        &self,
        direction: CopyDirection,
        layer: u32,
        host: &ShmRegion,
        copies: &[SlotCopy],
    ) -> Result<CopyTicket, TransferError> {
        self.check_layer(layer)?;
        let bl = self.geometry.bytes_per_block_layer();
        for c in copies {
            self.check_slot(c.slot)?;
            host.check_range(c.host_offset, bl)?;
        }
        if copies.is_empty() {
            return Ok(CopyTicket::done());
        }
        self.ctx.bind()?;
        let stream = match direction {
            CopyDirection::HostToDevice => &self.h2d,
            CopyDirection::DeviceToHost => &self.d2h,
        };
        if let Err(e) = self.enqueue(direction, layer, host, copies, stream) {
            let _ = stream.synchronize();
            return Err(e);
        }
        match Event::record(stream) {
            Ok(event) => Ok(CopyTicket::pending(Box::new(CudaPending { event }))),
            Err(e) => {
                let _ = stream.synchronize();
                Err(e)
            }
        }
    }

    /// A whole layer per batch: one run of copies or launches, one event.
    fn batch_bytes(&self) -> Option<usize> {
        Some(self.num_slots as usize * self.geometry.bytes_per_block_layer())
    }

    /// Device memory cannot shrink under the pool (an IPC mapping keeps its allocation alive
    /// even if the engine frees it or exits): a sticky error of the context is what makes the
    /// pool unusable.
    fn check_usable(&self) -> Result<(), TransferError> {
        self.ctx.bind()?;
        // SAFETY: a query of a live stream.
        let r = unsafe { sys::cuStreamQuery(self.d2h.raw) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
            r => Err(TransferError::PoolUnusable {
                pool: format!("cuda:{}", self.ctx.info().ordinal),
                reason: error_text(r),
            }),
        }
    }
}
