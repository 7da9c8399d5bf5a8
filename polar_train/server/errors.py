"""Request errors of the server: the shared shapes of :mod:`polar_train.wire.errors`, plus vLLM's
three other error forms, so each failure reads as vLLM's would.

Why three: vLLM answers its own checks (``VLLMValidationError``) with type ``BadRequestError`` and
the exception's text, pydantic type/shape/bound failures with type ``Bad Request`` and a
``"N validation error(s): {...}"`` message (in the OpenAI shape on every route, the Messages API's
included: its handler is app-wide), and a body FastAPI cannot parse with ``{"detail"}``.
"""

from __future__ import annotations

from typing import Any

from ..wire.errors import ApiError, BadRequest, NotFound

__all__ = ["ApiError", "BadRequest", "BodyParseError", "NotFound", "PydanticError", "ResponseNotFound",
           "ResponsesInvalidRequest", "UnsupportedMediaType", "VllmError", "field_error", "missing",
           "validation_error", "value_error"]


class VllmError(BadRequest):
    """vLLM's ``VLLMValidationError`` as its error handler prints it: ``str(exc)``, whose
    ``(parameter=…, value=…)`` suffix is part of the message."""

    type = "BadRequestError"

    def __init__(self, message: str, param: str | None = None, value: Any = None) -> None:
        extras = [f"parameter={param}"] if param is not None else []
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message, param)


class UnsupportedMediaType(BadRequest):
    """vLLM's ``validate_json_request``: a validation error whose one entry is plain text."""

    def __init__(self) -> None:
        super().__init__("1 validation error:\n  Unsupported Media Type: Only 'application/json' "
                         "is allowed")

    def anthropic_body(self) -> dict:  # vLLM's validation handler is app-wide (OpenAI shape)
        return self.openai_body()


class ResponseNotFound(NotFound):
    """vLLM's Responses API names an unknown stored response with OpenAI's error type."""

    type = "invalid_request_error"


class ResponsesInvalidRequest(BadRequest):
    """A check of vLLM's Responses serving (``create_error_response(err_type="invalid_request_error")``):
    OpenAI's error type, the message as written, no ``(parameter=…)`` suffix."""

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


def field_error(kind: str, loc: str, msg: str, value: Any, ctx: dict[str, Any] | None = None) -> dict:
    """One pydantic error entry as vLLM prints it (``loc`` already dotted, ``input`` bounded)."""
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": _summary(value)}
    if ctx:
        err["ctx"] = ctx
    return err


def missing(loc: str, parent: Any) -> dict:
    """pydantic's ``missing``: its ``input`` is the object the field is missing from."""
    return field_error("missing", loc, "Field required", parent)


class PydanticError(BadRequest):
    """vLLM's ``RequestValidationError`` handler: type "Bad Request", ``param`` the first error's
    cleaned ``loc``, message ``"N validation error(s):\n  {...}"`` (at most 10 entries).

    The handler is app-wide, so the Messages API answers these in the OpenAI shape too."""

    def __init__(self, errors: list[dict]) -> None:
        label = "error" if len(errors) == 1 else "errors"
        message = f"{len(errors)} validation {label}:\n" + "".join(
            f"  {_bounded(e)}\n" for e in errors[:_MAX_REPORTED])
        if len(errors) > _MAX_REPORTED:
            message += f"  ...and {len(errors) - _MAX_REPORTED} more {label}\n"
        super().__init__(message.rstrip(), param=errors[0]["loc"])
        self.errors = errors

    def anthropic_body(self) -> dict:
        return self.openai_body()


_MAX_REPORTED, _MAX_ERROR_CHARS = 10, 1000


def _bounded(err: dict) -> str:
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def validation_error(kind: str, field: str, msg: str, value: Any,
                     ctx: dict[str, Any] | None = None) -> PydanticError:
    """A pydantic field failure as vLLM's validation handler words it (param ``body.<field>``)."""
    return PydanticError([field_error(kind, f"body.{field}", msg, value, ctx)])


def value_error(loc: str, text: str, value: Any) -> PydanticError:
    """A pydantic ``field_validator``/``model_validator`` that raised ``ValueError(text)``."""
    return PydanticError([field_error("value_error", loc, f"Value error, {text}", value,
                                      {"error": ValueError(text)})])
