"""`strategy.float8`: the transformer blocks' linear layers trained in float8 (torchao's float8 training).

Each block's projections (attention's q, k, v, o and the feed-forward's three) become torchao `Float8Linear`s:
their inputs, weights and output gradients are cast to float8 with dynamic scales just before each matrix product,
while the weights, their gradients and the optimizer's moments stay in the parameters' own dtype. The embedding and
the output head keep their precision (torchtitan's choice too: the head's error reaches the loss undamped), and so
does any projection whose sides are not multiples of 16, which float8 kernels cannot take (`convert_to_float8`
returns their names, said once at start).

Recipes (torchao's names): `tensorwise`, one scale per tensor, the fastest, with float8 all-gathers of FSDP2's
parameters and float8 tensor-parallel styles; `rowwise`, one scale per row, more accurate with outliers, its
communication in the parameters' dtype.

Without a float8 device (a CPU, tests) torchao emulates the products (`emulate=True`): the values are rounded to
float8 exactly as a GPU rounds them and multiplied in float32: for tests, not for speed. On a GPU float8 pays only
compiled (`strategy.compile=true`), where the casts fuse into the kernels around them.

Scales are computed over what a rank holds: under data or context parallelism over its own micro batch or part of
each sequence, so a data-parallel float8 run compares with one device that accumulates the same micro batches (not
one that takes the whole batch at once: ddp equals it exactly), and a context-parallel one is within float8's
rounding of one device. Tensor parallelism keeps one device's scales (a sharded tensor's scale is reduced over its
shards). Float32 sums in another order (tensor parallelism's partial products, FSDP's reductions) round to the other
side of a float8 value now and then, so those layouts drift from one device by float8's rounding after their first
step (docs/configuration.md, tests/test_float8.py).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from project.parallel.float8_rules import (
    FLOAT8_CAPABILITY,
    FLOAT8_GPUS,
    FLOAT8_MULTIPLE,
    INSTALL_HINT,
    RECIPES,
    block_projections,
    in_float8,
    torchao_installed,
)
from project.runtime.errors import ConfigError

if TYPE_CHECKING:
    from project.model.llama import Llama

# Loggers that print at import on a machine without CUDA's libraries (torchao's optional kernels) or about an API
# torch deprecated that torchao still calls; nothing a user of float8 can act on.
_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def _quiet_import() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # torchao's modules use torch.jit's script_method, which torch deprecated
            warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def torchao_float8() -> Any:
    """torchao's float8 package, imported without its messages about optional CUDA kernels."""
    if not torchao_installed():
        raise ConfigError(
            f"strategy.float8 needs torchao, which is not installed: {INSTALL_HINT}; or strategy.float8=null."
        )
    with _quiet_import():
        import torchao.float8 as float8
        import torchao.float8.float8_tensor_parallel  # noqa: F401  (the float8 tensor-parallel styles)
    return float8


def refuse_device_without_float8(recipe: str, device: torch.device) -> None:
    """Refuse an unknown recipe, and a GPU without float8 matrix products. project.training.trainer calls this as
    soon as the Trainer knows the run's device, before the data is prepared and the model built."""
    if recipe not in RECIPES:
        raise ConfigError(f"strategy.float8={recipe!r}: choose one of {', '.join(RECIPES)} or null.")
    if reason := without_float8(device):
        raise ConfigError(
            f"strategy.float8={recipe}: {reason}. Set strategy.float8=null (bf16-mixed is this GPU's fastest "
            "precision)."
        )


