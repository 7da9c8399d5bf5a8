"""Read the call log: every Parquet part the capture addon wrote, checked, merged, resolved.

Why one reader for everyone: the addon writes parts concurrently (temporary ``.part-*.tmp``
files renamed when complete), parts from older or foreign writers may sit in the same folder,
and long sessions may store prompts compactly. Every consumer (builder, inspect, trainer
tools) must skip the same temporary files, report the same bad parts by name, and see full
prompts; doing that once here keeps them in agreement.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .schema import (CALL_LOG_ADDED_COLUMNS, CALL_LOG_SCHEMA, CALL_LOG_VERSION, COMPACT_TEXT_COLUMNS,
                     LEGACY_REQUEST_DELTA_COLUMNS, delta_columns, missing_columns)
from .text_delta import BadDelta, apply_text_delta, delta_length

log = logging.getLogger(__name__)

PART_SUFFIX = ".parquet"

T = TypeVar("T")


class CallLogError(ValueError):
    """The call-log folder cannot be read at all (missing, not a folder, no parts)."""


@dataclass
class PartProblem:
    """A part that was skipped, or a call whose stored prompt or text could not be resolved.

    ``call_id`` is set for a call's problem (its ``path`` then reads ``call <id>``): a part's
    path may start with "call " too. ``column`` names what of the call was not rebuilt (read as
    null): ``prompt_token_ids``, ``request_json`` or ``response_json``."""

    path: str
    message: str
    call_id: str | None = None
    column: str | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def call_problem(call_id: str, message: str, column: str = "prompt_token_ids") -> PartProblem:
    """A problem of one call's rows (not of a part): its ``column`` could not be rebuilt."""
    return PartProblem(f"call {call_id}", message, call_id=call_id, column=column)


@dataclass
class CallLog:
    """The calls of a folder plus what was read and what was wrong with it."""

    table: pa.Table
    parts: list[Path] = field(default_factory=list)
    problems: list[PartProblem] = field(default_factory=list)
    #: rows stored as a delta of an earlier call (compact storage), counted before they were resolved
    compact_rows: int = 0
    #: every row's full prompt length (None: no prompt), where the prompts were checked, not rebuilt
    prompt_lengths: list[int | None] | None = None
    #: rows of each part read, in the order of ``parts`` (the table's rows follow that order)
    part_rows: list[int] = field(default_factory=list)


def _folder_path(folder: str | Path) -> Path:
    """``folder`` as a path; an empty one is refused: ``Path("")`` is the current folder, and an
    unset variable passed as the folder would read everything under it (the CLI refuses an empty
    argument too). ``"."`` still names the current folder."""
    if isinstance(folder, (str, bytes, os.PathLike)) and not os.fspath(folder):
        raise CallLogError("empty path: name the call-log folder (\".\" for the current one)")
    return Path(folder)


def part_folder(folder: str | Path) -> Path:
    """Where the parts of a capture folder live: ``<folder>/calls`` if present, else ``<folder>``."""
    root = _folder_path(folder)
    if not root.exists():
        raise CallLogError(f"call-log folder not found: {root}")
    if root.is_file():
        return root
    calls = root / "calls"
    return calls if calls.is_dir() else root


def list_parts(folder: str | Path) -> list[Path]:
    """The finished parts of a capture folder (or a single part file), sorted by path."""
    return _find_parts(folder)[0]


def _calls_folders(folder: str | Path, parts: list[Path]) -> list[Path]:
    """The folders a capture writes into that a read of ``folder`` covers: those its parts are in,
    ``folder`` and ``folder/calls`` themselves, and any folder below holding a proxy's live lock or
    a loss record (a capture with no part yet: a proxy just started writing into
    ``folder/machine-b/calls`` went unnamed)."""
    from .capture.outdir import LIVE_LOCK

    root = Path(folder).expanduser()
    found = {p.parent for p in parts}
    if root.is_dir():
        found |= {root, root / "calls"}
        for here, files in _walk_capture(root, lambda exc: None):  # (an unreadable folder: the parts' walk says it)
            if LIVE_LOCK in files or any(name.startswith("_losses-") for name in files):
                found.add(Path(here))
    return sorted(found)


def live_writers(folder: str | Path, parts: list[Path]) -> list[tuple[Path, list[int]]]:
    """The ``calls/`` folders under ``folder`` that a capture proxy is writing into now (its row
    worker holds the folder's live lock), with the writers' process ids. Their calls in flight and
    the rows not yet flushed are not among ``parts``: a build read a live capture, left out
    finished calls and built rollouts still running as if complete, without a word."""
    from .capture.outdir import LIVE_LOCK
    from .folder_lock import lock_holders

    live = []
    for calls_dir in _calls_folders(folder, parts):
        if (calls_dir / LIVE_LOCK).is_file() and (holders := lock_holders(calls_dir / LIVE_LOCK)):
            live.append((calls_dir, holders))
    return live


