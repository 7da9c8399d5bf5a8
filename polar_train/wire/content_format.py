"""How a chat template reads its inputs: a message's content as a list of parts or as one string,
and which variables it reads (the request's template kwargs reach only those).

Why: vLLM hands a template what it can read. A template that loops over a message's content
("openai" format: ours) gets the parts; any other ("string" format: Qwen3's own, which prints a
content only when it is a string) gets the text parts joined by newlines. Rendering a Claude Code
request of several text blocks as parts for a string template printed an empty user turn, and the
capture recorded ids of a prompt the server never saw. The detection reads the template's syntax
tree as vLLM's does: a ``for`` over ``message['content']`` (or ``message.content``, through
filters and slices), over a macro parameter a message's content is passed to, or over a variable
named ``content`` outside a macro, means "openai".
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Literal

ContentFormat = Literal["openai", "string"]


def chat_template(tokenizer: Any) -> str | None:
    """The source of the template ``apply_chat_template`` renders with, or None."""
    try:
        template = tokenizer.get_chat_template()
    except Exception:  # noqa: BLE001 - no template, several without a default: apply_chat_template says so
        return None
    return template if isinstance(template, str) else None


def content_format(tokenizer: Any) -> ContentFormat:
    """The content format of ``tokenizer``'s chat template ("string" where it has none to read)."""
    template = chat_template(tokenizer)
    return template_content_format(template) if template is not None else "string"


def knows_developer_role(template: str) -> bool:
    """Whether the template names the ``developer`` role (vLLM's test): one that does not gets
    Codex's developer messages as system messages, merged into one first system message."""
    return '"developer"' in template or "'developer'" in template


@functools.lru_cache(maxsize=32)
def template_content_format(template: str) -> ContentFormat:
    """:func:`content_format` of one template's source ("string" when it does not parse)."""
    tree = _parse(template)
    if tree is None:
        return "string"
    try:
        return "openai" if next(_content_loops(tree), None) is not None else "string"
    except _Unreadable:  # where vLLM's reading fails (its assertion), it answers "string" too
        return "string"


class _Unreadable(Exception):
    """A messages alias or loop whose target is no plain name (``{% set ns.m = messages %}``,
    ``{% for a, b in messages|batch(2) %}``): vLLM's detection stops there."""


def _target(node) -> str:
    import jinja2.nodes as n

    if not isinstance(node, n.Name):
        raise _Unreadable
    return node.name


def _parse(template: str):
    try:  # the environment transformers renders with (its extensions: loop controls, {% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 - a template that does not compile renders nothing either
        try:
            import jinja2

            return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        except Exception:  # noqa: BLE001
            return None


def _inner(node):
    """The value a filter, a test or a slice is applied to (``messages | reverse``, ``messages[1:]``)."""
    import jinja2.nodes as n

    while True:
        if isinstance(node, (n.Filter, n.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            node = node.node
        else:
            return node


def _is_name(node, name: str) -> bool:
    import jinja2.nodes as n

    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


def _is_key_of(node, name: str, key: str) -> bool:
    """``name[key]`` or ``name.key`` (through filters and slices)."""
    import jinja2.nodes as n

    node = _inner(node)
    if isinstance(node, n.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    return isinstance(node, n.Getattr) and _is_name(node.node, name) and node.attr == key


def _aliases(tree, name: str) -> set[str]:
    """``name`` and the variables set from it (``{% set msgs = messages[1:] %}``), transitively."""
    import jinja2.nodes as n

    found, todo = {name}, [name]
    while todo:
        current = todo.pop()
        for assign in tree.find_all(n.Assign):
            if _is_name(_inner(assign.node), current) and (name := _target(assign.target)) not in found:
                found.add(name)
                todo.append(name)
    return found


def _content_loops(tree) -> Iterator[Any]:
    import jinja2.nodes as n

    lists = _aliases(tree, "messages")
    message_vars = {_target(loop.target) for loop in tree.find_all(n.For)
                    if any(_is_name(_inner(loop.iter), v) for v in lists)}

    def is_content(node) -> bool:
        return any(_is_key_of(node, v, "content") for v in message_vars)

    in_macros: set[int] = set()
    for macro in tree.find_all(n.Macro):
        params = [a.name for a in macro.args]
        bound = set()
        for call in tree.find_all(n.Call):
            if _is_name(call.node, macro.name):
                bound |= {params[i] for i, arg in enumerate(call.args[:len(params)]) if is_content(arg)}
                bound |= {kw.key for kw in call.kwargs if kw.key in params and is_content(kw.value)}
        for loop in macro.find_all(n.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, n.Name) and loop.iter.name in bound:
                _target(loop.target)
                yield loop
    for loop in tree.find_all(n.For):
        if is_content(loop.iter) or (id(loop) not in in_macros and _is_name(loop.iter, "content")):
            _target(loop.target)
            yield loop


@functools.lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its caller (``enable_thinking``, ``reasoning_effort``):
    vLLM hands a template only the request's kwargs it reads (empty when it does not parse)."""
    tree = _parse(template)
    if tree is None:
        return frozenset()
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(tree))
