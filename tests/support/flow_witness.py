"""mitmproxy addon used by the harness tests: one JSON line per completed HTTP flow.

An independent count of what went through the proxy, to check the capture addon against.
Records no headers or bodies (nothing secret): method, path, status, the client connection, and
whether what the client received held server token ids (``ids_seen``: what the capture addon's
stripping removes). Loaded after the capture addon, so that it sees the client's side of its
stream tap.
"""

from __future__ import annotations

import json

from mitmproxy import ctx, http


#: Bytes that only a response with server token ids holds (chat ids, Responses raw message tokens).
ID_MARKERS = (b'"token_ids":[', b'"raw_message_tokens"')


def _holds_ids(data: bytes) -> bool:
    return any(marker in data for marker in ID_MARKERS)


class FlowWitness:
    def __init__(self) -> None:
        self.ids_seen: dict[str, bool] = {}

    def load(self, loader) -> None:
        loader.add_option("witness_log", str, "", "JSONL file that gets one line per completed flow.")

    def _write(self, flow: http.HTTPFlow, status: int | None, error: str | None) -> None:
        path = ctx.options.witness_log
        if not path:
            return
        line = {"method": flow.request.method, "host": flow.request.pretty_host, "path": flow.request.path,
                "status": status, "error": error, "client_conn": flow.client_conn.id,
                "ids_seen": self.ids_seen.pop(flow.id, False)}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        inner = flow.response.stream
        if not callable(inner):
            return
        self.ids_seen[flow.id] = False

        def watched(chunk: bytes):
            out = inner(chunk)
            if _holds_ids(b"".join(out) if isinstance(out, list) else out):
                self.ids_seen[flow.id] = True
            return out

        flow.response.stream = watched

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and not flow.response.stream and flow.response.raw_content:
            self.ids_seen[flow.id] = _holds_ids(flow.response.get_content(strict=False) or b"")
        self._write(flow, flow.response.status_code if flow.response else None, None)

    def error(self, flow: http.HTTPFlow) -> None:
        self._write(flow, None, str(flow.error))


addons = [FlowWitness()]
