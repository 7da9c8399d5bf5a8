"""Which rollout a model call belongs to, without touching the harness.

Precedence: what the request itself carries before what its connection carried: proxy credentials
on the request (``HTTPS_PROXY=http://ROLLOUT:secret@host:port`` with plain-HTTP absolute-form
requests: on every request), then a header (``x-polar-rollout``), then the proxy credentials of the
tunnel's CONNECT (kept per client connection: a client that reuses a tunnel for another rollout
names it in the header), then an API key of the form ``polar-<rollout>``, then the listen port
(``--mode regular@P``), else none. The headers that carried an identity (proxy credentials, the
rollout/task headers) are removed before the request leaves the proxy; API keys are forwarded.
The proxy only removes them and keeps the raw header fields: the row worker resolves the identity
(nothing of it is needed while the call is in flight).
"""

from __future__ import annotations

import base64
import logging
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

API_KEY_PREFIX = "polar-"
#: A header ``polar-train harness`` sends on its check request through the proxy. The addon removes
#: it (as the identity headers) and marks the answer with :data:`CAPTURE_MARK`: a port that is the
#: model server itself, or a proxy without the addon, answers unmarked - a session through it
#: would go unrecorded. The mark's value is the listening mode (``regular``, ``reverse``, ...).
PROBE_HEADER = "x-polar-capture-probe"
CAPTURE_MARK = "x-polar-capture"
#: Also on the check's answer: where the proxy sent the request (``http://127.0.0.1:8000``). A
#: reverse-mode listener sends every request to its own target, whatever server the client named.
CAPTURE_TARGET = "x-polar-capture-target"
#: Headers in which a harness names its session: Codex's ``session-id`` (its sub-agents' threads
#: have their own ``thread-id``), Claude Code's ``x-claude-code-session-id``. Pi sends none.
CLIENT_SESSION_HEADERS = ("session-id", "x-claude-code-session-id")
#: The longest rollout or task id kept (a longer one is refused, and said once in the log).
MAX_ID_CHARS = 512

log = logging.getLogger("polar_capture")
_refused_said: set[tuple[str, int]] = set()


@dataclass(frozen=True)
class Identity:
    rollout_id: str | None
    source: str  # proxy_auth | header | api_key | listen_port | none
    task_id: str | None = None
    #: The harness's own id of its session (:data:`CLIENT_SESSION_HEADERS`): two sessions under one
    #: rollout id show as two of these, where their conversations alone cannot tell them from a
    #: sub-agent's (which shares its session's).
    client_session_id: str | None = None


def id_problem(value: str) -> str | None:
    """Why ``value`` (already stripped) cannot be an id: empty, longer than :data:`MAX_ID_CHARS`, or
    holding a control character or a lone surrogate (which no Parquet string can hold). Any other
    text is kept as sent: unicode, spaces, ``/``, ``%``."""
    if not value:
        return "empty"
    if len(value) > MAX_ID_CHARS:
        return f"longer than {MAX_ID_CHARS} characters"
    if _control(value):
        return "holds a control character or an undecodable byte"
    return None


def _control(value: str) -> bool:
    return any(unicodedata.category(c) in ("Cc", "Cs") for c in value)


def valid_id(value: str | None, what: str = "rollout id", show: bool = True) -> str | None:
    """The id as sent (surrounding spaces removed), or None when there is none or it cannot be one;
    a refused id is said once in the log (it used to vanish without a word, and every call so left
    without a rollout was pooled with the others). Control characters are looked for before the
    spaces go: ``"\\r\\ninj"`` was kept as ``inj``."""
    if value is None:
        return None
    problem = "holds a control character or an undecodable byte" if _control(value) else id_problem(value.strip())
    if problem is None:
        return value.strip()
    shown = repr(value[:80] + ("..." if len(value) > 80 else "")) if show else "(from an API key: not shown)"
    _say_once(what, value, f"polar_capture: {what} {shown} refused ({problem}); the call is recorded without one")
    return None


def _say_once(what: str, value: str, line: str) -> None:
    """Log ``line`` the first time ``value`` is refused as ``what`` (a rollout and a task refused
    alike are two lines; two long ids alike in their first 80 characters are two too), at most
    100 lines a process: a client sending a bad id on every call would flood the log."""
    key = (what, hash(value))
    if key not in _refused_said and len(_refused_said) < 100:
        _refused_said.add(key)
        log.warning("%s", line)


#: Authentication schemes (IANA's registry) other than Basic: the only part of a credential ever
#: logged (any other first word may be the secret itself).
_KNOWN_SCHEMES = frozenset({"bearer", "digest", "negotiate", "ntlm", "hoba", "mutual", "vapid", "scram-sha-1",
                            "scram-sha-256", "privatetoken", "concealed", "dpop", "gnap", "aws4-hmac-sha256"})


def _first(headers: Any, name: str) -> str | None:
    """The first value of a header sent more than once (joined, the values made no valid id)."""
    values = headers.get_all(name) if hasattr(headers, "get_all") else []
    return values[0] if values else headers.get(name)