def without_float8(device: torch.device) -> str | None:
    """Why `device` cannot train in float8 (a GPU before compute capability 8.9); None where it can or emulates it (a
    CPU). Also make gpu-check's, before it runs anything."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= FLOAT8_CAPABILITY:
        return None
    return (
        f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]}) has no float8 "
        f"matrix products; {FLOAT8_GPUS}"
    )


def check_float8_device(recipe: str, device: torch.device, compiled: bool) -> bool:
    """Whether `device` emulates float8 (a CPU: yes), refusing a GPU without float8 matrix products and saying
    once that an uncompiled float8 run on a GPU is slower than it need be."""
    refuse_device_without_float8(recipe, device)
    if device.type != "cuda":
        return True
    if not compiled:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"strategy.float8={recipe} without strategy.compile=true: the casts to float8 run as separate kernels and "
            "eat most of the speed-up; compile the blocks."
        )
    return False


def float8_linear_config(recipe: str, emulate: bool, all_gather_in_float8: bool) -> Any:
    """torchao's configuration of `recipe`; `all_gather_in_float8`: FSDP2 gathers the weights already cast
    (tensorwise only: half the bytes of a bf16 gather)."""
    float8 = torchao_float8()
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=all_gather_in_float8)
    return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def convert_to_float8(model: Llama, config: Any, tensor_parallel: int = 1) -> list[str]:
    """Swap the linear layers of `model`'s blocks (`layers`) for torchao's float8 ones in place, with `config`
    (float8_linear_config), where float8 kernels take their shapes as each of `tensor_parallel` ranks will hold them
    (project.parallel.float8_rules); return the names of those left as they were. Parameter names, and so
    checkpoints, stay the plain model's."""
    chosen = set(in_float8(model.config, tensor_parallel))
    projections = set(block_projections(model.config, tensor_parallel))
    kept: list[str] = []

    def convert(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or not name.startswith("layers."):  # not the head
            return False
        projection = name.split(".", 2)[2]  # layers.<i>.<sub-layer>.<projection>
        if projection not in projections:  # a mixture's router (float32 scores) and shared expert
            return False
        if projection not in chosen:
            kept.append(name)
            return False
        return True

    torchao_float8().convert_to_float8_training(model, module_filter_fn=convert, config=config)
    return kept


def tensor_parallel_styles(float8: bool) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) styles: torchao's float8 ones, which cast a sub-layer's input once and
    gather activations in float8 (tensorwise scales only), or torch's."""
    if float8:
        styles = torchao_float8().float8_tensor_parallel
        return styles.Float8ColwiseParallel, styles.Float8RowwiseParallel, styles.PrepareFloat8ModuleInput
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def apply_float8(
    model: Llama,
    recipe: str,
    device: torch.device,
    compiled: bool,
    gather: bool,
    tensor_parallel: int = 1,
) -> None:
    """`strategy.float8=recipe` on `model` (its blocks' linear layers) before it is sharded or compiled, for
    `device`; `gather`: FSDP2 is to gather the weights in float8 (tensorwise only); `tensor_parallel`: the degree
    that will split them."""
    emulate = check_float8_device(recipe, device, compiled)
    kept = convert_to_float8(model, float8_linear_config(recipe, emulate, gather), tensor_parallel)
    if gather:
        for module in model.modules():
            if isinstance(module, torchao_float8().float8_linear.Float8Linear):
                module.register_state_dict_post_hook(_plain_weight)
    if not any(isinstance(m, torchao_float8().float8_linear.Float8Linear) for m in model.modules()):
        # project.config.float8 says it before a run starts, with the model's settings to change.
        raise ConfigError(f"strategy.float8={recipe}: no linear layer of the blocks has a shape float8 can take.")
    from lightning.pytorch.utilities import rank_zero_info

    if kept:
        rank_zero_info(
            f"strategy.float8={recipe}: {len(kept)} linear layers keep their precision, their sides not multiples of "
            f"{FLOAT8_MULTIPLE} ({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})."
        )
    if emulate:
        rank_zero_info(f"strategy.float8={recipe} on {device.type}: emulated (float8 values, float32 products).")


def _plain_weight(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A float8-gathered weight is torchao's wrapper of the weight (it casts at each gather): a checkpoint holds the
    weight itself (an alias unwraps it: the same memory), which loads without torchao, in any precision. Relies on
    torchao's wrapper returning plain tensors from operators other than the few it keeps wrapped (alias is not
    among them: torchao 0.18); tests/test_float8.py reads such a checkpoint without torchao's classes."""
    state_dict[f"{prefix}weight"] = torch.ops.aten.alias.default(state_dict[f"{prefix}weight"])


def scales_before_each_forward(root: nn.Module) -> None:
    """Before each forward of `root` (a model or pipeline chunk that FSDP2 shards with float8 gathers), the scales of
    all its float8 weights in one all-reduce of their maxima (torchao's precompute), instead of one all-reduce per
    weight at each gather. Computed at each forward, not after the optimizer step as torchao's example does, so that
    weights changed any other way (a checkpoint loaded, a rollback) are never cast with stale scales; each weight's
    scale is what a gather of it would compute, so the numbers do not change. A pipeline stage, which keeps its
    weights gathered through the step, finds none sharded after its first microbatch and all-reduces nothing then.
    Relies on torchao casting at each gather with the scale last precomputed (torchao 0.18); tests/test_comms.py
    counts these all-reduces in runs."""
    precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    root.register_forward_pre_hook(lambda module, args: precompute(module), prepend=True)