def loss_notes(folder: str | Path, parts: list[Path]) -> list[str]:
    """One line per loss record (``outdir.LOSS_RECORD_GLOB``) in the ``calls/`` folders under
    ``folder``: calls a proxy dropped or rows it could not write, which its log said and mitmdump's
    exit status did not."""
    import json

    from .capture.outdir import LOSS_RECORD_GLOB

    notes = []
    for calls_dir in _calls_folders(folder, parts):
        for record in sorted(calls_dir.glob(LOSS_RECORD_GLOB)):
            try:
                data = json.loads(record.read_text())
            except (OSError, ValueError):
                data = None
            if not isinstance(data, dict):
                data = {}
            lost = [f"{n} {what}" for key, what in (("calls_dropped", "call(s) dropped (row worker queue full)"),
                                                    ("rows_lost", "row(s) whose part could not be written"),
                                                    ("rows_failed", "row(s) whose building failed"),
                                                    ("calls_lost", "call(s) the row worker process had not "
                                                                   "written when it died"))
                    if isinstance(n := data.get(key), int) and n > 0]
            if lost:
                why = data.get("why") if isinstance(data.get("why"), str) else ""
                why = f": {why}" if why and why not in ", ".join(lost) else ""  # (not said twice)
                notes.append(f"{record}: the capture process {data.get('pid')} lost {', '.join(lost)}{why}; its log "
                             "has the details (these calls are in no part)")
            else:  # a record is written only where something was lost: this one is damaged
                notes.append(f"{record}: a loss record that cannot be read (damaged or empty): a capture process "
                             "lost calls or rows it names in its log (they are in no part)")
    return notes


def shared_rollout_notes(log: CallLog) -> list[str]:
    """One line naming the rollout ids found in several capture folders (each part's folder): runs on
    two machines or days that number their rollouts alike (``polar-train demo`` always names them
    ``r0-greet-0``, ...), merged under one parent. Their calls count as one rollout's - its second
    run's first calls as retries of the first's. A call stored twice (a capture copied) counts once."""
    if len(log.part_rows) != len(log.parts) or len({p.parent for p in log.parts}) < 2:
        return []
    folder_of_row = [p.parent for p, n in zip(log.parts, log.part_rows) for _ in range(n)]
    rollouts = log.table.column("rollout_id").to_pylist()
    # a rollout is two runs' where two folders each hold a call of it the other lacks (a part, or a
    # whole capture, copied into a backup/ folder holds none the original lacks: no such rollout)
    calls_in: dict[Any, dict[Path, set[Any]]] = {}
    for row, call_id in enumerate(log.table.column("call_id").to_pylist()):
        if rollouts[row] is not None and row < len(folder_of_row):
            calls_in.setdefault(rollouts[row], {}).setdefault(folder_of_row[row], set()).add(call_id)
    shared = sorted(r for r, by_folder in calls_in.items()
                    if any(a - b and b - a for a, b in itertools.combinations(by_folder.values(), 2)))
    if not shared:
        return []
    named = ", ".join(repr(r) for r in shared[:5]) + (" ..." if len(shared) > 5 else "")
    return [f"{len(shared)} rollout id(s) hold calls of several capture folders ({named}): machines or days "
            "numbering their rollouts alike? each is counted as one rollout (its later calls as retries or "
            "branches of the first, one reward); give every session its own id, or read the folders apart"]


def live_notes(before: list[tuple[Path, list[int]]], after: list[tuple[Path, list[int]]]) -> list[str]:
    """The report's lines on :func:`live_writers` seen before and after a read: the proxies still
    writing (:func:`live_writers_note`), and those that stopped meanwhile - their last rows were
    written after the listing, unread (a probe's build read 20 of 25 rows and said nothing)."""
    # by folder, not process: a row worker replaced during the read leaves its proxy writing
    still = {folder for folder, _ in after}
    stopped = [(folder, pids) for folder, pids in before if folder not in still]
    notes = [note] if (note := live_writers_note(after)) is not None else []
    if stopped:
        where = "; ".join(f"{folder} (process {', '.join(map(str, pids))})" for folder, pids in stopped)
        notes.append(f"a capture proxy stopped while the parts were read: {where}; rows it wrote as it stopped may "
                     "not have been read: read again")
    return notes


def live_writers_note(live: list[tuple[Path, list[int]]]) -> str | None:
    """One line on :func:`live_writers`' folders for a report, or None."""
    if not live:
        return None
    where = "; ".join(f"{folder} (its lock held by process {', '.join(map(str, pids))})" for folder, pids in live)
    return (f"a capture proxy is writing into {where}: calls still in flight and rows not yet written (up to "
            "polar_flush_seconds, 10 s by default) are not read, and a rollout still running is read as it stands; "
            "read again once its rollouts have ended, or after stopping mitmdump")


