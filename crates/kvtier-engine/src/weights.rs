//! Model weights: deterministic seeded random (nothing to download), or a Hugging Face model
//! directory's safetensors. Kept in f32 (the CPU computes in f32); projections that read the
//! same input are fused (q|k|v, gate|up) so each is one matrix multiply.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::EngineError;
use crate::model_config::{Mlp, ModelConfig};

/// One expert (or the dense FFN): `gate_up` is `[2 * intermediate, hidden]` (gate rows first),
/// `down` is `[hidden, intermediate]`.
#[derive(Debug, Clone)]
pub struct FfnWeights {
    /// Fused gate and up projections.
    pub gate_up: Tensor,
    /// Down projection.
    pub down: Tensor,
}

/// A layer's feed-forward weights.
#[derive(Debug, Clone)]
pub enum MlpWeights {
    /// One SwiGLU.
    Dense(FfnWeights),
    /// A router `[experts, hidden]` and the experts.
    Moe {
        /// Router logits projection.
        router: Tensor,
        /// The experts.
        experts: Vec<FfnWeights>,
    },
}

/// One decoder layer. Matrices are `[out, in]` as in Hugging Face checkpoints.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm before attention, `[hidden]`.
    pub input_norm: Tensor,
    /// Fused q|k|v projection, `[(q_heads + 2 kv_heads) * head_dim, hidden]`.
    pub qkv: Tensor,
    /// Output projection, `[hidden, q_heads * head_dim]`.
    pub o_proj: Tensor,
    /// RMSNorm of each query head, `[head_dim]`.
    pub q_norm: Tensor,
    /// RMSNorm of each key head, `[head_dim]`.
    pub k_norm: Tensor,
    /// RMSNorm before the feed-forward block, `[hidden]`.
    pub post_norm: Tensor,
    /// The feed-forward block.
    pub mlp: MlpWeights,
}

/// All weights of a model.
#[derive(Debug, Clone)]
pub struct Weights {
    /// Token embeddings, `[vocab, hidden]`.
    pub embed: Tensor,
    /// The decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm, `[hidden]`.
    pub norm: Tensor,
    /// Output projection, `[vocab, hidden]` (the embedding itself when tied).
    pub lm_head: Tensor,
}

/// Standard deviation-ish scale of random weights (uniform in ±`RANDOM_SCALE`·√3).
const RANDOM_SCALE: f32 = 0.02;

/// Random numbers per generation chunk: fixed, so the weights do not depend on thread count.
const RANDOM_CHUNK: usize = 1 << 20;

