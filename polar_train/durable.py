"""Write-then-rename that survives a power loss, not only a crash of the process.

Why: a rename is atomic for other processes at once, but on disk it may land before the data of
the file it names (ext4, xfs with delayed allocation): after a power cut a build's parts, a run's
adapter or summary could be there by name and empty. Each file is flushed to disk before its
rename, and the folder after it (the rename itself is an entry of the folder).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def sync_file(path: str | Path) -> None:
    """Flush ``path``'s data to disk. An error is raised (the caller's write failed: EIO, ENOSPC),
    but for a file system that cannot flush (EINVAL, ENOSYS, ENOTSUP: some FUSE and network ones),
    where nothing more can be done."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def sync_folder(path: str | Path) -> None:
    """Flush ``path``'s entries (renames, new files) to disk; where a file system cannot (some
    network and FUSE ones refuse a folder's fsync), nothing more can be done: left so."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_tree(folder: str | Path) -> None:
    """:func:`sync_file` for every file under ``folder`` and :func:`sync_folder` for each folder."""
    for root, _, files in os.walk(folder):
        for name in files:
            sync_file(Path(root) / name)
        sync_folder(root)
