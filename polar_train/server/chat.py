"""``POST /v1/chat/completions`` in vLLM 0.32's shapes (with its ``return_token_ids`` extension).

Non-streamed: one ``chat.completion`` object. Streamed: a first chunk with the role (and
``prompt_token_ids``), one chunk per token that adds text (``token_ids`` as per-chunk deltas), the
finish on the last token's chunk, an optional usage chunk with ``choices: []``, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ..wire.errors import BadRequest
from . import constraints
from .common import (CHAT_MEDIA_PARTS, KNOWN_PART_TYPES, check_model, check_top_logprobs, continue_and_generate,
                     integer, keep_specials, require_list, sampling, unsupported_part)
from .completion import CompletionState, Delta
from .engine import SamplingParams
from .errors import PydanticError, VllmError, field_error, missing
from .extras import refuse_unsupported, truncate_prompt
from .fields import flag, list_of, obj
from .parse import random_id
from .prompt import encode_prompt, normalize_tool, render, template_kwargs
from .script import RequestView
from .sse import sse_data

SYSTEM_FINGERPRINT = "vllm-0.32.0-polar"
#: vLLM's _SAMPLING_EPS: a temperature below it samples greedily
GREEDY_EPS = 1e-5
#: vLLM's VLLM_MAX_N_SEQUENCES default
MAX_N = 16384
#: choices of one non-streamed request sampled at once (each on a thread of its own)
PARALLEL_CHOICES = 4


def refuse_null_content(messages: list[Any]) -> None:
    """A message other than the assistant's with ``"content": null`` is refused, as vLLM's union of
    message types refuses it (400; our wording, docs/server.md): it was rendered as an empty turn
    and answered 200 (a probe). Without the key vLLM takes it (its custom message type): so do we."""
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in ("assistant", "function") and "content" in m and m["content"] is None:
            raise BadRequest(f"messages[{i}].content is null for role {role!r} (a string or a list of parts, or no "
                             "content key)", param="messages")


_EMBEDS = ("image_embeds", "audio_embeds", "video_embeds")


def check_content_parts(messages: list[Any], model: str) -> None:
    """Content parts as vLLM's chat parser refuses them, the first failing part first: media for a
    text-only model; a part of an unknown type (``file``, ``weird``) or of none, which was dropped
    from the prompt and answered 200 (a probe: vLLM 400s); ``input_text``/``output_text`` (Responses
    parts) and an untyped media part, which its chat request model refuses."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in CHAT_MEDIA_PARTS or kind == "image_pil":
                raise VllmError(f"{model} is not a multimodal model")
            if kind in _EMBEDS:
                raise VllmError("The model is not multimodal.")
            if kind == "prompt_embeds":
                raise VllmError("You must set `--enable-prompt-embeds` to input `prompt_embeds`",
                                param="prompt_embeds")
            if (kind is None and any(key in part for key in CHAT_MEDIA_PARTS)) or (
                    kind is not None and not isinstance(kind, str)) or kind in ("input_text", "output_text"):
                raise VllmError(f"messages[{i}].content[{j}]: a part of type {kind!r} is no chat completions "
                                "content part (vLLM's validation of the parts refuses it)")
            if kind is None and "tool_reference" not in part:
                raise VllmError("Missing 'type' field in multimodal part.", param="type")
            if kind is not None and kind not in KNOWN_PART_TYPES:
                raise unsupported_part(kind)


