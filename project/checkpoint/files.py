"""Read a training checkpoint in one process, whether a single file or a distributed-checkpoint folder."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from project.runtime.errors import ConfigError


def read_checkpoint_file(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint file, or a sharded folder's metadata file, on the CPU.

    weights_only: a checkpoint is data (tensors, numbers, strings, dicts), and one from elsewhere must not
    run code as it loads; the platform's own checkpoints hold nothing else. A file that is not a readable
    checkpoint (truncated, corrupt, or holding other objects) is a ConfigError naming it.
    """
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"{path} is not a checkpoint this platform can read ({reason}): it may be truncated or corrupt "
            "(copied or downloaded only in part: pass another checkpoint, e.g. the run's best-step*.ckpt), or hold "
            "objects other than tensors and plain data, which are not loaded because loading them could run code."
        ) from None


SHARDED_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a folder's shards
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


def verify_sharded_checkpoint(folder: Path) -> None:
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
        with open(folder / SHARDED_METADATA, "rb") as file:
            metadata = _ShardedMetadataUnpickler(file).load()
        entries = [
            MetadataIndex(fqn)
            for fqn, kind in metadata.state_dict_metadata.items()
            if isinstance(kind, BytesStorageMetadata)
        ]
        for entry in entries:
            where = metadata.storage_data[entry]
            with open(folder / where.relative_path, "rb") as file:
                file.seek(where.offset)
                torch.load(io.BytesIO(file.read(where.length)), map_location="cpu", weights_only=True)
    except FileNotFoundError as error:
        raise refuse(f"{Path(error.filename).name} is missing") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, KeyError, TypeError) as error:
        raise refuse(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__) from None


def load_full_checkpoint(path: str | Path) -> dict[str, Any]:
    """The Lightning checkpoint dict, with the whole (unsharded) state_dict, on the CPU.

    Sharded strategies (fsdp with state_dict_type=sharded, fsdp2, tp, tp_fsdp) save `last.ckpt` as a
    folder of torch.distributed.checkpoint shards, which torch consolidates here without a process group
    (into one file in the temporary directory, $TMPDIR: it needs room for the whole checkpoint there).
    FSDP1 stores the weights under "model", ModelParallelStrategy under "state_dict"; both keep optimizers
    as "optimizer_0", ... (keyed by parameter name). The whole model must fit in CPU memory.
    """
    path = Path(path)
    if not path.is_dir():
        return read_checkpoint_file(path)
    verify_sharded_checkpoint(path)
    with tempfile.TemporaryDirectory(prefix="whole-checkpoint-") as scratch:
        whole = Path(scratch) / "checkpoint.pt"
        dcp_to_torch_save(path, whole)
        checkpoint = read_checkpoint_file(whole)
    if (path / LIGHTNING_EXTRA).is_file():
        checkpoint.update(read_checkpoint_file(path / LIGHTNING_EXTRA))
    if "model" in checkpoint:
        checkpoint["state_dict"] = checkpoint.pop("model")
    optimizers = sorted(
        (k for k in checkpoint if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k.split("_")[1])
    )
    if optimizers:
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in optimizers]
    return checkpoint


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """A checkpoint's (file or sharded folder) step, hyper-parameters and other records, without reading its tensors."""
    path = Path(path)
    return (
        read_checkpoint_file(path / LIGHTNING_EXTRA, mmap=False)
        if path.is_dir()
        else read_checkpoint_file(path, mmap=True)
    )


def checkpoint_step(path: str | Path) -> int:
    """The optimizer steps a checkpoint (file or sharded folder) was trained for, without loading its tensors."""
    return int(checkpoint_metadata(path)["global_step"])


def _keyed_by_name(optimizer_state: dict[str, Any]) -> bool:
    params = [p for group in optimizer_state.get("param_groups", []) for p in group["params"]]
    return not params or isinstance(params[0], str)


def _rekeyed(optimizer_state: dict[str, Any], key: Mapping[Any, Any]) -> dict[str, Any]:
    return {
        "state": {key[k]: value for k, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [key[k] for k in group["params"]]} for group in optimizer_state["param_groups"]
        ],
    }


