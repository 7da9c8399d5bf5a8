"""Which rollout a model call belongs to, without touching the harness.

Precedence: proxy credentials (``HTTPS_PROXY=http://ROLLOUT:secret@host:port``: on the CONNECT of a
tunnel, kept per client connection; on plain-HTTP absolute-form requests, on every request), then a
header (``x-polar-rollout``), then an API key of the form ``polar-<rollout>``, then the listen port
(``--mode regular@P``), else none. The headers that carried an identity (proxy credentials, the
rollout/task headers) are removed before the request leaves the proxy; API keys are forwarded.
"""

from __future__ import annotations

import base64
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

_VALID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
API_KEY_PREFIX = "polar-"


@dataclass(frozen=True)
class Identity:
    rollout_id: str | None
    source: str  # proxy_auth | header | api_key | listen_port | none
    task_id: str | None = None


def valid_id(value: str | None) -> str | None:
    """The id if it is a sane identifier (printable, no spaces, at most 200 chars), else None."""
    if value is None:
        return None
    value = value.strip()
    return value if _VALID.match(value) else None


def rollout_from_proxy_auth(value: str | None) -> str | None:
    """``Basic base64(ROLLOUT:secret)`` -> ``ROLLOUT`` (None when absent or malformed)."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    user, _, _ = decoded.partition(":")
    from urllib.parse import unquote

    return valid_id(unquote(user))


def rollout_from_api_key(headers: Any) -> str | None:
    auth = headers.get("authorization") or ""
    scheme, _, token = auth.partition(" ")
    candidates = [token.strip()] if scheme.lower() == "bearer" else []
    candidates.append((headers.get("x-api-key") or "").strip())
    for key in candidates:
        if key.startswith(API_KEY_PREFIX) and len(key) > len(API_KEY_PREFIX):
            return valid_id(key[len(API_KEY_PREFIX):])
    return None


class HeaderView:
    """A request's headers read once into a dict, for the many lookups a call needs.

    Why: mitmproxy's ``Headers`` lower-cases every field on every lookup (~4 us each; identity and
    secret scanning make ~20 per call, on the event loop). Deleting a header deletes it from the
    real headers too. Names are lower-case; values are decoded as mitmproxy decodes them.
    """

    __slots__ = ("_headers", "_values")

    def __init__(self, headers: Any) -> None:
        self._headers = headers
        values: dict[str, list[str]] = {}
        for name, value in headers.fields:
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

    def __delitem__(self, name: str) -> None:
        del self._headers[name]
        del self._values[name]


class IdentityResolver:
    """Remembers proxy credentials per client connection (bounded) and resolves each request."""

    def __init__(self, max_connections: int = 65536) -> None:
        self._by_conn: OrderedDict[str, str] = OrderedDict()
        self._max = max_connections

    def remember_connect(self, conn_id: str, proxy_authorization: str | None) -> None:
        rollout = rollout_from_proxy_auth(proxy_authorization)
        if rollout is not None:
            self._by_conn[conn_id] = rollout
            self._by_conn.move_to_end(conn_id)
            while len(self._by_conn) > self._max:
                self._by_conn.popitem(last=False)

    def forget(self, conn_id: str) -> None:
        self._by_conn.pop(conn_id, None)

    def resolve(self, conn_id: str, headers: Any, listen_port: int | None,
                rollout_header: str, task_header: str, port_rollouts: dict[int, str]) -> Identity:
        """Identity of one request; removes identity-only headers from ``headers`` in place."""
        proxy_auth = headers.get("proxy-authorization")
        if "proxy-authorization" in headers:
            del headers["proxy-authorization"]
        header_value = headers.get(rollout_header) if rollout_header else None
        if rollout_header and rollout_header in headers:
            del headers[rollout_header]
        task = headers.get(task_header) if task_header else None
        if task_header and task_header in headers:
            del headers[task_header]
        task_id = valid_id(task)

        rollout = rollout_from_proxy_auth(proxy_auth)
        if rollout is not None:
            return Identity(rollout, "proxy_auth", task_id)
        if conn_id in self._by_conn:
            return Identity(self._by_conn[conn_id], "proxy_auth", task_id)
        rollout = valid_id(header_value)
        if rollout is not None:
            return Identity(rollout, "header", task_id)
        rollout = rollout_from_api_key(headers)
        if rollout is not None:
            return Identity(rollout, "api_key", task_id)
        if listen_port is not None and listen_port in port_rollouts:
            return Identity(port_rollouts[listen_port], "listen_port", task_id)
        return Identity(None, "none", task_id)
