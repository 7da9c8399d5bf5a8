"""Parquet parts of the call log, written by one thread.

It runs in the row worker process (:mod:`polar_train.capture.worker`), or on a thread of the
proxy when that process cannot run. Why a thread with a bounded queue: building a row (JSON
parsing, tokenising, rendering) and Parquet encoding must not hold up whoever hands rows in; on
the proxy's side a full queue never blocks traffic (the call is dropped and counted), in the
worker process it blocks the reader (backpressure up to the proxy's own queue). Why parts with
atomic renames: a reader (pyarrow datasets, DuckDB, ``datasets``) globbing the folder never sees a
half-written file, since the part is written under a dot-name (which they skip) and
``os.replace``d when complete; a SIGKILL loses at most the rows not flushed yet, never a part.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from polar_train.capture.handoff import STOP, HandOff
from polar_train.capture.outdir import LIVE_LOCK_REFRESH_S, LiveLock, prepare_calls_dir, record_loss
from polar_train.capture.prompt_delta import PromptDeltaEncoder
from polar_train.durable import sync_folder
from polar_train.schema import CALL_LOG_SCHEMA

log = logging.getLogger("polar_capture")

Job = Callable[[], dict[str, Any] | None]

#: What a row keeps when Arrow cannot store it as built: who, when, what was sent and answered.
_KEPT_WHEN_UNSTORABLE = ("call_id", "rollout_id", "rollout_source", "task_id", "api", "method", "host", "path",
                         "model", "request_hash", "client_conn_id", "client_session_id", "started_at",
                         "first_byte_at", "finished_at", "stream", "request_json", "response_json", "token_source",
                         "finish_reason", "injected")


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The part's table. A row Arrow cannot convert (a server reported a token id or a count past
    its column's type: 2**33 in an int32 list) no longer fails the whole part, which lost every
    call flushed with it: that row is kept as a ``proxy_error`` saying why, with its identity,
    timing, request and response but none of its numbers, and the others are stored as built."""
    return checked_rows_table(rows)[0]


def checked_rows_table(rows: list[dict[str, Any]], quiet: frozenset[int] = frozenset()) -> tuple[pa.Table, set[int]]:
    """:func:`rows_table`, and the indices of the rows kept as ``proxy_error`` (not logged again
    for the indices in ``quiet``: the writer converts a part twice when a row was unstorable)."""
    try:
        return pa.Table.from_pylist(rows, schema=CALL_LOG_SCHEMA), set()
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        pass
    tables, bad = [], set()
    for i, row in enumerate(rows):
        try:
            tables.append(pa.Table.from_pylist([row], schema=CALL_LOG_SCHEMA))
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
            if i not in quiet:
                log.error("polar_capture: the row of call %s could not be stored as built (%s); it is kept as a "
                          "proxy_error without its token ids and numbers", row.get("call_id"), exc)
            bad.add(i)
            tables.append(pa.Table.from_pylist([_unstorable(row, exc)], schema=CALL_LOG_SCHEMA))
    return pa.concat_tables(tables), bad


def _unstorable(row: dict[str, Any], exc: Exception) -> dict[str, Any]:
    kept = {key: row.get(key) for key in _KEPT_WHEN_UNSTORABLE}
    note = (f"the row could not be stored as built, a value does not fit its column ({exc}); token ids, "
            "logprobs and numbers left out")
    before = row.get("error")
    kept.update(status="proxy_error", error=f"{note}; before that: {before}" if before else note)
    try:
        pa.Table.from_pylist([kept], schema=CALL_LOG_SCHEMA)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):  # not even those: the bare call
        kept = {"call_id": str(row.get("call_id")), "api": str(row.get("api")), "status": "proxy_error",
                "error": kept["error"]}
    return kept


#: While parts still cannot be written for the same reason, the log line is repeated this often.
FAILURE_REPEAT_S = 60.0


#: What rows waiting for a writable disk may hold in texts and ids (see ``max_pending_bytes``).
MAX_PENDING_BYTES = 256 << 20


#: What one number in a Python list costs (the list's slot and the int or float object).
_LIST_ITEM_BYTES = 36


def _row_bytes(row: dict[str, Any]) -> int:
    """A row's size in memory, roughly: its texts' characters, and its ids and logprobs as held -
    server ids as arrays, rendered ids and logprobs as Python lists (~9x an array's bytes)."""
    size = 0
    for key in ("request_json", "response_json"):
        text = row.get(key)
        size += len(text) if isinstance(text, str) else 0
    for key in ("prompt_token_ids", "completion_token_ids", "completion_logprobs"):
        values = row.get(key)
        if values is not None:
            size += values.nbytes if hasattr(values, "nbytes") else _LIST_ITEM_BYTES * len(values)
    return size


