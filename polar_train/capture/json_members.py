"""A JSON object's members with where each value lies in the text: parse once, change a few values
in place.

Why: a Responses stream repeats the whole response object (the harness's instructions and tool
schemas, tens of KiB for Codex) in its envelope events, and the proxy must set one or two of its
members back to what the client would have got without our injection. Parsing the event and
re-serialising all of it costs ~0.5 ms per event on mitmproxy's event loop; walking the object's
top level with the C scanner (``json``'s own, so values and errors are exactly ``json.loads``') and
splicing only the changed values costs a fraction, and every other byte stays as the server sent it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from .redact import utf8

_SCAN = json.JSONDecoder().scan_once
_WS = re.compile(r"[ \t\n\r]*")
_COMPACT_KEY = re.compile(r'"([^"\\\x00-\x1f]*+)":(?![ \t\n\r])')
#: One encoder for all of it: ``json.dumps`` with non-default arguments builds a new one per call
#: (~3 us, half of a short value's encoding; the request hook encodes five per call).
_ENCODE_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

#: ``skip[key](text, pos)``: the end of the value of ``key`` at ``pos`` if it can be proven valid
#: JSON without parsing it (else None: it is parsed); the member's value is then :data:`SKIPPED`.
Skipper = Callable[[str, int], "int | None"]


class _Skipped:
    """A value that was proven well-formed but not parsed (never ``None``, never equal to a value)."""

    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED: Any = _Skipped()


class Member(NamedTuple):
    key: str
    value: Any
    start: int  # text[start:end] is the value as written
    end: int


class EchoCache:
    """Values that come again and again (a harness's instructions and tool schemas, in every request
    of a session and echoed by vLLM in three events per call), remembered as text once json's
    scanner has parsed them, so that a later object holding the same text skips parsing it.

    Why: Codex sends tens of KiB of them with every call; the scanner builds Python objects for all
    of it only to find where it ends (most of a ~0.3 ms walk per event or request). Only strings,
    arrays and objects are remembered: each ends at its own closing character, so text that starts
    with a remembered one holds exactly that value there (a number could go on: ``12`` / ``123``).
    Bounded: the ``size`` texts used last, each of ``min_len``..``max_len`` characters.
    """

    def __init__(self, size: int = 8, min_len: int = 256, max_len: int = 1 << 18) -> None:
        self.size, self.min_len, self.max_len = size, min_len, max_len
        self.texts: list[str] = []  # most recently used first

    def skip(self, text: str, pos: int) -> int | None:
        """A :data:`Skipper`: the end of a remembered value at ``pos``, else None."""
        for i, known in enumerate(self.texts):
            if text.startswith(known, pos):
                if i:
                    self.texts.insert(0, self.texts.pop(i))
                return pos + len(known)
        return None

    def learn(self, text: str, member: Member) -> None:
        """Remember a member's value that json's scanner parsed (not one that was skipped)."""
        if member.value is not SKIPPED and text[member.start] in '"[{':
            self.remember(text, member.start, member.end)

    def remember(self, text: str, start: int, end: int) -> None:
        """Remember ``text[start:end]``, a well-formed string, array or object, if its length is
        within bounds (used first; the least recently used beyond ``size`` is forgotten)."""
        if self.min_len <= end - start <= self.max_len:
            self.texts.insert(0, text[start:end])
            del self.texts[self.size:]

    def clear(self) -> None:
        self.texts.clear()


class PrefixCache(EchoCache):
    """Arrays that come again one element longer: a harness resends its whole conversation with
    every call (chat ``messages``, Responses ``input``), the last one plus the new turns.

    Why: parsing tens to hundreds of KiB of history on mitmproxy's event loop, only to inject two
    top-level flags, was the largest piece of a chat call's request hook (~270 us per 100 KiB in
    the proxy). An array whose text starts with a remembered array's text up to its closing
    bracket holds those elements exactly (the same characters parse the same way); only what
    follows - ``,`` and the new elements, each parsed by json's scanner, then ``]`` - is read.
    The longest remembered head wins; a conversation's newer, longer text replaces its older one.
    """

    def __init__(self, size: int = 8, min_len: int = 256, max_len: int = 1 << 20) -> None:
        super().__init__(size, min_len, max_len)  # ``texts`` holds each array without its "]"

    def skip(self, text: str, pos: int) -> int | None:
        matched = [i for i, head in enumerate(self.texts) if text.startswith(head, pos)]
        if not matched:
            return None
        best = max(matched, key=lambda i: len(self.texts[i]))
        end = _array_tail(text, pos + len(self.texts[best]))
        if end is not None and (best or len(matched) > 1):
            # used first from now on; a shorter head that matched too is a head of it: it makes way
            # (one learned after it, e.g. the same turns without a space before "]", stayed)
            self.texts = [self.texts[best]] + [k for i, k in enumerate(self.texts) if i not in matched]
        return end

    def learn(self, text: str, member: Member) -> None:
        """Remember an array's text, parsed or proven by :meth:`skip` (its own heads make way)."""
        if (not self.min_len <= member.end - member.start <= self.max_len or text[member.start] != "["
                or _WS.match(text, member.start + 1).end() == member.end - 1):  # "[]": no element to go on from
            return
        if (self.texts and len(self.texts[0]) == member.end - 1 - member.start
                and text.startswith(self.texts[0], member.start)):
            return  # the conversation skip() just matched, unchanged: remembered already, used last
        head = text[member.start:member.end - 1]
        self.texts = [known for known in self.texts if not head.startswith(known)]
        self.texts.insert(0, head)
        del self.texts[self.size:]


