"""What float8 training can take, known without torch: the recipes, the devices, the layer shapes (the settings
check runs these before the imports; project.parallel.float8 converts the model)."""

from __future__ import annotations

from project.model.config import LlamaConfig

RECIPES = ("tensorwise", "rowwise")
#: float8 matrix products on a GPU: NVIDIA compute capability 8.9 (Ada: L4, L40S) and later (Hopper, Blackwell).
FLOAT8_CAPABILITY = (8, 9)
#: Both sides of a float8 matrix product must be multiples of this (torch's scaled_mm on NVIDIA GPUs).
FLOAT8_MULTIPLE = 16


def block_projections(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Each block's linear layers (by their names in a block) and their weights' shapes (out, in)."""
    heads, kv, dim, ffn = (
        config.n_heads * config.head_dim,
        config.kv_heads * config.head_dim,
        config.dim,
        config.ffn_hidden_dim,
    )
    return {
        "attention.wq": (heads, dim),
        "attention.wk": (kv, dim),
        "attention.wv": (kv, dim),
        "attention.wo": (dim, heads),
        "feed_forward.w1": (ffn, dim),
        "feed_forward.w3": (ffn, dim),
        "feed_forward.w2": (dim, ffn),
    }


def takes_shape(shape: tuple[int, ...]) -> bool:
    """Whether float8 kernels take a weight of this shape (both sides multiples of 16)."""
    return all(side % FLOAT8_MULTIPLE == 0 for side in shape)


def unconvertible(config: LlamaConfig) -> list[str]:
    """The block projections that stay in their precision under strategy.float8, for their shapes."""
    return [name for name, shape in block_projections(config).items() if not takes_shape(shape)]
