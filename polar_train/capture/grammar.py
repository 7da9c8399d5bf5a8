"""Regular expressions for pieces of compact JSON as vLLM writes its stream events: bytes
patterns for raw events, str patterns (``TEXT_*``) for decoded text.

Why: the stream fast paths (``event_stripper`` in the format modules) prove an event has vLLM's
exact shape before splicing ``null`` / ``[]`` over an injected value; strings, numbers and the
logprob entries are matched by their grammar, so nothing in a token's text can fake a key. A raw
line break is never part of a match: in SSE it would end the data line.
"""

from __future__ import annotations

import numpy as np

# Possessive quantifiers (*+, ++): these pieces never need to give characters back, and a prompt's
# ids run to tens of thousands (the possessive INTS matches 200 KB of ids ~25 % faster).
STR = rb'"[^"\\\r\n]*+(?:\\[^\r\n][^"\\\r\n]*+)*+"'
NUM = rb'(?:-?(?:\d++(?:\.\d++)?(?:[eE][-+]?\d++)?|Infinity)|NaN|null)'
INTS = rb'\[(?:\d++(?:,\d++)*+)?\]'
_BYTES = rb'(?:,"bytes":(?:' + INTS + rb'|null))?'
_TOP = rb'\{"token":' + STR + rb',"logprob":' + NUM + _BYTES + rb'\}'
#: One sampled token's logprob entry (chat's ``logprobs.content[i]``, Responses' ``logprobs[i]``).
LOGPROB_ENTRY = (rb'\{"token":' + STR + rb',"logprob":' + NUM + _BYTES
                 + rb',"top_logprobs":\[(?:' + _TOP + rb'(?:,' + _TOP + rb')*)?\]\}')
#: A list of such entries.
LOGPROB_LIST = rb'\[(?:' + LOGPROB_ENTRY + rb'(?:,' + LOGPROB_ENTRY + rb')*)?\]'

# The same pieces for decoded text (str patterns), strict as ``json.loads``: no raw control
# characters, only JSON's escapes, no leading zeros, ASCII digits only (``\d`` in a str pattern
# is any Unicode digit). Used where a value is skipped instead of parsed (``json_members``
# skippers), so what they accept json.loads accepts.
TEXT_STR = r'"[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+"'
TEXT_NUM = r'(?:-?(?:(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?(?:[eE][-+]?[0-9]++)?|Infinity)|NaN)'
TEXT_IDS = r'\[(?:(?:0|[1-9][0-9]*+)(?:,(?:0|[1-9][0-9]*+))*+)?\]'
_TEXT_BYTES = r'(?:,"bytes":(?:' + TEXT_IDS + r'|null))?'
_TEXT_TOP = r'\{"token":' + TEXT_STR + _TEXT_BYTES + r',"logprob":' + TEXT_NUM + r'\}'
_TEXT_ENTRY = (r'\{"token":' + TEXT_STR + _TEXT_BYTES + r',"logprob":' + TEXT_NUM
               + r',"top_logprobs":\[(?:' + _TEXT_TOP + r'(?:,' + _TEXT_TOP + r')*+)?\]\}')
#: A non-empty list of Responses logprob entries in vLLM's key order (``bytes`` after ``token``).
TEXT_LOGPROB_ENTRIES = r'\[' + _TEXT_ENTRY + r'(?:,' + _TEXT_ENTRY + r')*+\]'


# A prompt's token ids (tens of thousands: 70 KiB and more of digits) in the first chat chunk and
# in Responses' raw message tokens. The regex engine takes ~12 ns per byte over them (its loop per
# element); C string methods prove the same list in ~2.7 ns per byte, numpy's vector compares in
# ~0.5 (plus ~8 us of calls: below :data:`VECTOR_FROM_BYTES` the string methods are faster).
_ID_CHARACTERS = b"0123456789,"
VECTOR_FROM_BYTES = 4096
_COMMA, _ZERO = ord(","), ord("0")


def _proper_ids(ids: bytes) -> bool:
    """Whether ``ids`` (between the brackets) is a compact list of non-negative integers that
    ``json.loads`` accepts: digits and single commas, no empty element, no leading zero."""
    if len(ids) >= VECTOR_FROM_BYTES:
        return _proper_ids_vectorised(ids)
    if not ids:
        return True
    if ids.translate(None, _ID_CHARACTERS) or ids[:1] == b"," or ids[-1:] == b"," or b",," in ids:
        return False
    if ids[:1] == b"0" and ids[1:2].isdigit():
        return False
    at = ids.find(b",0")
    while at >= 0:  # an element that starts with 0 (token 0 itself is one): only 0 alone is JSON
        if ids[at + 2:at + 3].isdigit():
            return False
        at = ids.find(b",0", at + 2)
    return True


def _proper_ids_vectorised(ids: bytes) -> bool:
    """:func:`_proper_ids` by byte-wise array compares (the same rules; ``ids`` is not copied)."""
    a = np.frombuffer(ids, np.uint8)
    if a.size == 0:
        return True
    comma = a == _COMMA
    digit = (a - _ZERO) < 10  # uint8 wraps around below "0"
    if np.count_nonzero(comma) + np.count_nonzero(digit) != a.size or comma[0] or comma[-1]:
        return False  # another character, or an empty first or last element
    if a.size == 1:
        return True
    if np.count_nonzero(comma[1:] & comma[:-1]):
        return False  # ",,": an empty element
    zero_then_digit = (a[:-1] == _ZERO) & digit[1:]  # at i: a "0" followed by a digit
    return not (zero_then_digit[0] or np.count_nonzero(zero_then_digit[1:] & comma[:-2]))


def ids_end(data: bytes, pos: int) -> int | None:
    """The end of the compact list of token ids at ``data[pos]`` (``[1,20,3]``; None: not one):
    the list :data:`INTS` matches, proven at C speed and without leading zeros (what JSON allows)."""
    if data[pos:pos + 1] != b"[":
        return None
    end = data.find(b"]", pos + 1)
    return end + 1 if end >= 0 and _proper_ids(data[pos + 1:end]) else None


def text_ids_end(text: str, pos: int) -> int | None:
    """:func:`ids_end` for decoded text (ASCII digits only: ``json.loads`` takes no other)."""
    if text[pos:pos + 1] != "[":
        return None
    end = text.find("]", pos + 1)
    if end < 0:
        return None
    ids = text[pos + 1:end]
    return end + 1 if ids.isascii() and _proper_ids(ids.encode("ascii")) else None
