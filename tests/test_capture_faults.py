"""Faults through the real mitmdump + addon: the client always gets what the upstream sent, a row
is written where a call happened, the proxy keeps serving, nothing is lost on SIGTERM, and no part
is corrupt after SIGKILL. The upstream is a fault injector (tests/support/capture_faults.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import uuid
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from tests.support.capture_faults import BODY, CHUNK, fault_upstream, sse
from tests.support.mitm import read_calls, start_mitm
from tests.support.procs import free_port

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def upstream():
    with fault_upstream() as (base, received):
        yield base, received


@pytest.fixture(scope="module")
def proxy(upstream, tmp_path_factory):
    base, _ = upstream
    m = start_mitm(tmp_path_factory.mktemp("faults"), modes=[f"reverse:{base}"],
                   options={"polar_flush_seconds": "0.2"})
    yield m
    m.stop()


def post(proxy, model: str, rollout: str, stream: bool = False, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=kw.pop("timeout", 60),
                      headers={"x-polar-rollout": rollout, "authorization": "Bearer sk-fault-secret"}, **kw)


def wait_rows(out_dir: Path, rollout: str, n: int = 1, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [r for r in read_calls(out_dir) if r["rollout_id"] == rollout]
        if len(rows) >= n:
            return rows
        time.sleep(0.1)  # polling the output folder, with a deadline
    raise TimeoutError(f"{n} row(s) for {rollout} not written")


def rid() -> str:
    return "f-" + uuid.uuid4().hex[:10]


@pytest.mark.parametrize("model,status", [("fault-500", 500), ("fault-400", 400)])
def test_upstream_http_errors_pass_through_and_are_recorded(proxy, model, status):
    r = rid()
    resp = post(proxy, model, r)
    assert resp.status_code == status
    assert resp.json()["error"]["message"]  # the client got the upstream's body
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "upstream_error" and row["http_status"] == status
    assert "HTTP %d" % status in row["error"]


def test_connection_refused_gives_502_and_error_row(tmp_path):
    dead = free_port()
    m = start_mitm(tmp_path, modes=[f"reverse:http://127.0.0.1:{dead}"],
                   options={"polar_flush_seconds": "0.2", "connection_strategy": "lazy"})
    try:
        r = rid()
        resp = post(m, "x", r)
        assert resp.status_code == 502
        (row,) = wait_rows(m.out_dir, r)
        assert row["status"] == "upstream_error" and row["http_status"] is None
        assert row["error"]
    finally:
        m.stop()


def test_upstream_timeout_is_an_upstream_error(upstream, tmp_path):
    """mitmproxy's tcp_timeout closes a stalled call; the row says so."""
    base, _ = upstream
    m = start_mitm(tmp_path, modes=[f"reverse:{base}"], options={"polar_flush_seconds": "0.2", "tcp_timeout": 2})
    try:
        r = rid()
        with pytest.raises(httpx.HTTPError):
            post(m, "fault-stall", r, timeout=20)
        (row,) = wait_rows(m.out_dir, r)
        assert row["status"] == "upstream_error", row
        assert row["error"]
        assert post(m, "ok", rid()).status_code == 200  # the proxy keeps serving
    finally:
        m.stop()


def test_client_disconnect_mid_stream(proxy):
    r = rid()
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=30,
                      json={"model": "fault-slow-stream", "messages": [], "stream": True},
                      headers={"x-polar-rollout": r}) as resp:
        it = resp.iter_bytes()
        first = next(it)
        assert first.startswith(b"data: ")
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "client_disconnected"
    # the proxy keeps serving
    assert post(proxy, "ok", rid()).status_code == 200


def test_malformed_json_response(proxy):
    r = rid()
    resp = post(proxy, "fault-malformed-json", r)
    assert resp.content == b'{"id": "x", "choices": ['
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "upstream_error" and "malformed JSON" in row["error"]
    assert row["response_json"] is None


