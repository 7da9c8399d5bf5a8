"""OpenAI Responses (``/v1/responses``, Codex CLI): injection, stripping, reassembly.

vLLM (0.32) returns server-exact ids here only when asked: ``enable_response_messages: true``
puts ``input_messages`` / ``output_messages`` (``[{message, tokens, type: raw_message_tokens}]``)
into the final response (streaming: only into ``response.completed``), and logprobs need
``include: ["message.output_text.logprobs"]`` plus ``top_logprobs``. Without those flags the
server sends ``input_messages: null``, ``top_logprobs: null``, ``logprobs: null`` in finished
content parts and ``logprobs: []`` in deltas; stripping restores exactly that.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ..wire.errors import ApiError
from ..wire.responses import CUSTOM_INPUT_KEY, NAMESPACE_SEPARATOR, chat_tools, input_messages
from .grammar import INTS, LOGPROB_LIST, STR
from .parsed import Injection, ParsedCall, as_float, as_int, int_list
from .sse import parse_event, serialize_event

API = "openai.responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def inject(body: dict[str, Any]) -> Injection:
    include = body.get("include") if isinstance(body.get("include"), list) else []
    asked = {
        "response_messages": body.get("enable_response_messages") is True,
        "logprobs": LOGPROBS_INCLUDE in include,
        "has_top_logprobs": "top_logprobs" in body,
        "top_logprobs": body.get("top_logprobs"),
    }
    new = dict(body)
    changed = False
    if not asked["response_messages"]:
        new["enable_response_messages"] = True
        changed = True
    if not asked["logprobs"]:
        new["include"] = [*include, LOGPROBS_INCLUDE]
        changed = True
    if not isinstance(body.get("top_logprobs"), int):
        new["top_logprobs"] = 0
        changed = True
    return Injection(new, asked, changed)


def _strip_content(content: Any) -> bool:
    changed = False
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and isinstance(part.get("logprobs"), list) and part["logprobs"]:
            part["logprobs"] = None
            changed = True
    return changed


def _strip_response(resp: dict[str, Any], asked: dict[str, Any]) -> bool:
    changed = False
    if not asked.get("response_messages"):
        for key in ("input_messages", "output_messages"):
            if resp.get(key) is not None:
                resp[key] = None
                changed = True
    if not asked.get("has_top_logprobs") and resp.get("top_logprobs") is not None:
        resp["top_logprobs"] = None
        changed = True
    elif asked.get("has_top_logprobs") and resp.get("top_logprobs") != asked.get("top_logprobs"):
        resp["top_logprobs"] = asked.get("top_logprobs")
        changed = True
    if not asked.get("logprobs"):
        output = resp.get("output")
        for item in output if isinstance(output, list) else ():
            if isinstance(item, dict):
                changed |= _strip_content(item.get("content"))
    return changed


def strip(obj: dict[str, Any], asked: dict[str, Any]) -> bool:
    """Remove injected fields from a response body or a stream event (in place)."""
    if obj.get("object") == "response":
        return _strip_response(obj, asked)
    changed = False
    if isinstance(obj.get("response"), dict):
        changed |= _strip_response(obj["response"], asked)
    if not asked.get("logprobs"):
        kind = obj.get("type")
        if kind == "response.output_text.delta" and obj.get("logprobs"):
            obj["logprobs"] = []
            changed = True
        if isinstance(obj.get("part"), dict):
            changed |= _strip_content([obj["part"]])
        if isinstance(obj.get("item"), dict):
            changed |= _strip_content(obj["item"].get("content"))
    return changed


# vLLM 0.32's text delta event, exactly (compact JSON, its key order; strings, numbers and the
# logprobs list matched by their grammar, nothing loosely). Group 1: the logprobs list.
_TEXT_DELTA = re.compile(
    rb'event: response\.output_text\.delta\ndata: \{"content_index":\d+,"delta":' + STR + rb',"item_id":' + STR
    + rb',"logprobs":(' + LOGPROB_LIST + rb')'
    + rb',"output_index":\d+,"sequence_number":\d+,"type":"response\.output_text\.delta"\}\n\n')


# The tail of vLLM 0.32's final event: the raw message tokens (prompt and output ids) are the last
# keys of the response object. Group 1: input_messages, group 2: output_messages.
_MESSAGE = rb'\{"message":' + STR + rb',"tokens":' + INTS + rb',"type":"raw_message_tokens"\}'
_MESSAGES = rb'(?:null|\[(?:' + _MESSAGE + rb'(?:,' + _MESSAGE + rb')*)?\])'
_FINAL_TAIL = re.compile(
    rb',"input_messages":(' + _MESSAGES + rb'),"output_messages":(' + _MESSAGES + rb')\}'
    rb',"sequence_number":\d+,"type":"response\.(?:completed|incomplete|failed)"\}\n\n')
_FINAL_EVENTS = tuple(b"event: " + name.encode() + b"\ndata: {" for name in FINAL_EVENTS)


def _strip_final(raw: bytes, asked: dict[str, Any]) -> bytes | None:
    """The final event without re-encoding the call's token ids (None: use the JSON path).

    Why: ``response.completed`` carries ``input_messages`` - every prompt token id, often tens of
    thousands - that the client did not ask for. They are spliced to ``null`` first, so that the
    JSON path (still needed: the output's logprobs and ``top_logprobs``) parses a small event. The
    splice is kept only if the parsed result proves it hit the response's own keys (each key occurs
    once in the event, and the response object now has both, as ``null``).
    """
    if asked.get("response_messages") or not raw.startswith(_FINAL_EVENTS):
        return None
    pos = raw.rfind(b',"input_messages":')
    if pos < 0 or raw.count(b'"input_messages":') != 1 or raw.count(b'"output_messages":') != 1:
        return None
    m = _FINAL_TAIL.fullmatch(raw, pos)
    if m is None:
        return None
    (a, b), (c, d) = m.span(1), m.span(2)
    spliced = b"".join((raw[:a], b"null", raw[b:c], b"null", raw[d:]))
    ev = parse_event(spliced)
    try:
        obj = json.loads(ev.data or "")
    except ValueError:
        return None
    resp = obj.get("response") if isinstance(obj, dict) else None
    if not isinstance(resp, dict) or resp.get("input_messages", 0) is not None \
            or resp.get("output_messages", 0) is not None:
        return None
    return serialize_event(spliced, ev, obj) if strip(obj, asked) else spliced


def event_stripper(asked: dict[str, Any]) -> Callable[[bytes], bytes | None]:
    """The stream hot path: a function that strips one event without parsing all of it (None: not
    handled, use the JSON path).

    Text deltas (one per sampled token): the injected ``logprobs`` are emptied by a splice; the
    whole event must match :data:`_TEXT_DELTA`, a strict grammar of vLLM's shape, so the result
    equals :func:`strip` + re-serialisation while every other byte stays as sent. The final event:
    see :func:`_strip_final`. Other events (a handful per call) go the JSON way.
    """
    match = _TEXT_DELTA.fullmatch

    def strip_event(raw: bytes) -> bytes | None:
        m = match(raw)
        if m is None:
            return _strip_final(raw, asked)
        if asked.get("logprobs"):
            return raw
        a, b = m.span(1)
        return raw if b - a == 2 else b"".join((raw[:a], b"[]", raw[b:]))

    return strip_event


def sampling(request: dict[str, Any]) -> tuple[float | None, float | None]:
    return as_float(request.get("temperature")), as_float(request.get("top_p"))


def _concat_tokens(messages: Any) -> list[int] | None:
    if not isinstance(messages, list) or not messages:
        return None
    out: list[int] = []
    for m in messages:
        ids = int_list(m.get("tokens")) if isinstance(m, dict) else None
        if ids is None:
            return None
        out.extend(ids)
    return out


def parse_response(resp: dict[str, Any]) -> ParsedCall:
    """Fields of a final response object (non-streamed body or the final event's ``response``)."""
    parsed = ParsedCall(model=resp.get("model") if isinstance(resp.get("model"), str) else None)
    parsed.prompt_ids = _concat_tokens(resp.get("input_messages"))
    parsed.completion_ids = _concat_tokens(resp.get("output_messages"))
    usage = resp.get("usage")
    if isinstance(usage, dict):
        parsed.usage_prompt_tokens = as_int(usage.get("input_tokens"))
        parsed.usage_completion_tokens = as_int(usage.get("output_tokens"))
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    lps: list[float] | None = []
    output = resp.get("output")
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                if not isinstance(part, dict):
                    continue
                if isinstance(part.get("text"), str):
                    texts.append(part["text"])
                if lps is not None:
                    if isinstance(part.get("logprobs"), list):
                        for lp in part["logprobs"]:
                            v = lp.get("logprob") if isinstance(lp, dict) else None
                            if isinstance(v, (int, float)) and not isinstance(v, bool):
                                lps.append(float(v))
                            else:
                                lps = None
                                break
                    else:
                        lps = None
        elif kind == "reasoning":
            parts = [p for key in ("content", "summary") if isinstance(item.get(key), list) for p in item[key]]
            for part in parts:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        elif kind in ("function_call", "custom_tool_call"):
            tool_calls.append(_tool_call(item))
    ids = parsed.completion_ids
    if lps and ids is not None and len(lps) == len(ids):
        parsed.completion_logprobs = lps
    elif (lps and ids is not None and len(lps) == len(ids) - 1 and resp.get("status") == "completed"
          and not tool_calls and not reasoning):
        # vLLM reports logprobs for output_text only, so the end-of-turn token that closes a
        # completed answer has none: NaN there (= "the server reported none"), the rest aligned
        parsed.completion_logprobs = [*lps, float("nan")]
    status = resp.get("status")
    details = resp.get("incomplete_details") if isinstance(resp.get("incomplete_details"), dict) else {}
    if status == "completed":
        parsed.finish_reason = "tool_calls" if tool_calls else "stop"
        parsed.stopped = True
    elif status == "incomplete":
        parsed.finish_reason = "length" if details.get("reason") == "max_output_tokens" else str(details.get("reason"))
    elif isinstance(status, str):
        parsed.finish_reason = status
    parsed.tool_call_count = len(tool_calls)
    assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        assistant["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        assistant["tool_calls"] = tool_calls
    parsed.assistant = assistant
    parsed.response = resp
    return parsed


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call`` / ``custom_tool_call`` output item as a chat tool call (vLLM's conversion)."""
    name = item.get("name") or ""
    if item.get("type") == "custom_tool_call":
        args = json.dumps({CUSTOM_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
    else:
        args = item.get("arguments") or ""
        if item.get("namespace"):
            name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    return {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": args}}


def parse_body(obj: dict[str, Any]) -> ParsedCall:
    return parse_response(obj)


def parse_stream(events: list[tuple[str | None, Any]], done: bool) -> ParsedCall:
    """Use the final event's response; a truncated stream is rebuilt from its text deltas."""
    final = None
    text: list[str] = []
    for name, obj in events:
        if not isinstance(obj, dict):
            continue
        kind = obj.get("type") or name
        if kind in FINAL_EVENTS and isinstance(obj.get("response"), dict):
            final = obj["response"]
        elif kind == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            text.append(obj["delta"])
    if final is not None:
        parsed = parse_response(final)
        parsed.complete = True
        return parsed
    parsed = ParsedCall(complete=False, assistant={"role": "assistant", "content": "".join(text)})
    parsed.response = {"object": "response", "status": "truncated", "output_text": "".join(text)}
    return parsed


def is_done_event(name: str | None, data: str | None) -> bool:
    return name in FINAL_EVENTS


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
    return "".join(parts)


def to_chat(request: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat messages and tools of a Responses request, converted exactly as the server does
    (:mod:`polar_train.wire.responses`), for rendering when the server gave no ids."""
    try:
        messages = input_messages(request)
        tools = chat_tools(request.get("tools") or [])
    except ApiError as exc:
        raise ValueError(f"cannot convert the request to chat messages: {exc.message}") from None
    return messages, tools or None
