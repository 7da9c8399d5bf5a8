"""Fuzz the three wire-format parsers through the stream tap and the row builder.

Streams are built in the shapes vLLM 0.32 sends (``shared/vllm-0.32-wire``: chat chunks with
``token_ids`` and ``logprobs``, responses events with ``output_messages`` in
``response.completed``, Anthropic content-block deltas), with hypothesis drawing the text, the
token ids, the logprobs and where the TCP reads cut the stream. Asserted: the call-log row is the
same whatever the cuts, and it holds exactly the text and ids that were sent.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polar_train.capture import anthropic_messages, openai_chat, openai_responses
from polar_train.capture.identity import Identity
from polar_train.capture.record import CallState, build_row
from polar_train.capture.tap import StreamTap

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOLATILE = ("call_id", "started_at", "first_byte_at", "finished_at")

text_pieces = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8),
                       min_size=1, max_size=12)
token = st.integers(0, 248_000)
logprob = st.floats(-30, 0, allow_nan=False, width=32)


def sse(obj, event: str | None = None, nl: bytes = b"\n") -> bytes:
    head = b"event: " + event.encode() + nl if event else b""
    return head + b"data: " + json.dumps(obj, ensure_ascii=False).encode() + nl + nl


def chat_stream(pieces, ids, lps, prompt_ids) -> bytes:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    out = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}],
                "prompt_token_ids": prompt_ids, "prompt_text": None})]
    for i, (p, t, lp) in enumerate(zip(pieces, ids, lps)):
        last = i == len(pieces) - 1
        out.append(sse({**base, "choices": [{
            "index": 0, "delta": {"content": p},
            "logprobs": {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}]},
            "finish_reason": "stop" if last else None, "token_ids": [t]}]}))
    out.append(sse({**base, "choices": [], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                                                     "total_tokens": len(prompt_ids) + len(ids)}}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def responses_stream(pieces, ids, lps, prompt_ids) -> bytes:
    resp = {"id": "resp_1", "object": "response", "model": "tiny", "status": "in_progress", "output": [],
            "top_logprobs": 0, "input_messages": None, "output_messages": None, "usage": None}
    out = [sse({"response": resp, "sequence_number": 0, "type": "response.created"}, "response.created")]
    for i, (p, lp) in enumerate(zip(pieces, lps)):
        out.append(sse({"content_index": 0, "delta": p, "item_id": "msg_1", "output_index": 0,
                        "logprobs": [{"token": p, "logprob": lp, "top_logprobs": []}],
                        "sequence_number": i + 1, "type": "response.output_text.delta"},
                       "response.output_text.delta"))
    text = "".join(pieces)
    final = {**resp, "status": "completed",
             "output": [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                         "content": [{"type": "output_text", "text": text, "annotations": [],
                                      "logprobs": [{"token": p, "logprob": lp, "top_logprobs": []}
                                                   for p, lp in zip(pieces, lps)]}]}],
             "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(ids)},
             "input_messages": [{"message": "...", "tokens": prompt_ids, "type": "raw_message_tokens"}],
             "output_messages": [{"message": text, "tokens": ids, "type": "raw_message_tokens"}]}
    out.append(sse({"response": final, "sequence_number": 99, "type": "response.completed"}, "response.completed"))
    return b"".join(out)


def messages_stream(pieces, ids, lps, prompt_ids) -> bytes:
    out = [sse({"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "tiny",
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}},
        "message_start"),
        sse({"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
            "content_block_start")]
    for p in pieces:
        out.append(sse({"type": "content_block_delta", "delta": {"type": "text_delta", "text": p}, "index": 0},
                       "content_block_delta"))
    out += [sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                 "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(ids)}}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]
    return b"".join(out)


FORMATS = {
    openai_chat.API: (openai_chat, chat_stream, "/v1/chat/completions"),
    openai_responses.API: (openai_responses, responses_stream, "/v1/responses"),
    anthropic_messages.API: (anthropic_messages, messages_stream, "/v1/messages"),
}


def new_state(api: str) -> CallState:
    return CallState(api=api, method="POST", host="127.0.0.1", path=FORMATS[api][2], client_conn_id="c",
                     identity=Identity("r1", "header", None), started_at=datetime.now(timezone.utc),
                     upstream_base="http://127.0.0.1:1", http_status=200, stream=True)


def row_of(api: str, chunks: list[bytes], injected: bool) -> tuple[dict, bytes]:
    """Pass chunks through a real tap (stripping when injected), then build the row."""
    module = FORMATS[api][0]
    state = new_state(api)
    strip = strip_bytes = None
    if injected:
        state.injected, state.asked = True, module.inject({"messages": []}).asked
        strip = lambda obj: module.strip(obj, state.asked)  # noqa: E731
        if hasattr(module, "event_stripper"):  # the fast path, as the addon wires it
            strip_bytes = module.event_stripper(state.asked)
    tap = StreamTap(state, strip, None, False, lambda: None, strip_bytes)
    client: list[bytes] = []
    for c in [*chunks, b""]:
        got = tap(c)
        client.extend(got if isinstance(got, list) else [got])
    row = build_row(state, None)
    return {k: v for k, v in row.items() if k not in VOLATILE}, b"".join(client)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    idx = sorted({min(max(p, 0), len(data)) for p in points})
    bounds = [0, *idx, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@st.composite
def calls(draw):
    pieces = draw(text_pieces)
    ids = draw(st.lists(token, min_size=len(pieces), max_size=len(pieces)))
    lps = draw(st.lists(logprob, min_size=len(pieces), max_size=len(pieces)))
    prompt_ids = draw(st.lists(token, min_size=1, max_size=20))
    return pieces, ids, lps, prompt_ids


@FUZZ
@given(api=st.sampled_from(sorted(FORMATS)), call=calls(), points=st.lists(st.integers(0, 5000), max_size=50),
       injected=st.booleans())
def test_fuzz_reassembly_independent_of_boundaries(api: str, call, points: list[int], injected: bool) -> None:
    pieces, ids, lps, prompt_ids = call
    data = FORMATS[api][1](pieces, ids, lps, prompt_ids)
    whole_row, whole_client = row_of(api, [data], injected)
    row, client = row_of(api, cut(data, points), injected)
    assert row == whole_row
    assert client == whole_client
    if not injected:
        assert client == data

    assert row["status"] == "ok", row["error"]
    response = json.loads(row["response_json"])
    text = "".join(pieces)
    if api == openai_chat.API:
        assert response["choices"][0]["message"]["content"] == text
        assert row["completion_token_ids"] == ids and row["prompt_token_ids"] == prompt_ids
        assert row["completion_logprobs"] == [float(x) for x in lps]
        assert row["usage_match"] is True
    elif api == openai_responses.API:
        assert response["output"][0]["content"][0]["text"] == text
        assert row["completion_token_ids"] == ids and row["prompt_token_ids"] == prompt_ids
        assert row["completion_logprobs"] == [float(x) for x in lps]
    else:
        assert response["content"][0]["text"] == text
        assert row["finish_reason"] == "end_turn"
    if injected and api != anthropic_messages.API:
        # the client got the stream as if nothing had been injected
        assert b'"token_ids": [' not in client and b'"output_messages": [' not in client


@FUZZ
@given(api=st.sampled_from(sorted(FORMATS)), call=calls(), keep=st.floats(0, 1))
def test_fuzz_truncated_stream_is_an_error_row(api: str, call, keep: float) -> None:
    """A stream cut before its final event is never recorded as a complete call."""
    data = FORMATS[api][1](*call)
    final = {openai_chat.API: b"data: [DONE]", openai_responses.API: b"event: response.completed",
             anthropic_messages.API: b"event: message_stop"}[api]
    end = int(keep * data.rfind(final))
    row, client = row_of(api, [data[:end]], False)
    assert client == data[:end]
    assert row["status"] == "upstream_error"
    assert row["prompt_token_ids"] is None and row["completion_token_ids"] is None


@FUZZ
@given(api=st.sampled_from(sorted(FORMATS)), body=st.binary(max_size=400),
       points=st.lists(st.integers(0, 400), max_size=20), injected=st.booleans())
def test_fuzz_random_stream_bytes_never_raise(api: str, body: bytes, points: list[int], injected: bool) -> None:
    row, client = row_of(api, cut(body, points), injected)
    if not injected:
        assert client == body
    assert row["status"] in ("ok", "upstream_error")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=25)
keys = st.sampled_from(["choices", "delta", "content", "token_ids", "prompt_token_ids", "logprobs", "usage",
                        "type", "response", "output", "message", "index", "tool_calls", "function",
                        "input_messages", "output_messages", "content_block", "stop_reason", "finish_reason"])
odd_objects = st.recursive(
    json_values, lambda children: st.dictionaries(keys, children, max_size=5) | st.lists(children, max_size=3),
    max_leaves=30)


@FUZZ
@given(api=st.sampled_from(sorted(FORMATS)), events=st.lists(odd_objects, max_size=6),
       names=st.lists(st.sampled_from([None, "message_start", "content_block_delta", "message_stop",
                                       "response.completed", "response.output_text.delta"]), max_size=6))
def test_fuzz_odd_json_shapes_never_raise(api: str, events: list, names: list) -> None:
    """Valid SSE, valid JSON, wrong shapes (a list where a dict goes, ids as strings...)."""
    data = b"".join(sse(obj, names[i] if i < len(names) else None) for i, obj in enumerate(events))
    data += b"data: [DONE]\n\n"
    for injected in (False, True):
        row, _ = row_of(api, [data], injected)
        assert row["status"] in ("ok", "upstream_error", "proxy_error")
        if row["status"] == "proxy_error":
            raise AssertionError(f"a parser raised on odd input: {row['error']}")


@FUZZ
@given(api=st.sampled_from(sorted(FORMATS)), obj=odd_objects)
def test_fuzz_odd_bodies_never_raise(api: str, obj) -> None:
    """Non-streamed bodies of any JSON shape, and request bodies of any shape."""
    module = FORMATS[api][0]
    state = new_state(api)
    state.stream = False
    state.response_body = json.dumps(obj).encode()
    if isinstance(obj, dict):
        state.request = obj
        inj = module.inject(obj)
        module.strip(json.loads(json.dumps(obj)), inj.asked)
    row = build_row(state, None)
    assert row["status"] in ("ok", "upstream_error"), row["error"]


def _paths(obj, prefix=()):
    """Every (container, key) position inside a JSON value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(api=st.sampled_from(sorted(FORMATS)), call=calls(), data=st.data())