def prepare(server, body: dict) -> dict[str, Any]:
    """Validate the request and render its prompt; everything a chat call needs. The checks follow
    vLLM's order where it shows: its model validators on the raw values first (stream options,
    logprobs, tool usage), then the fields' types (pydantic), then its sampling checks."""
    if body.get("stream_options") and not body.get("stream"):  # vLLM tests the raw values
        raise VllmError("Stream options can only be defined when `stream=True`.",
                        param="stream_options")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None and not isinstance(prompt_logprobs, (int, float)):
        raise VllmError("`prompt_logprobs` must be an integer.", param="prompt_logprobs",
                        value=prompt_logprobs)
    if isinstance(prompt_logprobs, (int, float)) and body.get("stream") and (
            prompt_logprobs > 0 or prompt_logprobs == -1):
        raise VllmError("`prompt_logprobs` are not available when `stream=True`.",
                        param="prompt_logprobs")
    check_tool_usage(body)
    if body.get("chat_template") is not None:  # vLLM without --trust-request-chat-template
        raise VllmError("Chat template is passed with request, but --trust-request-chat-template "
                        "is not set. Refused request with untrusted chat template.")
    if server.script is None:  # a script's answer is fixed; sampling would ignore a constraint
        constraints.check_chat(body)
    messages = require_list(body, "messages")
    refuse_null_content(messages)
    check_tool_call_arguments(messages)
    tools_raw = list_of(body, "tools")
    check_tools(tools_raw or [])
    model = check_model(body, server.served_name)
    check_content_parts(messages, model)
    tools = [normalize_tool(t) for t in tools_raw or []]
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    n = integer(body, "n", 1)
    if n < 1:
        raise VllmError(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise VllmError(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
                        "VLLM_MAX_N_SEQUENCES environment variable.")
    stream = flag(body, "stream")
    stream_options = obj(body, "stream_options", "StreamOptions")
    logprobs = flag(body, "logprobs")
    top = check_top_logprobs(body, logprobs, server.engine.vocab_size)
    add_generation_prompt = flag(body, "add_generation_prompt", True)
    continue_final = flag(body, "continue_final_message")
    if continue_final and add_generation_prompt:
        if "add_generation_prompt" in body:  # vLLM's validator of the fields as given
            raise VllmError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        raise continue_and_generate()  # (add_generation_prompt by default: its later check)
    if body.get("mm_processor_kwargs"):  # vLLM without --trust-request-mm-kwargs (an empty one passes)
        raise VllmError("Per-request mm_processor_kwargs are disabled by default because they can change "
                        "multimodal preprocessing resource usage. Start the server with --trust-request-mm-kwargs "
                        "only when clients are trusted.", param="mm_processor_kwargs")
    if body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
        raise PydanticError([field_error("dict_type", "body.chat_template_kwargs",
                                         "Input should be a valid dictionary",
                                         body["chat_template_kwargs"])])
    text = render(server.tokenizer, messages, tools or None,
                  add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final,
                  kwargs=template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort")))
    refuse_unsupported(body)
    prompt_ids = truncate_prompt(body, encode_prompt(server.engine, text), server.engine.max_model_len)
    params = sampling(body, server.engine, len(prompt_ids), ("max_completion_tokens", "max_tokens"),
                      top_logprobs=top, clamp=server.script is not None, extras=True)
    keep_specials(params, bool(tools) and tool_choice != "none")
    if n > 1 and params.temperature < GREEDY_EPS:  # vLLM's _verify_greedy_sampling
        raise VllmError(f"n must be 1 when using greedy sampling, got {n}.")
    view = RequestView("openai.chat", messages, [t["function"]["name"] for t in tools])
    # vLLM's get_chat_request_role: without a generation prompt, the last message's role
    role = "assistant" if add_generation_prompt else messages[-1].get("role", "assistant")
    echo = flag(body, "echo")
    if echo and stream and echoed_content(messages, role) is not None:
        # vLLM 0.32 answers 200 here, then sends an error event mid-stream (its DeltaMessage
        # refuses the echoed content): refused up front instead
        raise VllmError("`echo` is not supported by polar-train serve when `stream=True` and the "
                        "last message has the answer's role", param="echo")
    return {
        "model": model, "prompt_ids": prompt_ids, "params": params, "view": view, "n": n,
        # vLLM's hermes parser reads the output unless tool_choice is "none" (an explicit null too,
        # even without tools), but its calls are returned only under a tool_choice given or implied
        "tools_enabled": tool_choice != "none", "calls_kept": bool(tools) and tool_choice is not None,
        "logprobs": logprobs,
        "return_token_ids": flag(body, "return_token_ids"),
        # vLLM (run with a tool parser) hides reasoning, and with it every token's ids and logprobs
        "include_reasoning": flag(body, "include_reasoning", True),
        "parallel_tool_calls": flag(body, "parallel_tool_calls", True),
        "tokens_as_ids": flag(body, "return_tokens_as_token_ids"),
        "echo": echo and not stream, "messages": messages, "role": role,
        "stream": stream,
        "include_usage": flag(stream_options, "include_usage", field="stream_options.include_usage"),
        "continuous_usage": flag(stream_options, "continuous_usage_stats",
                                 field="stream_options.continuous_usage_stats"),
    }


def check_tool_usage(body: dict) -> None:
    """vLLM's ``check_tool_usage`` model validator, in its words (it runs on the raw request)."""
    tools = body.get("tools")
    if tools == []:
        raise VllmError("`tools` must not be an empty array. Either provide at least one tool or "
                        "omit the field entirely.", param="tools")
    choice = body["tool_choice"] if "tool_choice" in body else ("auto" if tools else None)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise VllmError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise VllmError(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", "
                        "\"auto\" or \"required\" are supported.", param="tool_choice")
    if not isinstance(choice, dict):
        return
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise VllmError(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                        param="tool_choice.function")
    if "name" not in function:
        raise VllmError(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                        param="tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise VllmError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                        param="tool_choice.function.name")
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)
             and isinstance(t.get("function"), dict)] if isinstance(tools, list) else []
    if name not in names:
        raise VllmError("The tool specified in `tool_choice` does not match any of the specified "
                        "`tools`", param="tool_choice")


def check_tool_call_arguments(messages: list) -> None:
    """An assistant tool call's ``function.arguments`` must be a string: vLLM's pydantic answer
    for one given as an object (its union of function and custom tool calls, both branches)."""
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        errors: list[dict] = []
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if args is None or isinstance(args, str):
                continue
            errors.append(field_error("string_type",
                                      f"body.{j}.ChatCompletionMessageFunctionToolCallParam.function",
                                      "Input should be a valid string", args))
            errors.append(missing(f"body.{j}.ChatCompletionMessageCustomToolCallParam.custom", call))
            if "type" in call:
                errors.append(field_error("literal_error",
                                          f"body.{j}.ChatCompletionMessageCustomToolCallParam.type",
                                          "Input should be 'custom'", call["type"],
                                          {"expected": "'custom'"}))
        if errors:
            raise PydanticError(errors)


def check_tools(tools: list) -> None:
    """``tools[i]`` as vLLM's ``ChatCompletionToolsParam`` refuses it: ``type`` is the literal
    "function" (the default), ``function`` an object with a string ``name``."""
    errors: list[dict] = []
    for i, tool in enumerate(tools):
        loc = f"body.tools.{i}"
        if not isinstance(tool, dict):
            errors.append(field_error("model_attributes_type", loc, "Input should be a valid "
                                      "dictionary or object to extract fields from", tool))
            continue
        if tool.get("type", "function") != "function":
            errors.append(field_error("literal_error", f"{loc}.type", "Input should be 'function'",
                                      tool["type"], {"expected": "'function'"}))
        fn = tool.get("function")
        if "function" not in tool:
            errors.append(missing(f"{loc}.function", tool))
        elif not isinstance(fn, dict):
            errors.append(field_error("model_attributes_type", f"{loc}.function", "Input should "
                                      "be a valid dictionary or object to extract fields from", fn))
        elif "name" not in fn:
            errors.append(missing(f"{loc}.function.name", fn))
        elif not isinstance(fn["name"], str):
            errors.append(field_error("string_type", f"{loc}.function.name",
                                      "Input should be a valid string", fn["name"]))
        if isinstance(fn, dict) and fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            # (a JSON schema given as text was rendered into the system prompt as a string: a probe)
            errors.append(field_error("dict_type", f"{loc}.function.parameters", "Input should be a valid "
                                      "dictionary", fn["parameters"]))
    if errors:
        raise PydanticError(errors)


def echoed_content(messages: list, role: str) -> str | None:
    """What vLLM's ``echo`` puts before the answer: the last message's content when that message
    has the answer's role (text parts joined by newlines), else nothing (``None``)."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or "content" not in last or last.get("role") != role:
        return None
    content = last["content"] or ""
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def logprob_entries(server, steps, top: int, as_ids: bool = False) -> list[dict[str, Any]]:
    """Per-token logprobs. ``as_ids`` (``return_tokens_as_token_ids``): each token named
    ``token_id:<id>`` as vLLM names it; the entry keeps the real token's bytes, while an
    alternative's bytes are those of its ``token_id:<id>`` name (vLLM 0.32's answer)."""
    engine = server.engine
    out = []
    for s in steps:
        text = engine.logprob_token(s.token_id, s.before)
        alternatives = []
        for i, lp in s.top:
            name = f"token_id:{i}" if as_ids else engine.logprob_token(i, s.before)
            alternatives.append({"token": name, "logprob": lp, "bytes": list(name.encode())})
        out.append({"token": f"token_id:{s.token_id}" if as_ids else text, "logprob": s.logprob,
                    "bytes": list(text.encode()), "top_logprobs": alternatives})
    return out


def prompt_logprobs(server, req: dict[str, Any]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` as ``echo`` asks for them (``top_logprobs`` alternatives); a
    token is named in the context of the prompt tokens before it (vLLM leaves out the first)."""
    engine, ids = server.engine, req["prompt_ids"]
    rows = engine.prompt_logprobs(ids, req["params"].top_logprobs)
    return [None if row is None else {
        str(i): {"logprob": lp, "rank": rank,
                 "decoded_token": engine.logprob_token(i, ids[max(1, p - 4):p])}
        for i, (lp, rank) in row.items()} for p, row in enumerate(rows)]


