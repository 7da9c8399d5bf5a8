"""Request fields read as vLLM's pydantic models read them (lax mode).

Why: vLLM accepts ``"stream": "false"`` as False, ``"max_tokens": "4"`` or ``4.0`` as 4 and
``"seed": "5"`` as 5, and refuses ``"stream": "x"`` with pydantic's ``bool_parsing`` error; Python
truthiness would stream on ``"false"``. Every boolean, integer and number field goes through here.
"""

from __future__ import annotations

from typing import Any

from ..wire.lax import FALSE_WORDS, INT_TEXT, TRUE_WORDS
from .errors import PydanticError, field_error, missing, validation_error

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def to_bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:  # no trimming: " true " is refused
        return value.lower() in TRUE_WORDS
    if isinstance(value, (str, int, float)):
        raise validation_error("bool_parsing", field,
                               "Input should be a valid boolean, unable to interpret input", value)
    raise validation_error("bool_type", field, "Input should be a valid boolean", value)


def to_int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise validation_error("finite_number", field, "Input should be a finite number", value)
        if not value.is_integer():
            raise validation_error("int_from_float", field, "Input should be a valid integer, got a "
                                   "number with a fractional part", value)
        if not -(2**63) <= value < 2**63:  # (pydantic reads a float through an int64)
            raise validation_error("int_parsing_size", field, "Unable to parse input string as an integer, "
                                   "exceeded maximum size", value)
        return int(value)
    if isinstance(value, str):
        m = INT_TEXT.fullmatch(value.strip())  # ASCII digits only: int() would take "٤" and "4."
        if m is None:
            raise validation_error("int_parsing", field, "Input should be a valid integer, unable "
                                   "to parse string as an integer", value)
        return int(m[1])
    raise validation_error("int_type", field, "Input should be a valid integer", value)


def to_float(value: Any, field: str) -> float:
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:
            raise validation_error("float_parsing", field, "Input should be a valid number", value) from None
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise validation_error("float_parsing", field, "Input should be a valid number, unable "
                                   "to parse string as a number", value) from None
    raise validation_error("float_type", field, "Input should be a valid number", value)


def flag(body: dict, key: str, default: bool = False, field: str | None = None) -> bool:
    """A boolean field; absent or ``null`` is ``default``."""
    v = body.get(key)
    return default if v is None else to_bool(v, field or key)


def seed(body: dict) -> int | None:
    """``seed``: an int64, as vLLM's ``Field(ge=INT64_MIN, le=INT64_MAX)``."""
    v = body.get("seed")
    if v is None:
        return None
    s = to_int(v, "seed")
    if s > INT64_MAX:
        raise validation_error("less_than_equal", "seed", f"Input should be less than or equal to "
                               f"{INT64_MAX}", v, {"le": INT64_MAX})
    if s < INT64_MIN:
        raise validation_error("greater_than_equal", "seed", f"Input should be greater than or "
                               f"equal to {INT64_MIN}", v, {"ge": INT64_MIN})
    return s


def obj(body: dict, key: str, model: str) -> dict:
    """A nested object field (``stream_options`` …); absent or ``null`` is ``{}``."""
    v = body.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise validation_error("model_type", key, f"Input should be a valid dictionary or instance "
                               f"of {model}", v, {"class_name": model})
    return v


# -- shapes of container and text fields, as vLLM's request models refuse them -------------------

def _list_type(loc: str, value: Any) -> dict:
    return field_error("list_type", loc, "Input should be a valid list", value)


def _string_type(loc: str, value: Any) -> dict:
    return field_error("string_type", loc, "Input should be a valid string", value)


def required(body: dict, key: str) -> Any:
    """A field the request model requires: absent is pydantic's ``missing``."""
    if key not in body:
        raise PydanticError([missing(f"body.{key}", body)])
    return body[key]


def list_of(body: dict, key: str, need: bool = False) -> list | None:
    """A ``list[...]`` field (``None`` allowed unless ``need``)."""
    v = required(body, key) if need else body.get(key)
    if v is None and not need:
        return None
    if not isinstance(v, list):
        raise PydanticError([_list_type(f"body.{key}", v)])
    return v


def text(body: dict, key: str) -> str | None:
    """An optional ``str`` field."""
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise PydanticError([_string_type(f"body.{key}", v)])
    return v


def str_or_list(value: Any, loc: str) -> None:
    """``str | list[...]``: pydantic tries both branches and reports each."""
    if not isinstance(value, (str, list)):
        raise PydanticError([_string_type(loc, value), _list_type(loc, value)])


def strings(body: dict, key: str, allow_str: bool) -> list[str]:
    """``stop`` (``str | list[str] | None``) or ``stop_sequences`` (``list[str] | None``) as a list."""
    v = body.get(key)
    if v is None:
        return []
    loc = f"body.{key}"
    if allow_str and isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise PydanticError(([_string_type(loc, v)] if allow_str else []) + [_list_type(loc, v)])
    bad = [_string_type(f"{loc}.{i}", s) for i, s in enumerate(v) if not isinstance(s, str)]
    if bad:
        raise PydanticError(([_string_type(loc, v)] if allow_str else []) + bad)
    return list(v)
