"""Chat ``return_tokens_as_token_ids`` and ``echo`` answered as vLLM 0.32 answers them.

The reference answers in ``tests/data/vllm_wire/echo_token_ids.json`` are vLLM 0.32's (its CPU
build on the tiny model, greedy), recorded with these very requests; ids and timestamps are
ignored. ``return_tokens_as_token_ids`` names every logprobs token ``token_id:<id>``; ``echo``
puts the last message's content before the answer's when that message has the answer's role and
returns ``prompt_logprobs``. Those are computed by a separate full-prompt forward pass whose float32
sums may differ from vLLM's in the last bit, so their logprobs are compared to a relative 1e-6
(ids, ranks and tokens exactly); everything else must be equal.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.vllm_recorded import assert_answers_as_vllm, recorded, send

RECORDED = recorded("echo_token_ids")
ANSWERED = sorted(k for k in RECORDED if "body" in RECORDED[k])


def _approx_prompt_logprobs(body):
    if isinstance(body, dict) and body.get("prompt_logprobs"):
        body = {**body, "prompt_logprobs": [
            None if row is None else {
                tok: {**e, "logprob": pytest.approx(e["logprob"], rel=1e-6)} for tok, e in row.items()}
            for row in body["prompt_logprobs"]]}
    return body


@pytest.mark.parametrize("name", ANSWERED)
def test_answer_equals_vllms_recorded_answer(polar_base_url, name):
    assert_answers_as_vllm(polar_base_url, RECORDED[name], _approx_prompt_logprobs)


def test_tokens_as_ids_bytes_follow_vllm(polar_base_url):
    """The entry keeps the real token's bytes; an alternative's bytes spell ``token_id:<id>``."""
    body = {**RECORDED["chat_tokens_as_ids"]["request"]["body"], "top_logprobs": 3}
    r = httpx.post(polar_base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:")
        assert entry["bytes"] == [10]  # "\n", token 198
        assert len(entry["top_logprobs"]) == 3
        for alt in entry["top_logprobs"]:
            assert alt["token"].startswith("token_id:")
            assert alt["bytes"] == list(alt["token"].encode())


def test_echo_prompt_logprobs_follow_top_logprobs(polar_base_url):
    """vLLM's echo asks for ``top_logprobs`` prompt alternatives: the prompt token, then the k best."""
    body = {**RECORDED["chat_echo"]["request"]["body"], "logprobs": True, "top_logprobs": 2}
    r = httpx.post(polar_base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    rows = r.json()["prompt_logprobs"]
    assert rows[0] is None and len(rows) == r.json()["usage"]["prompt_tokens"]
    for row in rows[1:]:
        ranks = sorted(e["rank"] for e in row.values())
        assert 2 <= len(row) <= 3 and ranks[:2] == [1, 2]


def test_streamed_echo_of_the_final_message_is_refused_by_name(polar_base_url):
    """vLLM 0.32 answers 200 and then an error event mid-stream (recorded); serve refuses it with
    a 400 naming ``echo`` before streaming."""
    case = RECORDED["chat_cont_final_echo_stream"]
    assert '"error"' in case["vllm_body"]  # what vLLM sent instead of the echo
    r = send(polar_base_url, case["request"])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "echo" and "`echo`" in err["message"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
