"""vLLM 0.32's small routes and stream extras: ``/version``, ``/ping`` (GET and POST, empty 200),
``/load``, HEAD on a GET route (405, ``allow: GET``), and ``stream_options.continuous_usage_stats``
(with ``include_usage``: usage on every chunk; without it: ignored).

The reference answers in ``tests/data/vllm_wire/misc_routes.json`` are vLLM 0.32's (its CPU build
on the tiny model, greedy), recorded with these very requests; ids and timestamps are ignored, and
of the headers ``allow``, ``content-type`` and ``content-length`` are compared (streams are chunked).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.vllm_recorded import assert_answers_as_vllm, recorded

RECORDED = recorded("misc_routes")


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_answer_equals_vllms_recorded_answer(polar_base_url, name):
    case = RECORDED[name]
    r = assert_answers_as_vllm(polar_base_url, case)
    for key, value in case["headers"].items():
        if key == "content-type" and value.startswith("text/event-stream"):
            assert r.headers[key].startswith("text/event-stream")
        else:
            assert r.headers.get(key) == value, key
    if "content-type" not in case["headers"]:
        assert "content-type" not in r.headers


def test_continuous_usage_counts_each_choice_of_a_sampled_n2_stream(polar_base_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
            "n": 2, "seed": 1, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", polar_base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        assert c["usage"]["completion_tokens"] == seen[ch["index"]]
        assert c["usage"]["completion_tokens_details"] is None
        seen[ch["index"]] += 1
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_head_on_get_routes_is_405(polar_base_url):
    for path in ("/health", "/v1/models", "/version", "/load", "/ping"):
        r = httpx.head(polar_base_url + path, timeout=30)
        assert r.status_code == 405, path
        assert "GET" in r.headers["allow"]


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "metadata": {"k": "\ud83d"}}),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "user": "\ud800", "stream": True}),
    ("/v1/chat/completions", {"model": "tiny\ud800", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": "tiny\ud800", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_lone_surrogate_echoed_back_is_escaped_not_a_500(polar_base_url, path, body):
    """JSON may hold a lone surrogate (``"\\ud800"``), which UTF-8 cannot encode: echoed in an answer
    (metadata, user) or an error (the model name), it gave a 500 with a traceback (plain text for
    the error), and a stream that had sent its headers ended without an event."""
    data = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as its \u escape
    assert b"\\ud8" in data
    with httpx.stream("POST", polar_base_url + path, content=data, timeout=120,
                      headers={"content-type": "application/json"}) as r:
        raw = r.read()
    assert r.status_code == (404 if "\ud800" in body["model"] else 200), raw[:300]
    texts = [raw] if not body.get("stream") else [line[6:] for line in raw.splitlines() if line.startswith(b"data: ")]
    answers = [json.loads(t) for t in texts]
    echoed = json.dumps(answers, ensure_ascii=False)
    assert "\ud800" in echoed or "\ud83d" in echoed  # the same string back, as its escape
    if body.get("stream"):
        assert answers[-1]["type"] == "response.completed" and answers[-1]["response"]["user"] == "\ud800"
    elif r.status_code == 200:
        assert answers[0]["metadata"] == {"k": "\ud83d"}