def test_fuzz_mutated_real_shapes_never_raise(api: str, call, data) -> None:
    """A valid stream with a few values replaced by wrong types: recorded, never a parser crash."""
    from polar_train.capture.sse import event_json, split_all

    raw, _ = split_all(FORMATS[api][1](*call))
    events = [event_json(r) for r in raw]
    out = []
    for ev, obj in events:
        if obj is not None and data.draw(st.booleans()):
            paths = list(_paths(obj))
            for _ in range(data.draw(st.integers(1, 3))):
                if paths:
                    _set(obj, data.draw(st.sampled_from(paths)), data.draw(json_values))
                    paths = list(_paths(obj))
        out.append(sse(obj, ev.event) if obj is not None else b"data: " + (ev.data or "").encode() + b"\n\n")
    for injected in (False, True):
        row, _ = row_of(api, [b"".join(out)], injected)
        assert row["status"] in ("ok", "upstream_error"), row["error"]


def fast_strip_checked(module, obj: dict, asked: dict, compact: bool, fast_expected: bool,
                       event: str | None = None) -> tuple[bytes | None, bytes]:
    """``obj`` as an SSE event (compact like vLLM, or spaced), through the format's byte-level
    stripper; whenever it answers, its event must parse to what the JSON path gives. Returns (the
    stripped event or None, the raw event)."""
    from polar_train.capture.sse import parse_event

    sep = (",", ":") if compact else (", ", ": ")
    raw = ((f"event: {event}\n".encode() if event else b"") + b"data: "
           + json.dumps(obj, ensure_ascii=compact, separators=sep).encode() + b"\n\n")
    walk = {"walk_from": 0} if module is openai_responses else {}  # small events too, to test them
    fast = module.event_stripper(asked, **walk)(raw)
    if fast_expected:
        assert fast is not None  # vLLM's own shape takes the fast path
    if fast is not None:
        want = json.loads(json.dumps(obj))
        module.strip(want, asked)
        ev = parse_event(fast)
        assert fast.endswith(b"\n\n") and ev.event == event and json.loads(ev.data) == want
    return fast, raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(piece=st.text(max_size=12), tid=token, lp=logprob, top=st.lists(st.tuples(st.text(max_size=4), logprob), max_size=3),
       compact=st.booleans(), ask_ids=st.booleans(), ask_lps=st.booleans(), finish=st.sampled_from([None, "stop"]))
def test_fuzz_chat_fast_strip_equals_json_strip(piece, tid, lp, top, compact, ask_ids, ask_lps, finish) -> None:
    """The byte-splicing hot path gives the same JSON as parse + strip + re-serialise, for any token text."""
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
           "choices": [{"index": 0, "delta": {"content": piece},
                        "logprobs": {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                                                  "top_logprobs": [{"token": t, "logprob": v} for t, v in top]}]},
                        "finish_reason": finish, "stop_reason": None, "token_ids": [tid]}]}
    fast, raw = fast_strip_checked(openai_chat, obj, {"return_token_ids": ask_ids, "logprobs": ask_lps}, compact,
                                   fast_expected=compact)
    if fast is not None and ask_ids and ask_lps:
        assert fast == raw


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(token, max_size=30), text=st.none() | st.text(max_size=12), model=st.text(max_size=8),
       compact=st.booleans(), ask_ids=st.booleans(), ask_lps=st.booleans())
def test_fuzz_chat_fast_strip_of_the_first_chunk_equals_json_strip(prompt, text, model, compact, ask_ids,
                                                                   ask_lps) -> None:
    """vLLM's first chunk (role, prompt ids at the top level): the splice equals the JSON path."""
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}], "prompt_token_ids": prompt, "prompt_text": text}
    # (only logprobs to strip: the first chunk has none, it goes the JSON path)
    fast, raw = fast_strip_checked(openai_chat, obj, {"return_token_ids": ask_ids, "logprobs": ask_lps}, compact,
                                   fast_expected=compact and not (ask_ids and not ask_lps))
    if fast is not None and ask_ids:
        assert fast == raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(piece=st.text(max_size=12), lp=logprob, top=st.lists(st.tuples(st.text(max_size=4), logprob), max_size=3),
       n=st.integers(0, 3), compact=st.booleans(), ask_lps=st.booleans(), seq=st.integers(0, 10**6))
