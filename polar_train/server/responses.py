"""``POST /v1/responses`` (what Codex CLI uses) in vLLM 0.32's shapes.

Input items become chat messages the way vLLM converts them (reasoning + function calls of one
assistant turn merge into one message; ``custom`` tools are shown to the model as a function with
a single ``input`` string, vLLM's shim). vLLM extensions: ``enable_response_messages`` puts
``input_messages`` / ``output_messages`` (``raw_message_tokens``) into the final response, and
``include: ["message.output_text.logprobs"]`` + ``top_logprobs`` adds per-token logprobs.
"""

from __future__ import annotations

import json
import time

import partial_json_parser
from partial_json_parser.core.options import Allow
from collections.abc import AsyncIterator
from typing import Any

from . import constraints
from .common import (CHAT_MEDIA_PARTS, check_model, integer, keep_specials, max_logprobs, number, refuse_images,
                     sampling, unsupported_part)
from .completion import CompletionState, Delta, TokenStep
from .hermes_stream import ToolCallDelta
from .errors import PydanticError, ResponseNotFound, ResponsesInvalidRequest, VllmError, field_error
from .fields import flag, list_of, required, str_or_list
from .fields import text as text_field
from .parse import ParsedToolCall, random_id, tool_call_id
from .prompt import encode_prompt, render
from .script import RequestView
from .sse import sse_event
from ..wire.errors import BadRequest
from ..wire.responses import (CUSTOM_INPUT_KEY, NAMESPACE_SEPARATOR, chat_tools, input_messages,
                              request_template_kwargs)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: vLLM's sampling extensions its Responses request has (its ``to_sampling_params``); the chat
#: request's others (``min_tokens``, ``allowed_token_ids``, ``bad_words`` ...) it ignores
EXTRAS = frozenset({"stop_token_ids", "ignore_eos", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "skip_special_tokens",
                    "include_stop_str_in_output"})


def _uuid() -> str:
    return random_id(16)


