"""Unit tests of the capture package (pure parts) and of the addon's hooks with mitmproxy's
``tflow``/``taddons``: SSE splitting, field stripping against recorded vLLM 0.32 wire data,
identity, redaction, the Parquet part writer, row building for bad input.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import json
import logging
import os
import re
import stat
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from polar_train.capture import anthropic_messages, fields, openai_chat, openai_responses, record
from polar_train.capture.identity import HeaderView, Identity, resolve_identity, rollout_from_proxy_auth
from polar_train.capture.json_members import compact
from polar_train.capture.options import parse_port_rollouts
from polar_train.capture.redact import (REDACTED, SECRET_KEY_SUFFIXES, SECRET_KEYS, has_secret_key, header_secrets,
                                        redact_json, redacted_dumps, scrub, value_secrets)
from polar_train.capture.sse import SSESplitter, event_json, split_all
from polar_train.capture.tap import StreamTap
from polar_train.capture.writer import PartWriter
from polar_train.schema import CALL_LOG_SCHEMA
from tests.support.capture_wire import WIRE

REPO = Path(__file__).resolve().parents[1]
MASK = {"id", "created", "created_at", "item_id"}


@pytest.fixture(autouse=True)
def _identity_refusals_said_afresh(monkeypatch):
    """A refused id is said once a process: each test that looks for the line starts without the
    lines earlier tests spent (and within the 100-line budget)."""
    from polar_train.capture import identity

    monkeypatch.setattr(identity, "_refused_said", set())


def _mask(v):
    if isinstance(v, dict):
        return {k: ("*" if k in MASK else _mask(x)) for k, x in v.items()}
    if isinstance(v, list):
        return [_mask(x) for x in v]
    return v


def _sse_objs(text: str) -> list:
    events, rest = split_all(text.encode())
    assert rest == b""
    return [event_json(e) for e in events]


# -- SSE ------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2000), max_size=12), st.sampled_from(["\n", "\r\n"]))
def test_sse_splitter_any_chunking_gives_same_events(cuts, nl):
    data = WIRE["resp_inj_sse"].replace("\n", nl).encode()
    whole, rest = split_all(data)
    s = SSESplitter()
    got = []
    points = sorted({min(c, len(data)) for c in cuts})
    prev = 0
    for p in [*points, len(data)]:
        got += s.feed(data[prev:p])
        prev = p
    assert got == whole and s.pending == rest
    assert b"".join(got) + rest == data


def test_sse_splitter_keeps_partial_event_pending():
    s = SSESplitter()
    assert s.feed(b"data: {\"a\": 1}\n\ndata: {\"b\"") == [b"data: {\"a\": 1}\n\n"]
    assert s.pending == b"data: {\"b\""
    assert s.feed(b": 2}\n\n") == [b"data: {\"b\": 2}\n\n"]


# -- stripping: injected vLLM output must equal the plain output -----------------------------
def test_chat_body_strip_equals_plain():
    inj = json.loads(WIRE["chat_inj"])
    parsed = openai_chat.parse_body(json.loads(WIRE["chat_inj"]))
    assert parsed.prompt_ids and len(parsed.completion_ids) == len(parsed.completion_logprobs) == 2
    asked = openai_chat.inject({"messages": []}).asked
    assert openai_chat.strip(inj, asked)
    assert _mask(inj) == _mask(json.loads(WIRE["chat_plain"]))


def test_chat_stream_strip_equals_plain_event_by_event():
    asked = openai_chat.inject({"messages": [], "stream": True}).asked
    inj = _sse_objs(WIRE["chat_inj_sse"])
    plain = _sse_objs(WIRE["chat_plain_sse"])
    assert len(inj) == len(plain)
    for (ev_i, obj_i), (ev_p, obj_p) in zip(inj, plain):
        if obj_i is not None:
            openai_chat.strip(obj_i, asked)
        assert _mask(obj_i) == _mask(obj_p) and ev_i.data is not None
    events = [(e.event, o) for e, o in _sse_objs(WIRE["chat_inj_sse"]) if o is not None]
    parsed = openai_chat.parse_stream(events, done=True)
    assert parsed.prompt_ids == json.loads(WIRE["chat_inj"])["prompt_token_ids"]
    assert parsed.completion_ids == json.loads(WIRE["chat_inj"])["choices"][0]["token_ids"]


def test_a_streamed_chat_calls_usage_is_recorded_whole_as_the_client_saw_it():
    """The reassembled response_json kept prompt_tokens and completion_tokens only; the client's
    usage chunk also said total_tokens and the details (an SDK probe)."""
    usage = {"prompt_tokens": 9, "total_tokens": 19, "completion_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 0}}
    chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]},
              {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": [],
               "usage": usage}]
    parsed = openai_chat.parse_stream([(None, c) for c in chunks], done=True)
    assert parsed.response["usage"] == usage
    assert (parsed.usage_prompt_tokens, parsed.usage_completion_tokens) == (9, 10)
    assert openai_chat.parse_stream([(None, chunks[0])], done=True).response["usage"] is None  # none asked


def test_chat_strip_keeps_what_the_client_asked_for():
    asked = openai_chat.inject({"messages": [], "return_token_ids": True, "logprobs": True}).asked
    inj = json.loads(WIRE["chat_inj"])
    assert not openai_chat.strip(inj, asked)
    assert not openai_chat.inject({"messages": [], "return_token_ids": True, "logprobs": True}).changed


def test_responses_body_strip_equals_plain():
    asked = openai_responses.inject({"input": "Hi"}).asked
    inj = json.loads(WIRE["resp_inj"])
    parsed = openai_responses.parse_body(json.loads(WIRE["resp_inj"]))
    assert parsed.prompt_ids == inj["input_messages"][0]["tokens"]
    assert parsed.completion_ids == inj["output_messages"][0]["tokens"]
    assert len(parsed.completion_logprobs) == len(parsed.completion_ids)
    assert openai_responses.strip(inj, asked)
    assert _mask(inj) == _mask(json.loads(WIRE["resp_plain"]))


def test_responses_stream_strip_equals_plain_event_by_event():
    asked = openai_responses.inject({"input": "Hi", "stream": True}).asked
    inj = _sse_objs(WIRE["resp_inj_sse"])
    plain = _sse_objs(WIRE["resp_plain_sse"])
    assert [e.event for e, _ in inj] == [e.event for e, _ in plain]
    for (_, obj_i), (_, obj_p) in zip(inj, plain):
        openai_responses.strip(obj_i, asked)
        assert _mask(obj_i) == _mask(obj_p)
    events = [(e.event, o) for e, o in _sse_objs(WIRE["resp_inj_sse"])]
    parsed = openai_responses.parse_stream(events, done=True)
    assert parsed.complete and parsed.prompt_ids and parsed.completion_ids
    assert parsed.usage_prompt_tokens == len(parsed.prompt_ids)


def test_responses_inject_is_idempotent_and_keeps_client_include():
    body = {"input": "x", "include": ["reasoning.encrypted_content"]}
    inj = openai_responses.inject(body)
    assert inj.body["include"] == ["reasoning.encrypted_content", "message.output_text.logprobs"]
    assert inj.body["enable_response_messages"] is True and inj.body["top_logprobs"] == 0
    assert body == {"input": "x", "include": ["reasoning.encrypted_content"]}  # the original is untouched
    assert not openai_responses.inject(inj.body).changed


def test_stream_tap_rewrites_only_events_with_injected_fields():
    state = record.CallState("openai.chat", "POST", "h", "/v1/chat/completions", "c", None,  # type: ignore[arg-type]
                             record.utcnow(), "http://h")
    asked = openai_chat.inject({"messages": []}).asked
    seen = []
    tap = StreamTap(state, lambda o: openai_chat.strip(o, asked), None, False, lambda: seen.append(1))
    data = WIRE["chat_inj_sse"].encode()
    out = b""
    for i in range(0, len(data), 37):
        chunks = tap(data[i:i + 37])
        out += b"".join(chunks if isinstance(chunks, list) else [chunks])
    out += b"".join(tap(b""))
    assert seen == [1]
    got = [_mask(o) for _, o in _sse_objs(out.decode())]
    want = [_mask(o) for _, o in _sse_objs(WIRE["chat_plain_sse"])]
    assert got == want
    assert out.endswith(b"data: [DONE]\n\n")
    assert state.stream_raw == data  # recorded as received (with the injected fields)


def test_stream_tap_passthrough_is_byte_exact():
    state = record.CallState("openai.chat", "POST", "h", "/p", "c", None, record.utcnow(), "")  # type: ignore[arg-type]
    tap = StreamTap(state, None, None, False, lambda: None)
    data = WIRE["chat_inj_sse"].encode() + b"data: {trunc"
    out = b"".join(tap(data[i:i + 50]) for i in range(0, len(data), 50))
    assert out == data and tap(b"") == [] and state.stream_raw == data


@pytest.mark.parametrize("tail", [b"", b"\n"])
def test_an_unterminated_last_event_is_stripped_too_and_stays_unterminated(tail):
    """A server that ends its body without the last blank line: the injected ids reached the
    client in that event (some SSE clients dispatch it), and a terminator must not be invented."""
    state = record.CallState("openai.chat", "POST", "h", "/v1/chat/completions", "c", None,  # type: ignore[arg-type]
                             record.utcnow(), "http://h")
    asked = openai_chat.inject({"messages": []}).asked
    events = WIRE["chat_inj_sse"].encode().split(b"\n\n")
    last = events[-3]  # the last JSON event (then [DONE] and the end)
    assert b'"token_ids":[7348]' in last
    tap = StreamTap(state, lambda o: openai_chat.strip(o, asked), None, False, lambda: None)
    head = tap(b"\n\n".join(events[:-3]) + b"\n\n")
    end = tap(last + tail)
    assert end == []  # held until the body ends: it may still be completed
    out = tap(b"")
    assert len(out) == 1 and out[0].endswith(b"}" + tail)
    plain_last = WIRE["chat_plain_sse"].encode().split(b"\n\n")[-3]
    assert _mask(json.loads(out[0][6:])) == _mask(json.loads(plain_last[6:]))
    assert b"7348" not in b"".join(head if isinstance(head, list) else [head]) + out[0]
    cut = StreamTap(state, lambda o: openai_chat.strip(o, asked), None, False, lambda: None)
    cut(last[:-40])
    assert cut(b"") == [last[:-40]]  # cut short: no client can parse it; handed on as it came


@pytest.mark.parametrize("size", [37, 10_000])  # events split across reads / several events per read
def test_a_failing_strip_hands_on_every_remaining_byte_unchanged(size):
    """A bug in stripping must cost the call its row status, never a byte of the client's stream."""
    state = record.CallState("openai.chat", "POST", "h", "/p", "c", None, record.utcnow(), "")  # type: ignore[arg-type]
    calls = []

    def strip(obj):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("strip bug")
        return openai_chat.strip(obj, {})

    tap = StreamTap(state, strip, None, False, lambda: None)
    data = WIRE["chat_inj_sse"].encode()
    out = []
    for i in range(0, len(data), size):
        got = tap(data[i:i + size])
        out.extend(got if isinstance(got, list) else [got])
    out.extend(tap(b""))
    events = [_mask(o) for _, o in _sse_objs(b"".join(out).decode())]
    assert len(events) == len(split_all(data)[0])  # every event arrived
    assert state.status == "proxy_error" and "strip bug" in state.error
    assert b"".join(out).endswith(data[-200:])  # after the failure: the upstream's bytes, unchanged


