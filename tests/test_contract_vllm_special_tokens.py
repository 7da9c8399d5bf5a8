"""Contract: special tokens the model samples reach the answer as vLLM 0.32 sends them.

vLLM leaves special tokens out of the text (``skip_special_tokens``, default true) unless tools may
be called (its hermes tool parser keeps them) or the request turns it off; logprobs still name
them; a generation-config eos other than the tokenizer's (``<|endoftext|>``) is named in
``stop_reason``. Markup the model writes as text (``<tool_call>``, ``<tool_response>``) is not
special in Qwen's tokenizer and stays. The tokens are forced with ``allowed_token_ids`` +
``logit_bias`` and greedy decoding, so both servers sample the same ids and whole answers compare.
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


def answers(vllm: str, ours: str, body: dict) -> list:
    out = []
    for base in (vllm, ours):
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        out.append((r.status_code, rounded(essentials(r.text))))
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
