"""Scenario files for scripted mode (format: docs/scenario-format.md).

Why: a real harness must be able to run a deterministic multi-turn, tool-using session against the
server while the token ids stay real. The scripted assistant turn is rendered exactly as the chat
template renders an assistant message, tokenised, and closed with ``<|im_end|>``; the engine then
scores those tokens, so the logprobs are the model's true ones.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..paths import not_a_file
from ..yaml_errors import at, one_line, yaml_problem
from ..tokenizer import IM_END, IM_START, special_tokens
from .errors import BadRequest
from .prompt import encode, render

APIS = ("openai.chat", "openai.responses", "anthropic.messages")
#: Each match key with the type its value must have (a typo or a wrong type never matches silently).
_MATCH_TYPES: dict[str, type] = {"tool": str, "user_contains": str, "api": str, "no_tools": bool,
                                 "system_contains": str}
_TURN_KEYS = {"reasoning", "content", "tool_calls"}
_CALL_KEYS = {"name", "arguments", "input"}
_SCENARIO_KEYS = {"name", "match", "turns", "after_last"}
_SIDE_CALL_KEYS = {"match", "reply"}
_FILE_KEYS = {"scenarios", "side_calls"}
_AFTER_LAST = ("last_text", "repeat_last", "error")


class ScriptError(ValueError):
    """A scenario file that cannot be used (reported as one line at server start)."""


@dataclass
class ScriptedTurn:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # [{name, arguments: dict}]

    def message(self) -> dict[str, Any]:
        # (no content: none, not "" - vLLM hands a template "" as a text part, which it tests as true)
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": dict(c)} for c in self.tool_calls]
        return msg


@dataclass
class RequestView:
    """What matching needs to know about a request, whatever its API."""

    api: str
    messages: list[dict[str, Any]]
    tool_names: list[str]


@dataclass
class Scenario:
    name: str
    match: dict[str, Any]
    turns: list[ScriptedTurn]
    after_last: str = "last_text"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _matches(match: dict[str, Any], req: RequestView) -> bool:
    if "api" in match and match["api"] != req.api:
        return False
    if "tool" in match and match["tool"] not in req.tool_names:
        return False
    if match.get("no_tools") is True and req.tool_names:
        return False
    if match.get("no_tools") is False and not req.tool_names:
        return False
    if "user_contains" in match:
        # any user message: Codex's first one is its <environment_context>, Claude Code's first
        # block a <system-reminder>, so the task is not always in the first user message
        users = "\n".join(_text(m.get("content")) for m in req.messages if m.get("role") == "user")
        if str(match["user_contains"]) not in users:
            return False
    if "system_contains" in match:
        system = "".join(_text(m.get("content")) for m in req.messages
                         if m.get("role") in ("system", "developer"))
        if str(match["system_contains"]) not in system:
            return False
    return True


def assistant_turns(messages: list[dict[str, Any]]) -> int:
    """Assistant turns already in the conversation (a run of assistant messages is one turn)."""
    count, prev = 0, None
    for m in messages:
        role = m.get("role")
        if role == "assistant" and prev != "assistant":
            count += 1
        prev = role
    return count


def _no_unknown_keys(raw: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise ScriptError(f"{where}: unknown keys {sorted(map(str, unknown))} (allowed: {sorted(allowed)})")


def _list(raw: Any, where: str) -> list[Any]:
    """A list-valued key (absent or null: empty); ``turns: 5`` was a TypeError at start."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ScriptError(f"{where} must be a list, got {type(raw).__name__}")
    return raw


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a duplicate key would silently keep the last value."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