def _find_parts(folder: str | Path) -> tuple[list[Path], list[PartProblem]]:
    """The finished parts (sorted) and the folders below that could not be read.

    Why not ``rglob``: it passes over a folder it may not read without a word, and the calls in
    it would go missing from a build unnoticed. A symbolic link to a folder (another run's
    ``calls/`` linked in) is followed, each real folder read once: a loop cannot make the walk
    endless, and a folder linked twice is not read twice. The whole folder is walked, its
    ``calls/`` (the addon's) and every other folder in it: another machine's or day's capture
    folder copied in beside ``calls/`` was passed over in silence."""
    base = part_folder(folder)
    if base.is_file():
        return [base], []
    base = _folder_path(folder)
    problems: list[PartProblem] = []

    def unreadable(exc: OSError) -> None:
        problems.append(PartProblem(str(exc.filename or base), f"unreadable folder: {exc.strerror or exc}"))

    parts = []
    for here, files in _walk_capture(base, unreadable):
        for name in files:
            if name.endswith(PART_SUFFIX) and not name.startswith((".", "_")):
                path = Path(here) / name
                if path.is_file():
                    parts.append(path)
                else:  # passed over in silence, its calls would go missing from a build unnoticed
                    problems.append(PartProblem(str(path), _not_a_file(path)))
            elif _COMPRESSED_PART.fullmatch(name):  # gzip'd to archive: its calls went missing unsaid
                problems.append(PartProblem(str(Path(here) / name), "a compressed part: decompress it (gunzip, "
                                            "zstd -d, ...) to read its calls"))
    return sorted(parts), problems


def _walk_capture(base: Path, onerror: Callable[[OSError], None]):
    """``(folder, file names)`` for ``base`` and every folder below it, links to folders followed,
    each real folder once; names starting with ``.`` or ``_`` (temporary, private) left out."""
    seen = {os.path.realpath(base)}
    for here, folders, files in os.walk(base, onerror=onerror, followlinks=True):
        kept = []
        for d in folders:
            real = os.path.realpath(os.path.join(here, d))
            if not d.startswith((".", "_")) and real not in seen:
                seen.add(real)
                kept.append(d)
        folders[:] = kept
        yield here, files


#: A part file someone compressed whole (``gzip part-....parquet``): Parquet compresses inside.
_COMPRESSED_PART = re.compile(r"[^._].*\.parquet\.(gz|zst|zstd|bz2|xz|lz4|zip|7z)", re.IGNORECASE)


