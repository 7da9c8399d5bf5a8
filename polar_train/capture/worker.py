"""The row worker: builds call-log rows and writes Parquet parts in a child process.

Why a process and not a thread: mitmproxy moves every byte of every session on one event loop,
and a thread in the same interpreter shares its GIL. Reassembling a stream (a JSON parse per
event), rendering token ids and Parquet encoding cost about as much CPU as the proxy spends
forwarding the call; on a thread they slow the loop down (calls/s) and hold the GIL for up to a
switch interval (5 ms) while a request waits (time to first byte). In a child process they run on
another core and the proxy's loop only hands over bytes.

The hand-over: the event loop puts each finished :class:`~polar_train.capture.record.CallState`
(raw request body, raw stream bytes, timestamps) into a bounded queue and never blocks - a full
queue drops the call and counts it. A sender thread pickles the states and writes them as
length-prefixed frames to the child's stdin. The child (``python -m polar_train.capture.worker``)
feeds them to a :class:`~polar_train.capture.writer.PartWriter`. It ignores SIGINT/SIGTERM, so a
Ctrl-C or a signal to the process group reaches the proxy, whose ``done`` hook then closes the
worker in order; when the proxy dies without that (SIGKILL), the child reads end-of-file, writes
what it holds and exits.

If the child cannot start or keeps dying, the proxy falls back to an in-process writer thread
(logged): capture slows down but never stops.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import gc
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from .handoff import STOP, HandOff
from .options import CaptureOptions
from .outdir import LIVE_LOCK_REFRESH_S, LOSS_RECORD_GLOB, LiveLock, prepare_calls_dir, record_loss

log = logging.getLogger("polar_capture")

_HEADER = struct.Struct("!Q")
#: A child that exits within this many seconds of its start counts as failing to start.
_EARLY_EXIT_S = 5.0
_MAX_EARLY_EXITS = 2


def write_frame(out: BinaryIO, payload: bytes | memoryview) -> None:
    out.write(_HEADER.pack(len(payload)))
    out.write(payload)


#: A call's byte strings that travel beside its pickle (out of band) rather than in it: pickling a
#: Codex-sized call's ~250 KB in band held the proxy's GIL 28-195 us (the pickler grows its output
#: by copying, and the allocator may hand it fresh pages); out of band it takes ~1 us and the pipe
#: write reads them where they lie.
_OUT_OF_BAND = ("request_body", "stream_raw")


def call_frames(state: Any) -> list[bytes | memoryview]:
    """A finished call as the frames the child reads (:func:`read_call`): its pickle, led by the
    number of out-of-band byte strings that follow it, then those."""
    light = copy.copy(state)  # the proxy's own state is not touched from this thread
    for name in _OUT_OF_BAND:
        value = getattr(light, name, None)
        if value:  # a bytearray is frozen first (one memcpy): a view of it would pin its size
            setattr(light, name, pickle.PickleBuffer(bytes(value) if isinstance(value, bytearray) else value))
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(light, protocol=5, buffer_callback=buffers.append)
    return [bytes((len(buffers),)) + payload, *(b.raw() for b in buffers)]


def read_call(inp: BinaryIO) -> tuple[bytes, list[bytes]] | None:
    """The frames of one call (its pickle, its out-of-band byte strings), or None at end of file
    (also for a call cut short by a dying parent)."""
    head = read_frame(inp)
    if not head:
        return None
    buffers = [read_frame(inp) for _ in range(head[0])]
    return (head[1:], buffers) if None not in buffers else None


def read_frame(inp: BinaryIO) -> bytes | None:
    """One frame, or None at end of file (also for a frame cut short by a dying parent)."""
    head = inp.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    payload = inp.read(size)
    return payload if len(payload) == size else None


def _package_root() -> str:
    """The folder that holds the ``polar_train`` package (the child imports it from there too)."""
    return str(Path(__file__).resolve().parents[2])


#: How long a shutdown waits for the row worker before it says it is waiting (seconds).
CLOSE_NOTICE_S = 2.0


class RowWorker:
    """The proxy side of the row worker: non-blocking ``submit``, orderly ``close``.

    ``dropped`` counts calls refused because the queue was full; ``sent`` the calls handed over.
    """

    def __init__(self, opts: CaptureOptions, log_level: int = logging.INFO) -> None:
        self.opts = opts
        self.log_level = log_level
        self._queue = HandOff(opts.queue_size, "row worker")
        self._proc: subprocess.Popen | None = None
        self._proc_started = 0.0
        self._early_exits = 0
        self._fallback = None  # a PartWriter thread, when the child cannot run
        self._retry_child_at: float | None = None  # the child could not start for want of fds/memory
        self._sent_to_child = 0  # calls the running child was handed (what a death may take with it)
        self._proc_started_wall = 0.0
        #: An unlinked file the running child writes its count of rows written into (8 bytes): its
        #: parts may have moved away (calls/ archived) when it dies, and were counted as lost.
        self._progress: BinaryIO | None = None
        self._earlier_writers: list[int] = []  # pids of this proxy's writers before the running one
        self._fallback_renderer = None
        self._fallback_attempts = None
        self._thread: threading.Thread | None = None
        self._pending: list[Any] = []  # finished calls waiting for the hand-off timer (event loop only)
        self._closing = False
        self.sent = 0
        self._live_lock = None

    # -- proxy side (event loop) ----------------------------------------------------------------
    def start(self) -> None:
        """Create the output folder (errors surface as option errors) and the sender thread; the
        child starts with the first call (a proxy reconfigured before any traffic starts none)."""
        calls_dir = Path(self.opts.out).expanduser() / "calls"
        prepare_calls_dir(calls_dir)
        # held by the proxy from its start (the child, which starts later, holds it too): readers
        # see the capture is live while calls are in flight, before any row is written
        self._live_lock = LiveLock(calls_dir)
        self._live_lock.refresh()
        self._thread = threading.Thread(target=self._send_loop, name="polar-capture-sender", daemon=True)
        self._thread.start()

    def submit(self, state: Any) -> bool:
        """Queue a finished call; never blocks. False (and a counted drop) when the queue is full
        (a call that waits for the timer is counted when it is queued).

        On the event loop, calls are queued in batches ``handoff_ms`` after the first of them
        ended (one timer per batch). Why: a call ends when its last byte went out, and a harness
        (or a benchmark client) often sends its next request at once; waking the sender thread
        right then - it takes the GIL to pickle, the child parses on the other core - delayed that
        request's first byte (chat, concurrency 1: TTFB addon/bare 1.13 handing over at once, 1.06
        with the hand-off moved 50 ms later; bench/README.md)."""
        if self.opts.handoff_ms and not self._closing:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None  # not on an event loop: at once
            if loop is not None:
                self._pending.append(state)
                if len(self._pending) == 1:
                    loop.call_later(self.opts.handoff_ms / 1000, self._release)
                return True
        return self._queue.put(state)

    def _release(self) -> None:
        pending, self._pending = self._pending, []
        for state in pending:
            self._queue.put(state)

    @property
    def dropped(self) -> int:
        return self._queue.dropped

    def close(self, timeout: float = 60.0) -> None:
        """Hand over what is queued, let the child write its last part, wait for it."""
        try:
            self._close(timeout)
            if self.dropped:  # (the proxy's own queue: the child never saw these calls)
                record_loss(Path(self.opts.out).expanduser() / "calls", calls_dropped=self.dropped,
                            why="row worker queue full")
        finally:
            if self._live_lock is not None:
                self._live_lock.release()

    def _close(self, timeout: float) -> None:
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        self._closing = True
        self._release()  # what waits for the timer goes now
        if not self._queue.finish(deadline, self._thread):
            return
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._thread = None
        proc = self._proc
        if proc is not None:
            try:
                try:
                    proc.wait(min(CLOSE_NOTICE_S, max(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:  # said, not a silent minute (a second Ctrl-C waits too)
                    log.warning("polar_capture: waiting up to %.0fs more for the row worker to write the calls "
                                "it was handed", max(0.0, deadline - time.monotonic()))
                    proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("polar_capture: row worker did not finish within %gs; stopping it", timeout)
                proc.kill()
                proc.wait()
            if proc.returncode not in (0, None):
                lost = self._record_child_loss(proc.pid, proc.returncode)
                log.error("polar_capture: row worker exited with code %s; %d call(s) it had not written are lost",
                          proc.returncode, lost)
            _rows_written(self._progress)  # (closes it)
            self._progress = None
        if self._fallback is not None:
            self._fallback.close(max(1.0, deadline - time.monotonic()))

    # -- sender thread ---------------------------------------------------------------------------
    def _spawn(self) -> None:
        env = dict(os.environ)
        root = _package_root()
        if root in sys.path:  # found through sys.path (a checkout the addon put there): so must the child
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        progress = _progress_file()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "polar_train.capture.worker"], stdin=subprocess.PIPE, env=env,
                start_new_session=True, close_fds=True, pass_fds=(progress.fileno(),) if progress else ())
        except BaseException:
            if progress is not None:
                progress.close()
            raise
        self._progress = progress
        self._proc_started = time.monotonic()
        self._proc_started_wall = time.time()
        self._sent_to_child = 0
        try:
            write_frame(self._proc.stdin, pickle.dumps(
                (self.opts, self.log_level, self._earlier_writers, progress.fileno() if progress else None),
                protocol=5))
            self._proc.stdin.flush()
        except OSError:  # it died at once: not left behind when the start is tried again
            proc, self._proc = self._proc, None
            proc.kill()
            proc.wait()
            _rows_written(self._progress)  # (closes it)
            self._progress = None
            raise

    def _send(self, state: Any) -> None:
        """Write one call to the child (started on first use); a dead child is replaced, and one
        that cannot run at all makes way for an in-process writer thread."""
        if self._live_lock is not None:
            self._live_lock.refresh()  # (calls/ moved away to archive it: the new one is the live one)
        if self._fallback is not None and self._retry_child_at is not None and time.monotonic() >= self._retry_child_at:
            self._retry_child()
        frames = call_frames(state) if self._fallback is None else []
        while self._fallback is None:
            if self._proc is None:
                try:
                    self._spawn_when_it_can()
                except OSError as exc:
                    self._start_fallback(f"cannot start {sys.executable}: {exc}")
                    if exc.errno in _SHORT_OF:  # fds or memory may come back: the child is tried again later
                        self._retry_child_at = time.monotonic() + _CHILD_RETRY_S
                    break
            try:
                for frame in frames:
                    write_frame(self._proc.stdin, frame)
                if self._queue.empty():
                    self._proc.stdin.flush()
                self.sent += 1
                self._sent_to_child += 1
                return
            except (OSError, ValueError):  # BrokenPipeError: the child is gone
                self._reap_child()
        self._fallback.submit(_fallback_job(state, self._fallback_renderer, self.opts, self._fallback_attempts))

    def _spawn_when_it_can(self) -> None:
        """Start the child; a start refused for want of file descriptors or memory (many streams
        open at once under a low ``ulimit -n``) is tried again for a few seconds, on this thread,
        before the proxy builds rows itself (the queue holds the calls meanwhile)."""
        for wait in (*_SPAWN_WAITS, None):
            try:
                self._spawn()
                return
            except OSError as exc:
                if wait is None or exc.errno not in _SHORT_OF:
                    raise
                time.sleep(wait)

    def _retry_child(self) -> None:
        """Rows are built on the proxy's thread since the child could not start for want of fds or
        memory: try the child again, and go back to it if it starts. The thread's writer is closed
        first (its rows written, its thread and files let go: fds were what was short), so that the
        child numbers attempts on from its rows; if the child still cannot start, a new thread
        writer takes over, numbering on the same way."""
        fallback, self._fallback = self._fallback, None
        fallback.close()
        if os.getpid() not in self._earlier_writers:
            self._earlier_writers.append(os.getpid())
        try:
            self._spawn()
        except OSError as exc:
            self._start_fallback(f"cannot start {sys.executable}: {exc}", quiet=True)
            self._retry_child_at = time.monotonic() + _CHILD_RETRY_S
            return
        log.warning("polar_capture: the row worker process runs again; rows are built there from now on")
        self._retry_child_at = None

    def _record_child_loss(self, pid: int, code: int | None) -> int:
        """Calls the dead child was handed and did not write (handed minus the rows of its parts),
        written down as a loss record: its death was in the log only, and inspect/build then said
        the proxy "recorded no call"."""
        out = Path(self.opts.out).expanduser()
        handed, self._sent_to_child = self._sent_to_child, 0
        progress, self._progress = self._progress, None
        written = _rows_written(progress)
        lost = handed - _rows_accounted_for(out, pid, self._proc_started_wall, written)
        if lost > 0:
            record_loss(out / "calls", calls_lost=lost,
                        why=f"the row worker process {pid} exited with code {code} before writing them")
        return max(lost, 0)

    def _reap_child(self) -> None:
        """The child has exited (or its pipe broke): say so; the next call starts a new one."""
        proc, self._proc = self._proc, None
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        lost = self._record_child_loss(proc.pid, code)
        self._earlier_writers.append(proc.pid)  # the next writer numbers attempts on from its rows
        early = time.monotonic() - self._proc_started < _EARLY_EXIT_S
        self._early_exits = self._early_exits + 1 if early else 0
        if self._early_exits >= _MAX_EARLY_EXITS:
            self._start_fallback(f"it exited with code {code} right after starting, twice")
        else:
            log.error("polar_capture: the row worker process exited (code %s); %d call(s) it had not written "
                      "are lost%s; a new one starts with the next call", code, lost,
                      " (a loss record in calls/ says so)" if lost else "")

    def _start_fallback(self, why: str, quiet: bool = False) -> None:
        if self._fallback is not None:  # (never two at once: the one running is kept)
            return
        from .record import AttemptCounter
        from .render import Renderer
        from .writer import PartWriter

        if not quiet:  # (said once: not again at each failed retry of the child)
            log.error("polar_capture: the row worker process cannot run (%s); building rows on a thread "
                      "of the proxy instead (slower; nothing is lost)", why)
        o = self.opts
        if self._fallback_renderer is None and o.tokenizer:  # (kept across a retry of the child: seconds to load)
            self._fallback_renderer = Renderer(o.tokenizer)
        self._fallback_attempts = seeded_attempts(AttemptCounter(), o.out, self._earlier_writers)
        fallback = PartWriter(o.out, o.flush_rows, o.flush_seconds, o.queue_size, prompt_delta=o.prompt_delta)
        fallback.start(create_dir=False)
        self._proc = None
        self._fallback = fallback

    def _check_child(self) -> None:
        """Notice a child that died between calls (not only at the next write)."""
        if self._proc is not None and self._proc.poll() is not None:
            self._reap_child()

    def _send_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=LIVE_LOCK_REFRESH_S)
            except queue.Empty:
                try:
                    self._check_child()
                    self._live_lock.refresh()  # (idle: calls/ may have been moved away to archive it)
                except Exception:
                    log.exception("polar_capture: checking the row worker process failed")
                continue
            if item is STOP:
                break
            try:
                self._send(item)  # flushes the pipe once the queue is empty: once per batch
            except Exception:
                log.exception("polar_capture: handing a call to the row worker failed")
        if self._fallback is None and self._proc is not None:
            try:
                self._proc.stdin.close()  # end of file: the child writes its last part and exits
            except OSError:
                pass


#: Why a child could not start that may pass: file descriptors (EMFILE, ENFILE) or memory (ENOMEM,
#: EAGAIN from fork) short for a moment. Tried again after these waits (seconds), then every
#: ``_CHILD_RETRY_S`` while rows are built on the proxy's thread.
_SHORT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})
_SPAWN_WAITS = (0.25, 0.5, 1.0, 2.0)
_CHILD_RETRY_S = 60.0


def _parts_of(out: Path, pid: int):
    """The parts a writer process wrote anywhere under ``out`` (their names carry its pid)."""
    return out.rglob(f"part-*-{pid}-*.parquet")


def seeded_attempts(attempts: Any, out: str | os.PathLike, pids: list[int]) -> Any:
    """``attempts`` having counted the calls this proxy's earlier writers (``pids``: a row worker
    killed, the proxy's own thread) wrote under ``out``, in the order they finished: a retry sent
    after the writer was replaced is then numbered 2, as by one writer. Without it a one-call
    session's retry, numbered 1 again, was taken by the build for the same task run again."""
    if not pids:
        return attempts
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for pid in dict.fromkeys(pids):
        for part in _parts_of(Path(out).expanduser(), pid):
            try:
                tables.append(pq.read_table(part, columns=["rollout_id", "api", "request_hash", "finished_at"]))
            except Exception:  # noqa: BLE001 - unreadable or moved away: not counted
                pass
    if not tables:
        return attempts
    seen = pa.concat_tables(tables, promote_options="permissive").sort_by("finished_at").to_pydict()
    for rollout_id, api, request_hash in zip(seen["rollout_id"], seen["api"], seen["request_hash"]):
        if request_hash is not None:
            attempts.next(rollout_id, request_hash, api or "")
    return attempts


