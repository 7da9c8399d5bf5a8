"""What the client receives through the stream tap when the upstream frames, encodes or labels
its answer unusually: SSE framed by Content-Length, raw deflate, a body that lies about its
content-encoding or breaks inside it, several content-encodings, an event stream labelled JSON (or
not at all) and JSON labelled an event stream, the line endings the SSE spec allows, a byte order
mark, lone surrogates. The client always gets every byte in time, and never an injected field.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import brotli
import httpx
import pytest

from polar_train.capture import openai_chat, record
from polar_train.capture.sse import SSESplitter, serialize_event, parse_event, split_all
from polar_train.capture.tap import Decoder, StreamTap, decode_whole
from tests.support.capture_wire import WIRE
from tests.support.mitm import read_calls, rid, start_mitm
from tests.test_capture_units import _chat_flow, _configured_addon

INJ = WIRE["chat_inj_sse"].encode()
EVENTS = [e + b"\n\n" for e in INJ.split(b"\n\n") if e]
LEAKS = (b'"token_ids":[', b'"prompt_token_ids":[', b'"logprob":-')
BOM = b"\xef\xbb\xbf"


def leaked(out: bytes) -> list[bytes]:
    return [m for m in LEAKS if m in out]


def sse_objs(out: bytes) -> list:
    """The JSON of each event's data, by the spec's line rules (any line endings, a BOM)."""
    text = out.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    objs = []
    for block in text.split("\n\n"):
        data = [ln[5:].lstrip(" ") for ln in block.split("\n") if ln.startswith("data:")]
        if data and data != ["[DONE]"]:
            objs.append(json.loads("\n".join(data)))
    return objs


def _state() -> record.CallState:
    return record.CallState("openai.chat", "POST", "h", "/v1/chat/completions", "c", None,  # type: ignore[arg-type]
                            record.utcnow(), "http://h")


ASKED = openai_chat.inject({"messages": []}).asked
STRIPPED = [openai_chat.strip(o, ASKED) and o or o for o in sse_objs(INJ)]


def chat_tap(decoder=None, labelled_sse=True, fast=True):
    state = _state()
    tap = StreamTap(state, lambda o: openai_chat.strip(o, ASKED), decoder, decoder is not None, lambda: None,
                    openai_chat.event_stripper(ASKED) if fast else None, **({} if labelled_sse else {"labelled_sse": False}))
    return tap, state


def each(tap, chunks) -> list[bytes]:
    """What the client gets for each read (and the end, last)."""
    outs = []
    for c in [*chunks, b""]:
        got = tap(c)
        outs.append(b"".join(got) if isinstance(got, list) else got)
    return outs


def _requested(addon, body: dict):
    """A chat flow whose request went through the addon's request hooks (injected as it would be)."""
    f = _chat_flow(body)
    addon.requestheaders(f)
    asyncio.run(addon.request(f))
    return f


def compress(obj, parts):
    return [obj.compress(p) + obj.flush(zlib.Z_SYNC_FLUSH) for p in parts] + [obj.flush()]


# -- 1. SSE framed by Content-Length ---------------------------------------------------------
def test_content_length_goes_when_the_stream_may_change(tmp_path):
    from mitmproxy.http import Headers, Response

    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": [], "stream": True})
        f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
        f.response.headers["content-length"] = str(len(INJ))
        addon.responseheaders(f)
        assert "content-length" not in f.response.headers  # stripped events are shorter
        out = b"".join(each(f.response.stream, EVENTS))
        assert len(out) < len(INJ) and not leaked(out)
        addon.done()
    with _configured_addon(tmp_path / "off", polar_strip=False) as addon:  # nothing changes: kept
        f = _requested(addon, {"model": "m", "messages": [], "stream": True})
        f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
        f.response.headers["content-length"] = str(len(INJ))
        addon.responseheaders(f)
        assert f.response.headers["content-length"] == str(len(INJ))
        addon.done()