def rollout_from_proxy_auth(value: str | None) -> str | None:
    """``Basic base64(ROLLOUT:secret)`` -> ``ROLLOUT`` (None when absent or malformed)."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "basic" or not token.strip():
        # the scheme is named only where it is one (a word before a credential): a bare token, or one
        # after a tab, would be the credential itself (a password in the log)
        named = scheme if token.strip() and scheme.lower() in _KNOWN_SCHEMES else None
        _say_once("proxy credentials", (named or "").lower(), "polar_capture: proxy credentials " + (
            f"of scheme {named!r}, not Basic" if named else "without a Basic credential") +
            ": the call is recorded without a rollout id")
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError) as exc:  # (the token holds the password: never logged)
        problem = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else "not base64"
        _say_once("proxy credentials", problem, f"polar_capture: proxy credentials {problem} (Basic user:password "
                  "expected): the call is recorded without a rollout id")
        return None
    user, colon, rest = decoded.partition(":")
    if not colon:  # no user name: all of it may be a secret (a key given as the credential), never logged
        _say_once("proxy credentials", "no colon", "polar_capture: proxy credentials not user:password (no ':' in "
                  "the decoded Basic credential): the call is recorded without a rollout id")
        return None
    if ":" in rest:  # "job:7:run-1:x": the user name cannot be told from the password; "job" merged rollouts
        _say_once("proxy credentials", "colons", "polar_capture: proxy credentials hold more than one ':' - a rollout "
                  "id with ':' in the proxy user name cannot be told from the password (Basic splits at the first "
                  "one): the call is recorded without a rollout id; send such ids in the x-polar-rollout header")
        return None
    return valid_id(user)  # as sent: clients percent-decode the proxy URL's user name themselves


def rollout_from_api_key(headers: Any) -> str | None:
    auth = headers.get("authorization") or ""
    scheme, _, token = auth.partition(" ")
    candidates = [token.strip()] if scheme.lower() == "bearer" else []
    candidates.append((headers.get("x-api-key") or "").strip())
    for key in candidates:
        if key.startswith(API_KEY_PREFIX) and len(key) > len(API_KEY_PREFIX):
            return valid_id(key[len(API_KEY_PREFIX):], show=False)  # the key is a secret: never logged
    return None


class HeaderView:
    """Request headers read once into a dict of lower-case names, for the many lookups a call needs.

    Why: mitmproxy's ``Headers`` lower-cases every field on every lookup (~4 us each; identity and
    secret scanning make ~20 per call). The row worker builds one from the raw header fields the
    proxy handed over. Values are decoded as mitmproxy decodes them.
    """

    __slots__ = ("_values",)

    def __init__(self, fields: Iterable[tuple[bytes, bytes]]) -> None:
        values: dict[str, list[str]] = {}
        for name, value in fields:
            values.setdefault(name.lower().decode("utf-8", "surrogateescape"), []).append(
                value.decode("utf-8", "surrogateescape"))
        self._values = values

    def get(self, name: str, default: str | None = None) -> str | None:
        found = self._values.get(name)
        return ", ".join(found) if found else default

    def get_all(self, name: str) -> list[str]:
        return list(self._values.get(name, ()))

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def items(self):
        """(lower-case name, its values) of every header."""
        return self._values.items()


def identity_headers(rollout_header: str, task_header: str) -> frozenset[bytes]:
    """Lower-case names of the headers meant for the proxy alone (an identity, the harness check's
    probe): the proxy removes them before a request leaves (the upstream must never see proxy
    credentials)."""
    names = {"proxy-authorization", rollout_header.lower(), task_header.lower(), PROBE_HEADER}
    return frozenset(n.encode("latin-1") for n in names if n)


def client_session(headers: Any) -> str | None:
    """The harness's own session id (:data:`CLIENT_SESSION_HEADERS`), or None: one that could be no
    id is left out unsaid (it is the harness's, not the user's to fix)."""
    for name in CLIENT_SESSION_HEADERS:
        value = _first(headers, name)
        if value is not None and not _control(value) and id_problem(value.strip()) is None:
            return value.strip()
    return None


def resolve_identity(headers: Any, connect_auth: str | None, listen_port: int | None,
                     rollout_header: str, task_header: str, port_rollouts: dict[int, str]) -> Identity:
    """The identity of one request, from its headers as the client sent them and the proxy
    credentials of its tunnel's CONNECT (``connect_auth``), by the precedence above."""
    identity = _rollout_identity(headers, connect_auth, listen_port, rollout_header, task_header, port_rollouts)
    session = client_session(headers)
    return identity if session is None else replace(identity, client_session_id=session)


def _rollout_identity(headers: Any, connect_auth: str | None, listen_port: int | None,
                      rollout_header: str, task_header: str, port_rollouts: dict[int, str]) -> Identity:
    task_id = valid_id(_first(headers, task_header), "task id") if task_header else None
    rollout = rollout_from_proxy_auth(_first(headers, "proxy-authorization"))
    if rollout is not None:
        return Identity(rollout, "proxy_auth", task_id)
    rollout = valid_id(_first(headers, rollout_header)) if rollout_header else None
    if rollout is not None:
        return Identity(rollout, "header", task_id)
    rollout = rollout_from_proxy_auth(connect_auth)
    if rollout is not None:
        return Identity(rollout, "proxy_auth", task_id)
    rollout = rollout_from_api_key(headers)
    if rollout is not None:
        return Identity(rollout, "api_key", task_id)
    if listen_port is not None and listen_port in port_rollouts:
        return Identity(port_rollouts[listen_port], "listen_port", task_id)
    return Identity(None, "none", task_id)