# -- identity, redaction, options ------------------------------------------------------------
def _basic(user: str, pw: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()


def _view(headers: dict[str, str]) -> HeaderView:
    return HeaderView([(k.encode(), v.encode()) for k, v in headers.items()])


def test_identity_precedence():
    h = _view({"proxy-authorization": _basic("r1", "pw"), "x-polar-rollout": "r2",
               "authorization": "Bearer polar-r3", "x-polar-task": "t9"})
    ident = resolve_identity(h, _basic("tunnel-1", "s"), 8081, "x-polar-rollout", "x-polar-task", {8081: "r4"})
    assert (ident.rollout_id, ident.source, ident.task_id) == ("r1", "proxy_auth", "t9")
    h = _view({"x-polar-rollout": "r2", "authorization": "Bearer polar-r3"})
    assert resolve_identity(h, None, None, "x-polar-rollout", "x-polar-task", {}).source == "header"
    # the request's own header before its tunnel's CONNECT credentials (a client reusing a tunnel
    # for another rollout: every call went to the first CONNECT's rollout)
    assert resolve_identity(h, _basic("tunnel-1", "s"), None, "x-polar-rollout", "", {}).rollout_id == "r2"
    assert resolve_identity(_view({"authorization": "Bearer polar-r3"}), _basic("tunnel-1", "s"), None,
                            "x-polar-rollout", "", {}).rollout_id == "tunnel-1"
    h = _view({"x-api-key": "polar-r3"})
    assert resolve_identity(h, None, None, "x-polar-rollout", "", {}).rollout_id == "r3"
    assert resolve_identity(_view({}), None, 8081, "x", "", {8081: "r4"}).source == "listen_port"
    assert resolve_identity(_view({}), None, 9999, "x", "", {8081: "r4"}).rollout_id is None
    assert resolve_identity(_view({}), "Basic !!!", None, "x", "", {}).source == "none"


def test_the_harness_session_is_read_from_its_own_header():
    """Codex names its session in ``session-id``, Claude Code in ``x-claude-code-session-id``: kept
    beside the rollout id, whatever carried that; one that could be no id is left out."""
    h = _view({"x-polar-rollout": "r1", "session-id": " 019a-codex "})
    assert resolve_identity(h, None, None, "x-polar-rollout", "", {}) == Identity("r1", "header", None, "019a-codex")
    h = _view({"X-Claude-Code-Session-Id": "c0de"})
    assert resolve_identity(h, _basic("r2", "s"), None, "x", "", {}).client_session_id == "c0de"
    assert resolve_identity(_view({"session-id": "a\x00b"}), None, None, "x", "", {}).client_session_id is None
    assert resolve_identity(_view({}), None, None, "x", "", {}).client_session_id is None


@pytest.mark.parametrize("sent,kept", [
    ("r~1", "r~1"), ("rollout-é", "rollout-é"), ("任务-7", "任务-7"), ("my roll/out", "my roll/out"),
    ("a%2Fb", "a%2Fb"),  # as sent: clients percent-decode the proxy URL's user name themselves
    ("x" * 512, "x" * 512), ("x" * 513, None), ("", None), ("bad\x01id", None),
])
def test_any_printable_rollout_id_is_kept_as_sent(sent, kept, caplog):
    """Ids outside [A-Za-z0-9._:@/+=-]{1,200} were silently null (and pooled: build then dropped
    whole sessions as retries of each other); a percent-encoded user name was decoded twice."""
    caplog.set_level(logging.WARNING, logger="polar_capture")
    for headers, connect in (({}, _basic(sent, "pw")), ({"x-polar-rollout": sent}, None)):
        ident = resolve_identity(_view(headers), connect, None, "x-polar-rollout", "x-polar-task", {})
        assert ident.rollout_id == kept
    task = resolve_identity(_view({"x-polar-task": sent}), None, None, "x-polar-rollout", "x-polar-task", {})
    assert task.task_id == kept
    if kept is None and sent:
        assert "refused" in caplog.text  # said, not silently dropped


def test_a_rollout_header_that_is_not_utf8_gives_none():
    """Decoded with surrogate escapes, it could not be written to Parquet at all."""
    h = HeaderView([(b"x-polar-rollout", b"bad\xffid")])
    assert resolve_identity(h, None, None, "x-polar-rollout", "", {}).rollout_id is None


def test_a_header_sent_twice_gives_its_first_value():
    h = HeaderView([(b"x-polar-rollout", b"dup-a"), (b"x-polar-rollout", b"dup-b")])
    assert resolve_identity(h, None, None, "x-polar-rollout", "", {}).rollout_id == "dup-a"


def test_a_port_rollout_follows_the_id_rule():
    from polar_train.capture.options import parse_port_rollouts

    assert parse_port_rollouts("8081=任务 1") == {8081: "任务 1"}
    with pytest.raises(ValueError, match="rollout id for port 8081 longer than 512 characters"):
        parse_port_rollouts("8081=" + "x" * 600)


def test_resolve_head_collects_secrets_identity_and_host():
    fields = ((b"Host", b"Example.org:8000"), (b"Authorization", b"Bearer polar-r5"),
              (b"X-Polar-Task", b"t1"))
    s = record.CallState("openai.chat", "POST", "10.0.0.1", "/v1/chat/completions", "c", None, record.utcnow(),
                         "http://10.0.0.1:8000", header_fields=fields, connect_auth=_basic("r9", "tunnelpw"))
    record.resolve_head(s, "x-polar-rollout", "x-polar-task", {})
    assert (s.identity.rollout_id, s.identity.source, s.identity.task_id) == ("r9", "proxy_auth", "t1")
    assert {"polar-r5", "tunnelpw", "r9:tunnelpw"} <= s.secrets and s.host == "Example.org"
    assert s.header_fields is None  # resolved once


_NAMES = st.sampled_from([b"Content-Length", b"content-length", b"Transfer-Encoding", b"Content-Encoding",
                          b"content-type", b"Accept-Encoding", b"X-Polar-Rollout", b"Host"])
_FIELDS = st.lists(st.tuples(_NAMES, st.binary(min_size=1, max_size=8).filter(lambda v: b"\r" not in v
                                                                               and b"\n" not in v)),
                   max_size=6).map(tuple)


@settings(max_examples=200, deadline=None)
@given(_FIELDS, st.integers(0, 10**5))
def test_raw_field_helpers_agree_with_mitmproxy(raw_fields, length):
    """The one-pass helpers the hooks use instead of mitmproxy's Headers give its results."""
    from mitmproxy.http import Headers, Request

    headers = Headers(raw_fields)
    assert fields.values(raw_fields, b"content-type", b"transfer-encoding") == [
        None if headers.get(n) is None else headers.get(n).encode("utf-8", "surrogateescape")
        for n in ("content-type", "transfer-encoding")]
    drop = frozenset({b"accept-encoding", b"x-polar-rollout"})
    expected = Headers(raw_fields)
    for name in ("accept-encoding", "x-polar-rollout"):
        expected.pop(name, None)
    assert fields.without(raw_fields, drop) == expected.fields
    if not any(n.lower() == b"content-encoding" for n, _ in raw_fields):
        req = Request.make("POST", "http://h/v1/chat/completions")
        req.headers = Headers(raw_fields)
        req.content = b"x" * length
        assert fields.with_body_length(raw_fields, length) == req.headers.fields


def test_malformed_proxy_credentials_are_ignored():
    assert rollout_from_proxy_auth("Basic !!!") is None
    assert rollout_from_proxy_auth("Bearer abc") is None
    assert rollout_from_proxy_auth("Basic " + base64.b64encode(b"\xff\xfe:x").decode()) is None  # not UTF-8
    assert rollout_from_proxy_auth(_basic(" ", "x")) is None  # nothing but space


def test_proxy_credentials_with_several_colons_name_no_rollout(caplog):
    """A probe: HTTPS_PROXY=http://job%3A7%3Arun-1:x@... reaches the proxy as "job:7:run-1:x", and the
    rollouts job:7:run-1, job:7:run-2 and job:8 were all recorded as "job", silently."""
    with caplog.at_level(logging.WARNING, logger="polar_capture"):
        assert rollout_from_proxy_auth(_basic("job:7:run-1", "x")) is None
    assert "proxy credentials hold more than one ':'" in caplog.text and "x-polar-rollout" in caplog.text
    assert "run-1" not in caplog.text  # (what follows the first ':' may be the password: never logged)
    assert rollout_from_proxy_auth(_basic("job-7", "x")) == "job-7"


def test_redaction():
    body = {"messages": [{"content": "key is sk-abcdef"}], "api_key": "sk-abcdef",
            "nested": {"Authorization": "Bearer sk-abcdef"}, "max_tokens": 3}
    secrets = header_secrets(_view({"authorization": "Bearer sk-abcdef",
                                    "proxy-authorization": _basic("r1", "hunter22")}))
    assert {"sk-abcdef", "hunter22"} <= secrets
    assert value_secrets(_basic("r1", "")) == set()  # a user name alone: its base64 "cjE6" is no secret
    text = scrub(json.dumps(redact_json(body)), secrets)
    assert "sk-abcdef" not in text and json.loads(text)["max_tokens"] == 3
    assert json.loads(text)["api_key"] == REDACTED
    # keys that end in a secret's name, in any case; a schema under such a key is kept as sent
    body = {"metadata": {"openai_api_key": "v1", "ANTHROPIC_API_KEY": "v2", "auth_token": "v3", "token": "v4",
                         "private_key": "v5", "session_token": "v6", "db_password": 7, "max_tokens": 3},
            "tools": [{"parameters": {"properties": {"api_token": {"type": "string"}}}}]}
    redacted = redact_json(body)
    assert set(redacted["metadata"].values()) == {REDACTED, 3} and redacted["metadata"]["max_tokens"] == 3
    assert redacted["tools"] == body["tools"]
    assert redacted_dumps(body, compact) == compact(redacted)


def test_a_secret_inside_a_tool_calls_arguments_string_is_redacted():
    """OpenAI's tool calls carry their arguments as a JSON string (chat and Responses): a
    ``"password"`` there was stored as sent, where Anthropic's ``input`` object had it replaced
    (a probe). A header named as a secret (X-Auth-Token, GitLab's Private-Token) is one too."""
    arguments = json.dumps({"user": "bob", "password": "hunter2-tool"})
    body = {"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
                "name": "login", "arguments": arguments}}]}],
            "input": [{"type": "function_call", "name": "login", "arguments": arguments},
                      {"type": "function_call_output", "output": "[1, 2]"}, {"type": "message", "content": "{not json"}]}
    for text in (compact(body), json.dumps(body), json.dumps(body, indent=1)):
        assert has_secret_key(text.lower().encode(), spaced=True)
    stored = redacted_dumps(body, compact)
    assert "hunter2-tool" not in stored
    back = json.loads(stored)
    assert json.loads(back["messages"][0]["tool_calls"][0]["function"]["arguments"]) == {"user": "bob",
                                                                                          "password": REDACTED}
    assert json.loads(back["input"][0]["arguments"]) == {"user": "bob", "password": REDACTED}
    assert back["input"][1:] == body["input"][1:]  # strings without a secret key: as sent
    plain = {"tool_calls": [{"function": {"arguments": json.dumps({"path": "a.py"})}}]}
    assert redacted_dumps(plain, compact) == compact(plain)
    found = header_secrets(_view({"x-auth-token": "tok-PROBE-1", "private-token": "glpat-PROBE-2",
                                  "x-request-id": "req-123456", "x-session-token": "null"}))
    assert {"tok-PROBE-1", "glpat-PROBE-2"} <= found and not {"req-123456", "null"} & found
    # (a misconfigured header's word is no token: scrubbed from every text, it cost calls their ids)
    # a JSON file a tool writes, inside the arguments: two levels down (the review)
    config = json.dumps({"db_password": "hunter3-deep"})
    deep = {"input": [{"type": "function_call", "name": "write", "arguments": json.dumps({"content": config})}]}
    assert has_secret_key(compact(deep).lower().encode())
    assert "hunter3-deep" not in redacted_dumps(deep, compact)
    # nested deeper than Python parses (RecursionError is no ValueError), a lone surrogate: kept as sent
    nested = {"token": "x", "note": "[" * 5000 + "]" * 5000}
    assert json.loads(redacted_dumps(nested, compact))["note"] == nested["note"]
    cut = {"arguments": '{"password": "pw-1234", "text": "\\ud83d"}'}
    back = json.loads(redacted_dumps(cut, compact))["arguments"]
    assert back.encode("utf-8") and json.loads(back) == {"password": REDACTED, "text": "\ud83d"}


@pytest.mark.parametrize("depth", [1, 2])
def test_a_secret_key_spelled_with_a_unicode_escape_inside_a_json_string_is_redacted(depth):
    """A key written ``"\\u0070assword"`` inside a tool call's arguments string shows no
    ``password`` in any text the scan reads (the outer parse keeps the inner escape): it was stored
    as sent. Only the string's own parse spells the key; a plain ``\\u`` elsewhere costs the walk only."""
    inner = '{"user": "bob", "\\u0070assword": "hunter4-esc", "\\u0054oken": "tok-esc-5678"}'
    arguments = inner if depth == 1 else json.dumps({"content": inner})
    body = {"input": [{"type": "function_call", "name": "login", "arguments": arguments},
                      {"type": "function_call_output", "output": '{"name": "caf\\u00e9"}'}]}
    stored = redacted_dumps(body, compact)
    assert "hunter4-esc" not in stored and "tok-esc-5678" not in stored
    back = json.loads(stored)["input"]
    found = json.loads(back[0]["arguments"]) if depth == 1 else json.loads(json.loads(back[0]["arguments"])["content"])
    assert found == {"user": "bob", "password": REDACTED, "Token": REDACTED}
    assert back[1] == body["input"][1]  # an escape without a secret key: the string as sent
    escaped_only = {"input": [{"type": "function_call_output", "output": '{"path": "\\u00e9t\\u00e9.txt"}'}]}
    assert redacted_dumps(escaped_only, compact) == compact(escaped_only)


@pytest.mark.parametrize("key", ["null", "none", "true", 'tok"en\\abc-999', "clé-secrète-ü"])
def test_a_secret_is_scrubbed_from_the_stored_json_without_breaking_it(key):
    """The secret was replaced in the JSON *text*: a key `null` turned JSON's null into
    [REDACTED] (the stored JSON no longer parsed), `none` rewrote "none" values, and a key with a
    quote or backslash shows escaped in JSON text, where it was never found."""
    from polar_train.capture.identity import Identity

    request = {"model": "m", "tool_choice": "none" if key != "none" else None, "stream": False, "seed": None,
               "messages": [{"role": "user", "content": f"my key is {key}, keep it"}]}
    state = record.CallState("openai.chat", "POST", "h", "/v1/chat/completions", "c", Identity("r", "header"),
                             record.utcnow(), "http://h", header_fields=((b"authorization", f"Bearer {key}".encode()),))
    state.request_body = json.dumps(request).encode()
    state.http_status, state.response_body = 200, json.dumps({"id": "x", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": f"your key {key}"}, "logprobs": None,
        "finish_reason": "stop"}]}).encode()
    record.resolve_head(state, "x-polar-rollout", "x-polar-task", {})
    row = record.build_row(state, None)
    stored_request, stored_response = json.loads(row["request_json"]), json.loads(row["response_json"])
    assert stored_request["messages"][0]["content"] == f"my key is {REDACTED}, keep it"
    assert stored_response["choices"][0]["message"]["content"] == f"your key {REDACTED}"
    assert stored_request["seed"] is None and stored_response["choices"][0]["logprobs"] is None  # JSON's own null
    assert stored_request["stream"] is False
    if len(key) > 4:  # a real key: in no form anywhere in the stored text
        for text in (row["request_json"], row["response_json"]):
            assert key not in text and json.dumps(key)[1:-1] not in text and json.dumps(key, ensure_ascii=False)[1:-1] not in text


def test_a_key_in_the_query_string_is_scrubbed_from_the_row():
    """Google's ``?key=`` and Azure's ``?api-key=`` were stored in the row's ``path`` as sent."""
    from polar_train.capture.identity import Identity

    echoed = {"model": "m", "messages": [{"role": "user", "content": "my key is QSKEY-1234"}]}
    state = record.CallState("openai.chat", "POST", "h", "/v1/chat/completions?key=QSKEY-1234&api-version=2024",
                             "c", Identity("r", "header"), record.utcnow(), "http://h",
                             header_fields=((b"host", b"h"),), request_body=json.dumps(echoed).encode(),
                             http_status=200, response_body=b"{}")
    row = record.build_row(record.resolve_head(state, "x-polar-rollout", "x-polar-task", {}), None)
    assert row["path"] == "/v1/chat/completions?key=[REDACTED]&api-version=2024"
    assert "QSKEY-1234" not in row["request_json"]
    from polar_train.capture.redact import query_secrets

    assert query_secrets("/v1/messages?api-key=a%2Bb%3D%3D&x=1") == {"a%2Bb%3D%3D", "a+b=="}
    assert query_secrets("/v1/messages?max_tokens=1234&model=abcd") == set()


def _case_variants(key: str) -> st.SearchStrategy[str]:
    """``key`` with any letters upper-cased, and K/k possibly as the Kelvin sign (lower(): k)."""
    def one(ch: str) -> st.SearchStrategy[str]:
        options = [ch, ch.upper()] + (["\u212a"] if ch == "k" else [])
        return st.sampled_from(options)
    return st.tuples(*[one(c) for c in key]).map("".join)


_keys = (st.sampled_from(sorted(SECRET_KEYS)).flatmap(_case_variants)
         | st.sampled_from(["content", "tools", "api", "key", "x-api", "secretive", "Authorization2", ":", '"',
                            "openai_api_key", "Session-Token", 'a"_token', "max_tokens", "tokens", "db_password"])
         | st.text(max_size=6))
_json_with_keys = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10) | _keys,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4), max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(value=_json_with_keys)
def test_redacted_dumps_equals_walking_every_node(value) -> None:
    """The row worker skips the redaction walk when the text proves no secret-named key is there:
    same text as walking, for secret keys in any case (the Kelvin sign too), keys that only
    contain one, and secret names used as values."""
    assert redacted_dumps(value, compact) == compact(redact_json(value))


def test_port_rollouts_option():
    assert parse_port_rollouts("8081=a, 8082=b") == {8081: "a", 8082: "b"}
    for bad, why in (("0=a", "port 0 is not in 1..65535"), ("70000=a", "port 70000 is not in 1..65535"),
                     ("8081=a,8081=b", "port 8081 given twice ('a', 'b')")):
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_port_rollouts(bad)
    with pytest.raises(ValueError, match="PORT=ROLLOUT"):
        parse_port_rollouts("8081")


