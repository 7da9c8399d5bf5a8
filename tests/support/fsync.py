"""The paths ``polar_train.durable`` flushes to disk, in order: what the durability tests check."""

from __future__ import annotations

import os


def recorded_fsyncs(monkeypatch) -> list[str]:
    """Every path ``polar_train.durable`` fsyncs from now on (the real fsync still runs)."""
    from polar_train import durable

    synced: list[str] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", recording)
    return synced
