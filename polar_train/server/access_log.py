"""The server's access log, as vLLM's (uvicorn's request lines), without query strings.

Why: a log line per request lets a user count what the server answered (each harness call, its
status) beside the capture; uvicorn's lines carry the query string, where a client may put a key
(``?key=...``), so it is cut off and marked.
"""

from __future__ import annotations

import copy
import logging
from typing import Any


class DropQuery(logging.Filter):
    """Cut the query string off every path among a record's arguments: uvicorn's access lines
    (client, method, path with query, version, status) and its WebSocket handshake lines, which
    go to its error logger (``'%s - "WebSocket %s" [accepted]'``: client, path with query)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(a.split("?", 1)[0] + "?…" if isinstance(a, str) and a.startswith("/") and "?" in a
                                else a for a in record.args)
        return True


def log_config() -> dict[str, Any]:
    """uvicorn's default logging config with :class:`DropQuery` on both its handlers."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["drop_query"] = {"()": f"{__name__}.DropQuery"}
    for handler in config["handlers"].values():
        handler["filters"] = [*handler.get("filters", []), "drop_query"]
    return config
