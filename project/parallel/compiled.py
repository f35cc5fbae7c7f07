"""`strategy.compile=true`: each transformer block compiled in place, under every strategy.

`compile_blocks` is what all of them call (fsdp before wrapping, the model-parallel strategies inside
their `parallelize`, single and ddp through `WholeModelTransforms`), so that one setting means the same thing
everywhere. In place (`nn.Module.compile`): parameter names, and so checkpoints, stay the plain model's.
"""

from __future__ import annotations

from project.model.llama import Llama


def compile_blocks(model: Llama) -> None:
    for block in model.layers.values():
        block.compile()
