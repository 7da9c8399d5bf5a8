"""``POST /v1/messages`` (Anthropic, what Claude Code uses) in vLLM 0.32's shapes.

The request becomes chat messages as vLLM converts it: ``system`` (string or text blocks, Claude
Code's per-request ``x-anthropic-billing-header`` block dropped) first, ``thinking`` blocks as the
assistant's reasoning, ``tool_use`` as tool calls, ``tool_result`` as tool messages. vLLM returns
no token ids here; ``usage.input_tokens`` is the true prompt count. Unknown fields are ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from . import constraints
from .common import CHAT_MEDIA_PARTS, check_model, integer, keep_specials, refuse_images, sampling
from .completion import CompletionState
from .hermes_stream import is_json
from .errors import PydanticError, VllmError, field_error, missing, validation_error, value_error
from .fields import flag, strings
from .parse import random_id
from .prompt import encode_prompt, render
from .script import RequestView
from .sse import sse_event
from ..wire.anthropic import chat_messages, chat_tools, request_template_kwargs

_OBJECT = "Input should be a valid dictionary or object to extract fields from"


def _union_str_list(loc: str, value: Any) -> list[dict]:
    """``str | list[...]``: pydantic reports both branches."""
    return [field_error("string_type", loc, "Input should be a valid string", value),
            field_error("list_type", loc, "Input should be a valid list", value)]


#: ``AnthropicContentBlock.type`` in vLLM 0.32: a block of any other type (``document``,
#: ``search_result``, ...) is its 400 (it was dropped from the prompt and answered 200: a probe).
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
               "tool_addition", "tool_removal")
_BLOCK_TYPES_EXPECTED = ", ".join(f"'{t}'" for t in BLOCK_TYPES[:-1]) + f" or '{BLOCK_TYPES[-1]}'"
#: The block's fields typed ``str | None`` (a number there was rendered as its text).
_BLOCK_STRINGS = ("text", "id", "tool_use_id", "name", "tool_name", "thinking", "signature", "data")


def _block_errors(loc: str, block: dict) -> list[dict]:
    """One ``AnthropicContentBlock`` as its pydantic model refuses it, field by field."""
    errors = []
    if "type" not in block:
        errors.append(missing(f"{loc}.type", block))
    elif block["type"] not in BLOCK_TYPES:
        errors.append(field_error("literal_error", f"{loc}.type", f"Input should be {_BLOCK_TYPES_EXPECTED}",
                                  block["type"], {"expected": _BLOCK_TYPES_EXPECTED}))
    for key in _BLOCK_STRINGS:
        if block.get(key) is not None and not isinstance(block[key], str):
            errors.append(field_error("string_type", f"{loc}.{key}", "Input should be a valid string", block[key]))
    for key in ("source", "input"):
        if block.get(key) is not None and not isinstance(block[key], dict):
            errors.append(field_error("dict_type", f"{loc}.{key}", "Input should be a valid dictionary", block[key]))
    if not errors and block["type"] in ("tool_addition", "tool_removal") and block.get("tool") is None:
        text = f"tool is required for {block['type']} blocks"  # (its model validator, after the fields)
        errors.append(field_error("value_error", loc, f"Value error, {text}", block, {"error": ValueError(text)}))
    return errors


def _blocks(loc: str, value: Any) -> list[dict]:
    """``str | list[AnthropicContentBlock]`` (a message's ``content``, ``system``)."""
    if isinstance(value, str):
        return []
    if not isinstance(value, list):
        return _union_str_list(loc, value)
    bad = []
    for j, b in enumerate(value):
        bad += _block_errors(f"{loc}.{j}", b) if isinstance(b, dict) else [
            field_error("model_attributes_type", f"{loc}.{j}", _OBJECT, b)]
    return [field_error("string_type", loc, "Input should be a valid string", value)] + bad if bad else []


def _objects(errors: list[dict], value: Any, loc: str) -> list[tuple[str, dict]]:
    """The objects of a ``list[...]`` field with their locations; a value that is no list, or an
    item that is no object, is pydantic's error (added to ``errors``)."""
    if not isinstance(value, list):
        errors.append(field_error("list_type", loc, "Input should be a valid list", value))
        return []
    found = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            found.append((f"{loc}.{i}", item))
        else:
            errors.append(field_error("model_attributes_type", f"{loc}.{i}", _OBJECT, item))
    return found


_THINKING_TAGS = "'enabled', 'disabled', 'adaptive'"


def _thinking_errors(thinking: Any) -> list[dict]:
    """``thinking``: vLLM's union tagged by ``type`` (a bogus one was served as if absent: a probe)."""
    if thinking is None:
        return []
    if not isinstance(thinking, dict):
        return [field_error("model_attributes_type", "body.thinking", _OBJECT, thinking)]
    if "type" not in thinking:
        return [field_error("union_tag_not_found", "body.thinking", "Unable to extract tag using discriminator "
                            "'type'", thinking, {"discriminator": "'type'"})]
    if thinking["type"] not in ("enabled", "disabled", "adaptive"):
        return [field_error("union_tag_invalid", "body.thinking", f"Input tag {thinking['type']!r} found using "
                            f"'type' does not match any of the expected tags: {_THINKING_TAGS}", thinking,
                            {"discriminator": "'type'", "tag": thinking["type"], "expected_tags": _THINKING_TAGS})]
    return []


def check_shapes(body: dict, count_only: bool) -> None:
    """The fields vLLM's ``AnthropicMessagesRequest`` types, refused as its pydantic model refuses
    them, every failing field at once in field order (vLLM's validation handler answers these in
    the OpenAI error shape, even on this API)."""
    errors: list[dict] = []
    if "model" not in body:
        errors.append(missing("body.model", body))
    if "messages" not in body:
        errors.append(missing("body.messages", body))
    for loc, m in _objects(errors, body.get("messages", []), "body.messages"):
        if "role" not in m:
            errors.append(missing(f"{loc}.role", m))
        elif m["role"] not in ("user", "assistant", "system"):
            expected = "'user', 'assistant' or 'system'"
            errors.append(field_error("literal_error", f"{loc}.role", f"Input should be {expected}",
                                      m["role"], {"expected": expected}))
        if "content" not in m:
            errors.append(missing(f"{loc}.content", m))
        else:
            errors += _blocks(f"{loc}.content", m["content"])
    if not count_only and "max_tokens" not in body:
        errors.append(missing("body.max_tokens", body))
    if not count_only and body.get("stop_sequences") is not None:
        try:
            strings(body, "stop_sequences", allow_str=False)
        except PydanticError as exc:
            errors += exc.errors
    if body.get("system") is not None:
        errors += _blocks("body.system", body["system"])
    errors += _thinking_errors(body.get("thinking"))
    tools = body.get("tools")
    for loc, t in _objects(errors, tools, "body.tools") if tools is not None else []:
        if "name" not in t:
            errors.append(missing(f"{loc}.name", t))
        elif not isinstance(t["name"], str):
            errors.append(field_error("string_type", f"{loc}.name", "Input should be a valid string",
                                      t["name"]))
        if "input_schema" not in t:
            errors.append(missing(f"{loc}.input_schema", t))
    if errors:
        raise PydanticError(errors)


def prepare(server, body: dict, count_only: bool = False) -> dict[str, Any]:
    check_shapes(body, count_only)
    if not count_only and server.script is None:  # a script's answer is fixed
        constraints.check_messages(body)
    model = check_model(body, server.served_name, required_=True)
    tools = chat_tools(body.get("tools"))
    messages = chat_messages(body)
    refuse_images(messages, model, CHAT_MEDIA_PARTS)  # (a tool_result's image too: Claude Code's Read of a PNG)
    text = render(server.tokenizer, messages, tools or None, kwargs=request_template_kwargs(body))
    prompt_ids = encode_prompt(server.engine, text)
    req: dict[str, Any] = {"model": model, "prompt_ids": prompt_ids, "stream": False}
    if count_only:
        return req
    max_tokens = integer(body, "max_tokens", None)
    if max_tokens is None:  # `"max_tokens": null`: the field is an int, not Optional
        raise validation_error("int_type", "max_tokens", "Input should be a valid integer", None)
    if max_tokens < 1:  # vLLM's field validator
        raise value_error("body.max_tokens", "max_tokens must be positive", body["max_tokens"])
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = integer(thinking, "budget_tokens", None)
        if budget is not None and budget < 1024:
            raise PydanticError([field_error(
                "greater_than_equal", "body.thinking.enabled.budget_tokens",
                "Input should be greater than or equal to 1024", thinking["budget_tokens"],
                {"ge": 1024})])
        if budget is not None and budget >= max_tokens:
            raise value_error("body", "thinking.budget_tokens must be less than max_tokens", body)
        # vLLM sends it on as the chat request's thinking_token_budget (a 400 there without a
        # reasoning parser): a budget this server would not keep is refused, as on the chat route
        if server.script is None:  # (a script's answer is fixed)
            raise VllmError("`thinking` {'type': 'enabled'} (a thinking_token_budget) is not supported by "
                            "polar-train serve; use {'type': 'adaptive'}", param="thinking")
    choice = body.get("tool_choice") if isinstance(body.get("tool_choice"), dict) else {}
    tool_choice = choice.get("type", "auto")
    req.update({
        "params": sampling(body, server.engine, len(prompt_ids), ("max_tokens",),
                           stop_key="stop_sequences", clamp=server.script is not None,
                           budget_name="max_completion_tokens", bias=False),
        "view": RequestView("anthropic.messages", messages, [t["function"]["name"] for t in tools]),
        # vLLM: its hermes parser reads every answer unless tool_choice is none (a request without
        # tools or tool_choice too: streamed, its calls are tool_use blocks), but a non-streamed
        # answer keeps calls only where tools were given
        "tools_enabled": tool_choice != "none", "calls_kept": bool(tools),
        # vLLM: the chat request's parallel_tool_calls (only the first call is kept)
        "parallel_tool_calls": not flag(choice, "disable_parallel_tool_use",
                                        field="tool_choice.disable_parallel_tool_use"),
        "stream": flag(body, "stream"),
        "id": f"chatcmpl-{random_id()}",
    })
    keep_specials(req["params"], bool(tools) and tool_choice != "none")
    return req


def stop_reason(finish_reason: str, stop: int | str | None, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """vLLM's ``_to_anthropic_stop_reason``: ``max_tokens`` always wins; a matched stop string wins
    unless the calls are complete (a call it cut short must not run)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


async def respond(server, req: dict[str, Any]) -> dict[str, Any]:
    state = CompletionState(server.engine, req["tools_enabled"], req["params"])
    async for step in server.tokens(req):
        state.push(step)
    parsed = state.final()
    calls = parsed.tool_calls if req["calls_kept"] else []
    calls = calls if req["parallel_tool_calls"] else calls[:1]
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": uuid.uuid4().hex})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for c in calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
    if not content:
        content.append({"type": "text", "text": ""})
    finish = "tool_calls" if calls else (state.finish.reason if state.finish else "length")
    reason, seq = stop_reason(finish, state.finish.stop_reason if state.finish else None,
                              bool(calls), bool(calls))
    out = {"id": req["id"], "type": "message", "role": "assistant", "content": content,
           "model": req["model"], "stop_reason": reason}
    if seq is not None:
        out["stop_sequence"] = seq
    out["usage"] = {"input_tokens": len(req["prompt_ids"]), "output_tokens": len(state.steps)}
    return out


async def stream(server, req: dict[str, Any]) -> AsyncIterator[bytes]:
    """vLLM's ``message_stream_converter`` over the chat stream's deltas: a block per kind, a
    ``tool_use`` block per call (its arguments' pieces as ``input_json_delta``), text that arrives
    while a call's block is open sent as a text block of its own once that block closes."""
    n_in = len(req["prompt_ids"])
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": req["id"], "type": "message", "role": "assistant", "content": [], "model": req["model"],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_in, "output_tokens": 0}}})
    state = CompletionState(server.engine, req["tools_enabled"], req["params"])
    index = 0  # the next block's index
    open_kind: str | None = None
    open_call: str | None = None  # the open tool_use block's id
    pending: list[str] = []
    call_ids: dict[int, str] = {}
    tool_used, last_args = False, []

    def start(block: dict[str, Any]) -> bytes:
        nonlocal open_kind, open_call
        open_kind, open_call = block["type"], block.get("id")
        return sse_event("content_block_start", {"type": "content_block_start",
                                                 "content_block": block, "index": index})

    def stop() -> list[bytes]:
        nonlocal open_kind, open_call, index
        if open_kind is None:
            return []
        evs = []
        if open_kind == "thinking":
            evs.append(delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        evs.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        open_kind, open_call = None, None
        pending.clear()
        index += 1
        return evs

    def stop_and_flush() -> list[bytes]:
        held = "".join(pending)
        evs = stop()
        if held:
            evs.append(start({"type": "text", "text": ""}))
            evs.append(delta({"type": "text_delta", "text": held}))
            evs.extend(stop())
        return evs

    def delta(d: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "delta": d, "index": index})

    async for step in server.tokens(req):
        d = state.push(step)
        if d.reasoning:
            if open_kind != "thinking":
                for b in [*stop_and_flush(), start({"type": "thinking", "thinking": ""})]:
                    yield b
            yield delta({"type": "thinking_delta", "thinking": d.reasoning})
        if d.content:
            if open_kind == "tool_use":
                pending.append(d.content)
            else:
                if open_kind != "text":
                    for b in [*stop_and_flush(), start({"type": "text", "text": ""})]:
                        yield b
                yield delta({"type": "text_delta", "text": d.content})
        for c in d.call_deltas:
            if not req["parallel_tool_calls"] and c.index != 0:
                continue
            if c.id is not None:
                call_ids[c.index] = c.id
                if open_call != c.id and c.name is not None:
                    for b in stop_and_flush():
                        yield b
                    tool_used, last_args = True, []
                    yield start({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
            if c.arguments and open_call is not None and open_call == call_ids.get(c.index):
                last_args.append(c.arguments)
                yield delta({"type": "input_json_delta", "partial_json": c.arguments})
    for b in stop_and_flush():
        yield b
    f = state.finish
    finish = "tool_calls" if state.hermes.streamed_calls and f is not None and f.reason == "stop" \
        else (f.reason if f is not None else "length")
    reason, seq = stop_reason(finish, f.stop_reason if f is not None else None, tool_used,
                              tool_used and is_json("".join(last_args)))
    yield sse_event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": seq},
                                      "usage": {"input_tokens": n_in, "output_tokens": len(state.steps)}})
    yield sse_event("message_stop", {"type": "message_stop"})
