"""PyYAML's parse errors said in one line that keeps where and why.

Why: ``str()`` of a PyYAML error spreads it over several lines, context first ("while parsing a
flow sequence"), then the problem and its line and column with a caret; its first line alone
named neither where to look nor what was wrong. Every command that reads a user's YAML (train's
``--config``, serve's ``--script``) says it the same way.
"""

from __future__ import annotations

from typing import Any


def at(mark: Any) -> str:
    """A PyYAML mark as people count: ``line L, column C`` from 1."""
    return f"line {mark.line + 1}, column {mark.column + 1}"


def one_line(text: str) -> str:
    """``text``'s non-blank lines joined with ``; ``."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def yaml_problem(exc: Exception) -> str:
    """``expected ',' or ']', but got '<stream end>' at line 3, column 1 (while parsing a flow
    sequence started at line 2, column 12)``: the problem, its place, then its context."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and (exc.problem or exc.context):
        mark = exc.problem_mark or exc.context_mark
        text = (exc.problem or exc.context) + (f" at {at(mark)}" if mark else "")
        if exc.problem and exc.context:
            start = exc.context_mark
            same = start is not None and mark is not None and (start.line, start.column) == (
                mark.line, mark.column)
            text += f" ({exc.context}" + (f" started at {at(start)}" if start and not same else "") + ")"
        return one_line(text)
    return one_line(str(exc)) or type(exc).__name__
