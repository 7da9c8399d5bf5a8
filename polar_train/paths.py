"""What is wrong with a path a user named, said the same way by every command: a file that is
not one, or a folder we would write into that holds someone else's files."""

from __future__ import annotations

from pathlib import Path


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