def test_fuzz_responses_fast_strip_equals_json_strip(piece, lp, top, n, compact, ask_lps, seq) -> None:
    """The Responses text-delta hot path gives the same JSON as parse + strip + re-serialise."""
    obj = {"content_index": 0, "delta": piece, "item_id": "msg_1",
           "logprobs": [{"token": piece, "logprob": lp, "top_logprobs": [{"token": t, "logprob": v} for t, v in top]}
                        for _ in range(n)],
           "output_index": 0, "sequence_number": seq, "type": "response.output_text.delta"}
    fast, raw = fast_strip_checked(openai_responses, obj, {"logprobs": ask_lps}, compact, fast_expected=compact,
                                   event="response.output_text.delta")
    if fast is not None and (ask_lps or n == 0):
        assert fast == raw


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=calls(), compact=st.booleans(), raw_messages=st.booleans(), ask=st.booleans(),
       kind=st.sampled_from(["response.completed", "response.incomplete"]), top=st.none() | st.integers(0, 3))
def test_fuzz_responses_final_event_fast_strip_equals_json_strip(call, compact, raw_messages, ask, kind, top) -> None:
    """The final event (with every prompt token id): splicing the raw message tokens away before
    the JSON path gives what the JSON path alone gives."""
    pieces, ids, lps, prompt_ids = call
    text = "".join(pieces)
    part = {"annotations": [], "text": text, "type": "output_text",
            "logprobs": [{"token": p, "bytes": list(p.encode()), "logprob": lp, "top_logprobs": []}
                         for p, lp in zip(pieces, lps)]}
    resp = {"id": "resp_1", "object": "response", "model": "tiny", "output": [
                {"id": "msg_1", "content": [part], "role": "assistant", "status": "completed", "type": "message"}],
            "status": kind.split(".")[1], "top_logprobs": 0, "usage": {"input_tokens": len(prompt_ids)},
            "input_messages": [{"message": "…\u2028", "tokens": prompt_ids, "type": "raw_message_tokens"}]
            if raw_messages else None,
            "output_messages": [{"message": text, "tokens": ids, "type": "raw_message_tokens"}] if raw_messages else None}
    asked = openai_responses.inject({"input": "x", **({"enable_response_messages": True} if ask else {}),
                                     **({"top_logprobs": top} if top is not None else {})}).asked
    fast_strip_checked(openai_responses, {"response": resp, "sequence_number": 9, "type": kind}, asked, compact,
                       fast_expected=compact and not ask, event=kind)


def test_unicode_line_separators_in_tokens_are_data() -> None:
    """Found by fuzzing: U+2028 / U+0085 inside a token (vLLM writes raw UTF-8) are not SSE line
    breaks; the event must still parse, be stripped for the client and be recorded."""
    pieces = ["a\u2028b", "\x85", "\u2029c"]
    for api in sorted(FORMATS):
        data = FORMATS[api][1](pieces, [1, 2, 3], [-1.0, -2.0, -3.0], [7, 8])
        row, client = row_of(api, [data], True)
        assert row["status"] == "ok", (api, row["error"])
        assert "a\u2028b\x85\u2029c" in row["response_json"]
        assert b'"token_ids": [' not in client and b'"token_ids":[' not in client


request_keys = st.sampled_from(["model", "messages", "input", "stream", "include", "top_logprobs", "logprobs",
                                "return_token_ids", "enable_response_messages", "tools", "x"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(request_keys, json_values, max_size=6), api=st.sampled_from(sorted(FORMATS)),
       indent=st.sampled_from([None, 0, 2]), ws=st.sampled_from(["", " ", "\n\t "]), ascii_only=st.booleans())
def test_fuzz_injected_request_bytes_parse_to_the_injected_body(body, api, indent, ws, ascii_only) -> None:
    """Whatever the client's formatting: the forwarded bytes are the injected object, and when the
    injection only adds keys, every byte the client sent is still there, in order."""
    from polar_train.capture.record import encode_injection

    raw = (ws + json.dumps(body, indent=indent, ensure_ascii=ascii_only) + ws).encode()
    inj = FORMATS[api][0].inject(json.loads(raw))
    out = encode_injection(raw, body, inj.body)
    assert json.loads(out) == inj.body
    if all(inj.body[k] == v for k, v in body.items()):  # only keys added: a pure insertion after "{"
        p, d = raw.find(b"{"), len(out) - len(raw)
        assert out[:p + 1] + out[p + 1 + d:] == raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(st.lists(st.tuples(request_keys, json_values), max_size=6), min_size=1, max_size=3),
       api=st.sampled_from(sorted(FORMATS)), spaced=st.booleans(), ws=st.sampled_from(["", " ", "\n\t "]))
def test_fuzz_walked_request_splice_equals_parse_and_inject(bodies, api, spaced, ws) -> None:
    """Requests read member by member (repeated keys, any spacing, echoed members remembered from
    the requests before): the forwarded bytes parse to what injecting into ``json.loads``' object
    gives, and outside the changed values every byte the client sent is still there, in order."""
    from polar_train.capture.json_members import SKIPPED, EchoCache
    from polar_train.capture.request_walk import splice_injection, walk_request

    echoes = {"tools": EchoCache(min_len=1), "instructions": EchoCache(min_len=1), "input": EchoCache(min_len=1)}
    module = FORMATS[api][0]
    for pairs in bodies:
        raw = (ws + obj_text(pairs, not spaced) + ws).encode("utf-8", errors="surrogatepass")
        try:
            want_obj = json.loads(raw)
        except ValueError:
            assert walk_request(raw, echoes) is None
            continue
        walked = walk_request(raw, echoes)
        assert walked is not None
        assert {k: v for k, v in walked.obj.items() if v is not SKIPPED} == \
            {k: v for k, v in want_obj.items() if walked.obj[k] is not SKIPPED}
        want = module.inject(want_obj)
        got = module.inject(walked.obj)
        assert got.changed == want.changed and got.asked == want.asked
        out = splice_injection(walked, got.body)
        if out is None:
            continue
        assert json.loads(out) == want.body
        kept = [m for m in walked.found if not (m.key in got.body and got.body[m.key] is not walked.obj[m.key]
                                                 and got.body[m.key] != walked.obj[m.key])]
        pos = 0
        for m in kept:  # every unchanged value's bytes, in order, in what goes upstream
            piece = walked.text[m.start:m.end].encode()
            pos = out.index(piece, pos) + len(piece)


def test_requests_only_json_loads_can_read_are_not_walked() -> None:
    """Not UTF-8, a byte-order mark, UTF-16, a lone surrogate, not an object, text after it, invalid
    JSON: the walk declines (the addon then parses with json.loads and re-encodes, as before)."""
    from polar_train.capture.request_walk import walk_request

    body = {"model": "m", "input": "hi \u00e9", "include": []}
    for raw in (b"\xef\xbb\xbf" + json.dumps(body).encode(), json.dumps(body).encode("utf-16"),
                b'{"input":"\xed\xa0\x80"}', b"[1]", b'{"a":1} x', b'{"a":1}}', b'{"a":01}', b"", b"\xff{}"):
        assert walk_request(raw) is None, raw
    walked = walk_request(b' \n{"a" : 1 , "a":2}\t')
    assert walked is not None and walked.obj == {"a": 2} and walked.start == 2


def test_injection_into_bodies_that_are_not_plain_utf8_json_is_re_encoded() -> None:
    from polar_train.capture.record import encode_injection

    body = {"model": "m", "messages": []}
    inj = openai_chat.inject(body)
    for raw in (json.dumps(body).encode("utf-16"), b"\xef\xbb\xbf" + json.dumps(body).encode()):
        out = encode_injection(raw, body, inj.body)
        assert out.startswith(b"{") and json.loads(out) == inj.body
    assert encode_injection(b" {} ", {}, {"logprobs": True}) == b' {"logprobs":true} '


