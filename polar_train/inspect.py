"""``polar-train inspect DIR``: a summary of a capture folder's call log.

Why: before building trajectories a user wants to see at a glance what was captured - how many
calls per API, rollout and status, how many tokens, where the ids came from (server / rendered /
none), and whether rendered ids matched the server's usage counts.
"""

from __future__ import annotations

import argparse
import json
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from .paths import user_path
from .terminal import printable

if TYPE_CHECKING:  # the reader (pyarrow) is imported only when a command runs
    from .calllog import PartProblem


def load_calls(path: str | Path):
    """The call log under ``path`` (a capture folder, its ``calls/`` or one part), prompts resolved.

    Returns the :class:`~polar_train.calllog.CallLog`: its table, parts, the problems of parts
    (unreadable, foreign: skipped) and of calls (a compact prompt or text that cannot be rebuilt),
    and how many rows were stored compactly.
    """
    from .calllog import CallLogError, read_call_log
    from .cli import UserError

    if not str(path).strip():  # Path("") is the current folder: every part under it would be read
        raise UserError("the capture folder is empty: name it (\".\" for the current one)")
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"{root} not found" if not root.is_symlink() else f"{root} is a broken link")
    try:
        return read_call_log(root, rebuild=False)  # lengths and counts only: checked, not rebuilt
    except CallLogError as exc:
        raise UserError(str(exc)) from None


#: The per-rollout row of the calls without a rollout id (in brackets: a real id shows bare).
_NO_ROLLOUT = "[no rollout id]"


