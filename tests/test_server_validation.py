"""``polar-train serve`` refuses bad input as vLLM 0.32 does (status, type, param, message; never a
500), reads fields in pydantic's lax mode, refuses over-long prompts before tokenising, and stops
generating for a client that left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
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
    # /tokenize has no such bound in vLLM: a client measures a text too long to serve with it (a probe)
    tok = post(polar_base_url, "/tokenize", {"model": "tiny", "prompt": "a " * 300_000})
    assert tok.status_code == 200 and tok.json()["count"] == 300_001  # (vLLM 0.32: 300001)


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
    # an audio part was dropped from the prompt, answered 200 (a probe: vLLM 0.32 answers this 400)
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {
        "type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "http://x/a.mp4"}}]}]}, None),
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


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"role": "system", "content": None},
                                     {"role": "tool", "content": None, "tool_call_id": "a"}])
def test_a_null_content_is_refused_as_vllm_refuses_it(polar_base_url, message):
    """vLLM answers 400 (its union of message types, 18-19 entries); serve rendered an empty turn
    and answered 200 (a probe). An assistant turn with a null content (its tool calls) and a
    message without the key are taken, as vLLM takes them (its custom message type)."""
    r = post(polar_base_url, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}, message]})
    assert r.status_code == 400
    role = message["role"]
    assert r.json()["error"] == {"message": f"messages[1].content is null for role {role!r} (a string or a list "
                                            "of parts, or no content key)", "type": "Bad Request", "param": "messages",
                                 "code": 400}
    for taken in ({"role": "assistant", "content": None}, {"role": "system"}):
        ok = post(polar_base_url, "/v1/chat/completions", {**CHAT, "messages": [
            {"role": "user", "content": "x"}, taken, {"role": "user", "content": "y"}]})
        assert ok.status_code == 200


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
    if path == "/v1/messages/count_tokens":
        assert data["type"] == "error"
    elif path == "/v1/messages":  # a block field of the wrong type: vLLM's pydantic model refuses it,
        # in the OpenAI shape on this API too (its validation handler is app-wide)
        assert "type" not in data and err["type"] == "Bad Request" and "validation errors:" in err["message"]
        assert "'type': 'string_type'" in err["message"] and err["message"].count("'loc': 'body.") == 2


def test_deeply_nested_body_is_fastapis_parse_error(polar_base_url):
    r = post(polar_base_url, "/v1/chat/completions", "[" * 100000 + "]" * 100000)
    assert r.status_code == 400 and r.json() == {"detail": "There was an error parsing the body"}
    # a body that is no UTF-8: vLLM's answer too, on every API (serve said "request body is not valid JSON")
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        r = httpx.post(f"{polar_base_url}{path}", content=b'{"model": "tiny", "x": "\xff"}',
                       headers={"Content-Type": "application/json"})
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


@contextlib.contextmanager
def _served_in_process(engine):
    """Our app with ``engine`` under uvicorn in a thread; yields its port (a test reaches the
    server's own objects, which a subprocess would not show)."""
    import uvicorn

    from polar_train.server.app import Server, build_app

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
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def test_client_disconnect_stops_a_non_streamed_generation(tiny_tokenizer):
    engine = _EndlessEngine(tiny_tokenizer)
    with _served_in_process(engine) as port:
        body = json.dumps({**CHAT, "max_tokens": 4000}).encode()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert engine.started.wait(30)
        assert engine.cancelled.wait(30), "generation went on after the client left"


def test_a_client_gone_while_it_sent_its_body_is_no_internal_error(tiny_tokenizer, monkeypatch, caplog):
    """A probe: each client that closed its connection half way through its body was logged as an
    "internal error" with a traceback (starlette's ClientDisconnect): anyone could flood the log."""
    import logging

    from polar_train.server import app as server_app

    answered = threading.Event()
    statuses: list[int] = []
    real_error = server_app._error

    def recorded(exc, anthropic=False):
        response = real_error(exc, anthropic)
        statuses.append(response.status_code)
        answered.set()
        return response

    monkeypatch.setattr(server_app, "_error", recorded)
    caplog.set_level(logging.ERROR, logger="polar_train.server")
    with _served_in_process(_EndlessEngine(tiny_tokenizer)) as port:
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        assert answered.wait(30), "the request was never finished"
    assert statuses == [499]
    assert "internal error" not in caplog.text and "Traceback" not in caplog.text


def test_top_logprobs_text_and_an_empty_previous_response_id_as_vllm(polar_base_url):
    """vLLM's check_logprobs looks at the raw value, and it asks ``is not None`` of a previous id."""
    r = post(polar_base_url, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": "2"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "`top_logprobs` must be an integer. (parameter=top_logprobs, value=2)")
    r = post(polar_base_url, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                               "previous_response_id": ""})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Response with id '' not found."


#: vLLM 0.32's answers (its CPU build on the tiny model, ``--max-model-len 4096``, recorded with
#: these very bodies): pydantic's "Bad Request" for a field of the wrong shape (every failing
#: branch of a union listed, ``param`` the first one's location; on the Messages API too, in the
#: OpenAI shape), "BadRequestError" in vLLM's own words for the checks vLLM makes itself.
VLLM_ANSWERS = [
    ('/v1/chat/completions', {'model': 'tiny', 'messages': 'hi'},
     400, {'error': {'message': "1 validation error:\n  {'type': 'list_type', 'loc': 'body.messages', 'msg': 'Input should be a valid list', 'input': 'hi'}", 'type': 'Bad Request', 'param': 'body.messages', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny'},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 1 items>'}", 'type': 'Bad Request', 'param': 'body.messages', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [], 'max_tokens': 2},
     400, {'error': {'message': 'Cannot apply chat template to an empty conversation. Provide at least one message.', 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [{'type': 'x'}]},
     400, {'error': {'message': '2 validation errors:\n  {\'type\': \'literal_error\', \'loc\': \'body.tools.0.type\', \'msg\': "Input should be \'function\'", \'input\': \'x\', \'ctx\': {\'expected\': "\'function\'"}}\n  {\'type\': \'missing\', \'loc\': \'body.tools.0.function\', \'msg\': \'Field required\', \'input\': \'<dict of 1 items>\'}', 'type': 'Bad Request', 'param': 'body.tools.0.type', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [5]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body.tools.0', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '5'}", 'type': 'Bad Request', 'param': 'body.tools.0', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [{'type': 'function', 'function': {}}]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.tools.0.function.name', 'msg': 'Field required', 'input': '<dict of 0 items>'}", 'type': 'Bad Request', 'param': 'body.tools.0.function.name', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'n': 0},
     400, {'error': {'message': 'n must be at least 1, got 0.', 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stop': 5},
     400, {'error': {'message': "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '5'}\n  {'type': 'list_type', 'loc': 'body.stop', 'msg': 'Input should be a valid list', 'input': '5'}", 'type': 'Bad Request', 'param': 'body.stop', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stop': ['']},
     400, {'error': {'message': 'stop cannot contain an empty string.', 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stop': ''},
     400, {'error': {'message': 'stop cannot contain an empty string.', 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stop': [5]},
     400, {'error': {'message': "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '<list of 1 items>'}\n  {'type': 'string_type', 'loc': 'body.stop.0', 'msg': 'Input should be a valid string', 'input': '5'}", 'type': 'Bad Request', 'param': 'body.stop', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'logit_bias': {'x': 1}},
     400, {'error': {'message': "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x'] (parameter=logit_bias, value=['x'])", 'type': 'BadRequestError', 'param': 'logit_bias', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'logit_bias': {'999999999': 1}},
     400, {'error': {'message': 'token_id(s) [999999999] in logit_bias contain out-of-vocab token ids. Vocabulary size: 248077 (parameter=logit_bias, value=[999999999])', 'type': 'BadRequestError', 'param': 'logit_bias', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'logit_bias': {'5': 'x'}},
     400, {'error': {'message': "1 validation error:\n  {'type': 'float_parsing', 'loc': 'body.logit_bias.5', 'msg': 'Input should be a valid number, unable to parse string as a number', 'input': 'x'}", 'type': 'Bad Request', 'param': 'body.logit_bias.5', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'top_k': -2},
     400, {'error': {'message': 'top_k must be 0 (disable), or at least 1, got -2.', 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'logprobs': True, 'top_logprobs': 21},
     400, {'error': {'message': 'Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)', 'type': 'BadRequestError', 'param': 'logprobs', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'top_logprobs': 2},
     400, {'error': {'message': 'when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)', 'type': 'BadRequestError', 'param': 'top_logprobs', 'code': 400}}),
    ('/v1/chat/completions', {'model': 5, 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2},
     400, {'error': {'message': "1 validation error:\n  {'type': 'string_type', 'loc': 'body.model', 'msg': 'Input should be a valid string', 'input': '5'}", 'type': 'Bad Request', 'param': 'body.model', 'code': 400}}),
    ('/v1/chat/completions', b'{nope',
     400, {'error': {'message': "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}", 'type': 'Bad Request', 'param': 'body.1', 'code': 400}}),
    ('/v1/chat/completions', [1],
     400, {'error': {'message': "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '<list of 1 items>'}", 'type': 'Bad Request', 'param': 'body', 'code': 400}}),
    ('/v1/chat/completions', b'',
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}", 'type': 'Bad Request', 'param': 'body', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tool_choice': 'required'},
     400, {'error': {'message': 'When using `tool_choice`, `tools` must be set. (parameter=tool_choice)', 'type': 'BadRequestError', 'param': 'tool_choice', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 5},
     400, {'error': {'message': "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.input', 'msg': 'Input should be a valid string', 'input': '5'}\n  {'type': 'list_type', 'loc': 'body.input', 'msg': 'Input should be a valid list', 'input': '5'}", 'type': 'Bad Request', 'param': 'body.input', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'include': 'x'},
     400, {'error': {'message': "1 validation error:\n  {'type': 'list_type', 'loc': 'body.include', 'msg': 'Input should be a valid list', 'input': 'x'}", 'type': 'Bad Request', 'param': 'body.include', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'top_k': -2},
     400, {'error': {'message': 'top_k must be 0 (disable), or at least 1, got -2.', 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': [{'type': 'reasoning', 'encrypted_content': 'abc', 'summary': []}], 'max_output_tokens': 2},
     400, {'error': {'message': 'Encrypted content is not supported. (parameter=input)', 'type': 'BadRequestError', 'param': 'input', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field required', 'input': '<dict of 2 items>'}", 'type': 'Bad Request', 'param': 'body.max_tokens', 'code': 400}}),
    ('/v1/messages', {'max_tokens': 2, 'messages': [{'role': 'user', 'content': 'Hi'}]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.model', 'msg': 'Field required', 'input': '<dict of 2 items>'}", 'type': 'Bad Request', 'param': 'body.model', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'bot', 'content': 'x'}], 'max_tokens': 2},
     400, {'error': {'message': '1 validation error:\n  {\'type\': \'literal_error\', \'loc\': \'body.messages.0.role\', \'msg\': "Input should be \'user\', \'assistant\' or \'system\'", \'input\': \'bot\', \'ctx\': {\'expected\': "\'user\', \'assistant\' or \'system\'"}}', 'type': 'Bad Request', 'param': 'body.messages.0.role', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 3}], 'max_tokens': 2},
     400, {'error': {'message': "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.messages.0.content', 'msg': 'Input should be a valid string', 'input': '3'}\n  {'type': 'list_type', 'loc': 'body.messages.0.content', 'msg': 'Input should be a valid list', 'input': '3'}", 'type': 'Bad Request', 'param': 'body.messages.0.content', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [{}]},
     400, {'error': {'message': "2 validation errors:\n  {'type': 'missing', 'loc': 'body.tools.0.name', 'msg': 'Field required', 'input': '<dict of 0 items>'}\n  {'type': 'missing', 'loc': 'body.tools.0.input_schema', 'msg': 'Field required', 'input': '<dict of 0 items>'}", 'type': 'Bad Request', 'param': 'body.tools.0.name', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [{'name': 'f'}]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.tools.0.input_schema', 'msg': 'Field required', 'input': '<dict of 1 items>'}", 'type': 'Bad Request', 'param': 'body.tools.0.input_schema', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stop_sequences': 'a'},
     400, {'error': {'message': "1 validation error:\n  {'type': 'list_type', 'loc': 'body.stop_sequences', 'msg': 'Input should be a valid list', 'input': 'a'}", 'type': 'Bad Request', 'param': 'body.stop_sequences', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stop_sequences': ['']},
     400, {'type': 'error', 'error': {'type': 'BadRequestError', 'message': 'stop cannot contain an empty string.'}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 0},
     400, {'error': {'message': "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value error, max_tokens must be positive', 'input': '0', 'ctx': {'error': ValueError('max_tokens must be positive')}}", 'type': 'Bad Request', 'param': 'body.max_tokens', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 99999},
     400, {'type': 'error', 'error': {'type': 'BadRequestError', 'message': 'max_completion_tokens=99999 cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_completion_tokens, value=99999)'}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'top_k': -2},
     400, {'type': 'error', 'error': {'type': 'BadRequestError', 'message': 'top_k must be 0 (disable), or at least 1, got -2.'}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'thinking': {'type': 'enabled', 'budget_tokens': 10}},
     400, {'error': {'message': "1 validation error:\n  {'type': 'greater_than_equal', 'loc': 'body.thinking.enabled.budget_tokens', 'msg': 'Input should be greater than or equal to 1024', 'input': '10', 'ctx': {'ge': 1024}}", 'type': 'Bad Request', 'param': 'body.thinking.enabled.budget_tokens', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 10, 'thinking': {'type': 'enabled', 'budget_tokens': 2000}},
     400, {'error': {'message': "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': 'Value error, thinking.budget_tokens must be less than max_tokens', 'input': '<dict of 4 items>', 'ctx': {'error': ValueError('thinking.budget_tokens must be less than max_tokens')}}", 'type': 'Bad Request', 'param': 'body', 'code': 400}}),
    ('/v1/messages', b'{nope',
     400, {'error': {'message': "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double quotes'}}", 'type': 'Bad Request', 'param': 'body.1', 'code': 400}}),
    ('/v1/messages/count_tokens', {'messages': [{'role': 'user', 'content': 'Hi'}]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.model', 'msg': 'Field required', 'input': '<dict of 1 items>'}", 'type': 'Bad Request', 'param': 'body.model', 'code': 400}}),
    ('/tokenize', {'model': 'tiny'},
     400, {'error': {'message': "2 validation errors:\n  {'type': 'missing', 'loc': 'body.prompt', 'msg': 'Field required', 'input': '<dict of 1 items>'}\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 1 items>'}", 'type': 'Bad Request', 'param': 'body.prompt', 'code': 400}}),
    ('/detokenize', {'model': 'tiny', 'tokens': 'x'},
     400, {'error': {'message': "1 validation error:\n  {'type': 'list_type', 'loc': 'body.tokens', 'msg': 'Input should be a valid list', 'input': 'x'}", 'type': 'Bad Request', 'param': 'body.tokens', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': []},
     400, {'error': {'message': '`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. (parameter=tools)', 'type': 'BadRequestError', 'param': 'tools', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object', 'properties': {}}}}], 'tool_choice': {'type': 'function', 'function': {'name': 'g'}}},
     400, {'error': {'message': 'The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)', 'type': 'BadRequestError', 'param': 'tool_choice', 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object', 'properties': {}}}}], 'tool_choice': 'bogus'},
     400, {'error': {'message': 'Invalid value for `tool_choice`: bogus! Only named tools, "none", "auto" or "required" are supported. (parameter=tool_choice)', 'type': 'BadRequestError', 'param': 'tool_choice', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'tool_choice': 'required'},
     400, {'error': {'message': "Tool choice 'required' must be specified with 'tools' parameter. (parameter=tool_choice)", 'type': 'BadRequestError', 'param': 'tool_choice', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'prompt': {'id': 'x'}},
     400, {'error': {'message': 'prompt template is not supported (parameter=prompt)', 'type': 'BadRequestError', 'param': 'prompt', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': [], 'max_output_tokens': 2},
     400, {'error': {'message': 'Cannot apply chat template to an empty conversation. Provide at least one message.', 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [], 'max_tokens': 2},
     400, {'type': 'error', 'error': {'type': 'BadRequestError', 'message': 'Cannot apply chat template to an empty conversation. Provide at least one message.'}}),
    ('/v1/messages', [1],
     400, {'error': {'message': "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '<list of 1 items>'}", 'type': 'Bad Request', 'param': 'body', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'stop_sequences': ['a', 5]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'string_type', 'loc': 'body.stop_sequences.1', 'msg': 'Input should be a valid string', 'input': '5'}", 'type': 'Bad Request', 'param': 'body.stop_sequences.1', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'system': [5]},
     400, {'error': {'message': "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.system', 'msg': 'Input should be a valid string', 'input': '<list of 1 items>'}\n  {'type': 'model_attributes_type', 'loc': 'body.system.0', 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': '5'}", 'type': 'Bad Request', 'param': 'body.system', 'code': 400}}),
    ('/v1/messages', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 2, 'tools': [{'name': 'f', 'input_schema': {}}, {'type': 'web_search_20250305', 'name': 'web_search'}]},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.tools.1.input_schema', 'msg': 'Field required', 'input': '<dict of 2 items>'}", 'type': 'Bad Request', 'param': 'body.tools.1.input_schema', 'code': 400}}),
    ('/v1/messages', {'model': 'nope', 'max_tokens': 2},
     400, {'error': {'message': "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 2 items>'}", 'type': 'Bad Request', 'param': 'body.messages', 'code': 400}}),
    # recorded 2026-12-05 from vLLM 0.32 (CPU build, same tiny model): a Responses request in the
    # background with store left at true is refused (nothing is stored), as are both previous fields
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'background': True},
     400, {'error': {'message': 'This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.', 'type': 'invalid_request_error', 'param': 'background', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'background': True, 'store': False},
     400, {'error': {'message': 'background can only be used when `store` is true (parameter=background)', 'type': 'BadRequestError', 'param': 'background', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'previous_response_id': 'resp_x', 'previous_input_messages': [{'role': 'user', 'content': 'a'}]},
     400, {'error': {'message': 'Only one of `previous_input_messages` and `previous_response_id` can be set.', 'type': 'invalid_request_error', 'param': 'previous_response_id', 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'previous_response_id': 'abc'},
     404, {'error': {'message': "Response with id 'abc' not found.", 'type': 'invalid_request_error', 'param': 'response_id', 'code': 404}}),
    ('/v1/responses', {'model': 'nope', 'input': 'hi', 'background': True},
     404, {'error': {'message': 'The model `nope` does not exist. Valid aliases: tiny.', 'type': 'NotFoundError', 'param': 'model', 'code': 404}}),
    # a lone surrogate (sent as its \u escape) that the answer echoes: vLLM builds the answer, cannot
    # encode it, and its handler makes the UnicodeEncodeError a 400 (OpenAI's shape on every route)
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 4, 'seed': 1, 'metadata': {'k': '\ud83d'}},
     400, {'error': {'message': "'utf-8' codec can't encode character '\\ud83d' in position 143: surrogates not allowed", 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/responses', {'model': 'tiny', 'input': 'hi', 'max_output_tokens': 4, 'seed': 1, 'user': '\ud800'},
     400, {'error': {'message': "'utf-8' codec can't encode character '\\ud800' in position 1021: surrogates not allowed", 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny\ud800', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4, 'seed': 1},
     400, {'error': {'message': "'utf-8' codec can't encode character '\\ud800' in position 36: surrogates not allowed", 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/messages', {'model': 'tiny\ud800', 'max_tokens': 4, 'messages': [{'role': 'user', 'content': 'hi'}]},
     400, {'error': {'message': "'utf-8' codec can't encode character '\\ud800' in position 74: surrogates not allowed", 'type': 'BadRequestError', 'param': None, 'code': 400}}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4, 'seed': 1, 'user': '\ud800'},
     200, None),  # chat does not echo `user`
]


@pytest.mark.parametrize("path, body, status, expected", VLLM_ANSWERS,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(VLLM_ANSWERS)])
def test_bad_requests_get_vllms_exact_answer(polar_base_url, path, body, status, expected):
    r = post(polar_base_url, path, body)
    assert r.status_code == status, r.text
    if expected is not None and "position 1021" in str(expected):  # after the sampled text: its length
        assert re.sub(r"position \d+", "position N", r.text) == re.sub(r"position \d+", "position N", json.dumps(
            expected, separators=(",", ":")))
    elif expected is not None:
        assert r.json() == expected


def test_messages_api_ignores_logit_bias_as_vllm(polar_base_url):
    """vLLM's Messages request has no ``logit_bias`` field: a bad one is not looked at (200)."""
    r = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": USER,
                                              "logit_bias": {"x": 1}})
    assert r.status_code == 200, r.text


def test_prompt_beyond_the_context_is_vllms_token_check(polar_base_url):
    """vLLM tokenises at most max_model_len + 1 tokens, so it says "at least 4097"."""
    r = post(polar_base_url, "/v1/chat/completions",
             {**CHAT, "messages": [{"role": "user", "content": "hello " * 5000}]})
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": "This model's maximum context length is 4096 tokens. However, your prompt "
                   "contains at least 4097 input tokens, which exceeds this limit even without any "
                   "output tokens. Please reduce the length of the input prompt. "
                   "(parameter=input_tokens, value=4097)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}}


def test_a_null_max_tokens_on_the_messages_api_is_pydantics_int_type(polar_base_url):
    """`"max_tokens": null` reached a comparison with None: Python's TypeError text came back."""
    r = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": None, "messages": USER})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "Bad Request" and error["param"] == "body.max_tokens"
    assert error["message"] == ("1 validation error:\n  {'type': 'int_type', 'loc': 'body.max_tokens', "
                                "'msg': 'Input should be a valid integer', 'input': 'None'}")  # vLLM: str(input)


def test_the_access_log_names_each_request_without_its_query_string(tiny_model_dir, tmp_path):
    """With --log-level info, a request line per call as vLLM logs them (a user counts what the
    server answered beside the capture); a client's ``?key=`` never reaches the log."""
    from tests.support.procs import polar_server

    with polar_server(tiny_model_dir, tmp_path, extra=["--log-level", "info"]) as base:
        assert httpx.get(base + "/v1/models?key=sk-secret-in-query-9", timeout=30).status_code == 200
        assert post(base, "/v1/chat/completions?api-key=sk-other-secret-7", CHAT).status_code == 200
        assert post(base, "/v1/chat/completions", {**CHAT, "max_tokens": 0}).status_code == 400
    log = next(tmp_path.glob("polar-serve-*.log")).read_text()
    assert '"GET /v1/models?… HTTP/1.1" 200' in log, log[-2000:]
    assert '"POST /v1/chat/completions?… HTTP/1.1" 200' in log and '"POST /v1/chat/completions HTTP/1.1" 400' in log
    assert "sk-secret-in-query-9" not in log and "sk-other-secret-7" not in log


def test_the_log_filter_cuts_the_query_of_websocket_handshake_lines_too():
    """uvicorn logs a WebSocket handshake through its error logger with the path and query (where
    ``websockets`` is installed): the key of a ``?key=`` there was not cut."""
    import logging

    from polar_train.server.access_log import DropQuery, log_config

    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
                               (("127.0.0.1", 5), "/v1/responses?key=sk-ws-secret"), None)
    assert DropQuery().filter(record) and record.getMessage() == "('127.0.0.1', 5) - \"WebSocket /v1/responses?…\" [accepted]"
    config = log_config()
    assert all("drop_query" in h["filters"] for h in config["handlers"].values())



class _FailingEngine(_EndlessEngine):
    """Gives two tokens, then fails as an engine bug or an out-of-memory would."""

    def generate(self, prompt_ids, params, cancelled):
        yield self._step(11, -1.0)
        yield self._step(12, -1.0)
        raise RuntimeError("the engine broke")


def test_an_error_once_a_stream_began_is_said_to_the_client_and_logged(tiny_tokenizer, caplog):
    """A probe (GPT-2 before serve supported it): a streamed answer that failed after its first
    chunk was cut without an error event or [DONE], and nothing was logged. Now as vLLM: chat's
    data: {"error": ...} then [DONE]; Messages' error event."""
    import logging

    caplog.set_level(logging.ERROR, logger="polar_train.server")
    with _served_in_process(_FailingEngine(tiny_tokenizer)) as port:
        base = f"http://127.0.0.1:{port}"
        chat = httpx.post(base + "/v1/chat/completions", json={**CHAT, "max_tokens": 10, "stream": True}, timeout=60)
        events = [line for line in chat.text.split("\n\n") if line]
        assert json.loads(events[-2].removeprefix("data: ")) == {"error": {
            "message": "the engine broke", "type": "InternalServerError", "param": None, "code": 500}}
        assert events[-1] == "data: [DONE]"
        msg = httpx.post(base + "/v1/messages", json={"model": "tiny", "max_tokens": 10, "stream": True,
                                                      "messages": USER}, timeout=60)
        last = [e for e in msg.text.split("\n\n") if e][-1]
        assert last == ('event: error\ndata: {"type":"error","error":{"type":"internal_error",'
                        '"message":"the engine broke"}}'), msg.text[-500:]
    assert caplog.text.count("error in a streamed answer") == 2 and "RuntimeError: the engine broke" in caplog.text


def _prompt_ids(base: str, messages: list) -> list[int]:
    r = post(base, "/v1/chat/completions", {**CHAT, "max_tokens": 1, "return_token_ids": True, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


def test_chat_content_parts_are_refused_and_rendered_as_vllm_does(polar_base_url):
    """A part of an unknown type (`file`, `weird`) or of none was dropped from the prompt and
    answered 200, a `refusal` or `thinking` part's text was dropped too (a probe; vLLM 0.32's
    answers, taken from it: its chat parser refuses the first, renders the second as text)."""
    for part, kind in (({"type": "file", "file": {"file_data": "abc"}}, "file"), ({"type": "weird", "text": "x"}, "weird")):
        r = post(polar_base_url, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        assert r.json()["error"]["message"] == (
            f"Unsupported chat content part type: '{kind}'. Supported types: audio_embeds, audio_url, image_embeds, "
            "image_pil, image_url, input_audio, input_image, input_text, output_text, prompt_embeds, refusal, text, "
            f"thinking, tool_reference, video_embeds, video_url. (parameter=type, value={kind})")
    untyped = post(polar_base_url, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"text": "x"}]}]})
    assert untyped.json()["error"]["message"] == "Missing 'type' field in multimodal part. (parameter=type)"
    for part in ({"type": "input_text", "text": "A"}, {"type": 5, "text": "A"}, {"image_url": {"url": "http://x"}}):
        r = post(polar_base_url, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400 and "is no chat completions content part" in r.json()["error"]["message"]
    embeds = post(polar_base_url, "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_embeds", "image_embeds": "abc"}]}]})
    assert embeds.json()["error"]["message"] == "The model is not multimodal."
    # (vLLM's: [248045, 846, 198, 9419, ...] is "<|im_start|>user\nHello"; "R" is 49, "no" 2083 in its vocabulary)
    assert _prompt_ids(polar_base_url, [{"role": "system", "content": [{"type": "refusal", "refusal": "R"}]}, *USER])[:5] \
        == [248045, 8678, 198, 49, 248046]
    said = _prompt_ids(polar_base_url, [{"role": "user", "content": [{"type": "refusal", "refusal": "no"},
                                                                      {"type": "text", "text": "Hello"}]}])
    assert said[:5] == [248045, 846, 198, 2083, 9419]
    thought = _prompt_ids(polar_base_url, [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]},
                                           {"role": "user", "content": [{"type": "thinking"}, {"type": "text", "text": "Hello"}]}])
    assert thought[6:11] == [248045, 74455, 198, 87, 248046]  # the assistant turn holds "x"
    assert _prompt_ids(polar_base_url, [{"role": "user", "content": [{"type": "text"}, {"type": "text", "text": "Hello"}]}]) \
        == [248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198]


def test_responses_and_messages_refuse_the_parts_vllm_refuses(polar_base_url):
    """Responses `input_file` (vLLM's chat parser has none) and a part of another API, Messages
    `document`/`search_result` blocks and block fields of the wrong type: dropped and answered 200
    (a probe). vLLM 0.32's messages, taken from it."""
    def responses(part: dict) -> httpx.Response:
        return post(polar_base_url, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [
            {"type": "message", "role": "user", "content": [part, {"type": "input_text", "text": "Hi"}]}]})

    r = responses({"type": "input_file", "file_data": "abc", "filename": "a.txt"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "Unsupported chat content part type: 'input_file'. Supported types: audio_embeds, ")
    for kind in ("text", "weird", "output_text"):
        r = responses({"type": kind, "text": "x"})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            f"input[0].content[0]: a part of type '{kind}' is no part of a 'user' message (one of input_text, "
            "input_image, input_file)")
    def tool_output(part: dict) -> httpx.Response:
        return post(polar_base_url, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [
            {"type": "message", "role": "user", "content": "look"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}, part]}]})

    assert tool_output({"type": "input_file", "file_data": "abc"}).json()["error"]["message"].startswith(
        "Unsupported chat content part type: 'input_file'.")  # (the review of the first fix)
    assert tool_output({"type": "weird", "text": "x"}).json()["error"]["message"] == (
        "input[2].output[1]: a part of type 'weird' is no part of a tool's output (one of input_text, input_image, "
        "input_file)")
    assert tool_output({"type": "input_text", "text": "y"}).status_code == 200
    assistant = post(polar_base_url, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]},
        {"type": "message", "role": "user", "content": "again"}]})
    assert assistant.status_code == 200, assistant.text

    expected = ("'text', 'image', 'tool_use', 'tool_result', 'tool_reference', 'thinking', 'redacted_thinking', "
                "'tool_addition' or 'tool_removal'")
    doc = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "d"}}, {"type": "text", "text": "Hello"}]}]})
    assert doc.status_code == 400 and doc.json()["error"]["message"] == (
        "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.messages.0.content', 'msg': 'Input should be a "
        "valid string', 'input': '<list of 2 items>'}\n  {'type': 'literal_error', 'loc': 'body.messages.0.content.0.type', "
        f"'msg': \"Input should be {expected}\", 'input': 'document', 'ctx': {{'expected': \"{expected}\"}}}}")
    bad_input = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                                              "input": "s"}]}]})
    assert bad_input.json()["error"]["message"].endswith(
        "{'type': 'dict_type', 'loc': 'body.messages.1.content.0.input', 'msg': 'Input should be a valid dictionary', "
        "'input': 's'}")
    change = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_addition", "name": "x"}]}]})
    assert "'msg': 'Value error, tool is required for tool_addition blocks'" in change.json()["error"]["message"]


IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
_READ = [{"name": "Read", "input_schema": {"type": "object"}}]
_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}]}


@pytest.mark.parametrize("name, messages, input_tokens", [
    # an assistant turn vLLM keeps though nothing of it is rendered: it was left out (a probe)
    ("only redacted thinking", [*USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "E=="}]},
                                {"role": "user", "content": "b"}], 139),
    ("no blocks", [*USER, {"role": "assistant", "content": []}, {"role": "user", "content": "b"}], 139),
    ("an empty text", [*USER, {"role": "assistant", "content": [{"type": "text", "text": ""}]},
                       {"role": "user", "content": "b"}], 139),
    ("a tool_result without content", [*USER, _USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": True}]}], 156),
    # a tool_result's tool_reference blocks: a second tool message
    ("a tool_reference", [*USER, _USE, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "x"}, {"type": "tool_reference", "tool_name": "Read"}]}]}], 162),
])
def test_messages_are_converted_as_vllm_converts_them(polar_base_url, name, messages, input_tokens):
    """vLLM 0.32's `usage.input_tokens` for the same requests on the same tokenizer (taken from it;
    the capture's rendered ids come from the same conversion)."""
    r = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": messages, "tools": _READ})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == input_tokens, name


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "tiny", "max_tokens": 1, "tools": _READ, "messages": [
        *USER, _USE, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE_BLOCK]}]}]}),
    ("/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [
        {"type": "message", "role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBOR"}]}]}),
])
def test_an_image_inside_a_tool_result_is_refused_as_vllm_refuses_it(polar_base_url, path, body):
    """Claude Code's Read of a PNG, Codex's view_image: the image was dropped and the call answered
    200, a trajectory in which the agent saw an image the model never saw (a probe; vLLM's 400)."""
    r = post(polar_base_url, path, body)
    assert r.status_code == 400 and r.json()["error"]["message"] == "tiny is not a multimodal model"


