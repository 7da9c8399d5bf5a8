"""The call log's output folder: created readable by the owner only.

Why its own module: the proxy process creates the folder at start-up (so a bad ``polar_out`` is an
option error right away) but must not import the Parquet stack, which only the row worker needs.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..paths import make_private_dir


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