def usage(prompt_len: int, completion_len: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_len, "total_tokens": prompt_len + completion_len,
            "completion_tokens": completion_len}


def finish_reason(state: CompletionState, calls_kept: bool = True) -> str:
    """vLLM's non-streamed finish reason: ``tool_calls`` whenever the turn parsed into calls it returns."""
    if calls_kept and state.final() and state.final().tool_calls and state.tools_enabled:
        return "tool_calls"
    return state.finish.reason if state.finish else "length"


def stream_finish_reason(state: CompletionState) -> str:
    """vLLM's streamed one: ``tool_calls`` where a call was streamed and the turn stopped."""
    reason = state.finish.reason if state.finish else "length"
    return "tool_calls" if state.hermes.streamed_calls and reason == "stop" else reason


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling parameters, as vLLM's ``ParentRequest`` makes its children's:
    a seeded request gives child ``i`` the seed ``seed + i`` (so each choice is reproducible and
    choice 0 equals the ``n = 1`` answer); an unseeded one samples every choice freshly."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=params.seed + index)


async def _complete(server, req: dict[str, Any], index: int) -> CompletionState:
    params = choice_params(req["params"], index)
    state = CompletionState(server.engine, req["tools_enabled"], params)
    async for step in server.tokens(req, params):
        state.push(step)
    return state