def test_chat_tool_messages_and_system_lines_are_rendered_as_vllm_renders_them(polar_base_url):
    """A tool message of text parts is one string, its parts joined by newlines; a system message's
    Claude Code attribution line is dropped, as vLLM's chat parser does (prompt ids taken from it)."""
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    parts = _prompt_ids(polar_base_url, [*USER, call, {"role": "tool", "tool_call_id": "c1", "content": [
        {"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}])
    joined = _prompt_ids(polar_base_url, [*USER, call, {"role": "tool", "tool_call_id": "c1", "content": "x\ny"}])
    assert parts == joined
    header = "x-anthropic-billing-header: cc_version=2.1; cch=abc;"
    for content in (header + "\nYou are X", [{"type": "text", "text": header}, {"type": "text", "text": "You are X"}]):
        assert _prompt_ids(polar_base_url, [{"role": "system", "content": content}, *USER]) == \
            _prompt_ids(polar_base_url, [{"role": "system", "content": "You are X"}, *USER])


def test_a_prompt_of_exactly_the_context_is_refused_as_vllm_refuses_it(polar_base_url):
    """No room left for one token: vLLM's budget check ("max_tokens must be at least 1, got 0") on
    chat and Messages, its Responses serving's own line; serve said the prompt "exceeds this limit"
    (a probe). vLLM 0.32's answers, taken from it."""
    def content(n: int) -> str:
        return "x" + " hello" * n  # (" hello" is one token)

    base = post(polar_base_url, "/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": content(0)}]})
    n = 4096 - base.json()["count"]
    whole = [{"role": "user", "content": content(n)}]
    assert post(polar_base_url, "/tokenize", {"model": "tiny", "messages": whole}).json()["count"] == 4096
    for stream in (False, True):
        r = post(polar_base_url, "/v1/chat/completions", {"model": "tiny", "messages": whole, "stream": stream})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "type": "BadRequestError", "param": "max_tokens", "code": 400}
    r = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": whole})
    assert r.json() == {"type": "error", "error": {
        "type": "BadRequestError", "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"}}
    r = post(polar_base_url, "/v1/responses", {"model": "tiny", "input": content(n)})
    assert r.json() == {"error": {"message": "The engine prompt length 4096 exceeds the max_model_len 4096. Please "
                                             "reduce prompt.", "type": "invalid_request_error", "param": "input",
                                  "code": 400}}
    short = post(polar_base_url, "/v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": content(n - 1)}]})
    assert short.status_code == 200


