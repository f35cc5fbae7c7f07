"""The mixture-of-experts family's Hugging Face format: MixtralForCausalLM (project.model.families.llama.hf says what a
format is). Torch-free."""

from __future__ import annotations

from typing import Any

from project.model.config import LlamaConfig
from project.model.families.llama.hf import LlamaFormat, Pieces
from project.model.families.moe.config import MIXTRAL_ROUTING, MoEConfig


class MixtralFormat(LlamaFormat):
    """MixtralForCausalLM, as Mistral published it: a router's matrix, and each expert's three matrices under names
    of their own (ours are stacked, [n_experts, out, in])."""

    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    # Besides a Llama's: its experts and their width (intermediate_size, as ffn_dim); routing is Mixtral's
    # (MIXTRAL_ROUTING: softmax, the chosen renormalised, no shared expert, no bias).
    MIXTURE = {"n_experts": "num_local_experts", "top_k": "num_experts_per_tok", "expert_ffn_dim": "intermediate_size"}
    ROUTER = {"feed_forward.router.gate.weight": "gate.weight"}
    EXPERTS = {"feed_forward.experts.w1": "w1", "feed_forward.experts.w3": "w3", "feed_forward.experts.w2": "w2"}

    def config_dict(self, config: LlamaConfig, llama: dict[str, Any]) -> dict[str, Any]:
        moe = _mixture(config)
        mixtral = {key: value for key, value in llama.items() if key not in ("mlp_bias", "attention_bias")}
        return {
            **mixtral,
            "architectures": [self.architecture],
            "model_type": "mixtral",
            "intermediate_size": moe.expert_hidden_dim,
            "num_local_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
        }

    def settings(self, hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get("sliding_window") is not None:
            raise ValueError(
                f"has sliding_window={hf['sliding_window']}; attention here sees every earlier position "
                "(sliding_window null, as Mixtral 8x7B's)."
            )
        if missing := [key for key in self.MIXTURE.values() if key not in hf]:
            raise ValueError(f"lacks {missing}.")
        return {ours: hf[key] for ours, key in self.MIXTURE.items()} | MIXTRAL_ROUTING

    def fixed(self) -> dict[str, str]:
        return self.FIXED | self.MIXTURE | {key: f"Mixtral's routing, {key}" for key in MIXTRAL_ROUTING}

    def feed_forward_pieces(self, layer: str, name: str, config: LlamaConfig) -> Pieces:
        prefix = f"model.layers.{layer}.block_sparse_moe"
        if name in self.ROUTER:
            return [(f"{prefix}.{self.ROUTER[name]}", None)]
        return [(f"{prefix}.experts.{j}.{self.EXPERTS[name]}.weight", j) for j in range(_mixture(config).n_experts)]


def _mixture(config: LlamaConfig) -> MoEConfig:
    if not isinstance(config, MoEConfig):  # the registry pairs this format with the MoE family's config alone
        raise TypeError(f"Mixtral's format describes a mixture of experts, not model.family={config.family}")
    return config


MIXTRAL = MixtralFormat()
