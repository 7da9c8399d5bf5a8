"""The row worker process (``polar_train.capture.worker``) through the real ``mitmdump`` + addon.

What must hold: rows are built and written by a child process (the proxy's own process never loads
pyarrow), a worker killed from outside is replaced and the calls after it are recorded, a worker
that cannot start at all gives way to an in-process writer thread, and a SIGKILL of the proxy does
not take the rows already handed to the worker with it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from tests.support.capture_faults import fault_upstream
from tests.support.mitm import no_addon_traceback, poll, proxy_client, rid, rows_of, start_mitm

pytestmark = pytest.mark.timeout(240)

OK = {"model": "ok", "messages": [{"role": "user", "content": "hi"}]}


def _calls(m, base: str, rollout: str, n: int, stream: bool = False) -> None:
    with proxy_client(m, rollout) as c:
        for _ in range(n):
            body = dict(OK, model="ok-stream", stream=True) if stream else OK
            assert c.post(base + "/v1/chat/completions", json=body).status_code == 200


def _worker(m) -> psutil.Process:
    return poll(lambda: next(iter(psutil.Process(m.proc.pid).children()), None), 30, "the row worker process")


def _part_pids(out_dir: Path) -> set[int]:
    return {int(re.match(r"part-\w+-(\d+)-\d+\.parquet", p.name).group(1))
            for p in (out_dir / "calls").glob("part-*.parquet")}


def test_rows_are_written_by_a_child_process_and_the_proxy_never_loads_pyarrow(tmp_path: Path) -> None:
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2"})
        try:
            r = rid()
            _calls(m, base, r, 2)
            _calls(m, base, r, 2, stream=True)
            poll(lambda: len(rows_of(m.out_dir, r)) == 4, 30, "4 rows")
            worker = _worker(m)
            assert _part_pids(m.out_dir) == {worker.pid} != {m.proc.pid}
            maps = Path(f"/proc/{m.proc.pid}/maps").read_text()
            assert "arrow" not in maps  # Parquet encoding happens elsewhere
            assert all(row["status"] == "ok" for row in rows_of(m.out_dir, r))
        finally:
            m.stop()
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert no_addon_traceback(m.proc.log())


def test_a_killed_worker_is_replaced_and_later_calls_are_recorded(tmp_path: Path) -> None:
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2"})
        try:
            before = rid()
            _calls(m, base, before, 2)
            poll(lambda: len(rows_of(m.out_dir, before)) == 2, 30, "rows before the kill")
            first = _worker(m)
            first.kill()
            first.wait(10)
            poll(lambda: "row worker process exited" in m.proc.log(), 30, "a log line about the dead worker")
            after = rid()
            _calls(m, base, after, 3, stream=True)
            poll(lambda: len(rows_of(m.out_dir, after)) == 3, 30, "rows after the kill")
            second = _worker(m)
            assert second.pid != first.pid
        finally:
            m.stop()
        assert no_addon_traceback(m.proc.log())


#: Imported at the start of each Python process of the test's proxy (sitecustomize): the row
#: worker's tokenizer load waits until the test writes to a FIFO.
_HOLD_TOKENIZER = """
import os
import polar_train.tokenizer as tokenizer

_load = tokenizer.load_tokenizer


def held(path):
    with open(os.environ["POLAR_TEST_HOLD_TOKENIZER"]) as fifo:
        fifo.read()
    return _load(path)


tokenizer.load_tokenizer = held
"""


def test_calls_with_the_servers_ids_are_written_while_the_tokenizer_loads(tmp_path: Path, tiny_model_dir: Path,
                                                                          monkeypatch) -> None:
    """The tokenizer (4-12 s to load here) was loaded on the writer's thread before any row: a
    SIGKILL in that time lost every call, also those that need no rendering. Here the load is held
    as long as the test likes, and the row of a call with the server's ids still comes."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOLD_TOKENIZER)
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("POLAR_TEST_HOLD_TOKENIZER", str(gate))
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, tokenizer=tiny_model_dir, options={"polar_flush_seconds": "0.2"})
        try:
            r = rid()
            with proxy_client(m, r) as c:
                assert c.post(base + "/v1/chat/completions", json=dict(OK, model="ok-ids")).status_code == 200
            (row,) = poll(lambda: rows_of(m.out_dir, r), 30, "the row, while the tokenizer load is held")
            assert row["status"] == "ok" and row["token_source"] == "server" and row["prompt_token_ids"] == [1, 2, 3]
            rendered = rid()  # a call that needs the tokenizer waits for it, and is rendered then
            with proxy_client(m, rendered) as c:
                assert c.post(base + "/v1/chat/completions", json=OK).status_code == 200
            os.close(os.open(gate, os.O_WRONLY))  # the worker holds it open for reading: release it
            (row,) = poll(lambda: rows_of(m.out_dir, rendered), 60, "the rendered row, once loaded")
            assert row["token_source"] == "rendered" and row["prompt_token_ids"]
        finally:
            try:  # never leave the worker blocked
                os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # nobody has it open for reading
            m.stop()