def _choice(server, req: dict[str, Any], index: int, state: CompletionState) -> dict[str, Any]:
    parsed = state.final()
    message: dict[str, Any] = {
        "role": req["role"], "content": parsed.content if not (parsed.content is None and
                                                               not parsed.tool_calls) else "",
        "refusal": None, "annotations": None, "audio": None, "function_call": None,
    }
    if parsed.tool_calls and req["calls_kept"]:
        calls = parsed.tool_calls if req["parallel_tool_calls"] else parsed.tool_calls[:1]
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]
    message["reasoning"] = parsed.reasoning if req["include_reasoning"] else None
    shown = req["include_reasoning"]
    echoed = echoed_content(req["messages"], req["role"]) if req.get("echo") else None
    if echoed is not None:  # vLLM: last message's content + the answer's (None read as "")
        message["content"] = echoed + (message["content"] or "")
    return {
        "index": index, "message": message,
        "logprobs": {"content": logprob_entries(server, state.steps, req["params"].top_logprobs,
                                                req.get("tokens_as_ids", False))}
        if req["logprobs"] and shown else None,
        "finish_reason": finish_reason(state, req["calls_kept"]),
        "stop_reason": state.finish.stop_reason if state.finish else None,
        "token_ids": state.token_ids if req["return_token_ids"] and shown else None,
        "routed_experts": None,
    }


