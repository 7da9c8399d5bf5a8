"""vLLM 0.32's streaming ``hermes`` tool parser, step for step.

Why: a client (and our capture addon) reads tool calls from the stream's deltas, and vLLM sends
them piece by piece - the name with the call's id as soon as ``"name": "..."`` is complete, then
each new stretch of the arguments' *raw model text* (not re-dumped JSON) - while the text before
the first ``<tool_call>`` streams as content, holding back only a suffix that may be the start of
the tag. Sending each call whole once its ``</tool_call>`` arrived (what this server did) hid
what a client of vLLM must handle: a call cut by ``max_tokens`` streams its name and half its
arguments, and a malformed block streams whatever its text says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .parse import TOOL_CALL_END, TOOL_CALL_START, tool_call_id

_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


@dataclass
class ToolCallDelta:
    """One entry of a streamed delta's ``tool_calls``: the call's first entry carries its id and
    name, the later ones a piece of its arguments' text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text`` (vLLM's helper)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_json(text: str) -> bool:
    """Whether ``text`` is one whole JSON value (vLLM's ``is_complete_json`` / Anthropic ``_is_json``)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call_jsons(text: str) -> list[tuple[str, bool]]:
    """(JSON text, complete) of each ``<tool_call>`` region so far (``_extract_tool_call_jsons``)."""
    out: list[tuple[str, bool]] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) != -1:
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        if end != -1:
            out.append((text[body_start:end].strip(), True))
            pos = end + len(TOOL_CALL_END)
            continue
        raw = text[body_start:]
        overlap = partial_tag_overlap(raw, TOOL_CALL_END)
        body = (raw[:-overlap] if overlap else raw).strip()
        out.append((body, is_json(body) if body else False))
        break
    return out


def _arguments(body: str, complete: bool) -> str | None:
    """The arguments' text of a call's JSON so far; a complete one without the outer ``}``."""
    m = _ARGUMENTS.search(body)
    if m is None:
        return None
    raw = body[m.end():]
    if complete:
        raw = raw.rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
    return raw


class HermesStream:
    """Feed the whole content text so far (append-only); get what is new to send."""

    def __init__(self) -> None:
        self._sent_content = 0
        self._names: list[str | None] = []
        self._sent_arguments: list[str] = []
        self._arguments_sent: list[bool] = []
        #: whether any delta carried a tool call (vLLM's ``tools_streamed``: finish reason ``tool_calls``)
        self.streamed_calls = False

    def feed(self, text: str, finished: bool = False) -> tuple[str | None, list[ToolCallDelta]]:
        """What ``text`` (all of it so far) adds; ``finished``: the stream's last step, whose
        last entry gets the last call's arguments not sent yet - ``{}`` for a call that never
        sent any (vLLM's ``finalize_generation``; appended to whichever call the entry is for)."""
        content, deltas = self._feed(text)
        if finished and deltas and not self._arguments_sent[-1]:
            last = deltas[-1]
            last.arguments = (last.arguments or "") + "{}"
        return content, deltas

    def _feed(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        content = self._content(text)
        try:
            regions = _call_jsons(text)
        except RecursionError:  # vLLM logs the parser's exception and sends nothing this step
            return None, []
        deltas: list[ToolCallDelta] = []
        for i, (body, complete) in enumerate(regions):
            if i >= len(self._names):
                self._names.append(None)
                self._sent_arguments.append("")
                self._arguments_sent.append(False)
            if self._names[i] is None:
                m = _NAME.search(body)
                if m is None:
                    break  # the next call cannot start before this one's name
                self._names[i] = m.group(1)
                deltas.append(ToolCallDelta(i, id=tool_call_id(), name=m.group(1)))
            args = _arguments(body, complete)
            if args is not None and len(args) > len(self._sent_arguments[i]):
                deltas.append(ToolCallDelta(i, arguments=args[len(self._sent_arguments[i]):]))
                self._sent_arguments[i] = args
                self._arguments_sent[i] = True
        if deltas:
            self.streamed_calls = True
        return content, deltas

    def _content(self, text: str) -> str | None:
        """Unsent text before the first ``<tool_call>``, less a suffix that may start the tag."""
        if TOOL_CALL_START in text:
            sendable = text.index(TOOL_CALL_START)
        else:
            sendable = len(text) - partial_tag_overlap(text, TOOL_CALL_START)
        if sendable > self._sent_content:
            piece = text[self._sent_content:sendable]
            self._sent_content = sendable
            return piece
        return None