def echo_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as vLLM echoes them in the response object."""
    out = []
    for t in tools:
        if t.get("type") == "function":
            out.append({"name": t["name"], "parameters": t.get("parameters"), "strict": t.get("strict"),
                        "type": "function", "allowed_callers": None, "async": None,
                        "defer_loading": None, "description": t.get("description"),
                        "output_schema": None})
        elif t.get("type") == "custom":
            out.append({"name": t["name"], "type": "custom", "allowed_callers": None, "async": None,
                        "defer_loading": None, "description": t.get("description"),
                        "format": t.get("format")})
        elif t.get("type") == "namespace":
            out.append({"description": t.get("description"), "name": t.get("name"), "tools": [
                {"name": f.get("name"), "type": f.get("type"), "allowed_callers": None, "async": None,
                 "defer_loading": None, "description": f.get("description"), "output_schema": None,
                 "parameters": f.get("parameters"), "strict": f.get("strict")}
                for f in t.get("tools") or [] if isinstance(f, dict)], "type": "namespace"})
        elif t.get("type") == "web_search":
            out.append({"type": "web_search", "external_web_access": t.get("external_web_access"),
                        "filters": t.get("filters"), "search_context_size": t.get("search_context_size"),
                        "user_location": t.get("user_location")})
        else:
            out.append(t)
    return out


def before_validators(body: dict) -> dict:
    """vLLM's ``mode="before"`` validators of the Responses request, in its words; returns the
    request as its field validation then sees it (``tool_choice`` "none" added without tools)."""
    if body.get("background") and not body.get("store", True):
        raise VllmError("background can only be used when `store` is true", param="background")
    if body.get("prompt") is not None:
        raise VllmError("prompt template is not supported", param="prompt")
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    has_tools = isinstance(tools, (list, str, dict)) and len(tools) > 0
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not has_tools:
        if choice in ("auto", "none"):
            return {**body, "tool_choice": "none"}
        if choice == "required":
            raise VllmError("Tool choice 'required' must be specified with 'tools' parameter.",
                            param="tool_choice")
        if named:
            raise VllmError("Tool choice 'function' not found in 'tools' parameter.",
                            param="tool_choice")
    elif named and not choice.get("name"):
        raise VllmError("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
    return body


#: The content parts of a Responses message item, by role (the OpenAI types vLLM validates against:
#: input parts in any role, the assistant's output parts too); any other was dropped from the
#: prompt and answered 200 (a probe: vLLM's 400).
_INPUT_PARTS = ("input_text", "input_image", "input_file")
_ASSISTANT_PARTS = (*_INPUT_PARTS, "output_text", "refusal")


def check_content_parts(items: Any) -> None:
    """Refuse a part of a message item or of a tool's output that vLLM refuses: ``input_file`` (its
    chat parser has none), a part of another API (``text``, ``input_audio``) or of no known type
    (its request model)."""
    for i, item in enumerate(items if isinstance(items, list) else []):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ("function_call_output", "custom_tool_call_output"):
            parts, allowed, field, holder = item.get("output"), _INPUT_PARTS, "output", "a tool's output"
        elif kind == "message":
            role = item.get("role")
            parts, allowed, field = item.get("content"), _ASSISTANT_PARTS if role == "assistant" else _INPUT_PARTS, \
                "content"
            holder = f"a {role!r} message"
        else:
            continue
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            if not isinstance(part, dict):
                continue
            if part.get("type") == "input_file":
                raise unsupported_part("input_file")
            if part.get("type") not in allowed:
                raise BadRequest(f"input[{i}].{field}[{j}]: a part of type {part.get('type')!r} is no part of "
                                 f"{holder} (one of {', '.join(allowed)})", param="body.input")


def prepare(server, body: dict) -> dict[str, Any]:
    str_or_list(required(before_validators(body), "input"), "body.input")
    if server.script is None:  # a script's answer is fixed
        constraints.check_responses(body)
    text_field(body, "instructions")
    tools = list_of(body, "tools") or []
    include = list_of(body, "include") or []
    model = check_model(body, server.served_name)
    if body.get("background") and body.get("store", True):  # vLLM without VLLM_ENABLE_RESPONSES_API_STORE
        raise ResponsesInvalidRequest(
            "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
            "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
            "launching the vLLM server.", param="background")
    if body.get("previous_input_messages") and body.get("previous_response_id"):
        raise ResponsesInvalidRequest("Only one of `previous_input_messages` and `previous_response_id` can be set.",
                                      param="previous_response_id")
    if body.get("previous_response_id") is not None:  # nothing is stored, so no id is ever found (as vLLM's)
        raise ResponseNotFound(f"Response with id '{body['previous_response_id']}' not found.",
                               param="response_id")
    for item in body["input"] if isinstance(body["input"], list) else []:
        if isinstance(item, dict) and item.get("type") == "reasoning" and item.get("encrypted_content"):
            raise VllmError("Encrypted content is not supported.", param="input")
    ctools = chat_tools(tools)
    check_content_parts(body["input"])
    for key, allowed in (("service_tier", ("auto", "default", "flex", "scale", "priority")),
                         ("truncation", ("auto", "disabled"))):
        if body.get(key) is not None and body[key] not in allowed:
            expected = ", ".join(f"'{a}'" for a in allowed[:-1]) + f" or '{allowed[-1]}'"
            raise PydanticError([field_error("literal_error", f"body.{key}", f"Input should be {expected}", body[key],
                                             {"expected": expected})])
    try:
        messages = input_messages(body)
    except BadRequest as exc:  # (vLLM's own check: its type, its suffix)
        if exc.message.startswith("Unsupported input item type"):
            raise VllmError(exc.message, param="input") from None
        raise
    refuse_images(messages, model, CHAT_MEDIA_PARTS)  # (a tool output's image too: Codex's view_image)
    tool_choice = body.get("tool_choice", "auto")
    top = integer(body, "top_logprobs", None)
    want_logprobs = LOGPROBS_INCLUDE in include
    if want_logprobs and top:
        max_logprobs(top, server.engine.vocab_size)
    text = render(server.tokenizer, messages, ctools or None, kwargs=request_template_kwargs(body))
    prompt_ids = encode_prompt(server.engine, text)
    if len(prompt_ids) == server.engine.max_model_len:  # (vLLM's Responses serving checks this first)
        raise ResponsesInvalidRequest(f"The engine prompt length {len(prompt_ids)} exceeds the max_model_len "
                                      f"{server.engine.max_model_len}. Please reduce prompt.", param="input")
    params = sampling(body, server.engine, len(prompt_ids), ("max_output_tokens",),
                      top_logprobs=(top or 0) if want_logprobs else 0, clamp=server.script is not None,
                      extras=EXTRAS)
    keep_specials(params, bool(ctools) and tool_choice != "none")
    view = RequestView("openai.responses", messages, [t["function"]["name"] for t in ctools])
    return {
        "model": model, "body": body, "prompt_ids": prompt_ids, "prompt_text": text, "params": params,
        "view": view, "tools": tools, "tools_enabled": bool(ctools) and tool_choice != "none",
        "tool_choice": tool_choice if tools else "none",
        "custom_names": {t["name"] for t in tools if t.get("type") == "custom"},
        "namespaces": namespace_map(tools),
        "logprobs": want_logprobs, "top_logprobs": top,
        "response_messages": flag(body, "enable_response_messages"),
        # vLLM (run with a tool parser) hides reasoning, and with it the text's logprobs
        "include_reasoning": flag(body, "include_reasoning", True),
        "parallel_tool_calls": flag(body, "parallel_tool_calls", True),
        "stream": flag(body, "stream"),
        # vLLM's request_id (the body's, else a new one) is the response's id
        "id": body["request_id"] if isinstance(body.get("request_id"), str) else f"resp_{_uuid()}",
        "created": int(time.time()),
    }


# -- response objects -------------------------------------------------------------------------

#: The fields of vLLM's Reasoning and text-config models, echoed with every field (null where not given).
_REASONING_FIELDS = ("context", "effort", "generate_summary", "mode", "summary")
_TEXT_FIELDS = ("format", "verbosity")


def _echoed(value: Any, fields: tuple[str, ...]) -> Any:
    """A request object as vLLM echoes it: its model's fields in order, null where not given."""
    return {k: value.get(k) for k in fields} if isinstance(value, dict) else value


