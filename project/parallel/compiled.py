"""`strategy.compile=true` for the strategies that keep the whole model on every device (single, ddp).

The model-parallel strategies compile each block inside their `parallelize`; these get the same hook
from `CompiledBlocks`, so that one setting means the same thing under every strategy. Blocks are
compiled in place (`nn.Module.compile`): parameter names, and so checkpoints, stay the plain model's.
"""

from __future__ import annotations

from project.model import Llama
from project.parallel.init import materialize


def compile_blocks(model: Llama) -> None:
    for block in model.layers.values():
        block.compile()


class CompiledBlocks:
    """Mixin: a `parallelize` that compiles each transformer block before the strategy wraps the model."""

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        if any(p.is_meta for p in model.parameters()):  # a strategy with this hook gets its model built on meta
            materialize(model, self.root_device, initialize)
        compile_blocks(model)
