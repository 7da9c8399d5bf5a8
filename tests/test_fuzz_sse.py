"""Fuzz the SSE splitter and the stream tap: chunk boundaries must never change what comes out.

The proxy sees a stream as TCP reads cut anywhere (inside a UTF-8 character, between ``\\r`` and
``\\n``, inside ``data:``). Whatever the cut, the splitter must yield the same events as for one
chunk, lose no byte, and the tap must hand the client the same bytes.
"""

from __future__ import annotations

import json
import re

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polar_train.capture.sse import SSESplitter, loads_text, one_event, parse_event, parse_event_lines, split_all
from polar_train.capture.tap import StreamTap


def vllm_streams() -> dict[str, bytes]:
    """One stream per format in vLLM 0.32's shapes (built like shared/vllm-0.32-wire shows them)."""
    from tests.test_fuzz_formats import chat_stream, messages_stream, responses_stream

    args = (["Hel", "lo ", "wör", "ld\u2028!"], [9419, 11, 12, 13], [-0.5, -1.0, -2.0, -0.25], [248045, 846, 198])
    return {"chat": chat_stream(*args), "responses": responses_stream(*args), "messages": messages_stream(*args)}


STREAMS = vllm_streams()
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(st.sampled_from([b"\n", b"\r", b"\n\n", b"data: x", b"event: e", b"{}", b"\xe2\x80\xa8"]), max_size=8)
       | st.binary(max_size=40))
