"""mitmproxy addon: record every model call of an unmodified harness, token-exact, into Parquet.

    mitmdump -s addons/polar_capture.py --set polar_out=data/captures [--set polar_tokenizer=DIR]

Thin on purpose: the hooks collect bytes and timestamps and hand finished calls to the row worker,
a child process that parses them and writes Parquet (``polar_train.capture.worker``); nothing slow
runs on mitmproxy's event loop, and no exception escapes a hook (a bug becomes a logged
``proxy_error`` row, the traffic flows on).
See docs/capture.md.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import re
import signal
import sys
import threading
import uuid
from pathlib import Path

from mitmproxy import ctx, exceptions, http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy.mode_specs import ReverseMode, Socks5Mode

try:
    import polar_train  # noqa: F401
except ModuleNotFoundError:  # a checkout (or an installed copy) this interpreter does not see
    _here = Path(__file__).resolve()
    sys.path.insert(0, str(next((p for p in _here.parents if (p / "polar_train" / "__init__.py").is_file()),
                                _here.parents[1])))
    try:
        import polar_train  # noqa: F401,F811
    except ModuleNotFoundError:  # a copy of this file away from a checkout, under a mitmdump without it
        raise ModuleNotFoundError(
            f"polar_capture: the polar_train package is not importable by this mitmdump ({sys.executable}) "
            f"nor found above {_here.parent}: run the mitmdump of the environment polar-train is installed in, "
            "with the addon it ships (mitmdump -s \"$(polar-train addon)\")", name="polar_train") from None

from polar_train.capture import handover

handover.forget_failed_load()  # (mitmproxy's stale "None" addon of a load that failed before this one)

# before any name this file imports from the package: after a `git pull`, a new name (one the old
# modules cached in this process lack) was an ImportError that hid this message
_changed = handover.changed_modules()
if _changed:  # a reload after the package changed on disk (git pull): it would run the old modules
    raise ImportError(f"polar_train changed on disk since mitmdump started ({', '.join(_changed[:3])}"
                      f"{', ...' if len(_changed) > 3 else ''}); restart mitmdump to use it")

from polar_train.capture import record
from polar_train.capture.blind_spots import WATCHED, blind_spots
from polar_train.capture import fields as raw_headers
from polar_train.capture.identity import CAPTURE_MARK, CAPTURE_TARGET, PROBE_HEADER, identity_headers
from polar_train.capture.json_members import compact
from polar_train.capture.options import OPTION_SPECS, CaptureOptions, unusable_deferred
from polar_train.capture.outdir import output_of_another_command
from polar_train.capture.request_walk import splice_injection, walk_request
from polar_train.capture.redact import utf8
from polar_train.capture.tap import StreamTap, decode_whole, decoder_for, supported_encoding
from polar_train.capture.worker import RowWorker
from polar_train.terminal import escape_unencodable_output, one_line_records, printable
from polar_train.tokenizer import holds_tokenizer
from polar_train.wire.lax import lax_true

log = logging.getLogger("polar_capture")
one_line_records(log)

#: Hosted APIs reject unknown request fields: never inject there (their calls are rendered instead).
HOSTED_HOSTS = ("api.openai.com", "chatgpt.com", "api.anthropic.com", "openrouter.ai",
                "generativelanguage.googleapis.com")
_INLINE_PARSE_LIMIT = 1 << 20  # bodies above 1 MiB are parsed on a thread
#: Bodies below 4 KiB are parsed whole: there json.loads + re-encoding cost less than the member
#: walk's Python per member (~16 vs 10-13 us), and there is no long conversation to skip.
_WALK_MIN_BYTES = 4 << 10
#: A request's ``"stream": true`` read off its bytes, where the proxy does not parse the request
#: (nothing to inject): only to know that its answer is a stream whatever its label (a hint; the
#: row worker reads the real value). A quote inside a JSON string is escaped, so an unescaped one
#: starts a key. The pattern starts with its literal (``re`` then skips to each ``"stream"``):
#: with a look-behind first it tried every byte - 1.3 ms per 100 KB on the event loop, for every
#: Messages call (Claude Code sends ``stream`` last, after its tools and history).
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*(?:true|"true")')
_BACKSLASH = 0x5C
_LOG_LEVELS = {"error": logging.ERROR, "warn": logging.WARNING, "info": logging.INFO, "alert": logging.INFO,
               "debug": logging.DEBUG}


_PROBE = PROBE_HEADER.encode("ascii")
_PROBE_KEY = "polar_capture_probe"

_HOSTED_SUFFIXES = tuple("." + h for h in HOSTED_HOSTS) + (".openai.azure.com",)


def _stream_true(body: bytes) -> bool:
    """Whether the raw request body holds the key ``"stream"`` set to true (:data:`_STREAM_TRUE`)."""
    return any(m.start() == 0 or body[m.start() - 1] != _BACKSLASH for m in _STREAM_TRUE.finditer(body))


def _model_call_drops(opts: CaptureOptions) -> frozenset[bytes]:
    """Headers a model call loses before it leaves: the identity-only ones and accept-encoding
    (the stream is parsed as it passes)."""
    return identity_headers(opts.rollout_header, opts.task_header) | {b"accept-encoding"}


def _is_hosted(host: str) -> bool:
    host = host.lower()
    return host in HOSTED_HOSTS or host.endswith(_HOSTED_SUFFIXES)


def _checked_credentials(flow: http.HTTPFlow) -> str | None:
    """The proxy credentials mitmproxy's own ``proxyauth`` option checked, as the Basic value they
    came in: that addon runs first and removes ``Proxy-Authorization`` from the request. The row
    worker reads the rollout from it and scrubs the password from what it stores, as it does
    without ``proxyauth``."""
    checked = flow.metadata.get("proxyauth")
    if not isinstance(checked, tuple) or len(checked) != 2 or not all(isinstance(c, str) for c in checked):
        return None
    return "Basic " + base64.b64encode(f"{checked[0]}:{checked[1]}".encode("utf-8")).decode("ascii")


def _client_side(flow: http.HTTPFlow, msg: str) -> bool:
    m = msg.lower()
    if "peer closed" in m:
        # h11's words for a body cut short by either peer: a client's request body, or the
        # upstream's (chunked) response body; the side is the one whose connection has closed
        return not flow.client_conn.state & ConnectionState.CAN_READ
    return "client" in m


def _changed_since(req: http.Request, as_read: tuple) -> str | None:
    """What of the request a later addon changed after this one read it (None: nothing)."""
    body, host, port, path = as_read
    changed = []
    if req.raw_content is not body and req.raw_content != body:
        changed.append("body")
    if (req.host, req.port) != (host, port):
        changed.append(f"server ({host}:{port} became {req.host}:{req.port})")
    if req.path != path:
        changed.append("path")
    return ", ".join(changed) or None


def _strip_body(body: bytes, module, asked: dict) -> bytes | None:
    """The non-streamed body without injected fields (None: leave it as it is)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not module.strip(obj, asked):
        return None
    return utf8(compact(obj))  # a lone surrogate escaped as it came (no UTF-8 form)


