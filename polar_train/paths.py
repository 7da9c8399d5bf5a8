"""What is wrong with a path a user named, said the same way by every command: a file that is
not one, a folder that cannot be written, or a folder we would write into that holds someone
else's files."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

#: A build's report in its --out folder. The leading underscore: Parquet dataset readers (pyarrow,
#: pandas) skip it; as build_report.json, ``pd.read_parquet(out)`` failed on it ("Could not read
#: schema from 'out/build_report.json'").
REPORT_NAME = "_build_report.json"
#: An earlier version's report name: still an earlier build's folder; a rebuild removes it.
OLD_REPORT_NAME = "build_report.json"
#: Marks a folder as a ``polar-train train`` run's output (see polar_train.train.cli).
RUN_MARKER = ".polar-train-run"


def expand_home(value: str) -> str:
    """``value`` with ``~`` and ``~user`` expanded as the shell would have; ``ValueError`` for a
    ``~user`` that names no home. A quoted ``'~/run'``, ``--output=~/run`` (bash expands no ``~``
    after ``=``) or ``--set polar_out=~/caps`` reached a command as it was: train wrote half a run
    into a folder named ``~`` here and TRL the other half into $HOME, and an unknown ``~user`` was
    pathlib's traceback."""
    if not value.startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):  # left as it was: no such user (or no home to expand ~ to)
        user = value[1:].split("/", 1)[0]
        raise ValueError(f"{value}: cannot expand ~{user} (no home folder of "
                         f"{'user ' + repr(user) if user else 'this user'})")
    return expanded


def user_path(value: str) -> str:
    """:func:`expand_home` as an argparse ``type`` (its error as argparse says one)."""
    try:
        return expand_home(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def make_private_dir(path: str | Path) -> None:
    """Create ``path`` (and any missing parent) readable by the owner only (mode 0700); raises
    OSError. Captures, trajectories, training runs and harness homes hold prompts. Only folders
    created here get that mode: an existing one (a shared folder, ``$HOME``) keeps its own."""
    old = os.umask(0o077)  # what mkdir creates, parents included, is the owner's only
    try:
        Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
    finally:
        os.umask(old)


def not_a_file(path: str | Path, what: str = "file") -> str | None:
    """None when ``path`` is a file; else why not ("a folder, not a file" reads better than a
    "not found" for a folder that plainly exists)."""
    p = Path(path)
    if p.is_file():
        return None
    if p.is_dir():
        return f"{what} {p} is a folder, not a file"
    if p.exists():
        return f"{what} {p} is not a regular file"
    return f"{what} not found: {p}"


def holds_other_files(folder: str | Path, *ours: str) -> bool:
    """Whether ``folder`` exists with something in it but none of ``ours`` (the files an earlier
    run of the command leaves there): writing into it could replace a user's files."""
    p = Path(folder)
    return p.is_dir() and any(p.iterdir()) and not any((p / name).is_file() for name in ours)


def cannot_write_folder(folder: str | Path, what: str) -> str | None:
    """Why the folder ``folder`` (named by the option ``what``) cannot be written or created; None
    when it can. Checked before slow work, so that a typo fails in a second, not after a build or
    a model load."""
    out = Path(folder)
    if out.is_symlink() and not out.exists():
        return f"{what} {out} is a broken symbolic link (or a loop of them)"
    if out.exists():
        if not out.is_dir():
            return f"{what} is a file, not a folder: {out}"
        if not os.access(out, os.W_OK | os.X_OK):
            return f"{what} {out}: {_denied(out)} (the folder is not writable)"
        return None
    parent = out.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if parent.is_symlink() and not parent.exists():  # (it was called a file)
        return f"{what} {out}: {parent} is a broken symbolic link (or a loop of them)"
    if not parent.is_dir():
        return f"{what} {out}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{what} {out}: {_denied(parent)} (cannot create it in {parent})"
    return None


def _denied(folder: Path) -> str:
    """Why a folder is not writable, in the words of ``EROFS`` where that is why."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    return "permission denied"
