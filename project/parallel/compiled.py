"""`strategy.compile=true`: each transformer block compiled in place, under every strategy.

`compile_blocks` is what all of them call (fsdp before wrapping, the model-parallel strategies inside
their `parallelize`). Single and ddp get it through the `CompiledBlocks` hook, so that one setting means
the same thing everywhere. In place (`nn.Module.compile`): parameter names, and so checkpoints, stay the
plain model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from project.model.llama import Llama
from project.parallel.init import materialize

if TYPE_CHECKING:
    import torch


def compile_blocks(model: Llama) -> None:
    for block in model.layers.values():
        block.compile()


class CompiledBlocks:
    """Mixin: a `parallelize` that compiles each transformer block before the strategy wraps the model."""

    model_on_meta = True

    if TYPE_CHECKING:

        @property
        def root_device(self) -> torch.device: ...  # the strategy's that this mixes into

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        if any(p.is_meta for p in model.parameters()):  # a strategy with this hook gets its model built on meta
            materialize(model, self.root_device, initialize)
        compile_blocks(model)