async def respond(server, req: dict[str, Any]) -> dict[str, Any]:
    """``n`` choices (``n > 1``: sampled side by side, as vLLM's child requests)."""
    n = req.get("n", 1)
    if n == 1:
        states = [await _complete(server, req, 0)]
    else:
        gate = asyncio.Semaphore(PARALLEL_CHOICES)  # n threads at once would swamp the CPU

        async def gated(i: int) -> CompletionState:
            async with gate:
                return await _complete(server, req, i)

        tasks = [asyncio.ensure_future(gated(i)) for i in range(n)]
        try:
            states = list(await asyncio.gather(*tasks))
        finally:  # a client gone: the choices not started yet never start
            for task in tasks:
                task.cancel()
    n_prompt, n_out = len(req["prompt_ids"]), sum(len(s.steps) for s in states)
    return {
        "id": req.get("id") or f"chatcmpl-{random_id()}", "object": "chat.completion", "created": int(time.time()),
        "model": req["model"],
        "choices": [_choice(server, req, i, s) for i, s in enumerate(states)],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {**usage(n_prompt, n_out), "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "prompt_logprobs": await asyncio.to_thread(prompt_logprobs, server, req)
        if req.get("echo") else None,
        "prompt_token_ids": req["prompt_ids"] if req["return_token_ids"] else None,
        "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


async def stream(server, req: dict[str, Any]) -> AsyncIterator[bytes]:
    """vLLM's order for ``n`` choices: every choice's first (role) chunk, by index; then, step by
    step, each choice's chunk for its newest token in index order (a choice that holds its token
    back, or has finished, sends nothing); then the usage chunk and ``[DONE]``."""
    cid, created, model = req.get("id") or f"chatcmpl-{random_id()}", int(time.time()), req["model"]
    rti, n = req["return_token_ids"], req.get("n", 1)

    def chunk(choices: list, **extra: Any) -> bytes:
        return sse_data({"id": cid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "choices": choices, **extra})

    # vLLM's continuous_usage_stats (with include_usage): every chunk carries its choice's usage
    so_far = (lambda k: {**usage(len(req["prompt_ids"]), k), "completion_tokens_details": None}) \
        if req["include_usage"] and req.get("continuous_usage") else None
    for i in range(n):
        yield chunk([{"index": i, "delta": {"role": req["role"], "content": ""}, "logprobs": None,
                      "finish_reason": None}], **({"usage": so_far(0)} if so_far else {}),
                    prompt_token_ids=req["prompt_ids"] if rti else None, prompt_text=None)
    params = [choice_params(req["params"], i) for i in range(n)]
    states = [CompletionState(server.engine, req["tools_enabled"], p) for p in params]
    gens = [_choice_stream(server, req, i, params[i], states[i], chunk, so_far) for i in range(n)]
    try:
        if n == 1:
            async for piece in gens[0]:
                if piece is not None:
                    yield piece
        else:
            live = list(gens)
            while live:
                for g in list(live):
                    try:
                        piece = await anext(g)
                    except StopAsyncIteration:
                        live.remove(g)
                        continue
                    if piece is not None:
                        yield piece
    finally:
        for g in gens:
            await g.aclose()
    if req["include_usage"]:
        yield chunk([], usage=usage(len(req["prompt_ids"]), sum(len(s.steps) for s in states)),
                    system_fingerprint=SYSTEM_FINGERPRINT)
    yield b"data: [DONE]\n\n"


async def _choice_stream(server, req: dict[str, Any], index: int, params: SamplingParams,
                         state: CompletionState, chunk,
                         so_far=None) -> AsyncIterator[bytes | None]:
    """One choice's chunks: one item per token, ``None`` for a token held back."""
    shown = req["include_reasoning"]
    rti, logprobs = req["return_token_ids"] and shown, req["logprobs"] and shown
    pending = []
    tokens = server.tokens(req, params)
    try:
        async for step in tokens:
            d = state.push(step)
            pending.append(step)
            is_finish = state.finish is not None
            if not shown:
                d.reasoning = ""
            if d.empty() and not is_finish and not (rti or logprobs):
                yield None  # vLLM holds a token back until it adds text (e.g. half a UTF-8
                # character), but sends it at once in an empty delta when its ids or logprobs
                # were asked for
                continue
            delta = _delta_json(d, req["parallel_tool_calls"], shown)
            choice: dict[str, Any] = {
                "index": index, "delta": delta,
                "logprobs": {"content": logprob_entries(server, pending, req["params"].top_logprobs,
                                                        req.get("tokens_as_ids", False))}
                if logprobs else None,
                "finish_reason": stream_finish_reason(state) if is_finish else None,
            }
            if is_finish:
                choice["stop_reason"] = state.finish.stop_reason
            choice["token_ids"] = [s.token_id for s in pending] if rti else None
            pending = []
            if is_finish and not req["include_usage"]:
                yield chunk([choice], system_fingerprint=SYSTEM_FINGERPRINT)
            elif so_far:
                yield chunk([choice], usage=so_far(len(state.steps)))
            else:
                yield chunk([choice])
    finally:
        await tokens.aclose()


def _delta_json(d: Delta, parallel: bool, shown: bool = True) -> dict[str, Any]:
    """A chunk's ``delta`` as vLLM serialises it: with tools, the hermes parser's message sets
    ``content`` (``null`` beside tool calls), an empty ``tool_calls`` list is left out, and
    ``parallel_tool_calls: false`` keeps only the first call's entries; ``include_reasoning:
    false`` sets ``reasoning`` to null in every delta that says something."""
    delta: dict[str, Any] = {}
    if d.content or d.call_deltas:
        delta["content"] = d.content or None
    if d.reasoning:
        delta["reasoning"] = d.reasoning
    elif not shown and not d.empty():
        delta["reasoning"] = None
    calls = [c for c in d.call_deltas if parallel or c.index == 0]
    if calls:
        delta["tool_calls"] = [_call_entry(c) for c in calls]
    return delta


def _call_entry(c) -> dict[str, Any]:
    """A tool-call entry: the first with the call's id and name (and the stream's closing ``{}``
    when the name came last), the later ones a piece of the arguments."""
    if c.name is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    function = {"name": c.name} if c.arguments is None else {"name": c.name, "arguments": c.arguments}
    return {"id": c.id, "type": "function", "index": c.index, "function": function}
