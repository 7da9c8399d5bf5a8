"""What a wire-format parser returns: one model call reduced to the fields of a call-log row.

Why a shared shape: the three format modules (chat, responses, messages) differ on the wire, but
the row writer, the renderer and the status logic only need this.
"""

from __future__ import annotations

import re
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


#: Text pydantic's lax mode reads as true (vLLM's request models): ``"true"``, ``"yes"``, ``"1"``...
_LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})


def lax_true(value: Any) -> bool:
    """Whether vLLM reads a boolean request field as true: ``True``, ``1`` or a true word. A
    client that sent ``"return_token_ids": "true"`` asked for the ids as surely as with ``true``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1
    return isinstance(value, str) and value.lower() in _LAX_TRUE


#: An integer as pydantic reads one from text: a sign, ASCII digits (``_`` between them), a
#: fraction of zeros at most ("2.0" is 2).
_INT_TEXT = re.compile(r"([+-]?[0-9](?:_?[0-9])*)(?:\.0+)?", re.ASCII)


def lax_int(value: Any) -> int | None:
    """An integer request field as vLLM (pydantic's lax mode) reads it: ``2``, ``2.0``, ``"2"``,
    ``"2.0"``, ``"1_000"``, ``true``; else None (a value the server refuses)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _INT_TEXT.fullmatch(value.strip())
        return int(m[1]) if m else None
    return None


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