class _Upstream(BaseHTTPRequestHandler):
    """Answers by the request's model: ``sse-cl`` an event stream framed by Content-Length,
    ``sse-as-json`` an event stream labelled application/json whose second event waits until the
    test has read the first one through the proxy (``gate``)."""

    protocol_version = "HTTP/1.1"
    gate = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        model = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]
        self.send_response(200)
        if model == "sse-cl":
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(INJ)))
            self.end_headers()
            for ev in EVENTS:
                self.wfile.write(ev)
                self.wfile.flush()
            return
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, ev in enumerate(EVENTS):
            if i == 1:
                self.gate.wait(20)  # released by the test once the first event reached it
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    m = start_mitm(tmp_path_factory.mktemp("framing"), modes=[f"reverse:http://127.0.0.1:{server.server_address[1]}"],
                   options={"polar_flush_seconds": "0.2"})
    yield m
    m.stop()
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(120)
def test_e2e_a_content_length_framed_stream_ends_for_the_client(proxy):
    """Through the real proxy: the client's read ends with the body (it hung until its read
    timeout while the upstream's Content-Length, now too long, was forwarded)."""
    r = rid()
    resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=httpx.Timeout(30, read=10),
                      json={"model": "sse-cl", "messages": [], "stream": True}, headers={"x-polar-rollout": r})
    assert resp.status_code == 200 and not leaked(resp.content)
    assert [o["choices"] for o in sse_objs(resp.content)] == [o["choices"] for o in STRIPPED]


@pytest.mark.timeout(120)
def test_e2e_an_event_stream_labelled_json_streams_stripped(proxy):
    """A streamed request answered by SSE labelled application/json: the first event reaches the
    client (stripped) before the upstream sends the second one."""
    r = rid()
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=httpx.Timeout(30, read=15),
                      json={"model": "sse-as-json", "messages": [], "stream": True},
                      headers={"x-polar-rollout": r}) as resp:
        got = b""
        it = resp.iter_bytes()
        while b"\n\n" not in got:
            got += next(it)
        _Upstream.gate.set()
        got += b"".join(it)
    assert not leaked(got)
    assert [o["choices"] for o in sse_objs(got)] == [o["choices"] for o in STRIPPED]
    deadline_rows = [row for row in _rows(proxy, r)]
    assert deadline_rows[0]["status"] == "ok", deadline_rows[0]


def _rows(proxy, r):
    from tests.support.mitm import poll

    poll(lambda: any(row["rollout_id"] == r for row in read_calls(proxy.out_dir)), 30, "the row")
    return [row for row in read_calls(proxy.out_dir) if row["rollout_id"] == r]


# -- 2. raw deflate ---------------------------------------------------------------------------
@pytest.mark.parametrize("wbits", [zlib.MAX_WBITS, -zlib.MAX_WBITS], ids=["zlib", "raw"])
def test_deflate_with_or_without_its_zlib_header_is_decoded(wbits):
    tap, state = chat_tap(Decoder("deflate"))
    chunks = compress(zlib.compressobj(6, zlib.DEFLATED, wbits), EVENTS)
    outs = each(tap, [c[:1] for c in chunks[:1]] + [chunks[0][1:]] + chunks[1:])  # even the header cut
    out = b"".join(outs)
    assert state.status is None and not leaked(out)
    assert sse_objs(out) == STRIPPED and bytes(state.stream_raw) == INJ


# -- 3. a body that is not what its content-encoding says ------------------------------------
def test_a_body_labelled_gzip_but_plain_is_read_as_it_came(caplog):
    tap, state = chat_tap(Decoder("gzip"))
    with caplog.at_level(logging.WARNING, logger="polar_capture"):
        out = b"".join(each(tap, EVENTS))
    assert sse_objs(out) == STRIPPED and not leaked(out)
    assert state.status == "upstream_error" and "not encoded" in state.error
    (line,) = [r for r in caplog.records if r.name == "polar_capture"]
    assert line.levelno == logging.WARNING and line.exc_info is None  # the upstream's fault: no traceback


def test_a_gzip_stream_corrupt_midway_hands_on_every_byte(caplog):
    chunks = compress(zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS), EVENTS)
    bad = bytes(b ^ 0xFF for b in chunks[2])
    tap, state = chat_tap(Decoder("gzip"))
    with caplog.at_level(logging.WARNING, logger="polar_capture"):
        outs = each(tap, chunks[:2] + [bad] + chunks[3:])
    out = b"".join(outs)
    assert sse_objs(b"".join(outs[:2])) == STRIPPED[:2]  # decoded and stripped up to the break
    assert out.endswith(bad + b"".join(chunks[3:]))  # then the upstream's bytes, none dropped
    assert state.status == "upstream_error" and "not valid gzip" in state.error
    (line,) = [r for r in caplog.records if r.name == "polar_capture"]
    assert line.levelno == logging.WARNING and line.exc_info is None


def test_a_gzip_stream_cut_inside_its_encoding_is_an_upstream_error():
    chunks = compress(zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS), EVENTS)
    tap, state = chat_tap(Decoder("gzip"))
    out = b"".join(each(tap, chunks[:2]))
    assert sse_objs(out) == STRIPPED[:2]
    assert state.status == "upstream_error" and "cut short" in state.error
    whole, whole_state = chat_tap(Decoder("gzip"))
    each(whole, chunks)
    assert whole_state.status is None