def test_one_event_is_what_the_splitter_says_of_a_read(data) -> None:
    """The tap's shortcut for a read that is one whole event agrees with the splitter: it yields
    exactly that read as its one event and keeps nothing (reads with a CR take the splitter)."""
    if isinstance(data, list):
        data = b"".join(data)
    for read in (data, data + b"\n\n"):
        s = SSESplitter()
        splitter_says = s.feed(read) == [read] and not s.has_pending and b"\r" not in read
        assert one_event(read) == splitter_says, read


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (sorted, deduplicated, clipped)."""
    idx = sorted({min(max(p, 0), len(data)) for p in points})
    bounds = [0, *idx, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def feed_all(chunks: list[bytes]) -> tuple[list[bytes], bytes]:
    s = SSESplitter()
    events: list[bytes] = []
    for c in chunks:
        events += s.feed(c)
    return events, s.pending


line_endings = st.sampled_from([b"\n", b"\r\n", b"\r"])
field_text = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=30)


@st.composite
def sse_streams(draw) -> bytes:
    """Well-formed SSE with one line ending per stream (what servers send), any field text."""
    nl = draw(line_endings)
    events = []
    for _ in range(draw(st.integers(0, 8))):
        lines = []
        if draw(st.booleans()):
            lines.append(b"event: " + draw(field_text).encode())
        for _ in range(draw(st.integers(1, 3))):
            lines.append(b"data: " + draw(field_text).encode())
        if draw(st.booleans()):
            lines.append(b": comment " + draw(field_text).encode())
        events.append(nl.join(lines) + nl + nl)
    tail = draw(st.sampled_from([b"", b"data: trunc", b"data: x" + nl]))
    return b"".join(events) + tail


@FUZZ
@given(data=sse_streams(), points=st.lists(st.integers(0, 2000), max_size=40))
def test_fuzz_splitter_any_boundaries_same_events(data: bytes, points: list[int]) -> None:
    whole_events, whole_pending = split_all(data)
    events, pending = feed_all(cut(data, points))
    assert events == whole_events
    assert pending == whole_pending
    assert b"".join(events) + pending == data  # not a byte lost or duplicated
    for ev in events:
        assert parse_event(ev).data is not None or ev.strip(b"\r\n").startswith(b":")


@FUZZ
@given(data=st.binary(max_size=600), points=st.lists(st.integers(0, 600), max_size=60))
def test_fuzz_splitter_random_bytes_lose_nothing(data: bytes, points: list[int]) -> None:
    events, pending = feed_all(cut(data, points))
    assert b"".join(events) + pending == data
    whole_events, whole_pending = split_all(data)
    assert (events, pending) == (whole_events, whole_pending)
    for ev in events:
        parse_event(ev)  # never raises on arbitrary bytes


def terminator_split(data: bytes) -> tuple[list[bytes], bytes]:
    """The reference: events end at each leftmost blank line, scanned once: two line endings in a
    row by the SSE spec's rules (CRLF, LF or CR; a CRLF is one), CR CR at once; one that ends in a
    CR other than CR CR at the very end waits (a LF may still come)."""
    events, start = [], 0
    for m in re.finditer(rb"\r\r|(?>\r\n|\n|\r)(?>\r\n|\n|\r)", data):
        if m.end() == len(data) and data.endswith(b"\r") and m.group() != b"\r\r":
            break
        events.append(data[start:m.end()])
        start = m.end()
    return events, data[start:]


line_soup = st.lists(st.sampled_from([b"\n", b"\r", b"\r\n", b"\n\n", b"data: x", b"{}"]), max_size=30).map(b"".join)


@FUZZ
@given(data=line_soup, points=st.lists(st.integers(0, 200), max_size=30))
@example(data=b"data: x\r\n\r\n", points=[10])  # the CR came in an earlier read than the end
def test_fuzz_splitter_is_the_terminator_scan(data: bytes, points: list[int]) -> None:
    """Any line endings, carriage returns arriving in any read (the splitter switches between its
    line-feed walk and the terminator regex as they come and go): the events of one scan."""
    assert feed_all(cut(data, points)) == terminator_split(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _outcome(f, text: str):
    try:
        return "ok", json.dumps(f(text), sort_keys=True)
    except ValueError as exc:
        return "error", type(exc).__name__


@FUZZ
@given(value=json_values, before=st.sampled_from(["", " ", "\n\t", "\ufeff", "x"]),
       after=st.sampled_from(["", " ", "\r\n", "}", ",1", "x"]), cut_at=st.integers(0, 400))
def test_fuzz_loads_text_is_json_loads(value, before: str, after: str, cut_at: int) -> None:
    """The row worker's event decoder gives json.loads' value, or fails where json.loads fails:
    for valid values with any whitespace or garbage around them, and for values cut short."""
    text = before + json.dumps(value) + after
    for candidate in (text, text[:cut_at]):
        assert _outcome(loads_text, candidate) == _outcome(json.loads, candidate)


#: Bytes that matter to SSE (line breaks, colons, a second data field, invalid UTF-8) among any bytes.
sse_bytes = st.lists(st.sampled_from([b"a", b"\n", b"\r", b"\r\n", b":", b" ", b"data: ", b"event: ", b"\xff",
                                      b"\xe2\x80", b"\xe2\x80\xa8", b"{}"]) | st.binary(max_size=6),
                     max_size=20).map(b"".join)


def mostly(usual: bytes, *others: bytes):
    """``usual`` (the shape servers send, which the shortcuts take) four times in five."""
    return st.sampled_from([usual] * 4 * len(others) + list(others))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=sse_bytes, prefix=mostly(b"data: ", b"data:", b"data:  ", b"Data: "),
       end=mostly(b"\n\n", b"\r\n\r\n", b"\n", b"\r\r"), name=st.none() | sse_bytes,
       field=mostly(b"event: ", b"event:", b"event:  ", b"Event: ", b": ", b"id: "),
       nl=mostly(b"\n", b"\r\n", b"\r"))
def test_fuzz_event_fast_paths_equal_general_parse(payload: bytes, prefix: bytes, end: bytes, name: bytes | None,
                                                   field: bytes, nl: bytes) -> None:
    """``parse_event``'s shortcuts (one ``data:`` line; one ``event:`` line and one ``data:`` line)
    give what the line-by-line grammar gives, for any bytes in the name and the data (invalid
    UTF-8, line breaks, colons) and near-miss field names and line endings."""
    raw = (b"" if name is None else field + name + nl) + prefix + payload + end
    assert parse_event(raw) == parse_event_lines(raw)


@FUZZ
@given(points=st.lists(st.integers(0, 8000), max_size=80))
def test_fuzz_real_vllm_streams_split_anywhere(points: list[int]) -> None:
    for data in STREAMS.values():
        assert feed_all(cut(data, points)) == split_all(data)


class _State:
    """The attributes of a CallState the tap touches."""

    def __init__(self) -> None:
        self.stream_raw = None
        self.streamed = False
        self.failed: list[str] = []

    def fail(self, status: str, error: str) -> None:
        self.failed.append(f"{status}: {error}")


def run_tap(chunks: list[bytes], strip) -> tuple[bytes, list[bytes], _State]:
    state = _State()
    tap = StreamTap(state, strip, None, False, lambda: None)
    out = []
    for c in [*chunks, b""]:
        got = tap(c)
        out.extend(got if isinstance(got, list) else [got])
    return b"".join(out), split_all(bytes(state.stream_raw))[0], state


@FUZZ
@given(points=st.lists(st.integers(0, 8000), max_size=60))
def test_fuzz_tap_output_independent_of_boundaries(points: list[int]) -> None:
    """With stripping (injection on) and without: the client's bytes never depend on the cuts."""
    from polar_train.capture import openai_chat, openai_responses

    for name, module, asked in (("chat", openai_chat, {}), ("responses", openai_responses, {})):
        data = STREAMS[name]
        strip = lambda obj, m=module, a=asked: m.strip(obj, a)  # noqa: E731
        whole_out, whole_events, _ = run_tap([data], strip)
        out, events, state = run_tap(cut(data, points), strip)
        assert out == whole_out and events == whole_events and not state.failed
        injected = b'"prompt_token_ids": [' if name == "chat" else b'"output_messages": ['
        assert injected in data  # the upstream sent them ...
        assert injected not in out and injected.replace(b" ", b"") not in out  # ... the client never sees them
        passthrough, _, _ = run_tap(cut(data, points), None)
        assert passthrough == data  # injection off: byte for byte