def test_malformed_request_json_is_forwarded_unchanged(proxy, upstream):
    _, received = upstream
    r = rid()
    resp = httpx.post(proxy.url + "/v1/chat/completions", content=b"{not json\xff", timeout=30,
                      headers={"x-polar-rollout": r, "content-type": "application/json"})
    assert resp.status_code == 400
    assert any(body == b"{not json\xff" for _, _, body in received)
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "upstream_error" and row["request_json"] is None


@pytest.mark.parametrize("labelled_right", [True, False])
def test_a_request_body_reaches_the_server_in_the_encoding_it_came_in(proxy, upstream, labelled_right):
    """A gzip request body is injected and sent on gzipped; a plain JSON body labelled gzip (servers,
    vLLM too, ignore a request's Content-Encoding) was injected and then compressed by the proxy, and
    the server answered 400 to bytes the client never sent (a probe). It goes on plain."""
    import gzip

    _, received = upstream
    r = rid()
    plain = json.dumps({"model": "ok", "messages": [{"role": "user", "content": "hi"}]}).encode()
    resp = httpx.post(proxy.url + "/v1/chat/completions", content=gzip.compress(plain) if labelled_right else plain,
                      timeout=30, headers={"x-polar-rollout": r, "content-type": "application/json",
                                           "content-encoding": "gzip"})
    (row,) = wait_rows(proxy.out_dir, r)
    sent = [body for path, _, body in received if path.endswith("/chat/completions")][-1]
    if labelled_right:  # (this fake server reads no gzip: its 400 is no matter here)
        got = json.loads(gzip.decompress(sent))
    else:
        assert resp.status_code == 200 and row["status"] == "ok"
        got = json.loads(sent)
    assert got["messages"] == [{"role": "user", "content": "hi"}] and got["return_token_ids"] is True  # injected
    assert row["injected"] is True


@pytest.mark.parametrize("model,problem", [("fault-truncated-sse", "truncated"), ("fault-malformed-sse", "malformed")])
def test_bad_streams_reach_the_client_unchanged(proxy, model, problem):
    r = rid()
    resp = post(proxy, model, r, stream=True)
    if model == "fault-truncated-sse":
        assert resp.content == sse(CHUNK) + sse(CHUNK)[:20]
    else:
        assert resp.content == sse(CHUNK) + b"data: {not json\n\n" + b"data: [DONE]\n\n"
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "upstream_error" and problem in row["error"]


@pytest.mark.parametrize("model", ["fault-gzip", "fault-br", "fault-zstd"])
def test_compressed_bodies(proxy, model):
    r = rid()
    resp = post(proxy, model, r)
    body = resp.content
    if resp.headers.get("content-encoding") == "zstd":  # httpx cannot decode it: the bytes arrive as sent
        from backports import zstd

        body = zstd.decompress(body)
    assert json.loads(body)["choices"][0]["message"]["content"] == "hello"
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "ok" and json.loads(row["response_json"])["choices"][0]["message"]["content"] == "hello"
    assert row["usage_prompt_tokens"] == 3


def test_compressed_stream(proxy):
    r = rid()
    resp = post(proxy, "fault-gzip-sse", r, stream=True)
    assert resp.content == sse(CHUNK) * 3 + b"data: [DONE]\n\n"  # httpx decoded it
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "ok"
    assert json.loads(row["response_json"])["choices"][0]["message"]["content"] == "hihihi"


def test_non_utf8_body(proxy):
    r = rid()
    resp = post(proxy, "fault-nonutf8", r)
    assert b"\xff\xfe" in resp.content
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "upstream_error"


def test_fifty_megabyte_body(proxy):
    r = rid()
    resp = post(proxy, "fault-big", r, timeout=120)
    assert len(resp.json()["choices"][0]["message"]["content"]) == 50 << 20
    (row,) = wait_rows(proxy.out_dir, r, timeout=120)
    assert row["status"] == "ok"