def response_object(req: dict[str, Any], status: str, output: list, usage: dict | None,
                    incomplete: bool = False, messages: tuple | None = None) -> dict[str, Any]:
    body = req["body"]
    return {
        "id": req["id"], "created_at": req["created"],
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"),
        "model": req["model"], "object": "response", "output": output,
        "parallel_tool_calls": req["parallel_tool_calls"],  # (null echoed as the default, as vLLM does)
        "temperature": number(body, "temperature", 1.0), "tool_choice": req["tool_choice"],
        "tools": echo_tools(req["tools"]), "top_p": number(body, "top_p", 1.0),
        "background": False, "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"), "previous_response_id": None,
        "prompt": body.get("prompt"), "reasoning": _echoed(body.get("reasoning"), _REASONING_FIELDS),
        "service_tier": body.get("service_tier") or "auto", "status": status,
        "text": _echoed(body.get("text"), _TEXT_FIELDS),
        # (vLLM echoes top_logprobs only where the logprobs are included)
        "top_logprobs": req["top_logprobs"] if req["logprobs"] else None,
        "truncation": body.get("truncation") or "disabled", "usage": usage,
        "user": body.get("user"), "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "kv_transfer_params": None, "ec_transfer_params": None,
        "input_messages": messages[0] if messages else None,
        "output_messages": messages[1] if messages else None,
    }


def usage(prompt_len: int, out_len: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_len,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": out_len,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": prompt_len + out_len,
    }


