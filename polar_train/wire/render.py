"""Chat messages + tools → prompt text and ids, exactly as vLLM renders them.

vLLM (and so our server) normalises a request before the chat template sees it: a tool becomes
``{"type": "function", "function": {"name", "description", "parameters"}}`` (missing fields as
``null``), and assistant ``tool_calls[*].function.arguments`` given as JSON text are parsed into
objects (the template dumps them again; text that is no JSON object becomes ``{}``). A message of a role
the template does not know (``wizard``, ``function``) reaches the template, which drops it. The
text is then tokenised without extra special tokens.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .content_format import (ContentFormat, chat_template, knows_developer_role, template_content_format,
                             template_variables)
from .errors import BadRequest


def normalize_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat-completions tool in vLLM's canonical form."""
    if not isinstance(tool, dict):
        raise BadRequest("each tool must be an object", param="tools")
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise BadRequest("only tools of type 'function' with a 'function' object are supported",
                         param="tools")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRequest("tools[].function.name must be a non-empty string", param="tools")
    return function_tool(fn["name"], fn.get("description"), fn.get("parameters"), fn.get("strict"),
                         fn.get("defer_loading"))


def function_tool(name: str, description: str | None, parameters: Any, strict: Any = None,
                  defer_loading: Any = None) -> dict[str, Any]:
    """A tool as vLLM's ``FunctionDefinition`` hands it to the template: ``strict`` and
    ``defer_loading`` where given (Codex sends ``"strict": false`` with every tool: left out, each
    tool line of the prompt was shorter than vLLM's, 60 tokens in a Codex prompt; a probe)."""
    fn: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    for key, value in (("strict", _lax_bool(strict)), ("defer_loading", _lax_bool(defer_loading))):
        if value is not None:
            fn[key] = value
    return {"type": "function", "function": fn}


def _lax_bool(value: Any) -> bool | None:
    """A bool as pydantic's lax mode reads one (``"true"``, ``1``, ``"off"``), None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("1", "on", "t", "true", "y", "yes"):
            return True
        if text in ("0", "off", "f", "false", "n", "no"):
            return False
    return None


#: Content parts vLLM's chat parser hands the template as text parts, by the key holding the text:
#: a ``refusal`` or ``thinking`` part's text was dropped from the prompt (a probe).
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}


def _as_text_part(part: Any) -> Any:
    """A text-like part as the ``{"type": "text", "text": ...}`` the template reads (an
    ``input_text`` part too: a template that prints only ``text`` parts dropped Codex's text; a
    string too)."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if isinstance(part, dict) and (key := TEXT_PART_KEYS.get(part.get("type"))) and part.get("type") != "text":
        return {**{k: v for k, v in part.items() if k not in ("type", key)}, "type": "text", "text": part.get(key)}
    return part


def _joined_text(parts: list, keep_empty: bool) -> str:
    """The parts' texts (a ``tool_reference``'s name) joined by newlines: for a "string" template
    without the empty ones (vLLM's parser drops a part that parses to nothing), for a tool message
    of text parts with them."""
    texts = []
    for part in parts:
        if isinstance(part, dict):
            text = part.get("text") if part.get("type") == "text" else part.get("name") \
                if part.get("type") == "tool_reference" else None
            if isinstance(text, str) and (text or keep_empty):
                texts.append(text)
    return "\n".join(texts)


#: Content parts a model's processor turns into tokens of its own (an image's patches, an audio's
#: frames), never text a chat template prints: a prompt holding one has no rendered ids.
MEDIA_PART_TYPES = frozenset({"image_url", "input_image", "image", "input_audio", "audio_url", "video_url",
                              "image_embeds", "audio_embeds", "video_embeds", "image_pil", "input_file", "file",
                              "document"})


