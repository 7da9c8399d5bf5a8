"""mitmproxy addon used by the harness tests: one JSON line per completed HTTP flow.

An independent count of what went through the proxy, to check the capture addon against.
Records no headers or bodies (nothing secret): method, path, status and the client connection.
"""

from __future__ import annotations

import json

from mitmproxy import ctx, http


class FlowWitness:
    def load(self, loader) -> None:
        loader.add_option("witness_log", str, "", "JSONL file that gets one line per completed flow.")

    def _write(self, flow: http.HTTPFlow, status: int | None, error: str | None) -> None:
        path = ctx.options.witness_log
        if not path:
            return
        line = {"method": flow.request.method, "host": flow.request.pretty_host, "path": flow.request.path,
                "status": status, "error": error, "client_conn": flow.client_conn.id}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def response(self, flow: http.HTTPFlow) -> None:
        self._write(flow, flow.response.status_code if flow.response else None, None)

    def error(self, flow: http.HTTPFlow) -> None:
        self._write(flow, None, str(flow.error))


addons = [FlowWitness()]
