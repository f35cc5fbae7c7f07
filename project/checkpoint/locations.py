"""Where a checkpoint lives: a local path, or an object-storage URL (`ckpt_dir=s3://bucket/prefix`), and the few
operations the platform does on either.

A checkpoint in object storage is written and read where it lies, each rank its own share: torch's distributed
checkpoint (`save`, `async_save`, `load`) through a storage writer and reader of ours on obstore (already installed
for litdata's S3 reads; `ObjectWriter`, `ObjectReader`), which read only the byte ranges a rank's pieces need.
A single file is streamed by torch.save into an upload of ours (`writing`). Lightning's own file operations
(ModelCheckpoint's look at its folder) go through fsspec, for which obstore's fsspec implementation is registered for
s3:// (`use_object_storage`).

Object stores have no rename and no folders: a checkpoint there is a name prefix, complete once its last object is
written (a single file's object; a folder's `.metadata`, which torch writes after every rank's shards), and the
checkpoint to resume from is named by a small `latest` object written after it (project.checkpoint.latest).

Credentials and the endpoint come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION, AWS_ENDPOINT_URL for an S3-compatible server), never from the config: nothing a run writes holds them.
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Union
from urllib.parse import urlparse

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from project.checkpoint.urls import SCHEMES, check_url, is_remote, join_text
from project.runtime.errors import ConfigError

SHARDED_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a folder's shards, written after them
Location = Union[Path, str]  # a local path, or an object-storage URL kept as text (pathlib folds its //)


def location(path: str | os.PathLike) -> Location:
    """`path` as a Location: a URL stays text, a local path becomes a Path."""
    return str(path).rstrip("/") if is_remote(path) else Path(path)


def join(base: Location, *parts: str) -> Location:
    return join_text(base, *parts) if is_remote(base) else Path(base, *parts)


def name_of(path: Location) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else Path(path).name


def parent_of(path: Location) -> Location:
    return str(path).rstrip("/").rsplit("/", 1)[0] if is_remote(path) else Path(path).parent


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a refused write raises: the file system's OSError (a full disk, permissions), object storage's errors
    (a missing bucket, denied or missing credentials)."""
    from obstore.exceptions import BaseError

    return (OSError, BaseError)


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _client_options() -> dict[str, Any]:
    # An http:// endpoint (an S3-compatible server inside a cluster, a test server on loopback) must be allowed.
    return {"allow_http": True} if (_endpoint() or "").startswith("http://") else {}


@lru_cache(maxsize=None)
def _store(bucket: str, endpoint: str | None) -> Any:
    """A client for `bucket`, configured from the environment (AWS_*); one per endpoint, as the environment says."""
    from obstore.store import from_url

    options: Any = _client_options()
    return from_url(f"s3://{bucket}", client_options=options)


def _split(url: Location) -> tuple[Any, str]:
    check_url(str(url))
    parsed = urlparse(str(url))
    return _store(parsed.netloc, _endpoint()), parsed.path.strip("/")


def check_reachable(url: str, setting: str = "ckpt_dir") -> None:
    """The bucket at `url` answers a listing with these credentials, else a ConfigError saying what to check."""
    try:
        children(url)
    except storage_errors() as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ConfigError(
            f"{setting}={url}: could not reach it ({type(error).__name__}: {reason}). Check that the bucket exists, "
            "the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the machine's role) and the endpoint "
            "(AWS_ENDPOINT_URL for an S3-compatible server)."
        ) from None


def use_object_storage() -> None:
    """Lightning's file operations (fsspec) reach s3:// through obstore's fsspec implementation: ModelCheckpoint
    looks at its folder there. Idempotent; every process that saves calls it."""
    import fsspec
    from obstore.fsspec import register

    register("s3")
    fsspec.config.conf["s3"] = {"client_options": _client_options()}


def exists(path: Location) -> bool:
    """A file or folder at `path` (locally), an object or any object under `path/` (in object storage)."""
    if not is_remote(path):
        return Path(path).exists()
    return is_file(path) or is_folder(path)


