"""The exact bytes of each token id, to compare what two token sequences *say*.

Why bytes and not ``decode``: a character split over two tokens decodes to replacement marks
token by token, and decoding growing windows is quadratic. Concatenated token bytes are exact
and let the stitcher walk two sequences side by side in linear time (retokenization check).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from functools import lru_cache
from typing import Protocol


class TokenBytes(Protocol):
    """id -> the token's bytes; None for an id that names no token (negative, past the vocabulary:
    a corrupt or foreign capture), which then says nothing that could match."""

    def __call__(self, token_id: int) -> bytes | None: ...


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes_of(tokenizer) -> TokenBytes:
    """A cached id → bytes function for a Hugging Face tokenizer (byte-level BPE or not)."""
    decoder = _byte_decoder()
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}

    @lru_cache(maxsize=1 << 18)
    def token_bytes(token_id: int) -> bytes | None:
        if token_id in added:
            return added[token_id].encode("utf-8")
        if token_id < 0:
            return None
        try:
            piece = tokenizer.convert_ids_to_tokens(int(token_id))
        except (OverflowError, IndexError):
            return None
        if piece is None:
            return None
        try:
            return bytes(decoder[ch] for ch in piece)
        except KeyError:  # not byte-level: fall back to the tokenizer's own decoding
            return tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    return token_bytes


def ids_bytes(token_bytes: TokenBytes, ids) -> bytes | None:
    """What ``ids`` say, as bytes; None where an id names no token (nothing to compare)."""
    pieces = [token_bytes(int(x)) for x in ids]
    return None if None in pieces else b"".join(pieces)


def bytes_cover(token_bytes: TokenBytes, ids, want: bytes) -> tuple[int, bool] | None:
    """Walk ``ids`` until their bytes cover ``want``: how many ids that took and whether they end
    exactly there (the last may run on); None where they say something else first, an id names
    no token, or they end short. Linear: each id's bytes are looked at once."""
    for taken, got in _growing(token_bytes, ids):
        if got is None:
            return None
        if len(got) >= len(want):
            return (taken, len(got) == len(want)) if got.startswith(want) else None
        if not want.startswith(got):
            return None
    return None


def _growing(token_bytes: TokenBytes, ids) -> Iterator[tuple[int, bytearray | None]]:
    """``(ids taken, their bytes so far)`` after each id; ``(n, None)`` at an id that names no token."""
    got = bytearray()
    for j, x in enumerate(ids):
        piece = token_bytes(int(x))
        if piece is None:
            yield j + 1, None
            return
        got += piece
        yield j + 1, got


def withheld_at_end(token_bytes: TokenBytes, ids) -> int:
    """How many of the last ``ids`` of a reply its text leaves out: a reply cut (``max_tokens``)
    inside a character. vLLM's detokenizer (tokenizers' ``DecodeStream``, our server's too) adds a
    token's text only once the text ends in a whole character and never flushes what is left, so
    the text a client sends back ends before those ids - also before a space or letter that shares
    their token. At most 3 ids (a character is at most 4 bytes) - or all of them, where the reply is
    no more than the start of one character; 0 where an id names no token."""
    n = len(ids)
    for k in range(min(n, 3) + 1):
        pieces = [token_bytes(int(x)) for x in ids[max(0, n - k - 4):n - k]]
        if None in pieces:
            return 0
        if not b"".join(pieces)[-8:].decode("utf-8", "replace").endswith("\ufffd"):
            return k
    return 0


#: What ``surrogateescape`` makes of the bytes of a character not yet complete.
_HALF_CHARACTER = "".join(chr(c) for c in range(0xDC80, 0xDD00))


def text_cover(token_bytes: TokenBytes, ids, want: bytes) -> tuple[int, bool] | None:
    """:func:`bytes_cover`, or where the bytes differ, whether ``ids`` say ``want``'s text in
    Unicode's composed form (NFC) and end exactly there: ``(ids taken, True)``.

    Why: the tokenizer normalises text (NFC, as Qwen's does) before it encodes. A sampled
    ``e`` + combining acute sent back as it was comes back as one ``é`` in the next prompt: no
    edit, yet the bytes differ, and the fork read as a history rewrite. Only a sampled text that
    NFC changes is compared so (an ASCII or composed one never is: no cost on the usual path)."""
    covered = bytes_cover(token_bytes, ids, want)
    if covered is not None:
        return covered
    target = want.decode("utf-8", "surrogateescape")  # a tail may begin or end inside a character
    if target.isascii() or unicodedata.is_normalized("NFC", target):
        return None
    target = unicodedata.normalize("NFC", target)
    for taken, got in _growing(token_bytes, ids):
        if got is None:
            return None
        text = unicodedata.normalize("NFC", got.decode("utf-8", "surrogateescape"))
        if text == target:
            return taken, True
        # half a character at the end (up to 3 bytes, escaped) may complete, and the last two
        # characters may still compose with what follows
        whole = text.rstrip(_HALF_CHARACTER)
        if not target.startswith(whole[:max(0, len(whole) - 2)]) or len(got) > 4 * len(want) + 16:
            return None
    return None


@lru_cache(maxsize=1)
def default_token_bytes() -> TokenBytes:
    """Token bytes of the project's tokenizer (Qwen3.5 vocabulary), built on first use."""
    from ..tokenizer import build_tokenizer

    return token_bytes_of(build_tokenizer())
