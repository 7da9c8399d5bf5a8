"""vLLM 0.32's small routes and stream extras: ``/version``, ``/ping`` (GET and POST, empty 200),
``/load``, HEAD on a GET route (405, ``allow: GET``), and ``stream_options.continuous_usage_stats``
(with ``include_usage``: usage on every chunk; without it: ignored).

The reference answers in ``tests/data/vllm_wire/misc_routes.json`` are vLLM 0.32's (its CPU build
on the tiny model, greedy), recorded with these very requests; ids and timestamps are ignored, and
of the headers ``allow``, ``content-type`` and ``content-length`` are compared (streams are chunked).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx
import pytest

from tests.support.vllm_recorded import assert_answers_as_vllm, recorded

RECORDED = recorded("misc_routes")


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_answer_equals_vllms_recorded_answer(polar_base_url, name):
    case = RECORDED[name]
    r = assert_answers_as_vllm(polar_base_url, case)
    for key, value in case["headers"].items():
        if key == "content-type" and value.startswith("text/event-stream"):
            assert r.headers[key].startswith("text/event-stream")
        else:
            assert r.headers.get(key) == value, key
    if "content-type" not in case["headers"]:
        assert "content-type" not in r.headers


def test_continuous_usage_counts_each_choice_of_a_sampled_n2_stream(polar_base_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
            "n": 2, "seed": 1, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", polar_base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        assert c["usage"]["completion_tokens"] == seen[ch["index"]]
        assert c["usage"]["completion_tokens_details"] is None
        seen[ch["index"]] += 1
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_head_on_get_routes_is_405(polar_base_url):
    for path in ("/health", "/v1/models", "/version", "/load", "/ping"):
        r = httpx.head(polar_base_url + path, timeout=30)
        assert r.status_code == 405, path
        assert "GET" in r.headers["allow"]


@pytest.mark.parametrize("echoed", [{"metadata": {"k": "\ud83d"}}, {"user": "\ud800"}])
def test_a_lone_surrogate_a_stream_echoes_is_escaped(polar_base_url, echoed):
    """JSON may hold a lone surrogate (``"\\ud800"``), which UTF-8 cannot encode. Echoed in a
    stream's events, it cut the stream after its headers, before any event (vLLM 0.32 does that
    too: a broken stream); its events now carry it as its escape. (A body is answered with vLLM's
    400: tests/test_server_validation.py.)"""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": True, **echoed}
    data = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as its \u escape
    with httpx.stream("POST", polar_base_url + "/v1/responses", content=data, timeout=120,
                      headers={"content-type": "application/json"}) as r:
        raw = r.read()
    assert r.status_code == 200, raw[:300]
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith(b"data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    (key, value), = echoed.items()
    assert events[-1]["response"][key] == value  # the same string back, from its escape


@contextlib.contextmanager
def _serving_a_stream(tiny_model_dir, tmp_path, *, shell_prefix: str = "", log_level: str = "warning"):
    """A ``polar-train serve`` with one open stream (400 tokens x 0.3 s: two minutes, unless a stop
    cuts it); yields the server once the stream has sent its first event. ``shell_prefix`` runs
    before it in a shell (``trap '' INT``: a caller that ignores a signal)."""
    import shlex

    from tests.support.procs import VENV_BIN, ManagedProcess, free_port, http_ok

    port = free_port()
    command = [str(VENV_BIN / "polar-train"), "serve", "--model", str(tiny_model_dir), "--port", str(port),
               "--chunk-delay-ms", "300", "--log-level", log_level]
    server = ManagedProcess(["/bin/sh", "-c", f"{shell_prefix} exec {shlex.join(command)}"],
                            tmp_path / "serve.log").start()
    streaming, ended = threading.Event(), threading.Event()
    server.stream_lines = []  # what the open stream's client read, its end included

    def stream() -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    server.stream_lines.append(line)
                    streaming.set()
        except httpx.HTTPError as exc:
            server.stream_lines.append(f"cut: {type(exc).__name__}")  # (the body ended mid-chunk)
        finally:
            ended.set()

    server.stream_ended = ended

    try:
        server.wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 120, "polar-train serve")
        threading.Thread(target=stream, daemon=True).start()
        assert streaming.wait(60)
        yield server
    finally:
        server.stop()


# SIGHUP: the terminal closed (it ran on, or raised inside uvicorn's loop: a lifespan traceback)
@pytest.mark.parametrize("signum, status", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_stop_is_one_line_with_its_status_and_cuts_open_streams_after_a_grace(tiny_model_dir, tmp_path, signum,
                                                                               status):
    """A probe: Ctrl-C ended serve with exit 0 and no line (uvicorn.run swallowed it), and a stop
    waited for every open stream to end - a request without max_tokens streams up to the context
    length, so a Ctrl-C looked hung for minutes."""
    from polar_train.server.cli import SHUTDOWN_GRACE_S

    with _serving_a_stream(tiny_model_dir, tmp_path) as server:
        started = time.monotonic()
        server.proc.send_signal(getattr(signal, signum))
        returncode = server.proc.wait(timeout=120)
        took = time.monotonic() - started
    err = server.log()
    assert returncode == status
    assert err.strip().splitlines()[-1] == f"polar-train serve: interrupted ({signum})"
    assert "Traceback" not in err
    assert took < SHUTDOWN_GRACE_S + 15  # the stream was cut after the grace, not streamed to its end
    assert server.stream_ended.wait(60) and [line for line in server.stream_lines if line][-1] == "data: [DONE]"


def test_a_second_ctrl_c_during_the_grace_cuts_the_open_streams_at_once(tiny_model_dir, tmp_path):
    """A second Ctrl-C is uvicorn's force quit ("CTRL+C to force quit", it says): the streams ran on
    to the end of the grace all the same (Python 3.12's ``wait_closed`` waits for each connection),
    then the app's skipped lifespan shutdown logged a CancelledError traceback."""
    with _serving_a_stream(tiny_model_dir, tmp_path, log_level="info") as server:
        server.proc.send_signal(signal.SIGINT)
        server.wait_until(lambda: "CTRL+C to force quit" in server.log(), 60, "the stop's grace")
        server.proc.send_signal(signal.SIGINT)
        returncode = server.proc.wait(timeout=120)
    err = server.log()
    assert returncode == 130
    assert server.stream_ended.wait(60)
    # the stream ends as vLLM ends one it aborts (it was cut mid-chunk: an incomplete body)
    assert [line for line in server.stream_lines if line][-2:] == [
        'data: {"error":{"message":"the server is shutting down: the request was aborted before it finished",'
        '"type":"InternalServerError","param":null,"code":500}}', "data: [DONE]"]
    assert "second Ctrl-C: cutting 1 open request(s) now" in err
    assert "timeout graceful shutdown exceeded" not in err  # cut by the second Ctrl-C, not by the grace's end
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "polar-train serve: interrupted (SIGINT)"


def test_a_signal_the_caller_ignores_stays_ignored_while_serving():
    """uvicorn took SIGINT and SIGTERM also where the caller ignores them (a background job of a
    script ignores SIGINT; ``nohup``) and, after the stop it began, exited 0, unsaid. The handlers
    serve installs leave an ignored signal ignored and handle the others."""
    import uvicorn

    from polar_train.server.stopping import StoppingServer

    server = StoppingServer(uvicorn.Config(app=None))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with server.capture_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == server.handle_exit
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
