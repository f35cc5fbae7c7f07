"""Conversion between our models and Hugging Face's formats: a dense Llama and LlamaForCausalLM, a mixture of
experts and MixtralForCausalLM (as Mistral published it: each expert's matrices under names of their own). What a
Llama's config.json has is here; the names of the tensors, and what a family's config.json adds, are its format's
(families/<name>/hf.py, named by its registry entry).

Pure functions over dicts and tensors, with no transformers import, so a checkpoint can be exported on a
machine without transformers. Each family's rotary layout is its HF model's, so weights map by name; nothing is
permuted. A weight of ours is one HF tensor, or (a mixture's stacked experts [n_experts, out, in]) one per expert,
or part of one laid out the other way round (Llama 4's experts: `Transposed`) (`hf_pieces`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from project.model.config import LlamaConfig
from project.model.families import family_of
from project.model.families.llama.hf import LlamaFormat, Transposed

if TYPE_CHECKING:  # no torch at import: project.hf.folder reads folders before the heavy imports
    import torch

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_format(config: LlamaConfig) -> LlamaFormat:
    """The Hugging Face format of `config`'s family (ValueError where it has none)."""
    return family_of(config).format()


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
    llama = {
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
    return hf_format(config).config_dict(config, llama)


def weight_names(config: LlamaConfig) -> list[str]:
    """Our parameter names for `config` (project.model.spec); `output.weight` only when it is a separate matrix."""
    return [t.name for t in config.tensors()]


def hf_weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of the weights of `config`'s HF model, as a folder holds them."""
    shapes = {}
    for tensor in config.tensors():
        for hf, piece in hf_pieces(tensor.name, config):
            if isinstance(piece, Transposed):
                shapes[hf] = piece.shape
            else:
                shapes[hf] = tensor.shape if piece is None else tensor.shape[1:]
    return shapes


def hf_pieces(name: str, config: LlamaConfig) -> list[tuple[str, int | Transposed | None]]:
    """The HF tensors our weight `name` is (its family's format says): [(its HF name, None)], for a mixture's
    stacked experts one (`model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight`, j) per expert j, its slice [j], or
    [(an HF name, Transposed)]: part of that tensor, laid out the other way round."""
    return hf_format(config).pieces(name, config)


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
    """Our model's state dict -> HF names (`hf_pieces`). `lm_head.weight` is left out when tied, as HF's own
    checkpoints do. Tensors are shared (or a mixture's experts sliced), not copied, but where parts of ours make one
    of HF's (`Transposed`)."""
    rename = {name: name for name in weight_names(config)}
    return hf_tensors(_rename_checked(state_dict, rename, tied_name="output.weight"), config)


def hf_tensors(ours: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The HF tensors that our weights `ours` (some or all of the model's, by our names) are, by their HF names: every
    weight that is part of one of them must be given with the others (`hf_pieces`)."""
    hf_tensors: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        for hf, piece in hf_pieces(name, config):
            if isinstance(piece, Transposed):  # a new tensor, filled by each weight that is part of it
                piece.of(hf_tensors.setdefault(hf, t.new_empty(piece.shape))).copy_(t)
            else:
                hf_tensors[hf] = t if piece is None else t[piece]
    return hf_tensors


def from_hf_state_dict(state_dict: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF names -> ours, ready for `load_state_dict(..., strict=True)` on the model of `config`: a mixture's experts
    stacked; with tied embeddings `output.weight` is the embedding tensor itself and any `lm_head.weight` ignored."""
    pieces = {name: hf_pieces(name, config) for name in weight_names(config)}
    rename = {hf: hf for parts in pieces.values() for hf, _ in parts}
    given = _rename_checked(state_dict, rename, tied_name="lm_head.weight")
    ours = {name: _assembled(given, parts) for name, parts in pieces.items()}
    if config.tie_embeddings:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


def _assembled(given: Mapping[str, torch.Tensor], parts: list[tuple[str, int | Transposed | None]]) -> torch.Tensor:
    """Our weight from the HF tensors `parts` names: one of them, a part of one, or the experts' stacked."""
    import torch

    (first, piece), *_ = parts
    if piece is None:
        return given[first]
    if isinstance(piece, Transposed):
        return piece.of(given[first]).contiguous()
    return torch.stack([given[hf] for hf, _ in parts])
