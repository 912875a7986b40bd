//! Token-level reads and writes of KV in the device pool, converting between the pool's dtype
//! and the f32 the forward pass computes in.
//!
//! Layout of one (slot, layer) in the pool: `[K|V][token][kv_head][dim]`, so the keys of a
//! run of tokens in one block are one contiguous range, and so are their values.

use std::sync::Arc;

use kvtier_core::{Dtype, KvGeometry};
use kvtier_transfer::CpuDevicePool;

use crate::EngineError;

/// The engine's view of its device pool: the K and V of tokens in slots, by block table.
#[derive(Debug, Clone)]
pub struct KvSlots {
    pool: Arc<CpuDevicePool>,
    geometry: KvGeometry,
    /// Elements per token per layer in K (and in V): kv_heads × head_dim.
    token_elems: usize,
}

impl KvSlots {
    /// Wraps `pool`.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a dtype the engine cannot compute with (the fp8 formats).
    pub fn new(pool: Arc<CpuDevicePool>) -> Result<Self, EngineError> {
        let geometry = *kvtier_transfer::DevicePool::geometry(pool.as_ref());
        if !matches!(geometry.dtype(), Dtype::F32 | Dtype::Bf16 | Dtype::F16) {
            return Err(EngineError::Config(format!(
                "KV dtype {} is not supported by the CPU engine: use bf16, f16 or f32",
                geometry.dtype().name()
            )));
        }
        Ok(Self {
            token_elems: (geometry.kv_heads() * geometry.head_dim()) as usize,
            pool,
            geometry,
        })
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<CpuDevicePool> {
        &self.pool
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Writes the K and V of tokens `start .. start + n` of a sequence at `layer`, `k` and `v`
    /// being `[n][kv_head][dim]` f32. `blocks` is the sequence's block table (slot per block).
    ///
    /// Cost: converts and copies 2 × n × kv_heads × head_dim elements.
    ///
    /// # Errors
    /// Out-of-range slots or layers; [`EngineError::Config`] if `blocks` is too short.
    pub fn write(
        &self,
        layer: u32,
        blocks: &[u32],
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        let te = self.token_elems;
        let n = k.len() / te;
        debug_assert_eq!(k.len(), v.len());
        let bt = self.geometry.block_tokens() as usize;
        let es = self.geometry.dtype().size_bytes();
        let half = bt * te * es;
        let mut pos = start;
        let mut buf = Vec::new();
        while pos < start + n {
            let (b, t) = (pos / bt, pos % bt);
            let run = (bt - t).min(start + n - pos);
            let slot = *blocks.get(b).ok_or_else(|| {
                EngineError::Config(format!("block table of {} blocks has no block {b}", blocks.len()))
            })?;
            let (off, _) = self.pool.slot_layer_range(slot, layer)?;
            let from = (pos - start) * te..(pos - start + run) * te;
            for (src, section) in [(&k[from.clone()], 0), (&v[from], half)] {
                encode(self.geometry.dtype(), src, &mut buf);
                self.pool
                    .region()
                    .write(off + section + t * te * es, &buf)
                    .map_err(kvtier_transfer::TransferError::from)?;
            }
            pos += run;
        }
        Ok(())
    }

    /// Reads the K and V of the first `len` tokens of a sequence at `layer` into
    /// `[len][kv_head][dim]` f32 vectors.
    ///
    /// Cost: converts 2 × len × kv_heads × head_dim elements into two new vectors.
    ///
    /// # Errors
    /// Out-of-range slots or layers; [`EngineError::Config`] if `blocks` is too short.
    pub fn read(&self, layer: u32, blocks: &[u32], len: usize) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let te = self.token_elems;
        let bt = self.geometry.block_tokens() as usize;
        let es = self.geometry.dtype().size_bytes();
        let half = bt * te * es;
        let mut k = vec![0f32; len * te];
        let mut v = vec![0f32; len * te];
        for b in 0..len.div_ceil(bt) {
            let slot = *blocks.get(b).ok_or_else(|| {
                EngineError::Config(format!("block table of {} blocks has no block {b}", blocks.len()))
            })?;
            let run = bt.min(len - b * bt);
            let (off, _) = self.pool.slot_layer_range(slot, layer)?;
            let dst = b * bt * te..(b * bt + run) * te;
            for (out, section) in [(&mut k[dst.clone()], 0), (&mut v[dst], half)] {
                // SAFETY: the scheduler reads only its own sequences' slots, and only tokens
                // whose KV is complete: written by its own forward pass (on this thread), or
                // by a kvtier load whose LayerReady for this layer has arrived (a load's copies
                // of a layer are over by then). A chunk whose load failed stops reading at that
                // layer (the scheduler sets `skip` in `Model::forward`), and slots a failed load
                // may still write are given up until it ends, never read. The sidecar's stores
                // only read slots.
                unsafe {
                    self.pool
                        .region()
                        .with_bytes(off + section, run * te * es, |bytes| {
                            decode(self.geometry.dtype(), bytes, out)
                        })
                }
                .map_err(kvtier_transfer::TransferError::from)?;
            }
        }
        Ok((k, v))
    }
}

fn encode(dtype: Dtype, src: &[f32], out: &mut Vec<u8>) {
    out.clear();
    match dtype {
        Dtype::Bf16 => out.extend(src.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())),
        Dtype::F16 => out.extend(src.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes())),
        _ => out.extend(src.iter().flat_map(|x| x.to_le_bytes())),
    }
}

fn decode(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_through_the_pool_across_block_edges() {
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let g = KvGeometry::new(2, 2, 4, dtype, 4).unwrap();
            let pool = Arc::new(CpuDevicePool::create(None, g, 8).unwrap());
            let kv = KvSlots::new(pool).unwrap();
            let blocks = [5, 2, 7];
            let te = 8;
            // 10 tokens written in three uneven pieces, on layer 1.
            let k: Vec<f32> = (0..10 * te).map(|i| i as f32 * 0.5).collect();
            let v: Vec<f32> = (0..10 * te).map(|i| -(i as f32)).collect();
            for (a, b) in [(0, 3), (3, 9), (9, 10)] {
                kv.write(1, &blocks, a, &k[a * te..b * te], &v[a * te..b * te])
                    .unwrap();
            }
            let (rk, rv) = kv.read(1, &blocks, 10).unwrap();
            assert_eq!(
                (rk, rv),
                (k.clone(), v.clone()),
                "{dtype:?}: small integers and halves are exact"
            );
            let (rk, _) = kv.read(1, &blocks, 6).unwrap();
            assert_eq!(rk, k[..6 * te]);
            let e = kv.read(1, &blocks[..1], 6).unwrap_err().to_string();
            assert!(e.contains("no block 1"), "{e}");
        }
        let g = KvGeometry::new(1, 1, 4, Dtype::Fp8E4m3, 4).unwrap();
        let pool = Arc::new(CpuDevicePool::create(None, g, 1).unwrap());
        assert!(KvSlots::new(pool).unwrap_err().to_string().contains("fp8"));
    }
}
