"""Server-sent events framing, byte-exact with vLLM: compact JSON, ``ensure_ascii=False``.

vLLM writes ``data: {json}\\n\\n`` for chat and ``event: NAME\\ndata: {json}\\n\\n`` for the
Responses and Messages APIs.
"""

from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_data(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


def sse_event(event: str, obj: Any) -> bytes:
    return f"event: {event}\ndata: {dumps(obj)}\n\n".encode()