# -- the member-walking fast paths (envelope, part and item events) ----------------------------

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | logprob | st.text(max_size=6)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["a", "top_logprobs", "logprobs", "input_messages",
                                                              "content", "x\"y"]), inner, max_size=3),
                           max_leaves=8)
entry = st.builds(lambda t, lp, with_bytes, top: {"token": t, **({"bytes": list(t.encode())} if with_bytes else {}),
                                                  "logprob": lp, "top_logprobs": [{"token": x, "logprob": v}
                                                                                  for x, v in top]},
                  st.text(max_size=4), logprob, st.booleans(), st.lists(st.tuples(st.text(max_size=3), logprob),
                                                                        max_size=2))
logprobs_value = st.lists(entry, max_size=3) | st.none() | json_values


def obj_text(pairs: list[tuple[str, object]], compact: bool) -> str:
    """A JSON object written member by member (a repeated key stays repeated, as a server could send it)."""
    sep, colon = (",", ":") if compact else (", ", ": ")
    return "{" + sep.join(json.dumps(k) + colon + (v if isinstance(v, Raw) else json.dumps(v, ensure_ascii=False,
                                                                                             separators=(sep, colon)))
                          for k, v in pairs) + "}"


class Raw(str):
    """A value already written as JSON text."""


def checked_against_json_path(raw: bytes, asked: dict) -> bytes | None:
    """The fast path's answer; whenever it gives one, it parses to what the JSON path gives."""
    from polar_train.capture.sse import parse_event

    fast = openai_responses.event_stripper(asked, walk_from=0)(raw)
    if fast is not None:
        ev = parse_event(raw)
        want = json.loads(ev.data)
        changed = openai_responses.strip(want, asked)
        got = parse_event(fast)
        assert fast.endswith(b"\n\n") and got.event == ev.event and json.loads(got.data) == want
        if not changed:
            assert fast == raw
    return fast


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extra=st.lists(st.tuples(st.sampled_from(["instructions", "tools", "metadata", "top_logprobs", "output",
                                                 "input_messages", "user", "text"]), json_values), max_size=4),
       top=st.none() | st.integers(0, 5), messages=st.booleans(), parts=st.lists(logprobs_value, max_size=2),
       compact=st.booleans(), ask_msgs=st.booleans(), ask_lps=st.booleans(), ask_top=st.none() | st.integers(0, 3),
       kind=st.sampled_from(["response.created", "response.in_progress", "response.completed"]),
       outer=st.lists(st.tuples(st.sampled_from(["response", "x", "object"]), json_values), max_size=1))
def test_fuzz_envelope_fast_strip_equals_json_strip(extra, top, messages, parts, compact, ask_msgs, ask_lps, ask_top,
                                                    kind, outer) -> None:
    """An envelope event whose response object has any members in any order, repeated keys and
    spacing included: whenever the member walk answers, it parses to what the JSON path gives; vLLM's
    compact shape always takes it."""
    msgs = [{"message": "a\u2028\"", "tokens": [1, 2, 30]}] if messages else None
    if msgs:
        msgs[0]["type"] = "raw_message_tokens"
    output = [{"id": "msg_1", "content": [{"annotations": [], "text": "t", "type": "output_text", "logprobs": p}
                                          for p in parts], "role": "assistant", "type": "message"}]
    pairs = [("id", "resp_1"), ("object", "response"), ("output", output), *extra, ("top_logprobs", top),
             ("input_messages", msgs), ("output_messages", msgs)]
    sep, colon = (",", ":") if compact else (", ", ": ")
    data = "{" + sep.join([f'"response"{colon}{obj_text(pairs, compact)}',
                           *(json.dumps(k) + colon + json.dumps(v, separators=(sep, colon)) for k, v in outer),
                           f'"sequence_number"{colon}3', f'"type"{colon}"{kind}"']) + "}"
    raw = f"event: {kind}\ndata: {data}\n\n".encode()
    asked = openai_responses.inject({"input": "x", **({"enable_response_messages": True} if ask_msgs else {}),
                                     **({"include": [openai_responses.LOGPROBS_INCLUDE]} if ask_lps else {}),
                                     **({"top_logprobs": ask_top} if ask_top is not None else {})}).asked
    fast = checked_against_json_path(raw, asked)
    if compact and not extra and not outer:
        assert fast is not None
    # the same response object again (as .in_progress repeats .created): the stripper that saw it
    # answers as a fresh one does, and a changed event around the same object is not taken for it
    stripper = openai_responses.event_stripper(asked, walk_from=0)
    assert stripper(raw) == fast
    again = raw.replace(b'"sequence_number"' + colon.encode() + b"3", b'"sequence_number"' + colon.encode() + b"4")
    assert stripper(again) == openai_responses.event_stripper(asked, walk_from=0)(again)
    moved = raw.replace(f'"type"{colon}"{kind}"}}'.encode(), f'"type"{colon}"{kind}","x":1}}'.encode())
    assert moved != raw and stripper(moved) is None
    # the row worker leaves an opening event unparsed only where parsing it gives a well-formed
    # event of that type (which parse_stream never reads); vLLM's shape always qualifies
    if openai_responses.unused_event(raw, walk_from=0):
        assert kind in ("response.created", "response.in_progress") and json.loads(data)["type"] == kind
    elif compact and not extra and not outer:
        assert kind == "response.completed"


def test_envelope_with_a_repeated_key_goes_the_json_path() -> None:
    """A response object whose ``output`` repeats (found by the fuzz test above in CI): the shadowed
    first value held logprobs, the counting one is null, so the JSON path changes nothing and the
    event must pass as sent - the walk declines instead of splicing inside the shadowed value."""
    lps = [{"token": "", "logprob": 0.0, "top_logprobs": []}]
    output = [{"id": "msg_1", "content": [{"annotations": [], "text": "t", "type": "output_text", "logprobs": lps}],
               "role": "assistant", "type": "message"}]
    pairs = [("id", "resp_1"), ("object", "response"), ("output", output), ("output", None)]
    raw = (b'event: response.created\ndata: {"response":' + obj_text(pairs, True).encode()
           + b',"sequence_number":3,"type":"response.created"}\n\n')
    asked = openai_responses.inject({"input": "x"}).asked
    assert openai_responses.event_stripper(asked, walk_from=0)(raw) is None
    assert checked_against_json_path(raw.replace(b'"output":null', b'"user":null'), asked) not in (None, raw)


