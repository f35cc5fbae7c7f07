"""Copies that must stay equal, checked: every `stability.replica_check_every_n_steps` optimizer steps and before
every checkpoint is written, each part of a parameter that several ranks hold a copy of (the strategy's `replicas`:
DDP's whole model, the norms and a mixture's router under tensor parallelism, HSDP's shards across its groups) is
compared over the ranks holding it, bit for bit.

Why: every rank applies the same update to its copy, so copies only part when a rank computes its update
differently, which CPU kernels never do but GPU kernels that add in another order per rank (atomic `index_add_`,
split-K matmuls) can, and so can a faulty device. Nothing else would notice: each rank trains on, its copy a little
apart, until the model's quality or a resume under another layout shows it. A difference stops the run on every rank
with one paragraph naming the parameter, the ranks and the step; a checkpoint about to be written is not, so the
last one written holds equal copies.

Each copy is reduced to two integers on its own device (the sum of its elements' bit patterns, and that sum
weighted by position: exact, so the order of summing does not matter), gathered over its group: a few bytes per
parameter, one all-gather per group, and one all-reduce of a flag over every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from project.parallel.contract import Replica, contract_of
from project.runtime.errors import TrainingStopped
from project.training.callbacks.steps import OptimizerSteps

# An integer type of each element size, to read a tensor's bits as numbers.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements digested at a time: the int64 copies a piece needs (24 bytes an element) stay small beside the model.
PIECE = 1 << 22


def digest(tensor: torch.Tensor) -> torch.Tensor:
    """[2] int64: the sum of the elements' bit patterns and their sum weighted by position (1, 2, ...), wrapping
    around as integers do. Two copies that differ anywhere give other digests unless by rare coincidence."""
    bits = tensor.detach().contiguous().view(BITS[tensor.element_size()]).flatten()
    total = torch.zeros(2, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), PIECE):
        piece = bits[start : start + PIECE].long()
        position = torch.arange(start + 1, start + piece.numel() + 1, device=bits.device)
        total += torch.stack([piece.sum(), (piece * position).sum()])
    return total


def differences(replicas: list[Replica]) -> list[str]:
    """What differs across the groups this rank belongs to, one line per part: its name and the ranks whose copy is
    not the group's first rank's. Every rank of a group must call it with the group's parts in the same order (the
    strategy lists them from the same parameters on every rank)."""
    groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[Replica]]] = {}
    for replica in replicas:
        key = tuple(dist.get_process_group_ranks(replica.group))
        groups.setdefault(key, (replica.group, []))[1].append(replica)
    found = []
    for ranks, (group, members) in groups.items():  # in the order their first parts come, alike on every rank
        mine = torch.stack([digest(r.local) for r in members])
        everyone = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(everyone, mine, group=group)
        every = torch.stack(everyone).cpu()  # [ranks, parts, 2]: read on the host once
        for index, replica in enumerate(members):
            digests = [tuple(d) for d in every[:, index].tolist()]
            if len(set(digests)) == 1:
                continue
            counts = [digests.count(d) for d in digests]
            reference = digests[counts.index(max(counts))]  # the copy most ranks hold; on a tie, the first rank's
            apart = [rank for rank, d in zip(ranks, digests) if d != reference]
            held = [rank for rank, d in zip(ranks, digests) if d == reference]
            found.append(f"{replica.name} on rank(s) {apart} differs from rank(s) {held} (its copies: {list(ranks)})")
    return found


def check_replicas(replicas: list[Replica], step: int, device: torch.device) -> None:
    """Compare the copies (`differences`) and stop every rank alike where any group found one (TrainingStopped)."""
    found = differences(replicas)
    flag = torch.tensor([len(found)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    lines = sorted({line for rank_lines in every for line in rank_lines})
    shown = "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
    raise TrainingStopped(
        f"copies of replicated parameters differ at step {step}: {shown}. Ranks that hold the same part of a "
        "parameter apply the same update to it, so their copies must stay bit for bit equal: one rank computed "
        "its update differently (a GPU kernel that adds in another order on each rank, such as an atomic "
        "index_add_, or a faulty device). The run stopped before writing another checkpoint; the last one written "
        "holds equal copies. Resume from it (ckpt_path=last), on other devices if the same ranks differ again; "
        "stability.replica_check_every_n_steps sets how often this is checked."
    )


class ReplicaCheck(Callback):
    """`check_replicas` every `every_n_steps` optimizer steps (0: only before each save) and before each save, on
    multi-process runs whose strategy lists copies."""

    def __init__(self, every_n_steps: int = 100):
        self.every_n_steps = every_n_steps
        self._steps = OptimizerSteps()
        self._checked_at = -1  # a step's copies are compared once, be it a checking step or a save

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.start(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._steps.just_ended(trainer) and self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._check(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._check(trainer, pl_module)  # before the checkpoint is written: every rank builds it alike

    def _check(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.world_size <= 1 or self._checked_at == trainer.global_step:
            return
        self._checked_at = trainer.global_step
        replicas = contract_of(trainer.strategy).replicas(pl_module)
        if dist.is_available() and dist.is_initialized():
            check_replicas(replicas, trainer.global_step, pl_module.device)