def test_sigkill_of_the_proxy_leaves_the_worker_to_write_what_it_holds(tmp_path: Path) -> None:
    """Rows already handed over are written although the proxy dies before any flush is due."""
    with fault_upstream() as (base, _):
        # handed over at once (polar_handoff_ms=0), so each call reaches the worker as it ends
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "3600", "polar_flush_rows": 100000,
                                          "polar_handoff_ms": 0})
        r = rid()
        try:
            _calls(m, base, r, 5)  # each call is queued for the worker before its response goes out
            worker = _worker(m)
        finally:
            m.stop(signal.SIGKILL)  # the whole process group: the worker lives in a session of its own
        worker.wait(30)  # it read end of file, wrote its part and exited
        rows = rows_of(m.out_dir, r)
        assert len(rows) == 5 and all(row["status"] == "ok" for row in rows)


def _load_addon():
    spec = importlib.util.spec_from_file_location(
        "polar_capture_worker_test", Path(__file__).resolve().parents[1] / "addons" / "polar_capture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_worker_that_cannot_start_gives_way_to_a_thread(tmp_path: Path, monkeypatch, caplog) -> None:
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import taddons, tflow, tutils

    mod = _load_addon()
    addon = mod.PolarCapture()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with taddons.context(addon) as tctx:
        try:
            tctx.configure(addon, polar_out=str(tmp_path), polar_inject=False)
            for i in range(3):
                f = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions",
                                                content=json.dumps(dict(OK, model=f"m{i}")).encode()), resp=False)
                addon.requestheaders(f)
                asyncio.run(addon.request(f))
                f.response = Response.make(200, json.dumps({"choices": []}).encode(),
                                           Headers(content_type="application/json"))
                addon.responseheaders(f)
                asyncio.run(addon.response(f))
            addon.done()
        finally:
            tctx.master._legacy_log_events.uninstall()
    rows = [r for p in (tmp_path / "calls").glob("part-*.parquet") for r in pq.read_table(p).to_pylist()]
    assert sorted(r["model"] for r in rows) == ["m0", "m1", "m2"]
    assert _part_pids(tmp_path) == {os.getpid()}  # written by the thread, in this process
    assert "row worker process cannot run" in caplog.text


def test_calls_wait_for_the_hand_off_timer_and_closing_sends_them_at_once(tmp_path: Path) -> None:
    """On the event loop, finished calls wait ``polar_handoff_ms`` before they are queued for the
    worker; a shutdown does not wait for the timer and hands over every one (here the wait is ten
    minutes). Off the event loop a call is queued at once."""
    from polar_train.capture.options import CaptureOptions
    from polar_train.capture.record import CallState, utcnow
    from polar_train.capture.worker import RowWorker

    def state(r: str) -> CallState:
        s = CallState("openai.chat", "POST", "h", "/v1/chat/completions", "c", None, utcnow(), "http://h")
        s.header_fields = [(b"x-polar-rollout", r.encode())]
        s.request_body = json.dumps(OK).encode()
        s.http_status, s.response_body, s.finished_at = 500, b'{"error": "x"}', utcnow()
        return s

    worker = RowWorker(CaptureOptions(out=str(tmp_path), flush_seconds=3600.0, handoff_ms=600_000))
    worker.start()
    direct, batched = rid(), rid()
    assert worker.submit(state(direct))
    poll(lambda: worker.sent == 1, 30, "the call submitted off the event loop to be sent")

    async def proxy_side() -> None:
        for _ in range(3):
            assert worker.submit(state(batched))
        assert worker.sent == 1 and worker._queue.empty()  # waiting for the timer
        worker.close(timeout=60)

    asyncio.run(proxy_side())
    assert len(rows_of(tmp_path, direct)) == 1 and worker.sent == 4
    rows = rows_of(tmp_path, batched)
    assert len(rows) == 3 and all(row["status"] == "upstream_error" for row in rows)