def test_opening_events_are_parsed_unless_proven_well_formed_and_unused() -> None:
    """The row worker's skip (openai_responses.unused_event): an opening event whose echoed
    instructions were seen before is skipped, but not when the text after them is broken, when its
    data says it is another (final) event, or when it is not UTF-8 - those go the parsing path."""
    instructions = "Follow the rules. " * 40
    def event(name: str, kind: str, tail: str = "") -> bytes:
        data = ('{"response":{"id":"r","instructions":' + json.dumps(instructions) + ',"output":[]' + tail
                + '},"sequence_number":0,"type":"' + kind + '"}')
        return f"event: {name}\ndata: {data}\n\n".encode()

    openai_responses.PARSE_ECHOED["instructions"].clear()
    good = event("response.created", "response.created")
    assert openai_responses.unused_event(good, walk_from=0)
    assert openai_responses.PARSE_ECHOED["instructions"].texts == [json.dumps(instructions)]
    assert openai_responses.unused_event(event("response.in_progress", "response.in_progress"), walk_from=0)
    assert not openai_responses.unused_event(good, walk_from=len(good) + 1)
    for bad in (event("response.created", "response.created", ',"x":tru'),
                event("response.created", "response.created", ',"x":1,'),
                event("response.created", "response.completed"),
                event("response.completed", "response.completed"),
                good.replace(b"Follow", b"F\xffllow", 1)):
        assert not openai_responses.unused_event(bad, walk_from=0), bad[-60:]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.tuples(logprobs_value, st.booleans()), max_size=3), item=st.booleans(),
       extra=st.lists(st.tuples(st.sampled_from(["part", "item", "content", "logprobs", "type", "object", "a"]),
                                json_values), max_size=2),
       compact=st.booleans())
def test_fuzz_part_events_fast_strip_equals_json_strip(parts, item, extra, compact) -> None:
    """content_part.done and output_item.done with any parts (logprob lists with or without bytes,
    empty, null, other values), extra and repeated keys, any spacing: whenever the walk answers, it
    parses to what the JSON path gives; vLLM's compact shape always takes it."""
    def part(lps, dup: bool) -> Raw:
        pairs = [("annotations", []), ("text", "x"), ("type", "output_text"), ("logprobs", lps)]
        return Raw(obj_text(pairs + ([("logprobs", [])] if dup else []), compact))

    sep = "," if compact else ", "
    if item:
        kind = "response.output_item.done"
        content = Raw("[" + sep.join(part(lps, dup) for lps, dup in parts) + "]")
        pairs = [("item", Raw(obj_text([("id", "msg_1"), ("content", content), ("role", "assistant"),
                                        ("type", "message")], compact))), ("output_index", 0)]
    else:
        kind = "response.content_part.done"
        lps, dup = parts[0] if parts else ([], False)
        pairs = [("content_index", 0), ("item_id", "msg_1"), ("output_index", 0), ("part", part(lps, dup))]
    pairs += [*extra, ("sequence_number", 8), ("type", kind)]
    raw = f"event: {kind}\ndata: {obj_text(pairs, compact)}\n\n".encode()
    fast = checked_against_json_path(raw, {"logprobs": False})
    if compact and not extra and not any(dup for _, dup in parts[: None if item else 1]):
        assert fast is not None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lists=st.lists(st.lists(entry, min_size=8, max_size=10), min_size=1, max_size=3),
       events=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["part", "item", "final"]),
                                 st.sampled_from(["as sent", "cut", "longer", "spaced"])), min_size=1, max_size=6))
def test_fuzz_a_streams_proven_logprob_lists_are_recognised_only_as_they_were(lists, events) -> None:
    """One stripper per stream remembers the logprob lists it has proven (a part's list comes again
    in output_item.done and the final response): each event gets what a fresh stripper gives it,
    and a list that merely starts like a remembered one - cut short, or going on past it - is
    proven afresh, never taken for it."""
    texts = [json.dumps(lps, ensure_ascii=False, separators=(",", ":")) for lps in lists]
    variants = {"as sent": lambda t: t, "cut": lambda t: t[:-2] + "]",
                "longer": lambda t: t[:-1] + ',{"token":"x","logprob":-1.0,"top_logprobs":[],"y":1}]',
                "spaced": lambda t: t[:-1] + " ]"}
    asked = {"logprobs": False, "response_messages": False, "has_top_logprobs": False, "top_logprobs": None}
    shared = openai_responses.event_stripper(asked, walk_from=0)
    for which, kind, variant in events:
        lps = Raw(variants[variant](texts[which % len(texts)]))
        part = Raw(obj_text([("annotations", []), ("text", "x"), ("type", "output_text"), ("logprobs", lps)], True))
        item = Raw(obj_text([("id", "msg_1"), ("content", Raw(f"[{part}]")), ("role", "assistant"),
                             ("type", "message")], True))
        if kind == "part":
            data = obj_text([("content_index", 0), ("item_id", "msg_1"), ("output_index", 0), ("part", part),
                             ("sequence_number", 8), ("type", "response.content_part.done")], True)
            raw = f"event: response.content_part.done\ndata: {data}\n\n".encode()
        elif kind == "item":
            data = obj_text([("item", item), ("output_index", 0), ("sequence_number", 9),
                             ("type", "response.output_item.done")], True)
            raw = f"event: response.output_item.done\ndata: {data}\n\n".encode()
        else:
            raw = _envelope([("output", Raw(f"[{item}]")), ("status", "completed")], "response.completed")
        fresh = openai_responses.event_stripper(asked, walk_from=0)(raw)
        assert shared(raw) == fresh
        if variant == "cut":
            assert fresh is None  # not JSON: the JSON path passes it as it is
        else:  # outside the grammar ("longer": an entry with another key) the list is parsed instead
            assert fresh is not None and checked_against_json_path(raw, asked) == fresh


def _envelope(pairs: list[tuple[str, object]], kind: str = "response.created") -> bytes:
    data = '{"response":' + obj_text([("id", "resp_1"), ("object", "response"), *pairs, ("top_logprobs", 0)],
                                     True) + f',"sequence_number":1,"type":"{kind}"}}'
    return f"event: {kind}\ndata: {data}\n\n".encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["instructions", "tools"]), first=json_values | st.text(max_size=12),
       later=st.lists(st.sampled_from(["same", "longer", "shorter", "other", "twice", "number"]), min_size=1,
                      max_size=4), other=json_values, compact=st.booleans())
def test_fuzz_echo_cache_skips_only_what_it_parsed_before(key, first, later, other, compact) -> None:
    """Envelope events one after another, as a session's calls send them: a value remembered from
    one event is skipped in the next only where the same text stands there; every answer still
    parses to what the JSON path gives - for the same value, one that extends it (a longer string,
    an array with one more element, a number going on), one cut short, another value, and the key
    given twice."""
    cache = openai_responses.ECHOED[key]
    saved = cache.min_len
    cache.min_len = 1  # remember even the small values hypothesis makes
    cache.clear()
    try:
        asked = openai_responses.inject({"input": "x"}).asked
        text = json.dumps(first, ensure_ascii=False, separators=(",", ":") if compact else (", ", ": "))
        checked_against_json_path(_envelope([(key, Raw(text))]), asked)
        if text[0] in '"[{':
            # parsed by the scanner: remembered, as the walk reads events (a character per byte)
            assert cache.texts[:1] == [text.encode().decode("latin-1")]
        else:
            assert cache.texts == []  # a number or literal could go on: never remembered
        for how in later:
            value = {"same": text, "other": json.dumps(other), "twice": text,
                     "longer": text[:-1] + (',1' if text[-1] in "]}" and len(text) > 2 else 'x') + text[-1]
                     if text[0] in '"[{' else text + "1",
                     "shorter": text[:-1] if len(text) > 1 else text, "number": "12"}[how]
            pairs = [(key, Raw(value))] + ([(key, Raw(text))] if how == "twice" else [])
            fast = checked_against_json_path(_envelope(pairs), asked)
            if how == "same":
                assert fast is not None  # a remembered value: still vLLM's shape, still the fast path
    finally:
        cache.min_len = saved
        cache.clear()


