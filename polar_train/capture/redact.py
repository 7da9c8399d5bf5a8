"""Keep secrets out of everything the addon writes.

Two layers: keys that name a secret (``authorization``, ``api_key``, ...) are replaced wherever they
appear in a JSON body, and every secret value seen on the flow (bearer tokens, API keys, proxy
credentials) is scrubbed from the final text, wherever it hides (a prompt that echoes a key, an
upstream error that quotes it).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

REDACTED = "[REDACTED]"
SECRET_KEYS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api-key", "api_key", "apikey",
    "cookie", "set-cookie", "password", "secret", "client_secret", "access_token", "refresh_token",
    "id_token", "bearer", "x-goog-api-key",
})
SECRET_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie",
                  "x-goog-api-key", "openai-api-key", "anthropic-api-key")
_MIN_SECRET_LEN = 4
#: ``"key":`` for every secret key, in lower case, as bytes (one scan finds any of them).
_QUOTED_SECRET_KEY = re.compile(b'"(?:' + b"|".join(re.escape(k.encode()) for k in sorted(SECRET_KEYS)) + b')":')


def redact_json(value: Any) -> Any:
    """A copy of ``value`` with every secret-named key's value replaced."""
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(k, str) and k.lower() in SECRET_KEYS else redact_json(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_json(v) for v in value]
    return value


def redacted_dumps(value: Any, dumps: Callable[[Any], str]) -> str:
    """``dumps(redact_json(value))``, walking ``value`` only when its text can hold a secret key.

    Why: a harness's request (instructions, tool schemas, history) has thousands of nodes and
    rarely a secret-named key; the row worker writes every request and response. ``dumps`` must
    write keys unescaped, as ``json.dumps(..., ensure_ascii=False)`` does: a key whose lower case
    is a secret key then shows as ``"key":`` in the lower-cased text, so not finding one there
    proves there is none. Lower-casing the UTF-8 bytes (ASCII letters only) is enough unless the
    text has a Kelvin sign, the one other character whose lower case is an ASCII letter (``k``)."""
    text = dumps(value)
    if not isinstance(value, (dict, list)):
        return text
    if "\u212a" in text:
        found = _QUOTED_SECRET_KEY.search(text.lower().encode("utf-8"))
    else:
        found = _QUOTED_SECRET_KEY.search(text.encode("utf-8").lower())
    return dumps(redact_json(value)) if found else text


def header_secrets(headers: Any) -> set[str]:
    """Secret values in request headers (whole values, the token after the scheme, decoded Basic)."""
    found: set[str] = set()
    for name in SECRET_HEADERS:
        for value in headers.get_all(name) if hasattr(headers, "get_all") else [headers.get(name)]:
            if value:
                found |= value_secrets(value)
    return found


def value_secrets(value: str) -> set[str]:
    found = {value}
    scheme, _, token = value.partition(" ")
    if token:
        found.add(token.strip())
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                decoded = ""
            if decoded:
                found.add(decoded)
                user, _, password = decoded.partition(":")
                if password:
                    found.add(password)
    return {s for s in found if len(s) >= _MIN_SECRET_LEN}


def scrub(text: str | None, secrets: set[str]) -> str | None:
    """``text`` with every occurrence of a secret replaced (longest first)."""
    if not text or not secrets:
        return text
    for secret in sorted(secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text
