"""Parameter and FLOP arithmetic from the config's list of tensors (project.model.spec), so it works for models never
built and for every family alike."""

from __future__ import annotations

from project.model.config import LlamaConfig


def count_parameters(config: LlamaConfig, active: bool = False) -> int:
    """Exact parameter count of the model of `config`, tied output head counted once; `active`: only those one
    token's forward pass uses (a mixture of experts' router, chosen and shared experts; all of a dense model)."""
    tensors = [*config.model_tensors(), *(t for i in range(config.n_layers) for t in config.block_tensors(i))]
    return sum(t.per_token if active else t.numel for t in tensors)


def training_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6N plus the attention term (PaLM appendix B, nanoGPT).

    N counts the active parameters that take part in matrix products: all but the embedding lookup, with
    the output head included even when its weight is tied to the embedding; of a mixture of experts, the router
    and the experts a token goes to. The attention term, 12 x the query heads' width x the keys each query is scored
    against (`attention_span`: seq_len) per block, covers QK^T and AV (2 matmuls x 2 FLOPs x 3 for fwd+bwd) without
    discounting the causal mask, as PaLM and Megatron-LM report it.
    """
    n_matmul = count_parameters(config, active=True) - config.vocab_size * config.dim
    if config.tie_embeddings:
        n_matmul += config.vocab_size * config.dim
    width = config.n_heads * config.head_dim
    return 6 * n_matmul + sum(12 * width * config.attention_span(i, seq_len) for i in range(config.n_layers))


def parameter_counts(config: LlamaConfig) -> str:
    """`8.03B parameters`, or for a mixture of experts `46.7B parameters, 12.9B active` (what its FLOPs and MFU
    count): as the planner and the dry run say a model's size."""
    total, active = count_parameters(config), count_parameters(config, active=True)
    said = f"{total / 1e9:.3g}B parameters"
    return said if active == total else f"{said}, {active / 1e9:.3g}B active"