def test_a_read_that_decodes_to_nothing_is_no_empty_chunk():
    """``b""`` from the tap is an empty chunk to mitmproxy: the end of a chunked body."""
    state = _state()
    tap = StreamTap(state, None, Decoder("gzip"), True, lambda: None)
    gz = gzip.compress(INJ)
    assert tap(gz[:5]) == []  # the gzip header alone: nothing decoded yet
    assert b"".join(each(tap, [gz[5:]])) == INJ


# -- 4. what the body is: sniffed from its first bytes ---------------------------------------
@pytest.mark.parametrize("ctype", ["application/json", None])
def test_a_streamed_request_answered_with_unlabelled_sse_streams_stripped(tmp_path, ctype):
    from mitmproxy.http import Headers, Response

    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": [], "stream": True})
        f.response = Response.make(200, b"", Headers(**({"content_type": ctype} if ctype else {})))
        addon.responseheaders(f)
        assert callable(f.response.stream)
        outs = each(f.response.stream, EVENTS)
        assert all(outs[:-1])  # each event as it came
        assert sse_objs(b"".join(outs)) == STRIPPED and not leaked(b"".join(outs))
        state = addon.calls[f.id]
        assert bytes(state.stream_raw) == INJ
        asyncio.run(addon.response(f))
        addon.done()


def test_a_json_body_labelled_event_stream_is_stripped_whole(tmp_path):
    from mitmproxy.http import Headers, Response

    body = WIRE["chat_inj"].encode()
    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": []})
        f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
        addon.responseheaders(f)
        outs = each(f.response.stream, [body[:300], body[300:]])
        state = addon.calls[f.id]
        assert outs[:2] == [b"", b""]  # held: a JSON body is stripped whole
        assert json.loads(outs[2]) == json.loads(WIRE["chat_plain"]) | {"id": json.loads(outs[2])["id"],
                                                                       "created": json.loads(outs[2])["created"]}
        assert not leaked(outs[2])
        assert state.response_body == body and state.stream_raw is None  # recorded as the body it is
        addon.done()


def test_an_error_body_to_a_streamed_request_passes_whole():
    tap, state = chat_tap(labelled_sse=False)
    err = b'{"error": {"message": "bad", "code": 400}}'
    assert b"".join(each(tap, [err[:10], err[10:]])) == err
    assert state.response_body == err and state.stream_raw is None



@pytest.mark.parametrize("status", [429, 500])
def test_an_error_answer_to_a_streamed_request_keeps_its_content_length(tmp_path, status):
    """A 429 to a streamed request lost its content-length (mitmproxy then ends the body by closing
    the connection: an SDK's retry needed a new one). Error answers are read whole, as they came."""
    from mitmproxy.http import Headers, Response

    err = b'{"error": {"message": "slow down", "code": %d}}' % status
    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": [], "stream": True})
        f.response = Response.make(status, err, Headers(content_type="application/json"))
        addon.responseheaders(f)
        assert not f.response.stream and f.response.headers["content-length"] == str(len(err))
        asyncio.run(addon.response(f))
        addon.done()


@pytest.mark.parametrize("body", [b'{"model": "m", "stream": true, "messages": []}',
                                  b'{"model": "m", "stream":"true", "messages": []}'])
def test_an_unlabelled_stream_streams_where_nothing_is_injected(tmp_path, body):
    """With polar_inject=false (and for every Messages call) the proxy does not parse the request:
    an event stream labelled application/json was held whole until its end, and its row said
    "not a JSON object". The request's stream flag, read off its bytes, now says it streams."""
    from mitmproxy.http import Headers, Response
    from mitmproxy.test import tflow, tutils

    with _configured_addon(tmp_path, polar_inject=False) as addon:
        f = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=body), resp=False)
        addon.requestheaders(f)
        asyncio.run(addon.request(f))
        f.response = Response.make(200, b"", Headers(content_type="application/json"))
        addon.responseheaders(f)
        assert callable(f.response.stream)
        outs = each(f.response.stream, EVENTS)
        assert outs[:-1] == EVENTS  # each event as it came, unchanged
        asyncio.run(addon.response(f))
        addon.done()


