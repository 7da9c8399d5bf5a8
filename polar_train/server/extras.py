"""vLLM's sampling extensions of the chat request (``stop_token_ids``, ``min_tokens``, penalties,
``allowed_token_ids``, ``bad_words`` …), read and checked in vLLM's words, and the fields this
server cannot honour, refused by name.

Why a 400 for the rest: a server that answers 200 while ignoring ``use_beam_search`` or
``prompt_logprobs`` gives different tokens than vLLM without saying so; a refusal names the gap.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import PydanticError, VllmError, field_error, validation_error
from .fields import flag, list_of, to_float, to_int

#: Fields vLLM's chat request honours that this server does not: refused unless at their default.
UNSUPPORTED = {
    "use_beam_search": lambda v: bool(v),
    "length_penalty": lambda v: v is not None and v != 1.0,
    "prompt_logprobs": lambda v: v is not None,
    "logprob_token_ids": lambda v: v is not None,
    "watermarking": lambda v: bool(v),
    "thinking_token_budget": lambda v: v is not None,
    "repetition_detection": lambda v: v is not None,
    "vllm_xargs": lambda v: bool(v),
}


def refuse_unsupported(body: dict) -> None:
    """A field at a non-default value that would change the tokens: refused, named."""
    for key, active in UNSUPPORTED.items():
        if active(body.get(key)):
            raise VllmError(f"`{key}` is not supported by polar-train serve", param=key)


def _number(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    return default if v is None else to_float(v, key)


def _ids(body: dict, key: str) -> list[int] | None:
    """A ``list[int]`` field, each item read as pydantic reads it."""
    v = list_of(body, key)
    if v is None:
        return None
    return [to_int(x, f"{key}.{i}") for i, x in enumerate(v)]


def _out_of_vocab(ids: list[int], vocab_size: int) -> list[int]:
    return [t for t in ids if not 0 <= t < vocab_size]


#: vLLM's VLLM_MAX_NUM_BAD_WORDS default
MAX_BAD_WORDS = 128


def bad_words_ids(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's ``update_from_tokenizer``: each word as is and with a leading space (the second only
    when it is a different first token of the same length)."""
    out: list[list[int]] = []
    for word in words:  # repeats counted as vLLM counts them
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                if not prefix:
                    raise VllmError("bad_words entries must tokenize to at least one token.",
                                    param="bad_words", value=words)
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
                if len(out) > MAX_BAD_WORDS:
                    raise VllmError(f"Too many bad words after tokenization: {len(out)}. The max number "
                                    f"is {MAX_BAD_WORDS}.", param="bad_words", value=words)
    return out


def chat_extras(body: dict, engine, max_tokens: int) -> dict[str, Any]:
    """The extension fields as :class:`~.engine.SamplingParams` keywords, checked as vLLM's
    ``SamplingParams`` checks them (same messages)."""
    vocab = engine.vocab_size
    stop_ids = _ids(body, "stop_token_ids") or []
    bad = _out_of_vocab(stop_ids, vocab)
    if bad:
        raise VllmError(f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. "
                        f"Vocabulary size: {vocab}", param="stop_token_ids", value=bad)
    v = body.get("min_tokens")
    min_tokens = 0 if v is None else to_int(v, "min_tokens")
    if min_tokens < 0:
        raise VllmError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise VllmError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                        f"{min_tokens}.")
    min_p = _number(body, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise VllmError(f"min_p must be in [0, 1], got {min_p}.")
    rep = _number(body, "repetition_penalty", 1.0)
    if not math.isfinite(rep):
        raise VllmError(f"repetition_penalty must be a finite number, got {rep}.")
    if rep <= 0.0:
        raise VllmError(f"repetition_penalty must be greater than zero, got {rep}.")
    allowed = _ids(body, "allowed_token_ids")
    if allowed is not None and not allowed:
        raise VllmError("allowed_token_ids is not None and empty!", param="allowed_token_ids",
                        value=allowed)
    if allowed and _out_of_vocab(allowed, vocab):
        raise VllmError("allowed_token_ids contains out-of-vocab token id!",
                        param="allowed_token_ids", value=_out_of_vocab(allowed, vocab))
    words = list_of(body, "bad_words") or []
    wrong = [field_error("string_type", f"body.bad_words.{i}", "Input should be a valid string", w)
             for i, w in enumerate(words) if not isinstance(w, str)]
    if wrong:
        raise PydanticError(wrong)
    if any(not w for w in words):
        raise VllmError(f"bad_words cannot contain an empty string. Got bad_words={words}")
    return {
        "stop_token_ids": stop_ids,
        "include_stop_str_in_output": flag(body, "include_stop_str_in_output"),
        "ignore_eos": flag(body, "ignore_eos"),
        "min_tokens": min_tokens,
        "min_p": min_p,
        "repetition_penalty": rep,
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "allowed_token_ids": allowed,
        "bad_words_ids": bad_words_ids(words, engine.tokenizer),
        "skip_special_tokens": flag(body, "skip_special_tokens", True),
    }


def truncate_prompt(body: dict, prompt_ids: list[int], max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens`` (-1: the context length less one) keeps the prompt's last N tokens,
    or its first N with ``truncation_side: "right"``, as vLLM's renderer does (an empty result and
    N above the context length are its 400s)."""
    v = body.get("truncate_prompt_tokens")
    if v is None:
        return prompt_ids
    n = to_int(v, "truncate_prompt_tokens")
    if n < -1:
        raise validation_error("greater_than_equal", "truncate_prompt_tokens",
                               "Input should be greater than or equal to -1", v, {"ge": -1})
    if n > max_model_len:
        raise VllmError(f"truncate_prompt_tokens={n} cannot be greater than max_model_len = {max_model_len}. "
                        "Please request a smaller truncation size.", param="truncate_prompt_tokens", value=n)
    n = max_model_len - 1 if n == -1 else n  # vLLM's max_truncation_tokens: a token left to generate
    if len(prompt_ids) > n:
        prompt_ids = prompt_ids[:n] if body.get("truncation_side") == "right" else prompt_ids[len(prompt_ids) - n:]
    if not prompt_ids:
        raise VllmError("The decoder prompt cannot be empty")
    return prompt_ids
