//! The forward pass of a Qwen3-family decoder over paged KV.
//!
//! One call runs a batch of sequence chunks — prefill chunks and single decode tokens mixed —
//! through every layer: the projections and the feed-forward block see all tokens of the batch
//! as one matrix; attention runs per sequence against its KV read back from the device pool.
//! New K and V are written to the pool before attention reads the context, so a token's
//! attention sees the same (pool-dtype) KV whether its prefix was computed in this call, in an
//! earlier one, or loaded from a kvtier tier.

use candle_core::{Device, Tensor};

use crate::EngineError;
use crate::kv_slots::KvSlots;
use crate::model_config::{Mlp, ModelConfig};
use crate::weights::{FfnWeights, LayerWeights, MlpWeights, Weights};

/// The device every tensor lives on (the one place to change for CUDA).
pub fn compute_device() -> Device {
    Device::Cpu
}

/// One sequence's part of a batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Tokens to run, at positions `start ..`.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`: tokens `0 .. start` already have KV in the pool.
    pub start: usize,
    /// The sequence's block table, covering at least `start + tokens.len()` tokens.
    pub blocks: &'a [u32],
    /// Return the logits after the chunk's last token.
    pub logits: bool,
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    weights: Weights,
    /// `[max_positions, head_dim / 2]` rotary tables.
    cos: Tensor,
    sin: Tensor,
    /// Attention scores computed at once, at most.
    score_floats: usize,
}

/// What [`Model::forward`] calls before each layer: `(layer, skip)`, where setting `skip[c]`
/// stops chunk `c` reading KV.
pub type BeforeLayer<'a> = dyn FnMut(usize, &mut [bool]) -> Result<(), EngineError> + 'a;

impl Model {
    /// A model from its configuration and weights; precomputes the rotary tables.
    ///
    /// # Errors
    /// [`EngineError::Config`] for an invalid configuration.
    pub fn new(config: ModelConfig, weights: Weights) -> Result<Self, EngineError> {
        config.validate()?;
        let half = config.head_dim / 2;
        let positions = config.max_positions;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                let inv_freq = 1.0 / config.rope_theta.powf(2.0 * i as f64 / config.head_dim as f64);
                let angle = p as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let dev = compute_device();
        Ok(Self {
            cos: Tensor::from_vec(cos, (positions, half), &dev)?,
            sin: Tensor::from_vec(sin, (positions, half), &dev)?,
            config,
            weights,
            score_floats: ATTN_SCORE_FLOATS,
        })
    }