def test_detect_api_paths():
    assert record.detect_api("POST", "/v1/messages?beta=true") == "anthropic.messages"
    assert record.detect_api("POST", "/openai/v1/chat/completions") == "openai.chat"
    assert record.detect_api("POST", "/v1/responses") == "openai.responses"
    assert record.detect_api("GET", "/v1/responses") is None
    assert record.detect_api("POST", "/v1/messages/count_tokens") is None
    assert record.detect_api("POST", "/v1/embeddings") is None
    # the server decodes a path and drops a fragment: these were answered as model calls, unrecorded (a probe)
    assert record.detect_api("POST", "/v1/chat/%63ompletions") == "openai.chat"
    assert record.detect_api("POST", "/v1/%63hat/completions?x=1") == "openai.chat"
    assert record.detect_api("POST", "/v1/chat/completions#f") == "openai.chat"
    assert record.detect_api("POST", "/v1/messages%2Fcount_tokens") is None


def test_attempts_count_retries_per_rollout():
    c = record.AttemptCounter()
    h = record.request_hash({"model": "m", "input": "x", "metadata": {"t": 1}})
    assert h == record.request_hash({"model": "m", "input": "x", "metadata": {"t": 2}})
    assert [c.next("r", h), c.next("r", h), c.next("other", h)] == [1, 2, 1]


# -- writer ----------------------------------------------------------------------------------
def _row(i: int) -> dict:
    return {"call_id": f"c{i}", "api": "openai.chat", "status": "ok"}


def test_writer_flushes_by_rows_and_on_close(tmp_path):
    w = PartWriter(tmp_path, flush_rows=3, flush_seconds=3600)
    w.start()
    for i in range(7):
        assert w.submit(lambda i=i: _row(i))
    w.close()
    parts = sorted((tmp_path / "calls").glob("*.parquet"))
    assert [pq.read_metadata(p).num_rows for p in parts] == [3, 3, 1]
    # no temporary file left; the live lock stays (unlinked, a second proxy's lock would be on a ghost)
    assert [p.name for p in (tmp_path / "calls").iterdir() if p.name.startswith(".")] == [".polar-capture.lock"]
    assert pq.read_schema(parts[0]).equals(CALL_LOG_SCHEMA, check_metadata=False)
    assert stat.S_IMODE(os.stat(parts[0]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "calls").st_mode) == 0o700


def test_writer_flushes_by_time(tmp_path):
    w = PartWriter(tmp_path, flush_rows=1000, flush_seconds=0.2)
    w.start()
    w.submit(lambda: _row(1))
    deadline = time.monotonic() + 10
    while not list((tmp_path / "calls").glob("part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the part, with a deadline
    assert list((tmp_path / "calls").glob("part-*.parquet"))
    w.close()


def test_a_write_failure_is_logged_once_and_its_end_too(tmp_path, caplog):
    """A folder that cannot be written logged one line per retry (every flush interval: 9 lines
    in 18 s); now once, again only when something changes, and once when writing works again."""
    w = PartWriter(tmp_path, flush_rows=1000, flush_seconds=3600)
    calls = tmp_path / "calls"
    calls.write_text("not a folder")
    w._rows = [_row(0)]
    caplog.set_level(logging.INFO, logger="polar_capture")
    for _ in range(5):
        w._retry_at = 0.0  # as if a flush interval had passed
        w._flush()
    failures = [r for r in caplog.records if "cannot write a part" in r.getMessage()]
    assert len(failures) == 1 and "1 rows kept in memory, retrying every 3600s" in failures[0].getMessage()
    calls.unlink()
    w._retry_at = 0.0
    w._flush()
    assert "parts can be written to" in caplog.text and "the 1 rows kept in memory are written" in caplog.text
    assert pq.read_table(calls).num_rows == 1


def test_writer_full_queue_drops_instead_of_blocking(tmp_path):
    w = PartWriter(tmp_path, flush_rows=10, flush_seconds=3600, queue_size=2)
    gate = threading.Event()
    w.start()
    w.submit(lambda: (gate.wait(10), _row(0))[1])
    time.sleep(0.2)  # let the worker pick up the blocking job (a drop needs the queue full)
    results = [w.submit(lambda i=i: _row(i)) for i in range(1, 6)]
    assert results.count(False) >= 1 and w.dropped == results.count(False)
    gate.set()
    w.close()


def test_a_full_queue_says_its_drops_once_a_minute_not_once_a_call(caplog):
    """A probe: 180 dropped calls wrote 180 log lines (100 a second under load)."""
    from polar_train.capture.handoff import HandOff

    caplog.set_level(logging.WARNING, logger="polar_capture")
    hand = HandOff(1, "row worker")
    assert hand.put("first")
    assert [hand.put(i) for i in range(50)] == [False] * 50 and hand.dropped == 50
    lines = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
    assert lines == ["polar_capture: row worker queue full, call dropped (1 dropped so far; said again at most "
                     "once a minute)"]


def test_writer_survives_a_failing_job(tmp_path):
    w = PartWriter(tmp_path, flush_rows=10, flush_seconds=3600)
    w.start()
    w.submit(lambda: 1 / 0)
    w.submit(lambda: _row(1))
    w.close()
    assert w.failed_jobs == 1 and w.written_rows == 1


def test_a_row_arrow_cannot_store_costs_no_other_row_of_its_part(tmp_path, caplog):
    """A server that reports a number past the column's type (a token id or a usage count beyond
    int32) made the whole part fail to convert: every call flushed with it was lost. Now the other
    rows are written as they are and that call keeps its row, as a proxy_error that says why, with
    its identity, timing, request and response but without the numbers."""
    body = json.loads(WIRE["resp_inj"])
    body["usage"]["input_tokens"] = 2**40
    body["input_messages"][0]["tokens"][0] = 2**33
    bad = record.build_row(_state("openai.responses", request={"model": "tiny", "input": "Hi"}, http_status=200,
                                  identity=Identity("r", "header", None, "sess-1"),
                                  response_body=json.dumps(body).encode(), injected=True,
                                  asked=openai_responses.inject({"input": "Hi"}).asked), None)
    assert bad["status"] == "ok" and bad["prompt_token_ids"][0] == 2**33  # what the server said
    w = PartWriter(tmp_path, flush_rows=5, flush_seconds=3600)
    w.start()
    for i in range(5):
        w.submit(lambda i=i: bad if i == 2 else {**_row(i), "prompt_token_ids": [1, 2], "usage_prompt_tokens": 2})
    w.close()
    table = pq.read_table(tmp_path / "calls")
    rows = {r["call_id"]: r for r in table.to_pylist()}
    assert len(rows) == 5 and w.written_rows == 5
    assert all(rows[f"c{i}"]["prompt_token_ids"] == [1, 2] and rows[f"c{i}"]["status"] == "ok" for i in (0, 1, 3, 4))
    kept = rows[bad["call_id"]]
    assert kept["status"] == "proxy_error" and "could not be stored" in kept["error"] and "does not fit its column" in kept["error"]
    assert kept["prompt_token_ids"] is None and kept["usage_prompt_tokens"] is None
    assert kept["rollout_id"] == "r" and kept["client_session_id"] == "sess-1"
    assert kept["response_json"] == bad["response_json"]
    assert kept["started_at"] is not None and kept["api"] == "openai.responses"
    assert "could not be stored" in caplog.text


def test_compact_prompts_survive_a_row_with_ids_past_int64(tmp_path):
    """With polar_prompt_delta on, a prompt id too large for the prefix comparison (a server's
    2**70) raised on the writer's thread, which then died: every later call was lost. The row is
    now stored uncompacted (here: as the proxy_error above), and the calls after it as usual."""
    w = PartWriter(tmp_path, flush_rows=100, flush_seconds=3600, prompt_delta=True)
    w.start()
    base = list(range(1, 100))
    rows = [{**_row(0), "rollout_id": "r", "prompt_token_ids": base, "completion_token_ids": [7]},
            {**_row(1), "rollout_id": "r", "prompt_token_ids": base + [2**70], "completion_token_ids": [7]},
            {**_row(2), "rollout_id": "r", "prompt_token_ids": base + [7, 8], "completion_token_ids": [9]}]
    for row in rows:
        w.submit(lambda row=row: dict(row))
    w.close()
    got = {r["call_id"]: r for r in pq.read_table(tmp_path / "calls").to_pylist()}
    assert set(got) == {"c0", "c1", "c2"}
    assert got["c1"]["status"] == "proxy_error" and got["c1"]["prompt_token_ids"] is None
    assert got["c2"]["status"] == "ok" and got["c2"]["prompt_prefix_call_id"] == "c0"
    from polar_train.calllog import read_calls

    full = {r["call_id"]: r["prompt_token_ids"] for r in read_calls(tmp_path).to_pylist()}
    assert full == {"c0": base, "c1": None, "c2": base + [7, 8]}  # what readers (the builder) get


@pytest.mark.parametrize("api,wire,asked_itself", [("openai.chat", "chat_inj_sse", False),
                                                    ("openai.responses", "resp_inj_sse", False),
                                                    ("openai.responses", "resp_inj_sse", True)])
def test_a_prompts_ids_read_as_an_array_make_the_same_row(api, wire, asked_itself, tmp_path):
    """The row worker reads a long prompt's ids with numpy (chat's first chunk, Responses' final
    event): the row - and the part written from it - is what parsing every event as JSON gives. A
    client that asked for Responses' raw messages itself keeps them in response_json: read as JSON."""
    import numpy as np

    from polar_train.capture.id_arrays import as_list

    prompt = [248045, *range(1000, 4000), 0, 248046]  # ~17 KiB of ids, token 0 included
    short = "[248045,846,198,12675,248046,198,248045,74455,198]"
    raw = WIRE[wire].encode().replace(short.encode(), json.dumps(prompt, separators=(",", ":")).encode(), 1)
    module = record.FORMATS[api]
    request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]} if api == "openai.chat" \
        else {"model": "tiny", "input": "Hi", **({"enable_response_messages": True} if asked_itself else {})}
    injection = module.inject(dict(request))

    def row(**kw):
        state = _state(api, request=request, http_status=200, stream=True, stream_raw=bytearray(raw),
                       streamed=True, injected=True, asked=injection.asked)
        state.call_id, state.started_at, state.finished_at = "same", at, at
        return record.build_row(state, None)

    at = record.utcnow()

    fast = row()
    reader = module.ids_reader
    module.ids_reader = lambda state: None
    try:
        slow = row()
    finally:
        module.ids_reader = reader
    assert fast["status"] == "ok" and fast["token_source"] == "server" and as_list(fast["prompt_token_ids"]) == prompt
    assert isinstance(fast["prompt_token_ids"], np.ndarray) is not asked_itself
    assert isinstance(slow["prompt_token_ids"], list)
    assert {k: as_list(v) for k, v in fast.items()} == {k: v for k, v in slow.items()}
    from polar_train.calllog import read_calls

    w = PartWriter(tmp_path, flush_rows=10, flush_seconds=3600, prompt_delta=True)  # compact prompts too
    w.start()
    w.submit(lambda: fast)
    w.submit(lambda: {**fast, "call_id": "again"})  # the same prompt again: stored as a reference
    w.close()
    stored = {r["call_id"]: r for r in pq.read_table(tmp_path / "calls").to_pylist()}
    assert stored["same"]["prompt_token_ids"] == prompt and stored["again"]["prompt_prefix_call_id"] == "same"
    assert [r["prompt_token_ids"] for r in read_calls(tmp_path).to_pylist()] == [prompt, prompt]


# -- row building for bad input --------------------------------------------------------------
def _state(api="openai.chat", **kw) -> record.CallState:
    from polar_train.capture.identity import Identity

    s = record.CallState(api, "POST", "h", "/v1/chat/completions", "c", Identity("r", "header"),
                         record.utcnow(), "http://h")
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_the_harness_session_id_is_kept_on_every_row_path_and_never_holds_a_secret():
    """The row, the row of a call whose row could not be built, and (above) a row Arrow cannot store
    all keep it; a session id that is the call's own API key (a misconfigured harness) is scrubbed."""
    state = _state(identity=Identity("r", "header", None, "sess-1"), request={"model": "m", "messages": []},
                   http_status=500, response_body=b'{"error": "x"}')
    assert record.build_row(state, None)["client_session_id"] == "sess-1"
    assert record.fallback_row(state, RuntimeError("ours"))["client_session_id"] == "sess-1"
    state = _state(identity=Identity("r", "header", None, "key-s3cr3t-value"), secrets={"key-s3cr3t-value"},
                   request={"model": "m", "messages": []}, http_status=500, response_body=b'{"error": "x"}')
    assert record.build_row(state, None)["client_session_id"] == "[REDACTED]"
    assert record.fallback_row(state, RuntimeError("ours"))["client_session_id"] == "[REDACTED]"


@pytest.mark.parametrize("body,status,needle", [
    (b"{oops", "upstream_error", "malformed JSON"),
    (b"\xff\xfe\x00", "upstream_error", "malformed JSON"),
    (b'{"error": "x"}', "upstream_error", "HTTP 500"),
])
def test_build_row_bad_bodies(body, status, needle):
    row = record.build_row(_state(response_body=body, http_status=500 if b"error" in body else 200,
                                  request={"model": "m", "messages": []}), None)
    assert row["status"] == status and needle in row["error"]
    import pyarrow as pa

    pa.Table.from_pylist([row], schema=CALL_LOG_SCHEMA)  # always a valid row


@pytest.mark.parametrize("api,body,error", [
    ("openai.responses", {"error": {"message": "Overloaded", "type": "overloaded_error"}},
     "the server reported an error: Overloaded (overloaded_error)"),
    ("openai.responses", {"detail": "upstream busy"}, "response has no output list (not a Responses object)"),
    ("anthropic.messages", {"detail": "upstream busy"}, "response has no content list (not a Messages object)"),
])
def test_a_gateways_error_answered_with_200_is_no_ok_row(api, body, error):
    """A gateway answering its error with HTTP 200: chat's row said so (no choices[0]), Responses'
    and Messages' were ``ok`` with rendered prompt ids and an empty completion, and ``build`` made
    trajectories of them (a probe)."""
    request = {"model": "m", "max_tokens": 4, "input": "hi"} if api == "openai.responses" else \
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    row = record.build_row(_state(api, request=request, http_status=200, response_body=json.dumps(body).encode()),
                           None)
    assert row["status"] == "upstream_error" and row["error"] == error
    assert row["prompt_token_ids"] is None and row["completion_token_ids"] is None


def test_build_row_truncated_and_malformed_stream():
    row = record.build_row(_state(stream_raw=b'data: {"choices": []}\n\ndata: {bad\n\ndata: {',
                                  http_status=200, stream=True), None)
    assert row["status"] == "upstream_error" and "malformed" in row["error"]


