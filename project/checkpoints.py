"""Read a training checkpoint in one process, whether a single file or a distributed-checkpoint folder."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy


def load_full_checkpoint(path: str | Path) -> dict[str, Any]:
    """The Lightning checkpoint dict, with the whole (unsharded) state_dict, on the CPU.

    Sharded strategies (fsdp with state_dict_type=sharded, fsdp2, tp, tp_fsdp) save `last.ckpt` as a
    folder of torch.distributed.checkpoint shards, which Lightning reads here without a process
    group. FSDP1 stores the weights under "model", ModelParallelStrategy under "state_dict"; both
    keep optimizers as "optimizer_0", ... (keyed by parameter name). The whole model must fit in
    CPU memory.
    """
    path = Path(path)
    if not path.is_dir():
        return torch.load(path, map_location="cpu", weights_only=False)
    checkpoint = _load_distributed_checkpoint(path)
    if "model" in checkpoint:
        checkpoint["state_dict"] = checkpoint.pop("model")
    optimizers = sorted((k for k in checkpoint if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in optimizers]
    return checkpoint


def _index_keyed(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A distributed checkpoint keys optimizer state by parameter name; torch.optim wants positions."""
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    if not names or not isinstance(names[0], str):
        return optimizer_state
    position = {name: i for i, name in enumerate(names)}
    return {
        "state": {position[name]: value for name, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [position[n] for n in group["params"]]} for group in optimizer_state["param_groups"]],
    }


def resumable_by(strategy: Strategy, ckpt_path: str | None, run_dir: Path) -> str | None:
    """`ckpt_path`, or a single-file copy of it where `strategy` cannot read a sharded folder.

    FSDP and ModelParallelStrategy load sharded folders themselves, resharding to their own layout.
    Single-device and DDP runs resume from a consolidated file, written (atomically, whichever rank
    gets there first) beside the run's checkpoints.
    """
    if ckpt_path is None or not Path(ckpt_path).is_dir() or isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        return ckpt_path
    checkpoint = load_full_checkpoint(ckpt_path)
    checkpoint["optimizer_states"] = [_index_keyed(state) for state in checkpoint.get("optimizer_states", [])]
    target = run_dir / "checkpoints" / f"consolidated-{Path(ckpt_path).name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    torch.save(checkpoint, partial)
    os.replace(partial, target)
    return str(target)


def rebase_batch_progress(checkpoint: dict[str, Any], accumulate_grad_batches: int) -> None:
    """Re-count Lightning's micro-batch counters for this run's gradient accumulation.

    Lightning decides where an accumulation window ends, and when to validate, from how many
    micro batches it has seen. A run resumed with another accumulation count (another number of
    data-parallel replicas for the same global batch) must count as if it had always used its
    own, or its windows straddle optimizer steps. The optimizer-step count is what stays fixed.
    """
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = loop.get("epoch_loop.batch_progress")
    if progress is None:
        return
    steps = checkpoint["global_step"]
    for counts in (progress["total"], progress["current"]):
        in_flight = counts["ready"] - counts["completed"]  # the batch a mid-step checkpoint was taken in
        counts["ready"] = counts["started"] = counts["processed"] = steps * accumulate_grad_batches
        counts["completed"] = counts["ready"] - in_flight


def writes_sharded_checkpoints(strategy: Strategy) -> bool:
    if isinstance(strategy, ModelParallelStrategy):
        return strategy._save_distributed_checkpoint
    return isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "sharded"


def keep_previous_last(strategy: Strategy, checkpoint_dir: Path) -> Path | None:
    """Move a last.ckpt of the other kind (folder vs file) aside, so that this run can write its own.

    A run resumed under another layout writes last.ckpt in its own format; writing a file where a
    folder stands (or the reverse) would fail part-way and lose the new checkpoint. The old one is
    renamed, never deleted. Returns its new path, if it was moved.
    """
    last = checkpoint_dir / "last.ckpt"
    if not last.exists() or last.is_dir() == writes_sharded_checkpoints(strategy):
        return None
    kind = "sharded" if last.is_dir() else "file"
    target, n = checkpoint_dir / f"last-{kind}.ckpt", 1
    while target.exists():
        n += 1
        target = checkpoint_dir / f"last-{kind}-{n}.ckpt"
    try:
        last.rename(target)
    except FileNotFoundError:  # another rank of this run moved it first
        return None
    return target
