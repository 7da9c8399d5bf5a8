"""What a wire-format parser returns: one model call reduced to the fields of a call-log row.

Why a shared shape: the three format modules (chat, responses, messages) differ on the wire, but
the row writer, the renderer and the status logic only need this.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedCall:
    #: The response as the client saw it (non-streamed: the body; streamed: reassembled).
    response: dict[str, Any] | None = None
    model: str | None = None
    #: Ids the server returned itself (None when it returned none); an ``int32`` numpy array where
    #: the row worker read a prompt's worth of them as one (:mod:`~.id_arrays`).
    prompt_ids: Sequence[int] | None = None
    completion_ids: Sequence[int] | None = None
    completion_logprobs: list[float] | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    tool_call_count: int = 0
    #: The output as a chat-completions assistant message (for rendering its token ids).
    assistant: dict[str, Any] | None = None
    #: Whether the output ended naturally (end of turn: the template's end token was sampled).
    stopped: bool = False
    #: False when the stream ended before its final event (truncated).
    complete: bool = True
    #: A parse problem (malformed JSON/SSE) worth recording; the call is then an upstream_error.
    error: str | None = None
    #: An error the server itself reported (vLLM's ``{"error": ...}`` chunk, a Responses ``error``
    #: event or ``failed`` response, a Messages ``error`` event): the call is an upstream_error
    #: with this text, whatever tokens came before it.
    server_error: str | None = None
    #: Something the row should say about a call that is fine otherwise (events after the final
    #: event, a chat stream that ended without ``[DONE]`` after its final usage chunk).
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Injection:
    """A request body after injection, and what the client itself asked for (to strip the rest)."""

    body: dict[str, Any]
    asked: dict[str, Any]
    changed: bool


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def error_text(value: Any) -> str:
    """An error object as the server wrote it, for the row's ``error``: its message, then its type
    and code where it names them (``boom (BadRequestError, code 400)``); anything else as JSON."""
    if isinstance(value, dict):
        message = value.get("message")
        if isinstance(message, str) and message:
            extra = [str(value[k]) if k == "type" else f"code {value[k]}"
                     for k in ("type", "code") if value.get(k) is not None and not isinstance(value.get(k), (dict, list))]
            return f"{message} ({', '.join(extra)})" if extra else message
    if isinstance(value, str) and value:
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


_INT_ONLY = {int}


def int_list(value: Any) -> list[int] | None:
    """A copy of a list of ints (no bools), else None. Types are collected in C (a prompt's ids
    run to tens of thousands: a generator of isinstance checks took ~85 ns per id, this ~20)."""
    if isinstance(value, list) and set(map(type, value)) <= _INT_ONLY:
        return list(value)
    return None

