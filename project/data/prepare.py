"""Raw text -> tokenizer -> litdata token shards, once: the offline half of the data pipeline.

Output layout of `output_dir` (read by the training datamodule):
    manifest.json           what was built from what (see `prepare_shards`)
    tokenizer.json|.model   the tokenizer the ids belong to
    train/, val/            litdata chunks written with `TokensLoader`: each split is one token
                            stream, documents in source order, each followed by the end-of-text id
"""

import contextlib
import errno
import hashlib
import io
import json
import logging
import multiprocessing
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import litdata
import numpy as np
from filelock import FileLock

from project.data.corpus import (
    KNOWN_SUFFIXES,
    DocumentRef,
    NoSourcesError,
    fetch_corpus,
    find_sources,
    iter_document_refs,
    read_document,
)
from project.data.parts import assigned_parts, build_parts, is_done, merge_parts, node_of, plan_parts
from project.data.provenance import shards_origin
from project.data.shards import MANIFEST_NAME, SPLITS, shards_present
from project.data.storage import holds_objects, is_remote, read_remote_manifest, upload_dataset
from project.data.tokenizer import Tokenizer, file_sha256, load_tokenizer, train_bpe
from project.runtime.errors import ConfigError
from project.runtime.folders import unwritable

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
# Small chunks by default (data.chunk_mb): the default corpus (~2.5 MB of uint16 tokens) becomes several chunks, which
# litdata needs to spread work over ranks and loader workers. TokensLoader forms blocks within a
# chunk only, so each chunk drops its last (tokens % block_size) tokens: < 0.05% at this size.
CHUNK_BYTES = 1 << 20
# litdata's default, spawn, re-imports torch and litdata in every worker: on a small machine that is
# ~10 s per split for any corpus. The workers only read files and tokenize, which fork handles safely
# on Linux (elsewhere fork is unsafe or missing, so litdata's default stands).
START_METHOD = "fork" if sys.platform == "linux" else None
# What a write returns on a full disk, a full quota, or past a file-size limit (ulimit -f).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# MB of source files per part of the work (project.data.parts): a part's documents fill chunks of their
# own, so the shards do not depend on the number of workers or machines.
DEFAULT_PART_MB = 4


@dataclass(frozen=True)
class _Settings:
    """The knobs the shards depend on (and `num_workers`, which changes only how fast they are made)."""

    vocab_size: int
    seq_len: int
    val_fraction: float
    text_field: str
    num_workers: int
    seed: int
    part_bytes: int = 4 << 20
    chunk_bytes: int = 1 << 20
    tokenizer: str | None = None  # the tokenizer given (a file or folder, made absolute); None: a BPE trained here
    name: str | None = None  # data.name: recorded, to say whose shards these are (project.data.provenance)


def prepare_from_config(data: Mapping[str, Any]) -> dict:
    """`prepare_shards` with the settings of a `data` config group (conf/data/*.yaml)."""
    sources = data["sources"]
    return prepare_shards(
        sources if isinstance(sources, (str, os.PathLike)) else list(sources),
        data["dir"],
        tokenizer=data["tokenizer"],
        vocab_size=data["vocab_size"],
        seq_len=data["seq_len"],
        val_fraction=data["val_fraction"],
        text_field=data["text_field"],
        num_workers=data["prepare_workers"],
        seed=data["seed"],
        overwrite=data["overwrite"],
        fetch=data["fetch"],
        storage_options=data.get("storage_options"),
        part_mb=data.get("prepare_part_mb", DEFAULT_PART_MB),
        chunk_mb=data.get("chunk_mb", CHUNK_BYTES / (1 << 20)),
        num_nodes=data.get("prepare_nodes"),
        node_rank=data.get("prepare_node_rank"),
        name=data.get("name"),
    )


