"""Request errors of the server: the shared shapes of :mod:`polar_train.wire.errors`, plus vLLM's
three other error forms, so each failure reads as vLLM's would.

Why three: vLLM answers its own checks (``VLLMValidationError``) with type ``BadRequestError`` and
the exception's text, pydantic type/bound failures with type ``Bad Request`` and a
``"1 validation error: {...}"`` message, and a body FastAPI cannot parse with ``{"detail"}``.
"""

from __future__ import annotations

from typing import Any

from ..wire.errors import ApiError, BadRequest, NotFound

__all__ = ["ApiError", "BadRequest", "BodyParseError", "NotFound", "ResponseNotFound", "VllmError",
           "validation_error"]


class VllmError(BadRequest):
    """vLLM's ``VLLMValidationError`` as its error handler prints it: ``str(exc)``, whose
    ``(parameter=…, value=…)`` suffix is part of the message."""

    type = "BadRequestError"

    def __init__(self, message: str, param: str | None = None, value: Any = None) -> None:
        extras = [f"parameter={param}"] if param is not None else []
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message, param)


class ResponseNotFound(NotFound):
    """vLLM's Responses API names an unknown stored response with OpenAI's error type."""

    type = "invalid_request_error"


class BodyParseError(ApiError):
    """A body FastAPI cannot parse at all (e.g. JSON nested past the recursion limit)."""

    def __init__(self) -> None:
        super().__init__("There was an error parsing the body")

    def openai_body(self) -> dict:
        return {"detail": self.message}

    anthropic_body = openai_body


def _summary(value: Any) -> Any:
    """The ``input`` of a pydantic error as vLLM bounds it (containers described, long text cut)."""
    if isinstance(value, str):
        return value[:200] + "...[truncated]" if len(value) > 200 else value
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def validation_error(kind: str, field: str, msg: str, value: Any,
                     ctx: dict[str, Any] | None = None) -> BadRequest:
    """A pydantic field failure as vLLM's validation handler words it (param ``body.<field>``)."""
    err: dict[str, Any] = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": _summary(value)}
    if ctx:
        err["ctx"] = ctx
    return BadRequest(f"1 validation error:\n  {err}", param=f"body.{field}")
