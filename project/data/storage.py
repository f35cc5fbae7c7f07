"""Prepared shards in object storage (`data.dir=s3://bucket/prefix`): what we need beside litdata's reader.

litdata streams the chunks of a remote split itself, caching whole chunks locally. Training also reads
the dataset's small files, manifest.json, the tokenizer and each split's index.json, before any chunk:
`local_view` fetches those into a local folder (fresh at every start, so a dataset prepared again in place
is seen as such) and the checks and the datamodule read them there as they read a local dataset.
`upload_dataset` publishes a dataset that project.prepare built locally, its manifest last, so a reader
never finds a manifest whose shards are not all there yet.

Remote URLs are those litdata reads (s3://, gs://, azure://, hf://); credentials and the endpoint come
from the usual environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) or `data.storage_options`.
project.prepare writes to s3:// (and S3-compatible servers) only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from project.checkpoint.urls import is_remote
from project.checkpoint.urls import join_text as join
from project.data.shards import MANIFEST_NAME, SPLITS, check_block_size, check_shards, read_manifest
from project.runtime.errors import ConfigError


def allow_plain_http(storage_options: Mapping[str, Any] | None) -> None:
    """litdata 0.2.76 fetches S3 chunks through obstore, which refuses an http:// endpoint (a MinIO or
    other S3-compatible server inside a cluster, a test server on loopback) with 'builder error' unless
    its client allows it; litdata passes obstore a fixed set of client options, so add the permission
    there, for http:// endpoints only. Fetches of index.json go through boto3, which needs nothing."""
    endpoint = (
        (storage_options or {}).get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint and str(endpoint).startswith("http://"):
        from litdata.streaming import downloader

        options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
        if isinstance(options, dict):
            options["allow_http"] = "true"


def cache_folder(cache_dir: str | os.PathLike | None, kind: str, url: str) -> Path:
    """Where `kind` ("views", "chunks") of remote `url` is kept locally: under data.cache_dir, else the user's cache."""
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "llama-platform"
    return root / kind / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def _downloader(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    from litdata.streaming.downloader import get_downloader

    allow_plain_http(storage_options)
    return get_downloader(url, "", [], dict(storage_options or {}))


def local_view(
    data_dir: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Path:
    """A local folder with the manifest, tokenizer and split indexes of `data_dir`: itself when local,
    else a copy fetched under `cache_dir`. Missing remote files are simply not copied: the checks that
    read the folder then say what is missing, as for a local one."""
    if not is_remote(data_dir):
        return Path(data_dir)
    url = str(data_dir).rstrip("/")
    view = cache_folder(cache_dir, "views", url)
    partial = view.with_name(view.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    downloader = _downloader(url, storage_options)
    try:
        if not _fetch(downloader, join(url, MANIFEST_NAME), partial / MANIFEST_NAME):
            return partial  # no manifest there: read_manifest says so, naming data.dir
        manifest = json.loads((partial / MANIFEST_NAME).read_bytes())
        tokenizer = (manifest.get("tokenizer") or {}).get("file") if isinstance(manifest, dict) else None
        for name in ([tokenizer] if tokenizer else []) + [f"{split}/index.json" for split in SPLITS]:
            _fetch(downloader, join(url, *name.split("/")), partial / name)
        shutil.rmtree(view, ignore_errors=True)
        partial.rename(view)
    except Exception as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(
            f"data.dir={data_dir}: could not read it ({type(error).__name__}: {error}). Check the URL, the credentials "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or data.storage_options) and the endpoint (AWS_ENDPOINT_URL "
            "for an S3-compatible server)."
        ) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return view


class ChunkCache:
    """The chunks of one remote split, each fetched whole on its first read into a local folder that litdata
    then reads as a local dataset; the least recently fetched are removed past `cache_bytes`.

    Why not litdata's own remote reader: its map-style reads assume that a chunk is read to its end before
    the next one (at each switch it queues the previous chunk for deletion), which the windowed order of
    project.data.sampler is not: with litdata 0.2.76 that fails in loader workers (KeyError in
    TokensLoader.close) and would fetch a chunk again at every return to it. Fetches are whole files, to a
    temporary name and renamed, so the processes of one machine share the folder safely.
    """

    def __init__(self, url: str, folder: Path, cache_bytes: int, storage_options: Mapping[str, Any] | None):
        self.url, self.folder, self.cache_bytes = url.rstrip("/"), folder, cache_bytes
        self.storage_options = dict(storage_options or {})
        folder.mkdir(parents=True, exist_ok=True)
        fresh = folder / f".index.json.{os.getpid()}"
        if not _fetch(_downloader(self.url, storage_options), join(self.url, "index.json"), fresh):
            raise ConfigError(
                f"{self.url}/index.json is missing: the split was not prepared there (run project.prepare again)."
            )
        fresh.replace(folder / "index.json")  # an index newer than the chunks cached before replaces theirs
        chunks = json.loads((folder / "index.json").read_bytes())["chunks"]
        self.files = [(c["filename"], int(c["chunk_bytes"])) for c in chunks]
        self._downloader: Any = None

    def ensure(self, chunk: int) -> None:
        """Chunk `chunk` is in the folder, whole (waiting for another process that is fetching it)."""
        name, size = self.files[chunk]
        path = self.folder / name
        if path.is_file() and path.stat().st_size == size:
            return
        if self._downloader is None:  # one per process: loader workers make their own after fork
            self._downloader = _downloader(self.url, self.storage_options)
        for _ in range(600):
            self._downloader.download_file(
                join(self.url, name), str(path)
            )  # returns at once if another process holds it
            if path.is_file() and path.stat().st_size == size:
                self._evict(keep=name)
                return
            time.sleep(0.5)
        raise RuntimeError(f"{join(self.url, name)}: not fetched into {path} after 5 minutes")

    def _evict(self, keep: str) -> None:
        present = [(p.stat().st_mtime, p) for p in self.folder.glob("*.bin") if p.name != keep]
        total = sum(p.stat().st_size for _, p in present) + (self.folder / keep).stat().st_size
        for _, path in sorted(present):
            if total <= self.cache_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)  # a process reading it keeps its mapping; a later read fetches it again


def _fetch(downloader: Any, url: str, target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        downloader.download_file(url, str(target))
    except Exception as error:
        if _is_missing(error):
            return False
        raise
    return target.is_file()


def _is_missing(error: Exception) -> bool:
    code = str(getattr(error, "response", {}).get("Error", {}).get("Code", "")) if hasattr(error, "response") else ""
    return isinstance(error, FileNotFoundError) or code in ("404", "NoSuchKey", "NotFound")


def _s3(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str, str]:
    parsed = urlparse(url)
    if parsed.scheme != "s3":
        raise ConfigError(
            f"data.dir={url}: project.prepare writes to local folders and s3:// URLs (S3 and S3-compatible servers). "
            "Prepare into a local folder and copy it with your storage's own tool, then train with data.dir set to the "
            "URL."
        )
    from litdata.streaming.client import S3Client

    return S3Client(storage_options=dict(storage_options or {})).client, parsed.netloc, parsed.path.strip("/")


def read_remote_manifest(url: str, storage_options: Mapping[str, Any] | None) -> dict | None:
    """The manifest.json at `url`, None when there is none."""
    client, bucket, prefix = _s3(url, storage_options)
    try:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_NAME}")["Body"].read()
    except Exception as error:
        if _is_missing(error):
            return None
        raise
    manifest = json.loads(body)
    return manifest if isinstance(manifest, dict) else None


def holds_objects(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    client, bucket, prefix = _s3(url, storage_options)
    return bool(client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/", MaxKeys=1).get("KeyCount", 0))


def upload_dataset(folder: Path, url: str, storage_options: Mapping[str, Any] | None) -> None:
    """Publish a prepared dataset: its shards and tokenizer, then its manifest, then remove what a
    dataset prepared there before left that this one does not have."""
    client, bucket, prefix = _s3(url, storage_options)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    keys = {f"{prefix}/{p.relative_to(folder).as_posix()}": p for p in files}
    manifest_key = f"{prefix}/{MANIFEST_NAME}"
    for key, path in keys.items():
        if key != manifest_key:
            client.upload_file(str(path), bucket, key)
    client.upload_file(str(keys[manifest_key]), bucket, manifest_key)
    stale = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        stale += [item["Key"] for item in page.get("Contents", []) if item["Key"] not in keys]
    for start in range(0, len(stale), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": key} for key in stale[start : start + 1000]]})


def check_prepared_shards(
    data_dir: str | os.PathLike,
    seq_len: int,
    cache_dir: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """(a local folder holding the manifest and indexes, the manifest) of shards prepared in `data_dir` for
    blocks of seq_len + 1, refused with a ConfigError otherwise. Remote shards (a URL) are read from a local
    view of their small files, and
    checked by their indexes only: their chunks are fetched when read."""
    if "://" not in str(data_dir):
        manifest = read_manifest(data_dir)
        check_block_size(data_dir, manifest, seq_len)
        check_shards(data_dir)
        return Path(data_dir), manifest
    view = local_view(data_dir, cache_dir, storage_options)
    if not (view / MANIFEST_NAME).is_file():
        raise ConfigError(
            f"no prepared shards at data.dir={data_dir} (missing {MANIFEST_NAME}): prepare them there first with "
            f"`python -m project.prepare data.dir={data_dir}` and the same data settings (training does not "
            "prepare into object storage), or point data.dir at prepared shards."
        )
    manifest = read_manifest(view, data_dir)
    check_block_size(data_dir, manifest, seq_len)
    check_shards(view, data_dir, chunks=False)
    return view, manifest