def _not_a_file(path: Path) -> str:
    """Why a part's name is no readable file: a link whose target is gone (parts on a disk not
    mounted), a FIFO, a device."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return "a broken link" if path.is_symlink() else f"unreadable: {exc.strerror or exc}"
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    return f"{kind}, not a part file"


def _check_schema(schema: pa.Schema) -> str | None:
    """None when a part's schema has every call-log column with the right type (a part written
    before a column was added may lack it: it reads as null)."""
    metadata = schema.metadata or {}
    version = metadata.get(b"polar_train.version")
    if metadata.get(b"polar_train.table") == b"calls" and version is not None \
            and version.decode(errors="replace") != CALL_LOG_VERSION:
        # a later version may mean its columns otherwise (the trainer refuses such trajectories too)
        shown = version.decode(errors="replace")
        newer = shown.isdigit() and int(shown) > int(CALL_LOG_VERSION)
        return (f"call-log version {shown}, this polar-train reads version {CALL_LOG_VERSION}"
                + ("; upgrade polar-train" if newer else ""))
    problems = missing_columns(schema, CALL_LOG_SCHEMA, optional=CALL_LOG_ADDED_COLUMNS)
    if problems and {"trajectory_id", "completion_ids"} <= set(schema.names):
        return "trajectories (what `polar-train build` writes), not a call log"
    if problems:
        shown = ", ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
        return f"another schema than the call log: {shown}"
    return None


def _read_part(part: pq.ParquetFile, schema: pa.Schema, wanted: pa.Schema) -> pa.Table:
    """The ``wanted`` columns of a checked part (``schema``: its schema), each of its call-log type (a
    pandas round trip's ``large_string`` or ``double`` cast back; a column the part lacks null)."""
    names = set(schema.names)
    table = part.read(columns=[c for c in wanted.names if c in names], use_threads=False)
    if table.schema.equals(wanted, check_metadata=False):  # the capture's own parts
        return _full_schema(pa.Table.from_arrays(table.columns, schema=wanted))
    arrays = []
    for field in wanted:
        if field.name not in names:
            arrays.append(pa.nulls(table.num_rows, field.type))
            continue
        column = table.column(field.name)
        arrays.append(column if column.type.equals(field.type) else column.cast(field.type))
    return _full_schema(pa.Table.from_arrays(arrays, schema=wanted))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


#: Files of a ``polar-train train`` output folder: a folder given in place of a capture.
_RUN_FILES = (".polar-train-run", "train_summary.json", "metrics.jsonl", "adapter")


def read_call_log(folder: str | Path, *, resolve_prompts: bool = True, skip: Collection[str] = frozenset(),
                  rebuild: bool = True) -> CallLog:
    """Read every finished part under ``folder`` into one table with the full call-log schema.

    Parts with another schema or unreadable data are skipped and named in ``problems``; the
    rest is still read. Raises :class:`CallLogError` when the folder is missing or holds no
    parts at all. With ``resolve_prompts`` (the default) compactly stored prompts and request
    and response texts are expanded, so ``prompt_token_ids``, ``request_json`` and ``response_json``
    always hold the full prompt and texts, and the ``prompt_prefix_*``, ``*_base_call_id`` and
    ``*_delta`` columns are null. An empty path is a :class:`CallLogError` too (``"."`` names
    the current folder).

    Columns named in ``skip`` are not read at all - they come back null: the builder never needs
    the request and response texts, which are most of a long session's bytes. Columns that compact
    rows are rebuilt from (ids, call ids, references) cannot be skipped (``ValueError``).

    Without ``rebuild`` compact rows are checked (what cannot be rebuilt is a problem, as with
    it) but nothing is rebuilt: ``prompt_token_ids`` and the texts come back null, and
    ``CallLog.prompt_lengths`` holds every prompt's full length. ``inspect`` needs no more, and
    a long session's rebuilt prompts and texts take gigabytes where the capture takes megabytes.
    """
    if isinstance(skip, (str, bytes)):  # set("request_json") is its letters: "not call-log columns: _, e, j, ..."
        raise TypeError(f"skip: give a set of column names, e.g. {{{skip!r}}}, not one string")
    unknown = sorted(set(skip) - set(CALL_LOG_SCHEMA.names))
    if unknown:
        raise ValueError(f"skip: not call-log columns: {', '.join(unknown)}")
    # what compact rows are rebuilt from is always read: without it a stored suffix would pass
    # for a whole prompt (a text's own delta columns mean nothing without it: left unread with it)
    needed = {"call_id", "prompt_token_ids", "completion_token_ids", "prompt_prefix_call_id", "prompt_prefix_len",
              *(name for c in COMPACT_TEXT_COLUMNS if c not in skip for name in delta_columns(c))}
    refused = sorted(set(skip) & needed)
    if refused:
        raise ValueError(f"skip: {', '.join(refused)} cannot be left unread: compact rows are rebuilt from "
                         f"{'it' if len(refused) == 1 else 'them'}")
    skip = frozenset(skip) | {name for c in COMPACT_TEXT_COLUMNS if c in skip for name in delta_columns(c)}
    columns = [name for name in CALL_LOG_SCHEMA.names if name not in skip]
    root = _folder_path(folder)
    if not root.exists():
        raise CallLogError(f"call-log folder not found: {root}")
    parts, unreadable = _find_parts(root)
    if not parts and unreadable:
        raise CallLogError(f"cannot read {unreadable[0].path}: {unreadable[0].message.removeprefix('unreadable folder: ')}")
    if not parts:
        hint = ""
        if root.is_dir() and any((root / name).exists() for name in _RUN_FILES):
            hint = f": {root} is a training run (what `polar-train train` writes), not a capture"
        elif losses := loss_notes(root, []):  # a disk full at the stop: every row lost, said on disk
            hint = "; " + "; ".join(losses)
        elif live := live_writers(root, []):  # a proxy writing here, or in a folder below (none yet)
            hint = "; " + "; ".join(
                f"a capture proxy (its lock held by process {', '.join(map(str, pids))}) is writing into {where}: "
                f"{_WAIT}" for where, pids in live)
        elif part_folder(root).name == "calls" and part_folder(root).is_dir():  # the addon's: no part yet?
            hint = _no_part_yet(part_folder(root))
        raise CallLogError(f"no call-log parts (*{PART_SUFFIX}) in {part_folder(root)}{hint}")
    result = CallLog(table=CALL_LOG_SCHEMA.empty_table(), problems=unreadable)
    tables: list[pa.Table] = []  # batches of parts, each one table: a table per part held
    pending: list[pa.Table] = []  # ~45 columns' objects (~50 KB) however few its rows
    legacy: dict[int, tuple] = {}  # row -> its LEGACY_REQUEST_DELTA_COLUMNS, where they refer to a call
    read_legacy = resolve_prompts and "request_json" in columns
    rows_read = 0
    wanted = pa.schema([CALL_LOG_SCHEMA.field(name) for name in columns])
    # checked, not rebuilt: a part's texts are read for their lengths and let go at once (a long
    # run's texts, hundreds of MB, were all held together: 1.09 GB to report on 7,118 calls)
    text_lengths: dict[str, list[pa.Array]] | None = (
        {c: [] for c in COMPACT_TEXT_COLUMNS if c in columns} if resolve_prompts and not rebuild else None)
    for path in parts:
        # one open per part (footer parsed once), not a pyarrow dataset: its fragments held
        # ~150 KB each, and a week of 10-second parts (60,000) took 9 GB to read
        try:
            part_file = pq.ParquetFile(path, page_checksum_verification=True)  # the capture's checksums
        except FileNotFoundError:  # an archiving job moved it since the folder was listed
            result.problems.append(PartProblem(str(path), "removed while it was read"))
            continue
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for broken files
            if _short_of_resources(exc):
                raise _no_resources(path, exc) from None
            result.problems.append(PartProblem(str(path), f"not a readable Parquet file ({_short(exc)})"))
            continue
        with part_file:
            schema = part_file.schema_arrow  # (built anew at each use)
            problem = _check_schema(schema)
            if problem:
                result.problems.append(PartProblem(str(path), problem))
                continue
            try:
                part = _read_part(part_file, schema, wanted)
                if read_legacy and set(LEGACY_REQUEST_DELTA_COLUMNS) <= set(schema.names):
                    legacy.update(_legacy_request_deltas(part_file, rows_read))
            except Exception as exc:  # corrupt pages behind a valid footer; a value its column cannot hold
                if _short_of_resources(exc):  # no fault of the part: skipping it would build without its calls
                    raise _no_resources(path, exc) from None
                result.problems.append(PartProblem(str(path), f"unreadable data ({_short(exc)})"))
                continue
        if text_lengths is not None:
            for c, found in text_lengths.items():
                found.append(pc.utf8_length(part.column(c)).combine_chunks())
            part = _replace(part, dict.fromkeys(text_lengths))
        pending.append(part)
        rows_read += part.num_rows
        result.parts.append(path)
        result.part_rows.append(part.num_rows)
        if len(pending) >= 256:
            tables.append(pa.concat_tables(pending).combine_chunks())
            pending = []
    tables.extend(pending)
    if tables:
        table = pa.concat_tables(tables).combine_chunks()
        result.table = table
    result.compact_rows = _compact_rows(result.table, legacy)
    if resolve_prompts:
        if legacy:
            if rebuild:
                result.table = _replace(result.table, {"request_json": pa.array(_resolve_legacy_requests(
                    result.table, legacy, result.table.column("request_json").to_pylist(), result.problems),
                    type=pa.string())})
            elif text_lengths is not None:
                found = pa.chunked_array(text_lengths["request_json"], type=pa.int32()).to_pylist()
                text_lengths["request_json"] = [pa.array(_resolve_legacy_requests(
                    result.table, legacy, found, result.problems), type=pa.int32())]
        if not rebuild:
            result.prompt_lengths = _prompt_lengths(result.table, result.problems)
            result.table = _replace(result.table, {"prompt_token_ids": None, "prompt_prefix_call_id": None,
                                                   "prompt_prefix_len": None})
        lengths = None if text_lengths is None else {
            c: pa.chunked_array(found, type=pa.int32()) for c, found in text_lengths.items()}
        result.table, unresolved = resolve_compact_rows(result.table, rebuild=rebuild, text_lengths=lengths)
        result.problems.extend(unresolved)
    return result


def _no_resources(path: Path, exc: BaseException) -> CallLogError:
    return CallLogError(f"cannot read {path}: not enough memory or threads for it ({_short(exc)}); free memory or "
                        "raise the limit (ulimit -v), and read again")


def _short_of_resources(exc: BaseException) -> bool:
    """Whether reading failed for want of memory or threads (``ulimit -v``), not for the part."""
    import errno

    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.EAGAIN)):
        return True
    text = str(exc)
    return "Failed to launch worker thread" in text or "Resource temporarily unavailable" in text


