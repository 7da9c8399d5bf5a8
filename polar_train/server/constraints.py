"""Requests that need constrained decoding (forced tool calls, JSON output, grammars): refused.

Why: vLLM answers them with a grammar-guided sampler; this server samples freely, so a 200 would
carry text the client was promised could not happen (no tool call under ``tool_choice:
"required"``, no JSON under ``response_format: json_object``). A 400 in vLLM's error shape says so.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError, PydanticError, VllmError, field_error, missing
from .fields import to_bool

WHY = "polar-train serve does not constrain decoding"


def _refuse(what: str, param: str) -> VllmError:
    return VllmError(f"{what} needs constrained decoding; {WHY}", param=param)


def _literal(loc: str, expected: str, value: Any) -> dict:
    return field_error("literal_error", loc, f"Input should be {expected}", value,
                       {"expected": expected})


def _is(value: Any, want: bool) -> bool:
    """``value`` read as pydantic's lax bool equals ``want`` (a value no bool is left to the checks)."""
    try:
        return value is not None and to_bool(value, "") is want
    except ApiError:
        return False


def check_tool_envelope(tools: Any, auto: bool, single: bool, param: str) -> None:
    """vLLM (hermes, ``tool_choice`` auto) grammar-constrains the call envelope where one call at
    most is allowed (``parallel_tool_calls: false``, Anthropic's ``disable_parallel_tool_use``) or
    a tool is ``strict``: a free sampler could give a second call, an unknown name or arguments
    off the schema where vLLM never would."""
    if not (auto and isinstance(tools, list) and tools):
        return
    if single:
        raise _refuse(f"{param} (one tool call at most)", param)
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool
        if isinstance(fn, dict) and _is(fn.get("strict"), True):
            raise _refuse(f"a tool with strict: true (tools[{i}])", "tools")


def check_response_format(body: dict) -> None:
    """``response_format``: "text" is free text; a type vLLM does not know is its pydantic union
    error (every branch listed); JSON and structural tags are refused."""
    rf = body.get("response_format")
    if rf is None:
        return
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema", "structural_tag"):
        raise _refuse(f"response_format {kind!r}", "response_format")
    if not isinstance(rf, dict):
        raise PydanticError([field_error("model_type", "body.response_format", "Input should be a "
                                         "valid dictionary or object to extract fields from", rf)])
    loc = "body.response_format"
    tag = _literal(f"{loc}.type", "'structural_tag'", kind)
    raise PydanticError([
        _literal(f"{loc}.type", "'text', 'json_object' or 'json_schema'", kind),
        tag, missing(f"{loc}.format", rf), tag,
        missing(f"{loc}.structures", rf), missing(f"{loc}.triggers", rf),
    ])


def check_chat(body: dict) -> None:
    """Chat completions: forced tool choice, JSON output, ``structured_outputs``."""
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        raise _refuse("tool_choice " + ("'required'" if choice == "required" else "naming a tool"),
                      "tool_choice")
    check_response_format(body)
    if body.get("structured_outputs") is not None:
        raise _refuse("structured_outputs", "structured_outputs")
    check_tool_envelope(body.get("tools"), body.get("tool_choice", "auto") == "auto",
                        _is(body.get("parallel_tool_calls"), False), "parallel_tool_calls false")


def check_messages(body: dict) -> None:
    """Messages API: ``tool_choice`` ``{"type": "any"}`` or ``{"type": "tool", …}`` forces a call;
    ``output_config.format`` a JSON schema (vLLM's ``response_format``)."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        raise _refuse(f"tool_choice {{'type': {choice['type']!r}}}", "tool_choice")
    output = body.get("output_config")
    fmt = output.get("format") if isinstance(output, dict) else None
    if isinstance(fmt, dict) and fmt.get("schema", fmt.get("json_schema")) is not None:
        raise _refuse(f"output_config.format {fmt.get('type', 'json_schema')!r}", "output_config")
    auto = choice is None or isinstance(choice, dict) and choice.get("type") == "auto"
    single = isinstance(choice, dict) and _is(choice.get("disable_parallel_tool_use"), True)
    check_tool_envelope(body.get("tools"), auto, single, "tool_choice.disable_parallel_tool_use")


def check_responses(body: dict) -> None:
    """Responses API: a required or named ``tool_choice``, ``text.format`` JSON."""
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        raise _refuse("tool_choice " + ("'required'" if choice == "required" else "naming a tool"),
                      "tool_choice")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        raise _refuse(f"text.format {fmt['type']!r}", "text.format")
    check_tool_envelope(body.get("tools"), body.get("tool_choice", "auto") in ("auto", None),
                        _is(body.get("parallel_tool_calls"), False), "parallel_tool_calls false")