def test_request_ids_empty_model_names_and_tool_schemas_as_vllm_takes_them(polar_base_url):
    """vLLM names a chat (and Messages) answer after the X-Request-Id header, else the body's
    request_id, a Responses answer after the body's request_id; takes `"model": ""` as its model
    (the Messages request refuses it); refuses a tool's `parameters` that is no object. serve gave
    random ids, a 404 and a 200 with the schema rendered as text (a probe; vLLM's answers)."""
    chat = {"model": "tiny", "max_tokens": 1, "messages": USER}
    assert httpx.post(f"{polar_base_url}/v1/chat/completions", json={**chat, "request_id": "zz"},
                      headers={"X-Request-Id": "abc"}).json()["id"] == "chatcmpl-abc"
    assert post(polar_base_url, "/v1/chat/completions", {**chat, "request_id": "zz"}).json()["id"] == "chatcmpl-zz"
    streamed = httpx.post(f"{polar_base_url}/v1/chat/completions", json={**chat, "stream": True},
                          headers={"X-Request-Id": "abc"}).text
    assert all(json.loads(line[6:])["id"] == "chatcmpl-abc" for line in streamed.splitlines()
               if line.startswith("data: {"))
    assert httpx.post(f"{polar_base_url}/v1/messages", json={**chat},
                      headers={"X-Request-Id": "abc"}).json()["id"] == "chatcmpl-abc"
    assert post(polar_base_url, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": "a",
                                                  "request_id": "resp_zz"}).json()["id"] == "resp_zz"
    assert post(polar_base_url, "/v1/chat/completions", {**chat, "model": ""}).status_code == 200
    assert post(polar_base_url, "/v1/responses", {"model": "", "max_output_tokens": 1, "input": "a"}).status_code == 200
    empty = post(polar_base_url, "/v1/messages", {**chat, "model": ""})
    assert empty.json()["error"]["message"] == (
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body.model', 'msg': 'Value error, Model is required', "
        "'input': '', 'ctx': {'error': ValueError('Model is required')}}")
    schema = post(polar_base_url, "/v1/chat/completions", {**chat, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "nope"}}]})
    assert schema.status_code == 400 and schema.json()["error"]["message"] == (
        "1 validation error:\n  {'type': 'dict_type', 'loc': 'body.tools.0.function.parameters', 'msg': 'Input should "
        "be a valid dictionary', 'input': 'nope'}")