json_members_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=10)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=st.dictionaries(st.text(max_size=4), json_members_text, max_size=5), seps=st.sampled_from(
    [(",", ":"), (", ", ": "), (" ,\n", " :\t"), ("\r\n,", ":  ")]), ascii_only=st.booleans(), cut=st.integers(0, 400),
    insert=st.sampled_from(["", ",", "}", "x", "\"", " ", ":", "]"]), dup=st.booleans())
def test_fuzz_json_members_agree_with_json_loads(obj, seps, ascii_only, cut, insert, dup) -> None:
    """members() accepts exactly the objects json.loads accepts (spaced, repeated keys, cut or
    damaged anywhere), gives json's values, and each member's span is its value as written."""
    from polar_train.capture.json_members import as_dict, members

    text = json.dumps(obj, separators=seps, ensure_ascii=ascii_only)
    if dup and obj:
        key = next(iter(obj))
        text = text[:-1] + seps[0] + json.dumps(key) + seps[1] + "1}"
    cut %= len(text) + 1
    text = text[:cut] + insert + text[cut:]
    try:
        want = json.loads(text)
    except ValueError:
        want = None
    try:
        found, end = members(text, 0)
    except ValueError:
        assert not isinstance(want, dict) or not text.startswith("{")  # the object must start where asked
        return
    assert json.loads(text[:end]) == as_dict(found)  # what it read is one whole object
    rest = text[end:]
    if rest.strip(" \t\n\r"):
        assert want is None  # trailing garbage: json.loads refuses the whole text
    else:
        assert as_dict(found) == want
    for m in found:
        assert json.loads(text[m.start:m.end]) == m.value
