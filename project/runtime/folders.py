"""Where a command may write."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable(folder: str | os.PathLike) -> str | None:
    """Why files cannot be made in `folder` (created with its parents where missing), or None if they can."""
    folder = Path(os.path.abspath(folder))
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):  # root passes whatever the mode says, as its writes do
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        return f"{existing} is on a read-only file system" if read_only else f"{existing} is not writable by this user"
    try:  # the permission bits can allow what the file system refuses (/proc, /sys, a full disk): try a folder there
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as error:
        return f"no folder can be made in {existing} ({error.strerror or error})"
    return None