def _columns(text: str) -> int:
    """Terminal columns of ``text``: an emoji or CJK character takes two, a combining mark none
    (``len`` counted one each, and a rollout id holding an emoji pushed its row's columns right)."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
               for c in text)


def _table(title: str, header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [[printable(c) for c in r] for r in rows]
    widths = [max(_columns(r[i]) for r in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        pads = [" " * (w - _columns(c)) for c, w in zip(row, widths)]
        return "  ".join(c + pad if i == 0 else pad + c for i, (c, pad) in enumerate(zip(row, pads)))

    return "\n".join([title, line(header), line(["-" * w for w in widths]), *map(line, cells[1:])])


def _lengths(table, column: str) -> list[int]:
    """Ids per row (0 for null), counted by Arrow: never the ids themselves as Python ints (a long
    capture's prompts are tens of millions of them)."""
    import pyarrow.compute as pc

    return pc.fill_null(pc.list_value_length(table.column(column)), 0).to_pylist()


def first_of_each_call(table):
    """The rows of ``table`` less those that repeat a call id read before (a part copied twice),
    and how many were left out."""
    seen: set = set()
    keep = []
    for i, cid in enumerate(table.column("call_id").to_pylist()):
        if cid is None or cid not in seen:
            seen.add(cid)
            keep.append(i)
    return (table, 0) if len(keep) == table.num_rows else (table.take(keep), table.num_rows - len(keep))


_HTTP_ERROR = re.compile(r"HTTP (\d{3}): (\{.*)", re.DOTALL)
_JSON_MESSAGE = re.compile(r'"message"\s*:\s*"((?:[^"\\]|\\.)*)')
_JSON_TYPE = re.compile(r'"type"\s*:\s*"(\w*Error\w*)"')


def readable_error(text: str) -> str:
    """An error as a person reads it: ``HTTP 400: {"error": {"message": ...}}`` (a server's JSON
    error, up to 2,000 characters kept) as ``HTTP 400: BadRequestError: <message>``, so the table's
    width shows the message and not the JSON around it; other text as it is."""
    match = _HTTP_ERROR.match(text)
    if match is None:
        return text
    body = match.group(2)
    found = _JSON_MESSAGE.search(body)  # a regex, not json.loads: a long body was cut at its limit
    if found is None:
        return text
    try:
        message = json.loads(f'"{found.group(1)}"')
    except ValueError:  # cut inside an escape
        message = found.group(1)
    kind = _JSON_TYPE.search(body)
    return f"HTTP {match.group(1)}: " + (f"{kind.group(1)}: " if kind else "") + message


def _clip(text: str, width: int = 80) -> str:
    """A message cut to ``width``, marked as cut (a note that stops mid-word read as whole). Notes and
    errors get room for their reason: cut at 80, "the reply was cut (max_tokens) inside a tool call:
    the t…" hid why the call kept no ids."""
    return text if len(text) <= width else text[:width - 1] + "…"


def summarize(table, top: int = 20) -> str:
    n = table.num_rows
    col = {name: table.column(name).to_pylist()
           for name in ("api", "status", "token_source", "usage_match", "rollout_id", "attempt", "error")}
    prompt = (table.column("prompt_length").fill_null(0).to_pylist() if "prompt_length" in table.column_names
              else _lengths(table, "prompt_token_ids"))
    completion = _lengths(table, "completion_token_ids")
    out = [f"{n} calls"]
    by_api: dict[str, Counter] = {}
    for i in range(n):
        c = by_api.setdefault(col["api"][i] or "(none)", Counter())  # null only in a part written by hand
        c["calls"] += 1
        c[col["status"][i] or "(none)"] += 1
        c["prompt"] += prompt[i]
        c["completion"] += completion[i]
        if col["status"][i] == "ok":  # a failed call has no ids whatever the setup: not counted as "none"
            c[f"src:{col['token_source'][i] or 'none'}"] += 1
        if col["usage_match"][i] is False:
            c["usage_mismatch"] += 1
    statuses = ["ok", "upstream_error", "client_disconnected", "proxy_error"]
    sources = ["server", "rendered", "none"]
    api_rows = []
    for api, c in sorted(by_api.items()):
        calls = c["calls"]
        api_rows.append([api, calls, *[c[s] for s in statuses], c["prompt"], c["completion"],
                         *[_share(c['src:' + s], c["ok"]) if c["ok"] else "-" for s in sources],
                         c["usage_mismatch"]])
    out.append(_table("\nper api", ["api", "calls", *statuses, "prompt_tok", "completion_tok",
                                    *sources, "usage_mismatch"], api_rows))  # sources: shares of the ok calls
    used = {name: table.column(name).to_pylist() if name in table.column_names else [None] * n
            for name in ("usage_prompt_tokens", "usage_completion_tokens")}
    out += _mismatch_sides(used, col["usage_match"], prompt, completion)
    per_rollout: dict[str | None, Counter] = {}  # None apart: a rollout named "(none)" is not the calls without one
    # a request seen before in its rollout is a retry, also where another proxy (or a restarted
    # one) counted its attempts afresh: each proxy numbers only the attempts it saw
    hashes = table.column("request_hash").to_pylist() if "request_hash" in table.column_names else [None] * n
    seen: set[tuple[str, str | None, str]] = set()
    for i in range(n):
        rollout = col["rollout_id"][i]
        c = per_rollout.setdefault(rollout, Counter())
        c["calls"] += 1
        c["ok"] += col["status"][i] == "ok"
        # (the same body sent to two APIs is two requests, as the capture and the build count them)
        key = (rollout, col["api"][i], hashes[i]) if rollout is not None and hashes[i] is not None else None
        c["retries"] += (key is not None and key in seen) or (col["attempt"][i] or 1) > 1
        if key is not None:
            seen.add(key)
        c["tokens"] += prompt[i] + completion[i]
    ranked = sorted(per_rollout.items(), key=lambda kv: -kv[1]["calls"])
    if top == 0:  # totals only: the count, no table of rollouts
        out.append(f"\n{len(ranked)} rollouts")
    else:
        # a client may name its rollout as the id-less row is labelled: quoted then, to tell them apart
        roll_rows = [[_NO_ROLLOUT if k is None else f'"{k}"' if k == _NO_ROLLOUT else k, c["calls"], c["ok"],
                      c["retries"], c["tokens"]]
                     for k, c in ranked[:top]]
        more = f"\n({len(ranked) - top} more rollouts)" if len(ranked) > top else ""
        out.append(_table(f"\nper rollout ({len(ranked)})", ["rollout", "calls", "ok", "retries", "tokens"],
                          roll_rows) + more)
    # the token columns count recorded ids: an ok call that kept none (its note says why) counts 0
    # there, which read as a rollout of empty calls (a probe: "cc-rs 4 4 0 0" for ~12,000 tokens)
    without = [i for i in range(n) if col["status"][i] == "ok" and (col["token_source"][i] or "none") == "none"]
    if without:
        reported = sum((used["usage_prompt_tokens"][i] or 0) + (used["usage_completion_tokens"][i] or 0)
                       for i in without)
        out.append(f"\ntokens count recorded ids: {len(without)} ok call(s) kept none and count 0"
                   + (f" (the server's usage for them: {reported} tokens)" if reported else ""))
    # counted by the whole text, shown cut: two errors that differ past the cut are two lines
    errors = Counter((col["status"][i] or "(none)", readable_error(col["error"][i] or ""))
                     for i in range(n) if col["status"][i] != "ok")
    if errors and top:
        out.append(_table("\nerrors", ["status", "count", "error"],
                          [[s, k, _clip(e, 160)] for (s, e), k in errors.most_common(top)])
                   + (f"\n({len(errors) - top} more errors)" if len(errors) > top else ""))
    # an ok call may still say why something is missing: no token ids (a prompt the template
    # refuses, a credential in the prompt), a check that could not run
    notes = Counter(col["error"][i] for i in range(n) if col["status"][i] == "ok" and col["error"][i])
    if notes and top:
        out.append(_table(f"\nnotes on ok calls ({notes.total()})", ["count", "note"],
                          [[k, _clip(e, 240)] for e, k in notes.most_common(top)])
                   + (f"\n({len(notes) - top} more notes)" if len(notes) > top else ""))
    elif notes:
        out.append(f"\n{notes.total()} ok calls carry a note")
    return "\n".join(out)


def _mismatch_sides(used: dict[str, list], usage_match: list, prompt: list[int], completion: list[int]) -> list[str]:
    """Which count a usage mismatch is in: a prompt is rendered exactly where the template is the
    server's, a rendered completion re-encodes the reply's text (a sampler's 24 newlines can be 2
    ids), so the two mean different things (a probe: Claude Code's rows, 21 of 36 mismatched, all
    in the completion)."""
    rows = [i for i, match in enumerate(usage_match) if match is False]
    if not rows:
        return []
    in_prompt = sum(1 for i in rows if prompt[i] and used["usage_prompt_tokens"][i] not in (None, prompt[i]))
    in_completion = sum(1 for i in rows if used["usage_completion_tokens"][i] not in (None, completion[i]))
    return [f"usage mismatches: {in_prompt} in the prompt's count (another template than the server's?), "
            f"{in_completion} in the completion's (rendered ids re-encode the reply's text)"]


def _share(part: int, whole: int) -> str:
    """A percentage that never rounds a share to its neighbouring whole: one call of 224 without ids
    read as 0%, and its 223 others as 100%."""
    if 0 < part < whole and 100 * part / whole < 0.5:
        return "<1%"
    if 0 < part < whole and 100 * part / whole > 99.5:
        return ">99%"
    return f"{100 * part / whole:.0f}%"


#: Problems of calls shown by name; the rest are counted (a lost part can leave thousands).
_SHOWN_CALL_PROBLEMS = 5


def _cmd_inspect(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from .calllog import live_notes, live_writers, loss_notes, nothing_readable, shared_rollout_notes
    from .cli import UserError, print_out

    live_before = live_writers(args.dir, [])  # (a proxy that stops during the read: still said)
    log = load_calls(args.dir)
    table, files, problems = log.table, log.parts, log.problems
    if log.prompt_lengths is not None:  # the prompts were checked, not rebuilt: their lengths ride along
        table = table.append_column("prompt_length", pa.array(log.prompt_lengths, pa.int64()))
    skipped = [p for p in problems if p.call_id is None]
    if not files:  # every part was skipped: an empty summary would read as "no calls yet"
        raise UserError(nothing_readable(args.dir, problems))
    folders = sorted({str(Path(f).parent) for f in files})
    where = f" from {len(folders)} folders: {', '.join(folders)}" if len(folders) > 1 else ""
    size = sum(_size(f) for f in files)
    shown = f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.0f} kB"
    lines = [printable(f"{args.dir}: {len(files)} part(s), {shown}{where}"),
             *(f"skipped: {printable(p)}" for p in skipped)]
    lines += [printable(f"note: {live}") for live in live_notes(live_before, live_writers(args.dir, files))]
    lines += [printable(f"note: {loss}") for loss in loss_notes(args.dir, files)]
    lines += [printable(f"note: {shared}") for shared in shared_rollout_notes(log)]
    if log.compact_rows:
        lines.append(f"compact storage: {log.compact_rows} of {table.num_rows} rows store their prompt or texts as "
                     "a delta of an earlier call (checked here; `read_calls` rebuilds them)")
    table, repeated = first_of_each_call(table)
    if repeated:
        lines.append(f"{repeated} rows repeat a call id already read (a part copied twice?): each call counted once")
    unresolved = {p.call_id: p for p in problems if p.call_id is not None and p.column == "prompt_token_ids"}
    lines += _call_problems(unresolved, "compact prompt", "their prompt tokens are not counted, and `build` leaves "
                            "them out")
    texts = {p.call_id: p for p in problems
             if p.call_id is not None and p.column != "prompt_token_ids" and p.call_id not in unresolved}
    lines += _call_problems(texts, "compact request or response text", "that text reads as null; their tokens "
                            "are counted and `build` uses them")
    lines.append(summarize(table, top=args.top))
    print_out("\n".join(lines))  # `polar-train inspect DIR | head`: not an error
    return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed since it was read (an archiving job): counted as nothing
        return 0


def _call_problems(by_call: dict[str, PartProblem], what: str, consequence: str) -> list[str]:
    """Lines for calls whose ``what`` cannot be rebuilt (a repeated row counted once), a few by name."""
    if not by_call:
        return []
    shown = list(by_call.values())
    lines = [f"{len(shown)} {'call' if len(shown) == 1 else 'calls'} whose {what} cannot be rebuilt (the call it refers to is in a part that is missing "
             f"or unreadable, or does not fit it): {consequence}"]
    lines += [f"  {printable(p)}" for p in shown[:_SHOWN_CALL_PROBLEMS]]
    if len(shown) > _SHOWN_CALL_PROBLEMS:
        lines.append(f"  ... and {len(shown) - _SHOWN_CALL_PROBLEMS} more")
    return lines


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
    p.add_argument("dir", type=user_path, help="capture folder (polar_out) or its calls/ subfolder")
    p.add_argument("--top", type=_rows, default=20, help="rows shown per table (default 20; 0: the per-api totals only)")
    p.set_defaults(func=_cmd_inspect)