def _no_part_yet(calls: Path) -> str:
    """Why an addon's ``calls/`` folder that no proxy is writing into now holds no part: none ever
    started there (no lock file: a fresh checkout's ``data/captures/calls``), or the one that did
    recorded no call. Where the system does not say who holds locks (no ``/proc/locks``), a proxy
    writing into it is assumed possible."""
    from .capture.outdir import LIVE_LOCK

    lock = calls / LIVE_LOCK
    if not lock.exists():
        return ("; no capture proxy has started here (mitmdump -s addons/polar_capture.py --set polar_out=FOLDER "
                "makes FOLDER/calls/ and writes parts into it)")
    if os.access("/proc/locks", os.R_OK):  # (a proxy on another machine, over NFS, is not seen here)
        return ("; no capture proxy on this machine is writing into it, and the one that made it recorded no call "
                "(were the harness's model calls sent through it?)")
    return f"; if a capture proxy is running, {_WAIT}"


_WAIT = "it writes a part every polar_flush_seconds (10 s by default) and when it stops: wait, or stop mitmdump"


def _compact_rows(table: pa.Table, legacy_rows: Collection[int] = ()) -> int:
    """Rows with a reference to another call's prompt or text (``legacy_rows``: by the legacy columns)."""
    refs = ["prompt_prefix_call_id", *(delta_columns(c)[0] for c in COMPACT_TEXT_COLUMNS)]
    if table.num_rows == 0 or (not legacy_rows and all(table.column(c).null_count == table.num_rows for c in refs)):
        return 0
    valid = np.zeros(table.num_rows, dtype=bool)
    for c in refs:
        valid |= np.asarray(table.column(c).is_valid())
    valid[list(legacy_rows)] = True
    return int(valid.sum())


