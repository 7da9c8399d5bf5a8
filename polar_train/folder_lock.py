"""One writer per output folder: a build's ``--out``, a training run's ``--output``.

Why: two builds into one folder left parts of both; two training runs into one folder both said
they wrote the adapter, and the second's replaced the first's, with both runs' steps in one
metrics file. An ``flock`` on a dot-file in the folder goes with the process (a killed writer
leaves no stale lock behind).
"""

from __future__ import annotations

from pathlib import Path
from typing import IO


def hold_folder_lock(folder: Path, name: str, busy: str) -> IO[str]:
    """Lock ``folder/name`` for this process and return the open file (the lock lasts until it is
    closed); raises ``FileExistsError(busy)`` when another process holds it."""
    import errno
    import fcntl
    import sys

    lock = open(folder / name, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise FileExistsError(busy) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            lock.close()
            raise
        # some network and FUSE file systems have no locks: the writing goes on, unguarded, as before
        print(f"polar-train: warning: {folder}: the file system does not lock files ({exc.strerror}); "
              "a second writer into this folder meanwhile would not be refused", file=sys.stderr, flush=True)
    except BaseException:
        lock.close()
        raise
    return lock


def hold_shared_lock(path: Path) -> IO[str] | None:
    """A shared ``flock`` on ``path`` (made if missing, mode 0600) for as long as the returned file
    is open: many holders at once, and a reader can see that someone holds it (:func:`lock_holder`).
    None where it cannot be had (a read-only folder, a file system without locks): being seen is
    a courtesy, never a reason to stop writing."""
    import fcntl
    import os

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return None
    lock = os.fdopen(fd, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    return lock


def lock_holder(folder: Path, name: str) -> int | None:
    """The process id that holds ``folder/name``'s lock now, or None (none holds it, or this system
    does not say). Read from Linux's ``/proc/locks``: trying the lock instead would, for that
    instant, refuse a writer starting meanwhile. For readers (the training notebook: a run still
    loading or training is not "stopped")."""
    holders = lock_holders(folder / name)
    return holders[0] if holders else None


def lock_holders(path: Path) -> list[int]:
    """Every process id holding an ``flock`` on ``path`` now (shared locks: several), from
    ``/proc/locks``; empty where none does or the system does not say."""
    import os

    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = set()
    for line in table.splitlines():  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].isdigit() and fields[5] == where:
            holders.add(int(fields[4]))
    return sorted(holders)
