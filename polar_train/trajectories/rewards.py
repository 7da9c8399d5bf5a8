"""Rewards and tasks from user files (JSONL, CSV or Parquet), attached to trajectories.

Why tolerant reading: a rewards file is often produced by a script over many rollouts; one bad
row (a typo, ``"n/a"``, a rollout from another capture) must be named precisely and skipped,
not abort the build or silently become 0.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from ..paths import not_a_file

REWARD_MODES = ("broadcast", "split")
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
           ".parquet": "parquet"}


#: The largest reward magnitude accepted. GRPO's group mean and standard deviation are computed in
#: float32 (largest ~3.4e38): a reward of 1e39 became inf there, and ±1e300 overflowed the squares
#: of the standard deviation, so a run "trained" with every advantage NaN or 0 and said nothing.
#: 1e15 leaves room for the squares of groups of many thousands.
MAX_ABS_REWARD = 1e15


class RewardFileError(ValueError):
    """The file cannot be used at all (missing, unknown format, not one usable row); printed as one
    line."""


def file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise RewardFileError(
            f"{path}: unknown file type {path.suffix or '(none)'}; use .jsonl, .csv or .parquet")
    return fmt


def check_file(path: str | Path) -> Path:
    """Fail fast (before building) on a path that is missing or of an unknown type."""
    p = Path(path)
    if (problem := not_a_file(p)) is not None:
        raise RewardFileError(problem)
    file_format(p)
    return p


def read_records(path: Path, problems: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, record) pairs; unreadable rows/files are added to ``problems`` and skipped."""
    fmt = file_format(path)
    if fmt == "jsonl":
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:  # -sig: a byte-order mark is no JSON
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if n == 1 and _utf16(line):  # (each line of it would be named)
                    problems.append(f"{path}: line 1: {_UTF16_PROBLEM}; the file is not read")
                    return
                try:
                    rec = json.loads(line, object_pairs_hook=_object_noting_repeats)
                except json.JSONDecodeError as exc:
                    problems.append(f"{path}: line {n}: not valid JSON ({exc.msg}: column {exc.colno})")
                    continue
                except RecursionError:
                    problems.append(f"{path}: line {n}: JSON nested too deeply to read")
                    continue
                except ValueError as exc:  # an integer of over 4,300 digits (Python's limit)
                    problems.append(f"{path}: line {n}: not readable JSON ({str(exc).partition(';')[0]})")
                    continue
                if not isinstance(rec, dict):
                    problems.append(f"{path}: line {n}: expected a JSON object, got {type(rec).__name__}")
                    continue
                if isinstance(rec, _RepeatedKeys):  # (a nested object's repeats are not ours to judge)
                    problems.append(f"{path}: line {n}: the key {rec.again!r} is given twice (which value "
                                    "is meant?)")
                    continue
                if (problem := _not_utf8_used(rec)) is not None:
                    problems.append(f"{path}: line {n}: {problem}")
                    continue
                yield f"{path}: line {n}", rec
    elif fmt == "csv":
        yield from _csv_records(path, problems)
    else:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:
            problems.append(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:200]})")
            return
        for n, rec in enumerate(rows, start=1):
            yield f"{path}: row {n}", rec


#: The longest CSV field read (the csv module's own limit, 128 KiB, ended a build in a traceback
#: on a long note column; past this one the file's rest is named as unread).
CSV_FIELD_LIMIT = 2**31 - 1