def test_an_unlabelled_stream_that_starts_with_many_blank_lines_is_still_one():
    """Past the sniffing limit with only blank lines seen, an unlabelled answer to a streamed
    request was taken for a JSON body: held to its end, and the injected fields reached the client."""
    tap, state = chat_tap(labelled_sse=False)
    state.stream = True
    out = b"".join(each(tap, [b"\n" * 70, *EVENTS]))
    assert sse_objs(out) == STRIPPED and not leaked(out)


# -- 5. line endings -------------------------------------------------------------------------
@pytest.mark.parametrize("nl,blank", [(b"\n", b"\r\n"), (b"\r\n", b"\n"), (b"\r", b"\r\n"), (b"\n", b"\r"),
                                      (b"\r\n", b"\r")])
def test_every_line_ending_mix_the_spec_allows_ends_an_event(nl, blank):
    """``data: x\\n\\r\\n``: the LF ends the line, the CRLF is the blank line (and so on)."""
    events = [e[:-2] + nl + blank for e in EVENTS]
    tap, state = chat_tap()
    outs = each(tap, events)
    waits = blank == b"\r"  # "\n\r" may still become "\n\r\n": the event waits for the next byte
    assert all(outs[1:-1] if waits else outs[:-1])  # else each event as soon as its last byte came
    assert sse_objs(b"".join(outs)) == STRIPPED and not leaked(b"".join(outs))
    found, pending = split_all(b"".join(events))
    assert len(found) == len(events) - waits and b"".join(found) + pending == b"".join(events)


def test_splitter_reads_crlf_as_one_line_ending_across_reads():
    s = SSESplitter()
    assert s.feed(b"data: a\r") == [] and s.feed(b"\ndata: b\r\n") == []  # "\r" + "\n": no blank line
    assert s.feed(b"\r\n") == [b"data: a\r\ndata: b\r\n\r\n"]
    assert s.feed(b"data: c\n\r") == [] and s.feed(b"\ndata: d") == [b"data: c\n\r\n"]
    assert parse_event(b"data: c\n\r\n").data == "c"


# -- 6. a byte order mark --------------------------------------------------------------------
def test_a_bom_before_the_first_event_is_not_part_of_it():
    tap, state = chat_tap()
    outs = each(tap, [BOM + EVENTS[0], *EVENTS[1:]])
    out = b"".join(outs)
    assert outs[0].startswith(BOM) and not leaked(out)  # handed on, in front of the stripped event
    assert sse_objs(out) == STRIPPED and bytes(state.stream_raw) == INJ  # recorded without it
    split, _ = chat_tap()
    assert each(split, [BOM[:2], BOM[2:] + EVENTS[0]])[1].startswith(BOM + b"data: ")


# -- 7. several content-encodings ------------------------------------------------------------
def test_a_list_of_content_encodings_is_undone_last_first():
    gz = compress(zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS), EVENTS)
    br = brotli.Compressor()
    both = [br.process(c) + br.flush() for c in gz] + [br.finish()]
    tap, state = chat_tap(Decoder("gzip, br"))
    out = b"".join(each(tap, both))
    assert sse_objs(out) == STRIPPED and not leaked(out) and state.status is None
    assert decode_whole(gzip.compress(gzip.compress(INJ)), "gzip, gzip") == INJ


@pytest.mark.parametrize("fields", [[(b"content-encoding", b"gzip, gzip")],
                                    [(b"content-encoding", b"gzip"), (b"Content-Encoding", b"gzip")]])
def test_a_stream_in_two_encodings_streams_decoded_and_stripped(tmp_path, fields):
    from mitmproxy.http import Headers, Response

    once = compress(zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS), EVENTS)
    twice = compress(zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS), once)
    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": [], "stream": True})
        f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
        f.response.headers.fields = (*f.response.headers.fields, *fields)  # not through make(): it would encode
        addon.responseheaders(f)
        assert "content-encoding" not in f.response.headers
        out = b"".join(each(f.response.stream, twice))
        assert sse_objs(out) == STRIPPED and not leaked(out)
        assert addon.calls[f.id].status is None
        addon.done()


def test_a_non_streamed_body_in_two_encodings_is_stripped(tmp_path):
    from mitmproxy.http import Response

    body = WIRE["chat_inj"].encode()
    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": []})
        f.response = Response.make(200, b"", {"content-type": "application/json"})
        f.response.headers["content-encoding"] = "gzip, br"
        f.response.raw_content = brotli.compress(gzip.compress(body))
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
        assert not leaked(f.response.content) and json.loads(f.response.content)["choices"]
        addon.done()