def test_non_model_traffic_is_untouched_and_unrecorded(proxy, upstream):
    _, received = upstream
    r = rid()
    resp = httpx.post(proxy.url + "/v1/embeddings", json={"model": "ok"}, timeout=30,
                      headers={"x-polar-rollout": r, "accept-encoding": "gzip"})
    assert resp.status_code == 200
    path, headers, _ = received[-1]
    assert path == "/v1/embeddings"
    assert "x-polar-rollout" not in {k.lower() for k in headers}  # the proxy's own header: never forwarded
    assert headers.get("accept-encoding") == "gzip"  # everything else as sent
    assert post(proxy, "ok", marker := rid()).status_code == 200
    wait_rows(proxy.out_dir, marker)
    assert not [row for row in read_calls(proxy.out_dir) if row["rollout_id"] == r]


def test_64_concurrent_sessions(proxy):
    rollouts = [rid() for _ in range(64)]

    def one(r: str) -> bytes:
        return post(proxy, "ok-stream", r, stream=True).content

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        bodies = list(pool.map(one, rollouts))
    bad = [b for b in bodies if b != sse(CHUNK) * 3 + b"data: [DONE]\n\n"]
    assert not bad, bad[:2]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = {row["rollout_id"]: row for row in read_calls(proxy.out_dir) if row["rollout_id"] in rollouts}
        if len(rows) == 64:
            break
        time.sleep(0.2)  # polling the output folder, with a deadline
    assert len(rows) == 64
    assert all(row["status"] == "ok" for row in rows.values())


def test_sigterm_loses_no_row(upstream, tmp_path):
    base, _ = upstream
    m = start_mitm(tmp_path, modes=[f"reverse:{base}"], options={"polar_flush_seconds": "3600",
                                                                  "polar_flush_rows": 100000})
    r = rid()
    in_flight = rid()
    try:
        for _ in range(20):
            assert post(m, "ok", r).status_code == 200
        with httpx.stream("POST", m.url + "/v1/chat/completions", timeout=30,
                          json={"model": "fault-slow-stream", "messages": [], "stream": True},
                          headers={"x-polar-rollout": in_flight}) as resp:
            next(resp.iter_bytes())  # the call is streaming now
            assert m.stop(signal.SIGTERM) is not None
    finally:
        m.stop(signal.SIGTERM)
    rows = read_calls(m.out_dir)
    assert len([row for row in rows if row["rollout_id"] == r]) == 20
    (cut,) = [row for row in rows if row["rollout_id"] == in_flight]
    assert cut["status"] != "ok"  # the call cut by the shutdown is recorded, as an error row


def test_sigkill_leaves_no_corrupt_part(upstream, tmp_path):
    base, _ = upstream
    m = start_mitm(tmp_path, modes=[f"reverse:{base}"], options={"polar_flush_rows": 2, "polar_flush_seconds": "3600"})
    r = rid()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(post, m, "ok", r) for _ in range(40)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not list((m.out_dir / "calls").glob("part-*.parquet")):
                time.sleep(0.05)  # polling for the first part, with a deadline
            m.proc.send_signal(signal.SIGKILL)
            for f in futures:
                try:
                    f.result()
                except httpx.HTTPError:
                    pass
    finally:
        m.stop(signal.SIGKILL)
    parts = list((m.out_dir / "calls").glob("part-*.parquet"))
    assert parts
    for part in parts:
        pq.read_table(part)  # every visible part is complete
    for stray in (m.out_dir / "calls").glob(".*"):
        assert stray.name.startswith(".")  # readers skip dot-files


def test_injection_off_passes_bytes_unchanged(upstream, tmp_path):
    base, _ = upstream
    m = start_mitm(tmp_path, modes=[f"reverse:{base}"], options={"polar_inject": False, "polar_flush_seconds": "0.2"})
    try:
        r = rid()
        assert post(m, "ok-stream", r, stream=True).content == sse(CHUNK) * 3 + b"data: [DONE]\n\n"
        assert post(m, "ok", r).content == json.dumps(BODY).encode()
        rows = wait_rows(m.out_dir, r, 2)
        assert all(row["injected"] is False and row["token_source"] == "none" for row in rows)
    finally:
        m.stop()


