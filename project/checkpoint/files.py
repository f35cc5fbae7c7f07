"""Checkpoint files and folders: reading them safely, their records without their tensors, and putting a new one in
place of the old."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from project.checkpoint.locations import (
    SHARDED_METADATA,
    Location,
    is_folder,
    is_remote,
    join,
    local_file,
    read_bytes,
    read_range,
    remove,
    writing,
)
from project.runtime.errors import ConfigError


def read_checkpoint_file(path: Location, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint file, or a sharded folder's metadata file, on the CPU (one in object storage: memory-mapped from
    a local copy, else read into memory).

    weights_only: a checkpoint is data (tensors, numbers, strings, dicts), and one from elsewhere must not
    run code as it loads; the platform's own checkpoints hold nothing else. A file that is not a readable
    checkpoint (truncated, corrupt, or holding other objects) is a ConfigError naming it.
    """
    source: Any = local_file(path) if mmap else io.BytesIO(read_bytes(path)) if is_remote(path) else path
    try:
        return torch.load(source, map_location="cpu", mmap=mmap, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"{path} is not a checkpoint this platform can read ({reason}): it may be truncated or corrupt "
            "(copied or downloaded only in part: pass another checkpoint, e.g. the run's best-step*.ckpt), or hold "
            "objects other than tensors and plain data, which are not loaded because loading them could run code."
        ) from None


def write_checkpoint_file(checkpoint: dict[str, Any], path: Location) -> None:
    """`checkpoint` saved by torch straight into the file at `path` (or object), whole or not at all. Lightning's
    checkpoint IO serializes it into memory first and copies that out again: two more copies of the whole state in
    host memory, for the length of the save."""
    with writing(path) as file:
        try:
            torch.save(checkpoint, file)
        except RuntimeError:
            if file.error is not None:  # the storage's own error (a full disk), which torch reported as its own
                raise file.error from None
            raise


# What Lightning saves beside the shards of a sharded checkpoint: the step, hyper-parameters and loops' state.
# Its name is Lightning's (lightning.fabric.utilities.load), which keeps it private: tests/test_private_names.py.
LIGHTNING_EXTRA = "meta.pt"


class _ShardedMetadataUnpickler(pickle.Unpickler):
    """A distributed checkpoint's `.metadata` is a pickle (torch loads it with plain `pickle.load`): here only
    the types it holds may be built: torch.distributed.checkpoint's metadata classes, sizes, dtypes, paths."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    NAMES = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module in self.MODULES or (module, name) in self.NAMES else None
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None or module in self.MODULES and not isinstance(found, type):
            raise pickle.UnpicklingError(
                f"{module}.{name} is not among the types a distributed checkpoint's metadata holds"
            )
        return found


def verify_sharded_checkpoint(folder: Location) -> None:
    """Refuse a sharded checkpoint folder that would run code as torch loads it.

    torch reads a distributed checkpoint's `.metadata` with `pickle.load`, and its non-tensor entries
    (optimizer settings, say) with `torch.load(weights_only=False)`. Both are read here first, the metadata
    with `_ShardedMetadataUnpickler` and each entry with `weights_only=True`: a folder that passes holds
    only those types, so torch's own loading then runs no code from it.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    def refuse(reason: str) -> ConfigError:
        return ConfigError(
            f"{folder} is not a sharded checkpoint this platform can read ({reason}): it may be truncated or corrupt, "
            "or hold objects other than tensors and plain data, which are not loaded because loading them could run "
            "code."
        )

    try:
        metadata = _ShardedMetadataUnpickler(io.BytesIO(read_bytes(join(folder, SHARDED_METADATA)))).load()
        entries = [
            MetadataIndex(fqn)
            for fqn, kind in metadata.state_dict_metadata.items()
            if isinstance(kind, BytesStorageMetadata)
        ]
        for entry in entries:
            where = metadata.storage_data[entry]
            data = read_range(join(folder, where.relative_path), where.offset, where.length)
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except FileNotFoundError as error:
        missing = Path(error.filename).name if error.filename else str(error).strip().splitlines()[0]
        raise refuse(f"{missing} is missing") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, KeyError, TypeError) as error:
        raise refuse(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__) from None


def checkpoint_metadata(path: Location) -> dict[str, Any]:
    """A checkpoint's (file or sharded folder) step, hyper-parameters and other records, without reading its tensors."""
    return (
        read_checkpoint_file(join(path, LIGHTNING_EXTRA), mmap=False)
        if is_folder(path)
        else read_checkpoint_file(path, mmap=True)
    )


