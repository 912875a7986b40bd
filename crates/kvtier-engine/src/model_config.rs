//! The model's shape: presets of the Qwen3 family, or a Hugging Face `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::EngineError;

/// The feed-forward block of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Mlp {
    /// SwiGLU with one hidden size.
    Dense {
        /// Hidden size of the FFN.
        intermediate: usize,
    },
    /// Mixture of experts: a softmax router picks `top_k` of `experts` SwiGLU experts per token.
    Moe {
        /// Number of experts.
        experts: usize,
        /// Experts per token.
        top_k: usize,
        /// Hidden size of each expert.
        intermediate: usize,
        /// Renormalize the top-k router weights to sum to 1 (Qwen3-MoE does).
        norm_topk_prob: bool,
    },
}

/// A Qwen3-family decoder: pre-norm attention with RMSNorm on q and k (per head), rotary
/// position embedding (rotate-half), grouped-query attention, SwiGLU or MoE feed-forward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// The preset or directory this came from (also the model id of kvtier namespaces).
    pub name: String,
    /// Decoder layers.
    pub layers: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads (grouped-query attention: `q_heads` is a multiple of it).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// The feed-forward block.
    pub mlp: Mlp,
    /// The output projection is the embedding matrix.
    pub tie_embeddings: bool,
    /// Longest sequence (prompt + output) the engine accepts.
    pub max_positions: usize,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
}

/// Names of the built-in presets, for help texts and errors.
pub const PRESETS: &[&str] = &["qwen3-30b-a3b", "qwen3-0.6b", "tiny", "tiny-moe"];

impl ModelConfig {
    /// A built-in preset: `qwen3-30b-a3b` (48 layers, hidden 2048, 32/4 heads of 128, 128
    /// experts top-8 of width 768), `qwen3-0.6b` (28 layers, hidden 1024, 16/8 heads of 128,
    /// dense 3072), and the test models `tiny` (dense) and `tiny-moe`.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the unknown preset and the known ones.
    pub fn preset(name: &str) -> Result<Self, EngineError> {
        let qwen = |layers, hidden, q_heads, kv_heads, mlp, tie| ModelConfig {
            name: name.to_owned(),
            layers,
            hidden,
            q_heads,
            kv_heads,
            head_dim: 128,
            vocab: 151_936,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-6,
            mlp,
            tie_embeddings: tie,
            max_positions: 40_960,
            // <|im_end|>, <|endoftext|>
            eos_token_ids: vec![151_645, 151_643],
        };
        let tiny = |mlp| ModelConfig {
            name: name.to_owned(),
            layers: 2,
            hidden: 64,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 512,
            rope_theta: 10_000.0,
            rms_eps: 1e-6,
            mlp,
            tie_embeddings: false,
            max_positions: 4096,
            eos_token_ids: vec![511],
        };
        Ok(match name {
            "qwen3-30b-a3b" => qwen(
                48,
                2048,
                32,
                4,
                Mlp::Moe {
                    experts: 128,
                    top_k: 8,
                    intermediate: 768,
                    norm_topk_prob: true,
                },
                false,
            ),
            "qwen3-0.6b" => qwen(28, 1024, 16, 8, Mlp::Dense { intermediate: 3072 }, true),
            "tiny" => tiny(Mlp::Dense { intermediate: 128 }),
            "tiny-moe" => tiny(Mlp::Moe {
                experts: 8,
                top_k: 2,
                intermediate: 32,
                norm_topk_prob: true,
            }),
            other => {
                return Err(EngineError::Config(format!(
                    "unknown model preset {other:?}: known presets are {}",
                    PRESETS.join(", ")
                )));
            }
        })
    }

