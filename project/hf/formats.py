"""Each model family's Hugging Face format: what its config.json adds to a Llama's, and the HF tensors of its
feed-forward weights (the rest of a block, the embedding, the final norm and the head are a Llama's in every family;
the shapes are the family's tensors', project.model.spec). A family names its format in its registry entry
(project.model.families, `hf_format`); project.hf.conversion asks the entry, never a config's class.

Torch-free, like project.hf.conversion.
"""

from __future__ import annotations

from typing import Any

from project.model.config import LlamaConfig
from project.model.moe_config import MoEConfig

Pieces = list[tuple[str, int | None]]  # (an HF tensor's name, the slice [j] of our weight it is, or None: all of it)


class LlamaFormat:
    """LlamaForCausalLM: a SwiGLU feed-forward of three matrices."""

    architecture = "LlamaForCausalLM"
    # Ours -> HF's, under model.layers.{i}.: w1 gates, w3 is the up projection, w2 projects down.
    FEED_FORWARD = {
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
    }

    def config_dict(self, config: LlamaConfig, llama: dict[str, Any]) -> dict[str, Any]:
        """The family's config.json from the Llama one describing `config`'s attention, norms and sizes."""
        return llama

    def feed_forward_pieces(self, layer: str, name: str, config: LlamaConfig) -> Pieces:
        """The HF tensors our feed-forward weight `name` of block `layer` is."""
        return [(f"model.layers.{layer}.{self.FEED_FORWARD[name]}", None)]


class MixtralFormat(LlamaFormat):
    """MixtralForCausalLM, as Mistral published it: a router's matrix, and each expert's three matrices under names
    of their own (ours are stacked, [n_experts, out, in])."""

    architecture = "MixtralForCausalLM"
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

    def feed_forward_pieces(self, layer: str, name: str, config: LlamaConfig) -> Pieces:
        prefix = f"model.layers.{layer}.block_sparse_moe"
        if name in self.ROUTER:
            return [(f"{prefix}.{self.ROUTER[name]}", None)]
        return [(f"{prefix}.experts.{j}.{self.EXPERTS[name]}.weight", j) for j in range(_mixture(config).n_experts)]


def _mixture(config: LlamaConfig) -> MoEConfig:
    if not isinstance(config, MoEConfig):  # the registry pairs this format with the MoE family's config alone
        raise TypeError(f"Mixtral's format describes a mixture of experts, not model.family={config.family}")
    return config


LLAMA = LlamaFormat()
MIXTRAL = MixtralFormat()