def test_build_row_renders_when_server_gave_no_ids(tiny_model_dir):
    from polar_train.capture.render import Renderer

    req = {"model": "tiny", "max_tokens": 4, "system": "Be brief.",
           "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}
    body = {"id": "m", "type": "message", "role": "assistant", "model": "tiny",
            "content": [{"type": "text", "text": "Hi there"}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 0, "output_tokens": 0}}
    renderer = Renderer(str(tiny_model_dir))
    tok = renderer.tokenizer
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(want, add_special_tokens=False)
    body["usage"] = {"input_tokens": len(prompt), "output_tokens": len(tok.encode("Hi there")) + 1}
    row = record.build_row(_state("anthropic.messages", request=req, http_status=200,
                                  response_body=json.dumps(body).encode()), renderer)
    assert row["token_source"] == "rendered" and row["prompt_token_ids"] == prompt
    assert row["completion_token_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert row["usage_match"] is True


def _vllm_reasoning_reply(renderer, blocks: list[dict], sampled: str) -> dict:
    """A Messages row for what vLLM run with ``--reasoning-parser qwen3`` answers when the model
    sampled ``sampled`` (usage counts exactly those tokens)."""
    req = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    tok = renderer.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]  # (a BatchEncoding in transformers 5)
    body = {"id": "m", "type": "message", "role": "assistant", "model": "tiny", "content": blocks,
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": len(prompt), "output_tokens": len(tok.encode(sampled, add_special_tokens=False))}}
    return record.build_row(_state("anthropic.messages", request=req, http_status=200,
                                   response_body=json.dumps(body).encode()), renderer)


def test_a_thinking_only_reply_the_model_never_closed_keeps_no_rendered_ids(tiny_model_dir):
    """vLLM's qwen3 reasoning parser makes all text before a </think> reasoning: a model that ended
    its turn without one answers with a thinking block only, stop_reason end_turn. The row kept the
    template's '<think>...</think>' rendering - five tokens the model never sampled - as `ok`
    ids, unsaid (a probe against vLLM with the parser). One the model closed keeps its ids."""
    from polar_train.capture.render import Renderer

    renderer = Renderer(str(tiny_model_dir))
    thinking = [{"type": "thinking", "thinking": "Hello world", "signature": "s"}]
    row = _vllm_reasoning_reply(renderer, thinking, "Hello world<|im_end|>")
    assert row["status"] == "ok" and row["completion_token_ids"] is None, row
    assert "thinking only" in row["error"] and "ended its turn without closing it" in row["error"]
    closed = _vllm_reasoning_reply(renderer, thinking, "<think>\nHello world\n</think>\n\n<|im_end|>")
    assert closed["token_source"] == "rendered" and closed["usage_match"] is True


def test_text_after_thinking_renders_the_tokens_vllm_parsed_it_from(tiny_model_dir):
    """vLLM's qwen3 parser returns the text after </think> with the two newlines the model sampled
    there ('\\n\\nHello world'); our template printed them after its own, and the row held four
    newlines the model never sampled, usage_match true (the counts agreed by chance). Qwen3's
    template drops them; so does ours."""
    from polar_train.capture.render import Renderer

    renderer = Renderer(str(tiny_model_dir))
    sampled = "<think>\nLet me think\n</think>\n\nHello world<|im_end|>"
    row = _vllm_reasoning_reply(renderer, [{"type": "thinking", "thinking": "\nLet me think\n", "signature": "s"},
                                           {"type": "text", "text": "\n\nHello world"}], sampled)
    assert row["token_source"] == "rendered", row
    assert renderer.tokenizer.decode(row["completion_token_ids"]) == sampled


IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}


@pytest.mark.parametrize("api,request_", [
    ("anthropic.messages", {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [IMAGE_BLOCK, {"type": "text", "text": "What is in this image?"}]}]}),
    ("anthropic.messages", {"model": "tiny", "max_tokens": 4, "messages": [  # Claude Code's Read of a PNG
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE_BLOCK]}]}]}),
    ("openai.chat", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}}, {"type": "text", "text": "What?"}]}]}),
    ("openai.responses", {"model": "tiny", "max_output_tokens": 4, "input": [  # Codex's view_image
        {"type": "message", "role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBOR"}]}]}),
])
def test_a_rendered_call_whose_prompt_holds_an_image_keeps_no_token_ids(tiny_model_dir, api, request_, caplog):
    """A multimodal server that returns no ids (a hosted API, a VL model's Messages endpoint): the
    image was dropped before the template, and the row was `ok` with the ids of a prompt the model
    never saw, which build trained on (a probe). The row says why it keeps none, the log once."""
    from polar_train.capture.render import Renderer

    if api == "anthropic.messages":
        body = {"id": "m", "type": "message", "role": "assistant", "model": "tiny", "stop_reason": "end_turn",
                "content": [{"type": "text", "text": "A cat"}], "usage": {"input_tokens": 1200, "output_tokens": 3}}
    elif api == "openai.chat":
        body = {"id": "c", "object": "chat.completion", "model": "tiny", "usage": {"prompt_tokens": 1200,
                "completion_tokens": 3}, "choices": [{"index": 0, "message": {"role": "assistant", "content": "A cat"},
                                                       "finish_reason": "stop", "logprobs": None}]}
    else:
        body = {"id": "r", "object": "response", "status": "completed", "model": "tiny", "output": [
            {"type": "message", "id": "m", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "A cat", "annotations": []}]}],
            "usage": {"input_tokens": 1200, "output_tokens": 3}}
    record._LOGGED.clear()
    with caplog.at_level("WARNING", logger="polar_capture"):
        rows = [record.build_row(_state(api, request=request_, http_status=200, response_body=json.dumps(body).encode()),
                                 Renderer(str(tiny_model_dir))) for _ in range(2)]
    for row in rows:
        assert row["status"] == "ok" and row["token_source"] == "none" and row["prompt_token_ids"] is None
        assert row["completion_token_ids"] is None
        assert re.fullmatch(r"token ids unavailable: the prompt holds a media part \((image_url|input_image) in chat "
                            r"message \d, (user|tool)\), whose tokens a multimodal model's processor makes, not its "
                            r"chat template", row["error"]), row["error"]
    assert not any(r.exc_info for r in caplog.records)
    assert sum("image, audio or file part" in r.getMessage() for r in caplog.records) == 1


def test_a_stream_that_splits_an_emoji_by_utf16_code_unit_keeps_its_token_ids(tiny_model_dir, caplog):
    """A server that cuts its stream by UTF-16 code unit (JavaScript's) sends an emoji's surrogate
    pair in two deltas: the joined reply held the pair, the tokenizer refused it with a TypeError,
    the call lost all its ids (the prompt's too) and the log a traceback per call (a probe). A reply
    with a truly unpaired surrogate is said in its row, once in the log, without a traceback."""
    from polar_train.capture.render import Renderer

    def event(name, obj):
        return f"event: {name}\ndata: {json.dumps(obj)}\n\n"

    def stream(*texts):
        return "".join([
            event("message_start", {"type": "message_start", "message": {"id": "m", "type": "message",
                  "role": "assistant", "model": "tiny", "content": [], "usage": {"input_tokens": 9, "output_tokens": 1}}}),
            event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}),
            *[event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": t}}) for t in texts],
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                    "usage": {"output_tokens": 4}}),
            event("message_stop", {"type": "message_stop"})]).encode()

    renderer = Renderer(str(tiny_model_dir))
    req = {"model": "tiny", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    record._LOGGED.clear()
    with caplog.at_level("WARNING", logger="polar_capture"):
        rows = [record.build_row(_state("anthropic.messages", request=req, http_status=200,
                                        stream_raw=stream(*texts)), renderer)
                for texts in (("A\ud83d", "\ude00B"), ("A\ud83d", "B"), ("A\ud83d", "B"))]
    whole = rows[0]
    assert whole["status"] == "ok" and whole["token_source"] == "rendered" and whole["error"] is None
    assert whole["completion_token_ids"][:-1] == renderer.encode("A\U0001f600B")
    assert whole["prompt_token_ids"] == renderer.prompt_ids([{"role": "user", "content": "hi"}], None)
    for cut in rows[1:]:
        assert cut["status"] == "ok" and cut["token_source"] == "none" and cut["prompt_token_ids"] is None
        assert cut["error"] == ("token ids unavailable: the text holds an unpaired UTF-16 surrogate (\\ud83d at "
                                "character 1), which no tokenizer encodes")
    assert not any(r.exc_info for r in caplog.records)
    assert sum("unpaired UTF-16 surrogate" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("api,why", [
    ("anthropic.messages", {"stop_reason": "stop_sequence", "stop_sequence": "e"}),
    ("openai.chat", {"finish_reason": "stop", "stop_reason": "e"}),  # vLLM names the stop string
    ("openai.chat", {"finish_reason": "stop", "stop_reason": 13}),  # ... or the stop token id
])
def test_a_reply_cut_by_a_stop_string_gets_no_invented_end_of_turn(tiny_model_dir, api, why):
    """After a stop string the model sampled other tokens (cut from the text), not <|im_end|>: the
    rendered completion ended in an <|im_end|> nobody sampled, trained with loss mask 1, and its
    count could even make usage_match true."""
    from polar_train.capture.render import Renderer

    renderer = Renderer(str(tiny_model_dir))
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if api == "anthropic.messages":
        req = {"model": "tiny", "max_tokens": 24, "stop_sequences": ["e"], "messages": [{"role": "user", "content": "Hi"}]}
        body = {"id": "m", "type": "message", "role": "assistant", "model": "tiny",
                "content": [{"type": "text", "text": "Tuesday 會是"}], **why, "usage": {"input_tokens": 1, "output_tokens": 9}}
    else:
        req = {"model": "tiny", "max_tokens": 24, "stop": ["e"], "messages": [{"role": "user", "content": "Hi"}]}
        body = {"id": "c", "object": "chat.completion", "model": "tiny", "usage": {"prompt_tokens": 1, "completion_tokens": 9},
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Tuesday 會是"}, "logprobs": None,
                             **why}]}
    row = record.build_row(_state(api, request=req, http_status=200, response_body=json.dumps(body).encode()), renderer)
    assert row["token_source"] == "rendered"
    assert row["completion_token_ids"] == renderer.encode("Tuesday 會是") and end not in row["completion_token_ids"]
    ended = json.loads(json.dumps(body))  # the same reply ended by the model itself: the token is there
    if api == "anthropic.messages":
        ended["stop_reason"], ended["stop_sequence"] = "end_turn", None
    else:
        ended["choices"][0]["stop_reason"] = None
    row = record.build_row(_state(api, request=req, http_status=200, response_body=json.dumps(ended).encode()), renderer)
    assert row["completion_token_ids"][-1] == end


@pytest.mark.parametrize("stop_reason,stopped", [(None, True), ("e", False), (13, False)])
def test_a_streamed_chat_reply_says_whether_the_model_ended_it(stop_reason, stopped):
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "tiny",
             "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop", "stop_reason": stop_reason}]}
    assert openai_chat.parse_stream([(None, chunk)], True).stopped is stopped


def test_a_tokenizer_that_does_not_load_is_said_once_and_each_row_keeps_its_call(tiny_model_dir, tmp_path, caplog):
    from polar_train.capture.render import Renderer

    broken = tmp_path / "tok"  # the tokenizer's files, and a config.json cut short
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "config.json").write_text("{")
    req = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
    body = {"id": "m", "type": "message", "role": "assistant", "model": "tiny",
            "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "output_tokens": 2}}
    renderer = Renderer(str(broken))
    record._LOGGED.clear()
    with caplog.at_level("WARNING", logger="polar_capture"):
        rows = [record.build_row(_state("anthropic.messages", request=req, http_status=200,
                                        response_body=json.dumps(body).encode()), renderer) for _ in range(3)]
    for row in rows:  # the call is kept, with why it has no ids
        assert row["status"] == "ok" and row["token_source"] == "none" and row["prompt_token_ids"] is None
        assert row["error"].startswith(f"token ids unavailable: polar_tokenizer {broken}: cannot load it: ")
    said = [r for r in caplog.records if "cannot load it" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None  # once, without a traceback
    assert not any(r.exc_info for r in caplog.records)
    caplog.clear()
    with caplog.at_level("ERROR", logger="polar_capture"):
        Renderer(str(broken)).preload()  # the row worker loads it at start: said once, no traceback
    assert [r.exc_info for r in caplog.records] == [None] and "cannot load it" in caplog.text


def test_anthropic_to_chat_tool_round_trip():
    req = {"system": [{"type": "text", "text": "x-anthropic-billing-header: 1"}, {"type": "text", "text": "S"}],
           "messages": [{"role": "user", "content": "do it"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "sh",
                                                           "input": {"c": "ls"}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                      "content": [{"type": "text", "text": "a.py"}]}]}],
           "tools": [{"name": "sh", "description": "run", "input_schema": {"type": "object"}}]}
    messages, tools = anthropic_messages.to_chat(req)
    assert messages[0] == {"role": "system", "content": "S"}
    assert messages[2]["tool_calls"][0]["function"] == {"name": "sh", "arguments": '{"c": "ls"}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "a.py"}
    assert tools[0]["function"]["parameters"] == {"type": "object"}


# -- hooks with mitmproxy's tflow / taddons --------------------------------------------------
def _load_addon():
    spec = importlib.util.spec_from_file_location("polar_capture_addon", REPO / "addons" / "polar_capture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _configured_addon(out: Path, **options):
    """A fresh capture addon in mitmproxy's test context, writing to ``out``, with these options."""
    from mitmproxy.test import taddons

    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(out), **options)
        yield addon


def _chat_flow(body: dict, path="/v1/chat/completions"):
    from mitmproxy.test import tflow, tutils

    f = tflow.tflow(req=tutils.treq(method=b"POST", path=path.encode(), content=json.dumps(body).encode(),
                                    headers=((b"content-type", b"application/json"),
                                             (b"accept-encoding", b"gzip"))))
    return f


def test_hooks_connect_identity_injection_and_stream(tmp_path):
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import taddons, tflow

    mod = _load_addon()
    addon = mod.PolarCapture()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path), polar_flush_seconds="0.1")

        async def run():
            connect = tflow.tflow()
            connect.request.method = "CONNECT"
            connect.request.headers["proxy-authorization"] = _basic("roll-7", "pw-secret")
            addon.http_connect(connect)
            f = _chat_flow({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True})
            f.client_conn = connect.client_conn
            addon.requestheaders(f)
            assert "accept-encoding" not in f.request.headers
            await addon.request(f)
            sent = json.loads(f.request.content)
            assert sent["return_token_ids"] is True and sent["logprobs"] is True
            f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
            addon.responseheaders(f)
            out = b""
            for chunk in [WIRE["chat_inj_sse"].encode()[i:i + 64] for i in range(0, len(WIRE["chat_inj_sse"]), 64)]:
                got = f.response.stream(chunk)
                out += b"".join(got) if isinstance(got, list) else got
            out += b"".join(f.response.stream(b""))
            assert b"token_ids\":[" not in out and b"prompt_token_ids\":[" not in out
            await addon.response(f)

        asyncio.run(run())
        addon.done()
    (part,) = (tmp_path / "calls").glob("part-*.parquet")
    (row,) = pq.read_table(part).to_pylist()
    assert row["rollout_id"] == "roll-7" and row["rollout_source"] == "proxy_auth"
    assert row["token_source"] == "server" and row["status"] == "ok" and row["stream"] is True
    assert row["prompt_token_ids"] == json.loads(WIRE["chat_inj"])["prompt_token_ids"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_request_nested_deeper_than_python_parses_keeps_the_servers_answer(tmp_path, caplog, path):
    """JSON nested 5,000 deep in `metadata`: the request hook raised RecursionError (a traceback
    per call in the proxy's log) and the row was a proxy_error ("a bug of ours") without the
    server's 400 (a probe). The request goes on unchanged; its row is the server's error."""
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon = mod.PolarCapture()
    raw = ('{"model": "tiny", "max_tokens": 1, "metadata": {"x": %s}, "messages": [{"role": "user", "content": '
           '"%s"}]}' % ("[" * 5000 + "]" * 5000, "hi " * 2000)).encode()  # (past the member walk's minimum size)
    answer = b'{"detail":"There was an error parsing the body"}'
    with caplog.at_level("WARNING"), taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path), polar_flush_seconds="0.1")
        f = _chat_flow({}, path=path)
        f.request.content = raw
        addon.requestheaders(f)
        asyncio.run(addon.request(f))
        assert f.request.raw_content == raw
        f.response = Response.make(400, answer, Headers(content_type="application/json"))
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
        addon.done()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    (part,) = (tmp_path / "calls").glob("part-*.parquet")
    (row,) = pq.read_table(part).to_pylist()
    assert row["status"] == "upstream_error" and row["http_status"] == 400
    assert row["error"] == f"HTTP 400: {answer.decode()}"


