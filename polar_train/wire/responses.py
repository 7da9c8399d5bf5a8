"""OpenAI Responses requests (Codex CLI's API) as chat messages and tools, as vLLM converts them.

Input items become chat messages the way vLLM's ``construct_input_messages`` does (reasoning and
function calls of one assistant turn merge into one message); ``custom`` tools (Codex's freeform
``apply_patch``) are shown to the model as a function with a single ``input`` string, vLLM's
shim; ``namespace`` tools are flattened to ``<namespace>__<name>``.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import BadRequest
from .render import function_tool, template_kwargs

CUSTOM_INPUT_KEY = "input"
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_INPUT_KEY: {"type": "string",
                                      "description": "The freeform text payload for this tool."}},
    "required": [CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}


# -- request → chat messages ------------------------------------------------------------------

def _text_of(content: Any) -> str | list | None:
    """A message item's content as vLLM hands it to its chat parser: its parts as they are (text
    parts become the template's text; an ``input_image`` stays an image part, which a text-only
    model's server refuses and a capture does not render as text)."""
    if isinstance(content, str) or content is None:
        return content
    if isinstance(content, list):
        return [p for p in content if isinstance(p, dict)]
    raise BadRequest("message content must be a string or a list of parts", param="input")


def _output_text(output: Any) -> str | list:
    """A tool call's output as the tool message's content: a list of parts (``input_text``,
    ``input_image`` of Codex's ``view_image``) stays a list of parts, as vLLM keeps it."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return [p for p in output if isinstance(p, dict)]
    return json.dumps(output, ensure_ascii=False)


def input_messages(body: dict) -> list[dict[str, Any]]:
    """vLLM's ``construct_input_messages``: instructions, then the input items."""
    msgs: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string", param="instructions")
        msgs.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        msgs.append({"role": "user", "content": items})
        return msgs
    if not isinstance(items, list):
        raise BadRequest("input must be a string or a list of items", param="input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        prev = msgs[-1] if msgs and msgs[-1].get("role") == "assistant" else None
        if kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("name"), str):
                raise BadRequest(f"input[{i}] ({kind}) needs a name", param="input")
            name = item["name"]
            if kind == "function_call":
                args = item.get("arguments") or "{}"
                if item.get("namespace"):
                    name = item["namespace"] + NAMESPACE_SEPARATOR + name
            else:
                args = json.dumps({CUSTOM_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": name, "arguments": args}}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "reasoning":
            reasoning = ""
            if item.get("encrypted_content"):
                raise BadRequest("Encrypted content is not supported.", param="input")
            if item.get("content"):
                reasoning = item["content"][0].get("text", "")
            elif item.get("summary"):
                reasoning = item["summary"][0].get("text", "")
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = reasoning
            else:
                msgs.append({"role": "assistant", "reasoning": reasoning})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            msgs.append({"role": "tool", "content": _output_text(item.get("output")),
                         "tool_call_id": item.get("call_id")})
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"input[{i}].role must be user, system, developer or assistant",
                                 param="input")
            content = _text_of(item.get("content"))
            if role == "assistant":
                text = content if isinstance(content, str) else (content[0].get("text") if content else None)
                if prev is not None and prev.get("content") is None:
                    prev["content"] = text
                else:
                    msgs.append({"role": "assistant", "content": text})
            else:
                msgs.append({"role": role, "content": content})
        else:
            raise BadRequest(f"Unsupported input item type: {kind}", param="input")
    return msgs


NAMESPACE_SEPARATOR = "__"


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function tools the model is shown, as vLLM's ``get_function_tools``: namespace tools
    flattened to ``<namespace>__<name>``, custom tools as a one-string shim, others dropped."""
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise BadRequest("each tool must be an object", param="tools")
        if t.get("type") == "namespace":
            inner = t.get("tools") or []
            if not isinstance(t.get("name"), str) or not isinstance(inner, list):
                raise BadRequest("namespace tools need a name and a list of tools", param="tools")
            for f in inner:
                if isinstance(f, dict) and f.get("type") == "function" and isinstance(f.get("name"), str):
                    out.append(function_tool(t["name"] + NAMESPACE_SEPARATOR + f["name"],
                                             f.get("description"), f.get("parameters"), f.get("strict"),
                                             f.get("defer_loading")))
        elif t.get("type") == "function":
            if not isinstance(t.get("name"), str):
                raise BadRequest("function tools need a name", param="tools")
            out.append(function_tool(t["name"], t.get("description"), t.get("parameters"), t.get("strict"),
                                     t.get("defer_loading")))
        elif t.get("type") == "custom":
            if not isinstance(t.get("name"), str):
                raise BadRequest("custom tools need a name", param="tools")
            out.append(function_tool(t["name"], t.get("description"), CUSTOM_PARAMETERS))
        # built-in tools (web_search, ...) are not rendered: the model cannot call them here
    return out




def request_template_kwargs(body: dict) -> dict[str, Any]:
    """The template kwargs vLLM renders a Responses request with: its ``chat_template_kwargs`` and
    ``reasoning.effort`` (Codex sends one)."""
    reasoning = body.get("reasoning")
    return template_kwargs(body.get("chat_template_kwargs"), reasoning.get("effort") if isinstance(reasoning, dict)
                           else None)
