"""The call log's output folder: created readable by the owner only.

Why its own module: the proxy process creates the folder at start-up (so a bad ``polar_out`` is an
option error right away) but must not import the Parquet stack, which only the row worker needs.
"""

from __future__ import annotations

import os
from pathlib import Path


def prepare_calls_dir(calls_dir: Path) -> None:
    """Create ``calls_dir`` (and its parent) with mode 0700; raises OSError."""
    old = os.umask(0o077)
    try:
        calls_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    finally:
        os.umask(old)
    try:
        os.chmod(calls_dir.parent, 0o700)
        os.chmod(calls_dir, 0o700)
    except OSError:
        pass