    /// Bounds the attention scores computed at once (tests force many query blocks).
    #[cfg(test)]
    fn set_score_floats(&mut self, floats: usize) {
        self.score_floats = floats;
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs `batch` through the model, writing each token's K and V into the pool, and
    /// returns the logits (`vocab` floats) of each chunk that asked for them, in batch order.
    ///
    /// `before_layer(l, skip)` is called before layer `l` reads any KV: a load that streams KV
    /// in layer by layer waits there, so layer `l` computes while later layers still arrive.
    /// Setting `skip[c]` stops chunk `c` reading its context's KV from then on (its load
    /// failed, so its slots may still be written; the chunk's output is garbage, to be redone).
    ///
    /// Cost: the model's arithmetic for every token; per sequence and layer, the context's KV
    /// is read back and converted to f32.
    ///
    /// # Errors
    /// [`EngineError::BadRequest`] for a token id outside the vocabulary or a position past
    /// `max_positions`; tensor and pool errors.
    pub fn forward(
        &self,
        kv: &KvSlots,
        batch: &[SeqChunk<'_>],
        before_layer: &mut BeforeLayer<'_>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let c = &self.config;
        let dev = compute_device();
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for chunk in batch {
            if chunk.tokens.is_empty() {
                return Err(EngineError::BadRequest("empty chunk in a batch".into()));
            }
            let end = chunk.start + chunk.tokens.len();
            if end > c.max_positions {
                return Err(EngineError::BadRequest(format!(
                    "sequence of {end} tokens exceeds the model's {} positions",
                    c.max_positions
                )));
            }
            if let Some(bad) = chunk.tokens.iter().find(|t| **t as usize >= c.vocab) {
                return Err(EngineError::BadRequest(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    c.vocab
                )));
            }
            ids.extend_from_slice(chunk.tokens);
            positions.extend((chunk.start..end).map(|p| p as u32));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let total = ids.len();
        let ids = Tensor::from_vec(ids, total, &dev)?;
        let pos = Tensor::from_vec(positions, total, &dev)?;
        let cos = self.cos.index_select(&pos, 0)?;
        let sin = self.sin.index_select(&pos, 0)?;
        let mut x = self.weights.embed.index_select(&ids, 0)?;
        let mut skip = vec![false; batch.len()];
        for (l, layer) in self.weights.layers.iter().enumerate() {
            before_layer(l, &mut skip)?;
            x = self.layer(l, layer, kv, batch, &skip, &x, &cos, &sin)?;
        }
        // Logits of the last token of each chunk that wants them.
        let mut rows = Vec::new();
        let mut end = 0u32;
        for chunk in batch {
            end += chunk.tokens.len() as u32;
            if chunk.logits {
                rows.push(end - 1);
            }
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let n = rows.len();
        let last = x.index_select(&Tensor::from_vec(rows, n, &dev)?, 0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.weights.norm, c.rms_eps as f32)?;
        let logits = last.matmul(&self.weights.lm_head.t()?)?;
        Ok(logits.to_vec2::<f32>()?)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        l: usize,
        w: &LayerWeights,
        kv: &KvSlots,
        batch: &[SeqChunk<'_>],
        skip: &[bool],
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor, EngineError> {
        let c = &self.config;
        let eps = c.rms_eps as f32;
        let total = x.dim(0)?;
        let (qh, kvh, hd) = (c.q_heads, c.kv_heads, c.head_dim);
        let h = candle_nn::ops::rms_norm(x, &w.input_norm, eps)?;
        let qkv = h.matmul(&w.qkv.t()?)?;
        let q = qkv.narrow(1, 0, qh * hd)?.reshape((total, qh, hd))?;
        let k = qkv.narrow(1, qh * hd, kvh * hd)?.reshape((total, kvh, hd))?;
        let v = qkv.narrow(1, (qh + kvh) * hd, kvh * hd)?.contiguous()?;
        let q = candle_nn::ops::rms_norm(&q.contiguous()?, &w.q_norm, eps)?;
        let k = candle_nn::ops::rms_norm(&k.contiguous()?, &w.k_norm, eps)?;
        // rope wants [batch, heads, seq, dim]; every token carries its own position.
        let q = candle_nn::rotary_emb::rope(&q.transpose(0, 1)?.unsqueeze(0)?.contiguous()?, cos, sin)?
            .squeeze(0)?;
        let k = candle_nn::rotary_emb::rope(&k.transpose(0, 1)?.unsqueeze(0)?.contiguous()?, cos, sin)?
            .squeeze(0)?
            .transpose(0, 1)?
            .contiguous()?;
        // [total, kvh * hd] rows, to write into the pool.
        let k_rows = k.flatten_all()?.to_vec1::<f32>()?;
        let v_rows = v.flatten_all()?.to_vec1::<f32>()?;
        let te = kvh * hd;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut outs = Vec::with_capacity(batch.len());
        let mut row = 0;
        for (chunk, &skip) in batch.iter().zip(skip) {
            let n = chunk.tokens.len();
            let rows = row * te..(row + n) * te;
            kv.write(
                l as u32,
                chunk.blocks,
                chunk.start,
                &k_rows[rows.clone()],
                &v_rows[rows],
            )?;
            let ctx = chunk.start + n;
            let (kc, vc) = if skip {
                (vec![0f32; ctx * te], vec![0f32; ctx * te])
            } else {
                kv.read(l as u32, chunk.blocks, ctx)?
            };
            let dev = compute_device();
            // [kvh, ctx, hd]
            let kc = Tensor::from_vec(kc, (ctx, kvh, hd), &dev)?
                .transpose(0, 1)?
                .contiguous()?;
            let vc = Tensor::from_vec(vc, (ctx, kvh, hd), &dev)?
                .transpose(0, 1)?
                .contiguous()?;
            // Queries in blocks, so the scores stay small (large temporaries cost page faults
            // on every allocation) and each block reads only the keys it can see.
            let q_block = (self.score_floats / (qh * ctx)).clamp(1, n);
            let mut a = 0;
            while a < n {
                let m = q_block.min(n - a);
                let visible = chunk.start + a + m;
                // Query heads of one kv head are adjacent: [qh, m, hd] → [kvh, group·m, hd].
                let qs = q
                    .narrow(1, row + a, m)?
                    .contiguous()?
                    .reshape((kvh, c.group() * m, hd))?;
                // Views (no copy): matmul takes the batch stride of the full context.
                let (kv_k, kv_v) = (kc.narrow(1, 0, visible)?, vc.narrow(1, 0, visible)?);
                let scores = (qs.matmul(&kv_k.t()?)? * scale)?;
                let scores = if m > 1 {
                    let mask = causal_mask(m, chunk.start + a, &dev)?;
                    scores
                        .reshape((kvh, c.group(), m, visible))?
                        .broadcast_add(&mask)?
                        .reshape((kvh, c.group() * m, visible))?
                } else {
                    scores
                };
                let p = candle_nn::ops::softmax_last_dim(&scores)?;
                let o = p
                    .matmul(&kv_v)?
                    .reshape((qh, m, hd))?
                    .transpose(0, 1)?
                    .reshape((m, qh * hd))?;
                outs.push(o);
                a += m;
            }
            row += n;
        }
        let attn = Tensor::cat(&outs, 0)?;
        let x = (x + attn.matmul(&w.o_proj.t()?)?)?;
        let h = candle_nn::ops::rms_norm(&x, &w.post_norm, eps)?;
        let m = match (&w.mlp, c.mlp) {
            (MlpWeights::Dense(f), _) => ffn(&h, f)?,
            (
                MlpWeights::Moe { router, experts },
                Mlp::Moe {
                    top_k,
                    norm_topk_prob,
                    ..
                },
            ) => moe(&h, router, experts, top_k, norm_topk_prob)?,
            (MlpWeights::Moe { .. }, Mlp::Dense { .. }) => {
                return Err(EngineError::Config("MoE weights with a dense config".into()));
            }
        };
        Ok((x + m)?)
    }
}

/// Attention scores computed at once, at most (16 MiB of f32).
const ATTN_SCORE_FLOATS: usize = 4 << 20;

/// `[n, start + n]`: row i (position start + i) sees columns 0 ..= start + i.
fn causal_mask(n: usize, start: usize, dev: &Device) -> Result<Tensor, EngineError> {
    let ctx = start + n;
    let mut m = vec![0f32; n * ctx];
    for i in 0..n {
        for v in &mut m[i * ctx + start + i + 1..(i + 1) * ctx] {
            *v = f32::NEG_INFINITY;
        }
    }
    Ok(Tensor::from_vec(m, (n, ctx), dev)?)
}

/// SwiGLU: down(silu(gate(x)) · up(x)).
fn ffn(x: &Tensor, w: &FfnWeights) -> Result<Tensor, EngineError> {
    let inter = w.down.dim(1)?;
    let gu = x.matmul(&w.gate_up.t()?)?;
    let a = (gu.narrow(1, 0, inter)?.silu()? * gu.narrow(1, inter, inter)?)?;
    Ok(a.matmul(&w.down.t()?)?)
}

/// Mixture of experts: softmax router, top-k per token, each expert runs once on the tokens
/// routed to it, outputs summed with the router weights.
fn moe(
    x: &Tensor,
    router: &Tensor,
    experts: &[FfnWeights],
    top_k: usize,
    norm: bool,
) -> Result<Tensor, EngineError> {
    let (total, hidden) = x.dims2()?;
    let probs = candle_nn::ops::softmax_last_dim(&x.matmul(&router.t()?)?)?.to_vec2::<f32>()?;
    let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); experts.len()];
    let mut order: Vec<usize> = Vec::with_capacity(experts.len());
    for (t, p) in probs.iter().enumerate() {
        order.clear();
        order.extend(0..p.len());
        // Highest probability first; ties to the lower expert index (deterministic).
        order.select_nth_unstable_by(top_k - 1, |a, b| p[*b].total_cmp(&p[*a]).then(a.cmp(b)));
        let chosen = &order[..top_k];
        let sum: f32 = if norm {
            chosen.iter().map(|e| p[*e]).sum()
        } else {
            1.0
        };
        for &e in chosen {
            routed[e].0.push(t as u32);
            routed[e].1.push(p[e] / sum);
        }
    }
    let mut out = vec![0f32; total * hidden];
    let dev = x.device();
    for (e, (tokens, weights)) in routed.into_iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let n = tokens.len();
        let xe = x.index_select(&Tensor::from_vec(tokens.clone(), n, dev)?, 0)?;
        let y = ffn(&xe, &experts[e])?.flatten_all()?.to_vec1::<f32>()?;
        for ((t, w), yr) in tokens.iter().zip(&weights).zip(y.chunks_exact(hidden)) {
            let o = &mut out[*t as usize * hidden..(*t as usize + 1) * hidden];
            for (o, y) in o.iter_mut().zip(yr) {
                *o += w * y;
            }
        }
    }
    Ok(Tensor::from_vec(out, (total, hidden), dev)?)
}

/// Index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Largest absolute difference between two logit vectors.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvtier_core::{Dtype, KvGeometry};
    use kvtier_transfer::CpuDevicePool;

    use super::*;

    fn mat(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2::<f32>().unwrap()
    }

    /// `w` is `[out][in]`.
    fn matvec(w: &[Vec<f32>], x: &[f32]) -> Vec<f32> {
        w.iter()
            .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    fn rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * r * w).collect()
    }