def is_file(path: Location) -> bool:
    if not is_remote(path):
        return Path(path).is_file()
    import obstore

    store, key = _split(path)
    try:
        obstore.head(store, key)
    except FileNotFoundError:
        return False
    return True


def is_folder(path: Location) -> bool:
    if not is_remote(path):
        return Path(path).is_dir()
    return bool(_keys(path, first_only=True))


def _keys(folder: Location, first_only: bool = False) -> list[tuple[str, int]]:
    """(key, size) of every object under `folder/`."""
    import obstore

    store, key = _split(folder)
    found: list[tuple[str, int]] = []
    for batch in obstore.list(store, prefix=f"{key}/", chunk_size=1 if first_only else 1000):
        found += [(item["path"], item["size"]) for item in batch]
        if first_only and found:
            break
    return found


def children(folder: Location) -> list[str]:
    """The names directly inside `folder` (files and folders alike)."""
    if not is_remote(folder):
        return sorted(p.name for p in Path(folder).iterdir()) if Path(folder).is_dir() else []
    import obstore

    store, key = _split(folder)
    listing = obstore.list_with_delimiter(store, f"{key}/" if key else None)
    names = [prefix.rstrip("/").rsplit("/", 1)[-1] for prefix in listing["common_prefixes"]]
    return sorted(names + [item["path"].rsplit("/", 1)[-1] for item in listing["objects"]])


def size(path: Location) -> int:
    """Bytes of a file, or of everything in a folder."""
    if not is_remote(path):
        path = Path(path)
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size if path.is_file() else 0
    import obstore

    if is_file(path):
        store, key = _split(path)
        return int(obstore.head(store, key)["size"])
    return sum(n for _, n in _keys(path))


def remove(path: Location) -> None:
    """The file or folder at `path`, gone (nothing there is fine)."""
    if not is_remote(path):
        path = Path(path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        return
    import obstore

    store, key = _split(path)
    keys = [k for k, _ in _keys(path)] + ([key] if is_file(path) else [])
    for start in range(0, len(keys), 1000):
        obstore.delete(store, keys[start : start + 1000])


def read_bytes(path: Location) -> bytes:
    if not is_remote(path):
        return Path(path).read_bytes()
    import obstore

    store, key = _split(path)
    return bytes(obstore.get(store, key).bytes())


def read_range(path: Location, offset: int, length: int) -> bytes:
    if not is_remote(path):
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read(length)
    import obstore

    store, key = _split(path)
    return bytes(obstore.get_range(store, key, start=offset, length=length)) if length else b""


def write_bytes(path: Location, data: bytes) -> None:
    """`data` at `path`, whole or not at all (an object's put is atomic; locally written beside and renamed)."""
    if not is_remote(path):
        staged = Path(f"{path}.{os.getpid()}.partial")
        staged.write_bytes(data)
        os.replace(staged, path)
        return
    import obstore

    store, key = _split(path)
    obstore.put(store, key, data)


@contextmanager
def writing(path: Location) -> Iterator[Any]:
    """A file to write at `path` that appears whole or not at all: locally written beside it and renamed into
    place; in object storage an upload, which appears when it ends (and is removed if writing failed)."""
    if not is_remote(path):
        staged = Path(f"{path}.{os.getpid()}.partial")
        staged.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _WholeWrites(open(staged, "wb", buffering=0)) as file:
                yield file
            os.replace(staged, path)
        finally:
            staged.unlink(missing_ok=True)
        return
    import obstore

    store, key = _split(path)
    with _Writing(obstore.open_writer(store, key)) as stream:
        yield stream


_copies: dict[str, Path] = {}  # URL -> this process's local copy of a single-file checkpoint
_copies_removed_at_exit: list[bool] = []


def local_file(path: Location) -> Path:
    """A single-file checkpoint where torch can memory-map it: itself, or (in object storage) a copy fetched once
    per process into $TMPDIR, removed when another is fetched and at exit. (A folder's shards are read in place, each
    rank its ranges.)"""
    if not is_remote(path):
        return Path(path)
    if str(path) not in _copies:
        import obstore

        _remove_copies()  # one copy at a time: a rollback to another save does not pile them up (a copy still
        # memory-mapped stays readable: its pages go when the mapping does)
        store, key = _split(path)
        handle, name = tempfile.mkstemp(prefix="checkpoint-", suffix=".ckpt")
        with os.fdopen(handle, "wb") as file:
            for chunk in obstore.get(store, key).stream(min_chunk_size=8 << 20):
                file.write(chunk)
        if not _copies_removed_at_exit:
            atexit.register(_remove_copies)
            _copies_removed_at_exit.append(True)
        _copies[str(path)] = Path(name)
    return _copies[str(path)]


def _remove_copies() -> None:
    for copy in _copies.values():
        copy.unlink(missing_ok=True)
    _copies.clear()


class _Reading(io.RawIOBase):
    """An object read as a seekable file: obstore's buffered reader, with the `readinto` torch.load uses."""

    def __init__(self, file: Any):
        self._file = file

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = memoryview(self._file.read(len(view)))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _WholeWrites(io.RawIOBase):
    """A file whose every write is whole or raises, keeping its first error in `error`: torch's writer, given a file
    object whose write fails (a full disk, a size limit), reports a RuntimeError of its own instead."""

    def __init__(self, file: Any):
        self._file, self._written = file, 0
        self.error: Exception | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, data: Any) -> int:
        view, done = memoryview(data).cast("B"), 0
        try:
            while done < len(view):  # a short write (the disk just filled) is followed by one that raises
                done += self._send(view[done:])
        except Exception as error:
            self.error = self.error or error
            raise
        self._written += done
        return done

    def _send(self, data: memoryview) -> int:
        return self._file.write(data)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _Writing(_WholeWrites):
    """An object written as a file: obstore's multipart writer, keeping the position torch's writer asks for. Left
    on an error, the upload is abandoned (obstore's writer, told of the error, aborts it): no partial object."""

    def _send(self, data: memoryview) -> int:
        # A copy: obstore keeps the buffer it is given until it uploads, and torch reuses its buffers meanwhile.
        return self._file.write(bytes(data))

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if kind is None:
            self.close()
            return
        self._file.__exit__(kind, error, trace)
        io.RawIOBase.close(self)