def prepare_shards(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int = 4096,
    seq_len: int = 256,
    val_fraction: float = 0.05,
    text_field: str = "text",
    num_workers: int = 2,
    seed: int = 1234,
    overwrite: bool = False,
    fetch: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    part_mb: float = 4,
    chunk_mb: float = 1,
    num_nodes: int | None = None,
    node_rank: int | None = None,
    name: str | None = None,
) -> dict:
    """Tokenize the documents of `sources` into train/val token shards in `output_dir`; return the manifest.

    Does no work when `output_dir` already holds shards from the same settings and unchanged source
    files (same fingerprint). Shards from other settings are replaced only with `overwrite=True`.

    manifest.json: {"format": 1, "fingerprint": str,
        "tokenizer": {"kind": "hf"|"sentencepiece", "file": name in output_dir, "vocab_size", "eos_id", "bos_id"},
        "seq_len", "block_size": seq_len + 1, "dtype": "uint16"|"int32",
        "splits": {"train"|"val": {"documents", "tokens", "blocks"}},
        "sources": [{"path", "bytes"}, ...], "val_fraction", "seed",
        "settings": {"tokenizer", "tokenizer_sha256", "vocab_size", "text_field", "name"}}
    where `blocks` is what `StreamingDataset(split dir, item_loader=TokensLoader(block_size))` holds.

    `output_dir` may be an s3:// URL (`storage_options` go to boto3): the shards are built in a local
    temporary folder and uploaded, the manifest last.

    The work is done in parts of `part_mb` MB of source files (project.data.parts): machine `node_rank`
    of `num_nodes` (None: from SLURM or torchrun variables, else one machine) prepares its share of
    them, and the last machine to finish merges them into `output_dir`; the others return {}. `name` (data.name)
    is recorded in the manifest only, to say whose shards these are.
    """
    patterns = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    settings = _Settings(
        vocab_size,
        seq_len,
        val_fraction,
        text_field,
        num_workers,
        seed,
        int(part_mb * (1 << 20)),
        int(chunk_mb * (1 << 20)),
        str(Path(tokenizer).absolute()) if tokenizer else None,
        name,
    )
    _check(settings, part_mb, chunk_mb)
    rank, nodes = node_of(node_rank, num_nodes)
    if nodes > 1 and not tokenizer:
        raise ConfigError(
            f"prepare on {nodes} machines needs a tokenizer they all share: set data.tokenizer (a tokenizer.json, a "
            "sentencepiece .model or a model folder). To train a BPE on your text, prepare a sample of it on one "
            "machine first (data.sources=SAMPLE data.dir=OTHER) and use the tokenizer.json it writes."
        )
    if is_remote(output_dir):
        if nodes > 1:
            raise ConfigError(
                f"data.dir={output_dir}: preparing on {nodes} machines writes to a folder they share; prepare into "
                "one, then train from it or copy it into object storage with your storage's own tool."
            )
        return _prepare_to_remote(
            patterns, str(output_dir).rstrip("/"), tokenizer, settings, overwrite, fetch, storage_options
        )
    output_dir = Path(output_dir).absolute()
    # The lock and the staging folder go beside data.dir, and the shards are renamed into place from there.
    if problem := unwritable(output_dir.parent) or (output_dir.is_file() and f"{output_dir} is a file, not a folder"):
        raise ConfigError(
            f"data.dir={output_dir}: cannot write there ({problem}); point data.dir at a folder you can write to."
        )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # Ranks or jobs that prepare the same directory at once wait here, then find it up to date.
    lock = FileLock(output_dir.parent / f".{output_dir.name}.lock")
    with lock:
        files = _resolve_or_fetch(patterns, fetch)
        inside = [f for f in files if f.is_relative_to(output_dir)]
        if inside:
            raise ConfigError(f"data.sources include {inside[0]}, inside data.dir={output_dir}; keep raw text apart.")
        given = load_tokenizer(tokenizer) if tokenizer else None
        fingerprint = _fingerprint(files, given, settings)
        existing = _read_manifest(output_dir, overwrite)
        if existing is not None and existing.get("fingerprint") == fingerprint and shards_present(output_dir):
            log.info("Shards in %s are up to date (fingerprint %s); nothing to do.", output_dir, fingerprint)
            return existing
        _refuse_to_clobber(output_dir, existing, overwrite, files, settings, given)
    # The parts, shared by the machines preparing them; one machine's own are started afresh.
    work = output_dir.parent / f".{output_dir.name}.parts-{fingerprint}"
    if nodes == 1:
        shutil.rmtree(work, ignore_errors=True)
    try:
        manifest = _build(output_dir, work, lock, fingerprint, files, given, settings, rank, nodes)
    except OSError as error:
        if error.errno not in NO_SPACE:
            raise
        raise ConfigError(
            f"data.dir={output_dir}: could not write {error.filename or work} ({error.strerror}): free space on "
            f"that disk, or point data.dir at another, and run again; data.dir was left as it was."
        ) from None
    finally:
        if nodes == 1:
            shutil.rmtree(work, ignore_errors=True)
    if manifest:
        _log_summary(manifest, output_dir)
    return manifest


