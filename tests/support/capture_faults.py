"""A test-only HTTP upstream that misbehaves on purpose (a fault injector, not a model server).

The request's ``model`` field picks the fault (``fault-500``, ``fault-truncated-sse``, ...); the
answers imitate the shapes of vLLM's chat completions so the addon parses them as model calls.
Runs in a thread of the test process; the proxy under test is a separate mitmdump process.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = {"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]}
BODY = {"id": "chatcmpl-f", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None,
                     "finish_reason": "stop", "token_ids": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "prompt_token_ids": None}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json", headers=None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, parts, delay: float = 0.0, close_early: bool = False, headers=None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        try:
            for p in parts:
                self.wfile.write(p)
                self.wfile.flush()
                if delay:
                    time.sleep(delay)  # the fault: a slow upstream
        except (BrokenPipeError, ConnectionResetError):
            return
        self.close_connection = True

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        self.server.requests.append((self.path, dict(self.headers), raw))  # type: ignore[attr-defined]
        try:
            model = json.loads(raw).get("model", "")
        except ValueError:
            model = "fault-badrequest"
        if model == "fault-500":
            return self._send(500, b'{"error": {"message": "boom"}}')
        if model == "fault-400":
            return self._send(400, b'{"error": {"message": "bad request"}}')
        if model == "fault-badrequest":
            return self._send(400, b'{"error": {"message": "not json"}}')
        if model == "fault-malformed-json":
            return self._send(200, b'{"id": "x", "choices": [')
        if model == "fault-nonutf8":
            return self._send(200, b'{"id": "x", "choices": [{"index": 0, "message": {"content": "\xff\xfe"}}]}')
        if model == "fault-gzip":
            return self._send(200, gzip.compress(json.dumps(BODY).encode()), headers={"Content-Encoding": "gzip"})
        if model == "fault-br":
            import brotli

            return self._send(200, brotli.compress(json.dumps(BODY).encode()), headers={"Content-Encoding": "br"})
        if model == "fault-zstd":
            from backports import zstd

            return self._send(200, zstd.compress(json.dumps(BODY).encode()),
                              headers={"Content-Encoding": "zstd"})
        if model == "fault-gzip-sse":
            data = sse(CHUNK) * 3 + b"data: [DONE]\n\n"
            return self._stream([gzip.compress(data)], headers={"Content-Encoding": "gzip"})
        if model == "fault-big":
            big = dict(BODY, choices=[{**BODY["choices"][0],
                                       "message": {"role": "assistant", "content": "x" * (50 << 20)}}])
            return self._send(200, json.dumps(big).encode())
        if model == "fault-truncated-sse":
            return self._stream([sse(CHUNK), sse(CHUNK)[:20]])
        if model == "fault-malformed-sse":
            return self._stream([sse(CHUNK), b"data: {not json\n\n", b"data: [DONE]\n\n"])
        if model == "fault-slow-stream":
            return self._stream([sse(CHUNK)] * 200 + [b"data: [DONE]\n\n"], delay=0.05)
        if model == "fault-stall":
            time.sleep(30)  # the fault: an upstream that never answers in time
            return self._send(200, json.dumps(BODY).encode())
        if model == "fault-linger-after-done":  # the body goes on after [DONE] (the client leaves first)
            return self._stream([sse(CHUNK), b"data: [DONE]\n\n", b": keep-alive\n\n"], delay=1.5)
        if model == "ok-ids":  # the server's own ids, as vLLM returns them when asked: nothing to render
            return self._send(200, json.dumps({**BODY, "prompt_token_ids": [1, 2, 3], "choices": [
                {**BODY["choices"][0], "token_ids": [4]}]}).encode())
        if model == "ok-stream":
            return self._stream([sse(CHUNK)] * 3 + [b"data: [DONE]\n\n"])
        return self._send(200, json.dumps(BODY).encode())


@contextlib.contextmanager
def fault_upstream() -> Iterator[tuple[str, list]]:
    """Yields (base URL, list of received (path, headers, body))."""
    ThreadingHTTPServer.request_queue_size = 256  # 64 concurrent sessions must not overflow the backlog
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