def _legacy_request_deltas(part: pq.ParquetFile, first_row: int) -> dict[int, tuple]:
    """``{row: (call id, prefix length, suffix length)}`` of a part's rows that refer to a call by
    :data:`~polar_train.schema.LEGACY_REQUEST_DELTA_COLUMNS` (only parts of 2026-12-05's fourteen
    minutes have them); ``first_row``: the part's first row in the table read."""
    found = part.read(columns=list(LEGACY_REQUEST_DELTA_COLUMNS), use_threads=False)
    refs, prefixes, suffixes = (found.column(n).cast(t).to_pylist()
                                for n, t in zip(LEGACY_REQUEST_DELTA_COLUMNS, (pa.string(), pa.int32(), pa.int32())))
    return {first_row + i: row for i, row in enumerate(zip(refs, prefixes, suffixes)) if row[0] is not None}


def _resolve_legacy_requests(table: pa.Table, legacy: dict[int, tuple], texts: list[str | None] | list[int | None],
                             problems: list[PartProblem]) -> list:
    """Every row's request text (or, given lengths, its length), where rows of 2026-12-05's
    short-lived format store the middle of it (:data:`~polar_train.schema.LEGACY_REQUEST_DELTA_COLUMNS`):
    the referred call's first ``prefix_len`` characters, the middle, its last ``suffix_len``."""
    refs = [legacy[i][0] if i in legacy else None for i in range(table.num_rows)]

    def extend(base, ref: int, j: int):
        (_, p, s), base_len = legacy[j], base if isinstance(base, int) else len(base)
        if p is None or s is None or p < 0 or s < 0 or p + s > base_len:
            raise _BadReference(f"request_json_prefix_len {p} and request_json_suffix_len {s} do not fit the "
                                f"{base_len} characters of call {refs[j]}")
        if texts[j] is None:
            raise _BadReference("request_json_prefix_call_id is set but request_json (the middle) is null")
        if isinstance(base, int):
            return p + texts[j] + s
        return base[:p] + texts[j] + base[len(base) - s:]

    return _resolve_chains(table.column("call_id").to_pylist(), refs, texts.__getitem__, extend, "request_json",
                           "request_json_prefix_call_id", "request_json prefix", problems)


def _full_schema(table: pa.Table) -> pa.Table:
    """``table`` with every call-log column, in order: those not read are null."""
    if table.num_columns == len(CALL_LOG_SCHEMA):
        return table
    return pa.table([table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
                     for f in CALL_LOG_SCHEMA], schema=CALL_LOG_SCHEMA)


def nothing_readable(folder: str | Path, problems: list[PartProblem]) -> str:
    """The line for a folder whose every part was skipped (a trajectory folder, foreign parts): an
    empty table would read as "no calls yet"."""
    from .terminal import printable

    skipped = [p for p in problems if p.call_id is None]
    more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
    return f"no readable call-log part in {folder}" + (f"; skipped {printable(str(skipped[0]))}{more}" if skipped
                                                       else "")


def read_calls(folder: str | Path) -> pa.Table:
    """All calls of a capture folder as one table (``CALL_LOG_SCHEMA``), full prompts resolved.

    Skipped parts are logged as warnings, and so is what ``inspect`` and ``build`` print as notes
    (a capture proxy still writing into the folder, calls a proxy lost); use :func:`read_call_log`
    to get the problems as data. Raises :class:`CallLogError` where no part could be read (a
    trajectory folder, say), as the commands refuse it: an empty table read as "no calls".
    """
    before = live_writers(folder, [])
    result = read_call_log(folder)
    for problem in result.problems:
        log.warning("call log: %s", problem)
    if not result.parts:
        raise CallLogError(nothing_readable(folder, result.problems))
    for note in live_notes(before, live_writers(folder, result.parts)) + loss_notes(folder, result.parts):
        log.warning("call log: %s", note)
    return result.table


def _list_values(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat values, offsets, validity) of a list<int32> column, without Python lists."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, bool)
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = np.asarray(arr.values.fill_null(0), dtype=np.int32)  # the flat buffer; ids never null
    valid = ~np.asarray(arr.is_null(), dtype=bool)
    return values, offsets, valid


def first_rows(call_ids: list[str]) -> dict[str, int]:
    """Each call id's row; a call id stored twice (a part copied by hand) is its first row, as
    inspect, build and the reader's resolution all count it."""
    index: dict[str, int] = {}
    for i, cid in enumerate(call_ids):
        index.setdefault(cid, i)
    return index


