"""One writer per output folder (build's --out, train's --output), and file systems without locks."""

from __future__ import annotations

import errno

import pytest

from polar_train.folder_lock import hold_folder_lock


def test_a_second_holder_is_refused_until_the_first_lets_go(tmp_path):
    first = hold_folder_lock(tmp_path, ".lock", "busy here")
    with pytest.raises(FileExistsError, match="^busy here$"):
        hold_folder_lock(tmp_path, ".lock", "busy here")
    first.close()
    hold_folder_lock(tmp_path, ".lock", "busy here").close()


def test_a_file_system_without_locks_warns_and_writes_on(tmp_path, monkeypatch, capsys):
    """Some NFS and FUSE mounts answer flock with ENOLCK: build and train worked there before the
    lock, and must still (unguarded, said once)."""
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = hold_folder_lock(tmp_path, ".lock", "busy")
    lock.close()
    assert capsys.readouterr().err == (f"polar-train: warning: {tmp_path}: the file system does not lock files "
                                       "(No locks available); a second writer into this folder meanwhile would "
                                       "not be refused\n")

    def denied(fd, operation):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fcntl, "flock", denied)
    with pytest.raises(PermissionError):
        hold_folder_lock(tmp_path, ".lock", "busy")