def _content(resp: http.Response, strict: bool = False) -> bytes:
    """``get_content`` for any content-encoding the capture undoes: several (``gzip, br``, or the
    header sent twice) and ``x-gzip``, which mitmproxy leaves undecoded, each undone last first;
    as it came where it fails."""
    raw = resp.raw_content or b""
    try:
        return decode_whole(raw, resp.headers.get("content-encoding", ""))
    except ValueError:
        return raw


def _listen_hosts() -> list[str]:
    """The host each mode listens on: its own (``--mode regular@0.0.0.0:8080``) or ``listen_host``."""
    from mitmproxy.proxy.mode_specs import ProxyMode

    hosts = []
    for spec in ctx.options.mode or ["regular"]:
        try:
            hosts.append(ProxyMode.parse(spec).listen_host(ctx.options.listen_host))
        except Exception:  # mitmproxy refuses a bad spec itself
            hosts.append(ctx.options.listen_host)
    return hosts


def _stop_on_hangup() -> None:
    """SIGHUP (a closed terminal, a dropped ssh session) stops the proxy as SIGTERM does: mitmdump
    takes only SIGINT and SIGTERM, and the default ended it at once - its open calls got no row and
    no word. Left alone where the caller ignores it (``nohup``) or set it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL:
        return
    master = ctx.master
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, master.shutdown)
    except (NotImplementedError, RuntimeError):  # no running loop here, or a platform without it
        pass


def _close_off_the_loop(writer: RowWorker) -> None:
    """Close a row worker on a thread of its own: it drains what it holds (seconds with a tokenizer
    to load), and on the event loop every connection would stand still meanwhile. Not a daemon:
    the process waits for it before it exits."""
    threading.Thread(target=writer.close, name="polar-capture-close", daemon=False).start()


class PolarCapture:
    def __init__(self) -> None:
        self.opts = CaptureOptions()
        self.writer: RowWorker | None = None
        self.calls: dict[str, record.CallState] = {}
        #: Proxy credentials of each open tunnel's CONNECT (raw; the row worker reads them).
        self.connect_auth: dict[str, str] = {}
        #: Model endpoints' WebSocket handshakes waiting for their answer (see _websocket_answered).
        self.websockets: dict[str, record.CallState] = {}
        #: What each open call's request was as the addon left it (body, host, port, path): a later
        #: addon that changed it (modify_body, map_remote, an intercept edit) is seen at its answer.
        self._as_read: dict[str, tuple] = {}
        live = handover.take()  # the instance before a reload of this file: go on where it stopped
        if live is not None:
            self.opts, self.writer, self.calls, self.connect_auth = live.opts, live.writer, live.calls, live.connect_auth
            self.websockets, self._as_read = live.websockets, live.as_read
        self._drop_headers = _model_call_drops(self.opts)
        self._identity_headers = identity_headers(self.opts.rollout_header, self.opts.task_header)
        self._running = False
        #: ``--set polar_...`` values mitmproxy could not use (logged at load; see unusable_deferred).
        self._unusable: list[str] = []

    # -- setup -------------------------------------------------------------------------------
    def load(self, loader) -> None:
        escape_unencodable_output()  # an é in polar_out, ASCII stdout: our log line stopped mitmdump at start
        handover.stand_down(loader.master)  # loaded after a failed reload: record again
        for name, typ, default, help_text in OPTION_SPECS:
            loader.add_option(name, typ, default, help_text)
        self._unusable = unusable_deferred(loader.master.options)
        for problem in self._unusable:
            log.error("polar_capture: %s", problem)  # at startup: mitmdump exits (as for a bad value)

    def configure(self, updated) -> None:
        if self._running and WATCHED & set(updated):  # (at start: said once in running)
            for note in blind_spots(ctx.options, only=set(updated)):
                log.warning("polar_capture: %s", note)
        if not any(name.startswith("polar_") or name == "ssl_insecure" for name in updated):
            return  # (ssl_insecure: the /tokenize check trusts the upstream as the proxy does)
        if self._unusable and not self._running:
            return  # mitmdump exits on the error logged in load: no worker, no output folder
        try:
            self._configure()
        except exceptions.OptionsError as exc:
            if self._running:
                raise  # a change while running: mitmproxy refuses it, the old values stay
            # At startup one clear line: mitmproxy exits on an error logged before it runs, where a
            # raised one would also print its traceback (it reports a script's errors that way).
            log.error("polar_capture: %s", exc)

    def _configure(self) -> None:
        try:
            opts = CaptureOptions.from_mitmproxy(ctx.options)
        except ValueError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        if opts.tokenizer:
            tdir = Path(opts.tokenizer).expanduser()
            if tdir.is_file():
                raise exceptions.OptionsError(f"polar_tokenizer: {tdir} is a file; name the model or tokenizer "
                                              "folder it is in")
            if not tdir.is_dir() or not holds_tokenizer(tdir):
                raise exceptions.OptionsError(
                    f"polar_tokenizer: {tdir} is not a tokenizer folder (no tokenizer.json)")
        if (problem := output_of_another_command(Path(opts.out).expanduser())) is not None:
            raise exceptions.OptionsError(problem)
        if self.writer is None or opts.worker_settings() != self.opts.worker_settings():
            old = self.writer
            level = _LOG_LEVELS.get(str(getattr(ctx.options, "termlog_verbosity", "info")), logging.INFO)
            writer = RowWorker(opts, level)
            try:
                writer.start()
            except OSError as exc:
                raise exceptions.OptionsError(f"polar_out: cannot write to {opts.out}/calls: {exc}") from None
            self.writer = writer
            if old is not None:
                _close_off_the_loop(old)
                if self._running:  # (at start: said in running)
                    log.info("polar_capture: writing calls to %s", Path(opts.out).expanduser() / "calls")
        self.opts = opts
        self._drop_headers = _model_call_drops(opts)
        self._identity_headers = identity_headers(opts.rollout_header, opts.task_header)

    def running(self) -> None:
        self._running = True
        # The proxy's startup heap (modules, classes, options: long-lived) leaves the cyclic GC's
        # view: the addon allocates per event, and every full collection would walk all of it
        # again (measured: proxy CPU 2-7 % lower under load; bench/README.md). Once per process.
        handover.freeze_startup_heap()
        log.info("polar_capture: writing calls to %s", Path(self.opts.out).expanduser() / "calls")
        if getattr(ctx.options, "stream_large_bodies", None):
            # mitmproxy streams any body past it while reading (no hook can keep it whole)
            log.warning("polar_capture: stream_large_bodies is %s: a model call whose request or non-streamed "
                        "reply is larger passes unrecorded (a proxy_error row says so) and a reply keeps the "
                        "token ids the addon asked for", ctx.options.stream_large_bodies)
        for note in blind_spots(ctx.options):
            log.warning("polar_capture: %s", note)
        _stop_on_hangup()
        if getattr(ctx.options, "server", True) and any(host in ("", "0.0.0.0", "::") for host in _listen_hosts()):
            log.warning("polar_capture: the proxy listens on all interfaces; prompts and keys of every "
                        "rollout pass through it - use --listen-host 127.0.0.1 (and no other host in "
                        "--mode ...@HOST:PORT) unless you mean it")

    # -- connections -------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            value = flow.request.headers.get("proxy-authorization") or _checked_credentials(flow)
            if value:  # the tunnel's identity: its requests carry none of their own
                self.connect_auth[flow.client_conn.id] = value
        except Exception:
            log.exception("polar_capture: http_connect failed")

    def client_disconnected(self, client) -> None:
        self.connect_auth.pop(client.id, None)

    # -- requests ----------------------------------------------------------------------------
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            self._requestheaders(flow)
        except Exception as exc:
            log.exception("polar_capture: requestheaders failed")
            state = self.calls.get(flow.id)
            if state is not None:
                state.fail("proxy_error", f"requestheaders hook failed: {exc!r}")

    def _requestheaders(self, flow: http.HTTPFlow) -> None:
        """Only what must happen before the request leaves: identity headers (and, for a model
        call, ``accept-encoding``) removed in one pass over the raw fields, which the call keeps
        for the row worker to resolve identity, secrets and host from (~0.1 ms per call less on
        the event loop than resolving them here)."""
        req = flow.request
        headers = req.headers
        fields = headers.fields
        api = record.detect_api(req.method, req.path)
        if flow.response is not None:  # answered by the proxy itself (proxyauth's 407): no model call
            return
        if not flow.live:  # read from a file (-r): a past call, never sent through this proxy (replays are live)
            return
        if api is None:
            if raw_headers.values(fields, _PROBE)[0] is not None:  # polar-train harness's check: mark the answer
                flow.metadata[_PROBE_KEY] = True
            # meant for us, never the upstream (the identity headers too: docs/capture.md says so, for every request)
            headers.fields = raw_headers.without(fields, self._identity_headers)
            ws_api = record.websocket_api(req.method, req.path, fields)
            if ws_api is not None:  # model calls about to go over a WebSocket: see _websocket_answered
                self.websockets[flow.id] = self._call_state(flow, ws_api, fields)
            return
        headers.fields = raw_headers.without(fields, self._drop_headers)
        self.calls[flow.id] = self._call_state(flow, api, fields)

    def _call_state(self, flow: http.HTTPFlow, api: str, fields: tuple) -> record.CallState:
        """A new call's state from its request head, ``fields`` as the client sent them."""
        req = flow.request
        conn_id = flow.client_conn.id
        port = None
        if self.opts.port_rollouts:
            try:
                port = flow.client_conn.proxy_mode.listen_port(ctx.options.listen_port)
            except Exception:
                port = None
        scheme, host, req_port = req.scheme, req.host, req.port
        base = f"{scheme}://{host}" + ("" if req_port == (443 if scheme == "https" else 80) else f":{req_port}")
        # the credentials proxyauth checked on this request itself (a tunnel's are in connect_auth,
        # below the request's own rollout header); in reverse mode (a server's Basic auth) and SOCKS5
        # (per connection) they rank as a tunnel's too, below the header and the API key
        connect_auth = self.connect_auth.get(conn_id)
        checked = _checked_credentials(flow) if connect_auth is None else None
        if checked is not None:
            if isinstance(flow.client_conn.proxy_mode, (ReverseMode, Socks5Mode)):
                connect_auth = checked
            elif not raw_headers.values(fields, b"proxy-authorization")[0]:
                fields = (*fields, (b"proxy-authorization", checked.encode("latin-1", "replace")))
        return record.CallState(
            api=api, method=req.method, host=host, path=req.path, client_conn_id=conn_id, identity=None,
            started_at=record.utcnow(), upstream_base=base,
            # a replayed request (client replay, mitmweb's Replay) keeps its flow's id: a call of its own
            call_id=flow.id.replace("-", "") if flow.is_replay != "request" else uuid.uuid4().hex,
            header_fields=fields, connect_auth=connect_auth, listen_port=port)

    async def request(self, flow: http.HTTPFlow) -> None:
        state = self.calls.get(flow.id)
        if state is None:
            return
        try:
            await self._request(flow, state)
            req = flow.request
            self._as_read[flow.id] = (req.raw_content, req.host, req.port, req.path)
        except Exception as exc:
            log.exception("polar_capture: request hook failed")
            state.fail("proxy_error", f"request hook failed: {exc!r}")

    async def _request(self, flow: http.HTTPFlow, state: record.CallState) -> None:
        req = flow.request
        if req.raw_content is None and req.stream:  # stream_large_bodies, past its limit mid-body
            state.fail("proxy_error", _STREAMED_BY_MITMPROXY.format(what="request"))
            _say_streamed_once()
            return
        (encoding,) = raw_headers.values(req.headers.fields, b"content-encoding")
        as_labelled = encoding is not None
        try:
            body = (req.raw_content if encoding is None else req.get_content(strict=True)) or b""
        except ValueError:  # not in its label's encoding (plain JSON labelled gzip: servers ignore the label)
            body, as_labelled = req.raw_content or b"", False  # an injected body was compressed: a 400 (a probe)
        if len(body) > self.opts.max_body_mb << 20:
            state.request_error = f"request body of {len(body)} bytes exceeds polar_max_body_mb"
            state.stream = _stream_true(body)  # (a streamed call's row said stream false: a probe)
            return
        state.request_body = body  # parsed again, hashed and counted (attempt) by the row worker
        module = record.FORMATS[state.api]
        inject = self.opts.inject and module.INJECTS and not _is_hosted(flow.request.host)
        if not inject:  # nothing to change: the row worker alone reads it, off the event loop
            state.request_unread = True
            state.stream = _stream_true(body)  # a stream labelled JSON still streams
            return
        big = len(body) > _INLINE_PARSE_LIMIT
        echoes = getattr(module, "REQUEST_ECHOED", None)
        # a format whose requests repeat members call after call: read member by member, repeats skipped
        walkable = echoes is not None and _WALK_MIN_BYTES <= len(body) and not big
        walked = walk_request(body, echoes) if walkable else None
        if walked is not None:
            obj = walked.obj
        else:
            try:
                obj = await asyncio.to_thread(json.loads, body) if big else json.loads(body)
            except (ValueError, RecursionError) as exc:  # (nested past Python's limit: the server's 400)
                obj = None
                state.request_error = record.not_json(exc)
        if not isinstance(obj, dict):
            state.request_error = state.request_error or record.NOT_AN_OBJECT
            return
        state.stream = lax_true(obj.get("stream"))  # vLLM streams on "true" too
        inj = module.inject(obj)
        if inj.changed:
            new = splice_injection(walked, inj.body) if walked is not None else None
            if new is None and walked is not None:  # not a splice (a skipped member changed): the old way
                obj = json.loads(body)
                inj = module.inject(obj)
            if new is None:
                new = (await asyncio.to_thread(record.encode_injection, body, obj, inj.body) if big
                       else record.encode_injection(body, obj, inj.body))
            if not as_labelled:
                req.raw_content = new  # as the client sent it: unencoded
                req.headers.fields = raw_headers.with_body_length(req.headers.fields, len(new))
            else:
                req.content = new  # re-encoded as the client sent it
            state.injected = True
            state.asked = inj.asked

    # -- responses ---------------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = self.calls.get(flow.id)
        if state is None or flow.response is None:
            if flow.response is not None and flow.metadata.get(_PROBE_KEY):
                # the check learns the capture proxy passed it on, and in which mode it listens (a
                # reverse-mode port sends every request to its own target and refuses CONNECT)
                flow.response.headers[CAPTURE_MARK] = getattr(flow.client_conn.proxy_mode, "type_name", "1")
                host = f"[{flow.request.host}]" if ":" in flow.request.host else flow.request.host
                flow.response.headers[CAPTURE_TARGET] = f"{flow.request.scheme}://{host}:{flow.request.port}"
            return
        try:
            self._responseheaders(flow, state)
        except Exception as exc:
            log.exception("polar_capture: responseheaders failed")
            state.fail("proxy_error", f"responseheaders hook failed: {exc!r}")

    def _responseheaders(self, flow: http.HTTPFlow, state: record.CallState) -> None:
        as_read = self._as_read.pop(flow.id, None)
        if as_read is not None:
            state.request_changed = _changed_since(flow.request, as_read)
        resp = flow.response
        state.http_status = resp.status_code
        ctype, enc_raw = raw_headers.values(resp.headers.fields, b"content-type", b"content-encoding")
        labelled_sse = ctype is not None and b"text/event-stream" in ctype.lower()
        if not labelled_sse and not (state.stream and 200 <= resp.status_code < 300):
            # (an error answer to a streamed request is read whole and passes as it came, its
            # content-length kept: the client's connection stays open for its retry)
            state.first_byte_at = record.utcnow()
            return
        # labelled an event stream, or the answer to a streamed request (whatever its label): the
        # tap reads its first bytes to tell an event stream from a JSON body
        enc = (enc_raw or b"").decode("latin-1")
        try:
            decoder = decoder_for(enc)
        except ValueError:
            self._unreadable_stream(flow, state, enc)
            return
        module = record.FORMATS[state.api]
        strip = strip_bytes = None
        if state.injected and self.opts.strip:
            asked = state.asked
            strip = functools.partial(module.strip, asked=asked)
            if hasattr(module, "event_stripper"):
                strip_bytes = module.event_stripper(asked)
        deliver_decoded = False
        if strip is not None:
            # the body may change: its length (and, decoded, its encoding) is no longer the upstream's;
            # without content-length the client reads to the end of the chunked body or the close
            if decoder is not None:
                del resp.headers["content-encoding"]
                deliver_decoded = True
            if "content-length" in resp.headers:
                del resp.headers["content-length"]

        def first_byte() -> None:
            state.first_byte_at = record.utcnow()

        resp.stream = StreamTap(state, strip, decoder, deliver_decoded, first_byte, strip_bytes, labelled_sse)

    def _unreadable_stream(self, flow: http.HTTPFlow, state: record.CallState, enc: str) -> None:
        """A stream in a content-encoding the capture cannot undo (the request went without
        accept-encoding: the upstream chose it unasked): it streams on as it came, unrecorded."""
        self._unreadable(state, enc)
        state.streamed = True
        flow.response.stream = True

    def _unreadable(self, state: record.CallState, enc: str) -> None:
        """A response in a content-encoding the capture cannot undo: passed on as it came, said in
        the log and in the row (with whether the injected fields reached the client)."""
        unstripped = state.injected and self.opts.strip
        log.warning("polar_capture: a response in content-encoding %r, which the capture cannot decode, passed "
                    "through unread%s", enc, "; the injected fields reached the client" if unstripped else "")
        state.fail("upstream_error", f"unsupported content-encoding {enc!r}: response not read"
                   + ("; the injected fields reached the client unstripped" if unstripped else ""))

    async def response(self, flow: http.HTTPFlow) -> None:
        state = self.calls.get(flow.id)
        if state is None:
            if self.websockets:
                self._websocket_answered(flow)
            return
        try:
            await self._response(flow, state)
        except Exception as exc:
            log.exception("polar_capture: response hook failed")
            state.fail("proxy_error", f"response hook failed: {exc!r}")
        finally:
            self._finalize(flow, state)

    async def _response(self, flow: http.HTTPFlow, state: record.CallState) -> None:
        resp = flow.response
        if resp is None:
            return
        state.http_status = resp.status_code
        if 300 <= resp.status_code < 400:  # (its row said "empty response body")
            where = resp.headers.get("location", "").split("?", 1)[0]  # (a query string may hold a key)
            state.fail("upstream_error", f"HTTP {resp.status_code} redirect to {where or 'nowhere'}: a client that "
                       "follows it may bypass the proxy, unrecorded (a base URL or path ending in '/'?)")
            return
        tap = resp.stream
        if isinstance(tap, StreamTap) and not tap.seen_bytes and resp.raw_content:
            state.streamed, state.stream_raw = False, None  # the body came whole, past the tap: read it so
        if state.streamed:
            return
        if resp.raw_content is None and resp.stream:  # stream_large_bodies, past its limit mid-body
            state.fail("proxy_error", _STREAMED_BY_MITMPROXY.format(what="response"))
            _say_streamed_once()
            return
        big = len(resp.raw_content or b"") > _INLINE_PARSE_LIMIT
        enc = resp.headers.get("content-encoding", "")
        if enc and not supported_encoding(enc):  # (it was read as it came: "malformed JSON", unsaid)
            self._unreadable(state, enc)
            return
        # ours, not mitmproxy's get_content: it undoes a list of codings (``gzip, br``) and x-gzip too,
        # which mitmproxy leaves as they came (a good call's row then said "malformed JSON")
        read = functools.partial(_content, resp) if enc else resp.get_content
        body = (await asyncio.to_thread(read, strict=False) if big else read(strict=False)) or b""
        state.response_body = body
        if state.injected and self.opts.strip and 200 <= resp.status_code < 300 and body:
            module = record.FORMATS[state.api]
            new = (await asyncio.to_thread(_strip_body, body, module, state.asked) if big
                   else _strip_body(body, module, state.asked))
            if new is not None:
                if "content-encoding" in resp.headers:
                    del resp.headers["content-encoding"]
                resp.content = new

    def error(self, flow: http.HTTPFlow) -> None:
        state = self.calls.get(flow.id)
        if state is None:
            if self.websockets:
                self.websockets.pop(flow.id, None)  # a handshake that got no answer: nothing went over it
            return
        try:
            as_read = self._as_read.pop(flow.id, None)
            if as_read is not None:  # map_remote to a host that does not answer, say
                state.request_changed = _changed_since(flow.request, as_read)
            msg = flow.error.msg if flow.error else "unknown error"
            waited = (record.utcnow() - state.started_at).total_seconds()
            idle_limit = float(ctx.options.tcp_timeout)
            client_side = _client_side(flow, msg)
            if client_side and state.http_status is None and waited >= 0.95 * idle_limit:
                # mitmproxy's inactivity watchdog (tcp_timeout) closed a call the upstream never answered
                state.fail("upstream_error", f"no response from the upstream within tcp_timeout ({idle_limit:g} s)")
            elif client_side and state.streamed:
                # complete if the stream already carried its final event (Codex leaves then); the row
                # worker sees the whole stream and decides
                state.client_error = msg
            elif client_side:
                state.fail("client_disconnected", msg)
            else:
                state.fail("upstream_error", msg)
        except Exception as exc:
            log.exception("polar_capture: error hook failed")
            state.fail("proxy_error", f"error hook failed: {exc!r}")
        finally:
            self._finalize(flow, state)

    # -- WebSocket sessions ------------------------------------------------------------------
    def _websocket_answered(self, flow: http.HTTPFlow) -> None:
        """A model endpoint's WebSocket handshake was answered. Refused (vLLM has no such
        transport; Codex then falls back to HTTP): nothing is lost. Accepted: the model calls that
        follow pass unrecorded (the capture reads HTTP/SSE only), so the session gets a
        ``proxy_error`` row when it ends, and the log says so, rather than vanishing unseen."""
        state = self.websockets.pop(flow.id, None)
        if state is None or flow.websocket is None:
            return
        try:
            state.http_status = flow.response.status_code  # (set: flow.websocket follows a 101 answer)
            state.fail("proxy_error", _WEBSOCKET_UNRECORDED)
            self.calls[flow.id] = state  # finalized by websocket_end, or at shutdown as any open call
            _say_websocket_once(state.host, state.path)
        except Exception:
            log.exception("polar_capture: recording a WebSocket session failed")

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        state = self.calls.get(flow.id)
        if state is None:
            return
        try:
            ws = flow.websocket
            sent = sum(1 for m in ws.messages if m.from_client) if ws is not None else 0
            state.error = f"{state.error} ({sent} message{'s' if sent != 1 else ''} from the client)"
        except Exception:
            log.exception("polar_capture: websocket_end failed")
        finally:
            self._finalize(flow, state)

    # -- rows --------------------------------------------------------------------------------
    def _finalize(self, flow: http.HTTPFlow | None, state: record.CallState) -> None:
        if state.finalized:
            return
        state.finalized = True
        if flow is not None:
            self.calls.pop(flow.id, None)
            self._as_read.pop(flow.id, None)
        state.finished_at = record.utcnow()
        if self.writer is not None:
            self.writer.submit(state)  # the proxy holds no reference to it any more

    def _reloading(self) -> bool:
        """Whether ``done`` comes from mitmproxy reloading this file (its script manager, still
        registered, holds this instance) rather than from shutdown or the script's removal."""
        if not self._running or not _in_script_reload():  # a failed start, shutdown, the script's removal
            return False
        try:
            if ctx.master.should_exit.is_set():
                return False
            return any(self in (getattr(getattr(a, "ns", None), "addons", None) or [])
                       for a in list(ctx.master.addons.lookup.values()))
        except Exception:
            return False

    def done(self) -> None:
        if self._reloading():
            live = handover.Live(self.opts, self.writer, self.calls, self.connect_auth, self.websockets,
                                 self._as_read)
            handover.hand_over(live)
            log.info("polar_capture: reloading: %d calls in flight and the row worker go on", len(self.calls))
            try:  # a new file that does not load takes nothing: then end as at shutdown, off the loop
                asyncio.get_running_loop().call_soon(self._close_unless_taken, live)
            except RuntimeError:
                self._close_unless_taken(live)
            return
        try:
            for flow_id, state in list(self.calls.items()):
                state.fail("proxy_error", "proxy shut down before the call finished")
                self.calls.pop(flow_id, None)
                self._finalize(None, state)
            if self.writer is not None:
                self.writer.close()
                if self.writer.dropped:
                    log.warning("polar_capture: %d calls dropped (row worker queue full)", self.writer.dropped)
        except Exception:
            log.exception("polar_capture: shutdown failed")

    def _close_unless_taken(self, live: handover.Live) -> None:
        if handover.take(live) is None:
            return  # the reloaded instance goes on with it
        log.error("polar_capture: the reloaded addon did not start; %d calls in flight end as proxy_error",
                  len(live.calls))
        for state in list(live.calls.values()):
            state.fail("proxy_error", "the capture addon was reloaded and its new version did not start")
            self._finalize(None, state)
        live.calls.clear()
        if live.writer is not None:
            _close_off_the_loop(live.writer)
        handover.stand_in(ctx.master, record.detect_api)  # no model call passes unrecorded meanwhile


