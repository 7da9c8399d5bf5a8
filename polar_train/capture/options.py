"""The addon's options: names, types, defaults and help, declared once.

Why a table here instead of inline ``loader.add_option`` calls: the docs and the tests read the same
list, and the row worker (another process) gets a frozen, picklable :class:`CaptureOptions`
snapshot instead of mitmproxy's live options object.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..paths import expand_home

#: (name, type, default, help). Types are what ``loader.add_option`` accepts.
OPTION_SPECS: list[tuple[str, type, Any, str]] = [
    ("polar_out", str, "data/captures", "Output folder; Parquet parts go to <polar_out>/calls/."),
    ("polar_tokenizer", str, "",
     "Hugging Face model/tokenizer folder used to render token ids where the server returns none "
     "(empty: such calls get token_source=none)."),
    ("polar_inject", bool, True,
     "Ask the upstream for token ids/logprobs (return_token_ids, logprobs, enable_response_messages) "
     "and strip what the client did not ask for from what it receives."),
    ("polar_strip", bool, True,
     "Remove the injected fields from what the client receives (it sees what it would have got "
     "without the proxy). false: the client gets them as the server sent them - extra JSON members "
     "that OpenAI-style clients ignore - and the proxy does no work per event (bench/proxy_overhead.py "
     "addon-nostrip); the call log is the same."),
    ("polar_flush_rows", int, 256, "Close a Parquet part after this many rows."),
    ("polar_flush_seconds", str, "10", "Close a Parquet part after this many seconds (a number)."),
    ("polar_queue_size", int, 1024,
     "Finished calls waiting to be handed to the row worker process; when full, new calls are "
     "dropped (counted, logged), never blocking traffic."),
    ("polar_handoff_ms", int, 20,
     "Hand a finished call to the row worker this many milliseconds after it ends, with every call "
     "that ended meanwhile, so that parsing it does not compete with the next call's first byte "
     "(0: at once). A SIGKILLed proxy also loses the calls of this window."),
    ("polar_rollout_header", str, "x-polar-rollout",
     "Request header naming the rollout (removed before forwarding)."),
    ("polar_task_header", str, "x-polar-task", "Request header naming the task (removed before forwarding)."),
    ("polar_port_rollouts", str, "",
     "Listen port -> rollout id fallback, e.g. '8081=r1,8082=r2' (with --mode regular@8081 ...)."),
    ("polar_tokenize_check", bool, False,
     "For rendered calls, also ask the upstream's /tokenize for the same chat messages (in the row "
     "worker) and record whether its ids equal ours (server_tokenize_match)."),
    ("polar_tokenize_url", str, "",
     "Base URL for the /tokenize check (default: the call's own upstream, scheme://host:port)."),
    ("polar_max_body_mb", int, 256,
     "Request bodies larger than this (MiB) are forwarded untouched and recorded without parsing."),
    ("polar_prompt_delta", bool, False,
     "Store each prompt as a reference to the previous call of its rollout + the new suffix "
     "(prompt_prefix_call_id/len), and each request and response text as its new characters between "
     "copies of the previous call's (request_json_/response_json_base_call_id/delta); "
     "polar_train.calllog.read_calls expands them. ~9x fewer bytes for token ids and ~8x with texts "
     "in long sessions (bench/storage.py); off by default because tools that read the Parquet parts "
     "directly (DuckDB, pyarrow) then see suffixes and new text only."),
]


@dataclass(frozen=True)
class CaptureOptions:
    """A snapshot of the ``polar_`` options (immutable, picklable: the row worker gets a copy)."""

    out: str = "data/captures"
    tokenizer: str = ""
    inject: bool = True
    strip: bool = True
    flush_rows: int = 256
    flush_seconds: float = 10.0
    queue_size: int = 1024
    handoff_ms: int = 20
    rollout_header: str = "x-polar-rollout"
    task_header: str = "x-polar-task"
    port_rollouts: dict[int, str] = field(default_factory=dict)
    tokenize_check: bool = False
    tokenize_url: str = ""
    max_body_mb: int = 256
    prompt_delta: bool = False
    #: mitmproxy's ``ssl_insecure``: the /tokenize check then trusts the upstream as the proxy does.
    tokenize_insecure: bool = False

    def worker_settings(self) -> tuple:
        """What the row worker uses: a change of these needs a new worker, others do not."""
        return (self.out, self.tokenizer, self.flush_rows, self.flush_seconds, self.queue_size, self.handoff_ms,
                self.tokenize_check, self.tokenize_url, self.prompt_delta, self.rollout_header,
                self.task_header, self.port_rollouts, self.tokenize_insecure)

    @classmethod
    def from_mitmproxy(cls, opts: Any) -> "CaptureOptions":
        rollout_header = _header_name("polar_rollout_header", opts.polar_rollout_header)
        task_header = _header_name("polar_task_header", opts.polar_task_header)
        if rollout_header == task_header:
            raise ValueError(f"polar_rollout_header and polar_task_header: both are {rollout_header!r}; "
                             "which one would name the rollout?")
        return cls(
            out=_home_expanded("polar_out", _not_empty("polar_out", opts.polar_out)),
            tokenizer=_home_expanded("polar_tokenizer", opts.polar_tokenizer),
            inject=opts.polar_inject,
            strip=bool(getattr(opts, "polar_strip", True)),
            flush_rows=_at_least("polar_flush_rows", opts.polar_flush_rows, 1),
            flush_seconds=_seconds(opts.polar_flush_seconds),
            queue_size=_at_least("polar_queue_size", opts.polar_queue_size, 1),
            handoff_ms=_at_least("polar_handoff_ms", getattr(opts, "polar_handoff_ms", 20), 0),
            rollout_header=rollout_header,
            task_header=task_header,
            port_rollouts=parse_port_rollouts(opts.polar_port_rollouts),
            tokenize_check=opts.polar_tokenize_check,
            tokenize_url=_base_url("polar_tokenize_url", opts.polar_tokenize_url),
            max_body_mb=_at_least("polar_max_body_mb", opts.polar_max_body_mb, 1),
            prompt_delta=bool(getattr(opts, "polar_prompt_delta", False)),
            tokenize_insecure=bool(getattr(opts, "ssl_insecure", False)),
        )


def _home_expanded(name: str, value: str) -> str:
    """A path option with ``~`` expanded (no shell expands it in ``--set``), its error named."""
    try:
        return expand_home(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _not_empty(name: str, value: str) -> str:
    """A name or path option's value, refused when blank (an empty polar_out would write into
    ./calls of whatever folder mitmdump was started in)."""
    if not value.strip():
        raise ValueError(f"{name}: empty; give a value or leave the option out")
    return value


#: An HTTP field name (RFC 9110 token), and the names a request needs for itself.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_RESERVED_HEADERS = frozenset({"host", "content-length", "content-type", "content-encoding", "transfer-encoding",
                               "connection", "authorization", "proxy-authorization", "x-api-key", "accept-encoding",
                               "expect", "te", "upgrade", "cookie"})


def _header_name(name: str, value: str) -> str:
    """A header option's value as the lower-case field name. ``x-polar-rollout:`` (copied from a
    ``curl -H``) or a name with a space matched no header: every call lost its rollout, and the
    real header went on to the upstream."""
    header = _not_empty(name, value).strip().lower()
    if not _TOKEN.fullmatch(header):
        raise ValueError(f"{name}: {value!r} is not a header name (letters, digits and -, no ':' or spaces)")
    if header in _RESERVED_HEADERS:
        raise ValueError(f"{name}: {header!r} is a header requests need for themselves; choose another name")
    return header


def _base_url(name: str, value: str) -> str:
    """An optional server root URL without its trailing slash; refused without http(s):// (a bare
    ``host:port`` would fail in the row worker, call after call, instead of once here)."""
    value = value.strip().rstrip("/")
    if value and not value.lower().startswith(("http://", "https://")):
        raise ValueError(f"{name}: expected a URL starting with http:// or https://, got {value!r}")
    return value


def _at_least(name: str, value: Any, low: int) -> int:
    """An integer option's value, refused below ``low`` (a typo must not become a silent 1 or 0)."""
    if isinstance(value, bool):  # YAML's `true` passes mitmproxy's int check: it is no count
        raise ValueError(f"{name}: expected a whole number, got {str(value).lower()}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name}: at least {low}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"polar_flush_seconds: expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"polar_flush_seconds: must be > 0, got {text!r}")
    if math.isinf(value):  # "flush by row count only" is a large number: parts also close at shutdown
        raise ValueError(f"polar_flush_seconds: must be a finite number of seconds, got {text!r}")
    return value