def _prepare_to_remote(
    patterns: list,
    url: str,
    tokenizer: Any,
    settings: _Settings,
    overwrite: bool,
    fetch: str | None,
    storage_options: Mapping[str, Any] | None,
) -> dict:
    """prepare_shards into object storage: the same up-to-date and overwrite rules as a local folder."""
    files = _resolve_or_fetch(patterns, fetch)
    given = load_tokenizer(tokenizer) if tokenizer else None
    fingerprint = _fingerprint(files, given, settings)
    existing = read_remote_manifest(url, storage_options)
    if existing is not None and existing.get("fingerprint") == fingerprint:
        log.info("Shards at %s are up to date (fingerprint %s); nothing to do.", url, fingerprint)
        return existing
    if existing is None and holds_objects(url, storage_options):
        raise ConfigError(
            f"data.dir={url} holds objects but no {MANIFEST_NAME}, so it is not a prepared dataset and will not be "
            "written into; point data.dir at a new or empty prefix."
        )
    if existing is not None and not overwrite:
        raise ConfigError(
            f"data.dir={url} holds shards prepared from other settings: "
            f"{_settings_changed(existing, files, settings, given)}. Point data.dir at a prefix of your own to keep "
            f"both, or, only if those shards are yours to lose, set data.overwrite=true to replace them "
            f"({shards_origin(existing)})."
        )
    if existing is not None:
        _say_replaced(url, existing)
    with tempfile.TemporaryDirectory(prefix="prepare-") as staging:
        local = Path(staging) / "shards"
        manifest = _build(
            local, Path(staging) / "parts", FileLock(Path(staging) / "lock"), fingerprint, files, given, settings, 0, 1
        )
        log.info("Uploading the shards to %s", url)
        upload_dataset(local, url, storage_options)
    _log_summary(manifest, url)
    return manifest


def _check(settings: _Settings, part_mb: float = 1, chunk_mb: float = 1) -> None:
    if not (chunk_mb > 0 and settings.chunk_bytes >= 4 * (settings.seq_len + 1)):
        raise ConfigError(
            f"data.chunk_mb={chunk_mb} must hold at least one block of data.seq_len + 1 tokens; 1 (small corpora) to "
            "64 (large ones)."
        )
    if not part_mb > 0:
        raise ConfigError(f"data.prepare_part_mb={part_mb} must be above 0 (MB of source text per part of the work).")
    if settings.seq_len < 1:
        raise ConfigError(f"data.seq_len={settings.seq_len} must be a positive number of tokens.")
    if not 0 < settings.val_fraction < 1:
        raise ConfigError(
            f"data.val_fraction={settings.val_fraction} must lie strictly between 0 and 1 (at least one document "
            f"is held out, at least one trained on)."
        )
    if settings.num_workers < 1:
        raise ConfigError(f"data.prepare_workers={settings.num_workers} must be at least 1.")


def _resolve_or_fetch(patterns: list, fetch: str | None) -> list[Path]:
    """The source files, fetching the built-in corpus if there are none yet; binary files skipped are said once."""
    try:
        sources = find_sources(patterns)
    except NoSourcesError:
        if not fetch:
            raise
        destination = _fetch_destination(os.fspath(patterns[0]))
        log.info("data.sources match nothing yet: fetching corpus %r into %s", fetch, destination)
        fetch_corpus(fetch, destination)
        sources = find_sources(patterns)
    if note := sources.skipped_note():
        log.warning(note)
    return sources.files


def _fetch_destination(pattern: str) -> Path:
    """The folder a pattern's files live in: the part before any glob magic, or the file's parent."""
    parts = Path(pattern).parts
    plain = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    if plain is not None:
        return Path(*parts[:plain])
    path = Path(pattern)
    return path.parent if path.suffix in KNOWN_SUFFIXES else path


