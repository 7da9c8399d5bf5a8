"""Anthropic Messages requests (Claude Code's API) as chat messages and tools, as vLLM converts them.

``system`` (string or text blocks; Claude Code's per-request ``x-anthropic-billing-header`` block
dropped) first, ``thinking`` blocks as the assistant's reasoning, ``tool_use`` as tool calls,
``tool_result`` as tool messages; server tools (web_search, ...) are not shown to the model.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import BadRequest
from .render import function_tool

BILLING_HEADER = "x-anthropic-billing-header"


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise BadRequest("system must be a string or a list of text blocks", param="system")
    return "".join(b.get("text", "") for b in system
                   if isinstance(b, dict) and b.get("type") == "text" and b.get("text")
                   and not b["text"].startswith(BILLING_HEADER))


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(i.get("text", "") for i in content if isinstance(i, dict) and i.get("type") == "text")
    return ""


def chat_messages(body: dict) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise BadRequest("messages must be a list", param="messages")
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"messages[{i}] needs role user or assistant", param="messages")
        role, content = msg["role"], msg.get("content")
        if role == "system":
            text = _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of blocks",
                             param="messages")
        m: dict[str, Any] = {"role": role}
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            if not isinstance(block, dict):
                raise BadRequest(f"messages[{i}].content blocks must be objects", param="messages")
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or "", "type": "function",
                              "function": {"name": block.get("name") or "",
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                if role == "user":
                    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                                "content": _tool_result_text(block.get("content"))})
                else:
                    parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
        if reasoning:
            m["reasoning"] = "".join(reasoning)
        if calls:
            m["tool_calls"] = calls
        if parts:
            m["content"] = parts[0]["text"] if len(parts) == 1 else parts
        if role == "user" and "content" not in m:
            continue
        if role == "assistant" and not (parts or calls or reasoning):
            continue
        out.append(m)
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadRequest("each tool needs a name", param="tools")
        if t.get("type") not in (None, "custom"):
            continue  # server tools (web_search, ...) cannot run here
        out.append(function_tool(t["name"], t.get("description"), t.get("input_schema")))
    return out


