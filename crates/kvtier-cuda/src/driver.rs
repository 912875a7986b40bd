//! The CUDA driver, loaded at run time: whether this process can use it (probed once, with the
//! reason when not), its errors as [`TransferError`]s, and the GPUs kvtier works on, each
//! through its primary context (the one PyTorch and the CUDA runtime use too).

use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use kvtier_transfer::TransferError;

/// The device name in errors and logs.
pub(crate) const CUDA: &str = "cuda";

/// Whether this process can use CUDA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaStatus {
    /// The driver loaded and sees these GPUs.
    Available {
        /// `cuDriverGetVersion`: 13000 for CUDA 13.0.
        driver_version: i32,
        /// The visible GPUs, by ordinal.
        devices: Vec<DeviceInfo>,
    },
    /// Why not: no driver library, no GPU, a driver that fails to initialize.
    Unavailable {
        /// In words, for the log line and FAILED_PRECONDITION answers.
        reason: String,
    },
}

impl CudaStatus {
    /// The reason CUDA cannot be used, `None` when it can.
    pub fn unavailable_reason(&self) -> Option<&str> {
        match self {
            CudaStatus::Available { .. } => None,
            CudaStatus::Unavailable { reason } => Some(reason),
        }
    }

    /// One line for the start-up log: `CUDA 13.0, 1 GPU: 0 NVIDIA H200 (GPU-…)`, or why not.
    pub fn describe(&self) -> String {
        match self {
            CudaStatus::Available {
                driver_version,
                devices,
            } => {
                let gpus: Vec<String> = devices
                    .iter()
                    .map(|d| format!("{} {} ({})", d.ordinal, d.name, uuid_text(&d.uuid)))
                    .collect();
                format!(
                    "CUDA {}.{} driver, {} GPU(s): {}",
                    driver_version / 1000,
                    driver_version % 1000 / 10,
                    devices.len(),
                    gpus.join(", ")
                )
            }
            CudaStatus::Unavailable { reason } => format!("CUDA unavailable: {reason}"),
        }
    }
}

/// One visible GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its ordinal in this process (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetUuid`: what `torch.cuda.get_device_properties(i).uuid` holds.
    pub uuid: [u8; 16],
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Whether this process can use CUDA: probed on first call (loading the driver library,
/// `cuInit`, listing the GPUs), then remembered.
pub fn status() -> &'static CudaStatus {
    static STATUS: OnceLock<CudaStatus> = OnceLock::new();
    STATUS.get_or_init(probe)
}

fn probe() -> CudaStatus {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return CudaStatus::Unavailable {
            reason: "no CUDA driver library (libcuda.so.1 not found by the dynamic loader)".into(),
        };
    }
    // cudarc panics when the library lacks a function it looks up (a driver older than the
    // API this build uses): a reason, not a crash.
    match std::panic::catch_unwind(probe_driver) {
        Ok(Ok(s)) => s,
        Ok(Err(reason)) => CudaStatus::Unavailable { reason },
        Err(_) => CudaStatus::Unavailable {
            reason: "the CUDA driver library lacks a function kvtier calls (a driver older than CUDA 12?)"
                .into(),
        },
    }
}

fn probe_driver() -> Result<CudaStatus, String> {
    let text = |op: &str, r| format!("{op}: {}", error_text(r));
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        let r = sys::cuInit(0);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(text("cuInit", r));
        }
        let mut version = 0;
        let r = sys::cuDriverGetVersion(&mut version);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(text("cuDriverGetVersion", r));
        }
        let mut count = 0;
        let r = sys::cuDeviceGetCount(&mut count);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(text("cuDeviceGetCount", r));
        }
        if count == 0 {
            return Err(format!(
                "the driver sees no GPU (CUDA_VISIBLE_DEVICES={:?})",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
            ));
        }
        let mut devices = Vec::new();
        for ordinal in 0..count {
            let mut dev = 0;
            let r = sys::cuDeviceGet(&mut dev, ordinal);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(text("cuDeviceGet", r));
            }
            let mut name = [0 as std::ffi::c_char; 256];
            let r = sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(text("cuDeviceGetName", r));
            }
            let mut uuid = sys::CUuuid { bytes: [0; 16] };
            let r = sys::cuDeviceGetUuid_v2(&mut uuid, dev);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(text("cuDeviceGetUuid", r));
            }
            devices.push(DeviceInfo {
                ordinal: ordinal as u32,
                name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                uuid: uuid.bytes.map(|b| b as u8),
            });
        }
        Ok(CudaStatus::Available {
            driver_version: version,
            devices,
        })
    }
}

/// The driver's name and text for `r`: `CUDA_ERROR_INVALID_VALUE (invalid argument)`.
pub(crate) fn error_text(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver writes pointers to static strings (or leaves them null).
    unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
        let s = |p: *const std::ffi::c_char| {
            (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
        };
        match (s(name), s(text)) {
            (Some(n), Some(t)) => format!("{n} ({t})"),
            (Some(n), None) => n,
            _ => format!("{r:?}"),
        }
    }
}