_TAILS = st.sampled_from(["]", " ]", ",{}]", ", 1]", ",]", "1]", ",1 2]", ', "x"]', ',"unterminated]', ",[1,{}] ]",
                          ',{"a":[1,2]},null]', "", ",", "] ", "]]"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.lists(json_values, max_size=5), turns=st.lists(st.lists(json_values, max_size=3) | _TAILS,
                                                                   min_size=1, max_size=4),
       spaced=st.booleans())
@example(history=[None], turns=[" ]", [], " ]"], spaced=False)  # found in CI: a shorter head learned after a longer
def test_fuzz_conversation_prefix_is_read_only_where_it_grew(history, turns, spaced) -> None:
    """Requests whose array starts with the one remembered before (a conversation, one turn longer,
    or broken right after the remembered part): the walk reads what ``json.loads`` reads - a
    skipped array is exactly the array ``json.loads`` finds there, and a text it rejects is
    rejected - and the conversation's newest text is what the cache keeps."""
    from polar_train.capture.json_members import SKIPPED, PrefixCache
    from polar_train.capture.request_walk import walk_request

    sep = (", ", ": ") if spaced else (",", ":")
    cache = PrefixCache(size=3, min_len=1)
    echoes = {"messages": cache}
    text = json.dumps(history, separators=sep)
    for turn in turns:
        if isinstance(turn, list):  # the next call: the same conversation, more turns
            grown = json.dumps(json.loads(text) + turn, separators=sep) if _loads_or_none(text) is not None else text
        else:  # whatever follows the remembered head: valid or not
            grown = (cache.texts[0] if cache.texts else text[:-1]) + turn
        raw = ('{"model":"m","messages":' + grown + ',"stream":true}').encode()
        want = _loads_or_none(raw)
        walked = walk_request(raw, echoes)
        if not isinstance(want, dict):
            assert walked is None, raw
            continue
        assert walked is not None, raw
        (m,) = [m for m in walked.found if m.key == "messages"]
        assert json.loads(walked.text[m.start:m.end]) == want["messages"]
        assert walked.obj["messages"] is SKIPPED or walked.obj["messages"] == want["messages"]
        if want["messages"]:  # an empty array has no element to go on from: never remembered
            assert cache.texts[0] == walked.text[m.start:m.end - 1]  # the newest text, without its "]"
        assert not any(cache.texts[0].startswith(h) for h in cache.texts[1:])  # its own older heads made way
        text = grown


def _loads_or_none(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def test_prefix_cache_skips_a_grown_conversation_and_parses_only_the_new_turns() -> None:
    from polar_train.capture.json_members import SKIPPED, PrefixCache, members

    cache = PrefixCache(size=2, min_len=5)
    one = '[{"role":"user","content":"fix the bug"}]'
    found, _ = members('{"messages":' + one + "}", 0, {"messages": cache.skip})
    assert found[0].value != SKIPPED
    cache.learn('{"messages":' + one + "}", found[0])
    two = one[:-1] + ',{"role":"assistant","content":"done"}]'
    text = '{"messages":' + two + ',"stream":true}'
    found, _ = members(text, 0, {"messages": cache.skip})
    assert found[0].value is SKIPPED and text[found[0].start:found[0].end] == two
    assert found[1].key == "stream" and found[1].value is True
    cache.learn(text, found[0])
    assert cache.texts == [two[:-1]]  # the longer text replaced its own head
    other = '[{"role":"user","content":"fix the bug"},{"role":"assistant","content":"no"}]'
    cache.learn('{"m":' + other + "}", members('{"m":' + other + "}", 0)[0][0])
    assert cache.skip(two, 0) == len(two)  # the longest matching head wins, wherever it stands
    assert cache.texts[0] == two[:-1] and len(cache.texts) == 2


def test_echo_cache_skips_at_the_position_only_and_stays_bounded() -> None:
    cache = openai_responses.EchoCache(size=2, min_len=5)
    text = '{"a":"xyz","b":"abc","c":[1,2],"d":123,"e":"ab"}'
    found, _ = openai_responses.members(text, 0)
    for m in found:
        cache.learn(text, m)
    assert cache.texts == ['[1,2]', '"abc"']  # newest first; numbers and short values never; two kept
    assert cache.skip(text, text.index('"abc"')) == text.index('"abc"') + 5
    assert cache.skip(text, text.index('"xyz"')) is None  # "abc" stands later in the text, not here
    assert cache.skip('"abc"', 0) == 5 and cache.texts[0] == '"abc"'  # a hit moves to the front


@settings(max_examples=500, deadline=None)
@given(text=st.text(max_size=60), head=st.binary(max_size=8), tail=st.binary(max_size=4), data=st.data())
def test_fuzz_utf8_splice_equals_encoding_the_spliced_text(text, head, tail, data) -> None:
    """Byte offsets of character indices (ASCII or not, near either end) give what re-encoding the
    spliced text gives; the bytes around the text stay as they are."""
    from polar_train.capture.json_members import splice_utf8

    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))  # distinct starts: one order
    spans = [(a, a if data.draw(st.booleans()) else b, data.draw(st.text(max_size=5)))  # a span or an insertion
             for a, b in zip(cuts[::2], cuts[1::2])]
    reference, at = [], 0
    for a, b, new in spans:
        reference += [text[at:a], new]
        at = b
    reference.append(text[at:])
    raw = head + text.encode("utf-8") + tail
    got = splice_utf8(raw, text, list(reversed(spans)), len(head), len(raw) - len(tail))
    assert got == head + "".join(reference).encode("utf-8") + tail


