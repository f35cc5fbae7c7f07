"""`strategy.activation_checkpointing=true` under the model-parallel strategies (fsdp2, tp, tp_fsdp, pipeline): each
block's activations recomputed in its backward instead of kept from its forward, through torch's checkpoint_wrapper
(as torchtitan and Lightning's FSDP apply it).

The wrapper strips its own name from state dicts, so checkpoints keep the plain model's names; inside the model its
parameters are named with it, which the model's tensors are found without (project.model.spec.own_name).
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from project.model.llama import Llama


def recompute_blocks(model: Llama) -> None:
    """Wrap every block `model` holds (a pipeline stage: its own) so that its backward recomputes its forward."""
    for index, block in list(model.layers.items()):
        model.layers[index] = checkpoint_wrapper(block)