def test_a_call_crosses_the_pipe_with_its_byte_strings_out_of_band() -> None:
    """The pickle frame stays small whatever a call holds (its body and stream follow it as they
    are); the child gets every field back, the proxy's own state is left as it was, and a call cut
    short by a dying parent is no call."""
    import dataclasses
    import io
    import pickle
    from datetime import datetime, timezone

    from polar_train.capture.record import CallState
    from polar_train.capture.worker import call_frames, read_call, write_frame

    def call(body: bytes, stream: bytearray | None) -> CallState:
        state = CallState(api="openai.responses", method="POST", host="127.0.0.1", path="/v1/responses",
                          client_conn_id="c1", identity=None, started_at=datetime.now(timezone.utc),
                          upstream_base="http://127.0.0.1:8000", request_body=body, asked={"logprobs": False})
        state.stream_raw, state.streamed = stream, stream is not None
        return state

    big = call(b'{"input":"' + b"x" * 200_000 + b'"}', bytearray(b"event: e\ndata: {}\n\n" * 10_000))
    small = call(b"", None)
    frames = call_frames(big)
    assert len(frames) == 3 and len(frames[0]) < 2048
    assert isinstance(big.stream_raw, bytearray) and big.request_body.startswith(b'{"input"')
    pipe = io.BytesIO()
    for frame in [*frames, *call_frames(small)]:
        write_frame(pipe, frame)
    data = pipe.getvalue()

    pipe = io.BytesIO(data)
    for sent in (big, small):
        head, buffers = read_call(pipe)
        got = pickle.loads(head, buffers=buffers)
        for f in dataclasses.fields(CallState):
            want, have = getattr(sent, f.name), getattr(got, f.name)
            assert (bytes(have) if isinstance(have, (bytes, bytearray)) else have) == \
                (bytes(want) if isinstance(want, (bytes, bytearray)) else want), f.name
    assert read_call(pipe) is None
    cut = io.BytesIO(data[:len(data) - len(data) // 3])  # inside the first call's stream
    assert read_call(cut) is None
    growing = call(b"{}", bytearray(b"data: {}\n\n"))
    frames = call_frames(growing)  # still held by the sender while the proxy's stream may grow
    growing.stream_raw += b"data: {}\n\n"  # no view pins its size (BufferError otherwise)
    assert bytes(frames[-1]) == b"data: {}\n\n"


def _call_through(addon, model: str, rollout: str | None = None) -> None:
    """One finished chat call through the addon's hooks (mitmproxy's own test flows)."""
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import tflow, tutils

    f = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions",
                                    content=json.dumps(dict(OK, model=model)).encode()), resp=False)
    if rollout is not None:
        f.request.headers["x-polar-rollout"] = rollout
    addon.requestheaders(f)
    asyncio.run(addon.request(f))
    f.response = Response.make(200, json.dumps({"choices": []}).encode(), Headers(content_type="application/json"))
    addon.responseheaders(f)
    asyncio.run(addon.response(f))


def test_calls_a_dead_worker_took_with_it_are_written_down(tmp_path: Path) -> None:
    """A row worker killed (the OOM killer) while it held calls not yet written: the proxy logged
    it, and inspect/build later said the capture "recorded no call" - nothing on disk said 3 were
    lost. Handed minus written (its parts' rows) is now a loss record."""
    from mitmproxy.test import taddons

    from polar_train.calllog import loss_notes

    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        try:
            tctx.configure(addon, polar_out=str(tmp_path), polar_inject=False, polar_handoff_ms=0,
                           polar_flush_seconds="3600")
            for i in range(3):
                _call_through(addon, f"m{i}")
            poll(lambda: addon.writer.sent == 3, 30, "3 calls handed to the row worker")
            child = addon.writer._proc  # killed, and reaped by the proxy (its Popen), as the OOM killer's victim
            os.kill(child.pid, signal.SIGKILL)
            poll(lambda: list((tmp_path / "calls").glob("_losses-*.json")), 30, "a loss record")
            _call_through(addon, "after")  # a new worker takes the next call
            addon.done()
        finally:
            tctx.master._legacy_log_events.uninstall()
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "calls").glob("_losses-*.json")]
    assert record["calls_lost"] == 3 and record["why"] == (
        f"the row worker process {child.pid} exited with code -9 before writing them")
    assert "lost 3 call(s) the row worker process had not written when it died" in loss_notes(tmp_path, [])[0]
    rows = [r for p in (tmp_path / "calls").glob("part-*.parquet") for r in pq.read_table(p).to_pylist()]
    assert [r["model"] for r in rows] == ["after"]