def test_a_streamed_call_over_polar_max_body_mb_is_recorded_as_streamed(tmp_path):
    """A probe: a streamed call whose request passed polar_max_body_mb was recorded stream false."""
    with _configured_addon(tmp_path, polar_max_body_mb=1) as addon:
        f = _requested(addon, {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * (1 << 21)}]})
        state = addon.calls[f.id]
        assert state.request_error.endswith("exceeds polar_max_body_mb") and state.stream is True
        addon.done()


def test_a_redirect_is_named_in_its_row(tmp_path):
    """A probe: /v1/chat/completions/ (a trailing slash) got the server's 307 to its own address,
    which the client followed past the proxy; the row said "empty response body"."""
    from mitmproxy.http import Response

    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": []})
        f.response = Response.make(307, b"", {"location": "http://127.0.0.1:8000/v1/chat/completions?key=sk-x"})
        addon.responseheaders(f)
        state = addon.calls[f.id]
        asyncio.run(addon._response(f, state))
        assert state.status == "upstream_error" and state.error.startswith(
            "HTTP 307 redirect to http://127.0.0.1:8000/v1/chat/completions: a client that follows it may bypass")
        assert "sk-x" not in state.error
        addon.done()


def test_a_non_streamed_body_in_x_gzip_or_an_unknown_encoding(tmp_path, caplog):
    """A probe: a non-streamed answer labelled x-gzip (RFC 9110's alias of gzip), which mitmproxy's
    get_content leaves as it came, reached the client unstripped and its row said "malformed JSON";
    an encoding no one can undo said so neither."""
    from mitmproxy.http import Response

    body = WIRE["chat_inj"].encode()
    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": []})
        f.response = Response.make(200, b"", {"content-type": "application/json"})
        f.response.headers["content-encoding"] = "x-gzip"
        f.response.raw_content = gzip.compress(body)
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
        assert not leaked(f.response.content) and json.loads(f.response.content)["choices"]
        assert "content-encoding" not in f.response.headers
        g = _requested(addon, {"model": "m", "messages": []})
        g.response = Response.make(200, b"", {"content-type": "application/json"})
        g.response.headers["content-encoding"] = "compress"
        g.response.raw_content = b"\x1f\x9d..."
        addon.responseheaders(g)
        state = addon.calls[g.id]
        with caplog.at_level(logging.WARNING, logger="polar_capture"):
            asyncio.run(addon._response(g, state))
        assert state.status == "upstream_error" and state.error.startswith("unsupported content-encoding 'compress'")
        assert "cannot decode, passed through unread" in caplog.text
        addon.done()


def test_an_encoding_it_cannot_decode_streams_through_with_a_row_error(tmp_path, caplog):
    from mitmproxy.http import Headers, Response

    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": [], "stream": True})
        f.response = Response.make(200, b"", Headers(content_type="text/event-stream"))
        f.response.headers["content-encoding"] = "compress"
        with caplog.at_level(logging.WARNING, logger="polar_capture"):
            addon.responseheaders(f)
        state = addon.calls[f.id]
        assert f.response.stream is True  # streamed on as it came, not held whole
        assert state.status == "upstream_error" and "reached the client unstripped" in state.error
        assert "injected fields reached the client" in caplog.text
        addon.done()


# -- 8. lone surrogates ----------------------------------------------------------------------
def test_an_event_with_a_lone_surrogate_is_still_stripped():
    obj = json.loads(EVENTS[1][6:])
    obj["choices"][0]["delta"]["content"] = "\ud83d"
    raw = b"data: " + json.dumps(obj).encode() + b"\n\n"  # ensure_ascii: the escape as servers send it
    assert b"\\ud83d" in raw
    tap, state = chat_tap()
    out = b"".join(each(tap, [EVENTS[0], raw, *EVENTS[2:]]))
    assert not leaked(out) and state.status is None
    assert b"\\ud83d" in out and sse_objs(out)[1]["choices"][0]["delta"]["content"] == "\ud83d"
    assert serialize_event(raw, parse_event(raw), obj).decode("utf-8")  # valid UTF-8


def test_a_body_with_a_lone_surrogate_is_still_stripped(tmp_path):
    from mitmproxy.http import Response

    body = WIRE["chat_inj"].encode().replace(b'"content":" Cao', b'"content":"\\ud83d Cao', 1)
    with _configured_addon(tmp_path) as addon:
        f = _requested(addon, {"model": "m", "messages": []})
        f.response = Response.make(200, body, {"content-type": "application/json"})
        addon.responseheaders(f)
        asyncio.run(addon.response(f))
        assert not leaked(f.response.content)
        assert json.loads(f.response.content)["choices"][0]["message"]["content"] == "\ud83d Cao Tuesday"
        addon.done()
