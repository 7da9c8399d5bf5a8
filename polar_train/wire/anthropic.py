"""Anthropic Messages requests (Claude Code's API) as chat messages and tools, as vLLM converts them.

``system`` (string or text blocks; Claude Code's per-request ``x-anthropic-billing-header`` block
dropped) first, ``thinking`` blocks as the assistant's reasoning, ``tool_use`` as tool calls,
``tool_result`` as tool messages (its images as a user message after it), images as ``image_url``
parts; server tools (web_search, ...) are not shown to the model.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import BadRequest
from .render import BILLING_HEADER, function_tool, template_kwargs


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


def image_url(source: Any) -> str:
    """vLLM's ``_convert_image_source_to_url``: a URL source as is, any other as a data URI."""
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: dict) -> list[dict[str, Any]]:
    """A user's ``tool_result`` as vLLM converts it: the tool message (its text blocks joined by
    newlines), then a user message of its images and a tool message of its ``tool_reference``
    blocks, where it has them (a Claude Code ``Read`` of a PNG; its deferred-tool search)."""
    content, call_id = block.get("content"), block.get("tool_use_id") or ""
    texts: list[str] = []
    images: list[str] = []
    references: list[dict[str, Any]] = []
    for item in content if isinstance(content, list) else []:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            texts.append(item.get("text", ""))
        elif kind == "image" and (url := image_url(item.get("source", {}))):
            images.append(url)
        elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
            references.append({"type": "tool_reference", "name": name})
    text = content if isinstance(content, str) else "\n".join(texts)
    out = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


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
        if role == "system":  # (vLLM's _extract_system_text: a string that opens with Claude Code's
            # attribution line goes whole, where the top-level system keeps its other lines)
            text = "" if isinstance(content, str) and content.startswith(BILLING_HEADER) else _system_text(content)
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
            elif kind == "image" and block.get("source"):  # (a text-only model's server refuses it)
                parts.append({"type": "image_url", "image_url": {"url": image_url(block["source"])}})
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or "", "type": "function",
                              "function": {"name": block.get("name") or "",
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                if role == "user":
                    out += _tool_result(block)
                else:
                    parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
        if reasoning:
            m["reasoning"] = "".join(reasoning)
        if calls:
            m["tool_calls"] = calls
        if parts:
            m["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
        if role == "user" and "content" not in m:
            continue
        out.append(m)  # (an assistant turn with nothing vLLM keeps - an empty text, only redacted thinking -
        # is an empty turn: it was left out, and the prompt lost its "<|im_start|>assistant\n<|im_end|>\n")
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
        out.append(function_tool(t["name"], t.get("description"), t.get("input_schema"), t.get("strict"),
                                 t.get("defer_loading")))
    return out




def request_template_kwargs(body: dict) -> dict[str, Any]:
    """The template kwargs vLLM renders a Messages request with: its ``chat_template_kwargs`` and a
    reasoning effort from ``output_config.effort`` (Claude Code sends "high"), "none" under
    ``thinking: {"type": "disabled"}`` (vLLM's default effort for disabled thinking)."""
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = "none"
    return template_kwargs(body.get("chat_template_kwargs"), effort)
