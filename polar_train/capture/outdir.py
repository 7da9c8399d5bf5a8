"""The call log's output folder: created readable by the owner only.

Why its own module: the proxy process creates the folder at start-up (so a bad ``polar_out`` is an
option error right away) but must not import the Parquet stack, which only the row worker needs.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..paths import OLD_REPORT_NAME, REPORT_NAME, RUN_MARKER, make_private_dir


def output_of_another_command(out: Path) -> str | None:
    """Why ``out`` (``polar_out``) is no place for captures, or None: a ``build --out`` or ``train
    --output`` folder (data/trajectories for data/captures is an easy slip). Parts written there
    made train refuse the trajectories ("a capture's call log") and a rebuild refuse the folder."""
    for name, what in ((REPORT_NAME, "polar-train build --out"), (OLD_REPORT_NAME, "polar-train build --out"),
                       (RUN_MARKER, "polar-train train --output")):
        if (out / name).is_file():
            return (f"polar_out: {out} is a `{what}` folder (it holds {name}): captures need a folder of their own "
                    "(e.g. data/captures)")
    return None


def prepare_calls_dir(calls_dir: Path) -> None:
    """Create ``calls_dir`` (and any missing parent) with mode 0700; raises OSError.

    Only folders created here get that mode: an existing ``polar_out`` (a shared folder, the
    user's repository, ``$HOME``) keeps its own, sticky bit and all."""
    make_private_dir(calls_dir)
    # an existing calls/ on a read-only mount passed the mkdir: the proxy then served, kept rows in
    # memory and lost them at shutdown. A dot-file (readers skip it) proves the folder writable.
    probe = calls_dir / f".polar-write-check-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    os.unlink(probe)


#: A shared lock each writing proxy's row worker holds in ``calls/`` while it runs: ``build`` and
#: ``inspect`` see a capture that is still being written (calls in flight, rows not yet flushed)
#: and say so. A dot-file: readers of the parts skip it.
LIVE_LOCK = ".polar-capture.lock"
#: How often an idle capture process checks its live lock is on the folder it writes to (seconds).
LIVE_LOCK_REFRESH_S = 1.0


class LiveLock:
    """This process's hold on ``calls/.polar-capture.lock``, kept on the folder the capture writes
    to now. An ``flock`` goes with the file, not its name: a ``calls/`` moved away to archive it
    stayed "being written" while the proxy ran. :meth:`refresh` (once per call or part, off the
    event loop: a stat and an fstat) lets go of a lock file that is no longer there and takes the
    one that is."""

    def __init__(self, calls_dir: Path) -> None:
        self.path = calls_dir / LIVE_LOCK
        self._file = None
        self._closed = False
        #: refresh runs in a sender/writer thread while close releases from another one
        self._guard = threading.Lock()

    def refresh(self) -> None:
        from ..folder_lock import hold_shared_lock

        with self._guard:
            if self._closed:
                return
            try:
                here = os.stat(self.path)
            except OSError:
                here = None
            if self._file is not None and here is not None:
                held = os.fstat(self._file.fileno())
                if (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino):
                    return
            self._drop()
            if self.path.parent.is_dir():
                self._file = hold_shared_lock(self.path)

    def release(self) -> None:
        """Let go for good (a later refresh takes nothing)."""
        with self._guard:
            self._closed = True
            self._drop()

    def _drop(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


#: Loss records: ``_losses-<pid>-<UTC>.json`` in ``calls/``, written when a process of the capture
#: lost calls or rows (a full row-worker queue, a disk that stayed full at shutdown). The proxy's
#: log said so and mitmdump still exited 0: ``inspect`` and ``build`` read these and say so too.
LOSS_RECORD_GLOB = "_losses-*.json"


def record_loss(calls_dir: Path, **counts: int | str) -> None:
    """Write one loss record (best effort: a disk that is full may refuse it too; never raises)."""
    import json
    from datetime import datetime, timezone

    from ..durable import sync_file, sync_folder

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    if not calls_dir.exists():  # moved away to archive it: made again, as the next part would
        try:
            prepare_calls_dir(calls_dir)
        except OSError:
            pass
    final = calls_dir / f"_losses-{os.getpid()}-{stamp}.json"
    tmp = calls_dir / f".{final.name}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "at": stamp, **counts}, fh)
        sync_file(tmp)  # on disk before its name: after a power cut, an empty record told nothing
        os.replace(tmp, final)
        sync_folder(calls_dir)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
