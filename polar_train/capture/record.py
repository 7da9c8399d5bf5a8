"""One model call: the state collected while it passes the proxy, and its call-log row.

Why split this way: the hooks only collect bytes and timestamps (cheap, on the event loop);
:func:`build_row` does the expensive part (JSON parsing, reassembly, rendering) in the row worker
(a child process, :mod:`polar_train.capture.worker`). A :class:`CallState` crosses that process
boundary pickled, so it holds raw bytes (request body, stream) rather than parsed objects.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from ..wire.errors import BadRequest
from ..wire.lax import lax_true
from . import anthropic_messages, openai_chat, openai_responses
from . import fields as raw_fields
from .identity import API_KEY_PREFIX, HeaderView, Identity, resolve_identity
from .json_members import compact
from .parsed import ParsedCall
from .redact import (escape_surrogates, header_secrets, query_secrets, redacted_dumps, scrub, scrub_json,
                     secret_forms, utf8, value_secrets)
from .render import (Renderer, TokenizerUnavailable, UnencodableText, UnrenderableMedia, UnrenderableReply,
                     server_tokenize, unsampled_rendering)
from .request_row import hash_as_sent, request_hash, text_as_sent
from .request_walk import WalkedRequest, walk_request
from .sse import event_json, parse_event, split_all

log = logging.getLogger("polar_capture")

FORMATS = {m.API: m for m in (openai_chat, openai_responses, anthropic_messages)}
_PATHS = re.compile(r"/v1/(chat/completions|responses|messages)/?$")
_API_BY_TAIL = {"chat/completions": openai_chat.API, "responses": openai_responses.API,
                "messages": anthropic_messages.API}
ERROR_TEXT_LIMIT = 2000


def detect_api(method: str, path: str) -> str | None:
    """The wire format of a model call (POST to a known path, any prefix, any query), else None."""
    if method.upper() != "POST":
        return None
    path = path.split("?", 1)[0].split("#", 1)[0]
    if "%" in path:  # the server decodes it (Starlette, vLLM's): /v1/chat/%63ompletions was answered, unrecorded
        path = unquote(path)
    m = _PATHS.search(path)
    return _API_BY_TAIL[m.group(1)] if m else None


def websocket_api(method: str, path: str, fields: tuple[tuple[bytes, bytes], ...]) -> str | None:
    """The wire format of a model endpoint asked to become a WebSocket (a GET with ``Upgrade:
    websocket`` to a model call's path, as Codex's Responses WebSocket transport opens), else None."""
    if method.upper() != "GET":
        return None
    (upgrade,) = raw_fields.values(fields, b"upgrade")
    if upgrade is None or upgrade.strip().lower() != b"websocket":
        return None
    return detect_api("POST", path)


class AttemptCounter:
    """``attempt`` = 1 + earlier calls on the same rollout to the same API with the same request
    hash (bounded): a body sent to two endpoints is two requests, no retry.

    Kept by the row worker, which sees calls in the order they finish: "earlier" means finished
    earlier (a retry starts after the call it retries has ended, so this is its start order too).
    """

    def __init__(self, max_keys: int = 200_000) -> None:
        self._seen: OrderedDict[tuple[str | None, str, str], int] = OrderedDict()
        self._max = max_keys

    def next(self, rollout_id: str | None, req_hash: str, api: str = "") -> int:
        if rollout_id is None:  # no rollout to count on: one session's first prompt is every session's
            return 1
        key = (rollout_id, api, req_hash)
        n = self._seen.get(key, 0) + 1
        self._seen[key] = n
        self._seen.move_to_end(key)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return n


def count_attempt(state: "CallState", attempts: AttemptCounter) -> None:
    """Set ``request_hash`` and ``attempt`` (in the row worker: hashing a long conversation is too
    slow for the proxy's event loop). A body that is not a JSON object is hashed as bytes; one
    over ``polar_max_body_mb`` (not kept) gets no hash and attempt 1."""
    request = state.request_object()
    if request is not None:
        walked = state.request_walked
        state.request_hash = hash_as_sent(walked) if walked is not None else request_hash(request)
    elif state.request_body:
        state.request_hash = hashlib.sha256(state.request_body).hexdigest()[:32]
    if state.request_hash is not None:
        state.attempt = attempts.next(state.identity.rollout_id if state.identity else None, state.request_hash,
                                      state.api)


def encode_injection(raw: bytes, original: dict[str, Any], injected: dict[str, Any]) -> bytes:
    """The request body to forward after injection.

    Why splice: re-encoding a harness's request (a whole conversation, often hundreds of KB) costs
    milliseconds on the proxy's event loop. When the injection only adds top-level keys, they are
    written right after the client's opening brace and every other byte stays as sent. Otherwise
    (a key the client set is changed, or the body is not plain UTF-8 JSON) the object is re-encoded.
    """
    unchanged = len(injected) >= len(original) and all(
        k in injected and (injected[k] is v or injected[k] == v) for k, v in original.items())
    start = raw.find(b"{")
    if unchanged and len(injected) == len(original):
        return raw  # nothing added
    if unchanged and start >= 0 and not raw[:start].strip(b" \t\r\n") and b"\x00" not in raw:
        added = compact({k: v for k, v in injected.items() if k not in original})[1:-1]
        rest = raw[start + 1:]
        sep = b"" if rest.lstrip(b" \t\r\n")[:1] == b"}" else b","
        return raw[:start + 1] + utf8(added) + sep + rest
    return utf8(json.dumps(injected, ensure_ascii=False))  # a lone surrogate stays the escape it was


#: Why a request body is no request (the row's error), found by the proxy or the row worker.
NOT_AN_OBJECT = "request body is not a JSON object"


def not_json(exc: ValueError | RecursionError) -> str:
    if isinstance(exc, RecursionError):  # (a server answers its 400: the row keeps the server's message first)
        return "request body is JSON nested deeper than Python parses"
    return f"request body is not JSON: {exc}"[:500]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(slots=True)
class CallState:
    api: str
    method: str
    host: str
    path: str
    client_conn_id: str
    #: None until :func:`resolve_head` (in the row worker) derives it from ``header_fields``.
    identity: Identity | None
    started_at: datetime
    upstream_base: str
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    secrets: set[str] = field(default_factory=set)
    #: The request's header fields as the client sent them (before the proxy removed identity
    #: headers), the proxy credentials of its tunnel's CONNECT, and the port it came in on: all the
    #: proxy keeps of them; :func:`resolve_head` turns them into identity, secrets and host.
    header_fields: tuple[tuple[bytes, bytes], ...] | None = None
    connect_auth: str | None = None
    listen_port: int | None = None
    #: The request body as the client sent it (before injection); parsed again by the row worker.
    request_body: bytes = b""
    #: The parsed body: never set by the proxy (the raw body is cheaper to hand over than a pickled
    #: object tree); :meth:`request_object` parses it in the row worker.
    request: dict[str, Any] | None = None
    #: The body read member by member where it could be (row worker only): what the row's
    #: ``request_hash`` and ``request_json`` are taken from (:mod:`.request_row`).
    request_walked: WalkedRequest | None = None
    #: The proxy had nothing to change in the request (injection off, a hosted API) and left it
    #: unparsed: :meth:`request_object` sets ``stream`` and ``request_error`` from it.
    request_unread: bool = False
    request_error: str | None = None
    #: What a later addon changed in the request after the proxy read it (``modify_body``,
    #: ``map_remote``, an intercept edit): the recorded request is the client's, not the server's.
    request_changed: str | None = None
    injected: bool = False
    asked: dict[str, Any] = field(default_factory=dict)
    request_hash: str | None = None
    attempt: int = 1
    stream: bool = False
    http_status: int | None = None
    first_byte_at: datetime | None = None
    finished_at: datetime | None = None
    response_body: bytes | None = None
    #: A streamed body as it arrived (decoded), appended chunk by chunk; split into events later.
    stream_raw: bytearray | bytes | None = None
    streamed: bool = False
    #: The client closed the connection while the call was streaming: the row worker decides
    #: whether the stream had already carried its final event (a complete call; Codex does this).
    client_error: str | None = None
    status: str | None = None  # set by the error hook / proxy errors; None = decide from response
    error: str | None = None
    finalized: bool = False

    def fail(self, status: str, error: str) -> None:
        if self.status is None:
            self.status = status
            self.error = error

    def request_object(self) -> dict[str, Any] | None:
        """The parsed request: kept, or parsed again from the raw body (in the row worker); for a
        request the proxy left unread, also what the proxy would have found: ``stream``, or why the
        body is no request."""
        unread, self.request_unread = self.request_unread, False
        if self.request is not None or self.request_error is not None or not (self.request_body or unread):
            return self.request
        walked = walk_request(self.request_body)  # None where only json.loads can say
        try:
            obj = walked.obj if walked is not None else json.loads(self.request_body)
        except (ValueError, RecursionError) as exc:
            if unread:
                self.request_error = not_json(exc)
            return None
        if isinstance(obj, dict):
            self.request, self.request_walked = obj, walked
            if unread:
                self.stream = lax_true(obj.get("stream"))
        elif unread:
            self.request_error = NOT_AN_OBJECT
        return self.request


def resolve_head(state: CallState, rollout_header: str, task_header: str,
                 port_rollouts: dict[int, str]) -> CallState:
    """Identity, secrets and host of a call from the raw header fields the proxy kept (in the row
    worker: on the proxy's event loop this was ~0.1 ms of header decoding per call). A state
    without fields (built elsewhere, or resolved already) is left as it is."""
    fields = state.header_fields
    if fields is None:
        return state
    from mitmproxy.net.http.url import parse_authority  # what Request.pretty_host uses

    headers = HeaderView(fields)
    identity = resolve_identity(headers, state.connect_auth, state.listen_port, rollout_header,
                                task_header, port_rollouts)
    secrets = header_secrets(headers) | query_secrets(state.path) | state.secrets
    if state.connect_auth:
        secrets |= value_secrets(state.connect_auth)
    if identity.source == "api_key" and identity.rollout_id:
        secrets.add(f"{API_KEY_PREFIX}{identity.rollout_id}")
    host_header = headers.get("host")
    if host_header:
        state.host = parse_authority(host_header, check=False)[0]
    state.identity, state.secrets, state.header_fields = identity, secrets, None
    return state




def _is_final(module, ev, obj) -> bool:
    """Whether an event is the stream's final one (``[DONE]``, ``message_stop``,
    ``response.completed`` ...), by its name, its data or its JSON ``type``."""
    return module.is_done_event(ev.event, ev.data) or (isinstance(obj, dict)
                                                        and module.is_done_event(obj.get("type"), None))


#: The note of a row whose stream went on after its final event.
AFTER_FINAL = "{n} SSE event(s) after the final event ignored (a client stops reading at the final event)"
TRUNCATED = "stream ended before its final event (truncated)"


def _parse_stream(module, state: CallState) -> ParsedCall:
    """Reassemble a stream up to its final event, as the clients' SDKs read it: what comes after
    that event never changes the call (the row counts it in ``note``). A final event that lacks
    only its blank line (the stream's last bytes) is read as a whole one."""
    events: list[tuple[str | None, Any]] = []
    done = False
    malformed = 0
    after = 0  # events with data after the final event
    raw_events, pending = split_all(bytes(state.stream_raw or b""))
    unused = getattr(module, "unused_event", None)  # proven well-formed, not needed: not parsed
    reader = getattr(module, "ids_reader", None)
    ids_json = reader(state) if reader is not None else None  # a prompt's ids as an array
    for raw in raw_events:
        if done:
            if parse_event(raw).data is not None:
                after += 1
            continue
        if unused is not None and unused(raw):
            continue
        read = ids_json(raw) if ids_json is not None else None
        if read is not None:
            name, obj = read
            done = module.is_done_event(name, None) or module.is_done_event(obj.get("type"), None)
            events.append(read)
            continue
        ev, obj = event_json(raw)
        if ev.data is None:
            continue
        done = _is_final(module, ev, obj)
        if ev.data == "[DONE]":
            continue
        if obj is None:
            malformed += 1
            continue
        events.append((ev.event, obj))
    cut = False  # the stream ended inside an event
    if pending.strip():
        ev, obj = event_json(pending)
        if done:
            after += ev.data is not None
        elif ev.data is not None and _is_final(module, ev, obj) and (ev.data == "[DONE]" or obj is not None):
            done = True  # a final event without its blank line: complete, and read
            if obj is not None:
                events.append((ev.event, obj))
        else:
            cut = True
    parsed = module.parse_stream(events, done)
    if malformed:
        parsed.error = f"{malformed} malformed SSE event(s)"
    if not done:
        # never complete without its final event, even where every token came (a finish_reason,
        # a usage chunk): a cut right before the final event looks the same (docs/capture.md)
        parsed.complete = False
        why = TRUNCATED
        if parsed.finish_reason is not None:
            why += f": finish_reason {parsed.finish_reason!r} came, but no {module.FINAL_EVENT}"
        parsed.error = parsed.error or why
    if after:
        note = AFTER_FINAL.format(n=after)
        parsed.note = f"{parsed.note}; {note}" if parsed.note else note
    return parsed


#: Reasons already logged (the /tokenize check, a prompt that cannot be rendered): once each, not
#: once per call.
_LOGGED: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _LOGGED and len(_LOGGED) < 1000:
        _LOGGED.add(reason)
        log.warning("polar_capture: %s (said once)", reason)


def _ids(parsed: ParsedCall, module, state: CallState, renderer: Renderer | None,
         tokenize_check: bool, tokenize_url: str, tokenize_insecure: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_token_ids": None, "completion_token_ids": None,
                           "completion_logprobs": None, "token_source": "none",
                           "usage_match": None, "server_tokenize_match": None}
    if parsed.prompt_ids is not None and parsed.completion_ids is not None:
        out["prompt_token_ids"] = parsed.prompt_ids
        out["completion_token_ids"] = parsed.completion_ids
        lps = parsed.completion_logprobs
        out["completion_logprobs"] = lps if lps is not None and len(lps) == len(parsed.completion_ids) else []
        out["token_source"] = "server"
    elif renderer is not None and state.request is not None and parsed.assistant is not None:
        messages, tools = module.to_chat(state.request)
        kwargs = module.template_kwargs(state.request)
        prompt = renderer.prompt_ids(messages, tools, kwargs)
        out["prompt_token_ids"] = prompt
        completion = renderer.completion_ids(messages, tools, parsed.assistant, parsed.stopped, kwargs)
        counted = parsed.usage_completion_tokens
        surplus = renderer.tokenizer.decode(completion[counted:], skip_special_tokens=False) \
            if counted is not None and 0 < counted < len(completion) else ""
        unsampled = unsampled_rendering(parsed.assistant, parsed.finish_reason, surplus, renderer.turn_closing())
        if unsampled is not None:
            raise UnrenderableReply(unsampled)
        out["completion_token_ids"] = completion
        out["completion_logprobs"] = []
        out["token_source"] = "rendered"
        if tokenize_check:
            base = tokenize_url or state.upstream_base
            try:
                served = server_tokenize(base, state.request.get("model"), messages, tools,
                                         insecure=tokenize_insecure, kwargs=kwargs)
                out["server_tokenize_match"] = served == prompt
            except Exception as exc:  # the check is advisory: record why it could not run
                reason = f"/tokenize check could not run: {exc}"
                _log_once(reason)
                out["check_error"] = reason
    if out["prompt_token_ids"] is not None:
        checks = []
        if parsed.usage_prompt_tokens is not None:
            checks.append(parsed.usage_prompt_tokens == len(out["prompt_token_ids"]))
        if parsed.usage_completion_tokens is not None:
            checks.append(parsed.usage_completion_tokens == len(out["completion_token_ids"]))
        out["usage_match"] = all(checks) if checks else None
    return out


def _request_text(state: CallState, request: dict[str, Any]) -> str:
    """The request's JSON for its row, redacted: the body as sent where that is provably the same
    (:func:`~.request_row.text_as_sent`), else the object re-encoded."""
    walked = state.request_walked
    text = text_as_sent(walked) if walked is not None and walked.obj is request else None
    return text if text is not None else redacted_dumps(request, compact)


#: The id columns of a row that keeps no token ids.
_WITHOUT_IDS = {"prompt_token_ids": None, "completion_token_ids": None, "completion_logprobs": None,
                "token_source": "none", "usage_match": None}


def build_row(state: CallState, renderer: Renderer | None, tokenize_check: bool = False,
              tokenize_url: str = "", attempts: AttemptCounter | None = None,
              tokenize_insecure: bool = False) -> dict[str, Any]:
    """The call-log row of a finished call (runs in the row worker; never raises for bad input).
    With ``attempts`` it also sets the call's request hash and attempt number."""
    module = FORMATS[state.api]
    status, error = state.status, state.error
    parsed = ParsedCall()
    body_text: str | None = None
    request = state.request_object()
    if attempts is not None:
        count_attempt(state, attempts)
    try:
        if state.stream_raw:
            parsed = _parse_stream(module, state)
        elif state.response_body is not None and state.response_body != b"":
            body_text = state.response_body.decode("utf-8", errors="replace")
            try:
                obj = json.loads(state.response_body)
            except (ValueError, RecursionError):
                obj = None
            if isinstance(obj, dict):
                parsed = module.parse_body(obj)
                if parsed.response is None:
                    parsed.response = obj
            else:
                parsed.error = "response body is not a JSON object (malformed JSON)"
        elif state.http_status is not None and status is None:
            parsed.error = "empty response body"
    except Exception as exc:  # a parser bug: keep the call as an error row
        log.exception("polar_capture: parsing the response of %s failed", state.call_id)
        status, error = "proxy_error", f"parsing the response failed: {exc!r}"
        parsed = ParsedCall()

    failed = state.http_status is not None and state.http_status >= 400
    if status is None and parsed.server_error is not None and not failed:
        # the server said the call failed (mid-stream, after tokens): whatever the client did next,
        # and whatever came before, no part of it is a finished call
        status, error = "upstream_error", parsed.server_error
    if status is None and state.client_error is not None and not (state.stream_raw and parsed.complete):
        status, error = "client_disconnected", state.client_error  # left before the final event
    if status is None:
        if failed:
            if body_text is None and state.stream_raw:  # an error sent as an event stream
                body_text = bytes(state.stream_raw[:4 * ERROR_TEXT_LIMIT]).decode("utf-8", errors="replace").strip()
            status = "upstream_error"
            error = f"HTTP {state.http_status}: {(body_text or '')[:ERROR_TEXT_LIMIT]}"
        elif parsed.error:
            status, error = "upstream_error", parsed.error
        elif state.http_status is None:
            status, error = "upstream_error", "no response"
        else:
            status = "ok"
    lps, sampled = parsed.completion_logprobs, parsed.completion_ids
    if status == "ok" and parsed.prompt_ids is not None and sampled is not None and lps and len(lps) != len(sampled):
        # the row keeps none (see _ids): the trainer then scores these tokens itself
        note = f"logprobs not kept: the server gave {len(lps)} for {len(sampled)} completion ids"
        parsed.note = f"{parsed.note}; {note}" if parsed.note else note
    if parsed.note:
        error = f"{error}; {parsed.note}" if error else parsed.note
    request_note = getattr(module, "request_note", None)
    unrecorded = request_note(request) if request_note is not None and isinstance(request, dict) else None
    if unrecorded is not None and status == "ok":
        error = f"{error}; {unrecorded}" if error else unrecorded
        _log_once("a chat call asked for several completions (n > 1): only choices[0] is recorded")
    ids: dict[str, Any] = {"prompt_token_ids": None, "completion_token_ids": None,
                           "completion_logprobs": None, "token_source": "none",
                           "usage_match": None, "server_tokenize_match": None}
    if status == "ok":
        try:
            ids = _ids(parsed, module, state, renderer, tokenize_check, tokenize_url, tokenize_insecure)
            if "check_error" in ids:  # the call is fine; its row says why the check did not run
                reason = ids.pop("check_error")
                error = f"{error}; {reason}" if error else reason
        except TokenizerUnavailable as exc:  # logged once by the renderer
            error = f"token ids unavailable: {exc}"
        except UnencodableText as exc:  # a reply with half an emoji (a stream cut by UTF-16 code unit)
            error = f"token ids unavailable: {exc}"
            _log_once("a call's text holds an unpaired UTF-16 surrogate, which no tokenizer encodes; such calls "
                      "keep no token ids (their rows say where)")
        except UnrenderableMedia as exc:  # an image of a multimodal model's call: its tokens are not text
            error = f"token ids unavailable: {exc}"
            _log_once("calls whose prompt holds an image, audio or file part keep no token ids (their rows say "
                      "where)")
        except UnrenderableReply as exc:
            error = f"token ids unavailable: {exc}"
            _log_once("calls whose reply was cut inside a tool call or thinking keep no token ids (their rows "
                      "say why)")
        except BadRequest as exc:  # a prompt the template refuses (vLLM would have answered 400)
            error = f"token ids unavailable: {exc}"
            _log_once(f"a prompt could not be rendered ({exc}); such calls keep no token ids")
        except Exception as exc:
            log.exception("polar_capture: token ids of %s failed", state.call_id)
            error = f"token ids unavailable: {exc!r}"

    if state.request_changed is not None:
        note = (f"the request's {state.request_changed} changed after the capture read it (mitmproxy's "
                "modify_body, map_remote, an intercept edit, ...): request_json is the client's")
        if ids["token_source"] == "rendered":  # rendered from a request the server never saw
            ids = _WITHOUT_IDS | {"server_tokenize_match": None}
            note += "; its rendered token ids are not stored (the server saw another request)"
        error = f"{error}; {note}" if error else note
    response = parsed.response
    if response is not None and state.injected:
        try:
            module.strip(response, state.asked)
        except Exception:
            pass
    temperature, top_p = module.sampling(request) if isinstance(request, dict) else (None, None)
    if isinstance(response, dict):  # the Responses API echoes the values it sampled with
        from .parsed import as_float

        temperature = temperature if temperature is not None else as_float(response.get("temperature"))
        top_p = top_p if top_p is not None else as_float(response.get("top_p"))
    secrets = state.secrets
    forms = secret_forms(secrets)  # each secret as JSON text may hold it, once for every stored text
    request_text = _request_text(state, request) if request is not None else None
    response_text = redacted_dumps(response, compact) if response is not None else None
    request_json = scrub_json(request_text, secrets, compact, forms)
    response_json = scrub_json(response_text, secrets, compact, forms)
    if (request_json is not request_text or response_json is not response_text) and ids["token_source"] != "none":
        # a credential the call carried (its API key, proxy password, ...) is in its prompt or
        # reply: scrubbed from the texts, but the ids would decode to it and train on it
        ids = _WITHOUT_IDS | {"server_tokenize_match": None}
        note = ("a credential the call carried shows in its prompt or reply: its token ids are not stored "
                "(they would decode to it)")
        error = f"{error}; {note}" if error else note
    identity = state.identity or Identity(None, "none")
    row = {
        "call_id": state.call_id,
        "rollout_id": identity.rollout_id,
        "rollout_source": identity.source,
        "task_id": identity.task_id,
        "api": state.api,
        "method": state.method,
        "host": state.host,
        "path": scrub(state.path, secrets),
        "model": scrub(request.get("model") if isinstance(request, dict) and isinstance(request.get("model"), str)
                       else parsed.model, forms),
        "attempt": state.attempt,
        "request_hash": state.request_hash,
        "client_conn_id": state.client_conn_id,
        "client_session_id": scrub(identity.client_session_id, forms),
        "started_at": state.started_at,
        "first_byte_at": state.first_byte_at,
        "finished_at": state.finished_at or utcnow(),
        "stream": state.stream,
        "http_status": state.http_status,
        "status": status,
        "error": scrub(error if error is None else error[:ERROR_TEXT_LIMIT], forms),
        "request_json": request_json,
        "response_json": response_json,
        "usage_prompt_tokens": parsed.usage_prompt_tokens,
        "usage_completion_tokens": parsed.usage_completion_tokens,
        "finish_reason": parsed.finish_reason if isinstance(parsed.finish_reason, str) else None,
        "tool_call_count": parsed.tool_call_count,
        "temperature": temperature,
        "top_p": top_p,
        "injected": state.injected,
        "prompt_prefix_call_id": None,
        "prompt_prefix_len": None,
        **ids,
    }
    if state.request_error and row["error"] is None:
        row["error"] = state.request_error
    for key in _TEXT_COLUMNS:  # a path decoded with surrogateescape, a server message with "\ud83d"
        value = row[key]
        if isinstance(value, str) and not value.isascii():
            row[key] = escape_surrogates(value)
    return row


#: The row's short text columns that may hold what a client or a server sent (the JSON columns are
#: written escaped already: :func:`~.redact.redacted_dumps`).
_TEXT_COLUMNS = ("rollout_id", "task_id", "client_session_id", "host", "path", "model", "error", "finish_reason")


def fallback_row(state: CallState, exc: BaseException) -> dict[str, Any]:
    """The row of a call whose row could not be built (a bug of ours): a ``proxy_error`` with
    what the proxy knew of the call, never its texts or ids. A call never loses its row."""
    from ..schema import CALL_LOG_SCHEMA  # pyarrow: in the row worker only, never in the proxy

    identity = state.identity or Identity(None, "none")
    row: dict[str, Any] = dict.fromkeys(CALL_LOG_SCHEMA.names)  # every column; what is unknown stays null
    row.update({
        "call_id": state.call_id, "rollout_id": identity.rollout_id, "rollout_source": identity.source,
        "task_id": identity.task_id, "api": state.api, "method": state.method, "host": state.host,
        "path": scrub(state.path, state.secrets), "attempt": state.attempt,
        "request_hash": state.request_hash, "client_conn_id": state.client_conn_id,
        "client_session_id": scrub(identity.client_session_id, state.secrets),
        "started_at": state.started_at, "first_byte_at": state.first_byte_at,
        "finished_at": state.finished_at or utcnow(), "stream": state.stream, "http_status": state.http_status,
        "status": "proxy_error", "error": f"building the row failed: {exc!r}"[:ERROR_TEXT_LIMIT],
        "tool_call_count": 0, "injected": state.injected, **_WITHOUT_IDS,
    })
    for key in _TEXT_COLUMNS:
        if isinstance(row[key], str):
            row[key] = escape_surrogates(row[key])
    return row