class _BadReference(ValueError):
    """A compact row's stored numbers do not fit the row it refers to (the message says how)."""


def _resolve_chains(call_ids: list[str], refs: list[str | None], stored: Callable[[int], T | None],
                    extend: Callable[[T, int, int], T], column: str, ref_column: str, what: str,
                    problems: list[PartProblem]) -> list[T | None]:
    """Every row's full value: a plain row's own (``stored``), a compact row's built by ``extend``
    (the full value of the row it refers to, that row, itself; raises :class:`_BadReference`).
    Chains resolve from their root down; a row whose reference is unknown, circular, itself
    unresolved or does not fit gets None and a problem, never a guess."""
    index = first_rows(call_ids)
    full: dict[int, T | None] = {}

    def problem(i: int, message: str) -> None:
        problems.append(call_problem(call_ids[i], message, column))

    def resolve(start: int) -> T | None:
        chain, seen, i = [], set(), start
        while i not in full:  # walk up to a resolved or plain row
            if i in seen:  # every call on the chain is unresolvable, and each is named
                for j in chain:
                    problem(j, f"circular {ref_column} chain")
                    full[j] = None
                return None
            seen.add(i)
            if refs[i] is None:
                full[i] = stored(i)
                break
            chain.append(i)
            ref = index.get(refs[i])
            if ref is None:
                problem(i, f"{what} refers to unknown call {refs[i]}")
                full[i] = None
                break
            i = ref
        for j in reversed(chain):  # resolve from the root down
            if j in full:
                continue
            base = full.get(index[refs[j]])
            if base is None:
                if index[refs[j]] not in chain or j != chain[-1]:
                    problem(j, f"{what} call {refs[j]} is itself unresolved")
                full[j] = None
                continue
            try:
                full[j] = extend(base, index[refs[j]], j)
            except _BadReference as exc:
                problem(j, str(exc))
                full[j] = None
        return full[start]

    return [resolve(i) if refs[i] is not None else stored(i) for i in range(len(call_ids))]


def resolve_compact_rows(table: pa.Table, rebuild: bool = True,
                         text_lengths: dict[str, pa.ChunkedArray] | None = None) -> tuple[pa.Table, list[PartProblem]]:
    """Expand compact rows: prompts (:func:`resolve_prompt_prefixes`) and request and response texts
    stored as deltas of another call's.

    A row with ``request_json_base_call_id`` = R stores only the new text of its request; the
    text is that interleaved with copies of blocks of R's, as ``request_json_delta`` says
    (:mod:`polar_train.text_delta`); ``response_json`` likewise. R may itself be compact. A row
    whose reference is unknown, circular or does not fit keeps a null text and is reported,
    never guessed. Without ``rebuild`` the texts are checked, not rebuilt, and come back null;
    ``text_lengths`` then stands for a text column the caller already let go (each row's length).
    """
    table, problems = resolve_prompt_prefixes(table)
    for column in COMPACT_TEXT_COLUMNS:
        lengths = (text_lengths or {}).get(column)
        table = _resolve_texts(table, column, problems, rebuild=rebuild, lengths=lengths)
    return table, problems


def resolve_prompt_prefixes(table: pa.Table) -> tuple[pa.Table, list[PartProblem]]:
    """Expand compact prompts: prefix of (prompt + completion) of another call, then the suffix.

    A row with ``prompt_prefix_call_id`` = R and ``prompt_prefix_len`` = n stores only the
    suffix; its full prompt is ``(full_prompt(R) + completion(R))[:n] + suffix``. R may itself
    be compact (chains resolve in order). Rows whose reference is unknown, circular or too
    short keep a null prompt and are reported, never guessed. (The builder needs no more than
    this: it never reads the texts.)
    """
    problems: list[PartProblem] = []
    return _resolve_prompts(table, problems), problems