def _newest_within(rows: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """The newest rows whose sizes add up to ``budget`` at most (at least the newest one)."""
    total, keep = 0, 0
    for row in reversed(rows):
        total += _row_bytes(row)
        if keep and total > budget:
            break
        keep += 1
    return rows[len(rows) - keep:]


class PartWriter:
    """Buffers rows and writes ``<out>/calls/part-<UTC>-<pid>-<seq>.parquet`` every N rows / T s."""

    def __init__(self, out_dir: str | os.PathLike, flush_rows: int = 256, flush_seconds: float = 10.0,
                 queue_size: int = 1024, prompt_delta: bool = False,
                 on_written: Callable[[int], None] | None = None) -> None:
        self.calls_dir = Path(out_dir).expanduser() / "calls"
        #: Compact prompts (polar_prompt_delta): encoded when a part is written, in row order, so a
        #: reference only ever points at a row stored before (or with) the row that uses it - never
        #: at one dropped while parts could not be written, nor at one stored as a proxy_error.
        self._delta = PromptDeltaEncoder() if prompt_delta else None
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._queue = HandOff(queue_size, "part writer")
        self._rows: list[dict[str, Any]] = []
        self._first_row_at: float | None = None
        self._seq = 0
        self.written_rows = 0
        #: told the count of rows written after each part (the row worker's parent reads it)
        self._on_written = on_written
        self.failed_jobs = 0
        #: Rows kept in memory while parts cannot be written (disk full); beyond this many, or this
        #: many bytes of texts and ids, the oldest go (1,024 rows of multi-MB histories held 0.8 GB).
        self.max_pending_rows = max(4 * flush_rows, queue_size)
        self.max_pending_bytes = MAX_PENDING_BYTES
        self.lost_rows = 0
        self._retry_at = 0.0
        #: The reason parts cannot be written now (None: they can), and when it was last logged.
        self._failing: str | None = None
        self._lost_why = ""  # why rows were lost otherwise than by a write the disk refused
        self._failure_logged_at = 0.0
        self._thread: threading.Thread | None = None
        #: readers see this capture is being written (see ``outdir.LIVE_LOCK``)
        self._live_lock = LiveLock(self.calls_dir)

    def start(self, create_dir: bool = True) -> None:
        if create_dir:
            prepare_calls_dir(self.calls_dir)
        self._live_lock.refresh()
        self._thread = threading.Thread(target=self._run, name="polar-capture-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def warm_up() -> None:
        """Write an empty part to memory: pyarrow's first Parquet write spends ~0.2 s setting itself
        up; paid at start, it does not land on the first flush in the middle of traffic."""
        import io

        pq.write_table(pa.Table.from_pylist([], schema=CALL_LOG_SCHEMA), io.BytesIO(), compression="zstd")

    def submit(self, job: Job, block: bool = False) -> bool:
        """Queue a job. Without ``block`` it never blocks: False (and a counted drop) when full."""
        return self._queue.put(job, block)

    @property
    def dropped(self) -> int:
        return self._queue.dropped

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued jobs, write the last part, stop the thread."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        if self._queue.finish(deadline, self._thread):
            self._thread.join(max(0.0, deadline - time.monotonic()))
        self._thread = None
        if self.lost_rows or self.dropped or self.failed_jobs:  # said in the log; said on disk too
            record_loss(self.calls_dir, rows_lost=self.lost_rows, calls_dropped=self.dropped,
                        rows_failed=self.failed_jobs, why=self._failing or self._lost_why)
        self._live_lock.release()

    def _run(self) -> None:
        while True:
            # woken at least every LIVE_LOCK_REFRESH_S: an idle capture whose calls/ was moved
            # away to archive it let go of the archive's live lock only with its next call, so
            # inspect and build called the archive "still being written" meanwhile
            wait = LIVE_LOCK_REFRESH_S
            if self._first_row_at is not None:
                wait = min(max(0.0, self._first_row_at + self.flush_seconds - time.monotonic()), wait)
            try:
                job = self._queue.get(timeout=wait)
            except queue.Empty:
                self._live_lock.refresh()
                if self._first_row_at is not None and time.monotonic() >= self._first_row_at + self.flush_seconds:
                    self._flush()
                continue
            if job is STOP:
                self._flush(final=True)
                return
            try:
                row = job()
            except Exception:  # a bug in row building must not kill the writer
                log.exception("polar_capture: building a row failed")
                self.failed_jobs += 1
                row = None
            if row is not None:
                self._rows.append(row)
                if self._first_row_at is None:
                    self._first_row_at = time.monotonic()
            if len(self._rows) >= self.flush_rows or (
                    self._first_row_at is not None
                    and time.monotonic() - self._first_row_at >= self.flush_seconds):
                self._flush()

    def _flush(self, final: bool = False) -> None:
        if not final and time.monotonic() < self._retry_at:
            return  # the last write failed: wait a flush interval before the next attempt
        rows, self._rows, self._first_row_at = self._rows, [], None
        if not rows:
            return
        try:
            self._write_part(rows)
            if self._failing is not None:
                log.warning("polar_capture: parts can be written to %s again; the %d rows kept in memory are "
                            "written", self.calls_dir, len(rows))
                self._failing = None
        except (OSError, MemoryError) as exc:  # disk full, folder gone or read-only, memory short (pyarrow's
            # ArrowMemoryError under a memory limit): keep the rows, retry next flush
            reason = str(getattr(exc, "strerror", None) or exc or type(exc).__name__)
            if final:
                self.lost_rows += len(rows)
                self._failing = reason  # (for the loss record)
                log.error("polar_capture: cannot write a part to %s: %s; %d rows lost at shutdown",
                          self.calls_dir, reason, len(rows))
                return
            keep = _newest_within(rows[-self.max_pending_rows:], self.max_pending_bytes)
            lost = len(rows) - len(keep)
            self.lost_rows += lost  # never referred to: rows are compacted only as their part is written
            self._rows, self._first_row_at = keep + self._rows, time.monotonic()
            now = time.monotonic()
            self._retry_at = now + self.flush_seconds
            # one line when it starts, then only when something changes (another error, rows
            # dropped) or a minute has passed: not one line per retry
            if reason != self._failing or lost or now - self._failure_logged_at >= FAILURE_REPEAT_S:
                self._failing, self._failure_logged_at = reason, now
                log.error("polar_capture: cannot write a part to %s: %s; %d rows kept in memory, retrying "
                          "every %gs%s", self.calls_dir, reason, len(keep), self.flush_seconds,
                          f"; {lost} oldest rows dropped ({self.lost_rows} so far)" if lost else "")
        except Exception as exc:  # a bug of ours: the rows cannot be written as they are; counted, on disk too
            self.lost_rows += len(rows)
            self._lost_why = f"{type(exc).__name__}: {exc}"  # (not _failing: nothing is kept to retry)
            log.exception("polar_capture: writing a part of %d rows failed; they are lost", len(rows))

    #: Set in the metadata of a part written with compact prompts: a reader that opens the parts
    #: itself (DuckDB, pandas) can tell that ``prompt_token_ids`` may hold suffixes only.
    COMPACT_MARK = {b"polar_train.compact_prompts": b"true"}

    def _compacted_table(self, rows: list[dict[str, Any]]) -> pa.Table:
        """The part's table with compact prompts. The rows stay as they are (full prompts: kept for
        a retry when the part cannot be written); a row that cannot be stored is not compacted nor
        referred to, so the calls after it refer to the call before it, not to a row without ids."""
        skip: set[int] = set()
        saved = self._delta.state()
        while True:
            encoded = [row if i in skip else self._compacted(row) for i, row in enumerate(rows)]
            table, bad = checked_rows_table(encoded, quiet=frozenset(skip))
            if bad <= skip:
                return table.replace_schema_metadata({**(table.schema.metadata or {}), **self.COMPACT_MARK})
            skip |= bad
            self._delta.restore(saved)

    def _compacted(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._delta.encode(dict(row))
        except Exception:  # stored with its full prompt: this thread must not die
            log.exception("polar_capture: compacting the prompt of call %s failed; stored in full", row.get("call_id"))
            return row

    def _write_part(self, rows: list[dict[str, Any]]) -> Path:
        if self._delta is None:
            return self._write_table(rows_table(rows), len(rows))
        saved = self._delta.state()
        try:
            return self._write_table(self._compacted_table(rows), len(rows))
        except BaseException:  # not written: no later row may refer to these
            self._delta.restore(saved)
            raise

    def _write_table(self, table: pa.Table, n_rows: int) -> Path:
        self._seq += 1
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        name = f"part-{stamp}-{os.getpid()}-{self._seq:06d}.parquet"
        if not self.calls_dir.exists():
            prepare_calls_dir(self.calls_dir)  # removed (or moved away) while we ran: make it again
        self._live_lock.refresh()
        final = self.calls_dir / name
        tmp = self.calls_dir / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                # page checksums: a flipped bit in a zstd page can decode to other token ids without
                # an error; readers verify them (calllog) and name such a part instead
                pq.write_table(table, fh, compression="zstd", write_page_checksum=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        sync_folder(self.calls_dir)
        self.written_rows += n_rows
        if self._on_written is not None:
            self._on_written(self.written_rows)
        log.info("polar_capture: wrote %s (%d rows)", final, n_rows)
        return final
