"""Faults of issue 7 through the real ``mitmdump`` + addon that the capture fault tests do not cover:
an upstream process killed mid-stream, SIGTERM with 16 streams open, the SIGKILL loss bound, a full
disk and an output folder that cannot be written. What must hold each time: the client gets what
the upstream sent (or a clean end), the proxy keeps serving, every finished call is on disk, and
the log says what went wrong in one line.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from polar_train.calllog import read_call_log
from tests.support.capture_faults import fault_upstream
from tests.support.faulty_upstream import slow_upstream
from tests.support.mitm import no_addon_traceback, poll, proxy_client, rid, rows_of, start_mitm

pytestmark = pytest.mark.timeout(240)


def client(m, rollout: str, timeout: float = 30):
    return proxy_client(m, rollout, timeout)


def chat(stream: bool, max_tokens: int = 400) -> dict:
    return {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "max_tokens": max_tokens}


@pytest.mark.parametrize("chunked", [False, True], ids=["close-delimited", "chunked"])
def test_upstream_killed_mid_stream(tmp_path: Path, chunked: bool) -> None:
    """A chunked stream (vLLM's, uvicorn's) cut by the upstream gets h11's "peer closed connection
    without sending complete message body", the words it uses for a client's cut request body
    too: it was recorded as client_disconnected."""
    with slow_upstream(tmp_path, chunked=chunked) as (base, upstream), fault_upstream() as (other, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2"})
        try:
            r = rid()
            got = b""
            with client(m, r) as c, c.stream("POST", base + "/v1/chat/completions", json=chat(True)) as resp:
                assert resp.status_code == 200
                try:
                    for data in resp.iter_raw():
                        got += data
                        if got.count(b"\n\n") == 5:
                            upstream.send_signal(signal.SIGKILL)
                except httpx.HTTPError:
                    pass  # the connection may end with an error: the upstream died
            assert got.count(b"\n\n") >= 5 and b"[DONE]" not in got
            (row,) = poll(lambda: rows_of(m.out_dir, r), 30, "row of the killed stream")
            assert row["status"] == "upstream_error", row
            assert row["error"]
            assert row["prompt_token_ids"] is None  # never recorded as a complete call
            # the proxy keeps serving other upstreams
            r2 = rid()
            with client(m, r2) as c:
                assert c.post(other + "/v1/chat/completions", json={"model": "ok", "messages": []}).status_code == 200
            (row2,) = poll(lambda: rows_of(m.out_dir, r2), 30, "row after the fault")
            assert row2["status"] == "ok"
        finally:
            m.stop()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_request_body_cut_by_the_client_is_the_clients(tmp_path: Path, framing: str) -> None:
    """The same h11 words as an upstream's cut stream, from the other side: client_disconnected."""
    import base64
    import socket

    with slow_upstream(tmp_path, chunked=True) as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2"})
        try:
            r = rid()
            auth = base64.b64encode(f"{r}:x".encode()).decode()
            head = (f"POST {base}/v1/chat/completions HTTP/1.1\r\nHost: {base.split('//')[1]}\r\n"
                    f"Proxy-Authorization: Basic {auth}\r\nContent-Type: application/json\r\n")
            body = ("Content-Length: 1000\r\n\r\n{\"model\": \"x\", \"mess" if framing == "content-length"
                    else "Transfer-Encoding: chunked\r\n\r\na\r\n{\"model\": ")
            with socket.create_connection(("127.0.0.1", m.port)) as sock:
                sock.sendall((head + body).encode())
            (row,) = poll(lambda: rows_of(m.out_dir, r), 30, "row of the cut request")
            assert row["status"] == "client_disconnected", row
            assert "peer closed connection without sending complete message body" in row["error"]
        finally:
            m.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_with_16_streams_open(tmp_path: Path, sig: int) -> None:
    """Every finished call is on disk as ok; every stream still open has an error row. SIGHUP (a
    closed terminal) too: mitmdump left it to its default, which ended the proxy at once - the open
    streams had no row and no word."""
    with slow_upstream(tmp_path, delay_ms=20) as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "3600", "polar_flush_rows": 100000})
        done_r, open_r = rid(), rid()
        with client(m, done_r) as c:
            for _ in range(4):
                assert c.post(base + "/v1/chat/completions", json=chat(False)).status_code == 200
        started = threading.Barrier(17)
        ended = []

        def open_stream() -> None:
            with client(m, open_r, timeout=60) as c:
                try:
                    with c.stream("POST", base + "/v1/chat/completions", json=chat(True, 3000)) as resp:
                        it = resp.iter_raw()
                        next(it)
                        started.wait(30)
                        for _ in it:
                            pass
                except (httpx.HTTPError, threading.BrokenBarrierError):
                    pass
                ended.append(True)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(open_stream) for _ in range(16)]
            started.wait(60)  # all 16 streams have their first bytes
            assert m.stop(sig) is not None
            for f in futures:
                f.result(timeout=60)
    assert len(ended) == 16
    finished = rows_of(m.out_dir, done_r)
    assert len(finished) == 4 and all(r["status"] == "ok" for r in finished)
    opened = rows_of(m.out_dir, open_r)
    assert len(opened) == 16, [r["status"] for r in opened]
    for row in opened:
        assert row["status"] != "ok" and row["error"], row
    assert no_addon_traceback(m.proc.log())