def parse_port_rollouts(text: str) -> dict[int, str]:
    """Parse ``'8081=r1,8082=r2'``; raises ``ValueError`` with a clear message on bad input."""
    result: dict[int, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        port, sep, rollout = item.partition("=")
        if not sep or not port.strip().isdigit() or not rollout.strip():
            raise ValueError(f"polar_port_rollouts: expected PORT=ROLLOUT, got {item!r}")
        number = int(port)
        if not 0 < number < 65536:
            raise ValueError(f"polar_port_rollouts: port {number} is not in 1..65535")
        from .identity import id_problem

        if (problem := id_problem(rollout.strip())) is not None:  # the rule every other source follows
            raise ValueError(f"polar_port_rollouts: rollout id for port {number} {problem}")
        if number in result and result[number] != rollout.strip():  # which one would count?
            raise ValueError(f"polar_port_rollouts: port {number} given twice ({result[number]!r}, "
                             f"{rollout.strip()!r})")
        result[number] = rollout.strip()
    return result


def _typed_value_problem(deferred: dict[str, Any], name: str, typespec: Any) -> str | None:
    """Why a typed deferred value does not fit its option (None: it does). A YAML number for a
    text option (``polar_flush_seconds: 2``, the natural way to write it) is taken as its text;
    any other mismatch would be mitmproxy's TypeError traceback at start."""
    from mitmproxy.utils import typecheck

    value = deferred[name]
    if typespec is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        deferred[name] = str(value)
        return None
    try:
        typecheck.check_option_type(name, value, typespec)
    except TypeError:
        kind = {bool: "true or false", int: "a whole number", str: "text"}.get(typespec, str(typespec))
        return f"{name}: expected {kind}, got {value!r}"
    return None


def unusable_deferred(options: Any) -> list[str]:
    """``polar_*`` values given before the addon loaded (``--set`` on the command line, or the
    confdir's ``config.yaml``) that mitmproxy could not convert or whose type does not fit, or
    whose name is no option of ours: one ``"<name>: <why>"`` each, and each is taken out of
    mitmproxy's deferred values.

    Why: mitmproxy converts those values right after the addon's ``load``; a failure there stops
    loading the script without a word (the proxy then serves and records nothing), and an unknown
    name is ignored silently (a typo such as ``polar_flush_row=10``). Uses the option manager's own
    conversion (``_parse_setval``), so what passes here passes there.
    """
    from mitmproxy import exceptions

    deferred = getattr(options, "deferred", None)
    if not isinstance(deferred, dict):
        return []
    known = [spec[0] for spec in OPTION_SPECS]
    # mitmproxy 12's own conversion (private: without it, only unknown names are reported)
    parse, specs = getattr(options, "_parse_setval", None), getattr(options, "_options", None)
    problems = []
    for name in [n for n in deferred if n.startswith("polar_")]:
        if name not in known:
            problems.append(f"{name}: no such option (the addon's are {', '.join(known)})")
            del deferred[name]
            continue
        if parse is None or not isinstance(specs, dict) or name not in specs:
            continue
        raw = getattr(deferred[name], "val", None)
        if raw is None:  # a typed value: from the confdir's config.yaml, or set from Python
            problem = _typed_value_problem(deferred, name, specs[name].typespec)
            if problem:
                problems.append(problem)
                del deferred[name]
            continue
        try:
            parse(specs[name], raw)
        except exceptions.OptionsError as exc:
            why = str(exc).removeprefix(f"Failed to parse option {name}: ")
            problems.append(f"{name}: {why}")
            del deferred[name]
    return problems