def json_ids(text: str) -> bool:
    """What a list of token ids must be: compact JSON (ASCII, no spaces) of non-negative integers
    (no ``-0``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (text.isascii() and " " not in text and "-" not in text and isinstance(value, list)
            and all(type(v) is int and v >= 0 for v in value))


id_soup = st.lists(st.sampled_from(["0", "7", "10", "09", "248045", ",", ",,", " ", "-", "\u0661", "1.5", "]", "["]),
                   max_size=14).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inner=id_soup)
@example(inner="7,09")
@example(inner="09")
@example(inner="10,0,7")
@example(inner="0,\u0661")
def test_fuzz_token_ids_proof_is_json_loads(inner: str) -> None:
    """The C-speed proof of a prompt's ids (grammar.ids_end, text_ids_end) takes exactly the lists
    that json.loads reads as non-negative integers written compactly, and ends where they end."""
    from polar_train.capture.grammar import ids_end, text_ids_end

    from polar_train.capture.grammar import _proper_ids_vectorised

    text = "[" + inner + "]"
    close = text.index("]") + 1
    want = close if json_ids(text[:close]) else None
    assert text_ids_end(text, 0) == want
    assert ids_end(text.encode(), 0) == (len(text[:close].encode()) if want else None)
    assert _proper_ids_vectorised(text[1:close - 1].encode()) == (want is not None)  # long lists' path


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.integers(0, 248_100), max_size=40), at=st.floats(0, 1),
       flaw=st.sampled_from(["", ",", "0", ",0", "00", " ", "-", "\u0661", "x", "1.5", ",,"]))
def test_fuzz_long_token_ids_proof_is_json_loads(ids: list[int], at: float, flaw: str) -> None:
    """A prompt's worth of ids (past grammar.VECTOR_FROM_BYTES: the vectorised proof) with one
    flaw anywhere (an empty element, a leading zero, a foreign character...) is taken exactly when
    json.loads reads non-negative integers written compactly."""
    from polar_train.capture.grammar import VECTOR_FROM_BYTES, ids_end, text_ids_end

    inner = ",".join(map(str, [248_000 + i % 100 for i in range(600)] + ids))
    assert len(inner) >= VECTOR_FROM_BYTES
    cut = round(at * len(inner))
    text = "[" + inner[:cut] + flaw + inner[cut:] + "]"
    want = len(text) if json_ids(text) else None
    assert text_ids_end(text, 0) == want
    assert ids_end(text.encode(), 0) == (len(text.encode()) if want else None)


raw_message_pieces = st.lists(st.sampled_from([
    '{"message":"<|im_start|>user\\nhi \\u2028 \\"x\\"","tokens":[248045,846,0,198],"type":"raw_message_tokens"}',
    '{"message":"","tokens":[],"type":"raw_message_tokens"}', ",", ",,", "]", "[", " ", "\u0661",
    '{"message":"a\tb","tokens":[1],"type":"raw_message_tokens"}',  # a raw tab: not JSON
    '{"message":"a\\qb","tokens":[1],"type":"raw_message_tokens"}',  # no such escape
    '{"message":"a","tokens":[01],"type":"raw_message_tokens"}', '{"message":"a","tokens":[1],"type":"x"}',
    '{"message":"a","tokens":[1,2]}', '"message"', '"\\ud800"']), max_size=6).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inner=raw_message_pieces, before=st.sampled_from(["", '"x":']))
def test_fuzz_raw_message_tokens_proof_is_json_loads(inner: str, before: str) -> None:
    """Responses' raw message tokens are proven well-formed, not parsed: whatever the proof takes
    json.loads reads as a list of {message, tokens, type} objects; vLLM's compact list is taken."""
    from polar_train.capture.openai_responses import _skip_raw_messages

    text = before + "[" + inner + "]"
    end = _skip_raw_messages(text, len(before))
    if end is not None:
        value = json.loads(text[len(before):end])
        assert all(m.keys() == {"message", "tokens", "type"} and m["type"] == "raw_message_tokens"
                   and json_ids(json.dumps(m["tokens"], separators=(",", ":"))) for m in value)
    messages = [{"message": "a\u2028\n\"é", "tokens": [248045, 0, 10], "type": "raw_message_tokens"}] * 2
    compact = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    assert _skip_raw_messages(before + compact, len(before)) == len(before + compact)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inner=id_soup, ask_lps=st.booleans())
def test_fuzz_chat_first_chunk_with_broken_ids_goes_the_json_path(inner: str, ask_lps: bool) -> None:
    """A first chunk whose prompt ids are anything but a JSON list of ids is not spliced (the JSON
    path leaves an event it cannot read as it is); a proper one is, to what the JSON path gives."""
    raw = ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":'
           '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
           '"prompt_token_ids":[' + inner + '],"prompt_text":null}\n\n').encode()
    asked = {"return_token_ids": False, "logprobs": ask_lps}
    fast = openai_chat.event_stripper(asked)(raw)
    try:
        obj = json.loads(raw[6:-2])
    except ValueError:
        obj = None
    if obj is None or not json_ids("[" + inner + "]"):
        assert fast is None
    else:
        assert fast is not None
        openai_chat.strip(obj, asked)
        assert json.loads(fast[6:-2]) == obj


# -- events read one character per byte (polar_train.capture.byte_text) ---------------------------
_UTF8_PIECES = st.one_of(
    st.text(max_size=6).map(str.encode),  # valid characters, 1-4 bytes each
    st.lists(st.sampled_from([0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0,
                              0xF4, 0xF5, 0xFF, 0x41]), min_size=1, max_size=4).map(bytes),  # edges of the table
    st.sampled_from([b"\xed\xa0\x80", b"\xe0\x80\x80", b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf",
                     b"\xf0\x9f\x98", b"\xe2\x82"]))  # a surrogate, overlong forms, past U+10FFFF, cut short


@settings(max_examples=600, deadline=None)
@given(pieces=st.lists(_UTF8_PIECES, max_size=8), padding=st.sampled_from([0, 40, 3000]))
@example(pieces=[b"\xe2\x80\x94"], padding=3000)
@example(pieces=[b"\xe2\x80", b"x", b"\x94"], padding=3000)
def test_fuzz_is_utf8_is_pythons_decoder(pieces: list[bytes], padding: int) -> None:
    """byte_text.is_utf8 answers what bytes.decode("utf-8") does, for sparse non-ASCII bytes (each
    run checked alone) and dense ones (decoded whole), and byte_text reads one character per byte."""
    from polar_train.capture.byte_text import byte_text, is_utf8

    data = (b"a" * padding).join([b"", *pieces, b""]) if padding else b"".join(pieces)
    try:
        data.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    assert is_utf8(data) is valid
    assert byte_text(data) == (data.decode("latin-1") if valid else None)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xe0\x80\x80", b"\x80"]),
       where=st.sampled_from(["instructions", "text", "token"]),
       kind=st.sampled_from(["response.completed", "response.content_part.done"]))
def test_invalid_utf8_in_a_walked_event_goes_the_json_path(bad: bytes, where: str, kind: str) -> None:
    """An envelope or part event with invalid UTF-8 in a string is not read one character per byte:
    the fast path declines (the JSON path decides, as before: it reads U+FFFD there), and the same
    event with valid non-ASCII text in that place takes the fast path and parses to the JSON path's
    answer."""
    if kind != "response.completed" and where == "instructions":
        where = "text"  # a part event has no instructions
    lps = [{"token": "\u00e9" if where == "token" else "t", "logprob": -0.5, "top_logprobs": []}]
    part = {"annotations": [], "text": "\u2014" if where == "text" else "x", "type": "output_text", "logprobs": lps}
    if kind == "response.completed":
        resp = [("id", "resp_1"), ("instructions", "\u00e9 \u2014 ok" if where == "instructions" else "ok"),
                ("object", "response"), ("output", [{"id": "m", "content": [part], "type": "message"}]),
                ("top_logprobs", 0)]
        data = '{"response":' + obj_text(resp, True) + f',"sequence_number":9,"type":"{kind}"}}'
    else:
        data = obj_text([("content_index", 0), ("item_id", "m"), ("output_index", 0), ("part", part),
                         ("sequence_number", 8), ("type", kind)], True)
    good = f"event: {kind}\ndata: {data}\n\n".encode()
    asked = openai_responses.inject({"input": "x"}).asked
    assert checked_against_json_path(good, asked) not in (None, good)  # valid: the fast path strips
    mark = {"instructions": "\u00e9", "text": "\u2014", "token": "\u00e9"}[where].encode()
    broken = good.replace(mark, bad, 1)
    assert broken != good
    assert openai_responses.event_stripper(asked, walk_from=0)(broken) is None