def test_sigkill_loses_at_most_the_last_flush_interval(tmp_path: Path) -> None:
    """Rows of calls finished more than ``polar_flush_seconds`` before a SIGKILL are on disk."""
    flush_s = 1.0
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": str(flush_s), "polar_flush_rows": 100000})
        early, late = rid(), rid()
        try:
            with client(m, early) as c:
                for _ in range(10):
                    assert c.post(base + "/v1/chat/completions", json={"model": "ok", "messages": []}).status_code == 200
            t_done = time.monotonic()
            poll(lambda: len(rows_of(m.out_dir, early)) == 10, flush_s + 10, "early rows flushed")
            flushed_after = time.monotonic() - t_done
            with client(m, late) as c:
                for _ in range(5):
                    c.post(base + "/v1/chat/completions", json={"model": "ok", "messages": []})
        finally:
            m.stop(signal.SIGKILL)
    # the bound the docs state: one flush interval (plus the part's write time)
    assert flushed_after < flush_s + 5
    calls = m.out_dir / "calls"
    (calls / ".part-20261202T000000000000Z-1-000009.parquet.tmp").write_bytes(b"PAR1 half a part")
    for part in calls.glob("part-*.parquet"):
        pq.read_table(part)  # no visible part is corrupt
    log = read_call_log(m.out_dir)
    assert not log.problems  # the temporary file was skipped, not reported as a bad part
    ids = log.table.column("rollout_id").to_pylist()
    assert ids.count(early) == 10
    assert ids.count(late) <= 5


def _wait_log(m, needle: str, timeout: float = 30) -> str:
    return poll(lambda: (needle in m.proc.log()) and m.proc.log(), timeout, f"log line with {needle!r}")