def test_error_messages_leave_out_file_paths_as_vllm_does(polar_base_url):
    """vLLM sanitizes every error message (file paths to `<path>`, memory addresses and traceback
    lines out): a model named by its path came back whole (a probe; vLLM's answer)."""
    r = post(polar_base_url, "/v1/chat/completions", {**CHAT, "model": "/home/me/secret/model"})
    assert r.status_code == 404 and r.json()["error"]["message"] == \
        "The model `<path>` does not exist. Valid aliases: tiny."
    r = post(polar_base_url, "/v1/messages", {"model": "/tmp/x/model", "max_tokens": 1, "messages": USER})
    assert r.json()["error"]["message"] == "The model `<path>` does not exist. Valid aliases: tiny."


def test_more_of_vllms_refusals_in_its_words(polar_base_url):
    """vLLM 0.32's answers, taken from it (a probe found serve took these or worded them otherwise):
    both continue_final_message and add_generation_prompt (chat's words; /tokenize's are longer),
    per-request mm_processor_kwargs, a Messages `thinking` that is none of its tagged types."""
    both = {**CHAT, "continue_final_message": True, "add_generation_prompt": True}
    assert post(polar_base_url, "/v1/chat/completions", both).json()["error"] == {
        "message": "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        "type": "BadRequestError", "param": None, "code": 400}
    # (add_generation_prompt by default: the longer words, recorded in tests/data/vllm_wire/sampling.json)
    tok = post(polar_base_url, "/tokenize", {"model": "tiny", "messages": USER, "continue_final_message": True})
    assert tok.status_code == 400 and tok.json()["error"]["message"].startswith(
        "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when")
    mm = post(polar_base_url, "/v1/chat/completions", {**CHAT, "mm_processor_kwargs": {"a": 1}})
    assert mm.json()["error"]["param"] == "mm_processor_kwargs" and mm.json()["error"]["message"].startswith(
        "Per-request mm_processor_kwargs are disabled by default")
    assert post(polar_base_url, "/v1/chat/completions", {**CHAT, "mm_processor_kwargs": {}}).status_code == 200
    def thinking(value) -> str:
        r = post(polar_base_url, "/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": USER, "thinking": value})
        assert r.status_code == 400
        return r.json()["error"]["message"]

    assert thinking({"type": "bogus"}) == (
        "1 validation error:\n  {'type': 'union_tag_invalid', 'loc': 'body.thinking', 'msg': \"Input tag 'bogus' found "
        "using 'type' does not match any of the expected tags: 'enabled', 'disabled', 'adaptive'\", 'input': '<dict of 1 "
        "items>', 'ctx': {'discriminator': \"'type'\", 'tag': 'bogus', 'expected_tags': \"'enabled', 'disabled', "
        "'adaptive'\"}}")
    assert "'type': 'union_tag_not_found', 'loc': 'body.thinking'" in thinking({})
    assert "'type': 'model_attributes_type', 'loc': 'body.thinking'" in thinking("x")