class ObjectFiles(FileSystem):
    """torch's distributed-checkpoint file operations on object storage: every one of its local FileSystem's
    replaced (as torch's own fsspec one does)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        import obstore

        store, key = _split(str(path))
        stream: io.IOBase = (
            _Reading(obstore.open_reader(store, key)) if "r" in mode else _Writing(obstore.open_writer(store, key))
        )
        with stream:
            yield stream

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        import obstore

        store, key = _split(str(path))
        obstore.rename(store, key, _split(str(new_path))[1])

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path).rstrip("/")

    def mkdir(self, path: str | os.PathLike) -> None:
        pass  # no folders in object storage: a prefix exists once an object under it does

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return urlparse(str(checkpoint_id)).scheme in SCHEMES

    def exists(self, path: str | os.PathLike) -> bool:
        return is_file(str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        import obstore

        store, key = _split(str(path))
        obstore.delete(store, key)


class ObjectWriter(FileSystemWriter):
    """torch's FileSystemWriter (one file per rank, `.metadata` last) writing to object storage."""

    def __init__(self, url: str):
        super().__init__(url, sync_files=False)  # no fsync of an upload
        self.fs = ObjectFiles()
        self.path = self.fs.init_path(url)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return ObjectFiles.validate_checkpoint_id(checkpoint_id)


class ObjectReader(FileSystemReader):
    """torch's FileSystemReader reading from object storage: each rank fetches the byte ranges of its pieces."""

    def __init__(self, url: str):
        super().__init__(url)
        self.fs = ObjectFiles()
        self.path = self.fs.init_path(url)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return ObjectFiles.validate_checkpoint_id(checkpoint_id)


def storage_reader(folder: Location) -> StorageReader:
    return ObjectReader(str(folder)) if is_remote(folder) else FileSystemReader(str(folder))


def storage_writer(folder: Location) -> StorageWriter:
    return ObjectWriter(str(folder)) if is_remote(folder) else FileSystemWriter(str(folder))
