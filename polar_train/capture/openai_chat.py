"""OpenAI Chat Completions (``/v1/chat/completions``): injection, stripping, reassembly.

vLLM (0.32) and ``polar-train serve`` return ids when asked: ``return_token_ids: true`` gives a
top-level ``prompt_token_ids`` (streaming: in the first chunk, next to ``prompt_text``) and
``choices[i].token_ids``; ``logprobs: true`` gives ``choices[i].logprobs.content[*].logprob``.
Without the request flags the server sends those keys as ``null``, so stripping sets them back to
``null`` (not deleting them): the client sees exactly the shape it would see without the proxy.
Only choice 0 is recorded (harnesses send ``n=1``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..wire.errors import ApiError
from ..wire.lax import lax_bool_or_none, lax_int, lax_true
from ..wire.render import normalize_tool
from ..wire.render import template_kwargs as _template_kwargs
from .grammar import INTS, LOGPROB_LIST, STR, ids_end
from .id_arrays import parse_ids
from .json_members import EchoCache, PrefixCache
from .parsed import Injection, ParsedCall, as_float, as_int, error_text, int_list
from .sse import loads_text

API = "openai.chat"
#: The event that ends a stream (what the row calls its final event).
FINAL_EVENT = "data: [DONE]"
INJECTS = True
#: Request members a session sends again with every call: the proxy reads them only where they
#: differ from the call before (the injection changes neither).
REQUEST_ECHOED = {"messages": PrefixCache(), "tools": EchoCache()}


def inject(body: dict[str, Any]) -> Injection:
    asked = {
        "return_token_ids": lax_true(body.get("return_token_ids")),  # as vLLM reads it: 1, "true" too
        "logprobs": lax_true(body.get("logprobs")),
    }
    new = dict(body)
    changed = False
    # a value the server refuses stays as sent (its 400 for the client): setting ours would make a
    # refused request pass, recorded as ok ("logprobs": "maybe"; top_logprobs without logprobs)
    if not asked["return_token_ids"] and lax_bool_or_none(body.get("return_token_ids")):
        new["return_token_ids"] = True
        changed = True
    top = lax_int(body.get("top_logprobs"))
    refused_unless_logprobs = not body.get("logprobs") and (  # vLLM's check_logprobs, on the raw body
        (top is not None and (top == -1 or top > 0)) or bool(body.get("logprob_token_ids")))
    if not asked["logprobs"] and lax_bool_or_none(body.get("logprobs")) and not refused_unless_logprobs:
        new["logprobs"] = True
        changed = True
    return Injection(new, asked, changed)


def strip(obj: dict[str, Any], asked: dict[str, Any]) -> bool:
    """Remove injected fields from a response body or a stream chunk (in place)."""
    changed = False
    if not asked.get("return_token_ids"):
        for key in ("prompt_token_ids", "prompt_text"):
            if obj.get(key) is not None:
                obj[key] = None
                changed = True
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        if not asked.get("return_token_ids") and choice.get("token_ids") is not None:
            choice["token_ids"] = None
            changed = True
        if not asked.get("logprobs") and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    return changed


# The shape of a vLLM 0.32 token chunk, exactly (compact JSON, its key order). Strings, numbers and
# the logprobs object are matched by their grammar; only ``delta`` is matched loosely (any object).
# Group 1: the choice's logprobs value, group 2: its token_ids value.
_TOKEN_CHUNK = re.compile(
    rb'data: \{"id":' + STR + rb',"object":"chat\.completion\.chunk","created":\d+,"model":' + STR
    + rb',"choices":\[\{"index":\d+,"delta":\{[^\r\n]*?\}'
    + rb',"logprobs":(null|\{"content":' + LOGPROB_LIST + rb'\})'
    + rb',"finish_reason":(?:null|' + STR + rb')(?:,"stop_reason":(?:null|' + STR + rb'|-?\d+))?'
    + rb',"token_ids":(null|' + INTS + rb')\}\](?:,"system_fingerprint":(?:null|' + STR + rb'))?\}\n\n')
# vLLM's first chunk (the role, no token yet, the prompt fields at the top level): the head up to
# prompt_token_ids, the ids (a prompt's worth: proven by :func:`~.grammar.ids_end`, the regex engine
# took ~1 ms per 10,000), the tail with prompt_text (group 1).
_FIRST_HEAD = re.compile(
    rb'data: \{"id":' + STR + rb',"object":"chat\.completion\.chunk","created":\d+,"model":' + STR
    + rb',"choices":\[\{"index":\d+,"delta":\{[^\r\n]*?\},"logprobs":null,"finish_reason":null\}\]'
    + rb',"prompt_token_ids":')
_FIRST_TAIL = re.compile(rb',"prompt_text":(null|' + STR + rb')\}\n\n')
#: How vLLM 0.32's first chunk ends (its prompt_text is null). A token chunk never ends so, and an
#: event that does is not tried as one: its loose delta would be tried up to every ``}`` in it.
_FIRST_END = b',"prompt_text":null}\n\n'


def _first_chunk(raw: bytes) -> tuple[int, int, int, int] | None:
    """Where the values of prompt_token_ids and prompt_text lie in an event of exactly vLLM's
    first-chunk shape (None: any other)."""
    m = _FIRST_HEAD.match(raw)
    if m is None:
        return None
    a = m.end()
    b = a + 4 if raw.startswith(b"null", a) else ids_end(raw, a)
    tail = _FIRST_TAIL.fullmatch(raw, b) if b is not None else None
    return (a, b, *tail.span(1)) if tail is not None else None


#: A first chunk smaller than this is parsed as JSON: it holds too few ids to matter.
IDS_ARRAY_FROM_BYTES = 8192


def first_chunk_json(raw: bytes) -> tuple[None, dict[str, Any]] | None:
    """The row worker's reading of vLLM's first chunk: what ``json.loads`` makes of it, except that
    ``prompt_token_ids`` is an ``int32`` array (:mod:`~.id_arrays`); None for any other event.

    The ids are proven by :func:`_first_chunk` (which puts them at the top level) and parsed by
    numpy; everything else is parsed as JSON with ``null`` in their place, then they are set.
    The reassembled response never holds them, so the row's ``response_json`` is unchanged."""
    if len(raw) < IDS_ARRAY_FROM_BYTES or not raw.endswith(_FIRST_END):
        return None
    found = _first_chunk(raw)
    if found is None or raw[found[0]] != ord("["):
        return None
    a, b = found[0], found[1]
    ids = parse_ids(raw[a + 1:b - 1])
    if ids is None:
        return None
    try:
        obj = loads_text(b"".join((raw[6:a], b"null", raw[b:-2])).decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included: the JSON path decides
        return None
    if not isinstance(obj, dict) or "prompt_token_ids" not in obj:
        return None
    obj["prompt_token_ids"] = ids
    return None, obj


def ids_reader(state: Any) -> Callable[[bytes], tuple[None, dict[str, Any]] | None]:
    """How the row worker reads events that carry a prompt's ids (the reassembled response never
    holds them: any call)."""
    return first_chunk_json


def _nulled(raw: bytes, a: int, b: int, c: int = -1, d: int = -1) -> bytes:
    """``raw`` with ``null`` over ``raw[a:b]`` (and over ``raw[c:d]`` after it, if given)."""
    if c < 0:
        return b"".join((raw[:a], b"null", raw[b:]))
    return b"".join((raw[:a], b"null", raw[b:c], b"null", raw[d:]))


def event_stripper(asked: dict[str, Any]) -> Callable[[bytes], bytes | None]:
    """The stream hot path: a function that strips one vLLM chunk by splicing ``null`` over the
    injected values, without parsing it (None: not handled, use the JSON path).

    Why: parsing and re-serialising every event costs several times more than one regex match and
    a few slices (bench/proxy_overhead.py). The event must match vLLM's token-chunk or first-chunk
    shape exactly (:data:`_TOKEN_CHUNK`, :func:`_first_chunk`: one data line, one choice, fixed
    keys in vLLM's order; no event has both); in a valid JSON event that shape puts the spliced
    values at their own level (the choice's ``logprobs`` / ``token_ids``, the top-level prompt
    fields), so the result equals :func:`strip` + re-serialisation, while every other byte stays as
    the server sent it (a value that is already ``null`` is spliced over with ``null``: the same
    bytes). Anything else (the usage chunk, other servers' formatting) goes the JSON way. One
    function per call, specialised on what the client asked for itself.
    """
    match = _TOKEN_CHUNK.fullmatch
    keep_lps, keep_ids = bool(asked.get("logprobs")), bool(asked.get("return_token_ids"))

    def first_chunk(raw: bytes) -> bytes | None:
        found = _first_chunk(raw)
        if found is None or (keep_ids and not keep_lps):
            return None  # only logprobs to strip: a first chunk has none (the JSON path checks)
        return raw if keep_ids else _nulled(raw, *found)

    def strip_event(raw: bytes) -> bytes | None:
        if raw.endswith(_FIRST_END):
            return first_chunk(raw)
        m = match(raw)
        if m is None:
            return first_chunk(raw)
        if keep_lps:
            return raw if keep_ids else _nulled(raw, *m.span(2))
        return _nulled(raw, *m.span(1)) if keep_ids else _nulled(raw, *m.span(1), *m.span(2))

    def strip_both(raw: bytes) -> bytes | None:
        """What harnesses get (they ask for neither): ``strip_event`` without its branches."""
        if raw.endswith(_FIRST_END) or (m := match(raw)) is None:
            return first_chunk(raw)
        a, b = m.span(1)
        c, d = m.span(2)
        return b"".join((raw[:a], b"null", raw[b:c], b"null", raw[d:]))

    return strip_event if keep_lps or keep_ids else strip_both


def sampling(request: dict[str, Any]) -> tuple[float | None, float | None]:
    return as_float(request.get("temperature")), as_float(request.get("top_p"))


def request_note(request: dict[str, Any]) -> str | None:
    """What the row cannot hold of this request's answer: a row is one completion, ``choices[0]``;
    with ``n`` > 1 the others' token ids and logprobs (asked for by the proxy, stripped before
    the client saw them) are lost, and the row says so rather than pass as all there was."""
    n = lax_int(request.get("n"))
    if n is None or n <= 1:
        return None
    return (f"n={n}: only choices[0] is recorded; the other {n - 1} choices' token ids and logprobs "
            "are not (usage counts all of them)")


def _logprob_values(logprobs: Any) -> list[float] | None:
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("content"), list):
        return None
    out = []
    for item in logprobs["content"]:
        lp = item.get("logprob") if isinstance(item, dict) else None
        if not isinstance(lp, (int, float)) or isinstance(lp, bool):
            return None
        out.append(float(lp))
    return out