# The oldest checkpoints this version reads: those of 2026-11-27 on, which all record their learning-rate schedule
# ("schedule", the first record added that day). The code that read older ones went with version 0.2.0; 0.1.0 at
# commit da724a6 still reads them, and its checkpoints are read here.
FORMAT_SINCE = "2026-11-27"
READS_OLDER = "version 0.1.0 (git checkout da724a6)"


def refuse_older_format(checkpoint: Mapping[str, Any], source: object) -> None:
    """Refuse a checkpoint of our module written before FORMAT_SINCE, naming the version that reads it."""
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, Mapping) and "model" in hparams and "schedule" not in checkpoint:
        raise ConfigError(
            f"ckpt_path={source} was written before {FORMAT_SINCE} (it records no learning-rate schedule), by a "
            f"version of this platform whose checkpoints this one no longer reads. {READS_OLDER} reads it: resume "
            "it there for one step (or export it), then pass the checkpoint that run writes, which this version "
            "reads; or start a new run without ckpt_path."
        )


def checkpoint_step(path: Location) -> int:
    """The optimizer steps a checkpoint (file or sharded folder) was trained for, without loading its tensors."""
    return int(checkpoint_metadata(path)["global_step"])


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


def swap_in(staged: Path, target: Path, remove_old: bool = True) -> Path | None:
    """Put a fully written checkpoint (file or folder) at `target`, replacing what was there.

    A file replaces a file atomically. Otherwise the old one is renamed `<target>.old` first and
    removed last (or, with `remove_old=False`, left for the caller to remove), and `previous_checkpoint`
    finds it if the process dies in between. An old one of
    the other format (a folder where a file now goes, or the reverse: a run resumed under another
    layout) is kept instead, as `last-sharded.ckpt` or `last-file.ckpt`; its path is returned.
    """
    old = target.with_name(f"{target.name}.old")
    if staged.is_file() and target.is_file():
        remove(old)
        if not remove_old:  # the caller keeps the replaced one a while (ckpt_keep_last): a second name for it
            os.link(target, old)
        os.replace(staged, target)
        return None
    if target.exists():
        remove(old)
        target.rename(old)
    staged.rename(target)
    if not old.exists() or old.is_dir() == target.is_dir():
        if remove_old:
            remove(old)  # only now: it may be all a run that died mid-swap has
        return None
    kept, n = target.with_name(f"{target.stem}-{'sharded' if old.is_dir() else 'file'}{target.suffix}"), 1
    while kept.exists():
        n += 1
        kept = target.with_name(f"{target.stem}-{'sharded' if old.is_dir() else 'file'}-{n}{target.suffix}")
    old.rename(kept)
    return kept


def previous_checkpoint(target: Path) -> Path | None:
    """The checkpoint `swap_in` had moved aside when its process died, if any."""
    old = target.with_name(f"{target.name}.old")
    return old if old.exists() else None


def resolve_ckpt_path(ckpt_path: str | None, ckpt_dir: Location) -> str | None:
    """The checkpoint a run resumes from: `ckpt_path`, or `last` in `ckpt_dir` (the run's checkpoints folder); the
    one swap_in kept aside where the run stopped while replacing it. In object storage, `last` is the save that
    `latest` names (project.checkpoint.latest)."""
    if ckpt_path is None:
        return None
    if is_remote(ckpt_path) or ckpt_path == "last" and is_remote(ckpt_dir):
        from project.checkpoint.latest import complete, latest

        found = latest(ckpt_dir) if ckpt_path == "last" else ckpt_path if complete(ckpt_path) else None
        if found is None:
            where = (
                f"in {ckpt_dir} (no complete step-*.ckpt there)"
                if ckpt_path == "last"
                else f"at {ckpt_path} (or one whose save did not end: a folder without .metadata)"
            )
            raise ConfigError(f"ckpt_path={ckpt_path}: no checkpoint {where}.")
        return str(found)
    path = Path(ckpt_dir, "last.ckpt") if ckpt_path == "last" else Path(ckpt_path)
    previous = previous_checkpoint(path)
    if not path.exists() and previous is not None:
        rank_zero_info(f"{path} was being replaced when the run stopped: resuming from the previous one")
        path = previous
    if not path.exists():  # a file, or a folder from a sharded strategy
        hint = (
            " `ckpt_path=last` resumes the run in this run directory: pass the directory of the run to resume "
            "as hydra.run.dir=DIR."
            if ckpt_path == "last"
            else ""
        )
        raise ConfigError(f"ckpt_path={ckpt_path}: no checkpoint at {path}.{hint}")
    return str(path)
