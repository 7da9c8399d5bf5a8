"""``polar-train inspect DIR``: a summary of a capture folder's call log.

Why: before building trajectories a user wants to see at a glance what was captured - how many
calls per API, rollout and status, how many tokens, where the ids came from (server / rendered /
none), and whether rendered ids matched the server's usage counts.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def load_calls(path: str | Path):
    """The call log under ``path`` (a capture folder, its ``calls/`` or one part), prompts resolved.

    Returns (table, parts, problems); unreadable or foreign parts are skipped and named in problems.
    """
    from .calllog import CallLogError, read_call_log
    from .cli import UserError

    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"{root} not found" if not root.is_symlink() else f"{root} is a broken link")
    try:
        log = read_call_log(root)
    except CallLogError as exc:
        raise UserError(str(exc)) from None
    return log.table, log.parts, [str(p) for p in log.problems]


def _table(title: str, header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([title, line(header), line(["-" * w for w in widths]), *map(line, cells[1:])])


def summarize(table, top: int = 20) -> str:
    rows = table.to_pylist()
    n = len(rows)
    out = [f"{n} calls"]
    by_api: dict[str, Counter] = {}
    for r in rows:
        c = by_api.setdefault(r["api"] or "(none)", Counter())  # null only in a part written by hand
        c["calls"] += 1
        c[r["status"] or "(none)"] += 1
        c["prompt"] += len(r.get("prompt_token_ids") or [])
        c["completion"] += len(r.get("completion_token_ids") or [])
        c[f"src:{r.get('token_source') or 'none'}"] += 1
        if r.get("usage_match") is False:
            c["usage_mismatch"] += 1
    statuses = ["ok", "upstream_error", "client_disconnected", "proxy_error"]
    sources = ["server", "rendered", "none"]
    api_rows = []
    for api, c in sorted(by_api.items()):
        calls = c["calls"]
        api_rows.append([api, calls, *[c[s] for s in statuses], c["prompt"], c["completion"],
                         *[f"{100 * c['src:' + s] / calls:.0f}%" for s in sources], c["usage_mismatch"]])
    out.append(_table("\nper api", ["api", "calls", *statuses, "prompt_tok", "completion_tok",
                                    *sources, "usage_mismatch"], api_rows))
    per_rollout: dict[str, Counter] = {}
    for r in rows:
        c = per_rollout.setdefault(r.get("rollout_id") or "(none)", Counter())
        c["calls"] += 1
        c["ok"] += r["status"] == "ok"
        c["retries"] += (r.get("attempt") or 1) > 1
        c["tokens"] += len(r.get("prompt_token_ids") or []) + len(r.get("completion_token_ids") or [])
    ranked = sorted(per_rollout.items(), key=lambda kv: -kv[1]["calls"])
    if top == 0:  # totals only: the count, no table of rollouts
        out.append(f"\n{len(ranked)} rollouts")
    else:
        roll_rows = [[k, c["calls"], c["ok"], c["retries"], c["tokens"]] for k, c in ranked[:top]]
        more = f"\n({len(ranked) - top} more rollouts)" if len(ranked) > top else ""
        out.append(_table(f"\nper rollout ({len(ranked)})", ["rollout", "calls", "ok", "retries", "tokens"],
                          roll_rows) + more)
    errors = Counter((r["status"] or "(none)", (r.get("error") or "")[:80]) for r in rows if r["status"] != "ok")
    if errors and top:
        out.append(_table("\nerrors", ["status", "count", "error"],
                          [[s, k, e] for (s, e), k in errors.most_common(top)]))
    return "\n".join(out)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .cli import UserError, print_out

    table, files, problems = load_calls(args.dir)
    if not files:  # every part was skipped: an empty summary would read as "no calls yet"
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"no readable call-log part in {args.dir}; skipped {problems[0]}{more}")
    folders = sorted({str(Path(f).parent) for f in files})
    where = f" from {len(folders)} folders: {', '.join(folders)}" if len(folders) > 1 else ""
    lines = [f"{args.dir}: {len(files)} part(s){where}", *(f"skipped: {p}" for p in problems),
             summarize(table, top=args.top)]
    print_out("\n".join(lines))  # `polar-train inspect DIR | head`: not an error
    return 0


def _rows(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise a capture folder's call log")
    p.add_argument("dir", help="capture folder (polar_out) or its calls/ subfolder")
    p.add_argument("--top", type=_rows, default=20, help="rows shown per table (default 20; 0: totals only)")
    p.set_defaults(func=_cmd_inspect)
