"""Every rank resumes from the same checkpoint, or every rank starts afresh: checked as soon as the ranks can talk.

Each rank decides what `ckpt_path` resumes from (`auto`, `last`) from the files it sees, before the process group
exists. Run folders on each node's own disk, or a shared file system whose caches lag, can have the ranks decide
differently; a rank that starts afresh beside ranks that resume would train a model of its own, or wait in a sharded
load the others began. Once the group is up, before anything loads, rank 0's choice is sent to every rank, and if any
rank chose otherwise every rank stops with the same error.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from project.runtime.errors import ConfigError


class SameStartOnEveryRank(Callback):
    def __init__(self, ckpt_path: str | None):
        self.ckpt_path = None if ckpt_path is None else str(ckpt_path)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.world_size == 1:
            return
        first = trainer.strategy.broadcast(self.ckpt_path, src=0)
        # A flag per rank, each rank setting its own, summed over the ranks (an all-reduce: Lightning's all_gather
        # goes through a torch function that warns of its deprecation).
        differs = torch.zeros(trainer.world_size, device=trainer.strategy.root_device)
        differs[trainer.global_rank] = float(first != self.ckpt_path)
        flags = trainer.strategy.reduce(differs, reduce_op="sum")
        others = [rank for rank, flag in enumerate(flags.tolist()) if flag]
        if not others:
            return
        this = f" (rank {trainer.global_rank} {describe(self.ckpt_path)})" if trainer.global_rank in others else ""
        raise ConfigError(
            f"the ranks do not start from the same checkpoint: rank 0 {describe(first)}, and rank(s) "
            f"{', '.join(map(str, others))} decided otherwise{this}, each from the files it sees. Every rank must see "
            "the same run folder: put hydra.run.dir and ckpt_dir on a file system every node shares (not a node's "
            "own disk), or name the checkpoint for all of them with ckpt_path=PATH."
        )


def describe(ckpt_path: str | None) -> str:
    return "starts afresh (no checkpoint)" if ckpt_path is None else f"resumes from {ckpt_path}"
