"""The request as its row stores it: the JSON text the client sent, and a hash of the bytes as sent.

Why: the row worker used to parse every request, then encode it twice more - key-sorted for
``request_hash``, compact for ``request_json`` - ~0.4 ms per 33 KiB Codex request and ~1.3 ms per
100 KiB of history, on the core that mitmproxy shares. Reading the body member by member (json's
own scanner, as fast as ``json.loads``) gives the object and where each value is written, so the
hash takes the bytes as sent less the values that may change between retries, and ``request_json``
is the body's own text wherever that is provably what redaction would have written (see
:func:`text_as_sent`). A body the walk cannot read takes the old way: parse, redact, re-encode.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from .json_members import splice_utf8
from .redact import has_secret_key
from .request_walk import WalkedRequest

#: Request fields left out of ``request_hash`` (they may change between retries of one request).
#: ``client_metadata``: Codex's ids of the turn, thread and session, written in a random key order
#: on each send (a hash map), so a retry's bytes differed there and it was taken for a new request.
VOLATILE_FIELDS = frozenset({"metadata", "client_metadata", "user", "prompt_cache_key", "stream_options", "store"})

#: Escapes that write a character another way than the compact encoder does (``\u`` for any
#: character, ``\/`` for ``/``): where the body has none, every string in it reads as the encoder
#: writes it, so a secret value found in the re-encoded text is found in this one.
_OTHER_ESCAPES = re.compile(rb"\\[u/]")
#: The one non-ASCII character whose lower case is an ASCII letter (a regex: ``in`` is slower).
_KELVIN_SIGN = re.compile("\u212a".encode())


def request_hash(body: dict[str, Any]) -> str:
    """The hash of a request known only as an object: its key-sorted compact JSON."""
    canonical = {k: v for k, v in body.items() if k not in VOLATILE_FIELDS}
    data = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def hash_as_sent(walked: WalkedRequest) -> str:
    """The hash of a walked request: its bytes as sent, with the values of what may change between
    retries (:data:`VOLATILE_FIELDS`) cut out. A retry sends the same bytes; hashing them as they
    are costs one pass, where joining the values' text or re-encoding them cost several."""
    cuts = [(m.start, m.end, "") for m in walked.found if m.key in VOLATILE_FIELDS]
    data = splice_utf8(walked.body, walked.text, cuts) if cuts else walked.body
    return hashlib.sha256(data).hexdigest()[:32]


def text_as_sent(walked: WalkedRequest) -> str | None:
    """The body's own text if it can stand for the redacted request, else None (re-encode it).

    It can when no key names a secret: keys are then matched in the lower-cased body, which holds
    each key as written - sound unless a key hides a letter behind ``\\u`` (no ``\\u`` allowed) or
    the body has a Kelvin sign. And with neither ``\\u`` nor ``\\/`` every string is written as the
    compact encoder writes it, so scrubbing secret values from this text finds what scrubbing the
    re-encoded one would."""
    body = walked.body
    if (_OTHER_ESCAPES.search(body) or (not body.isascii() and _KELVIN_SIGN.search(body))
            or has_secret_key(body.lower(), spaced=True)):
        return None
    return walked.text