def _first_choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def _usage(parsed: ParsedCall, usage: Any) -> None:
    if isinstance(usage, dict):
        parsed.usage_prompt_tokens = as_int(usage.get("prompt_tokens"))
        parsed.usage_completion_tokens = as_int(usage.get("completion_tokens"))


def _finish(parsed: ParsedCall, message: dict[str, Any], stop_reason: Any = None) -> None:
    calls = message.get("tool_calls") or []
    parsed.tool_call_count = len(calls) if isinstance(calls, list) else 0
    # the model ended its turn itself (sampled the end-of-turn token) only when vLLM names no
    # stop string or stop token id as the reason: after a stop string it sampled other tokens
    # (cut from the text), and rendering must not invent an end-of-turn token for it
    parsed.stopped = parsed.finish_reason in ("stop", "tool_calls") and stop_reason is None
    # the content as the client sends it back: null stays null ("" a template reading parts takes as a text)
    assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        assistant["reasoning"] = reasoning
    if parsed.tool_call_count:
        assistant["tool_calls"] = calls
    parsed.assistant = assistant


def parse_body(obj: dict[str, Any]) -> ParsedCall:
    """A non-streamed response (before stripping: ids are read from it)."""
    parsed = ParsedCall(model=obj.get("model") if isinstance(obj.get("model"), str) else None)
    parsed.prompt_ids = int_list(obj.get("prompt_token_ids"))
    _usage(parsed, obj.get("usage"))
    choice = _first_choice(obj)
    if choice is None:
        if obj.get("error"):  # an error object in a 2xx body
            parsed.server_error = f"the server reported an error: {error_text(obj['error'])}"
        parsed.error = "response has no choices[0]"
        return parsed
    parsed.completion_ids = int_list(choice.get("token_ids"))
    parsed.completion_logprobs = _logprob_values(choice.get("logprobs"))
    parsed.finish_reason = choice.get("finish_reason")
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    _finish(parsed, message, choice.get("stop_reason"))
    return parsed