impl Weights {
    /// Deterministic random weights for `config` from `seed`: the same seed gives the same
    /// bits on every machine. Norm weights are 1.
    ///
    /// Cost: generates every parameter (4 bytes each) on all CPUs; ~1.2 G parameters for
    /// `qwen3-30b-a3b --layers 1` take a few seconds and 4.9 GB.
    ///
    /// # Errors
    /// [`EngineError::Tensor`] if memory cannot be allocated.
    pub fn random(config: &ModelConfig, seed: u64) -> Result<Self, EngineError> {
        let mut next_id = 0u64;
        let mut rand = |shape: &[usize]| -> Result<Tensor, EngineError> {
            next_id += 1;
            random_tensor(shape, seed, next_id)
        };
        let h = config.hidden;
        let ones = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu);
        let embed = rand(&[config.vocab, h])?;
        let qkv_rows = (config.q_heads + 2 * config.kv_heads) * config.head_dim;
        let mut layers = Vec::with_capacity(config.layers);
        for _ in 0..config.layers {
            let mlp = match config.mlp {
                Mlp::Dense { intermediate } => MlpWeights::Dense(FfnWeights {
                    gate_up: rand(&[2 * intermediate, h])?,
                    down: rand(&[h, intermediate])?,
                }),
                Mlp::Moe {
                    experts,
                    intermediate,
                    ..
                } => MlpWeights::Moe {
                    router: rand(&[experts, h])?,
                    experts: (0..experts)
                        .map(|_| {
                            Ok(FfnWeights {
                                gate_up: rand(&[2 * intermediate, h])?,
                                down: rand(&[h, intermediate])?,
                            })
                        })
                        .collect::<Result<_, EngineError>>()?,
                },
            };
            layers.push(LayerWeights {
                input_norm: ones(h)?,
                qkv: rand(&[qkv_rows, h])?,
                o_proj: rand(&[h, config.q_heads * config.head_dim])?,
                q_norm: ones(config.head_dim)?,
                k_norm: ones(config.head_dim)?,
                post_norm: ones(h)?,
                mlp,
            });
        }
        let lm_head = if config.tie_embeddings {
            embed.clone()
        } else {
            rand(&[config.vocab, h])?
        };
        Ok(Self {
            embed,
            layers,
            norm: ones(h)?,
            lm_head,
        })
    }

    /// Loads the first `config.layers` layers from the `*.safetensors` files of a Hugging Face
    /// model directory (Qwen3 / Qwen3-MoE tensor names), converting to f32.
    ///
    /// Cost: maps the files, reads and converts only the tensors used.
    ///
    /// # Errors
    /// [`EngineError::Io`] if the directory cannot be listed, [`EngineError::Weights`] naming
    /// a missing tensor or one whose shape disagrees with `config`.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Self, EngineError> {
        let files = safetensors_files(dir)?;
        // SAFETY: the files are mapped read-only; like every safetensors reader we assume
        // nobody truncates them while the engine loads (a changed file is the operator's error,
        // and loading copies every tensor out of the mapping before returning).
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
            .map_err(|e| EngineError::Weights(format!("{}: {e}", dir.display())))?;
        let get = |name: &str, shape: &[usize]| -> Result<Tensor, EngineError> {
            let t = st.load(name, &Device::Cpu).map_err(|_| {
                EngineError::Weights(format!("tensor {name:?} not found in {}", dir.display()))
            })?;
            if t.dims() != shape {
                return Err(EngineError::Weights(format!(
                    "tensor {name:?} has shape {:?}, the config says {shape:?}",
                    t.dims()
                )));
            }
            Ok(t.to_dtype(DType::F32)?)
        };
        let h = config.hidden;
        let (qd, kvd) = (
            config.q_heads * config.head_dim,
            config.kv_heads * config.head_dim,
        );
        let embed = get("model.embed_tokens.weight", &[config.vocab, h])?;
        let ffn = |prefix: &str, inter: usize| -> Result<FfnWeights, EngineError> {
            Ok(FfnWeights {
                gate_up: Tensor::cat(
                    &[
                        get(&format!("{prefix}.gate_proj.weight"), &[inter, h])?,
                        get(&format!("{prefix}.up_proj.weight"), &[inter, h])?,
                    ],
                    0,
                )?,
                down: get(&format!("{prefix}.down_proj.weight"), &[h, inter])?,
            })
        };
        let mut layers = Vec::with_capacity(config.layers);
        for l in 0..config.layers {
            let p = format!("model.layers.{l}");
            let mlp = match config.mlp {
                Mlp::Dense { intermediate } => MlpWeights::Dense(ffn(&format!("{p}.mlp"), intermediate)?),
                Mlp::Moe {
                    experts,
                    intermediate,
                    ..
                } => MlpWeights::Moe {
                    router: get(&format!("{p}.mlp.gate.weight"), &[experts, h])?,
                    experts: (0..experts)
                        .map(|e| ffn(&format!("{p}.mlp.experts.{e}"), intermediate))
                        .collect::<Result<_, _>>()?,
                },
            };
            layers.push(LayerWeights {
                input_norm: get(&format!("{p}.input_layernorm.weight"), &[h])?,
                qkv: Tensor::cat(
                    &[
                        get(&format!("{p}.self_attn.q_proj.weight"), &[qd, h])?,
                        get(&format!("{p}.self_attn.k_proj.weight"), &[kvd, h])?,
                        get(&format!("{p}.self_attn.v_proj.weight"), &[kvd, h])?,
                    ],
                    0,
                )?,
                o_proj: get(&format!("{p}.self_attn.o_proj.weight"), &[h, qd])?,
                q_norm: get(&format!("{p}.self_attn.q_norm.weight"), &[config.head_dim])?,
                k_norm: get(&format!("{p}.self_attn.k_norm.weight"), &[config.head_dim])?,
                post_norm: get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp,
            });
        }
        let lm_head = if config.tie_embeddings {
            embed.clone()
        } else {
            get("lm_head.weight", &[config.vocab, h])?
        };
        Ok(Self {
            embed,
            layers,
            norm: get("model.norm.weight", &[h])?,
            lm_head,
        })
    }
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let io = |e| EngineError::Io {
        path: dir.to_owned(),
        source: e,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    if files.is_empty() {
        return Err(EngineError::Weights(format!(
            "no *.safetensors file in {}",
            dir.display()
        )));
    }
    files.sort();
    Ok(files)
}

