"""A stream event's bytes as text with one character per byte, once they are proven valid UTF-8.

Why: the stream fast paths walk an event's JSON with json's own scanner, which reads ``str``. vLLM
writes UTF-8 as is (a logprob's token text, Codex's instructions: an event of any size has some),
and one non-ASCII character makes ``bytes.decode("utf-8")`` build a string of two bytes per
character - ~5x the time of an ASCII decode, ~0.25 ms for a Codex-sized ``response.completed`` on
the proxy's event loop. Decoded as Latin-1 instead, each byte is one character: JSON's structure
(all ASCII) and every ASCII key, number and ``null`` read the same, a character index is a byte
offset (a splice needs no offset arithmetic), and a multi-byte character's bytes are all >= 0x80,
so they can never read as a quote, a backslash or a control character. What such text must not be
used for is the *value* of a non-ASCII string: it reads as other characters (the fast paths only
compare such values to what the same view gave, or pass their bytes on untouched).

What ``json.loads`` would have done with invalid UTF-8 is kept by refusing it: :func:`byte_text`
returns None and the caller takes its JSON path.
"""

from __future__ import annotations

import numpy as np


#: Below one non-ASCII byte per this many, the runs of them are checked one by one; above, the
#: whole text is decoded once (a Python loop per run would cost more).
_BYTES_PER_RUN_CHECK = 256


def is_utf8(data: bytes) -> bool:
    """Whether ``data`` decodes as strict UTF-8 (what ``data.decode("utf-8")`` accepts).

    A multi-byte character is all non-ASCII bytes, so ``data`` is UTF-8 exactly when each maximal
    run of non-ASCII bytes is: those runs (found by one vector compare) are what Python's own
    decoder checks, a few bytes each, instead of widening all of ``data`` to a 2-byte-per-character
    string. Text dense with non-ASCII characters is decoded whole (the same answer)."""
    if data.isascii():
        return True
    where = np.flatnonzero(np.frombuffer(data, np.uint8) >= 0x80)
    if where.size * _BYTES_PER_RUN_CHECK > len(data):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True
    positions = where.tolist()
    start = prev = positions[0]
    try:
        for p in positions[1:]:
            if p != prev + 1:  # a run ended at prev
                data[start:prev + 1].decode("utf-8")
                start = p
            prev = p
        data[start:prev + 1].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def byte_text(data: bytes) -> str | None:
    """``data`` as text of one character per byte (Latin-1) if it is valid UTF-8, else None."""
    return data.decode("latin-1") if is_utf8(data) else None
