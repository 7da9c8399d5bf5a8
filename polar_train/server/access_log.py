"""The server's access log, as vLLM's (uvicorn's request lines), without query strings.

Why: a log line per request lets a user count what the server answered (each harness call, its
status) beside the capture; uvicorn's lines carry the query string, where a client may put a key
(``?key=...``), so it is cut off and marked.
"""

from __future__ import annotations

import asyncio
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


class DropShutdownCancels(logging.Filter):
    """Drop uvicorn's "Exception in ASGI application" traceback for a stream it cut at a stop
    (``timeout_graceful_shutdown`` exceeded: the stop was asked for, the cut is its purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:  # (a chain may loop back on itself)
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
                return False
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return True


def log_config() -> dict[str, Any]:
    """uvicorn's default logging config with :class:`DropQuery` on both its handlers and
    :class:`DropShutdownCancels` on its error log."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    filters = config.setdefault("filters", {})
    filters["drop_query"] = {"()": f"{__name__}.DropQuery"}
    filters["drop_shutdown_cancels"] = {"()": f"{__name__}.DropShutdownCancels"}
    for name, handler in config["handlers"].items():
        handler["filters"] = [*handler.get("filters", []), "drop_query"]
        if name == "default":  # the error logger's
            handler["filters"].append("drop_shutdown_cancels")
    return config
