"""Prompt rendering of the server: defined in :mod:`polar_train.wire.render` (shared with the addon),
plus the length check vLLM makes before it tokenises."""

from __future__ import annotations

from ..wire.render import encode, function_tool, normalize_tool, template_kwargs
from ..wire.render import render as _render
from .errors import VllmError

__all__ = ["encode", "encode_prompt", "function_tool", "normalize_tool", "render", "template_kwargs"]


def check_prompt_chars(engine, text: str) -> None:
    """vLLM's ``_text_len_check``: no token is longer than ``max_chars_per_token`` characters, so
    longer text cannot fit the context; refusing it before tokenising keeps a 60 MB prompt from
    costing seconds and gigabytes."""
    limit = engine.max_model_len * engine.max_chars_per_token
    if len(text) > limit:
        raise VllmError(
            f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
            f"prompt contains {len(text)} characters (more than {limit} characters, which is the "
            f"upper bound for {engine.max_model_len} input tokens). Please reduce the length of the "
            "input prompt.", param="input_text", value=len(text))


def encode_prompt(engine, text: str, add_special_tokens: bool = False) -> list[int]:
    """A prompt's token ids, after vLLM's length check."""
    check_prompt_chars(engine, text)
    return list(engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render(tokenizer, messages, tools, add_generation_prompt: bool = True,
           continue_final_message: bool = False, kwargs: dict | None = None) -> str:
    """The prompt text (:func:`polar_train.wire.render.render`), refusing an empty conversation
    as vLLM's renderer does, in its words."""
    if isinstance(messages, list) and not messages:
        raise VllmError("Cannot apply chat template to an empty conversation. Provide at least one "
                        "message.")
    return _render(tokenizer, messages, tools, add_generation_prompt, continue_final_message, kwargs)
