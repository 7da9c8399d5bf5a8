"""What is wrong with a path a user named as a file, said the same way by every command."""

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
