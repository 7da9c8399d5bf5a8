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
    """Cut the query string off the path of uvicorn's access record (its args: client address,
    method, path with query, HTTP version, status code)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?…", *args[3:])
        return True


def log_config() -> dict[str, Any]:
    """uvicorn's default logging config with :class:`DropQuery` on the access handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["drop_query"] = {"()": f"{__name__}.DropQuery"}
    config["handlers"]["access"]["filters"] = ["drop_query"]
    return config