/// SplitMix64: tiny, fast, and good enough to fill weights.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A tensor of uniform values in ±`RANDOM_SCALE`·√3, from (`seed`, `id`), filled in fixed-size
/// chunks on all CPUs.
fn random_tensor(shape: &[usize], seed: u64, id: u64) -> Result<Tensor, EngineError> {
    let n: usize = shape.iter().product();
    let mut data = vec![0f32; n];
    let amp = RANDOM_SCALE * 3f32.sqrt();
    let fill = |chunk_index: usize, chunk: &mut [f32]| {
        let mut state = seed
            ^ id.wrapping_mul(0xA24B_AED4_963E_E407)
            ^ (chunk_index as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25);
        for pair in chunk.chunks_mut(2) {
            let r = splitmix(&mut state);
            for (i, x) in pair.iter_mut().enumerate() {
                // 24 random bits per value → [-1, 1).
                let bits = (r >> (32 * i + 8)) & 0xFF_FFFF;
                *x = amp * (bits as f32 / (1u32 << 23) as f32 - 1.0);
            }
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunks: Vec<(usize, &mut [f32])> = data.chunks_mut(RANDOM_CHUNK).enumerate().collect();
    if threads <= 1 || chunks.len() <= 1 {
        chunks.into_iter().for_each(|(i, c)| fill(i, c));
    } else {
        let per = chunks.len().div_ceil(threads);
        let mut groups: Vec<Vec<(usize, &mut [f32])>> = Vec::new();
        let mut it = chunks.into_iter().peekable();
        while it.peek().is_some() {
            groups.push(it.by_ref().take(per).collect());
        }
        std::thread::scope(|s| {
            for g in groups {
                s.spawn(|| g.into_iter().for_each(|(i, c)| fill(i, c)));
            }
        });
    }
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// A model by preset name or Hugging Face directory: its configuration (cut to `layers` if
/// given) and weights (seeded random for a preset, the directory's safetensors otherwise).
/// Returns the directory too (for its tokenizer).
///
/// # Errors
/// [`EngineError::Config`] for a name that is neither a preset nor a directory, and the
/// errors of reading the configuration and the weights.
pub fn load_model(
    model: &str,
    layers: Option<usize>,
    seed: u64,
) -> Result<(ModelConfig, Weights, Option<PathBuf>), EngineError> {
    let dir = Path::new(model);
    let from_dir = dir.join("config.json").is_file();
    let mut config = if from_dir {
        ModelConfig::from_hf_config(&dir.join("config.json"))?
    } else if crate::PRESETS.contains(&model) {
        ModelConfig::preset(model)?
    } else if dir.is_dir() {
        return Err(EngineError::Config(format!(
            "{model}: a model directory needs a config.json"
        )));
    } else {
        return Err(EngineError::Config(format!(
            "unknown model {model:?}: give a preset ({}) or a Hugging Face model directory",
            crate::PRESETS.join(", ")
        )));
    };
    if let Some(l) = layers {
        config = config.with_layers(l)?;
    }
    let weights = if from_dir {
        Weights::load(dir, &config)?
    } else {
        Weights::random(&config, seed)?
    };
    Ok((config, weights, from_dir.then(|| dir.to_owned())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_weights_are_deterministic_and_shaped() {
        let c = ModelConfig::preset("tiny-moe").unwrap();
        let a = Weights::random(&c, 7).unwrap();
        let b = Weights::random(&c, 7).unwrap();
        let d = Weights::random(&c, 8).unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(&a.layers[1].qkv), v(&b.layers[1].qkv));
        assert_ne!(v(&a.layers[1].qkv), v(&d.layers[1].qkv));
        assert_eq!(a.layers[0].qkv.dims(), &[(4 + 2 * 2) * 16, 64]);
        let MlpWeights::Moe { router, experts } = &a.layers[0].mlp else {
            panic!("tiny-moe is MoE")
        };
        assert_eq!((router.dims(), experts.len()), (&[8, 64][..], 8));
        assert_eq!(experts[3].gate_up.dims(), &[64, 64]);
        let x = v(&a.embed);
        let mean = x.iter().sum::<f32>() / x.len() as f32;
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            mean.abs() < 0.002 && max <= 0.0347 && max > 0.03,
            "mean {mean} max {max}"
        );
    }

    #[test]
    fn a_directory_without_weights_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let c = ModelConfig::preset("tiny").unwrap();
        let e = Weights::load(dir.path(), &c).unwrap_err().to_string();
        assert!(e.contains("no *.safetensors"), "{e}");
    }
}

#[cfg(test)]
mod hf_tests {
    use std::collections::HashMap;

    use super::*;

    /// Writes `w` as a Hugging Face checkpoint (bf16, split q/k/v and gate/up, two shards).
    fn save_hf(dir: &Path, c: &ModelConfig, w: &Weights) {
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let (qd, kvd) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut a: HashMap<String, Tensor> = HashMap::new();
        let mut b: HashMap<String, Tensor> = HashMap::new();
        a.insert("model.embed_tokens.weight".into(), bf(&w.embed));
        b.insert("model.norm.weight".into(), bf(&w.norm));
        b.insert("lm_head.weight".into(), bf(&w.lm_head));
        for (l, lw) in w.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let m = if l == 0 { &mut a } else { &mut b };
            m.insert(format!("{p}.input_layernorm.weight"), bf(&lw.input_norm));
            m.insert(format!("{p}.post_attention_layernorm.weight"), bf(&lw.post_norm));
            m.insert(
                format!("{p}.self_attn.q_proj.weight"),
                bf(&lw.qkv.narrow(0, 0, qd).unwrap()),
            );
            m.insert(
                format!("{p}.self_attn.k_proj.weight"),
                bf(&lw.qkv.narrow(0, qd, kvd).unwrap()),
            );
            m.insert(
                format!("{p}.self_attn.v_proj.weight"),
                bf(&lw.qkv.narrow(0, qd + kvd, kvd).unwrap()),
            );
            m.insert(format!("{p}.self_attn.o_proj.weight"), bf(&lw.o_proj));
            m.insert(format!("{p}.self_attn.q_norm.weight"), bf(&lw.q_norm));
            m.insert(format!("{p}.self_attn.k_norm.weight"), bf(&lw.k_norm));
            let ffn = |m: &mut HashMap<String, Tensor>, prefix: &str, f: &FfnWeights| {
                let i = f.down.dim(1).unwrap();
                m.insert(
                    format!("{prefix}.gate_proj.weight"),
                    bf(&f.gate_up.narrow(0, 0, i).unwrap()),
                );
                m.insert(
                    format!("{prefix}.up_proj.weight"),
                    bf(&f.gate_up.narrow(0, i, i).unwrap()),
                );
                m.insert(format!("{prefix}.down_proj.weight"), bf(&f.down));
            };
            match &lw.mlp {
                MlpWeights::Dense(f) => ffn(m, &format!("{p}.mlp"), f),
                MlpWeights::Moe { router, experts } => {
                    m.insert(format!("{p}.mlp.gate.weight"), bf(router));
                    for (e, f) in experts.iter().enumerate() {
                        ffn(m, &format!("{p}.mlp.experts.{e}"), f);
                    }
                }
            }
        }
        candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
        candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    }

    #[test]
    fn a_hugging_face_directory_loads_to_the_same_weights() {
        let dir = tempfile::tempdir().unwrap();
        let c = ModelConfig::preset("tiny-moe").unwrap();
        let w = Weights::random(&c, 9).unwrap();
        save_hf(dir.path(), &c, &w);
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "num_hidden_layers": 2, "vocab_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 4096, "eos_token_id": 511}"#,
        )
        .unwrap();
        let (lc, lw, d) = load_model(dir.path().to_str().unwrap(), Some(1), 0).unwrap();
        assert_eq!((lc.layers, lc.mlp, d.as_deref()), (1, c.mlp, Some(dir.path())));
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // bf16 in the file: equal to the f32 originals rounded to bf16.
        let round = |t: &Tensor| v(&t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap());
        assert_eq!(v(&lw.layers[0].qkv), round(&w.layers[0].qkv));
        assert_eq!(v(&lw.lm_head), round(&w.lm_head));
        let (MlpWeights::Moe { experts: a, .. }, MlpWeights::Moe { experts: b, .. }) =
            (&lw.layers[0].mlp, &w.layers[0].mlp)
        else {
            panic!("MoE")
        };
        assert_eq!(v(&a[5].gate_up), round(&b[5].gate_up));
        // A missing tensor is named.
        std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
        let e = load_model(dir.path().to_str().unwrap(), None, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not found"), "{e}");
        let e = load_model("no-such-model", None, 0).unwrap_err().to_string();
        assert!(e.contains("unknown model") && e.contains("tiny"), "{e}");
    }
}