    /// Reads a Hugging Face `config.json` of a Qwen3 or Qwen3-MoE model.
    ///
    /// # Errors
    /// [`EngineError::Io`] if the file cannot be read, [`EngineError::Config`] naming the
    /// missing or bad field.
    pub fn from_hf_config(path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::Io {
            path: path.to_owned(),
            source: e,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| EngineError::Config(format!("{}: not JSON: {e}", path.display())))?;
        let field = |k: &str| -> Result<&serde_json::Value, EngineError> {
            v.get(k)
                .ok_or_else(|| EngineError::Config(format!("{}: missing {k:?}", path.display())))
        };
        let usize_of = |k: &str| -> Result<usize, EngineError> {
            field(k)?.as_u64().map(|x| x as usize).ok_or_else(|| {
                EngineError::Config(format!("{}: {k:?} is not a non-negative integer", path.display()))
            })
        };
        let hidden = usize_of("hidden_size")?;
        let q_heads = usize_of("num_attention_heads")?;
        let head_dim = match v.get("head_dim") {
            Some(_) => usize_of("head_dim")?,
            None => hidden / q_heads.max(1),
        };
        let experts = v
            .get("num_experts")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0) as usize;
        let mlp = if experts > 0 {
            if v.get("decoder_sparse_step")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(1)
                != 1
                || v.get("mlp_only_layers")
                    .and_then(serde_json::Value::as_array)
                    .is_some_and(|a| !a.is_empty())
            {
                return Err(EngineError::Config(format!(
                    "{}: mixed dense/sparse layers (decoder_sparse_step, mlp_only_layers) are not supported",
                    path.display()
                )));
            }
            Mlp::Moe {
                experts,
                top_k: usize_of("num_experts_per_tok")?,
                intermediate: usize_of("moe_intermediate_size")?,
                norm_topk_prob: v
                    .get("norm_topk_prob")
                    .and_then(serde_json::Value::as_bool)
                    .unwrap_or(true),
            }
        } else {
            Mlp::Dense {
                intermediate: usize_of("intermediate_size")?,
            }
        };
        let eos_token_ids = match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(serde_json::Value::Array(a)) => {
                a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect()
            }
            _ => Vec::new(),
        };
        let name = path
            .parent()
            .and_then(Path::file_name)
            .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned());
        let c = ModelConfig {
            name,
            layers: usize_of("num_hidden_layers")?,
            hidden,
            q_heads,
            kv_heads: usize_of("num_key_value_heads")?,
            head_dim,
            vocab: usize_of("vocab_size")?,
            rope_theta: v
                .get("rope_theta")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(10_000.0),
            rms_eps: v
                .get("rms_norm_eps")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(1e-6),
            mlp,
            tie_embeddings: v
                .get("tie_word_embeddings")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
            max_positions: v
                .get("max_position_embeddings")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(32_768) as usize,
            eos_token_ids,
        };
        c.validate()?;
        Ok(c)
    }

    /// Keeps only the first `layers` layers (as the seed experiment ran Qwen3-30B-A3B with 1).
    ///
    /// # Errors
    /// [`EngineError::Config`] if `layers` is 0 or more than the model has.
    pub fn with_layers(mut self, layers: usize) -> Result<Self, EngineError> {
        if layers == 0 || layers > self.layers {
            return Err(EngineError::Config(format!(
                "--layers {layers}: the model has {} layers; keep between 1 and {}",
                self.layers, self.layers
            )));
        }
        if layers != self.layers {
            self.name = format!("{}@{layers}l", self.name);
            self.layers = layers;
        }
        Ok(self)
    }

    /// Checks that the shape is one the forward pass can run.
    ///
    /// # Errors
    /// [`EngineError::Config`] naming the first bad field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |what: String| Err(EngineError::Config(format!("model {:?}: {what}", self.name)));
        if self.layers == 0 || self.hidden == 0 || self.vocab == 0 || self.q_heads == 0 || self.kv_heads == 0
        {
            return bad("layers, hidden, vocab and head counts must be positive".into());
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even and positive", self.head_dim));
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} kv heads",
                self.q_heads, self.kv_heads
            ));
        }
        if let Mlp::Moe {
            experts,
            top_k,
            intermediate,
            ..
        } = self.mlp
            && (top_k == 0 || top_k > experts || intermediate == 0)
        {
            return bad(format!(
                "top_k {top_k} of {experts} experts of width {intermediate}"
            ));
        }
        if let Mlp::Dense { intermediate: 0 } = self.mlp {
            return bad("intermediate size 0".into());
        }
        Ok(())
    }

    /// Parameters, for logs and memory estimates.
    pub fn parameters(&self) -> u64 {
        let h = self.hidden as u64;
        let attn =
            h * (self.q_heads * self.head_dim) as u64 * 2 + h * (self.kv_heads * self.head_dim) as u64 * 2;
        let mlp = match self.mlp {
            Mlp::Dense { intermediate } => 3 * h * intermediate as u64,
            Mlp::Moe {
                experts,
                intermediate,
                ..
            } => experts as u64 * 3 * h * intermediate as u64 + experts as u64 * h,
        };
        let embed = self.vocab as u64 * h * if self.tie_embeddings { 1 } else { 2 };
        self.layers as u64 * (attn + mlp) + embed
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_unknown_ones_are_named() {
        for p in PRESETS {
            ModelConfig::preset(p).unwrap().validate().unwrap();
        }
        let big = ModelConfig::preset("qwen3-30b-a3b").unwrap();
        assert_eq!(
            (big.layers, big.hidden, big.q_heads, big.kv_heads, big.head_dim),
            (48, 2048, 32, 4, 128)
        );
        // ~30.5 B parameters in all (the name's 30B).
        assert!(
            (29_000_000_000..32_000_000_000).contains(&big.parameters()),
            "{}",
            big.parameters()
        );
        let one = big.with_layers(1).unwrap();
        assert_eq!((one.layers, one.name.as_str()), (1, "qwen3-30b-a3b@1l"));
        let e = ModelConfig::preset("llama").unwrap_err().to_string();
        assert!(e.contains("\"llama\"") && e.contains("qwen3-30b-a3b"), "{e}");
        let e = ModelConfig::preset("tiny")
            .unwrap()
            .with_layers(3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--layers 3"), "{e}");
    }

    #[test]
    fn hf_config_json_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(
            &path,
            r#"{"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "num_hidden_layers": 48, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 768, "intermediate_size": 6144, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-06, "tie_word_embeddings": false, "max_position_embeddings": 40960,
                "eos_token_id": 151645, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": []}"#,
        )
        .unwrap();
        let c = ModelConfig::from_hf_config(&path).unwrap();
        let preset = ModelConfig::preset("qwen3-30b-a3b").unwrap();
        assert_eq!(
            (c.mlp, c.layers, c.hidden, c.head_dim),
            (preset.mlp, 48, 2048, 128)
        );
        assert_eq!(c.eos_token_ids, vec![151_645]);
        std::fs::write(&path, r#"{"hidden_size": 64}"#).unwrap();
        let e = ModelConfig::from_hf_config(&path).unwrap_err().to_string();
        assert!(e.contains("num_attention_heads"), "{e}");
        std::fs::write(&path, "not json").unwrap();
        assert!(
            ModelConfig::from_hf_config(&path)
                .unwrap_err()
                .to_string()
                .contains("not JSON")
        );
    }
}