def _progress_file() -> BinaryIO | None:
    """The file a row worker counts its written rows in (unlinked: nothing is left behind), or
    None where none can be made (the parts on disk are counted then)."""
    import tempfile

    try:
        f = tempfile.TemporaryFile(prefix="polar-capture-progress-")
        f.write(struct.pack("<q", -1))  # until the child says 0: one that never took the file (an older one)
        f.flush()
        return f
    except OSError:
        return None


def _rows_written(progress: BinaryIO | None) -> int | None:
    """The count the child wrote into ``progress`` (closed here), or None where there is none."""
    if progress is None:
        return None
    try:
        data = os.pread(progress.fileno(), 8, 0)
        count = struct.unpack("<q", data)[0] if len(data) == 8 else -1
        return count if count >= 0 else None
    except OSError:
        return None
    finally:
        progress.close()


def report_rows_written(fd: int | None, rows: int) -> None:
    """The child's side of :func:`_rows_written`: the count so far, in place (one 8-byte write)."""
    if fd is not None:
        try:
            os.pwrite(fd, struct.pack("<q", rows), 0)
        except OSError:
            pass


def _rows_accounted_for(out: Path, pid: int, since: float, written: int | None = None) -> int:
    """Rows a row worker process wrote - ``written``, the count it kept itself (its parts may have
    been archived elsewhere), or its parts (named with its pid, written since it started: not an
    earlier process's that had the same pid) found under ``out`` from their footers, whichever is
    more (a part renamed into place just before a SIGKILL, not yet counted) - plus the rows its own
    loss records say it could not write (counted there already)."""
    import json

    import pyarrow.parquet as pq

    rows = 0
    for part in _parts_of(out, pid):
        try:
            if part.stat().st_mtime >= since - 1:
                rows += pq.read_metadata(part).num_rows
        except Exception:  # noqa: BLE001 - a part moved away or unreadable: not counted as written
            pass
    lost = 0
    for record in out.rglob(LOSS_RECORD_GLOB):
        try:
            data = json.loads(record.read_text())
            if data.get("pid") == pid:
                lost += sum(n for k in ("rows_lost", "rows_failed") if isinstance(n := data.get(k), int))
        except Exception:  # noqa: BLE001 - an unreadable record: nothing to subtract
            pass
    return max(rows, written or 0) + lost