def test_a_worker_short_of_file_descriptors_for_a_moment_still_starts(tmp_path: Path, monkeypatch, caplog) -> None:
    """``ulimit -n`` reached while many streams were open: the first start of the row worker failed
    with EMFILE and rows were built on the proxy's own thread for the rest of its life. Such a start
    is tried again, and a proxy that had to fall back goes back to a child once one starts."""
    import errno

    from mitmproxy.test import taddons

    from polar_train.capture import worker

    monkeypatch.setattr(worker, "_SPAWN_WAITS", (0.0, 0.0))
    real_spawn, refusals = worker.RowWorker._spawn, []

    def spawn(self):
        if refusals and refusals.pop():
            raise OSError(errno.EMFILE, "Too many open files")
        real_spawn(self)

    monkeypatch.setattr(worker.RowWorker, "_spawn", spawn)
    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        try:
            tctx.configure(addon, polar_out=str(tmp_path), polar_inject=False, polar_handoff_ms=0, polar_flush_rows=1)
            refusals[:] = [True, True]  # two refusals, then it starts: no fallback
            _call_through(addon, "m0")
            poll(lambda: addon.writer.sent == 1, 30, "the call handed to a child")
            assert addon.writer._fallback is None and not refusals
            poll(lambda: list((tmp_path / "calls").glob("part-*.parquet")), 30, "its row written")
            addon.writer._proc.kill()
            poll(lambda: addon.writer._proc is None, 30, "the killed child reaped")
            monkeypatch.setattr(worker, "_CHILD_RETRY_S", 0.0)
            refusals[:] = [True] * 3  # every try of the next start refused: rows on the proxy's thread
            _call_through(addon, "m1")
            poll(lambda: addon.writer._fallback is not None, 30, "the fallback thread")
            _call_through(addon, "m2")  # the child is tried again, and starts
            poll(lambda: addon.writer.sent == 2, 30, "a call handed to a child again")
            assert addon.writer._fallback is None
            addon.done()
        finally:
            tctx.master._legacy_log_events.uninstall()
    rows = {r["model"]: p.name for p in (tmp_path / "calls").glob("part-*.parquet") for r in pq.read_table(p).to_pylist()}
    assert sorted(rows) == ["m0", "m1", "m2"]
    assert f"-{os.getpid()}-" in rows["m1"] and f"-{os.getpid()}-" not in rows["m2"]
    assert "the row worker process runs again" in caplog.text


def test_a_folder_name_the_terminal_cannot_show_does_not_stop_the_proxy(tmp_path: Path, monkeypatch) -> None:
    """``PYTHONIOENCODING=ascii`` (an ASCII stdout) and an ``ä`` in ``polar_out``: the addon's own "writing calls
    to ..." line raised UnicodeEncodeError in mitmproxy's log, and mitmdump exited at start."""
    monkeypatch.setenv("PYTHONIOENCODING", "ascii")
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, out_dir=tmp_path / "cäp", options={"polar_flush_seconds": "0.2"})
        try:
            r = rid()
            _calls(m, base, r, 1)
            poll(lambda: len(rows_of(m.out_dir, r)) == 1, 30, "the row")
        finally:
            m.stop()
        log_text = m.proc.log()
        assert f"writing calls to {tmp_path}/c\\xe4p/calls" in log_text and no_addon_traceback(log_text)


@pytest.mark.parametrize("archive", ["cap/monday", "archive/monday"])
def test_a_dead_workers_parts_moved_to_an_archive_folder_are_not_counted_lost(tmp_path: Path, archive: str) -> None:
    """The review: the rows a dead worker had written were looked for in the current ``calls/``
    only; moved beside it to archive them while the proxy ran, they were counted as lost - and
    moved out of the capture folder (a probe: "lost 22" where 8 were), they still were."""
    from mitmproxy.test import taddons

    out = tmp_path / "cap"
    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        try:
            tctx.configure(addon, polar_out=str(out), polar_inject=False, polar_handoff_ms=0,
                           polar_flush_rows=2, polar_flush_seconds="3600")
            for i in range(2):
                _call_through(addon, f"m{i}")
            poll(lambda: list((out / "calls").glob("part-*.parquet")), 30, "a part of 2 rows")
            (tmp_path / archive).parent.mkdir(exist_ok=True)
            (out / "calls").rename(tmp_path / archive)
            _call_through(addon, "held")  # handed, not yet written
            poll(lambda: addon.writer.sent == 3, 30, "3 calls handed to the row worker")
            os.kill(addon.writer._proc.pid, signal.SIGKILL)
            poll(lambda: list((out / "calls").glob("_losses-*.json")), 30, "a loss record")
            addon.done()
        finally:
            tctx.master._legacy_log_events.uninstall()
    (record,) = [json.loads(p.read_text()) for p in (out / "calls").glob("_losses-*.json")]
    assert record["calls_lost"] == 1