def test_responses_echo_the_request_as_vllm_does(polar_base_url):
    """vLLM echoes `reasoning`/`text` with all their fields, `truncation` and `service_tier` as given,
    `top_logprobs` only with the logprobs included; refuses other values of the two literals; an
    unsupported input item is its own check (a probe; vLLM 0.32's answers)."""
    base = {"model": "tiny", "max_output_tokens": 1, "input": "a"}
    r = post(polar_base_url, "/v1/responses", {**base, "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}},
                                               "top_logprobs": 2, "truncation": "auto", "service_tier": "flex"}).json()
    assert r["reasoning"] == {"context": None, "effort": "low", "generate_summary": None, "mode": None, "summary": None}
    assert r["text"] == {"format": {"type": "text"}, "verbosity": None}
    assert (r["top_logprobs"], r["truncation"], r["service_tier"]) == (None, "auto", "flex")
    with_logprobs = post(polar_base_url, "/v1/responses", {**base, "top_logprobs": 2,
                                                           "include": ["message.output_text.logprobs"]}).json()
    assert (with_logprobs["top_logprobs"], with_logprobs["truncation"], with_logprobs["service_tier"]) == \
        (2, "disabled", "auto")
    bogus = post(polar_base_url, "/v1/responses", {**base, "truncation": "bogus"}).json()["error"]
    assert bogus["param"] == "body.truncation" and "Input should be 'auto' or 'disabled'" in bogus["message"]
    item = post(polar_base_url, "/v1/responses", {**base, "input": [{"type": "item_reference", "id": "x"}]}).json()
    assert item["error"] == {"message": "Unsupported input item type: item_reference (parameter=input)",
                             "type": "BadRequestError", "param": "input", "code": 400}
