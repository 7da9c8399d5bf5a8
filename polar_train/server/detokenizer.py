"""Output text as vLLM's detokenizer builds it: token by token with tokenizers' ``DecodeStream``.

Why not ``decode(all_ids)`` after each token: that is quadratic (~9 s of decoding for a 4,000-token
answer), and vLLM's text differs from it: a piece is added only once it ends in a whole character,
and pieces never completed are never added (a text that ends in half a character leaves those
tokens out). ``DecodeStream`` is the very code vLLM's ``FastIncrementalDetokenizer`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """The text of a growing id sequence; ``feed`` takes the whole sequence so far each time."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._fed = 0
        self.text = ""

    def feed(self, ids: Sequence[int]) -> str:
        """Adds the ids past those fed before (``ids`` extends them) and returns the text."""
        for token_id in ids[self._fed:]:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - vLLM's recovery: DecodeStream's state broke
                # (non-monotonic output of some tokenizers); start a fresh stream at this token
                self._stream = DecodeStream(skip_special_tokens=self._skip)
                piece = self._stream.step(self._backend, token_id)
            if piece:
                self.text += piece
        self._fed = max(self._fed, len(ids))
        return self.text