/// `Ok` for `CUDA_SUCCESS`, else [`TransferError::Device`] naming `op` and the driver's error.
pub(crate) fn check(op: &str, r: sys::CUresult) -> Result<(), TransferError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(TransferError::Device {
            device: CUDA,
            op: op.to_string(),
            reason: error_text(r),
        })
    }
}

/// [`TransferError::DeviceUnavailable`] with `reason`.
pub(crate) fn unavailable(reason: impl Into<String>) -> TransferError {
    TransferError::DeviceUnavailable {
        device: CUDA,
        reason: reason.into(),
    }
}

/// One GPU, through its primary context (retained for the life of the process).
#[derive(Debug)]
pub struct CudaContext {
    info: DeviceInfo,
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context is usable from any thread once made current there ([`bind`]); the
// handle is an opaque pointer the driver owns.
unsafe impl Send for CudaContext {}
// SAFETY: see above; the driver serializes what needs serializing.
unsafe impl Sync for CudaContext {}

impl CudaContext {
    /// The context of GPU `ordinal` (retained on first use, shared afterwards).
    ///
    /// # Errors
    /// [`TransferError::DeviceUnavailable`] when CUDA cannot be used or there is no such GPU;
    /// [`TransferError::Device`] when the driver refuses the context.
    pub fn get(ordinal: u32) -> Result<Arc<CudaContext>, TransferError> {
        static CONTEXTS: Mutex<Vec<Arc<CudaContext>>> = Mutex::new(Vec::new());
        let devices = match status() {
            CudaStatus::Available { devices, .. } => devices,
            CudaStatus::Unavailable { reason } => return Err(unavailable(reason.clone())),
        };
        let Some(info) = devices.iter().find(|d| d.ordinal == ordinal) else {
            return Err(unavailable(format!(
                "no GPU {ordinal}: this process sees {} (0..{})",
                devices.len(),
                devices.len()
            )));
        };
        let mut contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = contexts.iter().find(|c| c.info.ordinal == ordinal) {
            return Ok(c.clone());
        }
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the ordinal is one the driver listed; `ctx` is a valid out-pointer.
        unsafe {
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            )?;
        }
        let c = Arc::new(CudaContext {
            info: info.clone(),
            ctx,
        });
        contexts.push(c.clone());
        Ok(c)
    }

    /// The GPU.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Makes the context current on the calling thread (every driver call below needs it).
    ///
    /// # Errors
    /// [`TransferError::Device`] from `cuCtxSetCurrent`.
    pub fn bind(&self) -> Result<(), TransferError> {
        // SAFETY: `ctx` is a retained primary context.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }
}

/// A CUDA stream of one context, destroyed on drop (after its work finished).
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) raw: sys::CUstream,
    ctx: Arc<CudaContext>,
}

// SAFETY: streams may be used from any thread of the context's process.
unsafe impl Send for Stream {}
// SAFETY: enqueueing on one stream from several threads is thread-safe in the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// A non-blocking stream (no implicit sync with the legacy default stream); `high`: the
    /// context's greatest priority (loads), else the least (stores).
    pub(crate) fn new(ctx: &Arc<CudaContext>, high: bool) -> Result<Stream, TransferError> {
        ctx.bind()?;
        let (mut least, mut greatest) = (0, 0);
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointers, context current.
        unsafe {
            check(
                "cuCtxGetStreamPriorityRange",
                sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest),
            )?;
            check(
                "cuStreamCreateWithPriority",
                sys::cuStreamCreateWithPriority(
                    &mut raw,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    if high { greatest } else { least },
                ),
            )?;
        }
        Ok(Stream {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// Waits for everything queued so far.
    pub(crate) fn synchronize(&self) -> Result<(), TransferError> {
        self.ctx.bind()?;
        // SAFETY: a live stream of the bound context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: a live stream; destroy waits for nothing but releases it once its work
            // is done.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// A completion marker recorded on a stream, waited for once and destroyed on drop.
#[derive(Debug)]
pub(crate) struct Event {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: events may be waited for from any thread of the process.
unsafe impl Send for Event {}

impl Event {
    /// Records an event after everything queued on `stream` so far.
    pub(crate) fn record(stream: &Stream) -> Result<Event, TransferError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the stream's context is current (the caller bound it).
        unsafe {
            check(
                "cuEventCreate",
                sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
            )?;
        }
        let event = Event {
            raw,
            ctx: stream.ctx.clone(),
        };
        // SAFETY: a live event and stream of the current context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event.raw, stream.raw)
        })?;
        Ok(event)
    }

    /// Blocks until the stream reached the event.
    pub(crate) fn synchronize(&self) -> Result<(), TransferError> {
        self.ctx.bind()?;
        // SAFETY: a live, recorded event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: a live event; nothing waits on it any more.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}
