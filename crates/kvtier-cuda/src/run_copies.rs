//! Batches for `kvtier_copy_runs` (`kernels/kv_copy.cu`): a layer's slots whose K and V the
//! engine splits per token and head (vLLM ≥ 0.34 interleaves them in `[.., K‖V]` rows), one
//! 16-byte plane entry per slot's K or V instead of one piece per run. The kernel computes each
//! run's address from the layer's [`LayerRuns`]; [`plan`] decides whether a batch can go that
//! way (everything 16-byte aligned) and builds the parameter blocks.

use kvtier_core::{KvGeometry, LayerRuns, PoolLayout};
use kvtier_transfer::{CopyDirection, SlotCopy};

/// Planes per launch (`KVTIER_MAX_PLANES` in the source).
pub const MAX_PLANES: usize = 240;

/// One slot's K or V (`kvtier_plane`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Plane {
    /// Engine address of the plane's run 0.
    pub dev: u64,
    /// Device address of the plane's bytes in the (mapped, pinned) host page.
    pub host: u64,
}

/// The kernel's one parameter, passed by value (`kvtier_runs_batch`).
#[repr(C)]
#[derive(Debug, Clone)]
pub struct RunsBatch {
    pub(crate) token_stride: u64,
    pub(crate) head_stride: u64,
    pub(crate) run_bytes: u64,
    pub(crate) per_token: u32,
    pub(crate) runs: u32,
    pub(crate) count: u32,
    pub(crate) to_host: u32,
    pub(crate) pad: u64,
    pub(crate) planes: [Plane; MAX_PLANES],
}

const _: () = assert!(std::mem::size_of::<Plane>() == 16);
const _: () = assert!(std::mem::size_of::<RunsBatch>() == 3888);

