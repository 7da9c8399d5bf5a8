"""What a wire-format parser returns: one model call reduced to the fields of a call-log row.

Why a shared shape: the three format modules (chat, responses, messages) differ on the wire, but
the row writer, the renderer and the status logic only need this.
"""

from __future__ import annotations

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


_INT_ONLY = {int}


def int_list(value: Any) -> list[int] | None:
    """A copy of a list of ints (no bools), else None. Types are collected in C (a prompt's ids
    run to tens of thousands: a generator of isinstance checks took ~85 ns per id, this ~20)."""
    if isinstance(value, list) and set(map(type, value)) <= _INT_ONLY:
        return list(value)
    return None

