"""Completion tokens → what the wire formats report: text, reasoning, tool calls.

One parser for every API (chat, responses, messages) and for both sampled and scripted turns, so
they all have the same shape. Tool calls follow vLLM's ``hermes`` parser (``<tool_call>`` JSON
blocks; content = the text before the first block as sampled, its newline too, ``None`` when
empty; arguments re-dumped with ``ensure_ascii=False``; streamed: :mod:`.hermes_stream`).
Reasoning is parsed only when the completion *starts* with ``<think>``
(what our template renders for a turn with reasoning), so a sampled turn that never opens a think
block keeps all its text as content, like vLLM without a reasoning parser.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def random_id(n: int = 16) -> str:
    """vLLM-style random hex id suffix (``chatcmpl-<16 hex>``)."""
    return secrets.token_hex(n // 2)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object as text
    id: str = field(default_factory=tool_call_id)


@dataclass
class ParsedTurn:
    reasoning: str | None
    content: str | None
    tool_calls: list[ParsedToolCall]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``<think>\\nR\\n</think>\\n\\nC`` → (R, C), with the template's wrapping newlines removed,
    so that sending R and C back renders the same text again."""
    if not text.startswith(THINK_START):
        return None, text
    body = text[len(THINK_START):]
    if THINK_END not in body:  # still thinking (cut by max_tokens)
        return body.strip("\n"), ""
    reasoning, _, rest = body.partition(THINK_END)
    return reasoning.strip("\n"), rest.lstrip("\n")


def _parse_block(body: str) -> ParsedToolCall | None:
    """A block's call, or None where vLLM's would fail (no JSON object, no ``name`` string - its
    ``FunctionCall`` model refuses another type -, no ``arguments``)."""
    try:
        obj = json.loads(body)
        if not isinstance(obj["name"], str):
            return None
        return ParsedToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))
    except (ValueError, KeyError, TypeError):
        return None


def parse_tool_calls(text: str, tools_enabled: bool) -> tuple[str | None, list[ParsedToolCall]]:
    """hermes: (content before the first ``<tool_call>`` - none where blank -, parsed calls); a
    block that does not parse turns the whole text back into content, with no calls (vLLM's
    non-streamed parser)."""
    if not tools_enabled or TOOL_CALL_START not in text:
        return text, []
    calls = []
    for m in _TOOL_CALL_RE.finditer(text):
        call = _parse_block(m.group(1) if m.group(1) is not None else m.group(2))
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[: text.find(TOOL_CALL_START)]
    return (content if content.strip() else None), calls


def parse_turn(text: str, tools_enabled: bool) -> ParsedTurn:
    reasoning, rest = split_reasoning(text)
    content, calls = parse_tool_calls(rest, tools_enabled)
    return ParsedTurn(reasoning, content, calls)
