"""The stream tap: sees each response chunk as it passes and hands it on at once.

Per chunk it only decodes (if the upstream compressed despite our request) and appends the bytes
to the call's record (the row worker splits them into events later). With injection off that is
all: the chunk is returned unchanged, byte for byte. With injection on, complete SSE events are
split off incrementally and each one that carries an injected field loses it (a format's byte-level
fast path where it can prove the event's shape, else JSON parse and re-serialise); events without
one keep their exact bytes, and the client gets each event as soon as its last byte arrives.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from typing import Any

from .json_members import compact
from .redact import utf8
from .sse import SSESplitter, one_event, parse_event, serialize_event

log = logging.getLogger("polar_capture")

def _has_marker(raw: bytes) -> bool:
    """Whether an event may carry an injected field (their absence skips JSON parsing). Plain
    substring tests: each is one fast scan, cheaper than a regex alternation."""
    return (b"token_ids" in raw or b"logprobs" in raw or b"prompt_text" in raw or b"input_messages" in raw
            or b"output_messages" in raw)


def _single(coding: str) -> tuple[Any, Callable[[bytes], bytes], Callable[[], bool]]:
    """(decoder object, its decode function, whether its stream has ended) for one coding."""
    if coding in ("gzip", "x-gzip"):
        obj: Any = zlib.decompressobj(32 + zlib.MAX_WBITS)  # gzip or zlib, as mitmproxy reads gzip
        return obj, obj.decompress, lambda: obj.eof
    if coding == "deflate":
        obj = _Deflate()
        return obj, obj.decompress, lambda: obj.eof
    if coding == "br":
        import brotli

        obj = brotli.Decompressor()
        return obj, obj.process, obj.is_finished
    if coding == "zstd":
        try:
            from compression import zstd  # Python >= 3.14
        except ImportError:
            from backports import zstd  # what mitmproxy itself uses before 3.14

        obj = zstd.ZstdDecompressor()
        return obj, obj.decompress, lambda: obj.eof
    raise ValueError(f"unsupported content-encoding {coding!r}")


class _Deflate:
    """``deflate`` as mitmproxy reads it: zlib-wrapped as RFC 9110 says, else raw deflate (what
    many servers send under that name). The zlib header is checked on the first two bytes; until
    then the bytes are kept to start over as raw deflate."""

    __slots__ = ("_obj", "_head")

    def __init__(self) -> None:
        self._obj = zlib.decompressobj()
        self._head: bytes | None = b""

    def decompress(self, chunk: bytes) -> bytes:
        if self._head is None:
            return self._obj.decompress(chunk)
        head = self._head + chunk
        try:
            out = self._obj.decompress(chunk)
        except zlib.error:
            self._obj = zlib.decompressobj(-zlib.MAX_WBITS)
            self._head = None
            return self._obj.decompress(head)
        self._head = None if len(head) >= 2 else head
        return out

    @property
    def eof(self) -> bool:
        return self._obj.eof


class Decoder:
    """Incremental decoder for a ``content-encoding``: one coding (gzip, deflate, br, zstd) or a
    list of them (``gzip, br``, or the header sent twice), undone last first as RFC 9110 says;
    ``identity`` in the list is nothing to undo."""

    def __init__(self, encoding: str) -> None:
        codings = [c.strip().lower() for c in encoding.split(",")]
        self.encoding = ", ".join(c for c in codings if c)
        steps = [_single(c) for c in reversed(codings) if c and c != "identity"]
        if not steps:
            raise ValueError(f"no content-encoding to undo in {encoding!r}")
        self._ended = [end for _, _, end in steps]
        fns = [fn for _, fn, _ in steps]
        if len(fns) == 1:
            self.decode = fns[0]  # the usual case: one call per chunk, nothing around it
        else:
            self._fns = fns
            self.decode = self._chain

    def _chain(self, chunk: bytes) -> bytes:
        for fn in self._fns:
            chunk = fn(chunk)
        return chunk

    def decode(self, chunk: bytes) -> bytes:  # replaced per instance in __init__
        raise NotImplementedError

    @property
    def finished(self) -> bool:
        """Whether every coding's stream reached its end (False: the body was cut inside it)."""
        return all(end() for end in self._ended)


