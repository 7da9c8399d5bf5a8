"""Keep secrets out of everything the addon writes.

Two layers: keys that name a secret (``authorization``, ``api_key``, ``openai_api_key``,
``session_token``, ...) have their values replaced wherever they appear in a JSON body, and every
secret value seen on the flow (bearer tokens, API keys in headers or the query string, proxy
credentials) is scrubbed from the final text, wherever it hides (the stored path, a prompt that
echoes a key, an upstream error that quotes it).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Any

REDACTED = "[REDACTED]"
#: Key names (lower case) that name a secret as they are ...
SECRET_KEYS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api-key", "api_key", "apikey",
    "cookie", "set-cookie", "password", "secret", "client_secret", "access_token", "refresh_token",
    "id_token", "bearer", "x-goog-api-key", "token", "private_key",
})
#: ... or end with: ``openai_api_key``, ``ANTHROPIC_API_KEY``, ``auth_token``, ``session_token``,
#: ``db_password``, ``aws_secret_access_key`` (a secret one writes in any case and separator).
SECRET_KEY_SUFFIXES = ("api_key", "api-key", "apikey", "_token", "-token", "_secret", "-secret", "password",
                       "private_key", "private-key", "access_key", "access-key", "secret_key", "secret-key")
SECRET_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie",
                  "x-goog-api-key", "openai-api-key", "anthropic-api-key")
_MIN_SECRET_LEN = 4
#: The shortest value taken as a secret from a header known only by its name (``X-Auth-Token``).
_MIN_HEADER_SECRET_LEN = 8


def is_secret_key(key: Any) -> bool:
    """Whether a JSON key names a secret (:data:`SECRET_KEYS`, :data:`SECRET_KEY_SUFFIXES`)."""
    if not isinstance(key, str):
        return False
    k = key.lower()
    return k in SECRET_KEYS or k.endswith(SECRET_KEY_SUFFIXES)


def _reversed_secret_key(gap: bytes) -> re.Pattern[bytes]:
    """The end of a JSON-encoded key that :func:`is_secret_key` accepts, then ``gap`` and ``:``,
    as it reads in the *reversed* lower-cased text: ``"name"`` for a whole name, or a suffix right
    before the closing quote (no escape can sit inside a suffix, so any key ending with one shows
    it so; a string value is never followed by ``":`` - a false match only costs the walk, which
    decides). Why reversed: read forwards, the suffixes start the pattern with no fixed byte, and
    ``re`` tried each of them at every position (3.5 ms per 100 KB body, half the row worker's
    time per call); reversed, every match starts with ``:`` and ``re`` skips to each colon."""
    keys = b"|".join(re.escape(k.encode()[::-1]) + b'"' for k in sorted(SECRET_KEYS))
    suffixes = b"|".join(re.escape(k.encode()[::-1]) for k in SECRET_KEY_SUFFIXES)
    # backslashes before the quote: a key inside a JSON string (a tool call's "arguments"), at any depth
    return re.compile(b":" + gap + b'"\\\\*(?:' + keys + b"|" + suffixes + b")")


_SECRET_KEY_COMPACT = _reversed_secret_key(b"")
_SECRET_KEY_SPACED = _reversed_secret_key(rb"[ \t\n\r]*")


def has_secret_key(lowered: bytes, spaced: bool = False) -> bool:
    """Whether lower-cased JSON bytes show ``"key":`` for a secret key (``spaced``: JSON
    whitespace allowed before the colon, as a client may send it; else the compact encoder's)."""
    return (_SECRET_KEY_SPACED if spaced else _SECRET_KEY_COMPACT).search(lowered[::-1]) is not None


def redact_json(value: Any) -> Any:
    """A copy of ``value`` with the value of every secret-named key replaced; where that value is
    an object or a list it is walked instead (a tool's parameter schema for a ``password`` or an
    ``api_token`` is no secret, and the record keeps it as sent). A string that holds a JSON object
    or list is walked too: OpenAI's tool calls carry their ``arguments`` so (a ``"password"`` there
    was stored as sent, where Anthropic's ``input`` object had it replaced); it is written back
    compact where something in it was replaced, as it was otherwise."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret_key(k) and not isinstance(v, (dict, list)) else redact_json(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_json(v) for v in value]
    if isinstance(value, str) and _JSON_TEXT.match(value) and (  # (a parse costs)
            has_secret_key(value.lower().encode("utf-8", "surrogatepass"), spaced=True) or _U_ESCAPE.search(value)):
        try:
            inner = json.loads(value)
            if isinstance(inner, (dict, list)):
                redacted = redact_json(inner)
                if redacted != inner:  # (a lone surrogate written back as the escape the client sent)
                    return escape_surrogates(json.dumps(redacted, ensure_ascii=False, separators=(",", ":")))
        except (ValueError, RecursionError):  # not JSON; nested deeper than Python parses: kept as sent
            return value
    return value


#: A string that may hold a JSON object or list (what :func:`redact_json` reads as JSON).
_JSON_TEXT = re.compile(r"[ \t\n\r]*[\[{]")
#: A key whose text holds a ``\uXXXX`` escape, in a string's own text (a tool call's arguments):
#: the escape may spell a letter (``"\\u0070assword":``), which no scan of the text finds; only the
#: string's parse shows the key. An escape elsewhere (``"\\u00a0"`` in a tool's source file, in every
#: later call of a session) is no key: it must not cost the walk (a review: 0.8 -> 1.7 ms per 114 KB).
_U_ESCAPE = re.compile(r'\\u[0-9a-fA-F]{4}[^"\\]{0,128}\\*"(?:[ \t\n\r]|\\+[tnr])*:')
#: The same inside a JSON string of a JSON text (its backslashes and quotes escaped once more), at any depth.
_NESTED_U_ESCAPE = re.compile(rb'\\\\u[0-9a-fA-F]{4}[^"\\\\]{0,128}\\+"(?:[ \t\n\r]|\\+[tnr])*:')


#: A UTF-16 surrogate code point: in a str only where JSON text escaped one alone (``"\\ud83d"``,
#: what JavaScript's ``JSON.stringify`` writes for a string cut inside an emoji); no UTF-8 holds it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escaped(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


def escape_surrogates(text: str) -> str:
    """``text`` with each surrogate code point written as its JSON escape (``\\ud83d``), so that
    it can be stored as UTF-8. In JSON text a surrogate can only sit inside a string, where the
    escape is what the client itself sent: ``json.loads`` gives back exactly the same value."""
    return text if text.isascii() else _SURROGATE.sub(_escaped, text)


def utf8(text: str) -> bytes:
    """JSON ``text`` as UTF-8 bytes, surrogates written as escapes (:func:`escape_surrogates`)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return escape_surrogates(text).encode("utf-8")


def redacted_dumps(value: Any, dumps: Callable[[Any], str]) -> str:
    """``dumps(redact_json(value))``, walking ``value`` only when its text can hold a secret key.

    Why: a harness's request (instructions, tool schemas, history) has thousands of nodes and
    rarely a secret-named key; the row worker writes every request and response. ``dumps`` must
    write keys unescaped, as ``json.dumps(..., ensure_ascii=False)`` does: a key whose lower case
    is a secret key then shows as ``"key":`` in the lower-cased text, so not finding one there
    proves there is none. Lower-casing the UTF-8 bytes (ASCII letters only) is enough unless the
    text has a Kelvin sign, the one other character whose lower case is an ASCII letter (``k``)."""
    text = dumps(value)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate the JSON escaped: escaped again, as sent
        text = escape_surrogates(text)
        data = text.encode("utf-8")
    if not isinstance(value, (dict, list)):
        return text
    # spaced: a JSON string inside (a tool call's arguments) keeps the client's spacing (`\"password\" :`)
    found = (has_secret_key(text.lower().encode("utf-8") if "\u212a" in text else data.lower(), spaced=True)
             or _NESTED_U_ESCAPE.search(data) is not None)  # a key in a JSON string may hide a letter so
    return escape_surrogates(dumps(redact_json(value))) if found else text


#: A credential in a header of any name (``x-custom-auth: Bearer ...``): its scheme, then the value.
_SCHEMED_CREDENTIAL = re.compile(r"(?i)^\s*(?:bearer|basic|token)\s+\S")


def header_secrets(headers: Any) -> set[str]:
    """Secret values in request headers (whole values, the token after the scheme, decoded Basic,
    each cookie's value), and any header of another name whose value is a schemed credential."""
    found: set[str] = set()
    for name in SECRET_HEADERS:
        for value in headers.get_all(name) if hasattr(headers, "get_all") else [headers.get(name)]:
            if value:
                found |= value_secrets(value)
                if name == "cookie":
                    found |= cookie_secrets(value)
    for name, values in getattr(headers, "items", lambda: ())():
        if name not in SECRET_HEADERS:
            secret_name = is_secret_key(name)  # X-Auth-Token, Private-Token (GitLab's), X-Service-Api-Key
            for value in values:
                # (a token's length: a misconfigured "null" would be scrubbed from every text, and every
                # call whose prompt holds the word would lose its token ids)
                if secret_name and len(value.strip()) >= _MIN_HEADER_SECRET_LEN:
                    found |= value_secrets(value)
                elif _SCHEMED_CREDENTIAL.match(value):
                    found |= value_secrets(value.strip())
    return found


def cookie_secrets(value: str) -> set[str]:
    """Each cookie's value (``session=abc; theme=dark``): the whole header alone is no secret a
    prompt would echo."""
    found = {part.partition("=")[2].strip() for part in value.split(";")}
    return {s for s in found if len(s) >= _MIN_SECRET_LEN}


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
            user, colon, password = decoded.partition(":")
            if password:
                found |= {decoded, password}
            elif colon:  # a user name alone (a rollout id) is no secret: its short base64 would be
                return set()  # scrubbed from every stored text that happens to hold it
    return {s for s in found if len(s) >= _MIN_SECRET_LEN}


#: Query parameters that carry a key although their name is no secret word (Google's ``?key=``,
#: signed URLs' ``sig``).
_SECRET_QUERY_NAMES = frozenset({"key", "sig", "signature", "auth", "code"})


def query_secrets(path: str | None) -> set[str]:
    """Values of secret-named query parameters in a request path (``?key=...``, ``?api-key=...``:
    Google's and Azure's way to send a key), as written and decoded, so that scrubbing removes them
    from the stored path and wherever else they show."""
    if not path or "?" not in path:
        return set()
    from urllib.parse import unquote_plus

    found: set[str] = set()
    for item in path.split("?", 1)[1].split("#", 1)[0].split("&"):
        name, sep, value = item.partition("=")
        name = unquote_plus(name)
        if sep and value and (is_secret_key(name) or name.lower() in _SECRET_QUERY_NAMES):
            found |= {value, unquote_plus(value)}
    return {s for s in found if len(s) >= _MIN_SECRET_LEN}


def _json_forms(secret: str) -> set[str]:
    """How ``secret`` can look inside JSON text: as is, and escaped (``"`` and ``\\`` always,
    non-ASCII as ``\\uXXXX`` when the writer escaped it)."""
    return {secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]}