def _array_tail(text: str, i: int) -> int | None:
    """The end of an array whose text up to ``i`` is a proven array's without its ``]``: what
    follows must be ``]`` or ``,`` + values, each read by json's scanner (None: it is not)."""
    ws, scan = _WS.match, _SCAN
    i = ws(text, i).end()
    while True:
        c = text[i:i + 1]
        if c == "]":
            return i + 1
        if c != ",":
            return None
        try:
            _, i = scan(text, ws(text, i + 1).end())
        except (StopIteration, ValueError):  # no value there, or a broken one: the caller parses it
            return None
        i = ws(text, i).end()


def skippers(caches: dict[str, EchoCache]) -> dict[str, Skipper]:
    """Each cache's skipper under its key (for :func:`members`)."""
    return {key: cache.skip for key, cache in caches.items()}


def remember(caches: dict[str, EchoCache], text: str, found: list[Member]) -> None:
    """Each cache learns the values of its key that :func:`members` parsed in ``found``."""
    for m in found:
        cache = caches.get(m.key)
        if cache is not None:
            cache.learn(text, m)


def members(text: str, start: int, skip: dict[str, Skipper] | None = None) -> tuple[list[Member], int]:
    """The members of the object at ``text[start]`` in the order written (duplicates kept) and the
    index after its closing brace. Raises ``ValueError`` unless a well-formed object starts there
    (what ``json.loads`` would reject, this rejects)."""
    if text[start:start + 1] != "{":
        raise ValueError(f"no object at {start}")
    out: list[Member] = []
    append, compact_key, scan, make = out.append, _COMPACT_KEY.match, _SCAN, tuple.__new__  # ~1 us/member less
    skip_get = skip.get if skip else None
    i = start + 1
    if text[i:i + 1] != '"':
        i = _WS.match(text, i).end()
        if text[i:i + 1] == "}":
            return out, i + 1
    while True:
        m = compact_key(text, i)
        if m is not None:  # "key": as servers write it (no escapes, no spaces): one match
            key = m[1]
            i = m.end()
        else:
            if text[i:i + 1] != '"':
                raise ValueError(f"expected a key at {i}")
            key, i = scan(text, i)
            i = _WS.match(text, i).end()
            if text[i:i + 1] != ":":
                raise ValueError(f"expected ':' at {i}")
            i = _WS.match(text, i + 1).end()
        skipper = skip_get(key) if skip_get is not None else None
        end = skipper(text, i) if skipper is not None else None
        if end is not None:
            append(make(Member, (key, SKIPPED, i, end)))
        else:
            try:
                value, end = scan(text, i)
            except StopIteration:
                raise ValueError(f"expected a value at {i}") from None
            append(make(Member, (key, value, i, end)))
        i = end
        c = text[i:i + 1]
        if c == ",":
            i += 1
            if text[i:i + 1] != '"':
                i = _WS.match(text, i).end()
            continue
        if c != "}":
            i = _WS.match(text, i).end()
            c = text[i:i + 1]
            if c == ",":
                i = _WS.match(text, i + 1).end()
                continue
            if c != "}":
                raise ValueError(f"expected ',' or '}}' at {i}")
        return out, i + 1


