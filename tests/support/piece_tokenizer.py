"""A real fast tokenizer over a handful of text pieces: token ``i`` decodes to ``pieces[i]``.

For unit tests of the server's text handling without the 248k-token vocabulary: it is a real
``tokenizers`` tokenizer (word-level, pieces joined as they are), so the incremental
``DecodeStream`` the server uses runs on it as on the real one.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast


def piece_tokenizer(pieces: list[str], special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """``special``: pieces that are special tokens (left out with ``skip_special_tokens``)."""
    vocab = {p: i for i, p in enumerate(pieces)}
    assert len(vocab) == len(pieces), "pieces must differ"
    tok = Tokenizer(models.WordLevel(vocab, unk_token=pieces[0]))
    tok.decoder = decoders.Fuse()
    if special:
        tok.add_special_tokens(list(special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    assert fast.decode(list(range(len(pieces)))) == "".join(pieces)
    return fast