# -- the row worker's id arrays (polar_train.capture.id_arrays) -------------------------------------
def _plain(value):
    """``value`` with every numpy array as a list (what json.loads would have made of it)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


_PAD = "x" * 9000  # past IDS_ARRAY_FROM_BYTES


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inner=raw_message_pieces, out=raw_message_pieces, extra=st.lists(st.tuples(
           st.sampled_from(["input_messages", "output_messages", "usage", "instructions"]), json_values), max_size=2),
       seq=st.sampled_from(["7", "07", "-1", "\u0661"]), end=st.sampled_from(["}", ',"x":1}', "} ", "}}"]),
       kind=st.sampled_from(["response.completed", "response.incomplete", "response.created"]))
@example(inner='{"message":"a","tokens":[2147483648],"type":"raw_message_tokens"}', out="", extra=[], seq="7",
         end="}", kind="response.completed")
@example(inner='{"message":"<|im_start|>user\\nhi \\u2028 \\"x\\"","tokens":[248045,846,0,198],"type":"raw_message_tokens"}',
         out='{"message":"","tokens":[],"type":"raw_message_tokens"}', extra=[], seq="7", end="}",
         kind="response.completed")
def test_fuzz_final_event_read_with_id_arrays_is_json_loads(inner, out, extra, seq, end, kind) -> None:
    """The row worker's reading of a final event (ids as arrays) answers only for a final event, and
    then what json.loads gives (arrays as lists), for any raw message tokens, repeated keys and tails;
    vLLM's exact shape is always read so."""
    from polar_train.capture.openai_responses import final_event_json
    from polar_train.capture.sse import parse_event

    pairs = [("id", "resp_1"), ("instructions", _PAD), ("input_messages", Raw("[" + inner + "]")),
             ("output_messages", Raw("[" + out + "]")), *extra]
    data = '{"response":' + obj_text(pairs, True) + f',"sequence_number":{seq},"type":"{kind}"' + end
    raw = f"event: {kind}\ndata: {data}\n\n".encode()
    got = final_event_json(raw)
    try:
        want = json.loads(data)
    except ValueError:
        want = None
    if got is not None:
        assert kind != "response.created" and got[0] == parse_event(raw).event == kind
        assert _plain(got[1]) == want
    exact = want is not None and not extra and kind != "response.created" and seq == "7" and end == "}" and all(
        json_ids(json.dumps(m["tokens"], separators=(",", ":"))) and max(m["tokens"], default=0) < 2**31
        and m.keys() == {"message", "tokens", "type"} and list(m) == ["message", "tokens", "type"]
        for key in ("input_messages", "output_messages") for m in want["response"][key]
        if isinstance(m, dict)) and all(isinstance(m, dict) for key in ("input_messages", "output_messages")
                                        for m in want["response"][key])
    if exact and _skip_both(raw):
        assert got is not None


def _skip_both(raw: bytes) -> bool:
    """Whether the proxy's proof takes both raw message lists (vLLM's exact compact shape)."""
    from polar_train.capture.openai_responses import _skip_raw_messages

    text = raw.decode("utf-8")
    for key in ("input_messages", "output_messages"):
        at = text.find(f'"{key}":') + len(key) + 3
        if _skip_raw_messages(text, at) is None:
            return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inner=id_soup, big=st.booleans())
def test_fuzz_chat_first_chunk_read_with_id_arrays_is_json_loads(inner: str, big: bool) -> None:
    """The row worker's reading of chat's first chunk (prompt ids as an array) answers exactly when
    the ids are a proper list within int32 (and the chunk is long enough to bother), with what
    json.loads gives."""
    from polar_train.capture.openai_chat import first_chunk_json

    ids = inner + ("," if inner else "") + ",".join(["248045"] * 1500) if big else inner
    raw = ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":'
           '[{"index":0,"delta":{"role":"assistant","content":"\u00e9"},"logprobs":null,"finish_reason":null}],'
           '"prompt_token_ids":[' + ids + '],"prompt_text":null}\n\n').encode()
    got = first_chunk_json(raw)
    null = raw.replace(b"[" + ids.encode() + b"]", b"null").replace(b'"content":"', b'"content":"' + _PAD.encode())
    assert first_chunk_json(null) is None or _plain(first_chunk_json(null)[1]) == json.loads(null[6:-2])
    try:
        want = json.loads(raw[6:-2])
    except ValueError:
        want = None
    proper = want is not None and json_ids("[" + ids + "]") and max(want["prompt_token_ids"], default=0) < 2**31
    assert (got is not None) == (proper and len(raw) >= 8192)
    if got is not None:
        assert got[0] is None and _plain(got[1]) == want


def _json_path(raw: bytes, asked: dict) -> bytes:
    """What the tap hands on for an event on its JSON path (the real StreamTap, without a fast path)."""
    from types import SimpleNamespace

    tap = StreamTap(SimpleNamespace(), lambda obj: openai_responses.strip(obj, asked), None, False, lambda: None)
    return tap._rewrite(raw)


_SMALL_EVENT_KEYS = st.sampled_from(["content_index", "item_id", "logprobs", "output_index", "sequence_number", "text",
                                     "type", "part", "item", "object", "response", "p\\u0061rt", "delta"])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=st.lists(st.tuples(_SMALL_EVENT_KEYS, json_values | st.sampled_from(
           ["response", "response.output_text.delta", "response.output_text.done", [{"logprob": -1.0}]])), max_size=6),
       kind=st.sampled_from(["response.output_text.done", "response.content_part.added", "response.output_text.delta",
                             "response.output_item.added"]),
       big=st.booleans(), ask_lps=st.booleans())
@example(pairs=[("logprobs", []), ("text", " Cao Tuesday"), ("type", "response.output_text.done")],
         kind="response.output_text.done", big=False, ask_lps=False)
def test_fuzz_events_nothing_can_strip_pass_as_the_json_path_passes_them(pairs, kind, big, ask_lps) -> None:
    """Events the stripper hands on without parsing (nothing in them names what strip() changes: no
    part, item, response or object key, no delta type, no \\u escape) are exactly what the JSON path
    hands on; vLLM's output_text.done is one of them, at any size."""
    if big:
        pairs = [*pairs, ("text", "x" * 3000)]  # past WALK_FROM_BYTES: after the walks decline
    raw = f"event: {kind}\ndata: {obj_text(pairs, True)}\n\n".encode()
    asked = {"logprobs": ask_lps}
    fast = openai_responses.event_stripper(asked)(raw)
    if fast is not None:
        assert fast == _json_path(raw, asked) or json.loads(fast.split(b"data: ", 1)[1]) == json.loads(
            _json_path(raw, asked).split(b"data: ", 1)[1])
    if pairs[:3] == [("logprobs", []), ("text", " Cao Tuesday"), ("type", "response.output_text.done")]:
        assert fast == raw


@pytest.mark.parametrize("data", [
    '{"content_index":0,"part":{"logprobs":[{"logprob":-1.0}]},"type":"response.content_part.added"}',
    '{"content_index":0,"p\\u0061rt":{"logprobs":[{"logprob":-1.0}]},"type":"response.content_part.added"}',
    '{"item":{"content":[{"logprobs":[{"logprob":-1.0}]}]},"type":"response.output_item.added"}',
    '{"logprobs":[{"logprob":-1.0}],"type":"response.output_text.delta","delta":"x"}',
    '{"logprobs":[{"logprob":-1.0}],"type":"response.output_text.\\u0064elta","delta":"x"}',
    '{"object":"response","output":[{"content":[{"logprobs":[{"logprob":-1.0}]}]}],"input_messages":[]}',
    '{"response":{"top_logprobs":3},"type":"response.failed"}',
])
def test_events_strip_would_change_are_never_passed_unparsed(data: str) -> None:
    """Each key strip() acts on, written plainly or with a \\u escape, keeps a small event on the
    JSON path: the stripper's answer is the JSON path's (never the event passed as it is)."""
    raw = f"event: x\ndata: {data}\n\n".encode()
    asked = openai_responses.inject({"input": "x"}).asked
    want = _json_path(raw, asked)
    assert want != raw  # the JSON path changes it
    fast = openai_responses.event_stripper(asked)(raw)
    assert fast is None or json.loads(fast.split(b"data: ", 1)[1]) == json.loads(want.split(b"data: ", 1)[1])
