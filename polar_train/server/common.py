"""Request-field validation and sampling parameters shared by the three wire formats.

Why: every API names the same knobs a little differently (``max_tokens`` /
``max_completion_tokens`` / ``max_output_tokens``); one place checks them and refuses a bad value
as vLLM does: a field of the wrong type as its pydantic model (``errors.PydanticError``), a value
its ``SamplingParams`` refuses in its words (``errors.VllmError``).
"""

from __future__ import annotations

import math
from typing import Any

from .engine import SamplingParams
from .errors import NotFound, PydanticError, VllmError, field_error, value_error
from .extras import chat_extras
from .fields import list_of, required, seed, strings, text, to_float, to_int


def number(body: dict, key: str, default: float | None) -> float | None:
    v = body.get(key, default)
    if v is None:
        return default
    return to_float(v, key)


def integer(body: dict, key: str, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    return to_int(v, key)


def check_model(body: dict, served_name: str, required_: bool = False) -> str:
    """``model``: a string (required on the Messages API), the served name or vLLM's 404."""
    model = required(body, "model") if required_ else body.get("model")
    if (model is None or model == "") and not required_:  # vLLM takes "" for its default model too
        return served_name
    if model == "":  # (the Messages request's validator)
        raise value_error("body.model", "Model is required", "")
    text(body, "model")  # a non-string (or a required null) is pydantic's string_type
    if model is None:
        raise PydanticError([field_error("string_type", "body.model", "Input should be a valid "
                                         "string", None)])
    if model != served_name:
        raise NotFound(f"The model `{model}` does not exist. Valid aliases: {served_name}.",
                       param="model")
    return served_name


def sampling(body: dict, engine, prompt_len: int, max_keys: tuple[str, ...],
             top_logprobs: int = 0, stop_key: str = "stop", clamp: bool = False,
             budget_name: str | None = None, bias: bool = True,
             extras: bool | frozenset[str] = False) -> SamplingParams:
    """Sampling parameters; the token budget defaults to what is left of the context, and one
    beyond it is cut to fit (vLLM's ``get_max_tokens``).

    ``clamp`` (scripted mode): even a budget beyond ``max_model_len`` is cut instead of refused, so
    Claude Code's ``max_tokens: 32000`` works with any ``--max-model-len``. ``budget_name``: the
    name vLLM's message gives the budget when it is not the request's own field (the Messages API
    says ``max_completion_tokens``). ``bias``: whether the API has ``logit_bias`` (vLLM's Messages
    request has none, so it is ignored there). ``extras``: read vLLM's sampling extensions of the
    chat request (:mod:`.extras`), or only the named ones (the Responses request has a few)."""
    room = engine.max_model_len - prompt_len
    if room < 0:
        # vLLM's _token_len_check: its tokenizer stops at max_model_len + 1 tokens, so a longer
        # prompt is reported as "at least" that many
        count = engine.max_model_len + 1
        raise VllmError(
            f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
            f"prompt contains at least {count} input tokens, which exceeds this "
            "limit even without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens", value=count)
    if room == 0:  # a prompt of exactly max_model_len tokens: vLLM's budget check of the room left
        raise VllmError("max_tokens must be at least 1, got 0.", param="max_tokens", value=0)
    max_tokens = max_tokens_of(body, max_keys, engine.max_model_len, clamp, budget_name)
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    stop = strings(body, stop_key, allow_str=stop_key == "stop")
    biases = logit_bias(body, engine.vocab_size) if bias else {}
    top_k = integer(body, "top_k", 0)
    if top_k < -1:  # vLLM quietly accepts -1 as "disabled"
        raise VllmError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    check_penalties(body)
    if any(not s for s in stop):
        raise VllmError("stop cannot contain an empty string.")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_temperature(body),
        top_p=_top_p(body),
        top_k=0 if top_k in (-1, None) else top_k,
        seed=seed(body),
        top_logprobs=top_logprobs,
        stop=list(stop),
        logit_bias=biases,
        **(chat_extras(body if extras is True else {k: body[k] for k in extras if k in body},
                       engine, max_tokens) if extras else {}),
    )


def keep_specials(params: SamplingParams, tools_enabled: bool) -> None:
    """vLLM's hermes tool parser (``adjust_request``) keeps special tokens in the text whenever
    tools may be called, so a ``<tool_call>`` marked special still reaches the parser."""
    if tools_enabled:
        params.skip_special_tokens = False


def max_tokens_of(body: dict, keys: tuple[str, ...], max_model_len: int, clamp: bool,
                  budget_name: str | None = None) -> int | None:
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
            name = budget_name or key
            raise VllmError(f"{name}={n} cannot be greater than max_model_len={max_model_len}. "
                            "Please request fewer output tokens.", param=name, value=n)
        return n
    return None


def logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` (``dict[str, float]``): pydantic's checks, then vLLM's key and vocabulary
    checks in its words; biases are clipped to [-100, 100] as vLLM clips them."""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PydanticError([field_error("dict_type", "body.logit_bias",
                                         "Input should be a valid dictionary", raw)])
    values = {k: to_float(v, f"logit_bias.{k}") for k, v in raw.items()}
    bias: dict[int, float] = {}
    invalid: list[str] = []
    for k, v in values.items():
        try:
            bias[int(k)] = min(100.0, max(-100.0, v))
        except ValueError:
            invalid.append(k)
    if invalid:
        raise VllmError("logit_bias contains key(s) that cannot be converted to integer token IDs: "
                        f"{invalid!r}", param="logit_bias", value=invalid)
    outside = [t for t in bias if not 0 <= t < vocab_size]
    if outside:
        raise VllmError(f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
                        f"Vocabulary size: {vocab_size}", param="logit_bias", value=outside)
    return bias


def check_top_logprobs(body: dict, logprobs: bool, vocab_size: int) -> int:
    """Chat's ``top_logprobs`` as vLLM's ``check_logprobs`` (raw values) and ``SamplingParams``
    (at most 20; -1 means the whole vocabulary, which is beyond that) refuse it."""
    raw = body.get("top_logprobs")
    if raw is not None and not isinstance(raw, (int, float)):
        raise VllmError("`top_logprobs` must be an integer.", param="top_logprobs", value=raw)
    if raw is not None:
        if raw < 0 and raw != -1:
            raise VllmError("`top_logprobs` must be a positive value or -1.", param="top_logprobs",
                            value=raw)
        if (raw == -1 or raw > 0) and not body.get("logprobs"):  # vLLM tests the raw value
            raise VllmError("when using `top_logprobs`, `logprobs` must be set to true.",
                            param="top_logprobs")
    top = integer(body, "top_logprobs", 0) or 0
    return max_logprobs(top, vocab_size) if logprobs else top


def max_logprobs(top: int, vocab_size: int, limit: int = 20) -> int:
    """vLLM's ``_validate_logprobs``: -1 asks for the whole vocabulary; more than 20 is refused."""
    n = vocab_size if top == -1 else top
    if n > limit:
        raise VllmError(f"Requested sample logprobs of {n}, which is greater than max allowed: "
                        f"{limit}", param="logprobs", value=n)
    return n


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
    """``presence_penalty`` / ``frequency_penalty`` in [-2, 2], as vLLM checks them (applied on the
    chat API, see :mod:`.extras`)."""
    for key in ("presence_penalty", "frequency_penalty"):
        v = number(body, key, 0.0)
        if not -2.0 <= v <= 2.0:
            raise VllmError(f"{key} must be in [-2, 2], got {v}.")


#: Parts vLLM hands its multimodal registry: an image (chat, Responses, Messages) ...
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
#: ... and on the chat API audio and video too (an audio part was dropped from the prompt and
#: answered 200, where vLLM answers 400: a probe).
CHAT_MEDIA_PARTS = IMAGE_PARTS | {"input_audio", "audio_url", "video_url"}


#: The part types vLLM 0.32's chat parser knows (``MM_PARSER_MAP``), named in its refusal.
KNOWN_PART_TYPES = ("audio_embeds", "audio_url", "image_embeds", "image_pil", "image_url", "input_audio", "input_image",
                    "input_text", "output_text", "prompt_embeds", "refusal", "text", "thinking", "tool_reference",
                    "video_embeds", "video_url")


def unsupported_part(kind: Any) -> VllmError:
    """vLLM's chat parser's refusal of a part type it does not know (chat, a Responses item's)."""
    return VllmError(f"Unsupported chat content part type: {kind!r}. Supported types: {', '.join(KNOWN_PART_TYPES)}.",
                     param="type", value=kind)


def continue_and_generate() -> VllmError:
    """vLLM's later check of ``continue_final_message`` with ``add_generation_prompt`` (chat's default, /tokenize)."""
    return VllmError("continue_final_message and add_generation_prompt are not compatible. Use "
                     "continue_final_message when you want the model to continue the final message, and "
                     "add_generation_prompt when you want to add a header that will prompt it to start a new "
                     "assistant message instead.")


def refuse_images(items: Any, served_name: str, media: frozenset[str] = IMAGE_PARTS) -> None:
    """vLLM's answer to a media part for a text-only model (its multimodal registry's ValueError)."""
    for m in items if isinstance(items, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in media:
                raise VllmError(f"{served_name} is not a multimodal model")


def require_list(body: dict, key: str) -> list[Any]:
    """A required ``list[...]`` field: pydantic's ``missing`` / ``list_type`` as vLLM answers them."""
    return list_of(body, key, need=True)