def build_call_row(state: Any, renderer: Any, opts: CaptureOptions, attempts: Any) -> dict[str, Any]:
    """A finished call's row: its identity first (from the header fields the proxy kept), then
    :func:`~polar_train.capture.record.build_row`. Never raises for bad input: a call whose
    headers cannot be read keeps its row, as a ``proxy_error`` without identity."""
    from .record import build_row, fallback_row, resolve_head

    try:
        resolve_head(state, opts.rollout_header, opts.task_header, opts.port_rollouts)
    except Exception as exc:
        log.exception("polar_capture: reading the headers of %s failed", state.call_id)
        state.fail("proxy_error", f"reading the request headers failed: {exc!r}")
    try:
        return build_row(state, renderer, opts.tokenize_check, opts.tokenize_url, attempts, opts.tokenize_insecure)
    except Exception as exc:  # a bug of ours: the call keeps a row saying so
        log.exception("polar_capture: building the row of %s failed", getattr(state, "call_id", "?"))
        return fallback_row(state, exc)


def _fallback_job(state: Any, renderer: Any, opts: CaptureOptions, attempts: Any):
    return lambda: build_call_row(state, renderer, opts, attempts)


# -- child process ------------------------------------------------------------------------------
def _preload(renderer: Any) -> None:
    """Load the tokenizer, then freeze what it left (as main() froze the imports before it)."""
    renderer.preload()
    gc.freeze()


