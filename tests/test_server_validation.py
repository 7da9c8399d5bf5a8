"""``polar-train serve`` refuses bad input as vLLM 0.32 does (status, type, param, message; never a
500), reads fields in pydantic's lax mode, refuses over-long prompts before tokenising, and stops
generating for a client that left."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

USER = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 2}


def post(base: str, path: str, body) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(base + path, content=data, timeout=60,
                      headers={"Content-Type": "application/json"})


def test_overlong_prompt_is_refused_before_tokenising(polar_base_url):
    """vLLM's character bound (max_model_len x the longest token): refused at once, not tokenised."""
    started = time.monotonic()
    r = post(polar_base_url, "/v1/chat/completions",
             {**CHAT, "messages": [{"role": "user", "content": "a" * 3_000_000}]})
    assert time.monotonic() - started < 5  # tokenising 3 MB alone takes seconds
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == "input_text"
    assert err["message"].startswith("This model's maximum context length is 4096 tokens. However, "
                                     "your prompt contains ")
    assert "characters, which is the upper bound for 4096 input tokens). Please reduce the length " \
           "of the input prompt. (parameter=input_text, value=" in err["message"]
    tok = post(polar_base_url, "/tokenize", {"model": "tiny", "prompt": "a" * 3_000_000})
    assert tok.status_code == 400 and tok.json()["error"]["param"] == "input_text"


@pytest.mark.parametrize("extra, kind", [
    ({"seed": 99999999999999999999999}, "less_than_equal"),
    ({"stream_options": "x", "stream": True}, "model_type"),
    ({"stream": "maybe"}, "bool_parsing"),
    ({"logprobs": [1]}, "bool_type"),
    ({"max_tokens": "four"}, "int_parsing"),
    ({"max_tokens": 2.5}, "int_from_float"),
    ({"temperature": "hot"}, "float_parsing"),
    ({"stream": " true "}, "bool_parsing"),  # pydantic trims no boolean text
    ({"max_tokens": "\u0664"}, "int_parsing"),  # an Arabic-Indic four: int() takes it, pydantic not
    ({"max_tokens": "4."}, "int_parsing"),
    ({"max_tokens": "4.5"}, "int_parsing"),  # text with a fraction: not int_from_float
])
def test_field_type_errors_are_pydantics(polar_base_url, extra, kind):
    r = post(polar_base_url, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    field = next(iter(extra)) if kind != "model_type" else "stream_options"
    assert err["type"] == "Bad Request" and err["param"] == f"body.{field}"
    assert err["message"].startswith(f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.{field}'")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "temperature": float("nan")}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, None),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -2.5}, None),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 99999}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}, None),
    ("/v1/responses", {"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/a.png"}]}]}, None),
])
def test_vllm_checks_in_vllms_words(polar_base_url, path, body, param):
    r = post(polar_base_url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == param
    expected = {
        "temperature": "temperature must be a finite number, got nan. (parameter=temperature, value=nan)",
        "top_p": "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)",
        "stream_options": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        "max_tokens": "max_tokens=99999 cannot be greater than max_model_len=4096. Please request "
                      "fewer output tokens. (parameter=max_tokens, value=99999)",
    }
    if param in expected:
        assert err["message"] == expected[param]
    elif "penalty" in json.dumps(body):
        assert "must be in [-2, 2], got" in err["message"]
    else:
        assert err["message"] == "tiny is not a multimodal model"


def test_unknown_previous_response_is_vllms_404(polar_base_url):
    r = post(polar_base_url, "/v1/responses", {"model": "tiny", "input": "x",
                                               "previous_response_id": "resp_abc"})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Response with id 'resp_abc' not found.",
                                  "type": "invalid_request_error", "param": "response_id", "code": 404}}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/tokenize", {"model": "tiny", "prompt": "\ud800"}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/responses", {"model": "tiny", "input": [{"type": "reasoning", "content": "abc"}]}),
    ("/v1/responses", {"model": "tiny", "input": [{"type": "reasoning", "content": [5]}]}),
    ("/v1/responses", {"model": "tiny", "input": [{"type": "reasoning", "summary": "abc"}]}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": 5}],
                      "messages": USER}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}]}),
    ("/tokenize", {"model": "tiny", "prompt": "x", "add_special_tokens": "x"}),
])
def test_malformed_fields_are_400_not_500(polar_base_url, path, body):
    r = post(polar_base_url, path, json.dumps(body, ensure_ascii=True))
    assert r.status_code == 400, r.text
    data = r.json()
    err = data["error"]
    assert err["type"] in ("BadRequestError", "Bad Request") and "Traceback" not in err["message"]
    if path.startswith("/v1/messages"):
        assert data["type"] == "error"


def test_deeply_nested_body_is_fastapis_parse_error(polar_base_url):
    r = post(polar_base_url, "/v1/chat/completions", "[" * 100000 + "]" * 100000)
    assert r.status_code == 400 and r.json() == {"detail": "There was an error parsing the body"}


def test_fields_are_read_in_pydantic_lax_mode(polar_base_url):
    r = post(polar_base_url, "/v1/chat/completions",
             {**CHAT, "stream": "false", "logprobs": "no", "max_tokens": "3", "temperature": "0.5",
              "seed": "5", "return_token_ids": "on"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["logprobs"] is None
    assert body["prompt_token_ids"]  # "on" is true
    same = post(polar_base_url, "/v1/chat/completions",
                {**CHAT, "max_tokens": 3.0, "temperature": 0.5, "seed": 5, "return_token_ids": True})
    assert same.json()["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    tok = post(polar_base_url, "/tokenize", {"model": "tiny", "messages": USER,
                                             "add_generation_prompt": "no"}).json()
    with_prompt = post(polar_base_url, "/tokenize", {"model": "tiny", "messages": USER}).json()
    assert tok["count"] < with_prompt["count"]


class _EndlessEngine:
    """Generates forever until stopped, and says when it was (the observable of the test)."""

    def __init__(self, tokenizer) -> None:
        from polar_train.server.engine import TokenStep

        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, 4096, len(tokenizer)
        self.max_chars_per_token, self.stop_token_ids = 128, frozenset()
        self.started, self.cancelled = threading.Event(), threading.Event()
        self._step = TokenStep

    def generate(self, prompt_ids, params, cancelled):
        self.started.set()
        try:
            while not cancelled():
                yield self._step(11, -1.0)
        finally:  # cancelled() seen, or the worker closed the generator: either way it stopped
            self.cancelled.set()


def test_client_disconnect_stops_a_non_streamed_generation(tiny_tokenizer):
    import uvicorn

    from polar_train.server.app import Server, build_app

    engine = _EndlessEngine(tiny_tokenizer)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(Server(engine, "tiny")), host="127.0.0.1",
                                           port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the observable "started", with a deadline
        assert server.started
        body = json.dumps({**CHAT, "max_tokens": 4000}).encode()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert engine.started.wait(30)
        assert engine.cancelled.wait(30), "generation went on after the client left"
    finally:
        server.should_exit = True
        thread.join(30)


def test_top_logprobs_text_and_an_empty_previous_response_id_as_vllm(polar_base_url):
    """vLLM's check_logprobs looks at the raw value, and it asks ``is not None`` of a previous id."""
    r = post(polar_base_url, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": "2"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "`top_logprobs` must be an integer. (parameter=top_logprobs, value=2)")
    r = post(polar_base_url, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                               "previous_response_id": ""})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Response with id '' not found."