def secret_forms(secrets: set[str]) -> set[str]:
    """Every secret in every form it can take in a text that quotes JSON (an upstream's error)."""
    return {form for secret in secrets for form in _json_forms(secret)}


def _scrub_strings(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {_scrub_strings(k, secrets): _scrub_strings(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub_strings(v, secrets) for v in value]
    return value


def scrub_json(text: str | None, secrets: set[str], dumps: Callable[[Any], str],
               forms: set[str] | None = None) -> str | None:
    """JSON ``text`` with every secret removed from its strings (keys and values), the text kept
    as it is when none shows in it in any form.

    Why not :func:`scrub` on the text: a key of ``null`` or ``none`` replaced JSON's own ``null``
    and the string ``"none"`` (the stored JSON no longer parsed), and a secret with a ``"`` or a
    ``\\`` shows escaped in JSON text, where a plain replace never finds it. ``forms``:
    :func:`secret_forms` of ``secrets``, when the caller has them already."""
    if not text or not secrets:
        return text
    forms = secret_forms(secrets) if forms is None else forms
    if not any(form in text for form in forms):
        return text
    try:
        value = json.loads(text)
    except ValueError:  # not JSON after all: every form, replaced in the text
        return scrub(text, forms)
    scrubbed = _scrub_strings(value, sorted(secrets, key=len, reverse=True))
    return escape_surrogates(dumps(scrubbed))  # a lone surrogate the client sent escaped: kept escaped


def scrub(text: str | None, secrets: set[str]) -> str | None:
    """``text`` with every occurrence of a secret replaced (longest first)."""
    if not text or not secrets:
        return text
    for secret in sorted(secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text
