"""A prepared dataset on this machine: its layout (a manifest beside one litdata split per folder) and the
checks that it is whole, made before training reads a batch. Nothing here imports torch."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping

from project.runtime.errors import ConfigError

MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
# What training reads of a manifest (project.data.prepare writes them all).
MANIFEST_KEYS = (
    ("tokenizer", "vocab_size"),
    ("tokenizer", "eos_id"),
    ("block_size",),
    *(("splits", s, "blocks") for s in SPLITS),
)


def _prepare_again(data_dir: str | os.PathLike) -> str:
    return (
        f"prepare the shards again with `python -m project.prepare data.dir={data_dir} data.overwrite=true` and the "
        "data settings they were made with, or point data.dir at other prepared shards"
    )


def read_manifest(folder: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The manifest.json in `folder` (prepared shards, or the local view of remote ones named `data_dir`),
    refused as a ConfigError when it is missing, is not JSON, or lacks what training reads."""
    path = Path(folder) / MANIFEST_NAME
    data_dir = data_dir or folder
    if not path.is_file():
        absent = "" if Path(folder).exists() else "; the folder does not exist"
        raise ConfigError(
            f"no prepared shards in data.dir={data_dir} (missing {MANIFEST_NAME}{absent}): run `python -m "
            "project.prepare` with the same data settings first (or train with data.auto_prepare=true), or point "
            "data.dir at prepared shards."
        )
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"data.dir={data_dir}: {path} is not JSON ({error}); {_prepare_again(data_dir)}.") from None
    missing = []
    for keys in MANIFEST_KEYS:
        node = manifest
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            missing.append(".".join(keys))
    if missing:
        raise ConfigError(
            f"data.dir={data_dir}: {path} lacks {', '.join(missing)}, so it was not written by project.prepare; "
            f"{_prepare_again(data_dir)}."
        )
    return manifest


def check_block_size(data_dir: str | os.PathLike, manifest: Mapping[str, Any], seq_len: int) -> None:
    if manifest["block_size"] != seq_len + 1:
        raise ConfigError(
            f"shards in data.dir={data_dir} hold blocks of {manifest['block_size']} tokens, but data.seq_len={seq_len} "
            f"needs {seq_len + 1}: re-run `python -m project.prepare` with data.seq_len={seq_len} (into another "
            f"data.dir, or with data.overwrite=true), or use data.seq_len={manifest['block_size'] - 1}."
        )


def check_shards(folder: str | os.PathLike, data_dir: str | os.PathLike | None = None, chunks: bool = True) -> None:
    """Every chunk file litdata's index.json lists is there and whole, checked by its size and its header.
    (`chunks=False`: the indexes only, for remote shards, whose chunks litdata fetches when it reads them.)

    litdata reads a chunk only when a batch needs it: a truncated one then stops training mid-run with
    litdata's own timeout, and an overwritten one trains on whatever its bytes say. Its header
    (item count, then item offsets ending at the file size) tells both apart from a sound chunk by
    reading a few bytes, where hashing every chunk would read the whole dataset at each start.
    """
    data_dir = data_dir or folder
    for split in SPLITS:
        index = Path(folder) / split / "index.json"
        try:
            listed = [
                (c["filename"], int(c["chunk_bytes"]), int(c["chunk_size"]))
                for c in json.loads(index.read_bytes())["chunks"]
            ]
        except FileNotFoundError:
            raise ConfigError(f"data.dir={data_dir}: {index} is missing; {_prepare_again(data_dir)}.") from None
        except (ValueError, KeyError, TypeError) as error:  # not JSON, or not litdata's index
            raise ConfigError(
                f"data.dir={data_dir}: {index} is damaged ({error!r}); {_prepare_again(data_dir)}."
            ) from None
        for name, size, items in listed if chunks else ():
            problem = _chunk_problem(index.parent / name, size, items)
            if problem:
                raise ConfigError(
                    f"data.dir={data_dir}: shard {index.parent / name} {problem}; {_prepare_again(data_dir)}."
                )


def _chunk_problem(path: Path, size: int, items: int) -> str | None:
    try:
        actual = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(4 * (items + 2))
    except FileNotFoundError:
        return "is missing"
    if actual != size:
        return f"holds {actual} bytes where its index.json says {size}: it was cut short (or appended to)"
    # litdata's chunk header: the item count, then items + 1 offsets from the header's end to the file's.
    count, *offsets = struct.unpack(f"<{items + 2}I", header) if len(header) == 4 * (items + 2) else (None, None)
    if count != items or offsets[0] != len(header) or offsets[-1] != size or offsets != sorted(offsets):
        return "does not start with the header litdata wrote (its bytes were overwritten: the file is corrupt)"
    return None


def shards_present(output_dir: Path) -> bool:
    """Whether every split's shards are in `output_dir` (a manifest without them has nothing left to lose)."""
    return all((output_dir / split / "index.json").is_file() for split in SPLITS)
