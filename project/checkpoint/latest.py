"""last.ckpt in object storage, where nothing can be renamed into place: each save is written under its own name,
`step-<N>.ckpt`, and `latest`, a small object written once that save is complete, names the one to resume from.

A run killed while saving leaves `latest` naming the previous save, and a partial `step-<N>.ckpt` that the next
save removes. With `ckpt_keep_last=N`, the N newest complete saves (by step, up to the one just made) are kept.
A checkpoint is complete once its last object is written: a file's one object, a folder's `.metadata`, which torch
writes after every rank's shards.
"""

from __future__ import annotations

import re

from project.checkpoint.locations import (
    SHARDED_METADATA,
    Location,
    children,
    is_file,
    join,
    read_bytes,
    remove,
    write_bytes,
)
from project.runtime.errors import ConfigError

LATEST = "latest"
SAVE_NAME = re.compile(r"step-(\d+)\.ckpt")


def save_name(step: int) -> str:
    return f"step-{step:06d}.ckpt"


def complete(path: Location) -> bool:
    return is_file(path) or is_file(join(path, SHARDED_METADATA))


def saves(folder: Location) -> list[tuple[int, str]]:
    """(step, name) of every step-<N>.ckpt in `folder`, complete or not, by step."""
    found = [(int(m[1]), name) for name in children(folder) if (m := SAVE_NAME.fullmatch(name))]
    return sorted(found)


def latest(folder: Location) -> Location | None:
    """The checkpoint to resume from: the one `latest` names, complete; else the newest complete save (`latest`
    lost, or naming one removed by hand); None if there is none."""
    if is_file(join(folder, LATEST)):
        named = join(folder, read_bytes(join(folder, LATEST)).decode().strip())
        if complete(named):
            return named
    for _, name in reversed(saves(folder)):
        if complete(join(folder, name)):
            return join(folder, name)
    return None


def publish(saved: Location, keep: int) -> None:
    """`saved` (complete) becomes the checkpoint to resume from; then the saves beyond the `keep` newest up to it
    are removed, and the partial ones a killed save left."""
    folder, name = str(saved).rstrip("/").rsplit("/", 1)
    write_bytes(join(folder, LATEST), name.encode())
    step = int(SAVE_NAME.fullmatch(name)[1])  # type: ignore[index]  # our own name
    kept = 0
    for other_step, other in reversed(saves(folder)):
        path = join(folder, other)
        if other == name:
            kept += 1
        elif not complete(path):
            remove(path)
        elif other_step <= step:
            kept += 1
            if kept > keep:
                remove(path)


def refuse_another_runs(folder: Location, ckpt_path: str | None) -> None:
    """A run that is not this folder's own resumed (a new run, or one from another run's checkpoint) into a folder of
    object storage that holds saves would publish its own over them (`latest` renamed, theirs pruned): refused,
    naming the fix. `ckpt_path`: None, `last`, or a checkpoint's location."""
    own_save = ckpt_path is not None and str(ckpt_path).rstrip("/").rsplit("/", 1)[0] == str(folder).rstrip("/")
    if str(ckpt_path) == "last" or own_save:
        return
    found = latest(folder)
    if found is not None:
        what = "a new run" if ckpt_path is None else f"a run from ckpt_path={ckpt_path}, another run's checkpoint,"
        raise ConfigError(
            f"ckpt_dir={folder} holds another run's checkpoints (the latest: {found}), which {what} would replace: "
            "resume that run with ckpt_path=last, or give this run a ckpt_dir of its own."
        )