@lru_cache(maxsize=1)
def _yaml_loader() -> type:
    """PyYAML's SafeLoader, but a duplicate key in a mapping is an error: a typo'd second
    ``tool:`` in ``match`` would silently replace the first."""
    import yaml
    from yaml.constructor import ConstructorError

    class UniqueKeySafeLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` may be overridden
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:  # unhashable: SafeLoader reports it
                        continue
                    if first is not key_node:
                        where = f"{at(key_node.start_mark)} (first at {at(first.start_mark)})"
                        raise ConstructorError(None, None, f"duplicate key {key!r} at {where}")
            return super().construct_mapping(node, deep=deep)

    return UniqueKeySafeLoader


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


@lru_cache(maxsize=1)
def _special_pattern() -> re.Pattern[str]:
    """Any special token of the tokenizer (the fixed Qwen3.5 list: the loader has no tokenizer)."""
    tokens = sorted((tok for _, tok in special_tokens()), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens)))


def _no_special_tokens(text: str, where: str) -> None:
    """Scripted text is encoded as text: ``<|im_end|>`` in it would put the stop token mid-turn
    (and ``<tool_call>``, ``<think>``... the parser's markers), which the model could never have
    sampled as plain text either."""
    found = _special_pattern().search(text)
    if found:
        ids = {tok: idx for idx, tok in special_tokens()}
        raise ScriptError(f"{where} contains the special token {found.group()!r} (id {ids[found.group()]}); "
                          "scripted text cannot hold special tokens")


def _key_path(where: str, key: str) -> str:
    return f"{where}.{key}" if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f"{where}[{key!r}]"


def _json_value(value: Any, where: str, parents: tuple[int, ...] = ()) -> None:
    """Only what JSON holds: YAML's dates, binary, NaN and non-string keys are refused, so the
    server never sends a date's str or an invalid ``NaN``."""
    if value is None or isinstance(value, (str, bool, int)):
        if isinstance(value, str):
            _no_special_tokens(value, where)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ScriptError(f"{where} is {value!r}, which JSON cannot hold")
        return
    if isinstance(value, (list, dict)):
        if id(value) in parents:  # a YAML anchor that contains itself
            raise ScriptError(f"{where} contains itself, which JSON cannot hold")
        parents = (*parents, id(value))
        if isinstance(value, list):
            for i, item in enumerate(value):
                _json_value(item, f"{where}[{i}]", parents)
            return
        for key, item in value.items():
            if not isinstance(key, str):
                raise ScriptError(f"{where}: key {key!r} is a {_kind(key)}, but JSON object keys are "
                                  "strings (quote it)")
            _no_special_tokens(key, f"{where} (key {key!r})")
            _json_value(item, _key_path(where, key), parents)
        return
    raise ScriptError(f"{where} is a {_kind(value)} ({value!s}), not a JSON value (string, number, "
                      "true/false, null, list or mapping): quote it if it is text")


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"].strip():
        raise ScriptError(f"{where}: needs a 'name'")  # "" too: a call to no tool, which no harness can run
    _no_unknown_keys(c, _CALL_KEYS, where)  # `arguements:` would have become {} without a word
    _no_special_tokens(c["name"], f"{where}.name")
    if "input" in c and "arguments" in c:
        raise ScriptError(f"{where}: 'input' (a freeform tool) or 'arguments', not both")
    if "input" in c:  # a freeform (custom) tool: vLLM's shim passes {"input": text}
        if not isinstance(c["input"], str):  # null was "None", {a: 1} "{'a': 1}"
            raise ScriptError(f"{where}.input must be a string (the freeform tool's text), "
                              f"got {_kind(c['input'])}")
        _no_special_tokens(c["input"], f"{where}.input")
        return {"name": c["name"], "arguments": {"input": c["input"]}}
    args = c.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args, object_pairs_hook=_unique_object)
        except ValueError as exc:
            raise ScriptError(f"{where}.arguments is not JSON: {one_line(str(exc))}") from None
    if not isinstance(args, dict):
        raise ScriptError(f"{where}.arguments must be a mapping")
    _json_value(args, f"{where}.arguments")
    try:  # what the server will send: the walk above should make this never fail
        json.dumps(args, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ScriptError(f"{where}.arguments is not JSON: {exc}") from None
    return {"name": c["name"], "arguments": args}


def _turn(raw: Any, where: str) -> ScriptedTurn:
    if not isinstance(raw, dict):
        raise ScriptError(f"{where}: a turn must be a mapping")
    _no_unknown_keys(raw, _TURN_KEYS, where)
    calls = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(_list(raw.get("tool_calls"),
                                                                                  f"{where}.tool_calls"))]
    for key in ("reasoning", "content"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ScriptError(f"{where}.{key} must be a string")
        if raw.get(key):
            _no_special_tokens(raw[key], f"{where}.{key}")
    if not (raw.get("reasoning") or raw.get("content") or calls):
        raise ScriptError(f"{where}: an empty turn (give content, reasoning or tool_calls)")
    return ScriptedTurn(raw.get("reasoning"), raw.get("content"), calls)


def _match(raw: Any, where: str) -> dict[str, Any]:
    raw = {} if raw is None else raw  # `match: false` or `[]` was {}: it matched everything
    if not isinstance(raw, dict):
        raise ScriptError(f"{where}.match must be a mapping")
    _no_unknown_keys(raw, set(_MATCH_TYPES), f"{where}.match")
    for key, value in raw.items():
        if not isinstance(value, _MATCH_TYPES[key]):
            raise ScriptError(f"{where}.match.{key} must be a {_MATCH_TYPES[key].__name__}, got {value!r}")
    if "api" in raw and raw["api"] not in APIS:
        raise ScriptError(f"{where}.match.api must be one of {', '.join(APIS)}")
    return raw


@dataclass
class Script:
    scenarios: list[Scenario]
    side_calls: list[tuple[dict[str, Any], ScriptedTurn]]

    @classmethod
    def load(cls, path: str | Path) -> "Script":
        p = Path(path)
        if (problem := not_a_file(p, "scenario file")) is not None:
            raise ScriptError(problem)
        try:
            text = p.read_text("utf-8")
            if p.suffix.lower() in (".yaml", ".yml"):  # x.YAML was parsed as JSON
                import yaml

                data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
            else:
                data = json.loads(text, object_pairs_hook=_unique_object)
        except Exception as exc:
            raise ScriptError(f"{p}: cannot parse: {yaml_problem(exc)}") from None
        return cls.from_data(data, str(p))

    @classmethod
    def from_data(cls, data: Any, where: str = "script") -> "Script":
        if not isinstance(data, dict) or not isinstance(data.get("scenarios", []), list):
            raise ScriptError(f"{where}: expected a mapping with a 'scenarios' list")
        _no_unknown_keys(data, _FILE_KEYS, where)
        scenarios, names = [], set()
        for i, raw in enumerate(_list(data.get("scenarios"), f"{where}: scenarios")):
            w = f"{where}: scenarios[{i}]"
            if not isinstance(raw, dict):
                raise ScriptError(f"{w} must be a mapping")
            _no_unknown_keys(raw, _SCENARIO_KEYS, w)
            if isinstance(raw.get("name"), (list, dict)):
                raise ScriptError(f"{w}.name must be a string")
            name = str(raw.get("name") or f"scenario-{i}")
            if name in names:
                raise ScriptError(f"{w}: duplicate name {name!r}")
            names.add(name)
            turns = [_turn(t, f"{w}.turns[{k}]") for k, t in enumerate(_list(raw.get("turns"), f"{w}.turns"))]
            if not turns:
                raise ScriptError(f"{w}: needs at least one turn")
            after = raw.get("after_last", "last_text")
            if after not in _AFTER_LAST:
                raise ScriptError(f"{w}.after_last must be one of {', '.join(_AFTER_LAST)}")
            scenarios.append(Scenario(name, _match(raw.get("match"), w), turns, after))
        side = []
        for i, raw in enumerate(_list(data.get("side_calls"), f"{where}: side_calls")):
            w = f"{where}: side_calls[{i}]"
            if not isinstance(raw, dict) or "reply" not in raw:
                raise ScriptError(f"{w} needs 'match' and 'reply'")
            _no_unknown_keys(raw, _SIDE_CALL_KEYS, w)
            if not raw.get("match"):  # {} matched every request and hid every scenario
                raise ScriptError(f"{w}.match is required and must not be empty (a side call without "
                                  "conditions would answer every request)")
            side.append((_match(raw.get("match"), w), _turn(raw["reply"], f"{w}.reply")))
        if not scenarios and not side:
            raise ScriptError(f"{where}: no scenarios")
        return cls(scenarios, side)

    def turn_for(self, req: RequestView) -> ScriptedTurn:
        """The scripted answer to this request, or a 400 that says why there is none."""
        for match, reply in self.side_calls:
            if _matches(match, req):
                return reply
        for sc in self.scenarios:
            if not _matches(sc.match, req):
                continue
            k = assistant_turns(req.messages)
            if k < len(sc.turns):
                return sc.turns[k]
            if sc.after_last == "repeat_last":
                return sc.turns[-1]
            if sc.after_last == "error":
                raise BadRequest(f"scenario {sc.name!r} has {len(sc.turns)} turns; "
                                 f"this request is turn {k + 1}")
            text_only = [t for t in sc.turns if not t.tool_calls]
            return text_only[-1] if text_only else ScriptedTurn(content="Done.")
        raise BadRequest("no scenario of the script matches this request "
                         f"(api {req.api}, tools {req.tool_names})")


def check_template(tokenizer) -> None:
    """Refuse, before the weights load, a model whose chat template is not ChatML: every scripted
    turn is ChatML's body + ``<|im_end|>`` (each request was a 500 with a traceback)."""
    try:
        turn_token_ids(tokenizer, ScriptedTurn(content="ok"))
    except RuntimeError as exc:
        raise ScriptError(f"--script needs a model whose chat template renders ChatML turns "
                          f"(<|im_start|>assistant ... <|im_end|>): {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a template that raises on a plain assistant turn
        raise ScriptError(f"--script: the model's chat template cannot render an assistant turn: {exc}") from None


def turn_token_ids(tokenizer, turn: ScriptedTurn) -> list[int]:
    """The tokens the model would have produced for this turn: body + ``<|im_end|>``."""
    text = render(tokenizer, [turn.message()], None, add_generation_prompt=False)
    head = f"{IM_START}assistant\n"
    tail = f"{IM_END}\n"
    if not (text.startswith(head) and text.endswith(tail)):
        raise RuntimeError("the chat template does not render an assistant turn as ChatML")
    body = text[len(head): -len(tail)]
    return encode(tokenizer, body) + [tokenizer.convert_tokens_to_ids(IM_END)]
