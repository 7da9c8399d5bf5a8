"""``polar-train serve`` samples as vLLM 0.32 does: stop strings held back while streaming, vLLM's
sampling extensions (``stop_token_ids``, ``min_tokens``, penalties, ``allowed_token_ids``,
``bad_words``, ``truncate_prompt_tokens``) applied with its semantics, fields it cannot honour
refused by name, constrained decoding refused instead of sampled freely.

The reference answers in ``tests/data/vllm_wire/sampling.json`` are vLLM 0.32's (its CPU build on
the tiny model, greedy), recorded with these very requests; ids and timestamps are ignored.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.vllm_recorded import assert_answers_as_vllm, recorded

RECORDED = recorded("sampling")
USER = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_answer_equals_vllms_recorded_answer(polar_base_url, name):
    assert_answers_as_vllm(polar_base_url, RECORDED[name])


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def _sse(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


STOPS = ["e", "\n\n", "an"]


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_equals_non_streamed_text_with_stop_strings(polar_base_url, seed):
    """A stream holds back what may start a stop string, so it never sends text the full answer
    lacks: on every API the streamed text equals the non-streamed one."""
    chat = {"model": "tiny", "messages": USER, "max_tokens": 12, "seed": seed, "stop": STOPS}
    full = _post(polar_base_url, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    chunks = _sse(polar_base_url, "/v1/chat/completions", chat)
    assert "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"]) == full

    msg = {"model": "tiny", "messages": USER, "max_tokens": 12, "seed": seed, "stop_sequences": STOPS}
    body = _post(polar_base_url, "/v1/messages", msg).json()
    full = "".join(b.get("text", "") for b in body["content"])
    events = _sse(polar_base_url, "/v1/messages", msg)
    streamed = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert streamed == full
    if not full:  # vLLM opens no content block when no text is left
        assert not [e for e in events if e["type"] == "content_block_start"]

    resp = {"model": "tiny", "input": "Hello", "max_output_tokens": 12, "seed": seed, "stop": STOPS}
    out = _post(polar_base_url, "/v1/responses", resp).json()["output"]
    full = "".join(p["text"] for item in out if item["type"] == "message" for p in item["content"])
    events = _sse(polar_base_url, "/v1/responses", resp)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == full


def test_penalties_change_the_tokens_and_allowed_ids_bound_them(polar_base_url):
    """Sampled (not greedy) requests: the penalties are applied, ``allowed_token_ids`` holds."""
    base = {"model": "tiny", "messages": USER, "max_tokens": 6, "seed": 3, "return_token_ids": True}
    plain = _post(polar_base_url, "/v1/chat/completions", base).json()["choices"][0]["token_ids"]
    again = _post(polar_base_url, "/v1/chat/completions", base).json()["choices"][0]["token_ids"]
    assert plain == again
    allowed = _post(polar_base_url, "/v1/chat/completions",
                    {**base, "allowed_token_ids": [9419, 1879, 198]}).json()["choices"][0]["token_ids"]
    assert set(allowed) <= {9419, 1879, 198}
    greedy = {**base, "temperature": 0}
    banned = _post(polar_base_url, "/v1/chat/completions",
                   {**greedy, "bad_words": ["Hello"]}).json()["choices"][0]
    assert banned["finish_reason"] == "length"


@pytest.mark.parametrize("extra, message", [
    ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal to max_tokens=2, got 5."),
    ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0."),
    ({"min_p": 2}, "min_p must be in [0, 1], got 2.0."),
    ({"allowed_token_ids": []}, "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])"),
    ({"stop_token_ids": [999999999]}, "token_id(s) [999999999] in stop_token_ids contain out-of-vocab token "
     "ids. Vocabulary size: 248077 (parameter=stop_token_ids, value=[999999999])"),
    ({"use_beam_search": True}, "`use_beam_search` is not supported by polar-train serve (parameter=use_beam_search)"),
    ({"prompt_logprobs": 1}, "`prompt_logprobs` is not supported by polar-train serve (parameter=prompt_logprobs)"),
    ({"length_penalty": 0.5}, "`length_penalty` is not supported by polar-train serve (parameter=length_penalty)"),
])
def test_sampling_fields_checked_or_refused_by_name(polar_base_url, extra, message):
    r = _post(polar_base_url, "/v1/chat/completions",
              {"model": "tiny", "messages": USER, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["message"] == message



@pytest.mark.parametrize("extra, message", [
    ({"n": 20000, "temperature": 1}, "n must be at most 16384, got 20000. To increase this limit, set the "
                                     "VLLM_MAX_N_SEQUENCES environment variable."),
    ({"truncate_prompt_tokens": 0}, "The decoder prompt cannot be empty"),
    ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens=5000 cannot be greater than max_model_len = "
                                       "4096. Please request a smaller truncation size. "
                                       "(parameter=truncate_prompt_tokens, value=5000)"),
    ({"bad_words": [f"w{i}q" for i in range(130)]}, "Too many bad words after tokenization: 129. The max "
                                                     "number is 128. (parameter=bad_words"),
])
def test_vllms_limits_are_checked(polar_base_url, extra, message):
    """n without a cap started a thread per choice until the server ran out of memory; a prompt cut
    to nothing was a 500; the other limits were not checked at all."""
    r = _post(polar_base_url, "/v1/chat/completions",
              {"model": "tiny", "messages": USER, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message)


def test_a_stop_string_may_start_in_the_first_min_tokens_text():
    """vLLM searches each new token's text from len(stop) - 1 characters back, so a stop string
    that starts inside the first min_tokens tokens and ends after them matches."""
    from types import SimpleNamespace

    from polar_train.server.engine import SamplingParams, StopStrings

    from tests.support.piece_tokenizer import piece_tokenizer

    engine = SimpleNamespace(tokenizer=piece_tokenizer(["?", "krát", " 공유", " x"]))
    stops = StopStrings(engine, SamplingParams(8, stop=["át 공"], min_tokens=1))
    assert stops.extend([1], check=False) is None
    finish = stops.extend([1, 2], check=True)
    assert finish is not None and finish.stop_reason == "át 공" and finish.text_end == 2


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
MTOOLS = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
RTOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 2}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs"),
    ("/v1/messages", {**CHAT, "tools": MTOOLS, "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/messages", {**CHAT, "tools": MTOOLS, "tool_choice": {"type": "tool", "name": "f"}}, "tool_choice"),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "tools": RTOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "tools": RTOOLS,
                       "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
    # vLLM constrains it (its response_format); answered here with free text before (an SDK probe)
    ("/v1/messages", {**CHAT, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config"),
])
def test_constrained_decoding_is_refused_not_sampled_freely(polar_base_url, path, body, param):
    r = _post(polar_base_url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError"
    assert "polar-train serve does not constrain decoding" in err["message"]
    assert err["message"].endswith(f"(parameter={param})")


def test_a_thinking_budget_is_refused_not_ignored(polar_base_url):
    """vLLM takes ``thinking: {type: enabled, budget_tokens}`` for the chat request's
    thinking_token_budget (a 400 without a reasoning parser); this server sampled on, unbudgeted.
    ``adaptive`` (what Claude Code sends) and ``disabled`` pin no budget: served."""
    body = {**CHAT, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    r = _post(polar_base_url, "/v1/messages", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == ("`thinking` {'type': 'enabled'} (a thinking_token_budget) is not supported "
                                            "by polar-train serve; use {'type': 'adaptive'} (parameter=thinking)")
    for kind in ("adaptive", "disabled"):
        assert _post(polar_base_url, "/v1/messages", {**CHAT, "thinking": {"type": kind}}).status_code == 200
