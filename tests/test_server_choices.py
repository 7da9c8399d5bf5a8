"""``n > 1`` on chat completions as vLLM 0.32 answers it: ``n`` independent choices (a seeded
request gives choice ``i`` the seed ``seed + i``), usage summing their tokens, a stream that sends
every choice's role chunk and then interleaves the choices step by step, and vLLM's 400s for
``n < 1`` and for ``n > 1`` with greedy sampling.

The reference answers in ``tests/data/vllm_wire/choices.json`` are vLLM 0.32's (its CPU build on
the tiny model), recorded with these very requests. Sampled text cannot match vLLM's, so sampled
answers are compared with the text masked; errors are compared whole.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.vllm_recorded import assert_answers_as_vllm, essentials, recorded

RECORDED = recorded("choices")
USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"


def _mask(obj: Any) -> Any:
    """The answer with sampled text (and what depends on it) replaced by a placeholder."""
    if isinstance(obj, dict):
        return {k: "<text>" if k == "content" and isinstance(v, str) and v else _mask(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mask(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_mask(v) for v in obj)
    return obj


@pytest.mark.parametrize("name", ["chat_n0", "chat_n2_t0"])
def test_refusal_equals_vllms_recorded_answer(polar_base_url, name):
    assert_answers_as_vllm(polar_base_url, RECORDED[name])


def test_n2_answer_has_vllms_shape(polar_base_url):
    """Same fields, two choices indexed 0 and 1, usage summing both (each runs to max_tokens here:
    ignore_eos keeps the tiny model from stopping early, which vLLM's answer did not either)."""
    case = RECORDED["chat_n2"]
    r = httpx.post(polar_base_url + CHAT, json={**case["request"]["body"], "ignore_eos": True,
                                                "seed": 3}, timeout=120)
    assert r.status_code == 200, r.text
    assert _mask(essentials(r.text)) == _mask(essentials(case["body"]))


def test_usage_sums_the_choices_tokens(polar_base_url):
    body = {"model": "tiny", "messages": USER, "max_tokens": 6, "n": 3, "seed": 11,
            "return_token_ids": True}
    out = httpx.post(polar_base_url + CHAT, json=body, timeout=120).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]


def test_seeded_choices_are_reproducible_independent_and_choice0_is_the_n1_answer(polar_base_url):
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "seed": 5, "return_token_ids": True,
            "ignore_eos": True}
    a = httpx.post(polar_base_url + CHAT, json={**body, "n": 2}, timeout=120).json()
    b = httpx.post(polar_base_url + CHAT, json={**body, "n": 2}, timeout=120).json()
    one = httpx.post(polar_base_url + CHAT, json=body, timeout=120).json()
    six = httpx.post(polar_base_url + CHAT, json={**body, "seed": 6}, timeout=120).json()
    ids = [c["token_ids"] for c in a["choices"]]
    assert ids == [c["token_ids"] for c in b["choices"]]
    assert ids[0] != ids[1]
    assert ids[0] == one["choices"][0]["token_ids"]  # vLLM: child i samples with seed + i
    assert ids[1] == six["choices"][0]["token_ids"]


def _stream(base: str, body: dict) -> tuple[list[str], list[dict]]:
    with httpx.stream("POST", base + CHAT, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    return lines, [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def test_n2_stream_has_vllms_chunks_in_vllms_order(polar_base_url):
    """Role chunks for choice 0 then 1, then one chunk per choice per step in index order, the
    finish on each choice's last chunk, the usage chunk summing both, then [DONE]."""
    case = RECORDED["chat_n2_stream"]
    body = {**case["request"]["body"], "ignore_eos": True, "seed": 3}
    with httpx.stream("POST", polar_base_url + CHAT, json=body, timeout=120) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert _mask(essentials(text)) == _mask(essentials(case["body"]))


def test_n2_streamed_text_equals_non_streamed_text(polar_base_url):
    body = {"model": "tiny", "messages": USER, "max_tokens": 10, "n": 2, "seed": 9,
            "return_token_ids": True}
    full = httpx.post(polar_base_url + CHAT, json=body, timeout=120).json()
    lines, chunks = _stream(polar_base_url, {**body, "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]"
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert all("role" in c["choices"][0]["delta"] for c in chunks[:2])
    assert all(c["prompt_token_ids"] == full["prompt_token_ids"] for c in chunks[:2])
    texts, ids, finishes = ["", ""], [[], []], [None, None]
    for c in chunks[2:-1]:
        (ch,) = c["choices"]
        assert finishes[ch["index"]] is None  # nothing after a choice's finish
        texts[ch["index"]] += ch["delta"].get("content", "")
        ids[ch["index"]] += ch["token_ids"]
        finishes[ch["index"]] = ch["finish_reason"]
    assert texts == [c["message"]["content"] for c in full["choices"]]
    assert ids == [c["token_ids"] for c in full["choices"]]
    assert finishes == [c["finish_reason"] for c in full["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        k: full["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}


def test_n_not_an_integer_is_refused_cleanly(polar_base_url):
    r = httpx.post(polar_base_url + CHAT, json={"model": "tiny", "messages": USER, "n": "two"},
                   timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400