def decoder_for(encoding: str | None) -> Decoder | None:
    """The decoder of a ``content-encoding`` value (None: nothing to undo); ValueError for a
    coding it cannot undo."""
    if not encoding or all(c.strip().lower() in ("", "identity") for c in encoding.split(",")):
        return None
    return Decoder(encoding)


def supported_encoding(encoding: str | None) -> bool:
    try:
        decoder_for(encoding)
    except ValueError:
        return False
    return True


def decode_whole(body: bytes, encoding: str) -> bytes:
    """A whole body decoded (ValueError: it is not what its ``content-encoding`` says)."""
    decoder = decoder_for(encoding)
    if decoder is None:
        return body
    try:
        out = decoder.decode(body)
    except Exception as exc:
        raise ValueError(f"not {encoding}: {exc}") from None
    if not decoder.finished:
        raise ValueError(f"{encoding} stream cut short")
    return out


_BOM = b"\xef\xbb\xbf"
#: How an SSE stream starts (a field or a comment); a JSON body starts with ``{`` or ``[``.
_SSE_STARTS = (b"data:", b"event:", b":", b"id:", b"retry:")
_SNIFF_LIMIT = 64  # undecided after this many bytes (all blank): the content-type decides
_SSE, _BODY = "sse", "body"


def _sniff(head: bytes, labelled_sse: bool) -> str | None:
    """What the first bytes of a body say it is: ``_SSE``, ``_BODY`` (JSON or anything else
    that is not an event stream) or None (too few bytes yet). A body that starts with ``{`` or
    ``[`` is JSON whatever its label; otherwise a stream labelled text/event-stream is one, and an
    unlabelled (or mislabelled) one is if it starts as SSE does."""
    if len(head) < 3 and _BOM.startswith(head):
        return None
    text = (head[3:] if head.startswith(_BOM) else head).lstrip(b" \t\r\n")
    if not text:
        return None
    if text[0] in b"{[":
        return _BODY
    if labelled_sse:
        return _SSE
    for start in _SSE_STARTS:
        if text.startswith(start):
            return _SSE
        if start.startswith(text):
            return None
    return _BODY


