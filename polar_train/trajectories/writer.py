"""Write trajectories as Parquet parts (``TRAJECTORY_SCHEMA``), temp-then-rename.

Why the discipline: the trainer (or ``datasets``) may glob ``--out`` while a build runs; it must
see either the previous complete set of parts or the new one, never a half-written file.
Old parts are replaced only after every new part is complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..schema import TRAJECTORY_SCHEMA
from .stitch import Trajectory

ROWS_PER_PART = 2000
PART_GLOB = "part-*.parquet"


def _list_array(chunks: Sequence[np.ndarray], value_type: pa.DataType, dtype) -> pa.Array:
    lengths = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int32)
    if lengths.sum() >= 2**31:
        raise ValueError("too many tokens for one part; lower rows per part")
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(chunks).astype(dtype, copy=False) if chunks else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def trajectories_table(trajectories: Sequence[Trajectory]) -> pa.Table:
    """One Arrow table of ``trajectories``; token columns built from flat numpy buffers."""
    ids, masks, lps = [], [], []
    for t in trajectories:
        c, m, lp = t.completion_arrays()
        ids.append(c)
        masks.append(m)
        lps.append(lp)
    cols: dict[str, Any] = {
        "trajectory_id": pa.array([t.trajectory_id for t in trajectories], pa.string()),
        "rollout_id": pa.array([t.rollout_id for t in trajectories], pa.string()),
        "group_id": pa.array([t.group_id for t in trajectories], pa.string()),
        "task_id": pa.array([t.task_id for t in trajectories], pa.string()),
        "prompt_ids": _list_array([t.prompt for t in trajectories], pa.int32(), np.int32),
        "completion_ids": _list_array(ids, pa.int32(), np.int32),
        "loss_mask": _list_array(masks, pa.int8(), np.int8),
        "logprobs": _list_array(lps, pa.float32(), np.float32),
        "reward": pa.array([t.reward for t in trajectories], pa.float64()),
        "num_calls": pa.array([len(t.call_ids) for t in trajectories], pa.int32()),
        "call_ids": pa.array([t.call_ids for t in trajectories], pa.list_(pa.string())),
        "token_source": pa.array([t.token_source for t in trajectories], pa.string()),
        "truncated": pa.array([t.truncated for t in trajectories], pa.bool_()),
        "realigned": pa.array([t.realigned for t in trajectories], pa.bool_()),
        "fork_cause": pa.array([t.fork_cause for t in trajectories], pa.string()),
        "model": pa.array([t.model for t in trajectories], pa.string()),
        "temperature": pa.array([t.temperature for t in trajectories], pa.float32()),
    }
    return pa.Table.from_arrays([cols[f.name] for f in TRAJECTORY_SCHEMA], schema=TRAJECTORY_SCHEMA)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def is_trajectory_part(path: Path) -> bool:
    """True for a Parquet file this writer made (its schema metadata says so)."""
    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception:
        return False
    return meta.get(b"polar_train.table") == b"trajectories"


def write_trajectories(trajectories: Sequence[Trajectory], out: str | Path,
                       rows_per_part: int = ROWS_PER_PART) -> list[Path]:
    """Write ``part-NNNNN.parquet`` files under ``out``; returns their paths.

    Parts from an earlier build in ``out`` are removed once the new ones are complete; other
    files (a call-log part, anything not written by this function) are never deleted.
    """
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out is a file, not a folder: {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_paths: list[tuple[Path, Path]] = []
    try:
        for n, start in enumerate(range(0, len(trajectories), rows_per_part)):
            table = trajectories_table(trajectories[start:start + rows_per_part])
            final = out_dir / f"part-{n:05d}.parquet"
            tmp = out_dir / f".{final.name}.tmp{os.getpid()}"
            pq.write_table(table, tmp)
            tmp_paths.append((tmp, final))
    except BaseException:
        for tmp, _ in tmp_paths:
            tmp.unlink(missing_ok=True)
        raise
    finals = {final for _, final in tmp_paths}
    for old in out_dir.glob(PART_GLOB):
        if old not in finals and is_trajectory_part(old):
            old.unlink()  # only our own earlier output: never a call-log part or a foreign file
    for tmp, final in tmp_paths:
        os.replace(tmp, final)
    return [final for _, final in tmp_paths]