def test_no_secret_in_outputs(proxy):
    marker = rid()
    assert post(proxy, "ok", marker).status_code == 200
    wait_rows(proxy.out_dir, marker)
    for f in proxy.out_dir.rglob("*"):
        if f.is_file():
            assert b"sk-fault-secret" not in f.read_bytes()


def test_retries_get_increasing_attempts(proxy):
    r = rid()
    for _ in range(3):
        assert post(proxy, "ok", r).status_code == 200
    rows = wait_rows(proxy.out_dir, r, 3)
    assert sorted(row["attempt"] for row in rows) == [1, 2, 3]
    assert len({row["request_hash"] for row in rows}) == 1 and len({row["call_id"] for row in rows}) == 3


def test_api_key_identity(proxy, upstream):
    _, received = upstream
    r = rid()
    resp = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "ok", "messages": []}, timeout=30,
                      headers={"authorization": f"Bearer polar-{r}"})
    assert resp.status_code == 200
    assert {k.lower(): v for k, v in received[-1][1].items()}["authorization"] == f"Bearer polar-{r}"  # forwarded
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["rollout_source"] == "api_key"
    assert f"polar-{r}" not in json.dumps(row, default=str)


def test_plain_http_proxy_credentials_are_used_and_removed(upstream, tmp_path):
    base, received = upstream
    p1, p2 = free_port(), free_port()
    m = start_mitm(tmp_path, modes=[f"regular@{p1}", f"regular@{p2}"],
                   options={"polar_flush_seconds": "0.2", "polar_port_rollouts": f"{p2}=port-rollout"})
    try:
        r = rid()
        with httpx.Client(proxy=f"http://{r}:cred-SECRET-9@127.0.0.1:{p1}") as c:
            assert c.post(base + "/v1/chat/completions", json={"model": "ok", "messages": []},
                          headers={"x-polar-task": "task-1"}).status_code == 200
        _, headers, _ = received[-1]
        assert not any(k.lower() in ("proxy-authorization", "x-polar-task") for k in headers)
        (row,) = wait_rows(m.out_dir, r)
        assert row["rollout_source"] == "proxy_auth" and row["task_id"] == "task-1"
        with httpx.Client(proxy=f"http://127.0.0.1:{p2}") as c:
            assert c.post(base + "/v1/chat/completions", json={"model": "ok", "messages": []}).status_code == 200
        (row,) = wait_rows(m.out_dir, "port-rollout")
        assert row["rollout_source"] == "listen_port"
    finally:
        m.stop()
    for f in m.out_dir.rglob("*"):
        if f.is_file():
            assert b"cred-SECRET-9" not in f.read_bytes()


def test_client_leaving_after_the_final_event_is_a_complete_call(proxy):
    """Codex closes the stream right after its terminal event; the call is complete (status ok)."""
    r = rid()
    got = b""
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=30,
                      json={"model": "fault-linger-after-done", "messages": [], "stream": True},
                      headers={"x-polar-rollout": r}) as resp:
        for chunk in resp.iter_bytes():
            got += chunk
            if b"[DONE]" in got:
                break
    (row,) = wait_rows(proxy.out_dir, r)
    assert row["status"] == "ok", row["error"]
    assert json.loads(row["response_json"])["choices"][0]["message"]["content"] == "hi"