def _calls_stay_fast(m, base: str, rollout: str, n: int) -> None:
    with client(m, rollout, timeout=10) as c:
        for _ in range(n):
            t0 = time.monotonic()
            assert c.post(base + "/v1/chat/completions", json={"model": "ok", "messages": []}).status_code == 200
            assert time.monotonic() - t0 < 5  # a failing disk never holds a call back


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_disk_full_traffic_keeps_flowing(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    if not _tmpfs(mnt, "256k"):
        pytest.skip("cannot mount a small tmpfs here (needs root); test_output_folder_not_writable covers "
                    "failing writes")
    try:
        with fault_upstream() as (base, _):
            m = start_mitm(tmp_path, out_dir=mnt / "out", options={"polar_flush_seconds": "0.2"})
            try:
                filler = mnt / "filler"
                fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    while os.write(fd, b"\0" * 4096):
                        pass
                except OSError:  # ENOSPC: the disk is full now
                    pass
                finally:
                    os.close(fd)
                full_r = rid()
                _calls_stay_fast(m, base, full_r, 5)
                log = _wait_log(m, "No space left on device")
                line = next(ln for ln in log.splitlines() if "No space left on device" in ln)
                assert "polar_capture" in line and str(mnt / "out" / "calls") in line, line
                assert not list((mnt / "out" / "calls").glob("part-*.parquet"))
                assert not list((mnt / "out" / "calls").glob(".*.tmp"))  # no half part left behind
                filler.unlink()  # space again: the next calls are written
                r = rid()
                _calls_stay_fast(m, base, r, 3)
                poll(lambda: len(rows_of(m.out_dir, r)) == 3, 30, "rows after the disk has space again")
                # the rows of the calls made while the disk was full were kept and written too
                assert len(rows_of(m.out_dir, full_r)) == 5
            finally:
                m.stop()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_output_folder_not_writable(tmp_path: Path) -> None:
    """The calls folder replaced by a file (writes fail even for root): one clear line, traffic flows."""
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2"})
        try:
            calls = m.out_dir / "calls"
            poll(calls.is_dir, 30, "the addon's calls folder")
            shutil.rmtree(calls)
            calls.write_text("not a folder")
            blocked_r = rid()
            _calls_stay_fast(m, base, blocked_r, 5)
            log = _wait_log(m, "Not a directory")
            line = next(ln for ln in log.splitlines() if "Not a directory" in ln)
            assert "polar_capture" in line and str(calls) in line, line
            calls.unlink()
            calls.mkdir(mode=0o700)
            r = rid()
            _calls_stay_fast(m, base, r, 3)
            poll(lambda: len(rows_of(m.out_dir, r)) == 3, 30, "rows once the folder is back")
            assert len(rows_of(m.out_dir, blocked_r)) == 5  # kept in memory, written on the retry
        finally:
            m.stop()
        assert no_addon_traceback(m.proc.log())


@pytest.mark.parametrize("option, message", [
    ("polar_flush_rows=0", "polar_capture: polar_flush_rows: at least 1, got 0"),
    ("polar_flush_seconds=soon", "polar_capture: polar_flush_seconds: expected a number of seconds"),
    ("polar_port_rollouts=nonsense", "polar_capture: polar_port_rollouts: expected PORT=ROLLOUT"),
    ("polar_tokenize_url=localhost:8000", "polar_capture: polar_tokenize_url: expected a URL starting with http"),
    # values mitmproxy itself cannot convert, and a misspelt name: it would skip the script, or the
    # option, without a word and serve without recording (or with the default)
    ("polar_strip=maybe", 'polar_capture: polar_strip: boolean must be "true", "false"'),
    ("polar_flush_rows=many", "polar_capture: polar_flush_rows: not an integer: many"),
    ("polar_flush_row=10", "polar_capture: polar_flush_row: no such option (the addon's are polar_out, "),
    ("polar_out=", "polar_capture: polar_out: empty; give a value or leave the option out"),
    # no shell expands ~ in --set: an unknown user's home was pathlib's RuntimeError traceback
    ("polar_out=~no-such-user-here/caps", "polar_capture: polar_out: ~no-such-user-here/caps: cannot expand "
                                          "~no-such-user-here (no home folder of user 'no-such-user-here')"),
    ("polar_out=a & polar_out=b", "polar_capture: polar_out: Received multiple values for polar_out"),
    ("polar_flush_seconds=inf", "polar_capture: polar_flush_seconds: must be a finite number of seconds"),
    # the same in the confdir's config.yaml, where values come typed (mitmproxy's TypeError traceback);
    # a number for polar_flush_seconds is taken (the natural way to write it), so only the other line shows
    ("yaml:polar_strip: maybe", "polar_capture: polar_strip: expected true or false, got 'maybe'"),
    ("yaml:polar_flush_rows: abc", "polar_capture: polar_flush_rows: expected a whole number, got 'abc'"),
    ("yaml:polar_flush_seconds: 2\npolar_flush_rows: 0", "polar_capture: polar_flush_rows: at least 1, got 0"),
])
def test_a_bad_option_stops_mitmdump_with_one_clear_line(tmp_path: Path, option: str, message: str) -> None:
    """As a user starts it: mitmdump exits 1 before serving, says what is wrong in one line, shows
    no traceback and creates no output folder."""
    from tests.support.mitm import ADDON
    from tests.support.procs import VENV_BIN, free_port

    out = tmp_path / "captures"
    given = [] if option.startswith("polar_out=") else ["--set", f"polar_out={out}"]  # a second one: two values
    sets = [a for o in option.split(" & ") for a in ("--set", o)]
    if option.startswith("yaml:"):
        (tmp_path / "conf").mkdir()
        (tmp_path / "conf" / "config.yaml").write_text(option.removeprefix("yaml:") + "\n")
        sets = []
    proc = subprocess.run(
        [str(VENV_BIN / "mitmdump"), "-s", str(ADDON), "--listen-host", "127.0.0.1", "-p", str(free_port()),
         "--set", f"confdir={tmp_path / 'conf'}", *given, *sets],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert "polar_capture: polar_flush_seconds" not in text or "flush_seconds" in message, text
    assert proc.returncode == 1, text
    assert message in text and "Error logged during startup, exiting" in text, text
    assert "Traceback" not in text
    assert not out.exists() and not (tmp_path / "calls").exists() and not (tmp_path / "a").exists()


def test_a_reload_of_the_addon_loses_no_call_in_flight(tmp_path: Path) -> None:
    """mitmproxy reloads a script whose file changed (an editor's save, a git checkout). The old
    instance's `done` failed every call in flight ("proxy shut down") though its stream went on,
    dropped open tunnels' credentials, and closed the row worker on the event loop. The calls, the
    credentials and the worker now pass to the reloaded instance."""
    from tests.support.mitm import ADDON

    script = tmp_path / "addon" / "polar_capture.py"
    script.parent.mkdir()
    shutil.copy(ADDON, script)
    with slow_upstream(tmp_path, delay_ms=50) as (base, _):
        m = start_mitm(tmp_path, scripts=[script], options={"polar_flush_seconds": "0.2"})
        try:
            r, got, reloaded_at = rid(), b"", None
            with client(m, r) as c, c.stream("POST", base + "/v1/chat/completions", json=chat(True, 120)) as resp:
                for data in resp.iter_raw():
                    got += data
                    if reloaded_at is None and got.count(b"\n\n") == 3:
                        now = time.time()
                        os.utime(script, (now, now + 5))  # newer: the script watcher reloads it
                        reloaded_at = -1
                    elif reloaded_at == -1 and "polar_capture: reloading:" in m.proc.log():
                        reloaded_at = got.count(b"\n\n")
            assert 3 <= reloaded_at < 120, reloaded_at  # reloaded while the stream was open
            assert b"[DONE]" in got
            (row,) = poll(lambda: rows_of(m.out_dir, r), 30, "row of the stream open during the reload")
            assert row["status"] == "ok" and row["error"] is None, row
            r2 = rid()
            with client(m, r2) as c:
                assert c.post(base + "/v1/chat/completions", json=chat(False)).status_code == 200
            poll(lambda: len(rows_of(m.out_dir, r2)) == 1, 30, "a call after the reload")
        finally:
            m.stop()
        log = m.proc.log()
        assert no_addon_traceback(log) and log.count("Loading script") == 2
        assert len(rows_of(m.out_dir, r2)) == 1 and len(rows_of(m.out_dir, r)) == 1


def test_a_reload_that_fails_refuses_model_calls_until_the_addon_loads_again(tmp_path: Path, monkeypatch) -> None:
    """A saved file that does not load (here a syntax error; also a package updated under the
    running proxy) left mitmdump forwarding every model call unrecorded, with a traceback in the
    log the only sign. Model calls are now refused with a 503 saying why until the addon loads."""
    from tests.support.mitm import ADDON

    script = tmp_path / "addon" / "polar_capture.py"
    script.parent.mkdir()
    shutil.copy(ADDON, script)
    package = tmp_path / "pkg" / "polar_train"  # a copy the proxy imports, to change under it
    shutil.copytree(ADDON.parents[1] / "polar_train", package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    module = package / "capture" / "handover.py"

    saves = []

    def save(text: str, marker: str) -> None:
        seen = m.proc.log().count(marker)
        script.write_text(text)
        saves.append(time.time() + 5 * (len(saves) + 1))
        os.utime(script, (saves[-1], saves[-1]))  # newer than every save before: the watcher reloads it
        poll(lambda: m.proc.log().count(marker) > seen, 30, marker)

    def model_call() -> httpx.Response:
        with client(m, rid()) as c:
            return c.post(base + "/v1/chat/completions", json=chat(False))

    with fault_upstream() as (base, received):
        m = start_mitm(tmp_path, scripts=[script], options={"polar_flush_seconds": "0.2"})
        try:
            save(ADDON.read_text() + "\nsyntax error (\n", "model calls are refused")
            before = len(received)
            r = rid()
            with client(m, r) as c:
                resp = c.post(base + "/v1/chat/completions", json=chat(False))
                assert resp.status_code == 503 and "failed to load" in resp.json()["error"]["message"]
                assert c.get(base + "/health").status_code == 501  # only model calls are held (no GET there)
            assert len(received) == before  # the model call never reached the server
            save(ADDON.read_text(), "model calls are recorded again")
            r2 = rid()
            with client(m, r2) as c:
                assert c.post(base + "/v1/chat/completions", json=chat(False)).status_code == 200
            poll(lambda: len(rows_of(m.out_dir, r2)) == 1, 30, "a call after the addon loaded again")
            # a module only touched (same content) is no change: the reload goes through
            os.utime(module, (time.time(), time.time() + 60))
            save(ADDON.read_text(), "Loading script")
            assert model_call().status_code == 200
            # `git pull` under the running proxy: the reloaded file would run with the old modules - and
            # a name the new file imports that the old cached module lacks hid this message (the review)
            identity = package / "capture" / "identity.py"
            identity.write_text(identity.read_text() + "\nPULLED_NAME = 1\n")
            save(ADDON.read_text().replace("from polar_train.capture.identity import ",
                                           "from polar_train.capture.identity import PULLED_NAME, "),
                 "model calls are refused")
            assert "polar_train changed on disk since mitmdump started (polar_train/capture/identity.py)" \
                in m.proc.log()
            assert model_call().status_code == 503
            # a second failed load: mitmproxy's stale "None" addon of the first one said "An addon
            # called 'nonetype' already exists", with a traceback of its own
            save(ADDON.read_text() + "\nsyntax error (\n", "error in script")
            assert "nonetype" not in m.proc.log()
        finally:
            m.stop()
        assert rows_of(m.out_dir, r) == []


def test_a_package_changed_before_the_first_reload_is_said(tmp_path: Path, monkeypatch) -> None:
    """The check for a package changed on disk, moved before the addon's imports, saw only the
    modules loaded before it at the first load: a `git pull` before the first reload went unsaid
    (the review). Start, pull (identity.py gains a name the new addon imports), reload."""
    from tests.support.mitm import ADDON

    script = tmp_path / "addon" / "polar_capture.py"
    script.parent.mkdir()
    shutil.copy(ADDON, script)
    package = tmp_path / "pkg" / "polar_train"
    shutil.copytree(ADDON.parents[1] / "polar_train", package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, scripts=[script], options={"polar_flush_seconds": "0.2"})
        try:
            identity = package / "capture" / "identity.py"
            poll(lambda: "polar_capture: writing calls to" in m.proc.log(), 30, "the first load done")  # (it runs
            # on after the port listens)
            identity.write_text(identity.read_text() + "\nPULLED_NAME = 1\n")
            script.write_text(ADDON.read_text().replace("from polar_train.capture.identity import ",
                                                        "from polar_train.capture.identity import PULLED_NAME, "))
            later = time.time() + 5
            os.utime(script, (later, later))
            poll(lambda: "model calls are refused" in m.proc.log(), 30, "the reload refused")
            assert "polar_train changed on disk since mitmdump started (polar_train/capture/identity.py)" \
                in m.proc.log()
            with client(m, rid()) as c:
                assert c.post(base + "/v1/chat/completions", json=chat(False)).status_code == 503
        finally:
            m.stop()


def test_the_addon_given_under_two_paths_records_each_call_once(tmp_path: Path) -> None:
    """`-s addons/polar_capture.py -s copy/polar_capture.py`: mitmproxy refused the second with its
    traceback and exited. The second copy now stands aside with one line."""
    from tests.support.mitm import ADDON

    copy = tmp_path / "copy" / "polar_capture.py"
    copy.parent.mkdir()
    shutil.copy(ADDON, copy)
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, scripts=[ADDON, copy], options={"polar_flush_seconds": "0.2"})
        try:
            r = rid()
            _calls_stay_fast(m, base, r, 2)
            poll(lambda: len(rows_of(m.out_dir, r)) == 2, 30, "rows of the two calls")
        finally:
            m.stop()
        log = m.proc.log()
        assert "the capture addon is loaded already" in log and "Traceback" not in log
        assert len(rows_of(m.out_dir, r)) == 2


def test_with_stream_large_bodies_a_large_model_call_says_why_it_was_not_recorded(tmp_path: Path) -> None:
    """mitmproxy's stream_large_bodies streams any body past it while reading it, whatever a hook
    says. Such a request was recorded as `ok` with "request body is not JSON"; the row now names the
    option, and the proxy says so once at start."""
    with fault_upstream() as (base, _):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2", "stream_large_bodies": "4k"})
        try:
            r = rid()
            big = {"model": "ok", "messages": [{"role": "user", "content": "x" * 20_000}]}
            with client(m, r) as c:
                assert c.post(base + "/v1/chat/completions", json=big).status_code == 200
            (row,) = poll(lambda: rows_of(m.out_dir, r), 30, "row of the streamed request")
        finally:
            m.stop()
        assert row["status"] != "ok" and "stream_large_bodies" in row["error"], row
        log = m.proc.log()
        assert "polar_capture: stream_large_bodies is 4k" in log and no_addon_traceback(log)


def test_flows_read_from_a_file_are_said_not_to_be_recorded(tmp_path: Path) -> None:
    """``mitmdump -n -r saved.flows -s addon`` (an offline replay) wrote no row and said nothing - and
    warned that the proxy listens on all interfaces, where nothing listens at all."""
    import json

    from mitmproxy import io
    from mitmproxy.test import tflow, tutils

    from tests.support.mitm import ADDON
    from tests.support.procs import VENV_BIN

    saved = tmp_path / "saved.flows"
    with saved.open("wb") as f:  # model calls without their answers: they ran all hooks again and were recorded
        writer = io.FlowWriter(f)
        for error in (False, True):
            flow = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                headers=((b"content-type", b"application/json"), (b"x-polar-rollout", b"r-file"))), err=error)
            writer.add(flow)
        writer.add(tflow.tflow(resp=True))
    proc = subprocess.run([str(VENV_BIN / "mitmdump"), "-n", "-r", str(saved), "-s", str(ADDON), "--set",
                           f"polar_out={tmp_path / 'out'}", "--set", f"confdir={tmp_path / 'conf'}", "--set",
                           "flow_detail=0"], capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert f"polar_capture: rfile: flows read from {saved} are not recorded" in log
    assert "listens on all interfaces" not in log and no_addon_traceback(log)
    assert not list((tmp_path / "out").rglob("*.parquet"))
