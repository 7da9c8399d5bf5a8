"""A slow streaming upstream in its own process, so a test can kill it mid-stream (SIGKILL).

``python -m tests.support.faulty_upstream PORT`` serves vLLM-shaped chat streams on 127.0.0.1:PORT:
``max_tokens`` chunks (default 400), one every ``POLAR_FAULT_DELAY_MS`` ms (default 20), then
``[DONE]``; non-streamed requests get one small body. Why a process and not a thread: the fault
under test is an upstream that dies (its sockets reset by the kernel), which a thread cannot do.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.procs import REPO, ManagedProcess, free_port, port_open

DELAY_S = float(os.environ.get("POLAR_FAULT_DELAY_MS", "20")) / 1000
CHUNKED = os.environ.get("POLAR_FAULT_CHUNKED") == "1"


def chunk(i: int, finish: str | None = None) -> bytes:
    obj = {"id": "chatcmpl-slow", "object": "chat.completion.chunk", "created": 1, "model": "slow",
           "choices": [{"index": 0, "delta": {"content": f" w{i}"}, "logprobs": None, "finish_reason": finish,
                        "token_ids": None}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            req = json.loads(raw)
        except ValueError:
            req = {}
        if req.get("stream") is not True:
            body = json.dumps({"id": "x", "object": "chat.completion", "model": "slow",
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                            "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        n = int(req.get("max_tokens") or 400)
        chunked = CHUNKED  # as vLLM and uvicorn send a stream; else the end of the body is the close
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding" if chunked else "Connection", "chunked" if chunked else "close")
        self.end_headers()

        def send(data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            self.wfile.flush()

        try:
            for i in range(n):
                send(chunk(i, "stop" if i == n - 1 else None))
                time.sleep(DELAY_S)  # the pace of a slow model, not synchronisation
            send(b"data: [DONE]\n\n")
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = not chunked


@contextlib.contextmanager
def slow_upstream(log_dir: Path, delay_ms: float = 20, chunked: bool = False) -> Iterator[tuple[str, ManagedProcess]]:
    """Start the upstream process; yields (base URL, process). The test may kill it at any time."""
    port = free_port()
    env = {**os.environ, "POLAR_FAULT_DELAY_MS": str(delay_ms), "PYTHONPATH": str(REPO),
           "POLAR_FAULT_CHUNKED": "1" if chunked else "0"}
    proc = ManagedProcess([sys.executable, "-m", "tests.support.faulty_upstream", str(port)],
                          log_dir / f"slow-upstream-{port}.log", env=env, cwd=str(REPO)).start()
    try:
        proc.wait_until(lambda: port_open(port), 30, "slow upstream")
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), _Handler)
    server.daemon_threads = True
    server.serve_forever()