def logprobs_full(server, steps) -> list[dict[str, Any]]:
    e = server.engine
    out = []
    for s in steps:
        text = e.logprob_token(s.token_id, s.before)
        tops = [(e.logprob_token(i, s.before), lp) for i, lp in s.top]
        out.append({"token": text, "bytes": list(text.encode()), "logprob": s.logprob,
                    "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": lp}
                                     for t, lp in tops]})
    return out


def logprobs_delta(server, steps) -> list[dict[str, Any]]:
    e = server.engine
    return [{"token": e.logprob_token(s.token_id, s.before), "logprob": s.logprob,
             "top_logprobs": [{"token": e.logprob_token(i, s.before), "logprob": lp} for i, lp in s.top]}
            for s in steps]


def raw_messages(server, req: dict[str, Any], state: CompletionState) -> tuple[list, list]:
    ids = state.token_ids
    return ([{"message": req["prompt_text"], "tokens": req["prompt_ids"], "type": "raw_message_tokens"}],
            [{"message": server.tokenizer.decode(ids, skip_special_tokens=True), "tokens": ids,
              "type": "raw_message_tokens"}])


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "summary": [], "type": "reasoning",
            "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": None,
            "status": None}


def message_item(item_id: str, text: str, logprobs: list | None) -> dict[str, Any]:
    return {"id": item_id, "content": [{"annotations": [], "text": text, "type": "output_text",
                                        "logprobs": logprobs}],
            "role": "assistant", "status": "completed", "type": "message", "phase": None}


