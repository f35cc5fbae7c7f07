"""Paths that may be URLs, without torch: which are remote, joining them, and which object stores checkpoints may go
to. Shared by the data (prepared shards in object storage), the checkpoints (project.checkpoint.locations) and the
settings check, which runs before torch is imported."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from project.runtime.errors import ConfigError

#: Object stores checkpoints are written to and read from (obstore's; only S3 is wired and tested).
SCHEMES = ("s3",)


def is_remote(path: str | os.PathLike | None) -> bool:
    return path is not None and "://" in str(path)


def join_text(base: str | os.PathLike, *parts: str) -> str:
    """A path or URL inside `base` (pathlib would fold the // of a URL)."""
    if is_remote(base):
        return "/".join([str(base).rstrip("/"), *parts])
    return str(Path(base, *parts))


def check_url(url: str | os.PathLike, setting: str | None = None) -> None:
    """A URL the platform can keep checkpoints at, else a ConfigError naming it (and the `setting` that gave it)."""
    parsed = urlparse(str(url))
    if parsed.scheme not in SCHEMES or not parsed.netloc:
        named = f"{setting}={url}" if setting else str(url)
        raise ConfigError(
            f"{named}: checkpoints go to a local folder or to S3 (and S3-compatible servers) as s3://bucket/prefix, "
            "with credentials and endpoint from the AWS_* environment variables. Write them to a local folder (and "
            "copy them with your storage's own tool), or use an s3:// URL."
        )