def test_responses_request_changed_members_spliced_rest_as_sent(tmp_path):
    """Codex's request: ``include`` changed, the rest (instructions, tools, input) goes upstream as
    the client wrote it, for the first request and for one whose tools the proxy remembers (a body
    of 4 KiB or more: smaller ones are parsed whole)."""
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon = mod.PolarCapture()
    tools = json.dumps([{"type": "function", "name": f"t{i}", "description": "d\u00e9 " * 40,
                         "parameters": {"type": "object", "properties": {}}} for i in range(12)])
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path))
        for turn in range(2):
            raw = ('{"model":"m","instructions":"be brief","input":[{"role":"user","content":"hi %d"}],'
                   '"tools":%s,"include":["reasoning.encrypted_content"],"stream":true}' % (turn, tools)).encode()
            f = _chat_flow({}, path="/v1/responses")
            f.request.content = raw
            addon.requestheaders(f)
            asyncio.run(addon.request(f))
            sent = f.request.raw_content
            want = openai_responses.inject(json.loads(raw)).body
            assert json.loads(sent) == want and int(f.request.headers["content-length"]) == len(sent)
            assert tools.encode() in sent and b'"input":[{"role":"user","content":"hi %d"}]' % turn in sent
        assert openai_responses.REQUEST_ECHOED["tools"].texts[0] == tools
        addon.done()


def test_chat_conversation_resent_longer_is_read_only_where_it_grew(tmp_path):
    """A chat session through the hooks: each request resends the conversation one turn longer;
    the injected flags go in after "{", every other byte as sent, and the proxy remembers the
    conversation so that the next request's old turns are not parsed again. A small body (under
    4 KiB) is parsed whole and injected the same way."""
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon = mod.PolarCapture()
    cache = openai_chat.REQUEST_ECHOED["messages"]
    cache.clear()
    messages = [{"role": "system", "content": "You are a coding agent. \u00e9 " * 200}]
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path))
        for turn in range(3):
            messages += [{"role": "user", "content": f"step {turn}: run the tests"}]
            conversation = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
            raw = ('{"model":"m","messages":%s,"stream":true}' % conversation).encode()
            if turn:  # what the proxy will find: the old turns remembered, only the new ones read
                assert cache.skip(raw.decode(), raw.decode().index("[")) == raw.decode().index(',"stream"')
            f = _chat_flow({})
            f.request.content = raw
            addon.requestheaders(f)
            asyncio.run(addon.request(f))
            sent = f.request.raw_content
            assert json.loads(sent) == openai_chat.inject(json.loads(raw)).body
            assert sent == b'{"return_token_ids":true,"logprobs":true,' + raw[1:]
            assert cache.texts[0] == conversation[:-1] and len(cache.texts) == 1  # the longer one replaced it
            messages.append({"role": "assistant", "content": f"done {turn}"})
        small = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"logprobs":false}'
        f = _chat_flow({})
        f.request.content = small
        addon.requestheaders(f)
        asyncio.run(addon.request(f))
        assert json.loads(f.request.raw_content) == openai_chat.inject(json.loads(small)).body
        assert len(cache.texts) == 1  # not walked: nothing learned
        addon.done()
    cache.clear()


def test_running_freezes_the_startup_heap(tmp_path):
    """Once the proxy runs, what it allocated at startup is out of the cyclic GC's walks (the
    addon's per-event allocations would otherwise make every full collection walk it again)."""
    import gc

    from mitmproxy.test import taddons

    from polar_train.capture import handover

    mod = _load_addon()
    addon = mod.PolarCapture()
    gc.unfreeze()
    handover._heap_frozen = False  # as in a new process (an earlier test's addon ran in this one)
    try:
        with taddons.context(addon) as tctx:
            tctx.configure(addon, polar_out=str(tmp_path))
            gc.unfreeze()  # (once, in a full run, 375 objects stood frozen here: whatever froze them, not this)
            assert gc.get_freeze_count() == 0
            addon.running()
            frozen = gc.get_freeze_count()
            assert frozen > 1000
            junk = [[i] for i in range(5000)]  # garbage of a proxy under load when the script reloads
            addon.running()  # a reload runs it again: what lives then is not pinned for good (once per process)
            assert gc.get_freeze_count() == frozen
            del junk
            addon.done()
    finally:
        gc.unfreeze()


def test_hooks_plain_http_proxy_auth_removed_and_non_model_untouched(tmp_path):
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon = mod.PolarCapture()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path), polar_inject=False)
        f = _chat_flow({"model": "m", "messages": []})
        f.request.headers["Proxy-Authorization"] = _basic("r-plain", "pw")
        f.request.headers["X-Polar-Rollout"] = "r-header"
        f.request.headers["x-polar-task"] = "t-1"
        f.request.headers["Accept-Encoding"] = "gzip"
        kept = [(k, v) for k, v in f.request.headers.fields if k.lower() == b"content-type"]
        addon.requestheaders(f)
        assert list(f.request.headers.fields) == kept  # identity headers and accept-encoding: gone
        state = record.resolve_head(addon.calls[f.id], "x-polar-rollout", "x-polar-task", {})
        assert (state.identity.rollout_id, state.identity.task_id) == ("r-plain", "t-1")
        other = _chat_flow({"x": 1}, path="/api/v3/repos")
        other.request.headers["x-polar-rollout"] = "r-header"
        before = other.request.content
        addon.requestheaders(other)
        asyncio.run(addon.request(other))
        # our identity headers are for the proxy alone, on any request; the rest passes untouched
        assert "x-polar-rollout" not in other.request.headers and other.request.content == before
        assert other.id not in addon.calls
        addon.done()


def test_hook_exception_becomes_proxy_error_row(tmp_path, monkeypatch):
    from mitmproxy.http import Response
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon = mod.PolarCapture()

    def boom(body):
        raise RuntimeError("injected bug")

    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path))
        monkeypatch.setattr(mod.record.FORMATS["openai.chat"], "inject", boom)
        f = _chat_flow({"model": "m", "messages": []})
        addon.requestheaders(f)
        asyncio.run(addon.request(f))  # must not raise
        f.response = Response.make(200, json.dumps({"choices": []}).encode(), {"content-type": "application/json"})
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
        addon.done()
    (row,) = pq.read_table(next((tmp_path / "calls").glob("part-*.parquet"))).to_pylist()
    assert row["status"] == "proxy_error" and "injected bug" in row["error"]


def test_bad_options_give_clear_errors(tmp_path, caplog):
    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon = mod.PolarCapture()
    with taddons.context(addon) as tctx:
        # at startup: one logged line (mitmproxy exits on it), no traceback, nothing started
        with caplog.at_level(logging.ERROR, logger="polar_capture"):
            tctx.configure(addon, polar_out=str(tmp_path / "out"), polar_flush_rows=0)
        assert "polar_capture: polar_flush_rows: at least 1, got 0" in caplog.text
        assert addon.writer is None and not (tmp_path / "out").exists()
        tctx.configure(addon, polar_out=str(tmp_path), polar_flush_rows=256)
        addon.running()
        # while running: mitmproxy refuses the change and keeps the old value
        with pytest.raises(exceptions.OptionsError, match="PORT=ROLLOUT"):
            tctx.configure(addon, polar_out=str(tmp_path), polar_port_rollouts="nonsense")
        with pytest.raises(exceptions.OptionsError, match="not a tokenizer folder"):
            tctx.configure(addon, polar_out=str(tmp_path), polar_tokenizer=str(tmp_path / "missing"))
        (tmp_path / "tokenizer.json").write_text("{}")
        with pytest.raises(exceptions.OptionsError, match="tokenizer.json is a file; name the model or tokenizer"):
            tctx.configure(addon, polar_out=str(tmp_path), polar_tokenizer=str(tmp_path / "tokenizer.json"))
        with pytest.raises(exceptions.OptionsError, match="polar_flush_seconds: must be a finite number"):
            tctx.configure(addon, polar_out=str(tmp_path), polar_flush_seconds="inf")
        with pytest.raises(exceptions.OptionsError, match="seconds"):
            tctx.configure(addon, polar_out=str(tmp_path), polar_flush_seconds="soon")
        for option, value, message in (("polar_flush_rows", 0, "polar_flush_rows: at least 1, got 0"),
                                       ("polar_queue_size", -1, "polar_queue_size: at least 1, got -1"),
                                       ("polar_handoff_ms", -5, "polar_handoff_ms: at least 0, got -5"),
                                       ("polar_max_body_mb", 0, "polar_max_body_mb: at least 1, got 0")):
            with pytest.raises(exceptions.OptionsError, match=message):
                tctx.configure(addon, polar_out=str(tmp_path), **{option: value})
        addon.done()


# -- readers and inspect ---------------------------------------------------------------------
def test_readers_see_complete_parts_only_and_inspect_summarises(tmp_path, capsys):
    import duckdb
    import pyarrow.dataset as ds

    from polar_train.cli import main

    w = PartWriter(tmp_path, flush_rows=2, flush_seconds=3600)
    w.start()
    for i in range(5):
        w.submit(lambda i=i: {**_row(i), "rollout_id": f"r{i % 2}", "token_source": "server",
                              "prompt_token_ids": [1, 2], "completion_token_ids": [3]})
    for i in (5, 6):  # ok, but without ids, and the row says why
        w.submit(lambda i=i: {**_row(i), "rollout_id": "r0", "token_source": "none",
                              "error": "token ids unavailable: the template refuses this prompt" + " at length" * 5 * i})
    w.close()
    (tmp_path / "calls" / ".part-half-written.parquet.tmp").write_bytes(b"PAR1 garbage")
    calls = tmp_path / "calls"
    assert ds.dataset(str(calls), format="parquet", exclude_invalid_files=False).count_rows() == 7
    assert duckdb.sql(f"select count(*) from '{calls}/*.parquet'").fetchall()[0][0] == 7
    from datasets import load_dataset

    dset = load_dataset("parquet", data_files=str(calls / "*.parquet"), split="train",
                        cache_dir=str(tmp_path / "hf-cache"))
    assert dset.num_rows == 7
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "7 calls" in out and "openai.chat" in out and "r0" in out
    # ok calls that say why their ids are missing were not shown at all (only errors were)
    assert "notes on ok calls (2)" in out and "token ids unavailable: the template refuses this prompt" in out
    assert any(line.endswith("at length at …") for line in out.splitlines())  # a note cut to the width says so
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "nope not found" in capsys.readouterr().err
    # argparse: exit 2 with the usage and the reason
    assert main(["inspect", str(tmp_path), "--top", "-1"]) == 2
    assert "--top: must be 0 or more, got -1" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path), "--top", "0"]) == 0  # totals only: no table of rollouts
    out = capsys.readouterr().out
    assert "\n2 rollouts" in out and "per rollout" not in out and "more rollouts" not in out
    assert "2 ok calls carry a note" in out
    # a folder whose only part is not Parquet: an error naming it, not an empty summary
    broken = tmp_path / "broken" / "calls"
    broken.mkdir(parents=True)
    (broken / "part-x.parquet").write_bytes(b"not parquet at all")
    assert main(["inspect", str(tmp_path / "broken")]) == 2
    err = capsys.readouterr().err
    assert "no readable call-log part" in err and "part-x.parquet: not a readable Parquet file" in err


def test_responses_row_takes_sampling_values_from_the_echoed_response():
    row = record.build_row(_state("openai.responses", request={"model": "tiny", "input": "Hi"}, http_status=200,
                                  response_body=WIRE["resp_inj"].encode(), injected=True,
                                  asked=openai_responses.inject({"input": "Hi"}).asked), None)
    assert row["status"] == "ok" and row["token_source"] == "server"
    assert row["temperature"] == 1.0 and row["top_p"] == 1.0
    stored = json.loads(row["response_json"])
    assert stored["input_messages"] is None and stored["output"][0]["content"][0]["logprobs"] is None


def test_responses_rows_are_the_same_with_opening_events_left_unparsed(monkeypatch):
    """The row worker skips parsing response.created/.in_progress it can prove well-formed: the row
    is what parsing every event gives, and a broken opening event is still counted as malformed."""
    big = "Follow the rules. " * 200  # over the walk's threshold, as Codex's instructions are
    raw = WIRE["resp_inj_sse"].encode().replace(b'"instructions":null', b'"instructions":' + json.dumps(big).encode())
    assert raw.count(json.dumps(big).encode()) == 3  # vLLM echoes them in its three envelope events
    request = {"model": "tiny", "input": "Hi", "instructions": big}

    def row(stream: bytes) -> dict:
        return record.build_row(_state("openai.responses", request=request, http_status=200, stream=True,
                                       stream_raw=bytearray(stream), injected=True,
                                       asked=openai_responses.inject(dict(request)).asked), None)

    fast = row(raw)
    assert fast["status"] == "ok" and fast["completion_token_ids"]
    skipped = [e for e in split_all(raw)[0] if openai_responses.unused_event(e)]
    assert [e.split(b"\n", 1)[0] for e in skipped] == [b"event: response.created", b"event: response.in_progress"]
    monkeypatch.setattr(openai_responses, "unused_event", lambda raw: False)
    slow = row(raw)
    assert {k: v for k, v in fast.items() if k not in ("call_id", "started_at", "finished_at")} == \
        {k: v for k, v in slow.items() if k not in ("call_id", "started_at", "finished_at")}
    monkeypatch.undo()
    broken = raw.replace(b'"type":"response.in_progress"}', b'"type":"response.in_progress"', 1)
    assert broken != raw
    bad = row(broken)
    assert bad["status"] == "upstream_error" and bad["error"] == "1 malformed SSE event(s)"


def test_hosted_apis_are_never_injected(tmp_path):
    """api.openai.com & co reject unknown request fields: their calls pass as sent."""
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon = mod.PolarCapture()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path))
        f = _chat_flow({"model": "gpt", "messages": []}, path="/v1/responses")
        f.request.host = "api.openai.com"
        before = f.request.content
        addon.requestheaders(f)
        asyncio.run(addon.request(f))
        assert f.request.content == before and addon.calls[f.id].injected is False
        local = _chat_flow({"model": "tiny", "messages": []}, path="/v1/responses")
        addon.requestheaders(local)
        asyncio.run(addon.request(local))
        assert json.loads(local.request.content)["enable_response_messages"] is True
        addon.done()


