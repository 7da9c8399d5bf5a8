"""Request fields as vLLM's pydantic models read them in lax mode, shared by the server (which
answers a bad value as vLLM does) and the capture addon (which must know what the client asked).

Why: vLLM reads ``"stream": "true"``, ``"return_token_ids": 1`` and ``"top_logprobs": "2.0"`` as
``True``/``True``/``2``; Python's ``is True`` or ``isinstance(v, int)`` would not, and the addon
then stripped what the client had asked for.
"""

from __future__ import annotations

import re
from typing import Any

#: An integer as pydantic reads one from text: a sign, ASCII digits (``_`` between them), and a
#: fraction of zeros at most ("4.0" is 4; "4.5" and "4." are no integers).
INT_TEXT = re.compile(r"([+-]?[0-9](?:_?[0-9])*)(?:\.0+)?", re.ASCII)
#: Text pydantic reads as a boolean (compared in lower case, not trimmed).
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_true(value: Any) -> bool:
    """Whether vLLM reads a boolean request field as true: ``True``, ``1`` or a true word."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1
    return isinstance(value, str) and value.lower() in TRUE_WORDS


def lax_bool_or_none(value: Any) -> bool:
    """Whether vLLM takes a boolean request field as given (absent, null, or a value it reads as
    true or false): the capture may then set it without changing whether the request is refused."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return value in (0, 1)
    return isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS


def lax_int(value: Any) -> int | None:
    """An integer request field as vLLM reads it: ``2``, ``2.0``, ``"2"``, ``"2.0"``, ``"1_000"``,
    ``true``; else None (a value the server refuses)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = INT_TEXT.fullmatch(value.strip())
        return int(m[1]) if m else None
    return None
