"""A small Qwen3 (or hybrid-attention Llama) model with random weights and a byte-level tokenizer, written as a Hugging Face
model directory that `vllm serve` loads from disk (no hub, no network).

The weights are random (seeded), so the text it writes means nothing; what the serve test
needs is real arithmetic of a real architecture: vLLM computes its KV, kvtier stores and loads
it, and greedy decoding over a loaded prefix must give the tokens it gives over vLLM's own
cached prefix. The tokenizer maps each byte to one token (ids 0-255, end of text 256), so a
prompt's token count is its length in bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

EOS_ID = 256
VOCAB = 257


@dataclass(frozen=True)
class TinyModel:
    """The model's shape; `kv_heads` x `head_dim` per layer is what kvtier's geometry holds.
    Without `sliding_window`, a Qwen3; with it, a Llama whose even layers attend to the last
    `sliding_window` tokens only and odd layers to all (vLLM's hybrid KV cache: a KV cache
    group per attention kind, each with its own block table)."""

    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 2816
    max_positions: int = 8192
    sliding_window: int | None = None

    def config(self) -> dict[str, object]:
        """The model's config.json."""
        hybrid: dict[str, object] = {}
        if self.sliding_window is not None:
            hybrid = {"sliding_window": self.sliding_window, "layer_types": [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)]}
        return {
            "architectures": ["LlamaForCausalLM" if hybrid else "Qwen3ForCausalLM"],
            "model_type": "llama" if hybrid else "qwen3",
            "vocab_size": VOCAB,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": EOS_ID,
            "eos_token_id": EOS_ID,
            **hybrid,
        }

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        """Random bf16 weights under Qwen3's (Llama's) parameter names (norms 1, projections
        scaled by 1/sqrt(fan-in) so activations stay near unit size through the layers)."""
        g = torch.Generator().manual_seed(seed)

        def proj(out_dim: int, in_dim: int) -> torch.Tensor:
            return (torch.randn(out_dim, in_dim, generator=g) / in_dim**0.5).to(torch.bfloat16)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=torch.bfloat16)

        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        w = {"model.embed_tokens.weight": torch.randn(VOCAB, h, generator=g).to(torch.bfloat16),
             "model.norm.weight": ones(h),
             # Logits of standard deviation ~4: peaked enough to decode, soft enough that the
             # log-probabilities move when anything in the context does.
             "lm_head.weight": (4 * torch.randn(VOCAB, h, generator=g) / h**0.5).to(torch.bfloat16)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            w |= {
                p + "input_layernorm.weight": ones(h),
                p + "post_attention_layernorm.weight": ones(h),
                p + "self_attn.q_proj.weight": proj(q, h),
                p + "self_attn.k_proj.weight": proj(kv, h),
                p + "self_attn.v_proj.weight": proj(kv, h),
                p + "self_attn.o_proj.weight": proj(h, q),
                p + "mlp.gate_proj.weight": proj(self.intermediate, h),
                p + "mlp.up_proj.weight": proj(self.intermediate, h),
                p + "mlp.down_proj.weight": proj(h, self.intermediate),
            }
            if self.sliding_window is None:  # Qwen3 normalizes each head's q and k
                w[p + "self_attn.q_norm.weight"] = ones(self.head_dim)
                w[p + "self_attn.k_norm.weight"] = ones(self.head_dim)
        return w


def byte_tokenizer() -> dict[str, object]:
    """tokenizer.json of a byte-level BPE with no merges: one token per byte (GPT-2's byte to
    character table, as ByteLevel pre-tokenization emits), plus `<|endoftext|>`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": EOS_ID, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_model(directory: Path, shape: TinyModel = TinyModel(), seed: int = 0) -> Path:
    """Writes the model directory (config, safetensors weights, tokenizer) and returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape.config(), indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    (directory / "tokenizer.json").write_text(json.dumps(byte_tokenizer()))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "model_max_length": shape.max_positions,
        "clean_up_tokenization_spaces": False,
    }))
    save_file(shape.weights(seed), str(directory / "model.safetensors"))
    return directory
