"""Contract: special tokens the model samples reach the answer as vLLM 0.32 sends them.

vLLM leaves special tokens out of the text (``skip_special_tokens``, default true) unless tools may
be called (its hermes tool parser keeps them) or the request turns it off; logprobs still name
them; a generation-config eos other than the tokenizer's (``<|endoftext|>``) is named in
``stop_reason``. Markup the model writes as text (``<tool_call>``, ``<tool_response>``) is not
special in Qwen's tokenizer and stays. The tokens are forced with ``allowed_token_ids`` +
``logit_bias`` and greedy decoding, so both servers sample the same ids and whole answers compare.
A stream is compared with its token events merged: vLLM sends several tokens in one event when
they are ready together, which depends on timing.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.vllm_recorded import essentials

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
# <|endoftext|> (a stop token), <|im_start|>, <|object_ref_start|>, <tool_call>, <tool_response>
TOKENS = [248044, 248045, 248047, 248058, 248066]


def rounded(x):
    """Logprobs agree to ~1e-4 between the two servers (float32 on different kernels)."""
    if isinstance(x, float):
        return round(x, 2)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x


def merged_chat(answer):
    """A chat stream with its token chunks (after the role chunk) merged into one."""
    if not isinstance(answer, list):
        return answer
    out, tokens = [], None
    for name, data in answer:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices or "role" in choices[0]["delta"]:
            out.append((name, data))
            continue
        ch = choices[0]
        if tokens is None:
            tokens = {**data, "choices": [{**ch, "delta": dict(ch["delta"])}]}
            out.append((name, tokens))
            continue
        m = tokens["choices"][0]
        if "content" in ch["delta"]:
            m["delta"]["content"] = m["delta"].get("content", "") + ch["delta"]["content"]
        for key in ("logprobs", "token_ids"):
            if ch.get(key) is not None:
                m[key] = ({"content": m[key]["content"] + ch[key]["content"]} if key == "logprobs"
                          else m[key] + ch[key])
        for key in ("finish_reason", "stop_reason"):
            if key in ch:
                m[key] = ch[key]
    return out


def merged_responses(answer):
    """A Responses stream with consecutive text deltas merged, without sequence numbers."""
    if not isinstance(answer, list):
        return answer
    out: list = []
    for name, data in answer:
        data = {k: v for k, v in data.items() if k != "sequence_number"}
        if name == "response.output_text.delta" and out and out[-1][0] == name:
            last = out[-1][1]
            out[-1] = (name, {**last, "delta": last["delta"] + data["delta"],
                              "logprobs": last["logprobs"] + data["logprobs"]})
        else:
            out.append((name, data))
    return out


def answers(vllm: str, ours: str, body: dict) -> list:
    out = []
    for base in (vllm, ours):
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        out.append((r.status_code, merged_chat(rounded(essentials(r.text)))))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("extra", [
    {"logprobs": True, "return_token_ids": True},
    {"tools": TOOLS},
    {"skip_special_tokens": False},
], ids=["logprobs", "tools", "kept"])
def test_forced_special_tokens_are_answered_as_vllm_answers_them(vllm_base_url, polar_base_url,
                                                                 stream, extra):
    for token in TOKENS:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                "temperature": 0, "allowed_token_ids": [token, 40], "logit_bias": {str(token): 100},
                "stream": stream, **extra}
        vllm, ours = answers(vllm_base_url, polar_base_url, body)
        assert vllm == ours, token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("extra", [
    {"include": ["message.output_text.logprobs"], "top_logprobs": 1},
    {"skip_special_tokens": False},
    {"stop_token_ids": [248045], "include_stop_str_in_output": True},
], ids=["logprobs", "kept", "stop-token"])
def test_responses_answer_forced_tokens_as_vllm(vllm_base_url, polar_base_url, stream, extra):
    """The Responses request has a few of vLLM's sampling extensions (``skip_special_tokens``,
    ``stop_token_ids``, ``include_stop_str_in_output`` ...); ``logit_bias`` forces the token.
    (``usage`` is left out: vLLM counts prefix-cache writes there, which depend on its past.)"""
    for token in (248045, 248044, 10838, 40):
        body = {"model": "tiny", "input": "Hello", "max_output_tokens": 3, "temperature": 0,
                "logit_bias": {str(token): 100}, "stream": stream, **extra}
        got = []
        for base in (vllm_base_url, polar_base_url):
            r = httpx.post(base + "/v1/responses", json=body, timeout=120)
            got.append((r.status_code, merged_responses(without_usage(rounded(essentials(r.text))))))
        assert got[0] == got[1], token


def without_usage(x):
    if isinstance(x, dict):
        return {k: without_usage(v) for k, v in x.items() if k != "usage"}
    if isinstance(x, list):
        return [without_usage(v) for v in x]
    return x