def namespace_map(tools: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    out = {}
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "namespace":
            for f in t.get("tools") or []:
                if isinstance(f, dict) and isinstance(f.get("name"), str):
                    out[t["name"] + NAMESPACE_SEPARATOR + f["name"]] = (t["name"], f["name"])
    return out


def call_item(req: dict[str, Any], item_id: str, call) -> dict[str, Any]:
    if call.name in req["custom_names"]:
        return {"call_id": call.id, "input": custom_input(call.arguments),
                "name": call.name, "type": "custom_tool_call", "id": item_id, "async": None,
                "caller": None, "namespace": None}
    namespace, name = req["namespaces"].get(call.name, (None, call.name))
    return {"arguments": call.arguments, "call_id": call.id, "name": name, "type": "function_call",
            "id": item_id, "async": None, "caller": None, "namespace": namespace, "status": "completed"}


def _is_custom(req, call) -> bool:
    return call.name in req["custom_names"]


async def respond(server, req: dict[str, Any]) -> dict[str, Any]:
    state = CompletionState(server.engine, req["tools_enabled"], req["params"])
    async for step in server.tokens(req):
        state.push(step)
    parsed = state.final()
    shown = req["include_reasoning"]
    calls = parsed.tool_calls if req["parallel_tool_calls"] else parsed.tool_calls[:1]
    output: list[dict[str, Any]] = []
    if parsed.reasoning and shown:
        output.append(reasoning_item(f"rs_{_uuid()}", parsed.reasoning))
    if parsed.content:
        output.append(message_item(f"msg_{_uuid()}", parsed.content,
                                   logprobs_full(server, state.steps) if req["logprobs"] and shown else None))
    for call in calls:  # (fresh ids, as vLLM's: the calls' ids are the chat parser's)
        output.append(call_item(req, ("ctc_" if _is_custom(req, call) else "fc_") + _uuid(), call))
    incomplete = state.finish.reason == "length"
    return response_object(req, "incomplete" if incomplete else "completed", output,
                           usage(len(req["prompt_ids"]), len(state.steps)), incomplete,
                           raw_messages(server, req, state) if req["response_messages"] else None)


def custom_input(arguments: str) -> str:
    """vLLM's ``decode_custom_tool_input``: the ``input`` of a custom tool call's arguments."""
    try:
        payload = json.loads(arguments)
    except ValueError:
        return arguments
    value = payload.get(CUSTOM_INPUT_KEY) if isinstance(payload, dict) else None
    return value if isinstance(value, str) else arguments


def custom_input_prefix(arguments: str) -> str:
    """vLLM's ``decode_custom_tool_input_prefix``: the longest ``input`` the partial arguments
    decode to (so the streamed deltas stay a prefix of the final input)."""
    try:
        parsed = partial_json_parser.loads(arguments, Allow.STR | Allow.OBJ)
    except (ValueError, IndexError, AssertionError):
        return ""
    value = parsed.get(CUSTOM_INPUT_KEY) if isinstance(parsed, dict) else None
    payload = value if isinstance(value, str) else ""
    if payload and "\ud800" <= payload[-1] <= "\udbff":
        payload = payload[:-1]
    return payload


class _OutputItems:
    """vLLM's ``SimpleStreamingEventProcessor``: one output item open at a time (a message, a
    reasoning item, a tool call); a delta of another kind, or of another call, closes it and opens
    the next. What it closed is the final response's ``output``, exactly as streamed."""

    def __init__(self, server, req: dict[str, Any], ev) -> None:
        self.server, self.req, self.ev = server, req, ev
        self.kind: str | None = None  # "message" | "reasoning" | "call"
        self.output: list[dict[str, Any]] = []
        self.item_id = ""
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.call: dict[str, Any] = {}

    @property
    def index(self) -> int:
        return len(self.output)

    def step(self, d: Delta, step_lps: list[TokenStep]) -> list[bytes]:
        """The events of one step's delta: reasoning, then content, then each call's entries."""
        parts: list[tuple[str, Any]] = []
        if d.reasoning:
            parts.append(("reasoning", d.reasoning))
        if d.content:
            parts.append(("message", d.content))
        groups: dict[int, list[ToolCallDelta]] = {}
        for c in d.call_deltas:
            if self.req["parallel_tool_calls"] or c.index == 0:
                groups.setdefault(c.index, []).append(c)
        parts.extend(("call", g) for g in groups.values())
        evs: list[bytes] = []
        for kind, value in parts:
            if kind != self.kind or (kind == "call" and value[0].index != self.call["index"]):
                evs += self.close() + self.open(kind, value)
            evs += self.delta(kind, value, step_lps)
        return evs

    def open(self, kind: str, value: Any) -> list[bytes]:
        self.kind, self.text, self.logprobs = kind, "", []
        at = {"output_index": self.index}
        if kind == "call":
            first = value[0]
            custom = first.name in self.req["custom_names"]
            self.item_id = ("ctc_" if custom else "fc_") + _uuid()
            self.call = {"index": first.index, "id": first.id or tool_call_id(), "name": first.name,
                         "custom": custom, "payload": ""}
            item = self._call_item("")
            item.update({"input": ""} if custom else {"status": "in_progress"})
            return [self.ev("response.output_item.added", {"item": item, **at})]
        if kind == "reasoning":
            self.item_id = f"rs_{_uuid()}"
            item = {"id": self.item_id, "summary": [], "type": "reasoning", "content": None,
                    "encrypted_content": None, "status": "in_progress"}
            part = {"text": "", "type": "reasoning_text"}
        else:
            self.item_id = f"msg_{_uuid()}"
            item = {"id": self.item_id, "content": [], "role": "assistant", "status": "in_progress",
                    "type": "message", "phase": None}
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return [self.ev("response.output_item.added", {"item": item, **at}),
                self.ev("response.content_part.added", {"content_index": 0, "item_id": self.item_id,
                                                        "part": part, **at})]

    def delta(self, kind: str, value: Any, steps: list[TokenStep]) -> list[bytes]:
        at = {"item_id": self.item_id, "output_index": self.index}
        if kind == "reasoning":
            self.text += value
            return [self.ev("response.reasoning_text.delta", {"content_index": 0, "delta": value, **at})]
        if kind == "message":
            self.text += value
            shown = self.req["logprobs"] and self.req["include_reasoning"]
            full = logprobs_full(self.server, steps) if shown else []
            self.logprobs += full
            lps = logprobs_delta(self.server, steps) if shown else []
            return [self.ev("response.output_text.delta", {"content_index": 0, "delta": value,
                                                           "logprobs": lps, **at})]
        args = "".join(c.arguments for c in value if c.arguments)
        if not args:
            return []
        self.text += args
        if self.call["custom"]:
            return self._custom_delta(custom_input_prefix(self.text))
        return [self.ev("response.function_call_arguments.delta", {"delta": args, **at})]

    def _call_item(self, arguments: str) -> dict[str, Any]:
        """The open call's item with these arguments, as the non-streamed response writes it."""
        call = ParsedToolCall(self.call["name"], arguments, self.call["id"])
        return call_item(self.req, self.item_id, call)

    def _custom_delta(self, payload: str) -> list[bytes]:
        sent = self.call["payload"]
        if payload == sent:
            return []
        self.call["payload"] = payload
        piece = payload[len(sent):] if payload.startswith(sent) else payload  # (vLLM resends it whole)
        return [self.ev("response.custom_tool_call_input.delta",
                        {"delta": piece, "item_id": self.item_id, "output_index": self.index})]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        at = {"item_id": self.item_id, "output_index": self.index}
        evs: list[bytes] = []
        if self.kind == "call":
            item = self._call_item(self.text)
            if self.call["custom"]:
                evs += self._custom_delta(item["input"])
                evs.append(self.ev("response.custom_tool_call_input.done", {"input": item["input"], **at}))
            else:
                evs.append(self.ev("response.function_call_arguments.done",
                                   {"arguments": self.text, "name": item["name"], **at}))
        elif self.kind == "reasoning":
            part = {"text": self.text, "type": "reasoning_text"}
            item = {"id": self.item_id, "summary": [], "type": "reasoning", "content": [part],
                    "encrypted_content": None, "status": "completed"}
            evs.append(self.ev("response.reasoning_text.done", {"content_index": 0, "text": self.text, **at}))
            evs.append(self.ev("response.content_part.done", {"content_index": 0, "part": part, **at}))
        else:
            part = {"annotations": [], "text": self.text, "type": "output_text",
                    "logprobs": self.logprobs or None}
            item = {"id": self.item_id, "content": [part] if self.text else [], "role": "assistant",
                    "status": "completed", "type": "message", "phase": None}
            evs.append(self.ev("response.output_text.done", {"content_index": 0, "logprobs": [],
                                                             "text": self.text, **at}))
            evs.append(self.ev("response.content_part.done", {"content_index": 0, "part": part, **at}))
        evs.append(self.ev("response.output_item.done", {"item": item, "output_index": self.index}))
        self.output.append(item)
        self.kind = None
        return evs


async def stream(server, req: dict[str, Any]) -> AsyncIterator[bytes]:
    seq = 0

    def ev(kind: str, payload: dict[str, Any]) -> bytes:
        nonlocal seq
        # top-level keys in name order, as vLLM's (OpenAI's pydantic event types declare them so)
        data = dict(sorted({**payload, "sequence_number": seq, "type": kind}.items()))
        seq += 1
        return sse_event(kind, data)

    yield ev("response.created", {"response": response_object(req, "in_progress", [], None)})
    yield ev("response.in_progress", {"response": response_object(req, "in_progress", [], None)})
    state = CompletionState(server.engine, req["tools_enabled"], req["params"])
    items = _OutputItems(server, req, ev)
    async for step in server.tokens(req):
        d = state.push(step)
        if not req["include_reasoning"]:
            d.reasoning = ""
        # (a step that adds nothing sends nothing: its tokens' logprobs are in no event, as in vLLM)
        for b in items.step(d, [step]):
            yield b
    for b in items.close():
        yield b
    incomplete = state.finish is not None and state.finish.reason == "length"
    final = response_object(req, "incomplete" if incomplete else "completed", items.output,
                            usage(len(req["prompt_ids"]), len(state.steps)), incomplete,
                            raw_messages(server, req, state) if req["response_messages"] else None)
    yield ev("response.completed", {"response": final})
