"""Preparing a corpus in parts, on one machine or several: the plan, who does what, and the merge.

A part is a contiguous group of source files of at least `part_bytes` (the last may be smaller). It is
the unit of work (one litdata worker tokenizes one part) and of chunking: a part's documents fill chunks
of their own. The shards therefore depend on the documents and the part size only, not on how many
workers or machines tokenized them: N machines each preparing their share give, once merged, the same
chunks, block for block, as one machine preparing every part.

Each machine (`node_rank` of `num_nodes`) tokenizes a contiguous range of parts into a work folder beside
the dataset (shared by all machines), marking each part done; whichever machine finishes last merges:
it moves every part's chunks into one dataset, in part order, with one index per split and one manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from project.runtime.errors import ConfigError

DONE_NAME = "done.json"
# Environment variables that say which machine this is, in the order they are consulted.
NODE_ENVIRONMENTS = (
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "a SLURM job array"),
    ("SLURM_PROCID", "SLURM_NTASKS", "srun"),
    ("NODE_RANK", "NUM_NODES", "torchrun-style variables"),
    ("GROUP_RANK", "NNODES", "torchrun"),
)


def plan_parts(files: Sequence[Path], part_bytes: int) -> list[list[Path]]:
    parts: list[list[Path]] = [[]]
    size = 0
    for path in files:
        if size >= part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(path)
        size += path.stat().st_size
    return parts


def node_of(
    node_rank: int | None = None, num_nodes: int | None = None, environ: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """(this machine's rank, the number of machines): as given, else from the launcher's environment, else (0, 1)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if num_nodes is not None or node_rank is not None:
        rank, count, source = node_rank or 0, num_nodes or 1, "data.prepare_node_rank / data.prepare_nodes"
    else:
        rank, count, source = 0, 1, None
        for rank_key, count_key, name in NODE_ENVIRONMENTS:
            if rank_key in env and count_key in env:
                rank, count, source = (
                    int(env[rank_key]),
                    int(env[count_key]),
                    f"{name} ({rank_key}, {count_key})",
                )
                if rank_key == "SLURM_ARRAY_TASK_ID":  # arrays may start anywhere: --array=1-8
                    rank -= int(env.get("SLURM_ARRAY_TASK_MIN", 0))
                break
    if not (count >= 1 and 0 <= rank < count):
        raise ConfigError(
            f"prepare on several machines: machine {rank} of {count} (from {source}) is not a machine of that set; "
            "set data.prepare_node_rank (0 to N-1) and data.prepare_nodes (N) yourself."
        )
    return rank, count


def assigned_parts(num_parts: int, rank: int, count: int) -> range:
    """The contiguous range of parts machine `rank` of `count` prepares (shares differ by at most one)."""
    return range(rank * num_parts // count, (rank + 1) * num_parts // count)


def part_dir(work: Path, part: int) -> Path:
    return work / f"part-{part:06d}"


def is_done(work: Path, part: int) -> bool:
    return (part_dir(work, part) / DONE_NAME).is_file()


def build_parts(
    work: Path,
    parts: Sequence[int],
    refs: dict[int, dict[str, list]],
    optimize: Callable[[list, Path, int], None],
    splits: Sequence[str],
) -> None:
    """Tokenize `parts` (one litdata worker each) and file their chunks under the work folder.

    `optimize(inputs, output_dir, num_workers)` runs litdata.optimize with one input per worker: the
    document refs of one part. litdata names worker w's chunks chunk-w-i.bin and lists them in worker
    order; they are renamed chunk-PART-i.bin so that parts from any batch or machine merge without clashes.
    """
    batch_dir = work / f".batch-{parts[0]:06d}-{os.getpid()}"
    shutil.rmtree(batch_dir, ignore_errors=True)
    try:
        counts: dict[int, dict[str, Any]] = {p: {} for p in parts}
        for split in splits:
            with_docs = [p for p in parts if refs[p][split]]
            index: dict[str, Any] = {"config": None, "chunks": []}
            if with_docs:
                optimize([refs[p][split] for p in with_docs], batch_dir / split, len(with_docs))
                index = json.loads((batch_dir / split / "index.json").read_text())
            for worker, part in enumerate(with_docs + [p for p in parts if p not in with_docs]):
                target = part_dir(work, part) / split
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir(parents=True)
                mine = (
                    [c for c in index["chunks"] if c["filename"].startswith(f"chunk-{worker}-")]
                    if part in with_docs
                    else []
                )
                for i, chunk in enumerate(mine):
                    name = f"chunk-{part}-{i}.bin"
                    (batch_dir / split / chunk["filename"]).rename(target / name)
                    chunk["filename"] = name
                written = sum(c["chunk_size"] for c in mine)
                if written != len(refs[part][split]):
                    raise RuntimeError(
                        f"litdata wrote {written} of {len(refs[part][split])} {split} documents of part {part}; a "
                        "worker process probably died (out of memory?). The existing data.dir, if any, was left as it "
                        "was."
                    )
                (target / "chunks.json").write_text(json.dumps({"config": index["config"], "chunks": mine}))
                counts[part][split] = {"documents": written, "tokens": sum(c["dim"] for c in mine), "chunks": len(mine)}
        for part in parts:
            (part_dir(work, part) / DONE_NAME).write_text(json.dumps(counts[part]))
    finally:
        shutil.rmtree(batch_dir, ignore_errors=True)


def merge_parts(work: Path, num_parts: int, staging: Path, splits: Sequence[str], block_size: int) -> dict[str, dict]:
    """Move every part's chunks into `staging`/SPLIT with one litdata index each; return the split counts."""
    counts = {}
    for split in splits:
        target = staging / split
        target.mkdir(parents=True)
        config, chunks = None, []
        for part in range(num_parts):
            listed = json.loads((part_dir(work, part) / split / "chunks.json").read_text())
            config = config or listed["config"]
            for chunk in listed["chunks"]:
                (part_dir(work, part) / split / chunk["filename"]).rename(target / chunk["filename"])
                chunks.append(chunk)
        documents = sum(c["chunk_size"] for c in chunks)
        if not documents:
            raise ConfigError(
                f"the {split} split holds no document: data.val_fraction puts each document in validation by a hash of "
                f"its text, and none of this corpus's {'fell outside' if split == 'train' else 'fell inside'} it. "
                "Choose a data.val_fraction nearer 0.5, or add documents."
            )
        (target / "index.json").write_text(json.dumps({"chunks": chunks, "config": config}, sort_keys=True))
        tokens = [c["dim"] for c in chunks]
        counts[split] = {"documents": documents, "tokens": sum(tokens), "blocks": sum(t // block_size for t in tokens)}
    return counts
