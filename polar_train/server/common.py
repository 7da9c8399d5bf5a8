"""Request-field validation and sampling parameters shared by the three wire formats.

Why: every API names the same knobs a little differently (``max_tokens`` /
``max_completion_tokens`` / ``max_output_tokens``); one place checks them and gives the same
clear 400 for a bad value.
"""

from __future__ import annotations

import math
from typing import Any

from .engine import SamplingParams
from .errors import BadRequest, NotFound, VllmError
from .fields import seed, to_float, to_int


def _range_error(key: str, v: float, lo: float | None, hi: float | None) -> BadRequest:
    """The bound that was broken, said as a person would (no "between 1 and None")."""
    if hi is None:
        return BadRequest(f"{key} must be at least {lo}, got {v}", param=key)
    if lo is None:
        return BadRequest(f"{key} must be at most {hi}, got {v}", param=key)
    return BadRequest(f"{key} must be between {lo} and {hi}, got {v}", param=key)


def number(body: dict, key: str, default: float | None, lo: float | None = None,
           hi: float | None = None) -> float | None:
    v = body.get(key, default)
    if v is None:
        return default
    v = to_float(v, key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _range_error(key, v, lo, hi)
    return float(v)


def integer(body: dict, key: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    v = to_int(v, key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _range_error(key, v, lo, hi)
    return v


def check_model(body: dict, served_name: str, required: bool = False) -> str:
    model = body.get("model")
    if model is None:
        if required:
            raise BadRequest("model is required", param="model")
        return served_name
    if model != served_name:
        raise NotFound(f"The model `{model}` does not exist. Valid aliases: {served_name}.",
                       param="model")
    return served_name


def sampling(body: dict, engine, prompt_len: int, max_keys: tuple[str, ...],
             top_logprobs: int = 0, stop_key: str = "stop", clamp: bool = False) -> SamplingParams:
    """Sampling parameters; the token budget defaults to what is left of the context, and one
    beyond it is cut to fit (vLLM's ``get_max_tokens``).

    ``clamp`` (scripted mode): even a budget beyond ``max_model_len`` is cut instead of refused, so
    Claude Code's ``max_tokens: 32000`` works with any ``--max-model-len``."""
    room = engine.max_model_len - prompt_len
    if room <= 0:
        raise BadRequest(
            f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input messages.",
            param="input_tokens")
    max_tokens = max_tokens_of(body, max_keys, engine.max_model_len, clamp)
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    stop = body.get(stop_key)
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"{stop_key} must be a string or a list of non-empty strings", param=stop_key)
    bias_raw = body.get("logit_bias") or {}
    if not isinstance(bias_raw, dict):
        raise BadRequest("logit_bias must be an object of token id -> bias", param="logit_bias")
    bias: dict[int, float] = {}
    for k, v in bias_raw.items():
        try:
            tid, b = int(k), float(v)
        except (TypeError, ValueError):
            raise BadRequest("logit_bias keys must be token ids and values numbers",
                             param="logit_bias") from None
        if not 0 <= tid < engine.vocab_size:
            raise BadRequest(f"logit_bias token id {tid} is out of vocabulary", param="logit_bias")
        bias[tid] = max(-100.0, min(100.0, b))
    top_k = integer(body, "top_k", 0, lo=-1)
    check_penalties(body)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_temperature(body),
        top_p=_top_p(body),
        top_k=0 if top_k in (-1, None) else top_k,
        seed=seed(body),
        top_logprobs=top_logprobs,
        stop=list(stop),
        logit_bias=bias,
    )


def max_tokens_of(body: dict, keys: tuple[str, ...], max_model_len: int, clamp: bool) -> int | None:
    """The first budget field given (vLLM: ``max_completion_tokens`` before ``max_tokens``); above
    ``max_model_len`` it is refused with vLLM's message naming the field the request used."""
    for key in keys:
        v = body.get(key)
        if v is None:
            continue
        n = to_int(v, key)
        if n < 1:
            raise VllmError(f"max_tokens must be at least 1, got {n}.", param="max_tokens", value=n)
        if n > max_model_len and not clamp:
            raise VllmError(f"{key}={n} cannot be greater than max_model_len={max_model_len}. "
                            "Please request fewer output tokens.", param=key, value=n)
        return n
    return None


def _temperature(body: dict) -> float:
    """vLLM's ``SamplingParams`` checks, in its words."""
    t = number(body, "temperature", 1.0)
    if not math.isfinite(t):
        raise VllmError(f"temperature must be a finite number, got {t}.", param="temperature", value=t)
    if t < 0.0:
        raise VllmError(f"temperature must be non-negative, got {t}.", param="temperature", value=t)
    if t > 2.0:
        raise VllmError(f"temperature must be in [0, 2], got {t}.", param="temperature", value=t)
    return t


def _top_p(body: dict) -> float:
    p = number(body, "top_p", 1.0)
    if not 0.0 < p <= 1.0:  # NaN fails too
        raise VllmError(f"top_p must be in (0, 1], got {p}.", param="top_p", value=p)
    return p


def check_penalties(body: dict) -> None:
    """``presence_penalty`` / ``frequency_penalty``: accepted (and ignored) only where vLLM accepts them."""
    for key in ("presence_penalty", "frequency_penalty"):
        v = number(body, key, 0.0)
        if not -2.0 <= v <= 2.0:
            raise VllmError(f"{key} must be in [-2, 2], got {v}.")


IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def refuse_images(items: Any, served_name: str) -> None:
    """vLLM's answer to an image part for a text-only model (its multimodal registry's ValueError)."""
    for m in items if isinstance(items, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                raise VllmError(f"{served_name} is not a multimodal model")


def require_list(body: dict, key: str) -> list[Any]:
    v = body.get(key)
    if not isinstance(v, list):
        raise BadRequest(f"{key} must be a list", param=key)
    return v
