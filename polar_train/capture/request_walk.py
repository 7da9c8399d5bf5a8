"""A request body read member by member, so that the injection changes only the members it names.

Why: Codex sends its instructions, tool schemas and whole history with every Responses call, and
the injection must change a member it already has (``include``); re-encoding the object after
``json.loads`` cost ~0.3 ms per 33 KiB on mitmproxy's event loop (more with a long history), before
the request can leave. Walking the top level with json's own scanner gives the same values and the
span of each, so the changed members are spliced and the new ones inserted after the opening brace,
while every other byte goes upstream as the client wrote it. The echoed instructions and tools are
not even parsed when an earlier request held the same text (:class:`~.json_members.EchoCache`).
Anything unusual (not UTF-8, a byte-order mark, not an object) returns None: the caller parses and
re-encodes as before.
"""

from __future__ import annotations

from typing import Any

from .json_members import (SKIPPED, EchoCache, Member, as_dict, compact, members, remember, replacements,
                           skip_whitespace, skippers, splice_utf8)


class WalkedRequest:
    """The request's top level: ``obj`` (what ``json.loads`` gives, except that members a skipper
    proved well-formed hold :data:`~.json_members.SKIPPED`), its members with spans, its text and
    the body it was decoded from."""

    __slots__ = ("obj", "found", "text", "start", "body")

    def __init__(self, obj: dict[str, Any], found: list[Member], text: str, start: int, body: bytes) -> None:
        self.obj, self.found, self.text, self.start, self.body = obj, found, text, start, body


def walk_request(body: bytes, echoes: dict[str, EchoCache] | None = None) -> WalkedRequest | None:
    """The body's top-level members, or None where only ``json.loads`` can say (the caller falls
    back to it; invalid JSON included, so its error message stays json's). Members named in
    ``echoes`` are skipped when their cache knows the text, and remembered when parsed."""
    try:
        text = body.decode("utf-8")
        start = skip_whitespace(text, 0)
        found, end = members(text, start, skippers(echoes) if echoes else None)
    except (ValueError, RecursionError):  # UnicodeDecodeError included; JSON nested past Python's limit
        return None
    if skip_whitespace(text, end) != len(text):
        return None
    if echoes:
        remember(echoes, text, found)
    return WalkedRequest(as_dict(found), found, text, start, body)


def splice_injection(walked: WalkedRequest, injected: dict[str, Any]) -> bytes | None:
    """The body with ``injected``'s new and changed members (compact JSON), every other byte as sent
    (a repeated key gets the new value everywhere, so the last one - what ``json.loads`` keeps -
    is it). None if a member was removed or a skipped one changed (the caller re-encodes)."""
    obj = walked.obj
    if not obj.keys() <= injected.keys():
        return None
    changed = {k: v for k, v in injected.items() if k in obj and not (v is obj[k] or v == obj[k])}
    if any(obj[k] is SKIPPED for k in changed):
        return None
    added = [f"{compact(k)}:{compact(v)}" for k, v in injected.items() if k not in obj]
    cuts = replacements(walked.found, changed)
    if added:
        at = walked.start + 1
        cuts.append((at, at, ",".join(added) + ("," if walked.found else "")))
    return splice_utf8(walked.body, walked.text, cuts)