def test_a_proxy_that_stops_while_the_parts_are_read_is_still_said(tmp_path, monkeypatch, capsys):
    """The lock was looked at only after the read: a proxy that stopped meanwhile wrote the rows it
    held after the listing (unread) and was gone by then - a probe's build read 20 of 25 rows and
    said nothing. A process holds the live lock as a proxy does, and lets go during the read."""
    import shutil
    import subprocess
    import sys

    import polar_train.calllog as calllog
    import polar_train.trajectories.build as build
    from polar_train.cli import main
    from polar_train.trajectories import BuildOptions, build_trajectories

    capture = tmp_path / "cap"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "samples" / "demo" / "captures", capture)
    holder_code = ("import sys; from pathlib import Path; from polar_train.capture.outdir import LiveLock; "
                   f"lock = LiveLock(Path({str(capture / 'calls')!r})); lock.refresh(); print('held', flush=True); "
                   "sys.stdin.read()")
    for reader, module in (("build", build), ("inspect", calllog)):
        holder = subprocess.Popen([sys.executable, "-c", holder_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout.readline() == "held\n"
        real = calllog.read_call_log

        def stopping_read(*args, **kwargs):
            result = real(*args, **kwargs)
            holder.stdin.close()  # the proxy stops while the parts are read
            holder.wait(30)
            return result

        monkeypatch.setattr(module, "read_call_log", stopping_read)
        said = (f"a capture proxy stopped while the parts were read: {capture / 'calls'} (process {holder.pid}); "
                "rows it wrote as it stopped may not have been read: read again")
        if reader == "build":
            notes = build_trajectories(capture, BuildOptions()).report.notes
            assert said in notes and not any("is writing into" in n for n in notes), notes
        else:
            assert main(["inspect", str(capture)]) == 0
            out = capsys.readouterr().out
            assert f"note: {said}" in out and "is writing into" not in out
        monkeypatch.undo()
        assert holder.returncode == 0 and calllog.live_writers(capture, []) == []


def test_inspect_and_build_say_a_capture_is_still_being_written(upstream, tmp_path):
    """A build of a capture that a proxy was still writing read 10 of 16 finished calls (the rest
    not yet flushed) and built rollouts still running as complete, exit 0, without a word: the row
    worker holds a shared lock in calls/ while it runs, and readers say so."""
    import subprocess
    import sys

    from polar_train.calllog import live_writers, read_call_log

    base, _ = upstream
    m = start_mitm(tmp_path, modes=[f"reverse:{base}"], options={"polar_flush_rows": 1})
    r = rid()

    def inspect_output() -> str:
        proc = subprocess.run([sys.executable, "-m", "polar_train", "inspect", str(m.out_dir)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    try:
        assert post(m, "ok", r).status_code == 200
        wait_rows(m.out_dir, r)
        live = live_writers(m.out_dir, read_call_log(m.out_dir).parts)
        assert [folder for folder, _ in live] == [m.out_dir / "calls"] and live[0][1]
        assert m.proc.pid in live[0][1]  # the proxy itself (from its start), and its row worker
        pids = ", ".join(map(str, live[0][1]))
        assert f"note: a capture proxy is writing into {m.out_dir / 'calls'} (its lock held by process {pids}): calls " \
               "still in flight and rows not yet written" in inspect_output()
        from polar_train.trajectories import BuildOptions, build_trajectories

        notes = build_trajectories(m.out_dir, BuildOptions()).report.notes
        assert any(n.startswith(f"a capture proxy is writing into {m.out_dir / 'calls'} (its lock held by process ")
                   for n in notes)
        second = start_mitm(tmp_path / "second", modes=[f"reverse:{base}"], out_dir=m.out_dir)
        try:  # two proxies into one folder: both seen
            deadline = time.monotonic() + 30  # (its addon takes the lock as it comes up, just after it listens)
            while second.proc.pid not in live_writers(m.out_dir, [])[0][1] and time.monotonic() < deadline:
                time.sleep(0.05)  # polling for the second proxy's lock, with a deadline
            assert {second.proc.pid, m.proc.pid} <= set(live_writers(m.out_dir, [])[0][1])
        finally:
            second.stop(signal.SIGTERM)
    finally:
        m.stop(signal.SIGTERM)
    assert live_writers(m.out_dir, read_call_log(m.out_dir).parts) == []
    assert "capture proxy is writing" not in inspect_output()
