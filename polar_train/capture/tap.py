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

from .sse import SSESplitter, one_event, parse_event, serialize_event

log = logging.getLogger("polar_capture")

def _has_marker(raw: bytes) -> bool:
    """Whether an event may carry an injected field (their absence skips JSON parsing). Plain
    substring tests: each is one fast scan, cheaper than a regex alternation."""
    return (b"token_ids" in raw or b"logprobs" in raw or b"prompt_text" in raw or b"input_messages" in raw
            or b"output_messages" in raw)


class Decoder:
    """Incremental decoder for one ``content-encoding`` (gzip, deflate, br, zstd)."""

    def __init__(self, encoding: str) -> None:
        enc = encoding.strip().lower()
        self.encoding = enc
        if enc in ("gzip", "x-gzip"):
            self._obj: Any = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self._obj = zlib.decompressobj()
        elif enc == "br":
            import brotli

            self._obj = brotli.Decompressor()
        elif enc == "zstd":
            try:
                from compression import zstd  # Python >= 3.14
            except ImportError:
                from backports import zstd  # what mitmproxy itself uses before 3.14

            self._obj = zstd.ZstdDecompressor()
        else:
            raise ValueError(f"unsupported content-encoding {encoding!r}")

    def decode(self, chunk: bytes) -> bytes:
        if self.encoding == "br":
            return self._obj.process(chunk)
        return self._obj.decompress(chunk)


def supported_encoding(encoding: str | None) -> bool:
    return (encoding or "").strip().lower() in ("gzip", "x-gzip", "deflate", "br", "zstd")


class StreamTap:
    """A ``flow.response.stream`` callable for one call.

    ``strip`` (None: pass through) removes injected fields from a decoded JSON event in place and
    says whether it changed anything. ``rewrite`` is only allowed on an uncompressed stream or
    when the caller removed ``content-encoding`` (then ``decoder`` output is what the client gets).
    """

    def __init__(self, state: Any, strip: Callable[[dict], bool] | None, decoder: Decoder | None,
                 deliver_decoded: bool, on_first_byte: Callable[[], None],
                 strip_bytes: Callable[[bytes], bytes | None] | None = None) -> None:
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
            return chunk if not self.deliver_decoded else self._safe_decode(chunk)
        data = held = b""  # on a failure: what the client has not been handed yet
        try:
            data = chunk if self.decoder is None else self.decoder.decode(chunk)
            self.raw += data
            if self.strip is None:
                return data if self.deliver_decoded else chunk
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
            if self.strip is None and not self.deliver_decoded:
                return chunk
            self.splitter = SSESplitter()
            rest = held + data
            return [rest] if rest else []

    def _safe_decode(self, chunk: bytes) -> bytes:
        try:
            return self.decoder.decode(chunk) if self.decoder is not None else chunk
        except Exception:
            return b""

    def _finish(self) -> list[bytes]:
        """End of the upstream's body: hand on an unterminated trailing event, stripped where it
        is whole (a server that omits the last blank line; some SSE clients still dispatch it),
        as it came where it is cut short (no client can parse it)."""
        if self.strip is None or self.broken is not None:
            return []  # every byte was handed on as it came
        pending = self.splitter.pending
        if not pending:
            return []
        try:
            out = self._rewrite(pending)
        except Exception:  # a cut event the format's fast path cannot read
            return [pending]
        if out is pending:
            return [pending]
        # the rewrite ends an event with a blank line; this one had none, and gets none
        return [out.rstrip(b"\r\n") + pending[len(pending.rstrip(b"\r\n")):]]

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