def media_part(messages: Any) -> str | None:
    """Where the first media part of these chat messages is (``image_url in chat message 3, user``:
    the request as converted for the template, a Messages ``image`` block as ``image_url``), or None."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PART_TYPES:
                return f"{kind} in chat message {i + 1}, {m.get('role')}"
            if isinstance(part, dict) and kind is None and (key := next((k for k in part if k in MEDIA_PART_TYPES), None)):
                return f"{key} in chat message {i + 1}, {m.get('role')}"  # (vLLM takes an untyped part by its key)
    return None


#: Claude Code's per-request attribution line (its ``cch`` hash changes every call).
BILLING_HEADER = "x-anthropic-billing-header"


def _part_text(part: Any) -> str | None:
    """The text of a string part or a ``text`` part, else None."""
    if isinstance(part, str):
        return part
    return part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None


def _without_billing_header(content: str | list) -> str | list:
    """A system message without Claude Code's attribution line, as vLLM's chat parser drops it:
    each text part that starts with it loses its first line, and a part left empty goes."""
    parts = [content] if isinstance(content, str) else content
    if not any(isinstance(t := _part_text(p), str) and t.startswith(BILLING_HEADER) for p in parts):
        return content
    out: list = []
    for part in parts:
        text = _part_text(part)
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _is_text(part: Any) -> bool:
    return isinstance(part, str) or (isinstance(part, dict) and part.get("type") == "text")


def _postprocess(messages: list[dict[str, Any]], fmt: ContentFormat = "openai") -> list[dict[str, Any]]:
    """The messages as vLLM's parser hands them to a template of content format ``fmt``: each one
    rebuilt of the keys vLLM keeps (role, content, an assistant's tool calls and reasoning - read from
    ``reasoning_content`` too, given as both -, a tool's call id, ``name``, ``task``, a developer's
    ``tools``); content as parts ("openai": a string too, as one text part, which a template tests
    as true even when empty) or as one string ("string"; a tool message of text parts always)."""
    out = []
    for i, m in enumerate(copy.deepcopy(messages)):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", param="messages")
        role, content = m["role"], m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts",
                             param="messages")
        if role == "system" and content is not None:
            content = _without_billing_header(content)
        parts = [] if content is None else [content] if isinstance(content, str) else content
        # (a text or refusal part without its text is skipped, as vLLM's parser skips it)
        parts = [_as_text_part(part) for part in parts if part is not None and not (
            isinstance(part, dict) and part.get("type") in ("text", "refusal")
            and part.get(TEXT_PART_KEYS[part["type"]]) is None)]
        if fmt == "string":  # a template that prints only a string content: one string, empty texts left out
            content = _joined_text(parts, keep_empty=False)
        elif role == "tool" and all(_is_text(part) for part in parts):
            # vLLM hands a tool message of text parts to the template as one string, the parts
            # joined by newlines (they were printed back to back)
            content = _joined_text(parts, keep_empty=True)
        else:
            content = parts
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = _tool_calls(i, m["tool_calls"])
            # (vLLM's chat request renames a client's "reasoning_content" - Pi's - to "reasoning")
            reasoning = m["reasoning"] if m.get("reasoning") is not None else m.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        elif role == "developer":
            msg["tools"] = m.get("tools")
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant's tool calls, their JSON-text arguments parsed (vLLM renders arguments that are
    no JSON object - text, a list, a number - as ``{}``)."""
    if not isinstance(calls, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list", param="messages")
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest("assistant tool_calls entries need a function with a name", param="messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                parsed = None
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}
    return calls


def _one_system_message(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's answer to developer messages for a template without that role: each becomes a system
    message, and the system messages are merged into one first message (their texts joined by a
    blank line), where one is not first or there are several."""
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conversation):
        if m["role"] in ("developer", "system"):
            merge = merge or i > 0 or bool(system_texts)
            content = m.get("content", "")
            if isinstance(content, list):
                content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                    if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
            if content:
                system_texts.append(content)
        else:
            others.append(m)
    if not merge:
        return [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer" else m
                for m in conversation]
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


#: Template kwargs a request cannot set: the rendering's own arguments (vLLM refuses the first two).
_NOT_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "messages", "conversation", "tools",
                                  "add_generation_prompt", "continue_final_message"})


def template_kwargs(given: Any, reasoning_effort: Any) -> dict[str, Any]:
    """The template kwargs vLLM renders a request with: its ``chat_template_kwargs``, then the
    request's reasoning effort (``reasoning_effort``, and ``enable_thinking`` = effort is not
    "none" unless the request set it) - Qwen3's template opens an empty think block for
    ``enable_thinking=false``, a gpt-oss one prints the effort: rendered without them, a capture's
    ids were those of another prompt (a probe with the real Claude Code and vLLM)."""
    kwargs = dict(given) if isinstance(given, dict) else {}
    if reasoning_effort is not None and reasoning_effort != "auto":  # (vLLM's unset values)
        kwargs["reasoning_effort"] = reasoning_effort
        if not (isinstance(given, dict) and "enable_thinking" in given):
            kwargs["enable_thinking"] = reasoning_effort != "none"
    return kwargs


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text; ``kwargs`` (:func:`template_kwargs`) reach the template where it reads them."""
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list", param="messages")
    template = chat_template(tokenizer)
    read = template_variables(template) if template is not None else frozenset()
    extra = {k: v for k, v in (kwargs or {}).items() if k in read and k not in _NOT_TEMPLATE_KWARGS}
    conversation = _postprocess(messages, template_content_format(template) if template is not None else "string")
    if template is not None and not knows_developer_role(template) and any(
            m["role"] == "developer" for m in conversation):
        conversation = _one_system_message(conversation)
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **extra,
        )
    except BadRequest:
        raise
    except Exception as exc:  # a template error is the request's fault (bad message shape)
        raise BadRequest(f"cannot render the chat template: {exc}", param="messages") from None


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))