def _resolve_prompts(table: pa.Table, problems: list[PartProblem]) -> pa.Table:
    if table.num_rows == 0:
        return table
    ref_col = table.column("prompt_prefix_call_id")
    if ref_col.null_count == table.num_rows:
        return table
    call_ids = table.column("call_id").to_pylist()
    refs = ref_col.to_pylist()
    lens = table.column("prompt_prefix_len").to_pylist()
    p_vals, p_offs, p_valid = _list_values(table.column("prompt_token_ids"))
    c_vals, c_offs, c_valid = _list_values(table.column("completion_token_ids"))

    def stored_prompt(i: int) -> np.ndarray:
        return p_vals[p_offs[i]:p_offs[i + 1]]

    def completion(i: int) -> np.ndarray:
        return c_vals[c_offs[i]:c_offs[i + 1]] if c_valid[i] else np.zeros(0, np.int32)

    def extend(base: np.ndarray, ref: int, j: int) -> np.ndarray:
        source = np.concatenate([base, completion(ref)])
        n = lens[j]
        if n is None or n < 0 or n > len(source):
            raise _BadReference(f"prompt_prefix_len {n} outside 0..{len(source)} of call {refs[j]}")
        if not p_valid[j]:  # a suffix the writer never leaves null (an empty one is [])
            raise _BadReference(f"its stored suffix (prompt_token_ids) is null after {n} tokens of call {refs[j]}")
        return np.concatenate([source[:n], stored_prompt(j)])

    new_prompts = _resolve_chains(call_ids, refs, lambda i: stored_prompt(i) if p_valid[i] else None, extend,
                                  "prompt_token_ids", "prompt_prefix_call_id", "prompt prefix", problems)
    lengths = np.array([0 if p is None else len(p) for p in new_prompts], dtype=np.int64)
    if lengths.sum() >= 2**31:
        raise CallLogError("resolved prompts exceed 2**31 tokens in one table: read fewer parts at once")
    offsets = np.zeros(len(new_prompts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([p for p in new_prompts if p is not None] or [np.zeros(0, np.int32)])
    mask = pa.array([p is None for p in new_prompts])
    prompts = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(np.int32)), mask=mask)
    prompts = prompts.cast(CALL_LOG_SCHEMA.field("prompt_token_ids").type)
    return _replace(table, {"prompt_token_ids": prompts, "prompt_prefix_call_id": None, "prompt_prefix_len": None})


def _prompt_lengths(table: pa.Table, problems: list[PartProblem]) -> list[int | None]:
    """Every row's full prompt length, compact rows checked against the rows they refer to as
    :func:`resolve_prompt_prefixes` checks them (the same problems), without rebuilding a prompt."""
    stored = pc.list_value_length(table.column("prompt_token_ids")).to_pylist()
    if table.num_rows == 0 or table.column("prompt_prefix_call_id").null_count == table.num_rows:
        return stored
    refs = table.column("prompt_prefix_call_id").to_pylist()
    lens = table.column("prompt_prefix_len").to_pylist()
    completion = pc.fill_null(pc.list_value_length(table.column("completion_token_ids")), 0).to_pylist()

    def extend(base: int, ref: int, j: int) -> int:
        n, source = lens[j], base + completion[ref]
        if n is None or n < 0 or n > source:
            raise _BadReference(f"prompt_prefix_len {n} outside 0..{source} of call {refs[j]}")
        if stored[j] is None:
            raise _BadReference(f"its stored suffix (prompt_token_ids) is null after {n} tokens of call {refs[j]}")
        return n + stored[j]

    return _resolve_chains(table.column("call_id").to_pylist(), refs, stored.__getitem__, extend,
                           "prompt_token_ids", "prompt_prefix_call_id", "prompt prefix", problems)


def _resolve_texts(table: pa.Table, column: str, problems: list[PartProblem], rebuild: bool = True,
                   lengths: pa.ChunkedArray | None = None) -> pa.Table:
    """``column`` (a text) whole again where rows store it as a delta of another call's. Without
    ``rebuild`` the deltas are only checked (problems reported) and the texts come back null: what
    is rebuilt grows with the square of a session's length, the check only with what is stored."""
    base_column, delta_column = delta_columns(column)
    columns: dict[str, pa.Array | None] = {base_column: None, delta_column: None}
    if not rebuild:
        columns[column] = None
    if table.num_rows == 0 or table.column(base_column).null_count == table.num_rows:
        return _replace(table, columns)
    call_ids = table.column("call_id").to_pylist()
    refs = table.column(base_column).to_pylist()
    deltas = table.column(delta_column).to_pylist()
    if rebuild:
        texts = table.column(column).to_pylist()
    else:  # lengths stand in for the texts
        texts = (lengths if lengths is not None else pc.utf8_length(table.column(column))).to_pylist()

    def extend(base: str | int, ref: int, j: int) -> str | int:
        if texts[j] is None or deltas[j] is None:
            raise _BadReference(f"{base_column} is set but {column} (the new text) or {delta_column} is null")
        try:
            if rebuild:
                return apply_text_delta(base, deltas[j], texts[j])
            return delta_length(base, deltas[j], texts[j])  # base and texts are lengths here
        except BadDelta as exc:
            raise _BadReference(f"{delta_column} over call {refs[j]}'s text: {exc}") from None

    full = _resolve_chains(call_ids, refs, texts.__getitem__, extend, column, base_column, f"{column} base", problems)
    if rebuild:
        columns[column] = pa.array(full, type=pa.string())
    return _replace(table, columns)


def _replace(table: pa.Table, columns: dict[str, pa.Array | pa.ChunkedArray | None]) -> pa.Table:
    """``table`` with these columns replaced (None: all null)."""
    for name, values in columns.items():
        field = CALL_LOG_SCHEMA.field(name)
        table = table.set_column(table.schema.get_field_index(name), field,
                                 pa.nulls(table.num_rows, field.type) if values is None else values)
    return table
