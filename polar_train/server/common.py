"""Request-field validation and sampling parameters shared by the three wire formats.

Why: every API names the same knobs a little differently (``max_tokens`` /
``max_completion_tokens`` / ``max_output_tokens``); one place checks them and gives the same
clear 400 for a bad value.
"""

from __future__ import annotations

from typing import Any

from .engine import SamplingParams
from .errors import BadRequest, NotFound


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
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{key} must be a number", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _range_error(key, v, lo, hi)
    return float(v)


def integer(body: dict, key: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer", param=key)
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
    """Sampling parameters; the token budget defaults to what is left of the context.

    ``clamp`` (scripted mode): a budget beyond the context is cut to fit instead of refused, so
    Claude Code's ``max_tokens: 32000`` works with any ``--max-model-len``."""
    room = engine.max_model_len - prompt_len
    if room <= 0:
        raise BadRequest(
            f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input messages.",
            param="input_tokens")
    max_tokens = None
    for key in max_keys:
        max_tokens = integer(body, key, None, lo=1)
        if max_tokens is not None:
            break
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room and clamp:
        max_tokens = room
    elif max_tokens > room:
        raise BadRequest(
            f"'{max_keys[0]}' is too large: {max_tokens}. This model's maximum context length is "
            f"{engine.max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {engine.max_model_len} - {prompt_len}).", param=max_keys[0])
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
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        top_k=0 if top_k in (-1, None) else top_k,
        seed=integer(body, "seed", None),
        top_logprobs=top_logprobs,
        stop=list(stop),
        logit_bias=bias,
    )


def require_list(body: dict, key: str) -> list[Any]:
    v = body.get(key)
    if not isinstance(v, list):
        raise BadRequest(f"{key} must be a list", param=key)
    return v
