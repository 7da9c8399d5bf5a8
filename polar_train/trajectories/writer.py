"""Write trajectories as Parquet parts (``TRAJECTORY_SCHEMA``), temp-then-rename.

Why the discipline: the trainer (or ``datasets``) may glob ``--out`` while a build runs; it must
never see a half-written file, and after an interrupt or a failure the folder holds the previous
complete set of parts or the new one. Old parts are replaced only after every new part (and the
report) is complete, in one swap that an interrupt cannot split. A reader listing the folder during
the swap's renames can meet parts of both builds (no folder swap is atomic for a set of files):
each part names its build, and the trainer refuses a mix.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..capture.outdir import LIVE_LOCK
from ..durable import sync_file, sync_folder
from ..paths import REPORT_NAME, make_private_dir
from ..schema import TRAJECTORY_SCHEMA
from .stitch import Trajectory

ROWS_PER_PART = 2000
PART_GLOB = "part-*.parquet"
#: Parquet metadata of every part: the build it belongs to and how many parts that build wrote.
#: A build killed outright (SIGKILL, the OOM killer) during its swap left some old parts and some
#: new ones; the trainer took the mix without a word. It now compares these (:func:`build_problem`).
BUILD_ID_KEY = b"polar_train.build_id"
BUILD_PARTS_KEY = b"polar_train.build_parts"
#: How the build gave a rollout's reward to its trajectories (``broadcast`` / ``split``): the trainer's
#: per-rollout baseline reads a split share as the rollout's value only where it knows.
REWARD_MODE_KEY = b"polar_train.reward_mode"
#: The lock a build holds on its --out folder while it writes (a dot-file: readers skip it).
LOCK_NAME = ".polar-build.lock"


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


def json_bytes(obj: Any) -> bytes:
    """A report as written beside the parts: indented, keys in their order, one final newline."""
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def _temp_name(final: Path) -> Path:
    """Where ``final`` is written first: a dot-file (readers skip it) naming this process."""
    return final.with_name(f".{final.name}.tmp{os.getpid()}")


#: The temp files a build writes (:func:`_temp_name`): only these are removed as stale.
_TEMP = re.compile(r"\.(?:part-\d+\.parquet|_?build_report\.json)\.tmp(\d+)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale_temps(out_dir: Path) -> int:
    """Remove the temp files of earlier builds that died before renaming them (SIGKILL, power
    loss): each names its writer's process id, and only those of processes gone are removed (a
    build running beside this one keeps its own). Returns how many were removed."""
    removed = 0
    for p in out_dir.glob(".*.tmp*"):
        m = _TEMP.fullmatch(p.name)
        if m and int(m[1]) != os.getpid() and not _pid_alive(int(m[1])) and p.is_file():
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def is_trajectory_part(path: Path) -> bool:
    """True for a Parquet file this writer made (its schema metadata says so)."""
    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception:
        return False
    return meta.get(b"polar_train.table") == b"trajectories"


def part_paths(out: str | Path, rows: int, rows_per_part: int = ROWS_PER_PART) -> list[Path]:
    """The parts :func:`write_trajectories` writes for ``rows`` trajectories (a report names them
    before they exist)."""
    return [Path(out) / f"part-{n:05d}.parquet" for n in range(-(-rows // rows_per_part))]


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (then arrive as usual): the swap of old parts
    for new ones is a few renames, and an interrupt between them would leave half of each build.

    Why handlers and not a signal mask: the kernel hands a process signal to any thread that does
    not block it (pyarrow's pool among them), and Python then runs the handler in the main thread
    all the same; a handler that only notes the signal holds it whichever thread took it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (and Python runs them there alone)
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)  # now the usual handler: KeyboardInterrupt, or the CLI's SIGTERM exit


@contextmanager
def _only_writer(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir``'s lock while writing: two builds into one folder (one suspended mid-swap
    with Ctrl-Z, say) could otherwise leave parts of both and trajectories twice."""
    from ..folder_lock import hold_folder_lock

    with hold_folder_lock(out_dir, LOCK_NAME, f"another polar-train build is writing into {out_dir}; wait for "
                                              "it to end or choose another folder"):
        yield  # the lock goes with the file's closing


def new_build_id() -> str:
    import uuid

    return uuid.uuid4().hex


#: The name of a part :func:`write_trajectories` writes (``part-00000.parquet`` ...).
PART_NAME = re.compile(r"part-(\d{5,})\.parquet")


