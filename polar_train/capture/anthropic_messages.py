"""Anthropic Messages (``/v1/messages``, Claude Code): reassembly and chat conversion.

vLLM returns no token ids here (``return_token_ids`` is ignored), so nothing is injected: ids are
rendered with ``polar_tokenizer`` from the equivalent chat messages, converted the way vLLM's own
Anthropic endpoint converts them (system blocks joined, ``tool_use`` -> ``tool_calls``,
``tool_result`` -> ``tool`` messages), and checked against ``usage.input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from ..wire.anthropic import chat_messages, chat_tools, request_template_kwargs
from ..wire.errors import ApiError
from .parsed import Injection, ParsedCall, as_float, as_int, error_text

API = "anthropic.messages"
#: The event that ends a stream (what the row calls its final event).
FINAL_EVENT = "message_stop"
#: vLLM's Messages API has no token ids to ask for: the proxy leaves these requests unread.
INJECTS = False


def inject(body: dict[str, Any]) -> Injection:
    return Injection(body, {}, False)


def strip(obj: dict[str, Any], asked: dict[str, Any]) -> bool:
    return False


def sampling(request: dict[str, Any]) -> tuple[float | None, float | None]:
    return as_float(request.get("temperature")), as_float(request.get("top_p"))


def _finish(parsed: ParsedCall, content: list[Any], stop_reason: Any) -> None:
    texts, reasoning, calls = [], [], []
    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block.get("type") == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif block.get("type") == "tool_use":
            args = block.get("input")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name") or "",
                                       "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
    parsed.finish_reason = stop_reason if isinstance(stop_reason, str) else None
    # a stop sequence cut the text: the tokens sampled after it are not in the reply, and no
    # end-of-turn token was sampled (rendering must not add one)
    parsed.stopped = stop_reason in ("end_turn", "tool_use")
    parsed.tool_call_count = len(calls)
    # (no text: no content - the conversion of the turn sent back drops empty text blocks, and a
    # template reading parts takes "" as a text)
    assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if reasoning:
        assistant["reasoning"] = "".join(reasoning)
    if calls:
        assistant["tool_calls"] = calls
    parsed.assistant = assistant


def _usage(parsed: ParsedCall, usage: Any) -> None:
    if isinstance(usage, dict):
        if as_int(usage.get("input_tokens")) is not None:
            parsed.usage_prompt_tokens = as_int(usage.get("input_tokens"))
        if as_int(usage.get("output_tokens")) is not None:
            parsed.usage_completion_tokens = as_int(usage.get("output_tokens"))


def parse_body(obj: dict[str, Any]) -> ParsedCall:
    parsed = ParsedCall(response=obj, model=obj.get("model") if isinstance(obj.get("model"), str) else None)
    if obj.get("type") == "error":  # an error object in a 2xx body
        parsed.server_error = f"the server reported an error: {error_text(obj.get('error'))}"
    elif not isinstance(obj.get("content"), list):  # a gateway's own error with HTTP 200 ({"detail": ...}): it
        parsed.error = "response has no content list (not a Messages object)"  # was an ok row, built (a probe)
    _usage(parsed, obj.get("usage"))
    content = obj.get("content") if isinstance(obj.get("content"), list) else []
    _finish(parsed, content, obj.get("stop_reason"))
    return parsed


def _index(obj: dict[str, Any], default: int) -> int:
    """A block index; a malformed one (string, list, bool) counts as the default (fuzzed upstreams)."""
    value = obj.get("index", default)
    return as_int(value) if as_int(value) is not None else default


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def parse_stream(events: list[tuple[str | None, Any]], done: bool) -> ParsedCall:
    parsed = ParsedCall()
    message: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, list[str]] = {}
    stop_reason = None
    for name, obj in events:
        if not isinstance(obj, dict):
            parsed.error = parsed.error or "stream event is not a JSON object"
            continue
        kind = obj.get("type") or name
        if kind == "error":  # overloaded_error, api_error ...: the stream ends here
            if parsed.server_error is None:
                parsed.server_error = f"the server reported an error mid-stream: {error_text(obj.get('error'))}"
        elif kind == "message_start" and isinstance(obj.get("message"), dict):
            message = dict(obj["message"])
            _usage(parsed, message.get("usage"))
        elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
            blocks[_index(obj, len(blocks))] = dict(obj["content_block"])
        elif kind == "content_block_delta" and isinstance(obj.get("delta"), dict):
            idx = _index(obj, 0)
            block = blocks.setdefault(idx, {"type": "text", "text": ""})
            delta = obj["delta"]
            if delta.get("type") == "text_delta":
                block["text"] = _str(block.get("text")) + _str(delta.get("text"))
            elif delta.get("type") == "thinking_delta":
                block["thinking"] = _str(block.get("thinking")) + _str(delta.get("thinking"))
            elif delta.get("type") == "signature_delta":  # the thinking block's signature, as in a whole reply
                block["signature"] = _str(block.get("signature")) + _str(delta.get("signature"))
            elif delta.get("type") == "input_json_delta":
                partial_json.setdefault(idx, []).append(delta.get("partial_json") or "")
        elif kind == "message_delta":
            d = obj.get("delta") if isinstance(obj.get("delta"), dict) else {}
            stop_reason = d.get("stop_reason", stop_reason)
            if "stop_sequence" in d:
                message["stop_sequence"] = d["stop_sequence"]
            _usage(parsed, obj.get("usage"))
    for idx, pieces in partial_json.items():
        try:
            blocks[idx]["input"] = json.loads("".join(pieces)) if "".join(pieces) else {}
        except ValueError:
            blocks[idx]["input"] = "".join(pieces)
    content = [blocks[i] for i in sorted(blocks)]
    message.update({"content": content, "stop_reason": stop_reason,
                    "usage": {"input_tokens": parsed.usage_prompt_tokens,
                              "output_tokens": parsed.usage_completion_tokens}})
    parsed.model = message.get("model") if isinstance(message.get("model"), str) else None
    parsed.response = message
    parsed.complete = done
    _finish(parsed, content, stop_reason)
    return parsed


def is_done_event(name: str | None, data: str | None) -> bool:
    return name == "message_stop"


def to_chat(request: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat messages and tools of a Messages request, converted exactly as the server does
    (:mod:`polar_train.wire.anthropic`, vLLM's Anthropic endpoint), for rendering."""
    try:
        messages = chat_messages(request)
        tools = chat_tools(request.get("tools"))
    except ApiError as exc:
        raise ValueError(f"cannot convert the request to chat messages: {exc.message}") from None
    return messages, tools or None


def template_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """The template kwargs vLLM renders this request with (:func:`~polar_train.wire.anthropic.request_template_kwargs`:
    Claude Code's ``output_config.effort``, a disabled thinking), for rendering."""
    return request_template_kwargs(request)
