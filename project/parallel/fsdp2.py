"""FSDP2 (`fully_shard`): each block, then the root, sharded over the data-parallel mesh."""

from __future__ import annotations

from typing import Callable, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from project.model.llama import Llama
from project.parallel.expert_parallel import SplitExperts


def apply_fsdp2(
    model: Llama | nn.Module,
    mesh: DeviceMesh,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    reshard_after_forward: bool = True,
    experts_mesh: DeviceMesh | None = None,
    cpu_offload: bool = False,
) -> None:
    """Shard parameters, gradients and optimizer state over `mesh`: a 1-D mesh shards over all its ranks; a 2-D mesh
    (HSDP) shards along its second dimension and replicates across its first, where FSDP2 all-reduces each
    reduce-scattered gradient shard.

    Sharding each block separately lets one block's parameters be gathered while the previous
    block computes; the root call covers the embedding, final norm and output head. `model` is a
    Llama or a pipeline stage of one (anything whose blocks are in `layers`).
    `param_dtype` (None: float32) is the compute dtype; `reduce_dtype` (None: float32) the dtype
    gradients are reduce-scattered in. torch's own default for the latter is `param_dtype`, which
    would sum bfloat16 gradients across ranks; we keep float32 unless asked, as torchtitan does.
    `reshard_after_forward=False` keeps each block's gathered parameters from its forward to the end of the
    step's backward passes: one gather per step instead of one per forward and backward of each microbatch (a
    pipeline stage runs several microbatches per step: torchtitan does the same there).
    `experts_mesh`: the ranks that hold the same experts, where expert parallelism split them
    (project.parallel.expert_parallel): each mixture's experts are sharded over those ranks alone, and their
    gradients averaged over them (each already the mean over its expert-parallel group's ranks).
    `cpu_offload`: the shards, their gradients and the optimizer's states kept in host memory, copied to the device
    for each gather (FSDP2's CPUOffloadPolicy).
    """
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype) if param_dtype else None,
        reduce_dtype=getattr(torch, reduce_dtype or "float32"),
    )

    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()

    def shard(module: nn.Module, over: DeviceMesh) -> None:
        placement = stacked_experts_by_width(over.size(over.ndim - 1))  # the ranks that split each weight
        fully_shard(
            module,
            mesh=over,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=placement,
            offload_policy=offload,
        )

    # nn.Module's attribute typing (Tensor | Module) does not know a stage's `layers` is a ModuleDict.
    for block in cast(nn.ModuleDict, model.layers).values():
        for experts in block.modules():
            if isinstance(experts, SplitExperts) and experts_mesh is not None:
                shard(experts, experts_mesh)  # over the ranks holding the same experts, before the block
        shard(block, mesh)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward, offload_policy=offload)


def stacked_experts_by_width(ranks: int) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2's placement of each parameter over `ranks`: stacked matrices [n, out, in] (a mixture's
    experts: the only 3-D tensors a family has, project.model.spec) split along a width (out, else in) that the ranks
    divide, not along their first dimension: 8 experts over 64 ranks would leave 56 ranks none of them and 8 a whole
    expert each (FSDP2 splits only dim 0 unevenly). Every other parameter, and experts no width of which the ranks
    divide: FSDP2's own dim-0 split (None)."""

    def placement(param: nn.Parameter) -> Shard | None:
        # A DTensor (expert or tensor parallelism's shard) is placed by its local shape, as FSDP2 splits that.
        shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
        if len(shape) != 3:
            return None
        return next((Shard(dim) for dim in (1, 2) if shape[dim] % ranks == 0), None)

    return placement