def test_responses_end_of_turn_token_gets_nan_logprob():
    """vLLM: a completed Responses answer ends with <|im_end|> in output_messages, without a logprob."""
    resp = json.loads(WIRE["resp_inj"])
    resp["status"], resp["incomplete_details"] = "completed", None
    resp["output_messages"][0]["tokens"].append(248046)
    parsed = openai_responses.parse_body(resp)
    n = len(parsed.completion_ids)
    assert len(parsed.completion_logprobs) == n and parsed.completion_logprobs[-1] != parsed.completion_logprobs[-1]
    assert parsed.completion_logprobs[:-1] == [lp["logprob"] for lp in resp["output"][0]["content"][0]["logprobs"]]


def test_a_responses_answer_one_logprob_short_keeps_none_and_says_so(tmp_path):
    """vLLM 0.32 streamed a Codex answer (finish length, 128 ids) with 127 logprobs, one token
    holding half a character: the row had no logprobs and said nothing (only build's count of
    tokens "sampled without logprob" showed it, among the rendered calls')."""
    from mitmproxy.http import Response

    resp = json.loads(WIRE["resp_inj"])
    assert resp["status"] == "incomplete"
    entries = resp["output"][0]["content"][0]["logprobs"]
    del entries[len(entries) // 2]
    with _configured_addon(tmp_path) as addon:
        f = _chat_flow({"model": "tiny", "input": "hi", "max_output_tokens": 16}, path="/v1/responses")
        addon.requestheaders(f)
        asyncio.run(addon.request(f))
        f.response = Response.make(200, json.dumps(resp).encode(), {"content-type": "application/json"})
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
        addon.done()
    (row,) = pq.read_table(next((tmp_path / "calls").glob("part-*.parquet"))).to_pylist()
    n = len(row["completion_token_ids"])
    assert row["status"] == "ok" and row["token_source"] == "server" and row["completion_logprobs"] == []
    assert row["error"] == f"logprobs not kept: the server gave {n - 1} for {n} completion ids"
    # with reasoning (or a tool call) vLLM scores the output text only: fewer logprobs is the rule
    # there, kept as none without a note (docs/capture.md), not a note on nearly every Codex row
    resp["output"].insert(0, {"type": "reasoning", "id": "rs_1", "summary": [],
                              "content": [{"type": "reasoning_text", "text": "think"}]})
    parsed = openai_responses.parse_body(resp)
    assert parsed.note is None and parsed.completion_logprobs is None


@pytest.mark.parametrize("body", [
    json.dumps({"model": "m", "messages": [], "stream": True}).encode(),
    json.dumps({"model": "m", "messages": []}).encode(),
    b"{not json", b"\xff\xfe{}", b"[1, 2]", b"",
])
def test_uninjected_requests_are_read_by_the_row_worker_with_the_same_verdict(tmp_path, body):
    """With nothing to inject, the proxy leaves the request unparsed (no JSON walk on the event
    loop); the row worker then finds what the proxy finds when it injects: the stream flag, or
    why the body is no request."""
    from mitmproxy.http import Response

    rows = {}
    for inject in (True, False):
        out = tmp_path / f"inject-{inject}"
        with _configured_addon(out, polar_inject=inject) as addon:
            f = _chat_flow({})
            f.request.content = body
            addon.requestheaders(f)
            asyncio.run(addon.request(f))
            state = addon.calls[f.id]
            if not inject:
                assert state.request_unread and state.request is None and state.request_error is None
                assert f.request.content == body  # as sent
            answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                   "finish_reason": "stop"}]}
            f.response = Response.make(200, json.dumps(answer).encode(), {"content-type": "application/json"})
            addon.responseheaders(f)
            asyncio.run(addon.response(f))
            addon.done()
        (rows[inject],) = pq.read_table(next((out / "calls").glob("part-*.parquet"))).to_pylist()
    assert (rows[False]["stream"], rows[False]["error"]) == (rows[True]["stream"], rows[True]["error"])
    assert rows[False]["stream"] is (b'"stream": true' in body)
    assert (rows[False]["error"] is None) is body.startswith(b'{"model"')
    assert rows[False]["request_json"] is None or json.loads(rows[False]["request_json"])["model"] == "m"


def test_int_list_takes_lists_of_ints_only():
    """Token ids are JSON integers: a bool, a float, a null or a nested list anywhere makes it no id list."""
    from polar_train.capture.parsed import int_list

    ids = [248045, 0, 9419]
    assert int_list(ids) == ids and int_list(ids) is not ids and int_list([]) == []
    for bad in ([1, True], [False], [1, 2.0], [1, None], [[1]], (1, 2), "12", None):
        assert int_list(bad) is None, bad