def _csv_records(path: Path, problems: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    limit = csv.field_size_limit(CSV_FIELD_LIMIT)  # (process-wide: given back when done)
    try:
        # utf-8-sig: spreadsheets write a byte-order mark, which would become part of the first name
        with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            reader = csv.DictReader(f)
            names = reader.fieldnames or []
            header = ",".join(n for n in names if n)
            if _utf16(header):  # no column can be named (another column's odd byte is no matter)
                problems.append(f"{path}: line 1: {_UTF16_PROBLEM}; the file is not read")
                return
            if names and "rollout_id" not in [n.strip() for n in names if n]:
                shown = ", ".join(repr(n) for n in names[:5] if n is not None)
                problems.append(f"{path}: line 1: the header has no rollout_id column (found {shown}); "
                                "the file must be comma-separated with a header line")
                return
            lines = reader.reader  # its count is right after an error too (DictReader's is not)
            while True:
                before = lines.line_num
                try:
                    rec = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:  # past the limit: the parser starts again inside the value,
                    # where any line of it could read as a row (a reward): nothing more is read
                    problems.append(f"{path}: {_lines(before, lines.line_num)}: not readable CSV ({exc}); the "
                                    "rest of the file is not read")
                    break
                where = f"{path}: {_lines(before, lines.line_num)}"
                if (problem := _not_utf8_used({k.strip(): v for k, v in rec.items() if isinstance(k, str)})) is not None:
                    problems.append(f"{where}: {problem}")
                    continue
                if any((v or "").strip() for v in rec.get(None, ())):  # DictReader's key for fields past the
                    # header's: a shifted row (a trailing comma, an empty field, is harmless)
                    problems.append(f"{where}: {len(names) + len(rec[None])} fields where "
                                    f"the header names {len(names)} (a comma inside a value? quote it)")
                    continue
                rec = {k.strip(): v for k, v in rec.items() if isinstance(k, str)}
                yield where, rec
    finally:
        csv.field_size_limit(limit)


#: The bytes that are no UTF-8 as Python's ``surrogateescape`` reads them (U+DC80-U+DCFF): with
#: ``errors="replace"`` a Latin-1 ``café`` became the task ``caf\ufffd``, a new group, unsaid.
_UNDECODED = re.compile("[\udc80-\udcff]")


_UTF16_PROBLEM = "UTF-16 text, not UTF-8 (save the file as UTF-8)"


def _utf16(first_line: str) -> bool:
    """Whether a file's first line, read as UTF-8 with ``surrogateescape``, is UTF-16 text (as
    Excel's "Unicode text" writes it): its byte-order mark, or NUL bytes without one."""
    return first_line.startswith(("\udcff\udcfe", "\udcfe\udcff")) or "\x00" in first_line


#: The columns a rewards or tasks file is read for: bytes that are no UTF-8 elsewhere (an Excel
#: note column) are no matter (the rows were lost for them).
_USED = ("rollout_id", "reward", "task_id")


def _not_utf8_used(rec: dict[str, Any]) -> str | None:
    """What is wrong with a record's used fields read with ``surrogateescape`` where they held
    bytes no UTF-8 (None: they are UTF-8): the first such byte and its column."""
    for key in _USED:
        value = rec.get(key)
        found = _UNDECODED.search(value) if isinstance(value, str) else None
        if found is not None:
            return f"{key}: not UTF-8 (byte {ord(found.group()) - 0xDC00:#04x}; save the file as UTF-8)"
    return None


class _RepeatedKeys(dict):
    """A JSON object that gave a key twice (``again``): ``{"reward": 1, "reward": 0}`` took the last
    value unsaid, where which one a script meant cannot be known."""

    again: str = ""


def _object_noting_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    repeated = _RepeatedKeys(obj)
    repeated.again = next(k for k, _ in pairs if k in seen or seen.add(k))
    return repeated


def _lines(before: int, after: int) -> str:
    """Where a CSV record lies: ``line 4``, or ``lines 3-4`` for a quoted value over two lines."""
    return f"line {after}" if after <= before + 1 else f"lines {before + 1}-{after}"


def _reward_value(value: Any) -> float | None:
    """The reward as a float, NaN and infinities included (the caller refuses those by name);
    None for what is no number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, Decimal)):  # Decimal: what DuckDB's 0.5 gives in Parquet
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            return math.inf
    if isinstance(value, str):
        value = value.strip()  # (a spreadsheet's no-break space too)
        if "_" in value or not value.isascii():  # Python's float() reads "1_000" as 1000, and "١" (an
            return None  # Arabic-Indic one) or a full-width "７" as digits: no reward script means that
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _id_text(value: Any) -> str | None:
    """A rollout or task id as text, trimmed as the capture trims ids (``"g1 "`` made a group of its
    own beside ``"g1"``): a whole-number float is written as the integer (JSON ``1`` and ``1.0``, or
    a Parquet column that became float, name one group, not two). None for what names nothing (a
    list, an object, true/false, a fraction): ``str()`` of it made up an id without a word."""
    if isinstance(value, Decimal):  # a Parquet decimal column (DuckDB writes 3.0 so)
        return str(int(value)) if value.is_finite() and value == value.to_integral_value() else None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else None
    return str(value).strip()


def _blank(value: Any) -> bool:
    """No id given: absent, null, or a string of spaces only (the capture refuses such an id too)."""
    return value is None or (isinstance(value, str) and not value.strip())


@dataclass
class Labels:
    """Rewards and task ids per rollout, with every problem found on the way."""

    rewards: dict[str, float] = field(default_factory=dict)
    tasks: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _rollout_of(loc: str, rec: dict[str, Any], known: set[str], problems: list[str]) -> str | None:
    given = rec.get("rollout_id")
    if _blank(given):
        problems.append(f"{loc}: no rollout_id")
        return None
    rid = _id_text(given)
    if isinstance(given, float) and math.isfinite(given) and (rid is None or rid not in known):
        rid = repr(given)  # a rollout named "1.5", or "2.0" (not "2"): the capture's own text
    if rid is None:  # true was looked up as the rollout 'True'
        problems.append(f"{loc}: rollout_id {given!r} is not a string or a number")
        return None
    if rid not in known:
        problems.append(f"{loc}: unknown rollout {rid!r} (no call of it is in the call log: a misspelt id, or a "
                        "session that ended before its first model call)")
        return None
    return rid


def load_labels(rewards_path: str | Path | None, tasks_path: str | Path | None,
                known_rollouts: set[str]) -> Labels:
    """Read ``--rewards`` (rollout_id, reward[, task_id]) and ``--tasks`` (rollout_id, task_id).

    A task id in ``--tasks`` wins over one in the rewards file.
    """
    labels = Labels()
    if rewards_path is not None:
        path = check_file(rewards_path)
        seen: set[str] = set()
        for loc, rec in read_records(path, labels.problems):
            rid = _rollout_of(loc, rec, known_rollouts, labels.problems)
            if rid is None:
                continue
            if "reward" not in rec:
                labels.problems.append(f"{loc}: no reward column")
                continue
            value = _reward_value(rec["reward"])
            if value is None or not math.isfinite(value):
                what = "non-numeric" if value is None else "non-finite"
                labels.problems.append(f"{loc}: {what} reward {rec['reward']!r} for rollout {rid!r}")
                continue
            if abs(value) > MAX_ABS_REWARD:
                labels.problems.append(f"{loc}: reward {value:g} for rollout {rid!r} is beyond ±{MAX_ABS_REWARD:g}: "
                                       "the trainer's float32 group statistics would overflow; scale the rewards")
                continue
            if rid in seen:
                labels.problems.append(f"{loc}: rollout {rid!r} listed again; the first reward is kept")
                continue
            seen.add(rid)
            labels.rewards[rid] = value
            task = rec.get("task_id")
            if not _blank(task):
                if _id_text(task) is None:
                    labels.problems.append(f"{loc}: task_id {task!r} of rollout {rid!r} is not a string or a whole "
                                           "number; left out (the reward is kept)")
                else:
                    labels.tasks[rid] = _id_text(task)
        if not labels.rewards:
            _nothing_usable(path, "reward", labels.problems)
    if tasks_path is not None:
        path = check_file(tasks_path)
        problems_before = len(labels.problems)
        listed: dict[str, str] = {}
        for loc, rec in read_records(path, labels.problems):
            rid = _rollout_of(loc, rec, known_rollouts, labels.problems)
            if rid is None:
                continue
            task = rec.get("task_id")
            if _blank(task):
                labels.problems.append(f"{loc}: no task_id for rollout {rid!r}")
                continue
            if _id_text(task) is None:
                labels.problems.append(f"{loc}: task_id {task!r} of rollout {rid!r} is not a string or a whole number")
                continue
            if rid in listed:  # as for rewards: the first row counts (the same task again is harmless)
                if listed[rid] != _id_text(task):
                    labels.problems.append(f"{loc}: rollout {rid!r} listed again with task {_id_text(task)!r}; "
                                           f"the first task id {listed[rid]!r} is kept")
                continue
            listed[rid] = labels.tasks[rid] = _id_text(task)
        if not listed:
            _nothing_usable(path, "task id", labels.problems[problems_before:])
    return labels


def _nothing_usable(path: Path, what: str, problems: list[str]) -> None:
    """A labels file the user named but that gave nothing: almost surely the wrong file or format;
    building on would write trajectories without the labels asked for."""
    if not problems:
        raise RewardFileError(f"no {what} in {path}: the file holds no rows")
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    raise RewardFileError(f"no usable {what} in {path}: {problems[0].removeprefix(f'{path}: ')}{more}")


@dataclass
class GroupSummary:
    groups: int = 0
    singleton_groups: list[str] = field(default_factory=list)
    equal_reward_groups: list[str] = field(default_factory=list)
    unrewarded_groups: list[str] = field(default_factory=list)
    rollouts_without_task: int = 0
    #: Rewarded rollouts with no task id: in no group (the trainer takes each of their trajectories
    #: as a group of one, which min_group_size leaves out).
    rewarded_without_task: list[str] = field(default_factory=list)
    rollouts_without_reward: int = 0
    unrewarded_rollouts: list[str] = field(default_factory=list)


def attach(trajectories: list, labels: Labels, mode: str = "broadcast") -> GroupSummary:
    """Set ``reward``, ``task_id`` and ``group_id`` on each trajectory; summarise the groups.

    ``broadcast``: every trajectory of a rollout gets the rollout's reward. ``split``: the
    reward is divided equally among the rollout's trajectories (their sum is the reward).
    Group = task: GRPO compares rollouts of the same task, so a group of one rollout, or one
    whose rewards are all equal, carries no learning signal and is reported. Where rewards were
    given, a group's size is its rewarded rollouts: the trainer leaves the others out, and a group
    of three with one reward was called fine here and dropped there as a group of one.
    """
    if mode not in REWARD_MODES:
        raise ValueError(f"unknown reward mode {mode!r}; use one of {', '.join(REWARD_MODES)}")
    per_rollout: dict[str | None, list] = defaultdict(list)
    for t in trajectories:
        per_rollout[t.rollout_id].append(t)
    summary = GroupSummary()
    groups: dict[str, dict[str, float | None]] = defaultdict(dict)
    for rid, trajs in per_rollout.items():
        reward = labels.rewards.get(rid) if rid is not None else None
        task = labels.tasks.get(rid) if rid is not None else None
        if task is None:
            task = next((t.task_id for t in trajs if t.task_id), None)
        if reward is None:
            summary.rollouts_without_reward += 1
            if rid is not None:
                summary.unrewarded_rollouts.append(rid)
        if task is None:
            summary.rollouts_without_task += 1
            if reward is not None and rid is not None:
                summary.rewarded_without_task.append(rid)
        for t in trajs:
            t.task_id = task
            t.group_id = task
            if reward is None:
                t.reward = None
            else:
                t.reward = reward / len(trajs) if mode == "split" else reward
                t.reward_mode = mode
        if task is not None and rid is not None:
            groups[task][rid] = reward
    summary.groups = len(groups)
    summary.unrewarded_rollouts.sort()
    summary.rewarded_without_task.sort()
    for task, members in sorted(groups.items()):
        rewarded = [v for v in members.values() if v is not None]
        if labels.rewards and not rewarded:  # counted among the groups, trained as none: said apart
            summary.unrewarded_groups.append(task)
        elif len(rewarded if labels.rewards else members) == 1:
            summary.singleton_groups.append(task)
        elif len(rewarded) > 1 and len(set(rewarded)) == 1:
            summary.equal_reward_groups.append(task)
    return summary