def _in_script_reload() -> bool:
    """Whether this ``done`` runs inside mitmproxy's script reload (``ScriptLoader.loadscript``
    removing the old instance). A start that failed after ``running`` (mitmproxy's TLS set-up on a
    read-only HOME) exits without setting ``should_exit``, and was logged as "reloading"."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "loadscript" and code.co_filename.replace("\\", "/").endswith("mitmproxy/addons/script.py"):
            return True
        frame = frame.f_back
    return False


_STREAMED_BY_MITMPROXY = ("the {what} body was streamed by mitmproxy's stream_large_bodies (past its limit while "
                          "being read) and not recorded; leave stream_large_bodies unset or raise it above model calls")
_streamed_said = False


_WEBSOCKET_UNRECORDED = ("model calls over a WebSocket are not recorded (the capture reads HTTP and SSE only): "
                         "this session's passed unread; configure the harness for HTTP (docs/capture.md)")
_websocket_said = False


def _say_websocket_once(host: str, path: str) -> None:
    global _websocket_said
    if not _websocket_said:
        _websocket_said = True
        log.warning("polar_capture: a WebSocket session to %s%s carries model calls, which the capture does not "
                    "record; each such session gets a proxy_error row - configure the harness for HTTP "
                    "(docs/capture.md)", printable(host), printable(path.split("?", 1)[0]))  # a client's path


def _say_streamed_once() -> None:
    global _streamed_said
    if not _streamed_said:
        _streamed_said = True
        log.error("polar_capture: %s", _STREAMED_BY_MITMPROXY.format(what="request or response"))


def _loaded_already() -> bool:
    """Whether another copy of this addon (the same file under another path) is registered."""
    try:
        loop = ctx.master.event_loop  # a master left over from a finished test has a closed loop
        return loop.is_running() and ctx.master.addons.get("polarcapture") is not None
    except Exception:  # no master (imported by a test): register
        return False


handover.changed_modules()  # (the first load: every module imported above is seen from now on; the check
#                              above saw only those loaded before it)
if _loaded_already():
    # a warning: an error logged at startup makes mitmdump exit, and the first copy records
    log.warning("polar_capture: the capture addon is loaded already (the script given twice under two paths?); "
                "this copy is not used")
    addons: list = []
else:
    addons = [PolarCapture()]