def build_problem(parts: Sequence[tuple[Path, dict[bytes, bytes]]]) -> str | None:
    """Why the build parts in one folder (each with its Parquet metadata) are no whole build, or
    None: parts of two builds (an earlier version's part, without a build id, beside this one's
    included), or not the parts ``part-00000`` ... its build wrote. Only parts of ours named as we
    name them are judged, and only where one of them records its build (a file taken out of a
    build, or parts another tool wrote, are not)."""
    ours = [(path, meta) for path, meta in parts
            if PART_NAME.fullmatch(path.name) and meta.get(b"polar_train.table") == b"trajectories"]
    if not any(BUILD_ID_KEY in meta for _, meta in ours):
        return None
    builds: dict[bytes | None, list[Path]] = {}
    for path, meta in ours:
        builds.setdefault(meta.get(BUILD_ID_KEY), []).append(path)
    if len(builds) > 1:
        names = [sorted(members)[0].name for members in builds.values()]
        return (f"parts of {len(builds)} builds ({' and '.join(names[:2])} are of different ones): a build killed "
                "while it replaced an earlier one, or parts copied together? build again (several builds are "
                "trained together each in a subfolder of its own)")
    ((path, meta),) = ours[:1]
    count = meta.get(BUILD_PARTS_KEY, b"").decode(errors="replace")
    if not count.isdigit():
        return None
    expected = {f"part-{n:05d}.parquet" for n in range(int(count))}
    # a part of the build written back by another tool (pandas keeps no Parquet metadata of ours) is
    # still there: "no part-00001.parquet" named a file in the folder, and "build again" lost the edit
    present = {path.name for path, _ in parts if PART_NAME.fullmatch(path.name)}
    if missing := sorted(expected - present):
        return (f"{len(present & expected)} of the {len(expected)} parts of its build (no {missing[0]}"
                f"{' ...' if len(missing) > 1 else ''}): a build killed while it wrote its parts, or parts removed? "
                "build again")
    have = {p.name for p, _ in ours}  # (a part another tool wrote beside the build's is not judged)
    if extra := sorted(have - expected):
        return (f"{extra[0]}{' ...' if len(extra) > 1 else ''} beside the {len(expected)} parts of its build, not "
                "one of them (a part copied under another number?): move it away, or build again")
    return None


def _holds_a_call_log(folder: Path) -> bool:
    """Whether ``folder`` is a capture or its ``calls/`` folder: a proxy's lock file there, or a
    Parquet file whose metadata says it is a call-log part (a capture copied without its dot-files,
    the repository's sample)."""
    for calls in (folder, folder / "calls"):
        if (calls / LIVE_LOCK).exists():
            return True
        for path in sorted(calls.glob("*.parquet")) if calls.is_dir() else ():
            try:
                if (pq.read_schema(path).metadata or {}).get(b"polar_train.table") == b"calls":
                    return True
            except Exception:  # noqa: BLE001 - an unreadable file is no call log we know
                continue
            break  # one readable part says what the folder holds
    return False