def _index_keyed(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A distributed checkpoint keys optimizer state by parameter name; torch.optim wants positions."""
    if not _keyed_by_name(optimizer_state):
        return optimizer_state
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    return _rekeyed(optimizer_state, {name: i for i, name in enumerate(names)})


def _name_keyed(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch.optim's positions -> parameter names, given the names in the optimizer's order.

    Lightning maps positions to names itself when a sharded strategy loads a single file, but in
    the module's parameter order, which is not the optimizer's when there are several groups.
    """
    if _keyed_by_name(optimizer_state):
        return optimizer_state
    positions = sum(len(group["params"]) for group in optimizer_state["param_groups"])
    if positions != len(names):
        raise ConfigError(
            f"the checkpoint's optimizer holds {positions} parameters, this model {len(names)}: "
            "resume with the model config the checkpoint was trained with."
        )
    return _rekeyed(optimizer_state, dict(enumerate(names)))


def checkpoint_format(path: str | Path) -> str:
    """ "file" (one torch.save file), or the strategy family that wrote a sharded folder.

    FSDP1 ("fsdp") keeps the weights under the top-level key "model", ModelParallelStrategy
    ("model_parallel": fsdp2, tp, tp_fsdp) under "state_dict"; neither loads the other's folder.
    """
    path = Path(path)
    if not path.is_dir():
        return "file"
    verify_sharded_checkpoint(path)
    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    return "fsdp" if any(key.startswith("model.") for key in keys) else "model_parallel"


def _shards_by_name(strategy: Strategy) -> bool:
    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))


def _loads_as_is(strategy: Strategy, path: Path) -> bool:
    fmt = checkpoint_format(path)
    if fmt != "file":  # a sharded strategy reshards its own family's folders as it loads them
        return isinstance(strategy, {"fsdp": FSDPStrategy, "model_parallel": ModelParallelStrategy}[fmt])
    if not _shards_by_name(strategy):
        return True
    optimizers = read_checkpoint_file(path, mmap=True).get("optimizer_states", [])
    return all(_keyed_by_name(state) for state in optimizers)


def _fingerprint(source: Path, by_name: bool) -> str:
    """Names a conversion after its source's path, size and age: equal for all ranks, new when the source changes."""
    files = [f for f in source.iterdir()] if source.is_dir() else [source]
    stats = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return hashlib.sha1(repr((str(source.resolve()), stats, by_name)).encode()).hexdigest()[:12]


def resumable_by(
    strategy: Strategy,
    ckpt_path: str | None,
    run_dir: Path,
    parameter_names: list[str],
    converts: bool,
    wait_s: float = 3600,
) -> str | None:
    """`ckpt_path`, or a single-file copy of it that `strategy` resumes from correctly.

    Sharded strategies load folders of their own family (resharding them) and single files whose
    optimizer state is keyed by parameter name; single-device and DDP runs load single files keyed
    by position. Anything else is converted into checkpoints/resume-<fingerprint>.ckpt by the one
    process with `converts` (the first of the run; the whole checkpoint passes through its CPU
    memory) while the others wait for the file. `parameter_names` are the names in the
    optimizer's order. StepCheckpoint deletes the copy once every rank has loaded it.
    """
    if ckpt_path is None or _loads_as_is(strategy, Path(ckpt_path)):
        return ckpt_path
    source, by_name = Path(ckpt_path), _shards_by_name(strategy)
    target = run_dir / "checkpoints" / f"resume-{_fingerprint(source, by_name)}.ckpt"
    if converts and not target.exists():
        rank_zero_info(f"converting {source} for this layout into {target} ...")
        checkpoint = load_full_checkpoint(source)
        states = [_index_keyed(state) for state in checkpoint.get("optimizer_states", [])]
        if by_name:
            states = [_name_keyed(state, parameter_names) for state in states]
        checkpoint["optimizer_states"] = states
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")  # written whole, then renamed into place
        torch.save(checkpoint, partial)
        os.replace(partial, target)
    deadline = time.monotonic() + wait_s
    while not target.exists():
        if time.monotonic() > deadline:
            raise ConfigError(
                f"ckpt_path={ckpt_path}: waited {wait_s:.0f} s for the first process to convert it into {target}; "
                "check that process's log, and that all processes share the run directory's file system."
            )
        time.sleep(1)
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


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


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
        os.replace(staged, target)
        remove(old)
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


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """The checkpoint a run resumes from: `ckpt_path`, or `last` in `run_dir`; the one swap_in kept aside
    where the run stopped while replacing it."""
    if ckpt_path is None:
        return None
    path = run_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
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