def test_without_strip_the_client_gets_the_server_bytes_and_the_row_is_the_same(tmp_path):
    """``polar_strip=false``: the request is injected as usual, every response byte reaches the
    client as the server sent it (the injected ids and logprobs included: no per-event work on the
    proxy's loop), and the row is what the stripping proxy records."""
    from mitmproxy.http import Headers, Response

    rows = {}
    for strip in (True, False):
        out = tmp_path / f"strip-{strip}"
        with _configured_addon(out, polar_strip=strip) as addon:
            body = {"model": "tiny", "input": "Hi", "stream": True, "instructions": "be brief"}
            f = _chat_flow(body, path="/v1/responses")
            addon.requestheaders(f)
            asyncio.run(addon.request(f))
            assert json.loads(f.request.content)["enable_response_messages"] is True  # injected either way
            f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
            addon.responseheaders(f)
            sent = WIRE["resp_inj_sse"].encode()
            got = b""
            for chunk in [sent[i:i + 100] for i in range(0, len(sent), 100)] + [b""]:
                part = f.response.stream(chunk)
                got += b"".join(part) if isinstance(part, list) else part
            if strip:
                assert b'"raw_message_tokens"' not in got
            else:
                assert got == sent
            asyncio.run(addon.response(f))

            plain = _chat_flow({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
            addon.requestheaders(plain)
            asyncio.run(addon.request(plain))
            answer = WIRE["chat_inj"].encode()
            plain.response = Response.make(200, answer, {"content-type": "application/json"})
            addon.responseheaders(plain)
            asyncio.run(addon.response(plain))
            assert (plain.response.content == answer) is (not strip)
            addon.done()
        rows[strip] = sorted(pq.read_table(next((out / "calls").glob("part-*.parquet"))).to_pylist(),
                             key=lambda r: r["api"])
    for a, b in zip(rows[True], rows[False], strict=True):
        assert a["token_source"] == b["token_source"] == "server" and a["status"] == b["status"] == "ok"
        for key in ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "response_json"):
            assert a[key] == b[key], key


def test_an_existing_output_folder_keeps_its_mode_and_what_is_created_is_private(tmp_path):
    """``polar_out=.`` (a repository), ``$HOME`` or a shared folder used to lose its mode (sticky bit
    and all) to 0700; only the folders the addon creates are the owner's alone."""
    from polar_train.capture.outdir import prepare_calls_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    prepare_calls_dir(shared / "calls")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE((shared / "calls").stat().st_mode) == 0o700
    prepare_calls_dir(tmp_path / "new" / "deeper" / "calls")
    for p in (tmp_path / "new", tmp_path / "new" / "deeper", tmp_path / "new" / "deeper" / "calls"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p


def test_a_streamed_messages_reply_keeps_the_thinking_signature_and_stop_sequence():
    """The stored response of a streamed Anthropic call is the reply as a whole one would read:
    the signature_delta events were dropped (the client got them)."""
    from polar_train.capture import anthropic_messages

    events = [
        ("message_start", {"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant",
                                                                "model": "tiny", "content": [], "usage": {"input_tokens": 3}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "signature_delta", "signature": "c2lnbmVk"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "e"},
                           "usage": {"output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    parsed = anthropic_messages.parse_stream(events, True)
    assert parsed.response["content"] == [{"type": "thinking", "thinking": "hmm", "signature": "c2lnbmVk"}]
    assert parsed.response["stop_reason"] == "stop_sequence" and parsed.response["stop_sequence"] == "e"
    assert parsed.stopped is False


@pytest.mark.parametrize("value,asked", [(True, True), (1, True), ("true", True), ("YES", True), ("1", True),
                                         (False, False), (0, False), ("false", False), (None, False), (2, False)])
def test_a_client_asks_for_ids_as_vllm_reads_the_field(value, asked):
    """`"return_token_ids": 1` or `"true"` asks the server for ids (pydantic's lax bool): the addon
    took only `true` as asking, and stripped the ids the client had asked for."""
    inj = openai_chat.inject({"messages": [], "return_token_ids": value, "logprobs": value})
    assert inj.asked == {"return_token_ids": asked, "logprobs": asked}
    assert inj.changed is (not asked and value != 2)  # (2 is no boolean: the server's 400 is left to it)
    resp = openai_responses.inject({"input": "x", "enable_response_messages": value})
    assert resp.asked["response_messages"] is asked


@pytest.mark.parametrize("api,body,kept", [
    ("chat", {"top_logprobs": 3}, {"logprobs"}),  # the server's 400: top_logprobs needs logprobs
    ("chat", {"top_logprobs": -1, "logprobs": False}, {"logprobs"}),
    ("chat", {"logprobs": "maybe"}, {"logprobs"}),
    ("chat", {"return_token_ids": "nope", "logprobs": []}, {"return_token_ids", "logprobs"}),
    ("responses", {"top_logprobs": 50}, {"include"}),  # unread without the include; refused with it
    ("responses", {"top_logprobs": -1}, {"include"}),
    ("responses", {"include": "message.output_text.logprobs"}, {"include"}),
    ("responses", {"include": {}}, {"include"}),
    ("responses", {"enable_response_messages": "nope"}, {"enable_response_messages"}),
    ("responses", {"enable_response_messages": None}, {"enable_response_messages"}),  # (not an Optional field)
    ("responses", {"top_logprobs": 10}, {"include"}),  # (past a server's --max-logprobs 5: refused once read)
    ("chat", {"logprob_token_ids": [1, 2]}, {"logprobs"}),  # vLLM's 400: logprob_token_ids needs logprobs
])
def test_the_capture_never_changes_whether_a_request_is_refused(api, body, kept):
    """A probe: through the proxy, top_logprobs 50 on /v1/responses got a 400 the server alone never
    gave (the injected include made it read the value), and chat's top_logprobs without logprobs or
    "logprobs": "maybe" got a 200 recorded ok where the server alone answered 400."""
    module, base = ((openai_chat, {"messages": []}) if api == "chat" else (openai_responses, {"input": "x"}))
    inj = module.inject({**base, **body})
    for field in kept:
        assert inj.body.get(field, "absent") == body.get(field, "absent")
    if api == "responses":  # top_logprobs 0 (any server takes it) keeps the include (and the logprobs) asked
        assert openai_responses.inject({"input": "x", "top_logprobs": 0}).body["include"] == [
            openai_responses.LOGPROBS_INCLUDE]
    else:
        assert openai_chat.inject({"messages": [], "top_logprobs": 0}).body["logprobs"] is True


def test_a_responses_top_logprobs_without_the_include_is_echoed_null():
    """A probe: "top_logprobs": 0 sent without the logprobs include is echoed null by vLLM (it
    samples without logprobs); through the proxy, which asked for them, the client got 0."""
    inj = openai_responses.inject({"input": "x", "top_logprobs": 0})
    response = {"object": "response", "top_logprobs": 0, "output": []}
    openai_responses.strip(response, inj.asked)
    assert response["top_logprobs"] is None
    asked = openai_responses.inject({"input": "x", "top_logprobs": 2, "include": [openai_responses.LOGPROBS_INCLUDE]})
    response = {"object": "response", "top_logprobs": 2, "output": []}
    openai_responses.strip(response, asked.asked)
    assert response["top_logprobs"] == 2
    # the include asked with "top_logprobs": null: vLLM reads and echoes 0 (it was made null)
    asked = openai_responses.inject({"input": "x", "top_logprobs": None, "include": [openai_responses.LOGPROBS_INCLUDE]})
    response = {"object": "response", "top_logprobs": 0, "output": []}
    openai_responses.strip(response, asked.asked)
    assert response["top_logprobs"] == 0


@pytest.mark.parametrize("value,read", [(2, 2), ("1", 1), (1.0, 1), ("2.0", 2), (True, 1), (None, None),
                                        ("x", None), ("--1", None)])
def test_a_responses_top_logprobs_is_read_as_the_server_reads_it(value, read):
    """`"top_logprobs": "1"` was overwritten with 0: the client got no top logprobs it had asked
    for; `"--1"` raised in the request hook. A value the server refuses is left for it to refuse."""
    inj = openai_responses.inject({"input": "x", "top_logprobs": value})
    assert inj.body["top_logprobs"] == (0 if value is None else value)
    if read is not None:
        assert inj.asked["top_logprobs"] == read  # compared with the server's echo (an int)


def test_a_stream_field_of_true_text_is_recorded_as_streamed():
    state = _state(request_body=b'{"model": "m", "stream": "true", "messages": []}')
    state.request_unread = True
    assert state.request_object() is not None and state.stream is True


def test_with_proxyauth_a_tunnels_user_stays_below_the_requests_own_header(tmp_path):
    """mitmproxy's proxyauth copies a tunnel's checked credentials into every request of it: taken
    for the request's own, they outranked its x-polar-rollout header."""
    from mitmproxy.addons.proxyauth import ProxyAuth
    from mitmproxy.test import taddons, tflow

    mod = _load_addon()
    addon, auth = mod.PolarCapture(), ProxyAuth()
    with taddons.context(auth, addon) as tctx:
        tctx.configure(auth, proxyauth="any")
        tctx.configure(addon, polar_out=str(tmp_path))
        connect = tflow.tflow()
        connect.request.method = "CONNECT"
        connect.request.headers["proxy-authorization"] = _basic("tunnel-rollout", "pw-secret")
        auth.http_connect(connect)
        addon.http_connect(connect)
        assert "proxy-authorization" not in connect.request.headers  # proxyauth took it
        states = []
        for header in ("header-rollout", None):
            f = _chat_flow({"model": "tiny", "messages": []})
            f.client_conn = connect.client_conn
            if header:
                f.request.headers["x-polar-rollout"] = header
            auth.requestheaders(f)
            addon.requestheaders(f)
            states.append(record.resolve_head(addon.calls[f.id], "x-polar-rollout", "x-polar-task", {}))
        assert [s.identity.rollout_id for s in states] == ["header-rollout", "tunnel-rollout"]
        assert "pw-secret" in states[1].secrets
        addon.done()


def test_a_refused_id_from_an_api_key_is_not_logged(caplog):
    """The key `polar-<id>` is a secret: a refused id (too long) was logged with 80 characters of it."""
    caplog.set_level(logging.WARNING, logger="polar_capture")
    key = "polar-" + "K" * 600
    ident = resolve_identity(_view({"authorization": f"Bearer {key}"}), None, None, "x-polar-rollout", "", {})
    assert ident.rollout_id is None and "refused" in caplog.text and "KKKK" not in caplog.text


def test_scrubbed_json_with_an_escaped_lone_surrogate_stays_storable():
    """JSON.stringify escapes a lone surrogate ("\\ud83d"): re-dumped unescaped, the row's text could
    not be encoded as UTF-8 and the call lost its ids, request and response."""
    from polar_train.capture.redact import scrub_json

    out = scrub_json('{"x":"\\ud83d","k":"sk-ab/cd1234"}', {"sk-ab/cd1234"}, compact)
    out.encode("utf-8")
    assert json.loads(out) == {"x": "\ud83d", "k": REDACTED}


def test_header_options_must_name_a_header_and_counts_are_no_booleans(tmp_path):
    """`polar_rollout_header=x-polar-rollout:` (copied from curl -H) matched no header: every call
    lost its rollout and the real header went on to the upstream. YAML's `true` passed as 1 row."""
    from mitmproxy import exceptions

    with _configured_addon(tmp_path) as addon:
        from mitmproxy import ctx

        addon.running()
        for options, message in (({"polar_rollout_header": "x-polar-rollout:"}, "is not a header name"),
                                 ({"polar_task_header": "bad header"}, "is not a header name"),
                                 ({"polar_rollout_header": "Host"}, "a header requests need for themselves"),
                                 ({"polar_task_header": "X-Polar-Rollout"}, "both are 'x-polar-rollout'"),
                                 ({"polar_flush_rows": True}, "polar_flush_rows: expected a whole number, got true")):
            with pytest.raises(exceptions.OptionsError, match=message):
                ctx.options.update(**options)
        ctx.options.update(polar_rollout_header=" X-Run-Id ")
        assert addon.opts.rollout_header == "x-run-id"
        addon.done()


def test_in_reverse_mode_proxyauths_user_ranks_below_the_rollout_header(tmp_path):
    """Reverse mode: proxyauth checks (and removes) the request's Authorization. Its user was taken
    for per-request proxy credentials, above x-polar-rollout and the API key; SOCKS5 likewise (its
    credentials are per connection). Now it ranks as a tunnel's credentials do."""
    from mitmproxy.addons.proxyauth import ProxyAuth
    from mitmproxy.proxy.mode_specs import ProxyMode
    from mitmproxy.test import taddons

    mod = _load_addon()
    addon, auth = mod.PolarCapture(), ProxyAuth()
    with taddons.context(auth, addon) as tctx:
        tctx.configure(auth, proxyauth="any", mode=["reverse:http://127.0.0.1:8000"])
        tctx.configure(addon, polar_out=str(tmp_path))
        got = []
        for header in ("header-rollout", None):
            f = _chat_flow({"model": "tiny", "messages": []})
            f.client_conn.proxy_mode = ProxyMode.parse("reverse:http://127.0.0.1:8000")
            f.request.headers["authorization"] = _basic("auth-user", "pw-secret")
            if header:
                f.request.headers["x-polar-rollout"] = header
            auth.requestheaders(f)
            addon.requestheaders(f)
            state = record.resolve_head(addon.calls[f.id], "x-polar-rollout", "x-polar-task", {})
            got.append((state.identity.rollout_id, "pw-secret" in state.secrets))
        assert got == [("header-rollout", True), ("auth-user", True)]
        addon.done()


def test_the_tokenize_check_goes_straight_to_the_upstream_and_says_why_it_could_not_run(monkeypatch):
    """An HTTP_PROXY in mitmdump's environment failed every /tokenize check, and the row did not say
    why (a warning per call in the log)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from polar_train.capture.render import server_tokenize

    class Tokenize(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            body = b'{"tokens": [1, 2, 3], "count": 3}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Tokenize)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert server_tokenize(f"http://127.0.0.1:{server.server_port}", "m", [{"role": "user", "content": "x"}],
                               None) == [1, 2, 3]
    finally:
        server.shutdown()


def test_a_prompt_the_template_refuses_is_said_once_without_a_traceback(caplog, tiny_model_dir):
    """`"messages": []` to a server that answers anyway: the renderer refuses it; that was a
    traceback in the log per call."""
    from polar_train.capture.render import Renderer

    caplog.set_level(logging.WARNING, logger="polar_capture")
    renderer = Renderer(str(tiny_model_dir))
    rows = []
    for _ in range(2):
        state = _state(request_body=b'{"model": "m", "messages": []}', api="openai.chat", request_unread=True)
        state.response_body = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()
        state.http_status = 200
        rows.append(record.build_row(state, renderer))
    assert all(r["status"] == "ok" and "token ids unavailable" in r["error"] for r in rows)
    assert "Traceback" not in caplog.text and caplog.text.count("could not be rendered") == 1


def test_an_existing_calls_folder_that_cannot_be_written_is_refused_at_start(tmp_path, monkeypatch):
    """A read-only polar_out whose calls/ exists passed the mkdir: the proxy served, kept rows in
    memory and lost them at shutdown. A write check refuses it at start (one line)."""
    import errno

    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    from polar_train.capture import outdir

    (tmp_path / "calls").mkdir()
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if ".polar-write-check" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(outdir.os, "open", read_only)
    with pytest.raises(OSError, match="Read-only"):
        outdir.prepare_calls_dir(tmp_path / "calls")
    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        addon.running()  # a change while running is refused with the reason
        with pytest.raises(exceptions.OptionsError, match=r"polar_out: cannot write to .*Read-only file system"):
            tctx.configure(addon, polar_out=str(tmp_path))
    assert list((tmp_path / "calls").iterdir()) == []


def test_the_all_interfaces_warning_reads_each_modes_own_host(tmp_path, caplog):
    """`--listen-host 127.0.0.1 --mode regular@0.0.0.0:8088` listened on every interface without a
    word, and a mode bound to 127.0.0.1 without --listen-host was warned about."""
    from mitmproxy.test import taddons

    caplog.set_level(logging.WARNING, logger="polar_capture")
    for modes, host, warned in ((["regular@0.0.0.0:18088"], "127.0.0.1", True),
                                (["regular@127.0.0.1:18088"], "", False),
                                (["regular@18088"], "", True)):
        caplog.clear()
        addon = _load_addon().PolarCapture()
        with taddons.context(addon) as tctx:
            try:
                tctx.configure(addon, polar_out=str(tmp_path), mode=modes, listen_host=host)
                addon.running()
                assert ("listens on all interfaces" in caplog.text) is warned, (modes, host)
                addon.done()
            finally:  # the next context's log handler, not this one's (its loop is closed then)
                tctx.master._legacy_log_events.uninstall()


#: The forward form of the secret-key scan (what redact searched before it read the text reversed):
#: the reference the fast scan must agree with.
_FORWARD_SECRET_KEY = (b'(?:"(?:' + b"|".join(re.escape(k.encode()) for k in sorted(SECRET_KEYS)) + b')|(?:'
                       + b"|".join(re.escape(k.encode()) for k in SECRET_KEY_SUFFIXES) + b'))\\\\*"')
_KEY_PIECES = st.sampled_from(sorted(SECRET_KEYS) + list(SECRET_KEY_SUFFIXES)
                              + ["my", "_", "-", "key", "token", "x", '"', "\\", ":", " ", "\n", "{", "}", ","])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_KEY_PIECES, st.text(max_size=4)), max_size=12))
@example(['{', '"', 'api_key', '"', ':', '1}'])  # a whole key, compact
@example(['{', '"', 'token', '"', ' ', '\n', ':', '1}'])  # a whole key, spaced
@example(['{"openai', 'api_key', '" :1}'])  # a suffix, spaced
@example(['{"', 'x', '\\', '"', 'password', '":1}'])  # an escaped quote before a suffix
def test_the_reversed_secret_key_scan_agrees_with_the_forward_one(pieces):
    """redact reads lower-cased JSON reversed (a fixed first byte: 3.5 ms -> ~0.1 ms per 100 KB);
    it must find a secret key exactly where the forward pattern does, spaced or compact."""
    data = "".join(pieces).lower().encode("utf-8", "surrogatepass")
    assert has_secret_key(data) == (re.search(_FORWARD_SECRET_KEY + b":", data) is not None)
    assert has_secret_key(data, spaced=True) == (
        re.search(_FORWARD_SECRET_KEY + b"[ \t\n\r]*:", data) is not None)


@pytest.mark.parametrize("body, streams", [
    (b'{"stream":true}', True), (b'{"model": "m", "stream" : "true"}', True), (b'"stream":true', True),
    (b'{"stream": false}', False), (b'{"x": "say \\"stream\\": true"}', False),  # inside a string: escaped
    (b'{"x": "\\"stream\\": true", "stream": true}', True),  # an escaped one first, the key after it
    (b'{"my \\"stream": true}', False),  # a key that only ends in an escaped "stream"
    (b'{"messages": [' + b'{"role": "user", "content": "abc"},' * 3000 + b'{}], "stream": true}', True),
])
def test_the_proxys_stream_hint_finds_the_key_and_not_text_in_a_string(body, streams):
    """The proxy reads ``stream`` off an uninjected request's bytes (Claude Code puts it last); the
    pattern starts with its literal (a look-behind first made re try every byte on the event loop)."""
    addon = _load_addon()
    assert addon._stream_true(body) is streams
    assert addon._STREAM_TRUE.pattern.startswith(b'"stream"')


def test_the_harness_checks_probe_is_marked_and_never_leaves_the_proxy(tmp_path):
    """``polar-train harness`` tells the capture proxy from a model server on its port by a probe
    header on its GET /v1/models: the addon removes it before the request leaves and marks the
    answer; any other answer, and a model call that carries the header, gets no mark."""
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import tflow, tutils

    from polar_train.capture.identity import CAPTURE_MARK, PROBE_HEADER

    with _configured_addon(tmp_path) as addon:
        probe = tflow.tflow(req=tutils.treq(method=b"GET", path=b"/v1/models",
                                            headers=((PROBE_HEADER.encode(), b"1"), (b"accept", b"application/json"))))
        plain = tflow.tflow(req=tutils.treq(method=b"GET", path=b"/v1/models"))
        call = _chat_flow({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        call.request.headers[PROBE_HEADER] = "1"
        for flow in (probe, plain, call):
            addon.requestheaders(flow)
            assert PROBE_HEADER not in flow.request.headers  # the upstream never sees it
            asyncio.run(addon.request(flow))
            flow.response = Response.make(200, b"{}", Headers(content_type="application/json"))
            addon.responseheaders(flow)
        assert probe.request.headers["accept"] == "application/json"
        assert probe.response.headers.get(CAPTURE_MARK) == "regular"  # the listening mode (tflow's client: regular)
        assert CAPTURE_MARK not in plain.response.headers and CAPTURE_MARK not in call.response.headers
        addon.done()


def test_every_refused_identity_is_said_once_and_control_characters_are_refused_before_trimming(
        caplog, monkeypatch):
    """A proxy user "\\r\\ninj" was kept as "inj" (the spaces went first, then nothing was left to
    refuse); an empty header, proxy credentials that are not Basic base64 of UTF-8, went without a
    word; a bad value sent as both rollout and task was said for the task only."""
    from polar_train.capture import identity

    caplog.set_level(logging.WARNING, logger="polar_capture")

    def resolve(headers: dict[str, str], connect: str | None = None):
        return resolve_identity(_view(headers), connect, None, "x-polar-rollout", "x-polar-task", {})

    assert resolve({}, _basic("\r\ninj", "pw")).rollout_id is None
    assert resolve({"x-polar-rollout": "\tr1"}).rollout_id is None
    assert resolve({"x-polar-rollout": " r1 "}).rollout_id == "r1"  # plain spaces are trimmed, as documented
    assert resolve({"x-polar-rollout": ""}).rollout_id is None
    assert resolve({}, "Basic !!!").source == "none"
    assert resolve({}, "Basic " + base64.b64encode(b"caf\xe9:x").decode()).source == "none"
    assert resolve({}, "Bearer abc").source == "none"
    both = resolve({"x-polar-rollout": "bad\x01", "x-polar-task": "bad\x01"})
    assert both.rollout_id is None and both.task_id is None
    text = caplog.text
    for said in ("rollout id '\\r\\ninj' refused (holds a control character", "rollout id '\\tr1' refused",
                 "rollout id '' refused (empty)", "proxy credentials not base64", "proxy credentials not UTF-8",
                 "proxy credentials of scheme 'Bearer', not Basic", "rollout id 'bad\\x01' refused",
                 "task id 'bad\\x01' refused"):
        assert text.count(said) == 1, said
    assert "abc" not in text and "caf" not in text  # a credential's token is never logged
    secret = base64.b64encode(b"r1:hunter2-very-secret").decode()
    for credential, said in ((secret, "without a Basic credential"), (f"Basic\t{secret}", "without a Basic credential"),
                             (f"hunter2 {secret}", "without a Basic credential"),  # no scheme: all of it is secret
                             ("Basic " + base64.b64encode(b"sk-live-" + b"A" * 600).decode(), "not user:password"),
                             ("Basic " + base64.b64encode(b"sk-secret\x01xyz").decode(), "not user:password")):
        identity._refused_said.clear()  # each case says its own line
        caplog.clear()
        assert resolve({}, credential).source == "none"
        assert f"proxy credentials {said}" in caplog.text, credential
        assert not any(part in caplog.text for part in (secret[:6], "hunter2", "sk-", "AAAA")), caplog.text
    resolve({"x-polar-rollout": ""})
    assert caplog.text.count("rollout id '' refused (empty)") == 1  # once


def test_a_replayed_request_is_a_call_of_its_own(tmp_path):
    """Client replay (``-C``, mitmweb's Replay) sends a flow again under its own flow id: the row had
    the first call's id, and inspect and build dropped one of the two as a copy."""
    with _configured_addon(tmp_path) as addon:
        f = _chat_flow({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        addon.requestheaders(f)
        first = addon.calls.pop(f.id).call_id
        f.is_replay = "request"
        addon.requestheaders(f)
        again = addon.calls.pop(f.id).call_id
    assert first == f.id.replace("-", "") and again != first and len(again) == 32


def test_settings_that_hide_or_change_calls_are_named():
    from types import SimpleNamespace

    from polar_train.capture.blind_spots import blind_spots

    plain = SimpleNamespace(mode=["regular"], modify_body=[], rfile=None, proxyauth=None)
    assert blind_spots(plain) == []
    notes = blind_spots(SimpleNamespace(
        mode=["regular@8080", "reverse:tcp://h:1@9000", "reverse:http://h:1@9001", "dns@53", "socks5@1080"],
        modify_body=["|~q|a|b"], modify_headers=["|~q|h|v"], map_local=["|~q|/x|f"], intercept="~u chat",
        rfile="saved.flows", ignore_hosts=["example"], allow_hosts=[], proxyauth=None,
        server_replay=["s.flows"], client_replay=["c.flows"]))
    assert [n.split(":", 1)[0] for n in notes] == [
        "modify_body (1 rule(s)), modify_headers (1 rule(s)), intercept (~u chat", "map_local", "server_replay",
        "client_replay", "rfile", "ignore_hosts", "mode reverse", "mode socks5 without proxyauth"]
    assert "says in its error when the body or server changed" in notes[0] and "not recorded" in notes[4]
    assert notes[6] == ("mode reverse:tcp://h:1@9000, dns@53: traffic passes as raw bytes there and is not "
                        "recorded")  # (reverse:http:// is read: no note)
    socks = SimpleNamespace(mode=["socks5@1080"], proxyauth="any")
    assert blind_spots(socks) == []  # credentials read with proxyauth
    # a change while running: only the notes of what changed
    assert [n.split(":", 1)[0] for n in blind_spots(SimpleNamespace(mode=["regular"], map_remote=["|a|b"],
                                                                    rfile="x"), only={"map_remote"})] == [
        "map_remote (1 rule(s))"]


@pytest.mark.parametrize("change", ["body", "server"])
def test_a_request_a_later_addon_changed_says_so_in_its_row(tmp_path, change):
    """mitmproxy's modify_body / map_remote / an intercept edit run after the addon read the request:
    its row held the client's request as what the server saw, without a word (a probe)."""
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import taddons

    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path), polar_flush_seconds="0.1")

        async def run(changed: bool):
            f = _chat_flow({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True})
            addon.requestheaders(f)
            await addon.request(f)
            if changed and change == "body":  # as modify_body '|~q|Hi|HELLO' does
                f.request.content = f.request.content.replace(b'"Hi"', b'"HELLO"')
            elif changed:  # as map_remote does
                f.request.host = "10.0.0.9"
            f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
            addon.responseheaders(f)
            f.response.stream(WIRE["chat_inj_sse"].encode())
            f.response.stream(b"")
            await addon.response(f)

        asyncio.run(run(False))
        asyncio.run(run(True))
        addon.done()
    rows = [r for part in sorted((tmp_path / "calls").glob("part-*.parquet")) for r in pq.read_table(part).to_pylist()]
    plain, changed = sorted(rows, key=lambda r: r["started_at"])
    assert plain["error"] is None and plain["status"] == "ok"
    assert changed["status"] == "ok" and changed["token_source"] == "server"  # the server's own ids stand
    said = "body" if change == "body" else "server (address:22 became 10.0.0.9:22)"  # (tflow's host)
    assert changed["error"].startswith(f"the request's {said} changed after the capture read it")


def test_a_new_polar_out_while_running_is_said(tmp_path, caplog):
    """mitmweb's options (or a config.yaml reload) can move the output while the proxy runs: the
    calls went to the new folder without a word of where."""
    from mitmproxy.test import taddons

    caplog.set_level(logging.INFO, logger="polar_capture")
    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path / "a"))
        addon._running = True  # (as after the running hook)
        tctx.configure(addon, polar_out=str(tmp_path / "b"))
        addon.done()
    assert f"polar_capture: writing calls to {tmp_path / 'b' / 'calls'}" in caplog.text


@pytest.mark.parametrize("marker, what", [("_build_report.json", "polar-train build --out"),
                                          (".polar-train-run", "polar-train train --output")])
def test_a_polar_out_that_is_a_build_or_run_folder_is_refused(tmp_path, marker, what, caplog):
    """data/trajectories for data/captures: the parts landed in the build's folder, and train (a
    capture's call log) and a rebuild (Parquet no build wrote) refused it after (a probe)."""
    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    out = tmp_path / "traj"
    out.mkdir()
    (out / marker).write_text("{}")
    said = (f"polar_out: {out} is a `{what}` folder (it holds {marker}): captures need a folder of their own "
            "(e.g. data/captures)")
    addon = _load_addon().PolarCapture()
    with taddons.context(addon) as tctx:
        with caplog.at_level(logging.ERROR, logger="polar_capture"):  # at startup: one line, mitmdump exits
            tctx.configure(addon, polar_out=str(out))
        assert f"polar_capture: {said}" in caplog.text and addon.writer is None
        tctx.configure(addon, polar_out=str(tmp_path / "captures"))
        addon.running()
        with pytest.raises(exceptions.OptionsError) as err:  # while running: refused, the old folder kept
            tctx.configure(addon, polar_out=str(out))
        assert str(err.value) == said
        addon.done()
    assert sorted(p.name for p in out.iterdir()) == [marker]


def test_a_copy_of_the_addon_without_polar_train_says_how_to_run_it(tmp_path):
    """A copy of the addon file run by a mitmdump whose Python lacks polar_train: a bare
    ``No module named 'polar_train'`` that named no way out."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "polar_capture.py"
    shutil.copy(REPO / "addons" / "polar_capture.py", copy)
    script = ("import runpy, sys\nsys.modules['polar_train'] = None  # not importable here\n"
              f"runpy.run_path({str(copy)!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ModuleNotFoundError: polar_capture: the polar_train package is not importable by this mitmdump "
        f"({sys.executable}) nor found above {tmp_path}: run the mitmdump of the environment polar-train is "
        "installed in, with the addon it ships (mitmdump -s \"$(polar-train addon)\")")


def test_rows_a_writer_lost_leave_a_record_that_inspect_and_build_name(tmp_path, monkeypatch):
    """A disk full at shutdown ("12 rows lost at shutdown") and a full queue ("27 of 48 calls
    dropped") were said in the proxy's log only, mitmdump exited 0, and inspect/build showed the
    calls that were left as if they were all: a loss record beside the parts says so."""
    import errno
    import subprocess
    import sys

    from polar_train.calllog import loss_notes, read_call_log
    from polar_train.trajectories import BuildOptions, build_trajectories

    kept = PartWriter(tmp_path, flush_rows=1, flush_seconds=3600)  # a part that was written
    kept.start()
    kept.submit(lambda: _row(9))
    kept.close()
    assert not list((tmp_path / "calls").glob("_losses-*"))  # nothing lost: no record
    w = PartWriter(tmp_path, flush_rows=1000, flush_seconds=3600)
    w.start()
    w.submit(lambda: _row(0))
    w.submit(lambda: 1 / 0)

    def disk_full(rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(w, "_write_part", disk_full)
    w.close()
    (record_file,) = (tmp_path / "calls").glob("_losses-*.json")
    assert json.loads(record_file.read_text())["rows_lost"] == 1
    note = (f"{record_file}: the capture process {os.getpid()} lost 1 row(s) whose part could not be written, "
            "1 row(s) whose building failed: No space left on device; its log has the details (these calls are in "
            "no part)")
    assert loss_notes(tmp_path, read_call_log(tmp_path).parts) == [note]
    assert build_trajectories(tmp_path, BuildOptions()).report.notes == [note]
    proc = subprocess.run([sys.executable, "-m", "polar_train", "inspect", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert f"note: {note}" in proc.stdout, proc.stdout + proc.stderr


def test_a_damaged_loss_record_is_named_and_a_reason_said_once(tmp_path):
    """A probe: a truncated, empty or odd loss record (a crash right after a loss) was skipped without
    a word - the one fact the user needed; and a queue-full record said its reason twice."""
    from polar_train.calllog import loss_notes
    from polar_train.capture.outdir import record_loss

    calls = tmp_path / "calls"
    calls.mkdir()
    record_loss(calls, calls_dropped=180, why="row worker queue full")
    (record,) = calls.glob("_losses-*.json")
    assert loss_notes(tmp_path, []) == [
        f"{record}: the capture process {os.getpid()} lost 180 call(s) dropped (row worker queue full); its log "
        "has the details (these calls are in no part)"]
    record.unlink()
    for name, text in (("a", '{"pid": 1, "calls_dr'), ("b", ""), ("c", "[1, 2]"), ("d", '{"calls_dropped": "x"}')):
        (calls / f"_losses-{name}.json").write_text(text)
    notes = loss_notes(tmp_path, [])
    assert len(notes) == 4 and all("a loss record that cannot be read (damaged or empty)" in n for n in notes)


def test_rows_of_a_part_that_failed_otherwise_than_on_the_disk_are_counted(tmp_path, monkeypatch):
    """Under a memory limit pyarrow raised ArrowMemoryError writing a part: only OSError kept the
    rows or counted them, so 16 calls were in no part while the loss record said 0 rows lost."""
    import pyarrow as pa

    from polar_train.calllog import loss_notes

    w = PartWriter(tmp_path, flush_rows=1000, flush_seconds=3600)
    w.start()
    for k in range(5):
        w.submit(lambda k=k: _row(k))
    tries = []

    def short_of_memory(rows):
        tries.append(len(rows))
        raise pa.ArrowMemoryError("malloc of size 4096 failed")

    monkeypatch.setattr(w, "_write_part", short_of_memory)
    w.close()
    assert w.lost_rows == 5 and tries == [5]
    (record_file,) = (tmp_path / "calls").glob("_losses-*.json")
    assert json.loads(record_file.read_text())["rows_lost"] == 5
    assert "malloc of size 4096 failed" in loss_notes(tmp_path, [])[0]
    # a failure that is no shortage (a bug of ours) loses the rows too: counted, and the reason kept
    # (the review: the next part that could be written said the lost rows were "kept" and written,
    # and the record lost its reason)
    w = PartWriter(tmp_path / "bug", flush_rows=2, flush_seconds=3600)
    w.start()
    real_write, failures = w._write_part, [True]
    monkeypatch.setattr(w, "_write_part", lambda rows: 1 / 0 if failures and failures.pop() else real_write(rows))
    for k in range(4):
        w.submit(lambda k=k: _row(k))
    w.close()
    assert w.lost_rows == 2 and len(list((tmp_path / "bug" / "calls").glob("part-*.parquet"))) == 1
    (record_file,) = (tmp_path / "bug" / "calls").glob("_losses-*.json")
    assert json.loads(record_file.read_text())["rows_lost"] == 2
    assert "ZeroDivisionError: division by zero" in loss_notes(tmp_path / "bug", [])[0]


def test_a_build_of_unreadable_parts_names_the_part_not_a_note(tmp_path):
    """The review: with a note on the input (a loss record here) a build whose parts were all
    unreadable said "skipped <the note>" instead of the part it skipped."""
    import subprocess
    import sys

    from polar_train.capture.outdir import record_loss

    calls = tmp_path / "cap" / "calls"
    calls.mkdir(parents=True)
    (calls / "part-1.parquet").write_bytes(b"PAR1 cut short")
    record_loss(calls, calls_dropped=3, why="row worker queue full")
    proc = subprocess.run([sys.executable, "-m", "polar_train", "build", str(tmp_path / "cap"), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"polar-train build: error: no readable call-log part in {tmp_path / 'cap'}; "
                                          f"skipped {calls / 'part-1.parquet'}: not a readable Parquet file"), proc.stderr


def test_the_live_lock_follows_the_folder_the_capture_writes_to(tmp_path):
    """The review: an flock goes with the file, so a calls/ moved away to archive it stayed
    "being written" while the proxy ran. The lock is taken again where the capture writes now."""
    from polar_train.calllog import live_writers
    from polar_train.capture.outdir import LiveLock

    calls = tmp_path / "cap" / "calls"
    calls.mkdir(parents=True)
    lock = LiveLock(calls)
    lock.refresh()
    assert live_writers(tmp_path / "cap", []) == [(calls, [os.getpid()])]
    archive = tmp_path / "day1"
    calls.rename(archive)
    lock.refresh()  # the next call: the folder is gone, nothing to hold
    assert live_writers(archive, []) == [] and live_writers(tmp_path / "cap", []) == []
    calls.mkdir()  # the writer makes it again for its next part
    lock.refresh()
    assert live_writers(tmp_path / "cap", []) == [(calls, [os.getpid()])] and live_writers(archive, []) == []
    lock.release()
    assert live_writers(tmp_path / "cap", []) == []
    lock.refresh()  # a writer thread still running after its close released the lock: takes nothing
    assert live_writers(tmp_path / "cap", []) == []


def test_an_idle_writer_lets_go_of_an_archived_calls_folder(tmp_path):
    """A probe: calls/ moved away to archive it while the proxy ran idle - inspect and build of the
    archive said "a capture proxy is writing into" it until the proxy's next call. The writer (and
    the proxy's sender) look at their lock every second, with or without calls."""
    from polar_train.calllog import live_writers

    w = PartWriter(tmp_path / "cap", flush_rows=1000, flush_seconds=3600)
    w.start()
    w.submit(lambda: _row(1))  # a row held in memory (flushed an hour later): still idle
    calls = tmp_path / "cap" / "calls"
    deadline = time.monotonic() + 10
    while not live_writers(tmp_path / "cap", []) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the lock, with a deadline
    assert live_writers(tmp_path / "cap", []) == [(calls, [os.getpid()])]
    archive = tmp_path / "day1"
    archive.mkdir()
    calls.rename(archive / "calls")
    deadline = time.monotonic() + 10
    while live_writers(archive, []) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the release, with a deadline
    assert live_writers(archive, []) == []
    w.close()
    assert [pq.read_metadata(p).num_rows for p in calls.glob("part-*.parquet")] == [1]  # written where it writes now


def test_a_proxy_writing_into_a_deeper_folder_without_a_part_yet_is_seen(tmp_path):
    """A team folder whose own calls/ holds parts, and machine B's proxy just started writing into
    team/machine-b/calls (no part yet): the live note looked only where parts were, and at
    team/calls, and said nothing."""
    from polar_train.calllog import live_writers
    from polar_train.capture.outdir import LiveLock
    from tests.support.calls import make_row, write_parts

    part = write_parts(tmp_path / "team", [make_row(call_id="c1", prompt_ids=[1], completion_ids=[2])])
    calls_b = tmp_path / "team" / "machine-b" / "calls"
    calls_b.mkdir(parents=True)
    lock = LiveLock(calls_b)
    lock.refresh()
    try:
        assert live_writers(tmp_path / "team", [part]) == [(calls_b, [os.getpid()])]
    finally:
        lock.release()
    assert live_writers(tmp_path / "team", [part]) == []


def test_a_capture_that_lost_every_row_says_so_where_it_has_no_part(tmp_path):
    """The verification of the loss records: a disk full at the stop left no part, only the
    record, and inspect/build said "no call-log parts ...: wait, or stop mitmdump" - the proxy
    had stopped, and its 12 lost rows went unsaid."""
    from polar_train.calllog import CallLogError, read_call_log
    from polar_train.capture.outdir import record_loss

    calls = tmp_path / "calls"
    calls.mkdir()
    record_loss(calls, rows_lost=12, why="No space left on device")
    with pytest.raises(CallLogError, match=re.escape(f"no call-log parts (*.parquet) in {calls}; {calls}/_losses-")
                       + r".*: the capture process \d+ lost 12 row\(s\) whose part could not be written: No space "
                         r"left on device; its log has the details \(these calls are in no part\)$"):
        read_call_log(tmp_path)


def test_the_proxys_log_lines_stay_one_line_each(caplog):
    """A capture folder named with a newline split "writing calls to" in two, the second line without
    its time stamp (inspect and build escape such names); a reloaded addon adds no second filter."""
    import logging

    from polar_train.terminal import one_line_records

    logger = logging.getLogger("polar_capture.test-one-line")
    one_line_records(logger)
    one_line_records(logger)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("polar_capture: writing calls to %s", "/tmp/n\nl/calls")
        logger.info("plain %d", 5)
    assert [r.getMessage() for r in caplog.records] == ["polar_capture: writing calls to /tmp/n\\nl/calls", "plain 5"]