class StreamTap:
    """A ``flow.response.stream`` callable for one call.

    ``strip`` (None: pass through) removes injected fields from a decoded JSON event in place and
    says whether it changed anything. ``rewrite`` is only allowed on an uncompressed stream or
    when the caller removed ``content-encoding`` (then ``decoder`` output is what the client gets).

    What the body is comes from its first bytes, once (``labelled_sse``: its content-type says
    text/event-stream): an event stream is split and stripped event by event as it passes; a JSON
    body (a server that answered a streamed request with one, or labelled it text/event-stream) is
    held whole when it is to be stripped, stripped at its end, and recorded as ``response_body``.
    A UTF-8 byte order mark before the first event is no part of it (the SSE spec drops it): not
    recorded, and handed on in front of the first event.
    """

    def __init__(self, state: Any, strip: Callable[[dict], bool] | None, decoder: Decoder | None,
                 deliver_decoded: bool, on_first_byte: Callable[[], None],
                 strip_bytes: Callable[[bytes], bytes | None] | None = None, labelled_sse: bool = True) -> None:
        #: Optional fast path of the format (raw event -> stripped event, None: use the JSON path).
        self.fast = strip_bytes
        self.state = state
        self.strip = strip
        self.decoder = decoder
        self.deliver_decoded = deliver_decoded
        self.splitter = SSESplitter()
        self.on_first_byte = on_first_byte
        self.seen_bytes = 0
        self.broken: str | None = None
        self.raw = state.stream_raw = bytearray()
        self.labelled_sse = labelled_sse
        self.mode: str | None = None  # _SSE, _BODY; None until the first bytes said which
        self._head = b""  # decoded bytes while the mode is undecided (held back when stripping)
        self._bom = False
        state.streamed = True

    def __call__(self, chunk: bytes) -> list[bytes] | bytes:
        """One upstream read in, what the client gets out (never ``b""``: mitmproxy would send it
        as an empty chunk, which ends a chunked body; "nothing yet" is ``[]``)."""
        if not self.seen_bytes and chunk:
            self.on_first_byte()
        self.seen_bytes += len(chunk)
        if not chunk:
            return self._finish()
        if self.broken is not None:
            return self._passthrough(chunk)
        if self.decoder is None:
            data = chunk
        else:
            try:
                data = self.decoder.decode(chunk)
            except Exception as exc:
                if not self._not_encoded(chunk, exc):
                    return self._undecodable(chunk, exc)
                data = chunk
        self.raw += data
        if self.mode is not _SSE:
            return self._not_sse(chunk, data)
        if self.strip is None:
            return chunk if not self.deliver_decoded else (data or [])
        return self._events(data)

    def _events(self, data: bytes) -> list[bytes] | bytes:
        held = b""  # on a failure: what the client has not been handed yet
        try:
            if not self.splitter.has_pending and one_event(data):
                out = self._rewrite(data)  # the usual read: exactly one whole event (what feed() would give)
            else:
                held = self.splitter.pending
                out = b"".join([self._rewrite(ev) for ev in self.splitter.feed(data)])
            return out or []
        except Exception as exc:  # never let the tap break the stream: pass the rest through
            log.exception("polar_capture: stream tap failed; passing the rest through unchanged")
            self.broken = repr(exc)
            self.state.fail("proxy_error", f"stream tap failed: {exc!r}")
            self.splitter = SSESplitter()
            rest = held + data
            return [rest] if rest else []

    def _not_sse(self, chunk: bytes, data: bytes) -> list[bytes] | bytes:
        """A read before the first bytes said what the body is, or of a body that is no stream."""
        passed = chunk if not self.deliver_decoded else data
        if self.mode is _BODY:
            return (passed or []) if self.strip is None else []  # stripped whole at the end
        head = self._head = self._head + data
        mode = _sniff(head, self.labelled_sse)
        if mode is None and len(head) < _SNIFF_LIMIT:
            return (passed or []) if self.strip is None else []
        out = self._decide(mode)
        return (passed or []) if self.strip is None else out

    def _decide(self, mode: str | None) -> list[bytes]:
        """Settle what the body is (None: as labelled); what of the held bytes the client gets."""
        # undecided (blank lines only so far): an event stream where it says so or the request
        # asked for one (a JSON body starts with "{" after at most a little whitespace)
        self.mode = mode = mode or (_SSE if self.labelled_sse or getattr(self.state, "stream", False) else _BODY)
        head, self._head = self._head, b""
        if head.startswith(_BOM):
            self._bom = True
            del self.raw[:3]  # the head is where the recording starts
            head = head[3:]
        if mode is _BODY:
            self.state.stream_raw = None
            self.state.response_body = self.raw  # bytes at the end
            return []
        if self.strip is None or not head:
            return [_BOM] if self._bom and self.strip is not None else []
        out = self._events(head)
        out = b"".join(out) if isinstance(out, list) else out
        return [_BOM + out] if self._bom else ([out] if out else [])

    def _passthrough(self, chunk: bytes) -> list[bytes] | bytes:
        """After a failure: every byte as it comes (decoded where the client was promised that)."""
        if self.decoder is None or not self.deliver_decoded:
            return chunk
        try:
            return self.decoder.decode(chunk) or []
        except Exception as exc:
            return self._undecodable(chunk, exc)

    def _not_encoded(self, chunk: bytes, exc: Exception) -> bool:
        """Whether the body's first read failed to decode because it is plain text under a
        ``content-encoding`` label (a server's mistake): then it is read as it is."""
        text = (chunk[3:] if chunk.startswith(_BOM) else chunk).lstrip(b" \t\r\n")
        if self.seen_bytes != len(chunk) or not (text[:1] in (b"{", b"[") or text.startswith(_SSE_STARTS)):
            return False
        enc = self.decoder.encoding
        log.warning("polar_capture: the upstream labelled a response content-encoding %r but sent it unencoded; "
                    "read as it came", enc)
        self.state.fail("upstream_error", f"response labelled content-encoding {enc!r} but not encoded ({exc})")
        self.decoder = None
        return True

    def _undecodable(self, chunk: bytes, exc: Exception) -> list[bytes] | bytes:
        """The upstream's encoded body broke (corrupt or not what its label says): from here on the
        client gets the upstream's bytes as they come, after every decoded byte not handed on yet.
        Never fewer bytes than the upstream sent: a client that decodes fails as it would without
        the proxy. The upstream is at fault: one line, no traceback."""
        enc = self.decoder.encoding if self.decoder is not None else "?"
        decoded = len(self.raw)
        log.warning("polar_capture: the upstream's %s-encoded response body cannot be decoded after %d bytes "
                    "(%s); the rest passes through undecoded", enc, self.seen_bytes - len(chunk), exc)
        self.state.fail("upstream_error", f"response body not valid {enc} after {decoded} decoded bytes: {exc}")
        self.broken = repr(exc)
        self.decoder = None
        if not self.deliver_decoded:
            return chunk
        if self.strip is None:
            held = b""  # every decoded byte was handed on as it came
        elif self.mode is None:
            held = self._head
        elif self.mode is _BODY:
            held = (_BOM if self._bom else b"") + bytes(self.raw)
        else:
            held = self.splitter.pending
        self.splitter = SSESplitter()
        return [held + chunk]

    def _finish(self) -> list[bytes]:
        """End of the upstream's body: hand on an unterminated trailing event, stripped where it
        is whole (a server that omits the last blank line; some SSE clients still dispatch it),
        as it came where it is cut short (no client can parse it)."""
        if self.broken is None and self.decoder is not None and self.seen_bytes and not self.decoder.finished:
            log.warning("polar_capture: the upstream's %s-encoded response body ended inside its encoding "
                        "(cut short)", self.decoder.encoding)
            self.state.fail("upstream_error", f"response body ended inside its {self.decoder.encoding} encoding "
                                              "(cut short)")
        head: list[bytes] = []
        if self.mode is None and self.broken is None:
            head = self._decide(_sniff(self._head, self.labelled_sse))
        if self.strip is None or self.broken is not None:
            return []  # every byte was handed on as it came
        if self.mode is _BODY:
            self.state.response_body = bytes(self.raw)
            return self._whole_body()
        out = head + [self._last(ev, True) for ev in self.splitter.end()]
        if self.splitter.has_pending:
            out.append(self._last(self.splitter.pending, False))
        return [b"".join(out)] if out else []

    def _last(self, pending: bytes, whole: bool) -> bytes:
        try:
            out = self._rewrite(pending)
        except Exception:  # a cut event the format's fast path cannot read
            return pending
        if out is pending or whole:
            return out
        # the rewrite ends an event with a blank line; this one had none, and gets none
        return out.rstrip(b"\r\n") + pending[len(pending.rstrip(b"\r\n")):]

    def _whole_body(self) -> list[bytes]:
        """A JSON body that passed through the tap, stripped as a non-streamed reply is."""
        body = bytes(self.raw)
        out = body
        try:
            obj = json.loads(body)
            if isinstance(obj, dict) and self.strip(obj):
                out = utf8(compact(obj))
        except ValueError:
            pass
        except Exception as exc:  # a bug in stripping: the client gets the body as it came
            log.exception("polar_capture: stripping a body failed; passing it through unchanged")
            self.state.fail("proxy_error", f"stream tap failed: {exc!r}")
        out = (_BOM + out) if self._bom else out
        return [out] if out else []

    def _rewrite(self, raw: bytes) -> bytes:
        if self.fast is not None:
            out = self.fast(raw)
            if out is not None:
                return out
        if not _has_marker(raw):
            return raw
        ev = parse_event(raw)
        if ev.data is None or ev.data == "[DONE]":
            return raw
        try:
            obj = json.loads(ev.data)
        except ValueError:
            return raw
        if not isinstance(obj, dict) or not self.strip(obj):
            return raw
        return serialize_event(raw, ev, obj)
