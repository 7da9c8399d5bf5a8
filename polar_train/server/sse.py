"""Server-sent events and JSON bodies, byte-exact with vLLM: compact JSON, ``ensure_ascii=False``.

vLLM writes ``data: {json}\\n\\n`` for chat and ``event: NAME\\ndata: {json}\\n\\n`` for the
Responses and Messages APIs.

Why a fallback: JSON may carry a lone surrogate (``"\\ud800"``), which Python reads into a string
that UTF-8 cannot encode. A request's ``metadata``, ``user`` or model name is echoed back: the
answer failed to encode, a 500 with a traceback (a plain-text one where the error's own message
held it), and a stream that had sent its headers ended with no event. A body is answered as vLLM
answers it, a 400 naming the encoding error (:class:`WireJSONResponse`); a stream's event, where
vLLM cuts the stream after its headers, is written with ``\\u`` escapes, which a client's JSON
parser reads as the same string.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _utf8(template: str, obj: Any) -> bytes:
    """``template`` with the JSON of ``obj`` in place of ``{}``, as UTF-8."""
    try:
        return template.format(dumps(obj)).encode()
    except UnicodeEncodeError:  # a lone surrogate echoed from the request: escaped, not a 500
        return template.format(json.dumps(obj, separators=(",", ":"))).encode()


def sse_data(obj: Any) -> bytes:
    return _utf8("data: {}\n\n", obj)


def sse_event(event: str, obj: Any) -> bytes:
    return _utf8(f"event: {event}\n" + "data: {}\n\n", obj)


class WireJSONResponse(JSONResponse):
    """Starlette's JSON response (vLLM's bytes). A body that cannot be encoded (a lone surrogate
    echoed from the request) becomes the 400 vLLM answers then: its exception handler turns the
    ``UnicodeEncodeError`` (a ``ValueError``) into a ``BadRequestError`` naming it, in the OpenAI
    shape on every route (recorded from vLLM 0.32: tests/test_server_validation.py)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError as exc:  # str(exc) writes the character as an escape: it encodes
            self.status_code = 400  # (Response.__init__ sets the status before it renders)
            return super().render({"error": {"message": str(exc), "type": "BadRequestError", "param": None,
                                              "code": 400}})
