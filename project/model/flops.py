"""Parameter and FLOP arithmetic from the config alone, so it works for models never built.

Every family's blocks share attention and norms; each config says its own feed-forward's parameters
(`feed_forward_parameters`), all of them or those one token uses (a mixture of experts' active ones)."""

from __future__ import annotations

from project.model.config import LlamaConfig


def count_parameters(config: LlamaConfig, active: bool = False) -> int:
    """Exact parameter count of the model of `config`, tied output head counted once; `active`: only those one
    token's forward pass uses (a mixture of experts' router, chosen and shared experts; all of a dense model)."""
    d, kv_dim = config.dim, config.kv_heads * config.head_dim
    attention = d * d * 2 + d * kv_dim * 2  # wq, wo, wk, wv
    blocks = sum(attention + config.feed_forward_parameters(i, active) + 2 * d for i in range(config.n_layers))
    embeddings = config.vocab_size * d
    head = 0 if config.tie_embeddings else config.vocab_size * d
    return embeddings + blocks + d + head


def training_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6N plus the attention term (PaLM appendix B, nanoGPT).

    N counts the active parameters that take part in matrix products: all but the embedding lookup, with
    the output head included even when its weight is tied to the embedding; of a mixture of experts, the router
    and the experts a token goes to. The attention term, 12 * n_layers * dim * seq_len, covers QK^T and AV
    (2 matmuls x 2 FLOPs x 3 for fwd+bwd) without discounting the causal mask, as PaLM and Megatron-LM report it.
    """
    n_matmul = count_parameters(config, active=True) - config.vocab_size * config.dim
    if config.tie_embeddings:
        n_matmul += config.vocab_size * config.dim
    return 6 * n_matmul + 12 * config.n_layers * config.dim * seq_len


def parameter_counts(config: LlamaConfig) -> str:
    """`8.03B parameters`, or for a mixture of experts `46.7B parameters, 12.9B active` (what its FLOPs and MFU
    count): as the planner and the dry run say a model's size."""
    total, active = count_parameters(config), count_parameters(config, active=True)
    said = f"{total / 1e9:.3g}B parameters"
    return said if active == total else f"{said}, {active / 1e9:.3g}B active"
