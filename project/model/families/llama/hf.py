"""The dense Llama's Hugging Face format, LlamaForCausalLM, and the base of every family's: what a family's config.json
adds to a Llama's, and the HF tensors of its feed-forward weights (the rest of a block, the embedding, the final norm
and the head are a Llama's in every family; the shapes are the family's tensors', project.model.spec). A family names
its format in its registry entry (`hf_format`); project.hf.conversion asks the entry, never a config's class.

Torch-free, like project.hf.conversion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from project.model.config import LlamaConfig


@dataclass(frozen=True)
class Transposed:
    """Our weight as part of an HF tensor of `shape` laid out the other way round: its columns start:stop along the
    last dimension, the last two dimensions swapped (Llama 4's experts: [experts, in, out], w1 and w3 side by side in
    one tensor, where ours are [experts, out, in] each)."""

    shape: tuple[int, ...]
    start: int
    stop: int

    def of(self, hf: Any, experts: slice = slice(None)) -> Any:
        """Our weight's values in `hf` (a tensor of `shape`, or safetensors' slice of one, which then reads only these),
        as a view of it; of `experts` along dim 0 only, where given."""
        if experts != slice(None) and len(self.shape) != 3:
            raise ValueError(f"experts are dim 0 of a stacked [experts, in, out] tensor, not of one of {self.shape}")
        middle = (slice(None),) * (len(self.shape) - 2)
        return hf[(experts, *middle, slice(self.start, self.stop))].transpose(-2, -1)


# (an HF tensor's name, what of it our weight is: None all of it, j its slice [j] along dim 0 (a mixture's experts one
# tensor each), or a Transposed part).
Pieces = list[tuple[str, int | Transposed | None]]


class LlamaFormat:
    """LlamaForCausalLM: a SwiGLU feed-forward of three matrices."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"  # config.json's, which tells a folder's family (project.hf.folder)
    TOP = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    # A block's tensors but the feed-forward's, ours -> HF's (under model.layers.{i}.).
    BLOCK = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    # The model settings a folder fixes (ours <- HF's config.json). Others (max_seq_len, init_std) a run may set.
    FIXED = {
        "vocab_size": "vocab_size",
        "dim": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "ffn_dim": "intermediate_size",
        "norm_eps": "rms_norm_eps",
        "rope_theta": "rope_theta",
        "rope_scaling": "rope_scaling",
        "tie_embeddings": "tie_word_embeddings",
    }
    # Ours -> HF's, under model.layers.{i}.: w1 gates, w3 is the up projection, w2 projects down.
    FEED_FORWARD = {
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
    }

    def config_dict(self, config: LlamaConfig, llama: dict[str, Any]) -> dict[str, Any]:
        """The family's config.json from the Llama one describing `config`'s attention, norms and sizes."""
        return llama

    def pieces(self, name: str, config: LlamaConfig) -> Pieces:
        """The HF tensors our weight `name` (`layers.0.attention.wq.weight`) is."""
        if name in self.TOP:
            return [(self.TOP[name], None)]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m and m[2] in self.BLOCK:
            return [(f"model.layers.{m[1]}.{self.BLOCK[m[2]]}", None)]
        if m and m[2].startswith("feed_forward."):
            return self.feed_forward_pieces(m[1], m[2], config)
        raise KeyError(name)

    def feed_forward_pieces(self, layer: str, name: str, config: LlamaConfig) -> Pieces:
        """The HF tensors our feed-forward weight `name` of block `layer` is."""
        return [(f"model.layers.{layer}.{self.FEED_FORWARD[name]}", None)]

    def unsupported(self, hf: dict[str, Any]) -> list[str]:
        """The keys of a folder's config.json whose values the family's model cannot be (`hidden_act`)."""
        heads = hf.get("num_attention_heads") or 1
        return [
            key
            for key, bad in {
                "hidden_act": hf.get("hidden_act", "silu") != "silu",
                "attention_bias": bool(hf.get("attention_bias", False)),
                "mlp_bias": bool(hf.get("mlp_bias", False)),
                "head_dim": hf.get("head_dim", hf.get("hidden_size", 0) // heads) != hf.get("hidden_size", 0) // heads,
            }.items()
            if bad
        ]

    def settings(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The family's own model settings from a folder's config.json, beyond a Llama's (FIXED); ValueError (the
        problem, in a sentence) for what the family's model cannot hold."""
        return {}

    def fixed(self) -> dict[str, str]:
        """Every setting a folder fixes, with what fixes it: the config.json key, or a phrase."""
        return dict(self.FIXED)


LLAMA = LlamaFormat()
