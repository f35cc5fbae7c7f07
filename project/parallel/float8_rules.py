"""What float8 training can take, known without torch: the recipes, the devices, the layer shapes (the settings
check and the planner use these before any model exists; project.parallel.float8 converts the model)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from project.model.config import LlamaConfig

RECIPES = ("tensorwise", "rowwise")
INSTALL_HINT = "`make install` brings it (or pip install torchao==0.18.0)"
#: float8 matrix products on a GPU: NVIDIA compute capability 8.9 (Ada: L4, L40S) and later (Hopper, Blackwell).
FLOAT8_CAPABILITY = (8, 9)
FLOAT8_GPUS = "they start at compute capability 8.9 (L4, L40S, H100, H200, B200)"  # what a refusal says
#: Both sides of a float8 matrix product must be multiples of this (torch's scaled_mm on NVIDIA GPUs), and so must
#: the tokens of a micro batch on a rank (the inner side of the weight gradient's product).
FLOAT8_MULTIPLE = 16


def has_float8_products(peak_tflops: Mapping[str, float]) -> bool:
    """Whether a cluster preset's devices have float8 matrix products (conf/cluster): it gives their float8 peak."""
    return (peak_tflops.get("fp8") or 0) > 0


def block_projections(config: LlamaConfig, tensor_parallel: int = 1) -> dict[str, tuple[int, int]]:
    """Each projection of the blocks that float8 may take (the family's tensors say which, project.model.spec), by its
    module's name in a block, as one rank holds its weight: (out, in)."""
    found: dict[str, tuple[int, int]] = {}
    for index in range(config.n_layers):
        for tensor in config.block_tensors(index):
            if tensor.float8:
                out, into = tensor.shape
                out //= tensor_parallel if tensor.split == "rows" else 1
                into //= tensor_parallel if tensor.split == "cols" else 1
                found.setdefault(tensor.name.removesuffix(".weight"), (out, into))
    return found


def widths_not_taken(config: LlamaConfig, tensor_parallel: int = 1) -> dict[str, int]:
    """The widths of the blocks' projections, as one rank holds them, that are no multiples of FLOAT8_MULTIPLE, by
    what they are: "model" (model.dim, a side of every projection), "query" (the heads' width on a rank, the
    model's unless split), "key_value" and "feed_forward"."""
    tp = tensor_parallel
    widths = {
        "model": config.dim,
        "query": config.n_heads * config.head_dim // tp,
        "key_value": config.kv_heads * config.head_dim // tp,
        "feed_forward": config.ffn_hidden_dim // tp,
    }
    if tp == 1:
        del widths["query"]  # the model's own width
    return {name: width for name, width in widths.items() if width % FLOAT8_MULTIPLE}


def takes_shape(shape: tuple[int, ...]) -> bool:
    """Whether float8 kernels take a weight of this shape (both sides multiples of 16)."""
    return all(side % FLOAT8_MULTIPLE == 0 for side in shape)


def in_float8(config: LlamaConfig, tensor_parallel: int = 1) -> list[str]:
    """The block projections strategy.float8 trains in float8: those whose shapes, as each rank holds them, float8
    kernels take."""
    return [name for name, shape in block_projections(config, tensor_parallel).items() if takes_shape(shape)]


def sub_layer_in_float8(config: LlamaConfig, sub_layer: str, tensor_parallel: int = 1) -> bool:
    """Whether every projection of a block's `sub_layer` (attention, feed_forward) is in float8."""
    kept = in_float8(config, tensor_parallel)
    return all(name in kept for name in block_projections(config, tensor_parallel) if name.startswith(f"{sub_layer}."))


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None