def main() -> int:
    """``python -m polar_train.capture.worker``: frames on stdin -> rows -> Parquet parts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the proxy decides when this process ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inp = sys.stdin.buffer
    first = read_frame(inp)
    if first is None:
        return 0
    opts, level, *rest = pickle.loads(first)
    earlier_writers = rest[0] if rest else []
    progress_fd = rest[1] if len(rest) > 1 else None
    report_rows_written(progress_fd, 0)  # (the parent reads -1 as "no count kept": it counts the parts)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s.%(msecs)03d] %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    from ..terminal import one_line_records

    one_line_records(log)
    log.setLevel(level)
    log.propagate = False

    from .record import AttemptCounter
    from .render import Renderer
    from .writer import PartWriter

    writer = PartWriter(opts.out, opts.flush_rows, opts.flush_seconds, opts.queue_size,
                        prompt_delta=opts.prompt_delta,
                        on_written=lambda rows: report_rows_written(progress_fd, rows))
    writer.start(create_dir=False)  # the proxy created it; if it is gone, each write tries again
    writer.submit(PartWriter.warm_up, block=True)
    renderer = Renderer(opts.tokenizer) if opts.tokenizer else None
    # used by the writer's thread only, in the order calls arrive; numbered on from this proxy's
    # earlier writers (a worker replaced mid-session numbered the retry of a call it never saw 1)
    attempts = seeded_attempts(AttemptCounter(), opts.out, earlier_writers)
    if renderer is not None:
        # loaded beside the writer, not on its thread: 4-12 s here, during which calls with the
        # server's ids would otherwise wait unwritten (a SIGKILL then lost all of them); a call
        # that needs rendering waits for it on the renderer's lock
        threading.Thread(target=_preload, args=(renderer,), name="polar-capture-tokenizer", daemon=True).start()
    gc.freeze()  # what the imports left (pyarrow, the tokenizer): never walked again by the cyclic GC
    while (call := read_call(inp)) is not None:
        try:
            state = pickle.loads(call[0], buffers=call[1])
        except Exception:
            log.exception("polar_capture: row worker got a call it cannot read")
            continue
        writer.submit(lambda state=state: build_call_row(state, renderer, opts, attempts), block=True)
    writer.close(timeout=3600)
    if writer.failed_jobs or writer.lost_rows:
        log.error("polar_capture: row worker finished: %d rows written, %d failed, %d lost",
                  writer.written_rows, writer.failed_jobs, writer.lost_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