def parse_stream(events: list[tuple[str | None, Any]], done: bool) -> ParsedCall:
    """Reassemble the chunks (already JSON-decoded; ``[DONE]`` excluded) of a streamed call."""
    parsed = ParsedCall()
    content: list[str] = []
    reasoning: list[str] = []
    tools: dict[int, dict[str, Any]] = {}
    ids: list[int] = []
    ids_seen = False
    lps: list[float] | None = []
    base: dict[str, Any] = {}
    role = "assistant"
    stop_reason: Any = None
    usage: Any = None
    for _name, obj in events:
        if not isinstance(obj, dict):
            parsed.error = parsed.error or "stream chunk is not a JSON object"
            continue
        if obj.get("error") and parsed.server_error is None:
            # vLLM's own mid-stream failure: {"error": {...}} then [DONE], no finish_reason
            parsed.server_error = f"the server reported an error mid-stream: {error_text(obj['error'])}"
        if not base:
            base = {k: obj.get(k) for k in ("id", "created", "model", "system_fingerprint")}
        if obj.get("prompt_token_ids") is not None:
            prompt = obj["prompt_token_ids"]
            parsed.prompt_ids = prompt if isinstance(prompt, np.ndarray) else int_list(prompt)
        if obj.get("usage"):
            _usage(parsed, obj["usage"])
            usage = obj["usage"]  # whole, as the client saw it (total_tokens, *_details)
        if obj.get("system_fingerprint"):
            base["system_fingerprint"] = obj["system_fingerprint"]
        choice = _first_choice(obj)
        if choice is None:
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        role = delta.get("role") or role
        if isinstance(delta.get("content"), str):
            content.append(delta["content"])
        r = delta.get("reasoning") or delta.get("reasoning_content")
        if isinstance(r, str):
            reasoning.append(r)
        tool_deltas = delta.get("tool_calls")
        for tc in tool_deltas if isinstance(tool_deltas, list) else ():
            if not isinstance(tc, dict):
                continue
            slot = tools.setdefault(as_int(tc.get("index")) or 0,
                                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
            if isinstance(fn.get("name"), str):
                slot["function"]["name"] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                slot["function"]["arguments"] += fn["arguments"]
        tids = choice.get("token_ids")
        if isinstance(tids, list):
            ids_seen = True
            ids.extend(t for t in tids if isinstance(t, int))
        if lps is not None and choice.get("logprobs") is not None:
            vals = _logprob_values(choice.get("logprobs"))
            if vals is None:
                lps = None
            else:
                lps.extend(vals)
        if choice.get("finish_reason"):
            parsed.finish_reason = choice["finish_reason"]
            stop_reason = choice.get("stop_reason")
    parsed.model = base.get("model") if isinstance(base.get("model"), str) else None
    parsed.completion_ids = ids if ids_seen else None
    parsed.completion_logprobs = lps if lps else None
    message: dict[str, Any] = {"role": role, "content": "".join(content) if content or not tools else None}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if tools:
        message["tool_calls"] = [tools[i] for i in sorted(tools)]
    parsed.response = {
        "id": base.get("id"), "object": "chat.completion", "created": base.get("created"),
        "model": base.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": parsed.finish_reason}],
        "usage": usage if isinstance(usage, dict) else None,
        "system_fingerprint": base.get("system_fingerprint"),
    }
    parsed.complete = done
    _finish(parsed, message, stop_reason)
    return parsed


def to_chat(request: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat messages and tools for rendering (already in chat form; tools in vLLM's canonical form)."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        raise ValueError("request has no messages list")
    tools_in = request.get("tools") if isinstance(request.get("tools"), list) else []
    try:
        tools = [normalize_tool(t) for t in tools_in]
    except ApiError as exc:
        raise ValueError(f"cannot use the request's tools: {exc.message}") from None
    return copy.deepcopy(messages), tools or None


def is_done_event(name: str | None, data: str | None) -> bool:
    return data == "[DONE]"


def template_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """The template kwargs the server renders this request with (its ``chat_template_kwargs`` and
    ``reasoning_effort``), for rendering."""
    return _template_kwargs(request.get("chat_template_kwargs"), request.get("reasoning_effort"))