def test_only_mitmproxys_script_reload_is_taken_for_a_reload() -> None:
    """A start that failed after ``running`` (mitmproxy's TLS set-up on a read-only HOME) exits
    without ``should_exit`` set: the addon's ``done`` logged "reloading: 0 calls in flight and the
    row worker go on" as mitmdump exited. A reload is told by mitmproxy's ``loadscript`` on the stack."""
    mod = _load_addon()
    namespace: dict = {"check": mod._in_script_reload}
    exec(compile("def loadscript():\n    return check()\n", "/x/site-packages/mitmproxy/addons/script.py", "exec"),
         namespace)
    assert namespace["loadscript"]() is True
    assert mod._in_script_reload() is False
    exec(compile("def loadscript():\n    return check()\n", "/x/mine.py", "exec"), namespace)
    assert namespace["loadscript"]() is False  # a function of the same name elsewhere is no reload


def test_a_retry_after_the_worker_was_replaced_is_numbered_on(tmp_path: Path) -> None:
    """A probe with pi: a one-call session's request cut short, the row worker killed, and the
    harness's retry numbered attempt 1 by the new worker - so the build took it for the same task
    run again (both kept, a restart named). The new worker numbers on from its predecessor's rows."""
    from mitmproxy.test import taddons

    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        try:
            tctx.configure(addon, polar_out=str(tmp_path), polar_inject=False, polar_handoff_ms=0, polar_flush_rows=1)
            _call_through(addon, "same", rollout="r1")
            poll(lambda: list((tmp_path / "calls").glob("part-*.parquet")), 30, "the first attempt written")
            first = addon.writer._proc
            os.kill(first.pid, signal.SIGKILL)
            poll(lambda: addon.writer._proc is None, 30, "the killed worker reaped")
            _call_through(addon, "same", rollout="r1")  # the harness's retry, through the next worker
            addon.done()
        finally:
            tctx.master._legacy_log_events.uninstall()
    rows = sorted((r for p in (tmp_path / "calls").glob("part-*.parquet") for r in pq.read_table(p).to_pylist()),
                  key=lambda r: r["finished_at"])
    assert [r["attempt"] for r in rows] == [1, 2] and rows[0]["request_hash"] == rows[1]["request_hash"]


def test_a_worker_that_kept_no_count_has_its_parts_counted(tmp_path: Path) -> None:
    """The review: the count file started at 0, so a worker that never took it (an older one)
    read as "wrote nothing" and every call it had written counted as lost; and a part renamed into
    place just before a SIGKILL, before the count, was lost too. -1 until the child says 0, and the
    larger of the count and the parts found."""
    import pyarrow as pa

    from polar_train.capture import worker
    from polar_train.schema import CALL_LOG_SCHEMA

    progress = worker._progress_file()
    assert worker._rows_written(progress) is None  # (never written by a child)
    progress = worker._progress_file()
    worker.report_rows_written(progress.fileno(), 7)
    assert worker._rows_written(progress) == 7
    calls = tmp_path / "calls"
    calls.mkdir()
    row = {name: None for name in CALL_LOG_SCHEMA.names} | {"call_id": "c", "api": "openai.chat", "status": "ok"}
    pq.write_table(pa.Table.from_pylist([row, {**row, "call_id": "d"}], schema=CALL_LOG_SCHEMA),
                   calls / "part-20261207T000000000000Z-4242-000001.parquet")
    assert worker._rows_accounted_for(tmp_path, 4242, 0.0, None) == 2
    assert worker._rows_accounted_for(tmp_path, 4242, 0.0, 1) == 2  # the part after the count: not lost
    assert worker._rows_accounted_for(tmp_path, 4242, 0.0, 5) == 5  # parts archived elsewhere: the count


def test_a_shutdown_that_waits_for_a_slow_worker_says_so(tmp_path: Path) -> None:
    """A probe: a row worker held up (stuck storage) made SIGTERM wait a silent minute; the log now
    says it is waiting, and the worker's rows are written once it goes on."""
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "3600"})
        try:
            r = rid()
            _calls(m, base, r, 2)
            worker = _worker(m)
            worker.suspend()
            os.kill(m.proc.proc.pid, signal.SIGTERM)
            poll(lambda: "waiting up to" in m.proc.log(), 30, "the waiting line")
            assert m.proc.proc.poll() is None
            worker.resume()
            assert m.proc.proc.wait(60) == 0
            assert len(rows_of(m.out_dir, r)) == 2
        finally:
            m.stop()
        assert no_addon_traceback(m.proc.log())