def _fingerprint(files: list[Path], tokenizer: Tokenizer | None, settings: _Settings) -> str:
    """A hash of everything the shards depend on. Source files count by path, size and mtime (cheap to
    check on every run; re-hashing a corpus is not); a given tokenizer by content. The number of
    workers changes only how tokens are grouped into chunks, so it is left out."""
    tokenizer_key: dict[str, Any]
    if tokenizer is not None:
        tokenizer_key = {"sha256": file_sha256(tokenizer.path)}
    else:
        tokenizer_key = {"train_bpe": settings.vocab_size}
    key = {
        "format": MANIFEST_FORMAT,
        "tokenizer": tokenizer_key,
        "seq_len": settings.seq_len,
        "val_fraction": settings.val_fraction,
        "text_field": settings.text_field,
        "seed": settings.seed,
        "chunk_bytes": settings.chunk_bytes,
        "part_bytes": settings.part_bytes,
        "sources": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read_manifest(output_dir: Path, overwrite: bool) -> dict | None:
    """The manifest of earlier shards in `output_dir`, None if there is none; a damaged one counts as
    shards from other settings: replaced with `overwrite` only."""
    try:
        manifest = json.loads((output_dir / MANIFEST_NAME).read_bytes())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        manifest = error
    if isinstance(manifest, dict):
        return manifest
    if overwrite:
        return {}
    raise ConfigError(
        f"data.dir={output_dir} holds a {MANIFEST_NAME} that is not a manifest ({manifest}). Set data.overwrite=true "
        f"to prepare the shards afresh, or point data.dir at another folder."
    )


def _refuse_to_clobber(
    output_dir: Path,
    existing: dict | None,
    overwrite: bool,
    files: list[Path],
    settings: _Settings,
    tokenizer: Tokenizer | None,
) -> None:
    """Replace shards only when asked to, and never a folder that holds something else, asked or not."""
    if existing is None:
        if output_dir.exists() and any(output_dir.iterdir()):
            raise ConfigError(
                f"data.dir={output_dir} exists, is not empty and holds no {MANIFEST_NAME}, so it is not a "
                f"prepared dataset and will not be replaced; point data.dir at a new or empty folder."
            )
        return
    if not shards_present(output_dir):
        return  # the remains of a dataset whose shards were deleted: nothing valid to lose
    if overwrite:
        _say_replaced(output_dir, existing)
        return
    raise ConfigError(
        f"data.dir={output_dir} holds shards prepared from other settings: "
        f"{_settings_changed(existing, files, settings, tokenizer)}. Point data.dir at a folder of your own to keep "
        f"both, or, only if those shards are yours to lose, set data.overwrite=true to replace them "
        f"({shards_origin(existing)})."
    )


def _say_replaced(output_dir: Path | str, existing: Mapping[str, Any]) -> None:
    """One line before data.overwrite=true replaces shards: whose they were, which another run may have trained on."""
    log.warning(
        "data.overwrite=true: replacing the shards in %s, prepared from %s", output_dir, shards_origin(existing)
    )


def _settings_changed(existing: dict, files: list[Path], settings: _Settings, tokenizer: Tokenizer | None) -> str:
    """What differs from the manifest of the shards in place, each as `setting: there, here` (as training says it,
    project.config.data); settings the manifest does not record (older shards) are not compared. What the
    fingerprint holds besides (modification times, chunk and part sizes) is named where nothing else differs."""
    recorded = existing.get("settings") or {}
    differences = []
    if "seq_len" in existing and existing["seq_len"] != settings.seq_len:
        differences.append(f"data.seq_len: {existing['seq_len']} there, {settings.seq_len} here")
    for key, name in (("val_fraction", "data.val_fraction"), ("seed", "data.seed")):
        if key in existing and existing[key] != getattr(settings, key):
            differences.append(f"{name}: {existing[key]} there, {getattr(settings, key)} here")
    if "text_field" in recorded and recorded["text_field"] != settings.text_field:
        differences.append(f"data.text_field: {recorded['text_field']} there, {settings.text_field} here")
    given = settings.tokenizer
    if "tokenizer" in recorded and recorded["tokenizer"] != given:
        differences.append(f"data.tokenizer: {recorded['tokenizer']} there, {given} here")
    elif tokenizer is not None and recorded.get("tokenizer_sha256") not in (None, file_sha256(tokenizer.path)):
        differences.append(f"data.tokenizer: the file {given} changed since the shards were prepared")
    elif given is None and "vocab_size" in recorded and recorded["vocab_size"] != settings.vocab_size:
        differences.append(f"data.vocab_size: {recorded['vocab_size']} there, {settings.vocab_size} here")
    there = {str(s.get("path")): s.get("bytes") for s in existing.get("sources", []) if isinstance(s, Mapping)}
    here = {str(f): f.stat().st_size for f in files}
    if "sources" in existing and there.keys() != here.keys():
        differences.append(f"data.sources: {len(there)} files there, {len(here)} here")
    elif "sources" in existing and (changed := sorted(path for path in here if there[path] != here[path])):
        differences.append(
            f"data.sources: {changed[0]} held {there[changed[0]]} bytes when prepared, {here[changed[0]]} now"
        )
    return "; ".join(differences) or (
        "the source files' modification times (their names and sizes are the same), data.chunk_mb or "
        "data.prepare_part_mb"
    )


def _build(
    output_dir: Path,
    work: Path,
    lock: FileLock,
    fingerprint: str,
    files: list[Path],
    tokenizer: Tokenizer | None,
    settings: _Settings,
    rank: int,
    nodes: int,
) -> dict:
    """Prepare this machine's parts under `work`; the last machine done merges them all into `output_dir`
    and returns the manifest, the others {}."""
    work.mkdir(parents=True, exist_ok=True)
    text_field = settings.text_field
    parts = plan_parts(files, settings.part_bytes)
    mine = assigned_parts(len(parts), rank, nodes)
    if nodes == 1:
        # One machine sees every document: it trains the BPE if none is given, and keeps at least one
        # document on each side of the split, however small the corpus.
        splits = _split_documents(files, text_field, settings.val_fraction, settings.seed)
        if tokenizer is None:
            tokenizer = _train_tokenizer(splits["train"], text_field, settings, work)
        part_of = {str(path): i for i, group in enumerate(parts) for path in group}
        refs = {p: {split: [r for r in splits[split] if part_of[r.path] == p] for split in SPLITS} for p in mine}
    else:
        refs = {
            p: _split_documents(parts[p], text_field, settings.val_fraction, settings.seed, at_least_one=False)
            for p in mine
        }
    assert tokenizer is not None
    given_file = tokenizer.path if settings.tokenizer else None
    with lock:  # machines share the work folder: one writes the tokenizer, the others find it
        tokenizer_file = tokenizer.save(work)
    # uint16 halves the shards and the loader's memory traffic; ids beyond 65535 need int32.
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    optimize = partial(
        _optimize,
        tokenizer_file=str(tokenizer_file),
        text_field=text_field,
        dtype=dtype,
        chunk_bytes=settings.chunk_bytes,
    )
    todo = [p for p in mine if not is_done(work, p)]
    if todo:
        log.info("Tokenizing %d of %d parts (machine %d of %d)", len(todo), len(parts), rank, nodes)
    # A litdata worker that cannot write reports a traceback of its own, or nothing (the parts' counts then
    # fall short): both show as a RuntimeError, said as the full disk it is where no chunk fits any more.
    with _said_if_out_of_space(work):
        for start in range(0, len(todo), settings.num_workers):
            build_parts(work, todo[start : start + settings.num_workers], refs, optimize, SPLITS)
    with lock:
        existing = _read_manifest(output_dir, True)
        if existing and existing.get("fingerprint") == fingerprint and shards_present(output_dir):
            return existing  # another machine merged meanwhile
        waiting = [p for p in range(len(parts)) if not is_done(work, p)]
        if waiting:
            log.info(
                "Machine %d of %d has prepared its %d parts; %d parts of other machines are not done yet: the "
                "last machine to finish merges them into %s.",
                rank,
                nodes,
                len(mine),
                len(waiting),
                output_dir,
            )
            return {}
        staging = output_dir.parent / f".{output_dir.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted run
        staging.mkdir()
        try:
            shutil.copy2(tokenizer_file, staging / tokenizer_file.name)
            counts = merge_parts(work, len(parts), staging, SPLITS, settings.seq_len + 1)
            manifest = {
                "format": MANIFEST_FORMAT,
                "fingerprint": fingerprint,
                "tokenizer": {
                    "kind": tokenizer.kind,
                    "file": tokenizer_file.name,
                    "vocab_size": tokenizer.vocab_size,
                    "eos_id": tokenizer.eos_id,
                    "bos_id": tokenizer.bos_id,
                },
                "seq_len": settings.seq_len,
                "block_size": settings.seq_len + 1,
                "dtype": np.dtype(dtype).name,
                "splits": counts,
                "sources": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
                # The data settings as given, for training to check its own against (project.config.checks).
                "settings": {
                    "tokenizer": settings.tokenizer,
                    "tokenizer_sha256": file_sha256(given_file) if given_file else None,
                    "vocab_size": settings.vocab_size,
                    "text_field": text_field,
                    "name": settings.name,
                },
                "val_fraction": settings.val_fraction,
                "seed": settings.seed,
                "parts": len(parts),
            }
            (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
            _swap_in(staging, output_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _train_tokenizer(train_refs: list[DocumentRef], text_field: str, settings: _Settings, directory: Path) -> Tokenizer:
    log.info("Training a byte-level BPE of %d tokens on %d train documents", settings.vocab_size, len(train_refs))
    tokenizer = train_bpe((read_document(ref, text_field) for ref in train_refs), settings.vocab_size, directory)
    if tokenizer.vocab_size < settings.vocab_size:
        log.warning(
            "The training documents gave a BPE of only %d tokens, fewer than data.vocab_size=%d (a small corpus has "
            "no more merges to learn). The manifest records %d; set data.vocab_size=%d so that the model presets "
            "that follow it carry no embedding rows that never train.",
            tokenizer.vocab_size,
            settings.vocab_size,
            tokenizer.vocab_size,
            tokenizer.vocab_size,
        )
    return tokenizer


def _optimize(
    inputs: list[list[DocumentRef]],
    output_dir: Path,
    num_workers: int,
    *,
    tokenizer_file: str,
    text_field: str,
    dtype: type,
    chunk_bytes: int,
) -> None:
    """litdata.optimize over parts, one worker each (keep_data_ordered: worker w takes inputs[w])."""
    with _litdata_chatter_hidden():
        litdata.optimize(
            fn=partial(tokenize_part, tokenizer_file=tokenizer_file, text_field=text_field, dtype=dtype),
            inputs=inputs,
            output_dir=str(output_dir),
            chunk_bytes=chunk_bytes,
            item_loader=litdata.TokensLoader(),
            num_workers=num_workers,
            keep_data_ordered=True,
            reorder_files=False,
            start_method=START_METHOD,
        )


def _split_documents(
    files: list[Path], text_field: str, val_fraction: float, seed: int, at_least_one: bool = True
) -> dict[str, list[DocumentRef]]:
    """Assign each document to train or val by a seeded hash of its text, keeping source order in each.

    Hashing the text (not its place) keeps the split stable when files move or new ones join, and
    puts exact duplicates on the same side, so none leaks from train into val.
    """
    scored = [(_split_score(text, seed), ref) for file in files for ref, text in iter_document_refs(file, text_field)]
    if not at_least_one:  # a share of a corpus prepared on several machines: the merge checks both sides
        return {
            "train": [ref for score, ref in scored if score >= val_fraction],
            "val": [ref for score, ref in scored if score < val_fraction],
        }
    if len(scored) < 2:
        raise ConfigError(
            f"data.sources hold {len(scored)} non-empty document(s), but a train and a validation split need at "
            f"least two: a text file is one document, so add more files, or use a .jsonl file with one "
            f"document per line."
        )
    in_val = [score < val_fraction for score, _ in scored]
    # At least one document on each side, whatever val_fraction says about so small a corpus.
    if not any(in_val):
        in_val[min(range(len(scored)), key=lambda i: scored[i][0])] = True
    if all(in_val):
        in_val[max(range(len(scored)), key=lambda i: scored[i][0])] = False
    return {
        "train": [ref for (_, ref), val in zip(scored, in_val) if not val],
        "val": [ref for (_, ref), val in zip(scored, in_val) if val],
    }


def _split_score(text: str, seed: int) -> float:
    """A number uniform in [0, 1) fixed by the text and the seed."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") / 2**64


def tokenize_part(
    refs: list[DocumentRef], *, tokenizer_file: str, text_field: str, dtype: type
) -> Iterator[np.ndarray]:
    """litdata's worker function: the documents of one part, one item each (see `tokenize_document`)."""
    for ref in refs:
        yield tokenize_document(ref, tokenizer_file=tokenizer_file, text_field=text_field, dtype=dtype)


def tokenize_document(ref: DocumentRef, *, tokenizer_file: str, text_field: str, dtype: type) -> np.ndarray:
    """litdata's worker function: one document's ids followed by the end-of-text id, as one item.

    One item per document lets the part's count check that every document arrived (project.data.parts). Top level (not a
    closure) so that litdata can pickle it for spawned worker processes.
    """
    tokenizer = _cached_tokenizer(tokenizer_file)
    return np.asarray(tokenizer.encode(read_document(ref, text_field)) + [tokenizer.eos_id], dtype=dtype)


@lru_cache(maxsize=1)
def _cached_tokenizer(path: str) -> Tokenizer:
    """Each worker process loads the tokenizer once, not once per document."""
    if multiprocessing.parent_process() is not None:  # a litdata worker, not a process of its own
        multiprocessing.util.Finalize(None, _stop_helper_processes, exitpriority=0)
    return load_tokenizer(path)


def _stop_helper_processes() -> None:
    """At a litdata worker's exit: stop the helper process it started (one that deletes cached files).

    The worker tells the helper to stop only when its loop ends well. After a failed write (a full disk)
    the worker would wait for the helper forever as it exits, and litdata.optimize for the worker
    (litdata 0.2.76, DataWorkerProcess.run), instead of reporting the error.
    """
    for child in multiprocessing.active_children():
        child.terminate()


@contextlib.contextmanager
def _litdata_chatter_hidden() -> Iterator[None]:
    """Hide litdata's stdout prints (setup steps, an advert) and info logs; keep its progress bar
    (on stderr). If optimize fails, the hidden prints are shown after all: they may say why."""
    chatter = io.StringIO()
    litdata_log = logging.getLogger("litdata")
    level = litdata_log.level
    litdata_log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(chatter):
            yield
    except BaseException:
        sys.stdout.write(chatter.getvalue())
        raise
    finally:
        litdata_log.setLevel(level)


@contextlib.contextmanager
def _said_if_out_of_space(split_dir: Path) -> Iterator[None]:
    """A litdata worker that cannot write a chunk reports a traceback of its own, or, where the write was
    its last, nothing: both show here as a RuntimeError. Where a chunk's worth of bytes no longer fits
    in `split_dir`, that is the cause, and its OSError is raised instead."""
    try:
        yield
    except RuntimeError:
        probe = split_dir / ".space-probe"
        try:
            with open(probe, "wb") as f:
                f.write(bytes(CHUNK_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            if error.errno in NO_SPACE:
                raise OSError(error.errno, error.strerror, str(split_dir)) from None
        finally:
            probe.unlink(missing_ok=True)
        raise


def _swap_in(staging: Path, output_dir: Path) -> None:
    """Replace `output_dir` by `staging` with renames only: readers see the old or the new dataset, never
    a mix. Interrupted between the two renames, the old dataset survives as `.<name>.old`."""
    if output_dir.exists():
        old = output_dir.parent / f".{output_dir.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        output_dir.rename(old)
        staging.rename(output_dir)
        shutil.rmtree(old)
    else:
        staging.rename(output_dir)


def _log_summary(manifest: dict, output_dir: Path | str) -> None:
    for split, counts in manifest["splits"].items():
        log.info(
            "%-5s %6d documents %10d tokens %8d blocks of %d",
            split,
            counts["documents"],
            counts["tokens"],
            counts["blocks"],
            manifest["block_size"],
        )
    log.info("Shards, tokenizer and manifest written to %s", output_dir)