/// The launches that copy `copies` of `layer` in `direction` with `kvtier_copy_runs`, or `None`
/// where the layer is not split per token or head (the piece paths serve it better) or
/// something is not 16-byte aligned. `buffers`: the pool's buffers' device addresses;
/// `host_base`: the device address of the host region's byte 0.
pub fn plan(
    layout: &PoolLayout,
    geometry: &KvGeometry,
    buffers: &[u64],
    layer: u32,
    direction: CopyDirection,
    host_base: u64,
    copies: &[SlotCopy],
) -> Option<Vec<RunsBatch>> {
    let l = layout.layer(layer);
    let runs: LayerRuns = l.runs(geometry);
    if runs.count <= 1 {
        return None;
    }
    let half = geometry.bytes_per_block_layer() as u64 / 2;
    let aligned = |x: u64| x.is_multiple_of(16);
    if ![runs.len, runs.token_stride, runs.head_stride, half]
        .into_iter()
        .all(aligned)
    {
        return None;
    }
    let mut planes = Vec::with_capacity(copies.len() * 2);
    for c in copies {
        let (k, v) = layout.kv_offsets(layer, c.slot);
        let host = host_base + c.host_offset as u64;
        for (buffer, offset, at) in [(l.k_buffer, k, 0), (l.v_buffer, v, half)] {
            let plane = Plane {
                dev: buffers[buffer as usize] + offset,
                host: host + at,
            };
            if !aligned(plane.dev) || !aligned(plane.host) {
                return None;
            }
            planes.push(plane);
        }
    }
    Some(
        planes
            .chunks(MAX_PLANES)
            .map(|chunk| {
                let mut batch = RunsBatch {
                    token_stride: runs.token_stride,
                    head_stride: runs.head_stride,
                    run_bytes: runs.len,
                    per_token: runs.per_token,
                    runs: runs.count,
                    count: chunk.len() as u32,
                    to_host: u32::from(direction == CopyDirection::DeviceToHost),
                    pad: 0,
                    planes: [Plane::default(); MAX_PLANES],
                };
                batch.planes[..chunk.len()].copy_from_slice(chunk);
                batch
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use kvtier_core::{Dtype, LayoutKind};

    use super::*;

    /// `kvtier_copy_runs` on the CPU, line for line (addresses are host pointers here): every
    /// thread of every row, in any order, copies its 16-byte units.
    fn emulate(batch: &RunsBatch) {
        let units_per_run = batch.run_bytes >> 4;
        let units = units_per_run * u64::from(batch.runs);
        for p in &batch.planes[..batch.count as usize] {
            for u in 0..units {
                let r = u / units_per_run;
                let within = (u - r * units_per_run) << 4;
                let dev = p.dev
                    + (r / u64::from(batch.per_token)) * batch.token_stride
                    + (r % u64::from(batch.per_token)) * batch.head_stride
                    + within;
                let host = p.host + (u << 4);
                let (src, dst) = if batch.to_host == 1 {
                    (dev, host)
                } else {
                    (host, dev)
                };
                // SAFETY: the test's buffers hold every address the plan names (checked by the
                // results against slot_pieces).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, 16) };
            }
        }
    }

    /// For the interleaved layouts, the planned launches copy exactly what the pool's pieces
    /// say, both ways; packed layouts and misaligned ones are left to the piece paths.
    #[test]
    fn planned_launches_copy_what_the_pieces_say() {
        let g = KvGeometry::new(3, 4, 16, Dtype::Bf16, 8).unwrap(); // runs of 32 bytes
        let slots = 300u32; // more planes than one launch holds
        let bl = g.bytes_per_block_layer();
        for kind in [LayoutKind::VllmLbnhc, LayoutKind::VllmLbhnc] {
            let layout = PoolLayout::of_kind(kind, &g, slots, 0);
            let bytes = PoolLayout::kind_bytes(&g, slots, 0) as usize;
            // u128 elements: 16-byte aligned buffers.
            let mut pool = vec![0u128; bytes / 16];
            for (i, b) in bytemuck_bytes(&mut pool).iter_mut().enumerate() {
                *b = (i * 7 + i / 251) as u8;
            }
            let mut host = vec![0u128; slots as usize * bl / 16];
            let copies: Vec<SlotCopy> = (0..slots)
                .rev()
                .map(|s| SlotCopy {
                    slot: s,
                    host_offset: (slots - 1 - s) as usize * bl,
                })
                .collect();
            let base = pool.as_mut_ptr() as u64;
            let host_base = host.as_mut_ptr() as u64;
            let batches = plan(
                &layout,
                &g,
                &[base],
                1,
                CopyDirection::DeviceToHost,
                host_base,
                &copies,
            )
            .unwrap();
            assert_eq!(batches.len(), 3, "{kind}: 600 planes");
            batches.iter().for_each(emulate);
            let want: Vec<u8> = bytemuck_bytes(&mut pool).to_vec();
            let host_bytes: &[u8] = bytemuck_bytes(&mut host);
            for c in &copies {
                for p in layout.slot_pieces(&g, 1, c.slot) {
                    let (o, a) = (p.offset as usize, c.host_offset + p.at);
                    assert_eq!(
                        &host_bytes[a..a + p.len],
                        &want[o..o + p.len],
                        "{kind} slot {}",
                        c.slot
                    );
                }
            }
            // Back into a zeroed pool: the same bytes, and nothing of the other layers.
            pool.iter_mut().for_each(|x| *x = 0);
            let batches = plan(
                &layout,
                &g,
                &[base],
                1,
                CopyDirection::HostToDevice,
                host_base,
                &copies,
            )
            .unwrap();
            batches.iter().for_each(emulate);
            let pool_bytes: &[u8] = bytemuck_bytes(&mut pool);
            for s in 0..slots {
                for l in 0..3 {
                    for p in layout.slot_pieces(&g, l, s) {
                        let o = p.offset as usize;
                        if l == 1 {
                            assert_eq!(&pool_bytes[o..o + p.len], &want[o..o + p.len], "{kind}");
                        } else {
                            assert!(pool_bytes[o..o + p.len].iter().all(|&b| b == 0), "{kind}");
                        }
                    }
                }
            }
            // A host page 8 bytes off alignment: left to the piece kernel.
            assert!(
                plan(
                    &layout,
                    &g,
                    &[base],
                    1,
                    CopyDirection::DeviceToHost,
                    host_base + 8,
                    &copies
                )
                .is_none()
            );
        }
        let packed = PoolLayout::of_kind(LayoutKind::Vllm, &g, slots, 0);
        assert!(plan(&packed, &g, &[0], 0, CopyDirection::DeviceToHost, 0, &[]).is_none());
    }

    fn bytemuck_bytes(v: &mut [u128]) -> &mut [u8] {
        // SAFETY: u128 has no padding and any byte pattern is valid for u8.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
}