    fn silu(x: f32) -> f32 {
        x / (1.0 + (-x).exp())
    }

    fn swiglu(f: &FfnWeights, x: &[f32]) -> Vec<f32> {
        let gu = matvec(&mat(&f.gate_up), x);
        let i = gu.len() / 2;
        let a: Vec<f32> = (0..i).map(|j| silu(gu[j]) * gu[i + j]).collect();
        matvec(&mat(&f.down), &a)
    }

    /// Rotate-half RoPE of one head at position `p`.
    fn rope(x: &mut [f32], p: usize, theta: f64) {
        let half = x.len() / 2;
        for i in 0..half {
            let a = p as f64 / theta.powf(2.0 * i as f64 / x.len() as f64);
            let (c, s) = (a.cos() as f32, a.sin() as f32);
            let (x0, x1) = (x[i], x[i + half]);
            x[i] = x0 * c - x1 * s;
            x[i + half] = x1 * c + x0 * s;
        }
    }

    /// A plain scalar implementation of the whole model, no paging, no batching: the
    /// definition the candle forward pass must agree with. Returns the last token's logits.
    #[allow(clippy::needless_range_loop)]
    fn reference(c: &ModelConfig, w: &Weights, tokens: &[u32]) -> Vec<f32> {
        let eps = c.rms_eps as f32;
        let (qh, kvh, hd) = (c.q_heads, c.kv_heads, c.head_dim);
        let embed = mat(&w.embed);
        let mut xs: Vec<Vec<f32>> = tokens.iter().map(|t| embed[*t as usize].clone()).collect();
        for lw in &w.layers {
            let v1 = |t: &Tensor| t.to_vec1::<f32>().unwrap();
            let qkv_w = mat(&lw.qkv);
            let (mut ks, mut vs, mut qs) = (Vec::new(), Vec::new(), Vec::new());
            for (p, x) in xs.iter().enumerate() {
                let qkv = matvec(&qkv_w, &rms(x, &v1(&lw.input_norm), eps));
                let mut q: Vec<Vec<f32>> = (0..qh)
                    .map(|h| rms(&qkv[h * hd..(h + 1) * hd], &v1(&lw.q_norm), eps))
                    .collect();
                let mut k: Vec<Vec<f32>> = (0..kvh)
                    .map(|h| rms(&qkv[(qh + h) * hd..(qh + h + 1) * hd], &v1(&lw.k_norm), eps))
                    .collect();
                let v: Vec<Vec<f32>> = (0..kvh)
                    .map(|h| qkv[(qh + kvh + h) * hd..(qh + kvh + h + 1) * hd].to_vec())
                    .collect();
                q.iter_mut()
                    .chain(k.iter_mut())
                    .for_each(|h| rope(h, p, c.rope_theta));
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            let o_w = mat(&lw.o_proj);
            let mut next = Vec::new();
            for (p, x) in xs.iter().enumerate() {
                let mut attn = Vec::new();
                for h in 0..qh {
                    let g = h / c.group();
                    let scores: Vec<f32> = (0..=p)
                        .map(|j| {
                            qs[p][h].iter().zip(&ks[j][g]).map(|(a, b)| a * b).sum::<f32>()
                                / (hd as f32).sqrt()
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f32 = e.iter().sum();
                    attn.extend((0..hd).map(|d| (0..=p).map(|j| e[j] / z * vs[j][g][d]).sum::<f32>()));
                }
                let x1: Vec<f32> = x.iter().zip(matvec(&o_w, &attn)).map(|(a, b)| a + b).collect();
                let h2 = rms(&x1, &v1(&lw.post_norm), eps);
                let m = match (&lw.mlp, c.mlp) {
                    (MlpWeights::Dense(f), _) => swiglu(f, &h2),
                    (MlpWeights::Moe { router, experts }, Mlp::Moe { top_k, .. }) => {
                        let logits = matvec(&mat(router), &h2);
                        let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let e: Vec<f32> = logits.iter().map(|l| (l - mx).exp()).collect();
                        let z: f32 = e.iter().sum();
                        let mut idx: Vec<usize> = (0..e.len()).collect();
                        idx.sort_by(|a, b| e[*b].total_cmp(&e[*a]));
                        let top = &idx[..top_k];
                        let s: f32 = top.iter().map(|i| e[*i] / z).sum();
                        let mut out = vec![0f32; h2.len()];
                        for &i in top {
                            for (o, y) in out.iter_mut().zip(swiglu(&experts[i], &h2)) {
                                *o += e[i] / z / s * y;
                            }
                        }
                        out
                    }
                    _ => unreachable!(),
                };
                next.push(x1.iter().zip(m).map(|(a, b)| a + b).collect());
            }
            xs = next;
        }
        let last = rms(xs.last().unwrap(), &w.norm.to_vec1::<f32>().unwrap(), eps);
        matvec(&mat(&w.lm_head), &last)
    }

    fn setup(preset: &str, dtype: Dtype) -> (Model, KvSlots, Weights) {
        let c = ModelConfig::preset(preset).unwrap();
        let w = Weights::random(&c, 11).unwrap();
        let g = KvGeometry::new(c.layers as u32, c.kv_heads as u32, c.head_dim as u32, dtype, 4).unwrap();
        let kv = KvSlots::new(Arc::new(CpuDevicePool::create(None, g, 16).unwrap())).unwrap();
        (Model::new(c, w.clone()).unwrap(), kv, w)
    }

    fn run(m: &Model, kv: &KvSlots, chunks: &[SeqChunk<'_>]) -> Vec<Vec<f32>> {
        m.forward(kv, chunks, &mut |_, _| Ok(())).unwrap()
    }

    #[test]
    fn forward_matches_the_scalar_reference_dense_and_moe() {
        let tokens: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 500).collect();
        for preset in ["tiny", "tiny-moe"] {
            let (m, kv, w) = setup(preset, Dtype::F32);
            let want = reference(m.config(), &w, &tokens);
            let blocks = [3, 9, 0];
            let got = run(
                &m,
                &kv,
                &[SeqChunk {
                    tokens: &tokens,
                    start: 0,
                    blocks: &blocks,
                    logits: true,
                }],
            );
            let d = max_abs_diff(&got[0], &want);
            assert!(d < 1e-4, "{preset}: max |Δlogit| {d}");
            assert_eq!(argmax(&got[0]), argmax(&want));
            // One query row per attention block: every block reads a prefix view of the keys.
            let mut m = m;
            m.set_score_floats(1);
            let got = run(
                &m,
                &kv,
                &[SeqChunk {
                    tokens: &tokens,
                    start: 0,
                    blocks: &blocks,
                    logits: true,
                }],
            );
            let d = max_abs_diff(&got[0], &want);
            assert!(d < 1e-4, "{preset}, blocked attention: max |Δlogit| {d}");
        }
    }

    #[test]
    fn chunked_prefill_decode_and_batching_agree_with_one_pass() {
        let tokens: Vec<u32> = (0..14).map(|i| (i * 91 + 3) % 500).collect();
        let (m, kv, _) = setup("tiny-moe", Dtype::Bf16);
        let a = [0, 1, 2, 3];
        let one = run(
            &m,
            &kv,
            &[SeqChunk {
                tokens: &tokens,
                start: 0,
                blocks: &a,
                logits: true,
            }],
        );
        // Same sequence in other slots: 5 + 6 tokens, then 3 single-token decode steps, each
        // batched with an unrelated sequence.
        let b = [7, 5, 6, 4];
        let other: Vec<u32> = vec![1, 2, 3, 4, 5];
        let o = [10, 11];
        run(
            &m,
            &kv,
            &[SeqChunk {
                tokens: &tokens[..5],
                start: 0,
                blocks: &b,
                logits: false,
            }],
        );
        run(
            &m,
            &kv,
            &[
                SeqChunk {
                    tokens: &other,
                    start: 0,
                    blocks: &o,
                    logits: true,
                },
                SeqChunk {
                    tokens: &tokens[5..11],
                    start: 5,
                    blocks: &b,
                    logits: false,
                },
            ],
        );
        let mut last = Vec::new();
        for p in 11..14 {
            let r = run(
                &m,
                &kv,
                &[
                    SeqChunk {
                        tokens: &tokens[p..=p],
                        start: p,
                        blocks: &b,
                        logits: true,
                    },
                    SeqChunk {
                        tokens: &other[4..5],
                        start: 4,
                        blocks: &o,
                        logits: true,
                    },
                ],
            );
            last = r[0].clone();
        }
        let d = max_abs_diff(&one[0], &last);
        assert!(d < 1e-3, "max |Δlogit| {d}");
        assert_eq!(argmax(&one[0]), argmax(&last));
    }

    #[test]
    fn bad_tokens_and_positions_are_refused() {
        let (m, kv, _) = setup("tiny", Dtype::Bf16);
        let blocks = [0];
        let e = m
            .forward(
                &kv,
                &[SeqChunk {
                    tokens: &[512],
                    start: 0,
                    blocks: &blocks,
                    logits: true,
                }],
                &mut |_, _| Ok(()),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("token id 512"), "{e}");
        let e = m
            .forward(
                &kv,
                &[SeqChunk {
                    tokens: &[1],
                    start: 4096,
                    blocks: &blocks,
                    logits: true,
                }],
                &mut |_, _| Ok(()),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("4097 tokens"), "{e}");
    }
}
