"""Llama 4's Hugging Face format: Llama4ForCausalLM (model_type llama4_text), the text model as transformers holds it
(families/llama/hf.py says what a format is). Torch-free.

A Llama's names for attention and norms; a dense block's feed-forward under `feed_forward.` (gate_proj, up_proj,
down_proj, of intermediate_size_mlp); a mixture's router, shared expert, and its experts fused: gate_up_proj
[experts, dim, 2 x width] holds w1 and w3 side by side and down_proj [experts, width, dim] w2, each laid out the other
way round from ours (`Transposed`). The rotary pairs are Meta's (neighbouring channels), as our Llama 4 rotates, so
q and k map as they are.
"""

from __future__ import annotations

from typing import Any

from project.model.config import LlamaConfig
from project.model.families.llama.hf import LlamaFormat, Pieces, Transposed
from project.model.families.llama4.config import LLAMA4_ROUTING, Llama4Config


class Llama4Format(LlamaFormat):
    architecture = "Llama4ForCausalLM"
    model_type = "llama4_text"
    # Besides a Llama's: the mixture, the dense blocks' width, the attention's pattern and treatment. Routing is
    # Meta's (LLAMA4_ROUTING: one sigmoid score scaling the expert's input, a shared expert, no bias).
    LLAMA4 = {
        "ffn_dim": "intermediate_size_mlp",
        "expert_ffn_dim": "intermediate_size",
        "n_experts": "num_local_experts",
        "top_k": "num_experts_per_tok",
        "moe_every": "interleave_moe_layer_step",
        "nope_every": "no_rope_layer_interval",
        "attention_chunk_size": "attention_chunk_size",
        "qk_norm": "use_qk_norm",
        "temperature_tuning": "attn_temperature_tuning",
        "floor_scale": "floor_scale",
        "attn_scale": "attn_scale",
    }
    FIXED = {key: value for key, value in LlamaFormat.FIXED.items() if key != "ffn_dim"} | LLAMA4
    DENSE = {
        "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
        "feed_forward.w3.weight": "feed_forward.up_proj.weight",
        "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    }
    MIXTURE = {
        "feed_forward.router.gate.weight": "feed_forward.router.weight",
        "feed_forward.shared_expert.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
        "feed_forward.shared_expert.w3.weight": "feed_forward.shared_expert.up_proj.weight",
        "feed_forward.shared_expert.w2.weight": "feed_forward.shared_expert.down_proj.weight",
    }

    def config_dict(self, config: LlamaConfig, llama: dict[str, Any]) -> dict[str, Any]:
        c = _llama4(config)
        text = {key: value for key, value in llama.items() if key != "mlp_bias"}
        return (
            text
            | {hf: getattr(c, ours) for ours, hf in self.LLAMA4.items()}
            | {
                "architectures": [self.architecture],
                "model_type": self.model_type,
                "intermediate_size_mlp": c.ffn_hidden_dim,
                "intermediate_size": c.expert_hidden_dim,
                "router_aux_loss_coef": c.aux_loss_coef,
                "router_jitter_noise": 0.0,
                "output_router_logits": False,
            }
        )

    def unsupported(self, hf: dict[str, Any]) -> list[str]:
        return super().unsupported(hf) + [
            key
            for key, bad in {
                # Only the layers' regular patterns, as interleave_moe_layer_step and no_rope_layer_interval make them.
                "moe_layers": hf.get("moe_layers") not in (None, _every(hf, "interleave_moe_layer_step", 1, 1)),
                "no_rope_layers": hf.get("no_rope_layers") not in (None, _every(hf, "no_rope_layer_interval", 4, 0)),
            }.items()
            if bad
        ]

    def settings(self, hf: dict[str, Any]) -> dict[str, Any]:
        if missing := [key for key in ("intermediate_size", "intermediate_size_mlp") if key not in hf]:
            raise ValueError(f"lacks {missing}.")
        defaults = {field: getattr(Llama4Config, field) for field in self.LLAMA4}
        settings = {ours: hf.get(key, defaults[ours]) for ours, key in self.LLAMA4.items()}
        # Meta's folders give attn_temperature_tuning as a number (4), which transformers reads as true.
        settings |= {key: bool(settings[key]) for key in ("qk_norm", "temperature_tuning")}
        return settings | LLAMA4_ROUTING

    def fixed(self) -> dict[str, str]:
        return self.FIXED | {key: f"Llama 4's routing, {key}" for key in LLAMA4_ROUTING}

    def feed_forward_pieces(self, layer: str, name: str, config: LlamaConfig) -> Pieces:
        prefix = f"model.layers.{layer}"
        if name in self.DENSE and not _llama4(config).is_moe_layer(int(layer)):
            return [(f"{prefix}.{self.DENSE[name]}", None)]
        if name in self.MIXTURE:
            return [(f"{prefix}.{self.MIXTURE[name]}", None)]
        c = _llama4(config)
        n, d, f = c.n_experts, c.dim, c.expert_hidden_dim
        experts = f"{prefix}.feed_forward.experts"
        fused = {
            "feed_forward.experts.w1": (f"{experts}.gate_up_proj", Transposed((n, d, 2 * f), 0, f)),
            "feed_forward.experts.w3": (f"{experts}.gate_up_proj", Transposed((n, d, 2 * f), f, 2 * f)),
            "feed_forward.experts.w2": (f"{experts}.down_proj", Transposed((n, f, d), 0, d)),
        }
        return [fused[name]]


def _every(hf: dict[str, Any], key: str, default: int, flag: int) -> list[int]:
    """The regular pattern `key` makes over the layers: the indices of every k-th layer (moe_layers, flag 1), or for
    every layer 0 at every k-th and 1 elsewhere (no_rope_layers, flag 0)."""
    k, n = hf.get(key, default), hf.get("num_hidden_layers", 0)
    if flag:
        return list(range(k - 1, n, k))
    return [int((i + 1) % k != 0) for i in range(n)]


def _llama4(config: LlamaConfig) -> Llama4Config:
    if not isinstance(config, Llama4Config):  # the registry pairs this format with Llama 4's config alone
        raise TypeError(f"Llama 4's format describes Llama 4, not model.family={config.family}")
    return config


LLAMA4 = Llama4Format()
