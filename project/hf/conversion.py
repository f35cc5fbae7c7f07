"""Conversion between our Llama and Hugging Face's LlamaForCausalLM format.

Pure functions over dicts and tensors, with no transformers import, so a checkpoint can be exported on a
machine without transformers. Our rotary layout is HF's rotate-half, so weights map 1:1 by name; nothing
is permuted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from project.model.config import LlamaConfig

if TYPE_CHECKING:  # no torch at import: project.hf.folder reads folders before the heavy imports
    import torch

# Per-block names: ours -> HF's (under model.layers.{i}.). w1 gates, w3 is the up projection, w2 projects down.
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_config_dict(
    config: LlamaConfig,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    torch_dtype: str = "float32",
) -> dict:
    """The contents of a HF `config.json` for LlamaForCausalLM describing `config`.

    RoPE settings are written twice on purpose: transformers < 5 reads `rope_theta` and `rope_scaling`;
    transformers 5 reads `rope_parameters` (and still converts the old keys, preferring `rope_scaling`
    when both are present, so the two spellings must and do agree). Likewise `torch_dtype` (< 5) and `dtype` (5).
    """
    rope_scaling = None
    rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in config.rope_scaling]
        if missing:
            raise ValueError(f"model.rope_scaling lacks {missing}; Llama-3.1 scaling needs {list(LLAMA3_ROPE_KEYS)}.")
        s = config.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(s["factor"]),
            "low_freq_factor": float(s["low_freq_factor"]),
            "high_freq_factor": float(s["high_freq_factor"]),
            "original_max_position_embeddings": int(s["original_max_position_embeddings"]),
        }
        rope_parameters = {**rope_scaling, "rope_theta": config.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }


def weight_names(config: LlamaConfig) -> list[str]:
    """Our parameter names for `config`; `output.weight` only when it is a separate matrix."""
    names = ["tok_embeddings.weight", "norm.weight"]
    names += [f"layers.{i}.{name}" for i in range(config.n_layers) for name in _BLOCK_NAMES]
    if not config.tie_embeddings:
        names.append("output.weight")
    return names


def hf_weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of the weights of a LlamaForCausalLM of `config`, as a folder holds them."""
    d, q, kv, ffn = (
        config.dim,
        config.n_heads * config.head_dim,
        config.kv_heads * config.head_dim,
        config.ffn_hidden_dim,
    )
    block = {
        "attention_norm.weight": (d,),
        "attention.wq.weight": (q, d),
        "attention.wk.weight": (kv, d),
        "attention.wv.weight": (kv, d),
        "attention.wo.weight": (d, q),
        "ffn_norm.weight": (d,),
        "feed_forward.w1.weight": (ffn, d),
        "feed_forward.w3.weight": (ffn, d),
        "feed_forward.w2.weight": (d, ffn),
    }
    top = {
        "tok_embeddings.weight": (config.vocab_size, d),
        "norm.weight": (d,),
        "output.weight": (config.vocab_size, d),
    }
    return {hf_name(name): top.get(name) or block[name.split(".", 2)[2]] for name in weight_names(config)}


def hf_name(name: str) -> str:
    """The HF name of one of our parameters (`layers.0.attention.wq.weight` ->
    `model.layers.0.self_attn.q_proj.weight`)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}"
    raise KeyError(name)


def _rename_checked(state_dict: Mapping[str, torch.Tensor], rename: dict[str, str], tied_name: str) -> dict:
    """Rename every key of `state_dict` by `rename`, refusing unknown or missing keys.

    `tied_name` (the output matrix, in the source's spelling) may be present or absent when embeddings
    are tied: a module's state_dict lists a tied parameter under both names, a safetensors file once.
    """
    unknown = sorted(set(state_dict) - set(rename) - {tied_name})
    missing = sorted(set(rename) - set(state_dict))
    if unknown or missing:
        raise KeyError(f"state dict does not match the model config: unexpected {unknown[:5]}, missing {missing[:5]}")
    return {rename[k]: v for k, v in state_dict.items() if k in rename}


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our Llama's state dict -> HF LlamaForCausalLM names. `lm_head.weight` is left out when tied,
    as HF's own checkpoints do. Tensors are shared, not copied."""
    rename = {name: hf_name(name) for name in weight_names(config)}
    return _rename_checked(state_dict, rename, tied_name="output.weight")


def from_hf_state_dict(state_dict: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM names -> ours, ready for `Llama(config).load_state_dict(..., strict=True)`:
    with tied embeddings `output.weight` is the embedding tensor itself and any `lm_head.weight` is ignored."""
    rename = {hf_name(name): name for name in weight_names(config)}
    ours = _rename_checked(state_dict, rename, tied_name="lm_head.weight")
    if config.tie_embeddings:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours
