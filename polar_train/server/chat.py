"""``POST /v1/chat/completions`` in vLLM 0.32's shapes (with its ``return_token_ids`` extension).

Non-streamed: one ``chat.completion`` object. Streamed: a first chunk with the role (and
``prompt_token_ids``), one chunk per token that adds text (``token_ids`` as per-chunk deltas), the
finish on the last token's chunk, an optional usage chunk with ``choices: []``, then ``[DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from .common import check_model, integer, refuse_images, require_list, sampling
from .completion import CompletionState
from .errors import BadRequest, VllmError
from .fields import flag, obj
from .parse import random_id
from .prompt import encode_prompt, normalize_tool, render
from .script import RequestView
from .sse import sse_data

SYSTEM_FINGERPRINT = "vllm-0.32.0-polar"


def prepare(server, body: dict) -> dict[str, Any]:
    """Validate the request and render its prompt; everything a chat call needs."""
    model = check_model(body, server.served_name)
    messages = require_list(body, "messages")
    refuse_images(messages, model)
    tools_raw = body.get("tools")
    if tools_raw is not None and not isinstance(tools_raw, list):
        raise BadRequest("tools must be a list", param="tools")
    tools = [normalize_tool(t) for t in tools_raw or []]
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    n = integer(body, "n", 1, lo=1)
    if n != 1:
        raise BadRequest("n > 1 is not supported by polar-train serve", param="n")
    stream = flag(body, "stream")
    stream_options = obj(body, "stream_options", "StreamOptions")
    if body.get("stream_options") and not body.get("stream"):  # vLLM tests the raw values
        raise VllmError("Stream options can only be defined when `stream=True`.",
                        param="stream_options")
    logprobs = flag(body, "logprobs")
    raw_top = body.get("top_logprobs")
    if raw_top is not None and not isinstance(raw_top, (int, float)):
        # vLLM's check_logprobs looks at the raw value: no lax reading of a string here
        raise VllmError("`top_logprobs` must be an integer.", param="top_logprobs", value=raw_top)
    top = integer(body, "top_logprobs", 0, lo=0, hi=20) or 0
    if top and not logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    text = render(server.tokenizer, messages, tools or None,
                  add_generation_prompt=flag(body, "add_generation_prompt", True),
                  continue_final_message=flag(body, "continue_final_message"))
    prompt_ids = encode_prompt(server.engine, text)
    params = sampling(body, server.engine, len(prompt_ids), ("max_completion_tokens", "max_tokens"),
                      top_logprobs=top, clamp=server.script is not None)
    view = RequestView("openai.chat", messages, [t["function"]["name"] for t in tools])
    return {
        "model": model, "prompt_ids": prompt_ids, "params": params, "view": view,
        "tools_enabled": bool(tools) and tool_choice != "none", "logprobs": logprobs,
        "return_token_ids": flag(body, "return_token_ids"),
        "stream": stream,
        "include_usage": flag(stream_options, "include_usage", field="stream_options.include_usage"),
    }


def logprob_entries(server, steps, top: int) -> list[dict[str, Any]]:
    out = []
    for s in steps:
        tok = server.engine.token_text(s.token_id)
        out.append({
            "token": tok, "logprob": s.logprob, "bytes": server.engine.token_bytes(s.token_id),
            "top_logprobs": [{"token": server.engine.token_text(i), "logprob": lp,
                              "bytes": server.engine.token_bytes(i)} for i, lp in s.top],
        })
    return out


def usage(prompt_len: int, completion_len: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_len, "total_tokens": prompt_len + completion_len,
            "completion_tokens": completion_len}


def finish_reason(state: CompletionState) -> str:
    if state.final() and state.final().tool_calls and state.tools_enabled:
        return "tool_calls"
    return state.finish.reason if state.finish else "length"


async def respond(server, req: dict[str, Any]) -> dict[str, Any]:
    state = CompletionState(server.engine, req["tools_enabled"])
    async for step in server.tokens(req):
        state.push(step)
    parsed = state.final()
    message: dict[str, Any] = {
        "role": "assistant", "content": parsed.content if not (parsed.content is None and
                                                               not parsed.tool_calls) else "",
        "refusal": None, "annotations": None, "audio": None, "function_call": None,
    }
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls]
    message["reasoning"] = parsed.reasoning
    n_prompt, n_out = len(req["prompt_ids"]), len(state.steps)
    return {
        "id": f"chatcmpl-{random_id()}", "object": "chat.completion", "created": int(time.time()),
        "model": req["model"],
        "choices": [{
            "index": 0, "message": message,
            "logprobs": {"content": logprob_entries(server, state.steps, req["params"].top_logprobs)}
            if req["logprobs"] else None,
            "finish_reason": finish_reason(state),
            "stop_reason": state.finish.stop_reason if state.finish else None,
            "token_ids": state.token_ids if req["return_token_ids"] else None,
            "routed_experts": None,
        }],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {**usage(n_prompt, n_out), "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "prompt_logprobs": None,
        "prompt_token_ids": req["prompt_ids"] if req["return_token_ids"] else None,
        "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


async def stream(server, req: dict[str, Any]) -> AsyncIterator[bytes]:
    cid, created, model = f"chatcmpl-{random_id()}", int(time.time()), req["model"]
    rti = req["return_token_ids"]

    def chunk(choices: list, **extra: Any) -> bytes:
        return sse_data({"id": cid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "choices": choices, **extra})

    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}],
                prompt_token_ids=req["prompt_ids"] if rti else None, prompt_text=None)
    state = CompletionState(server.engine, req["tools_enabled"])
    pending = []
    async for step in server.tokens(req):
        d = state.push(step)
        pending.append(step)
        is_finish = state.finish is not None
        if d.empty() and not is_finish:
            continue  # vLLM holds a token back until it adds text (e.g. half a UTF-8 character)
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = []
            for i, c in d.tool_calls:
                delta["tool_calls"].append({"id": c.id, "type": "function", "index": i,
                                            "function": {"name": c.name}})
                delta["tool_calls"].append({"index": i, "function": {"arguments": c.arguments}})
        choice: dict[str, Any] = {
            "index": 0, "delta": delta,
            "logprobs": {"content": logprob_entries(server, pending, req["params"].top_logprobs)}
            if req["logprobs"] else None,
            "finish_reason": finish_reason(state) if is_finish else None,
        }
        if is_finish:
            choice["stop_reason"] = state.finish.stop_reason
        choice["token_ids"] = [s.token_id for s in pending] if rti else None
        pending = []
        if is_finish and not req["include_usage"]:
            yield chunk([choice], system_fingerprint=SYSTEM_FINGERPRINT)
        else:
            yield chunk([choice])
    if req["include_usage"]:
        yield chunk([], usage=usage(len(req["prompt_ids"]), len(state.steps)),
                    system_fingerprint=SYSTEM_FINGERPRINT)
    yield b"data: [DONE]\n\n"
