"""MoEConfig: the shape of a Llama whose feed-forward is a mixture of experts, as plain data (no torch).

Attention, norms, rotary embeddings and the head are the dense Llama's (LlamaConfig's fields); every `moe_every`-th
block's SwiGLU becomes `n_experts` SwiGLU experts of width `expert_ffn_dim`, of which a router picks `top_k` per
token, beside an optional shared expert every token goes through (Llama 4). Mixtral 8x7B is n_experts=8, top_k=2,
moe_every=1, softmax scores renormalised over the chosen two; Llama 4 Scout's text model 16 experts, top_k=1 and a
shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from project.model.config import WHOLE, LlamaConfig, Mixture
from project.model.spec import TensorSpec, swiglu
from project.runtime.settings import at_least, or_null, setting, switch, whole

SCORE_FUNCTIONS = ("softmax", "sigmoid")
# How Mixtral routes (MixtralForCausalLM): what a mixture must have to be written in its format, and what a Mixtral
# folder's model is given (project.hf.folder).
MIXTRAL_ROUTING = {
    "moe_every": 1,
    "shared_expert": False,
    "score_func": "softmax",
    "normalize_top_k": True,
    "bias_update_rate": 0.0,
    "weigh_inputs": False,
}


@dataclass
class MoEConfig(LlamaConfig):
    family: str = "moe"
    n_experts: int = setting(8, whole(2), "a whole number of experts, at least 2")
    top_k: int = setting(2, whole(1), "a whole number of experts per token, at least 1")
    # Blocks 0-based i with (i + 1) % moe_every == 0 are mixtures, the others dense (Llama 4's interleave step).
    moe_every: int = setting(1, whole(1), WHOLE)
    # Each expert's SwiGLU width; null: the dense rule's (ffn_dim, or multiple_of and ffn_dim_multiplier).
    expert_ffn_dim: int | None = setting(None, or_null(whole(1)), "null (the dense width) or a whole number above 0")
    # A SwiGLU of expert_ffn_dim that every token goes through beside its routed experts (Llama 4, DeepSeek).
    shared_expert: bool = switch(False)
    # How the router's logits become scores: softmax over the experts (Mixtral) or each expert's sigmoid (DeepSeek-V3).
    score_func: str = setting("softmax", lambda v: v in SCORE_FUNCTIONS, "softmax or sigmoid")
    # Divide the chosen experts' scores by their sum, so a token's expert weights add up to 1 (Mixtral does).
    normalize_top_k: bool = switch(True)
    # The router's weights scale each chosen expert's input (Llama 4) rather than its output (Mixtral, DeepSeek-V3).
    weigh_inputs: bool = switch(False)
    # The load-balancing loss's weight in the training objective (0: none); the loss is logged as moe/aux_loss.
    aux_loss_coef: float = setting(0.01, at_least(0), "at least 0, e.g. 0.01 (0: no auxiliary loss)")
    # DeepSeek-V3's balancing without a loss: after each optimizer step every expert's routing bias moves by this
    # much toward the mean load (up if under-loaded); it only chooses experts, never weighs them. 0: no bias.
    bias_update_rate: float = setting(0.0, at_least(0), "at least 0, e.g. 0.001 (0: no routing bias)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k > self.n_experts:
            raise ValueError(
                f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts}: a token cannot be routed to more "
                "experts than there are. Lower model.top_k or raise model.n_experts."
            )
        if self.moe_every > self.n_layers:
            raise ValueError(
                f"model.moe_every={self.moe_every} exceeds model.n_layers={self.n_layers}: no block would be a mixture "
                "of experts. Set model.moe_every to at most model.n_layers (1: every block)."
            )

    @property
    def expert_hidden_dim(self) -> int:
        return self.ffn_hidden_dim if self.expert_ffn_dim is None else self.expert_ffn_dim

    def is_moe_layer(self, index: int) -> bool:
        return (index + 1) % self.moe_every == 0

    def hf_format_differences(self) -> list[str]:
        """The settings that Mixtral's format (MixtralForCausalLM) cannot hold, as `model.KEY=VALUE`."""
        return [
            f"model.{key}={getattr(self, key)}" for key, value in MIXTRAL_ROUTING.items() if getattr(self, key) != value
        ]

    def feed_forward_tensors(self, index: int) -> list[TensorSpec]:
        """A mixture block's: the router's gate (whole on every tensor-parallel rank), the stacked experts (top_k of n
        used per token) and the shared expert, each expert's hidden units split over the tensor-parallel ranks as a
        SwiGLU's are (project.parallel.expert_parallel); none in float8 (project.model.families.moe.model)."""
        if not self.is_moe_layer(index):
            return super().feed_forward_tensors(index)
        d, n, f, std, used = (
            self.dim,
            self.n_experts,
            self.expert_hidden_dim,
            self.init_std,
            self.top_k / self.n_experts,
        )
        shared = swiglu("feed_forward.shared_expert", d, f, std, self._residual_std, mixture=True)
        return [
            TensorSpec("feed_forward.router.gate.weight", (n, d), None, std, mixture=True),
            TensorSpec("feed_forward.experts.w1", (n, f, d), "rows", std, used=used, mixture=True),
            TensorSpec("feed_forward.experts.w3", (n, f, d), "rows", std, used=used, mixture=True),
            TensorSpec("feed_forward.experts.w2", (n, d, f), "cols", self._residual_std, used=used, mixture=True),
            *(shared if self.shared_expert else []),
        ]

    def mixture(self, index: int) -> Mixture | None:
        if not self.is_moe_layer(index):
            return None
        return Mixture(self.n_experts, self.top_k, self.expert_hidden_dim, self.shared_expert, self.aux_loss_coef > 0)

    def refuses_precision(self, precision: str) -> str | None:
        if self.bias_update_rate > 0 and precision.endswith("-true") and precision != "32-true":
            return (
                f"model.bias_update_rate={self.bias_update_rate} with trainer.precision={precision}: the routing "
                f"biases would be stored in {'bfloat16' if precision.startswith('bf') else 'float16'}, whose steps "
                "are coarser than the updates past a bias of 0.125 and swallow them past 0.5 (bfloat16). Use "
                "trainer.precision=bf16-mixed (float32 weights and biases, bfloat16 compute), or "
                "model.bias_update_rate=0 with an auxiliary loss."
            )
        return None

    def values_summed_each_step(self) -> int:
        # The expert loads and balancing losses of every mixture (MoELlama.step_statistics), summed after each step
        # where the routing biases move; only on logging steps otherwise.
        return len(self.moe_layers) * (self.n_experts + 2) if self.bias_update_rate > 0 else 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]
