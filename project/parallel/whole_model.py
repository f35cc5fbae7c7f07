"""The model transforms of strategies that keep the whole model on each rank (single, ddp): float8 layers, then
each block compiled, as the sharding strategies apply them inside their own `parallelize`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from project.model.llama import Llama
from project.parallel.compiled import compile_blocks
from project.parallel.float8 import apply_float8
from project.parallel.init import materialize

if TYPE_CHECKING:
    import torch


class WholeModelTransforms:
    """Mixin: a `parallelize` that applies `strategy.float8` and `strategy.compile` before the strategy wraps the
    model (DDP) or trains it (one device)."""

    model_on_meta = True

    def __init__(self, *args: Any, compile: bool = False, float8: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compile = compile
        self.float8 = float8

    if TYPE_CHECKING:

        @property
        def root_device(self) -> torch.device: ...  # the strategy's that this mixes into

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        if any(p.is_meta for p in model.parameters()):  # a strategy with this hook gets its model built on meta
            materialize(model, self.root_device, initialize)
        if self.float8:
            apply_float8(model, self.float8, self.root_device, self.compile, gather=False)
        if self.compile:
            compile_blocks(model)