def objects(text: str, start: int, skip: dict[str, Skipper] | None = None) -> tuple[list[list[Member]], int]:
    """An array of objects at ``text[start]``: each one's :func:`members`, and the index after the
    closing bracket. ``ValueError`` unless a well-formed array of objects starts there."""
    if text[start:start + 1] != "[":
        raise ValueError(f"no array at {start}")
    out: list[list[Member]] = []
    i = _WS.match(text, start + 1).end()
    if text[i:i + 1] == "]":
        return out, i + 1
    while True:
        found, i = members(text, i, skip)
        out.append(found)
        i = _WS.match(text, i).end()
        c = text[i:i + 1]
        if c == "]":
            return out, i + 1
        if c != ",":
            raise ValueError(f"expected ',' or ']' at {i}")
        i = _WS.match(text, i + 1).end()


def as_dict(found: list[Member]) -> dict[str, Any]:
    """What ``json.loads`` makes of the members: the last value of a repeated key wins."""
    return {m.key: m.value for m in found}


def unique(found: list[Member]) -> bool:
    """Whether no key is repeated (where one is, only the JSON path knows which value counts)."""
    return len({m.key for m in found}) == len(found)


def compact(value: Any) -> str:
    """``value`` as compact JSON, UTF-8 as is: how vLLM writes, and how the capture writes every
    splice, re-encoded event, stripped body and row JSON (keys unescaped, which
    :func:`~.redact.redacted_dumps` relies on)."""
    return _ENCODE_COMPACT(value)


def skip_whitespace(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    return _WS.match(text, i).end()


def replacements(found: list[Member], new: dict[str, Any]) -> list[tuple[int, int, str]]:
    """Spans for :func:`splice_utf8` that give every member whose key is in ``new`` that value
    (:func:`compact`; a repeated key gets it everywhere)."""
    return [(m.start, m.end, compact(new[m.key])) for m in found if m.key in new]


def splice_utf8(data: bytes, text: str, spans: list[tuple[int, int, str]], base: int = 0,
                end: int | None = None) -> bytes:
    """``data`` with the text it holds at ``data[base:end]`` (``text``, UTF-8) spliced: each ``(start,
    end, new)`` span of ``text`` (character indices, not overlapping) replaced by ``new``. The same
    bytes as re-encoding ``text`` with the spans replaced, between ``data[:base]`` and ``data[end:]``.

    Why: an envelope event or a Codex request is tens of KiB and a splice changes a few values;
    encoding all of it again cost more than the walk's splice itself. Character indices become
    byte offsets for free in ASCII text, else by encoding the text from the point before or to the
    end, whichever is shorter (a final event's cuts - the parts' logprobs, top_logprobs, the raw
    message tokens - are far from both ends but near each other)."""
    encoded_len = (len(data) if end is None else end) - base
    ordered = sorted(spans)
    points = [i for start, stop, _ in ordered for i in (start, stop)]
    if not text.isascii():
        offsets, before, before_at = [], 0, 0
        for i in points:  # from the point before or from the end, whichever is nearer
            if i - before <= len(text) - i:
                at = before_at + len(text[before:i].encode("utf-8"))
            else:
                at = encoded_len - len(text[i:].encode("utf-8"))
            offsets.append(at)
            before, before_at = i, at
        points = offsets
    pieces: list[bytes] = []
    at = 0
    for k, (_, _, new) in enumerate(ordered):
        pieces.append(data[at:base + points[2 * k]])
        pieces.append(utf8(new))  # a value holding a lone surrogate: its JSON escape
        at = base + points[2 * k + 1]
    pieces.append(data[at:])
    return b"".join(pieces)


def splice_bytes(data: bytes, spans: list[tuple[int, int, str]], base: int = 0) -> bytes | None:
    """``data`` with each ``(start, end, new)`` span of the text at ``data[base:]`` replaced by
    ``new``, for text read one character per byte (:mod:`~.byte_text`: indices are byte offsets).
    None when a replacement is not ASCII: from such text it may hold misread characters (the
    caller takes its JSON path)."""
    pieces: list[bytes] = []
    at = 0
    for start, stop, new in sorted(spans):
        if not new.isascii():
            return None
        pieces.append(data[at:base + start])
        pieces.append(new.encode("ascii"))
        at = base + stop
    pieces.append(data[at:])
    return b"".join(pieces)
