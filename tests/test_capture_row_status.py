"""The recorded row of a call whose wire is odd: a server error inside a 2xx stream, events after
the final event, a final event without its blank line, lone surrogate escapes, an error reply sent
as an event stream, a chat stream without ``[DONE]``. The bytes are the ones a probe against real
mitmdump found recorded wrongly (vLLM 0.32's shapes, tests/support/capture_wire.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_train.capture import anthropic_messages, openai_chat, openai_responses, record, redact, worker
from polar_train.capture.identity import Identity
from polar_train.capture.options import CaptureOptions
from polar_train.capture.json_members import compact
from polar_train.schema import CALL_LOG_SCHEMA
from tests.support.capture_wire import WIRE

REPO = Path(__file__).resolve().parents[1]
PATHS = {"openai.chat": "/v1/chat/completions", "openai.responses": "/v1/responses",
         "anthropic.messages": "/v1/messages"}
CHAT_REQ = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
RESP_REQ = {"model": "tiny", "input": "Hi", "stream": True}
MSG_REQ = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "stream": True}

#: vLLM 0.32's Messages stream (recorded), its events one by one.
MESSAGES_SSE = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-a0","type":"message","role":'
    b'"assistant","content":[],"model":"tiny","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":9,'
    b'"output_tokens":0}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","content_block":{"type":"text","text":""},'
    b'"index":0}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta","text":'
    b'".OrderBy"},"index":0}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta","text":'
    b'" ranking"},"index":0}\n\n',
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
    b'"usage":{"input_tokens":9,"output_tokens":2}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


def _events(text: str) -> list[bytes]:
    return [p + b"\n\n" for p in text.encode().split(b"\n\n") if p]


CHAT_SSE = _events(WIRE["chat_inj_sse"])  # role chunk, " Cao", " Tuesday" (finish_reason), [DONE]
RESP_SSE = _events(WIRE["resp_inj_sse"])  # ... response.completed last
CHAT_IDS = json.loads(WIRE["chat_inj"])["choices"][0]["token_ids"]
RESP_IDS = json.loads(WIRE["resp_inj"])["output_messages"][0]["tokens"]
USAGE_CHUNK = (b'data: {"id":"chatcmpl-b5ae1e474d782846","object":"chat.completion.chunk","created":1796224826,'
               b'"model":"tiny","choices":[],"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2}}\n\n')
VLLM_ERROR = b'data: {"error":{"message":"boom","type":"BadRequestError","param":null,"code":400}}\n\n'


def _state(api: str, request: dict, **kw) -> record.CallState:
    s = record.CallState(api, "POST", "h", PATHS[api], "c", Identity("r", "header"), record.utcnow(), "http://h")
    s.request_body = json.dumps(request).encode()
    s.stream = bool(request.get("stream"))
    if api != "anthropic.messages":
        s.injected, s.asked = True, record.FORMATS[api].inject(dict(request)).asked
    s.http_status = 200
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def _row(api: str, request: dict, stream: list[bytes] | bytes | None = None, **kw) -> dict:
    if stream is not None:
        kw["stream_raw"] = b"".join(stream) if isinstance(stream, list) else stream
    row = record.build_row(_state(api, request, **kw), None)
    pa.Table.from_pylist([row], schema=CALL_LOG_SCHEMA)  # always storable as built
    return row


def _without_ids(row: dict) -> bool:
    return row["prompt_token_ids"] is None and row["completion_token_ids"] is None and row["token_source"] == "none"


# -- 1. a server error inside a 2xx stream ------------------------------------------------------
def test_vllms_error_chunk_mid_stream_is_an_upstream_error_without_ids():
    """vLLM 0.32 (chat_completion/serving.py): an exception mid-generation yields
    ``data: {"error": ...}`` then ``data: [DONE]``; the tokens before it were kept as an ok call."""
    row = _row("openai.chat", CHAT_REQ, CHAT_SSE[:2] + [VLLM_ERROR, b"data: [DONE]\n\n"])
    assert row["status"] == "upstream_error" and _without_ids(row)
    assert "boom" in row["error"] and "BadRequestError" in row["error"]


def test_vllms_error_chunk_through_the_hooks_gives_an_upstream_error_row(tmp_path):
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import taddons, tflow, tutils

    spec = importlib.util.spec_from_file_location("polar_capture_addon_rs", REPO / "addons" / "polar_capture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    addon = mod.PolarCapture()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_out=str(tmp_path))

        async def run():
            f = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions",
                                            content=json.dumps(CHAT_REQ).encode(),
                                            headers=((b"content-type", b"application/json"),)))
            addon.requestheaders(f)
            await addon.request(f)
            f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
            addon.responseheaders(f)
            for event in CHAT_SSE[:2] + [VLLM_ERROR, b"data: [DONE]\n\n"]:
                f.response.stream(event)
            f.response.stream(b"")
            await addon.response(f)

        asyncio.run(run())
        addon.done()
    (row,) = pq.read_table(tmp_path / "calls").to_pylist()
    assert row["status"] == "upstream_error" and "boom" in row["error"] and _without_ids(row)


def test_a_failed_responses_stream_is_an_upstream_error_with_the_servers_message():
    last = RESP_SSE[-1]
    obj = json.loads(last[last.index(b"data: ") + 6:])
    obj["type"] = "response.failed"
    obj["response"]["status"] = "failed"
    obj["response"]["error"] = {"code": "server_error", "message": "boom"}
    failed = b"event: response.failed\ndata: " + compact(obj).encode() + b"\n\n"
    row = _row("openai.responses", RESP_REQ, RESP_SSE[:-1] + [failed])
    assert row["status"] == "upstream_error" and _without_ids(row)
    assert "boom" in row["error"] and "server_error" in row["error"]


def test_a_responses_error_event_is_an_upstream_error_with_the_servers_message():
    error = (b'event: error\ndata: {"type":"error","code":"server_error","message":"boom","param":null,'
             b'"sequence_number":5}\n\n')
    row = _row("openai.responses", RESP_REQ, RESP_SSE[:5] + [error])
    assert row["status"] == "upstream_error" and _without_ids(row)
    assert "boom" in row["error"] and "truncated" not in row["error"]


def test_a_failed_non_streamed_response_is_an_upstream_error():
    body = json.loads(WIRE["resp_inj"])
    body["status"], body["error"] = "failed", {"code": "server_error", "message": "boom"}
    row = _row("openai.responses", {**RESP_REQ, "stream": False}, response_body=json.dumps(body).encode())
    assert row["status"] == "upstream_error" and "boom" in row["error"] and _without_ids(row)


def test_an_anthropic_error_event_gives_its_message():
    error = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    row = _row("anthropic.messages", MSG_REQ, MESSAGES_SSE[:4] + [error])
    assert row["status"] == "upstream_error"
    assert "Overloaded" in row["error"] and "overloaded_error" in row["error"] and "truncated" not in row["error"]


def test_a_server_error_outranks_a_client_that_left_after_it():
    row = _row("openai.chat", CHAT_REQ, CHAT_SSE[:2] + [VLLM_ERROR], client_error="client disconnected")
    assert row["status"] == "upstream_error" and "boom" in row["error"]


# -- 2. events after the final event ---------------------------------------------------------------
def test_chat_events_after_done_do_not_change_the_call():
    whole = _row("openai.chat", CHAT_REQ, CHAT_SSE)
    after = _row("openai.chat", CHAT_REQ, CHAT_SSE + CHAT_SSE[1:3])
    assert whole["status"] == after["status"] == "ok" and whole["error"] is None
    assert after["completion_token_ids"] == whole["completion_token_ids"] == CHAT_IDS
    assert after["completion_logprobs"] == whole["completion_logprobs"]
    assert json.loads(after["response_json"]) == json.loads(whole["response_json"])
    assert after["error"] == record.AFTER_FINAL.format(n=2)


def test_a_second_done_is_noted_and_changes_nothing():
    row = _row("openai.chat", CHAT_REQ, CHAT_SSE + CHAT_SSE[-1:])
    assert row["status"] == "ok" and row["completion_token_ids"] == CHAT_IDS
    assert row["error"] == record.AFTER_FINAL.format(n=1)


def test_messages_events_after_message_stop_do_not_cut_the_text():
    whole = _row("anthropic.messages", MSG_REQ, MESSAGES_SSE)
    after = _row("anthropic.messages", MSG_REQ, MESSAGES_SSE + MESSAGES_SSE[1:3])
    assert json.loads(whole["response_json"])["content"][0]["text"] == ".OrderBy ranking"
    assert after["response_json"] == whole["response_json"] and after["status"] == "ok"


def test_responses_events_after_completed_do_not_change_the_call():
    last = RESP_SSE[-1]
    obj = json.loads(last[last.index(b"data: ") + 6:])
    obj["response"]["output_messages"][0]["tokens"] = [1, 2, 3]
    again = b"event: response.completed\ndata: " + compact(obj).encode() + b"\n\n"
    row = _row("openai.responses", RESP_REQ, RESP_SSE + [again])
    assert row["status"] == "ok" and row["completion_token_ids"] == RESP_IDS
    assert row["error"] == record.AFTER_FINAL.format(n=1)


# -- 3. a final event without its blank line ------------------------------------------------------
def test_a_responses_final_event_without_its_blank_line_is_read():
    whole = _row("openai.responses", RESP_REQ, RESP_SSE)
    row = _row("openai.responses", RESP_REQ, b"".join(RESP_SSE)[:-2])
    assert row["status"] == "ok" and row["completion_token_ids"] == RESP_IDS == whole["completion_token_ids"]
    assert row["response_json"] == whole["response_json"] and row["finish_reason"] == whole["finish_reason"]


@pytest.mark.parametrize("cut", [2, 40])
def test_a_final_event_cut_inside_its_data_is_truncated(cut):
    data = b"".join(RESP_SSE)
    row = _row("openai.responses", RESP_REQ, data[:-cut - 200])
    assert row["status"] == "upstream_error" and "truncated" in row["error"] and _without_ids(row)


# -- 4. lone surrogate escapes ---------------------------------------------------------------------
def test_a_request_with_a_lone_surrogate_escape_keeps_its_row_and_its_text():
    body = b'{"model":"tiny","messages":[{"role":"user","content":"hi \\ud83d"}],"max_tokens":16}'
    s = _state("openai.chat", {}, request_body=body, stream=False, response_body=WIRE["chat_inj"].encode())
    row = record.build_row(s, None)
    pa.Table.from_pylist([row], schema=CALL_LOG_SCHEMA)
    assert row["status"] == "ok" and row["completion_token_ids"] == CHAT_IDS
    assert json.loads(row["request_json"]) == json.loads(body)
    assert json.loads(row["request_json"])["messages"][0]["content"] == "hi \ud83d"


def test_a_streamed_event_with_a_lone_surrogate_keeps_its_row_and_its_text():
    odd = CHAT_SSE[1].replace(b'"content":" Cao"', b'"content":" Cao\\ud83d"')
    assert odd != CHAT_SSE[1]
    row = _row("openai.chat", CHAT_REQ, [CHAT_SSE[0], odd, *CHAT_SSE[2:]])
    assert row["status"] == "ok" and row["completion_token_ids"] == CHAT_IDS
    assert json.loads(row["response_json"])["choices"][0]["message"]["content"] == " Cao\ud83d Tuesday"


def test_a_non_streamed_reply_with_a_lone_surrogate_keeps_its_row_and_its_text():
    body = WIRE["chat_inj"].replace('"content":" Cao', '"content":"\\ud83d Cao', 1).encode()
    row = _row("openai.chat", {**CHAT_REQ, "stream": False}, response_body=body)
    assert row["status"] == "ok" and row["completion_token_ids"] == CHAT_IDS
    assert json.loads(row["response_json"])["choices"][0]["message"]["content"] == "\ud83d Cao Tuesday"


def test_a_server_error_message_with_a_lone_surrogate_is_stored_escaped():
    error = b'data: {"error":{"message":"bad \\udc80 byte","type":"BadRequestError","code":400}}\n\n'
    row = _row("openai.chat", CHAT_REQ, CHAT_SSE[:1] + [error, b"data: [DONE]\n\n"])
    assert row["status"] == "upstream_error" and "bad \\udc80 byte" in row["error"]


def test_surrogates_are_escaped_exactly_and_only_them():
    value = {"a\ud83d": ["x\udc00y", "\\ud83d", "é😀"], "api_key": "k\ud800"}
    text = redact.redacted_dumps(value, compact)
    assert json.loads(text) == {"a\ud83d": ["x\udc00y", "\\ud83d", "é😀"], "api_key": "[REDACTED]"}
    text.encode("utf-8")
    assert redact.escape_surrogates("é😀") == "é😀" and redact.utf8('"\ud83d"') == b'"\\ud83d"'
    raw = b'{"model":"m","messages":[{"role":"user","content":"\\ud83d"}],"include":"x"}'
    obj = json.loads(raw)
    sent = record.encode_injection(raw, obj, {**obj, "include": ["y"]})  # re-encoded: a changed key
    assert json.loads(sent) == {**obj, "include": ["y"]}


def test_a_row_that_cannot_be_built_is_kept_as_a_proxy_error(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(record, "build_row", broken)
    s = _state("openai.chat", CHAT_REQ, stream_raw=b"".join(CHAT_SSE))
    row = worker.build_call_row(s, None, CaptureOptions(), record.AttemptCounter())
    pa.Table.from_pylist([row], schema=CALL_LOG_SCHEMA)
    assert row["status"] == "proxy_error" and "a bug" in row["error"] and row["call_id"] == s.call_id
    assert _without_ids(row)


# -- 5. an error reply sent as an event stream ------------------------------------------------------
def test_an_error_status_with_an_event_stream_keeps_the_servers_message():
    row = _row("openai.chat", CHAT_REQ, b'data: {"error":{"message":"engine dead","code":500}}\n\n', http_status=500)
    assert row["status"] == "upstream_error" and row["error"].startswith("HTTP 500: ")
    assert "engine dead" in row["error"] and _without_ids(row)


# -- 6. a chat stream without [DONE] ---------------------------------------------------------------
def test_a_chat_stream_without_done_is_truncated_and_says_what_came():
    """Every token and the usage chunk came, but no ``[DONE]``: a cut right before it looks the
    same, so the call is not complete (vLLM always sends it); the row says what was missing."""
    row = _row("openai.chat", CHAT_REQ, CHAT_SSE[:-1] + [USAGE_CHUNK])
    assert row["status"] == "upstream_error" and _without_ids(row)
    assert row["error"] == f"{record.TRUNCATED}: finish_reason 'length' came, but no data: [DONE]"
    assert row["finish_reason"] == "length" and row["usage_completion_tokens"] == 2


@pytest.mark.parametrize("events", [
    CHAT_SSE[:-1],  # finish_reason but no usage chunk: a cut there looks the same
    CHAT_SSE[:2] + [USAGE_CHUNK],  # a usage chunk before any finish_reason
    CHAT_SSE[:-1] + [USAGE_CHUNK[:-2]],  # the usage chunk without its blank line: maybe cut
    CHAT_SSE[:-1] + [USAGE_CHUNK, CHAT_SSE[1]],  # more after the usage chunk
])
def test_a_chat_stream_without_done_is_never_ok(events):
    row = _row("openai.chat", CHAT_REQ, events)
    assert row["status"] == "upstream_error" and "truncated" in row["error"] and _without_ids(row)


def test_the_format_modules_report_server_errors_in_bodies():
    assert "boom" in openai_chat.parse_body({"error": {"message": "boom"}}).server_error
    assert "Overloaded" in anthropic_messages.parse_body(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}).server_error
    assert openai_responses.parse_response({"status": "incomplete"}).server_error is None
    assert openai_responses.parse_response({"status": "cancelled"}).server_error == \
        "the response ended with status cancelled"


def test_a_spliced_value_holding_a_lone_surrogate_is_written_as_its_escape() -> None:
    """A request value the capture re-encodes (Codex's ``include`` list) may hold a lone surrogate
    the client escaped: the splice writes the escape, not a UnicodeEncodeError."""
    from polar_train.capture.json_members import compact, splice_utf8

    data = b'{"include":["a"],"x":1}'
    value = json.loads('["\\ud83d"]')
    out = splice_utf8(data, data.decode(), [(11, 16, compact(value))])
    assert out == b'{"include":["\\ud83d"],"x":1}' and json.loads(out)["include"] == value


@pytest.mark.parametrize("n, noted", [(None, False), (1, False), ("1", False), (3, True), ("3.0", True)])
def test_a_chat_call_with_n_above_1_says_only_its_first_choice_is_recorded(n, noted):
    """n > 1 (a sampler asking for a group): the row holds choices[0]; its note names what is not
    there, as vLLM reads n (lax: "3.0" is 3)."""
    request = {**CHAT_REQ, **({} if n is None else {"n": n})}
    row = _row("openai.chat", request, CHAT_SSE)
    assert row["status"] == "ok" and row["completion_token_ids"] == CHAT_IDS
    if noted:
        assert row["error"] == ("n=3: only choices[0] is recorded; the other 2 choices' token ids and logprobs "
                                "are not (usage counts all of them)")
    else:
        assert row["error"] is None