def write_trajectories(trajectories: Sequence[Trajectory], out: str | Path,
                       rows_per_part: int = ROWS_PER_PART, extra: dict[str, bytes] | None = None,
                       retire: Sequence[str] = (), build_id: str | None = None,
                       reward_mode: str | None = None) -> list[Path]:
    """Write ``part-NNNNN.parquet`` files (and ``extra``: file name -> bytes, e.g. the build
    report) under ``out``; returns the parts' paths. ``retire``: names of files an earlier
    build wrote that this one replaces under other names (an older report name), removed in the swap;
    an earlier build's report that ``extra`` does not replace is removed too (it described other
    parts). ``reward_mode``: the build's, recorded in each part for
    the trainer (under ``split`` a trajectory's reward is a share, no rollout's value); by default
    the trajectories' own (set where their rewards were attached).

    Everything is written under temporary names first; then, with SIGINT/SIGTERM held back, parts
    from an earlier build that the new set does not replace are removed and the new files renamed
    into place, so that ``out`` holds the old build or the new one, never a mix (but to a reader
    listing it during those renames: the trainer checks the parts' build ids). A file in the
    way that this function did not write (a call-log part, a user's file) is never replaced or
    deleted, and a second build writing into the same folder meanwhile is refused (a lock):
    :class:`FileExistsError` before anything is written. Folders made for a build that did not
    finish are removed again. No trajectories, a ``rows_per_part`` that is no positive whole
    number or an empty ``out`` are a :class:`ValueError` before anything is touched (an empty set
    used to remove the earlier build and write nothing; ``""`` wrote into the current folder).
    """
    if isinstance(rows_per_part, numbers.Integral) and not isinstance(rows_per_part, bool):
        rows_per_part = int(rows_per_part)  # (a numpy integer too)
    if isinstance(rows_per_part, bool) or not isinstance(rows_per_part, int) or rows_per_part < 1:
        raise ValueError(f"rows_per_part must be a positive whole number, not {rows_per_part!r}")
    if isinstance(out, (str, bytes, os.PathLike)) and not os.fspath(out):
        raise ValueError("empty path: name the folder to write the trajectories to (\".\" for the current one)")
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out: name a folder (str or os.PathLike), not {type(out).__name__}")
    if hasattr(trajectories, "trajectories") and hasattr(trajectories, "report"):  # a BuildResult
        raise TypeError("pass the build's trajectories (result.trajectories), not the BuildResult")
    if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Sequence):
        raise TypeError(f"trajectories: a list of Trajectory (BuildResult.trajectories), not "
                        f"{type(trajectories).__name__}")
    if not trajectories:
        raise ValueError(f"no trajectories to write to {out}: it keeps what it holds")
    if not all(isinstance(t, Trajectory) for t in trajectories):
        wrong = next(t for t in trajectories if not isinstance(t, Trajectory))
        raise TypeError("trajectories: a list of Trajectory (BuildResult.trajectories); one is a "
                        f"{type(wrong).__name__}")
    if reward_mode is None:  # a caller of the earlier signature: the trajectories know how they were rewarded
        reward_mode = next((t.reward_mode for t in trajectories if t.reward_mode), None)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} is a file, not a folder")
    if _holds_a_call_log(out_dir):  # (the command refuses any folder inside a capture; from Python,
        # parts written into it read as "trajectories, not a call log" in every later read)
        raise FileExistsError(f"{out_dir} holds a capture's call log: write the trajectories elsewhere")
    finals = part_paths(out_dir, len(trajectories), rows_per_part)
    build = {BUILD_ID_KEY: (build_id or new_build_id()).encode(), BUILD_PARTS_KEY: str(len(finals)).encode(),
             **({REWARD_MODE_KEY: reward_mode.encode()} if reward_mode else {})}
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    lock_existed = (out_dir / LOCK_NAME).exists()  # (a refusal leaves no lock of ours in a user's folder)
    make_private_dir(out_dir)  # the trajectories hold the captured prompts
    written: list[tuple[Path, Path]] = []
    swapped = False
    try:
        with _only_writer(out_dir):
            for final in finals:  # (under the lock: another build's swap made its own part read as foreign)
                if (final.exists() or final.is_symlink()) and (final.is_symlink() or not is_trajectory_part(final)):
                    if not lock_existed:  # a user's folder, refused: no lock file of ours is left in it
                        (out_dir / LOCK_NAME).unlink(missing_ok=True)
                    raise FileExistsError(f"{final} exists and was not written by polar-train build; move it away "
                                          "or choose another folder")
            remove_stale_temps(out_dir)
            for n, final in enumerate(finals):
                start = n * rows_per_part
                tmp = _temp_name(final)
                written.append((tmp, final))
                table = trajectories_table(trajectories[start:start + rows_per_part])
                table = table.replace_schema_metadata({**(table.schema.metadata or {}), **build})
                pq.write_table(table, tmp, write_page_checksum=True)  # the trainer verifies them: no silently other ids
                os.chmod(tmp, 0o600)  # the captured prompts, as the capture's parts: an --out made beforehand
                sync_file(tmp)  # under umask 022 held them readable by every user
            for name, data in (extra or {}).items():
                final = out_dir / name
                tmp = _temp_name(final)
                written.append((tmp, final))
                tmp.write_bytes(data)
                os.chmod(tmp, 0o600)
                sync_file(tmp)
            with _signals_held():
                new = set(finals)
                for old in out_dir.glob(PART_GLOB):
                    if old not in new and is_trajectory_part(old):
                        old.unlink()  # only our own earlier output: never a call-log part or a foreign file
                # an earlier build's report, where this write brings none (a call from Python): it
                # described the parts replaced here (a notebook read its realign and counts)
                stale = [*retire, *(() if extra and REPORT_NAME in extra else (REPORT_NAME,))]
                for name in stale:
                    if (out_dir / name).is_file() and not (out_dir / name).is_symlink():
                        (out_dir / name).unlink()
                for tmp, final in written:
                    os.replace(tmp, final)
                swapped = True
            sync_folder(out_dir)
    finally:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)  # after a failure or an interrupt: no temp file stays
        if not swapped and created:  # nothing was built here after all: the folders made for it go again
            (out_dir / LOCK_NAME).unlink(missing_ok=True)
            for folder in created:
                with contextlib.suppress(OSError):
                    folder.rmdir()
    return finals
