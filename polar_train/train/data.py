"""Trajectory Parquet -> checked trajectories -> GRPO groups -> a ``datasets.Dataset``.

Why groups are dataset rows: TRL's ``RepeatSampler`` repeats each row ``num_generations``
times in a row and computes group-relative advantages over exactly those repeats. One row per
(builder) group, and the rollout function returning that group's trajectories for the repeats,
makes GRPO's baseline the real group's. Groups of another size are split, padded by resampling
or dropped, and every such decision is counted in the ``DataReport`` - never silent.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..cli import UserError
from ..paths import OLD_REPORT_NAME, REPORT_NAME
from ..schema import TRAJECTORY_SCHEMA, TRAJECTORY_VERSION, missing_columns, same_kind
from ..trajectories.rewards import MAX_ABS_REWARD
from ..trajectories.writer import BUILD_ID_KEY, REWARD_MODE_KEY, build_problem

#: Columns the trainer reads; the other TRAJECTORY_SCHEMA columns are optional here.
#: How far above 0 a recorded logprob may lie: float rounding of a token the sampler was sure of.
_LOGPROB_SLACK = 1e-3

REQUIRED = ("trajectory_id", "prompt_ids", "completion_ids", "loss_mask", "logprobs", "reward")
_OPTIONAL = ("group_id", "task_id", "rollout_id", "temperature", "truncated", "model")


@dataclass
class Trajectory:
    trajectory_id: str
    group: str
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    temperature: float | None = None  # the sampler's, as recorded (None: not recorded)
    model: str | None = None  # the model name its calls asked for (None: not recorded)
    #: The rollout (session) it is part of; a rollout that forked has several trajectories, which
    #: share one place in their group's baseline (None: not recorded - it stands for itself).
    rollout: str | None = None


@dataclass
class DataReport:
    """What the loader kept, changed and dropped (printed before training, saved in the summary).

    ``trainable_tokens``, ``trainable_tokens_without_logprob`` and ``temperatures`` describe the
    data that is trained: the GRPO rows :func:`make_groups` makes, a padding copy counted each time
    it is trained. What groups dropped is in ``groups_dropped`` / ``trajectories_dropped_in_groups``.
    Until ``make_groups`` has run, ``temperatures`` holds those of every trajectory the loader kept
    (what the temperature check before grouping reads)."""

    files: int = 0
    rows: int = 0
    dropped_no_reward: int = 0
    dropped_duplicate_id: int = 0  # a trajectory_id already read (a part copied twice): only the first is used
    dropped_no_trainable_tokens: int = 0
    truncated_to_max_length: int = 0
    trainable_tokens: int = 0
    trainable_tokens_without_logprob: int = 0
    temperatures: list[float] = field(default_factory=list)
    #: The builds the data came from (each part's ``polar_train.build_id``, as its folder's
    #: ``_build_report.json`` names it): a folder rebuilt since holds another build's report.
    build_ids: list[str] = field(default_factory=list)
    group_sizes: dict[int, int] = field(default_factory=dict)  # size -> number of groups
    num_generations: int = 0
    rows_out: int = 0  # dataset rows (GRPO groups of exactly num_generations)
    groups_split: int = 0
    groups_padded: int = 0
    padding_trajectories: int = 0
    groups_dropped: int = 0
    trajectories_dropped_in_groups: int = 0
    #: why groups were dropped -> their names (a group of one dropped unnamed sent users looking)
    dropped_groups: dict[str, list[str]] = field(default_factory=dict)
    zero_reward_std_rows: int = 0
    #: GRPO groups holding several trajectories of one rollout (its forks), and how the baseline took them
    rows_with_forks: int = 0
    advantage_baseline: str = "trajectory"
    #: a part says its build split each rollout's reward among its trajectories (--reward-mode split):
    #: each trajectory then stands for itself in the baseline (a share is no rollout's value)
    split_rewards: bool = False
    #: allow_temperature_mismatch let a real mismatch through (a training temperature other than the
    #: recorded one, or raw logprobs away from temperature 1): the mismatch warning names it then
    temperature_mismatch_allowed: bool = False
    #: trajectories trained (until ``make_groups``: kept), by the model name their calls asked for
    models: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        sizes = ", ".join(f"{n}x{s}" for s, n in sorted(self.group_sizes.items()))
        out = [
            f"data: {self.rows} trajectories in {self.files} file(s); groups by size: {sizes or 'none'}",
            f"data: {self.rows_out} GRPO groups of {self.num_generations} "
            f"({self.trainable_tokens} trainable tokens)",
        ]
        notes = [
            (self.dropped_no_reward, "trajectories dropped: no reward"),
            (self.dropped_duplicate_id, "trajectories dropped: trajectory_id already read (a part copied "
             "twice?); the first is used"),
            (self.dropped_no_trainable_tokens, "trajectories dropped: no trainable (mask 1) token"),
            (self.truncated_to_max_length, "trajectories truncated to max_completion_length"),
            (self.groups_split, "groups split into several GRPO groups"),
            (self.groups_padded, f"groups padded by resampling ({self.padding_trajectories} copies)"),
            (self.groups_dropped, f"groups dropped ({self.trajectories_dropped_in_groups} trajectories)"),
            (self.zero_reward_std_rows, "GRPO groups with equal rewards (no learning signal)"),
            (self.rows_with_forks, "GRPO groups hold several trajectories of one rollout (its forks): "
             + ("each rollout counts once in its group's mean and std, its trajectories share its advantage "
                "(advantage_baseline=rollout)" if self.advantage_baseline == "rollout" else
                "each trajectory counts as a rollout of its own in the baseline (advantage_baseline=trajectory)")),
            (self.trainable_tokens_without_logprob, "trainable tokens without a sampler logprob "
             "(importance weight 1)"),
        ]
        out += [f"data: {n} {what}" for n, what in notes if n]
        if self.split_rewards and self.advantage_baseline == "rollout":
            out.append("data: rewards split among each rollout's trajectories (build --reward-mode split): each "
                       "trajectory stands for itself in its group's baseline, as with advantage_baseline=trajectory")
        for why, names in self.dropped_groups.items():
            shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            out.append(f"data: dropped {why}: {shown}")
        if not self.temperatures:
            out.append("data: no sampling temperature recorded: `temperature` cannot be checked")
        if self.models:
            named = ", ".join(f"{m} {n}" for m, n in sorted(self.models.items(), key=lambda kv: (-kv[1], kv[0])))
            out.append(f"data: sampled by {named} (model names as served; trajectories)")
            if len(self.models) > 1:
                out.append("data: warning: several samplers in one run: their old logprobs are each their own "
                           "policy's, one policy is trained here; train each round's data on its own, from the "
                           "adapter that sampled it (init_adapter)")
        return out


def parquet_files(path: str | Path) -> list[Path]:
    """The Parquet parts of a trajectory folder (dot-files are in-progress: ignored), or one file."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise UserError(f"trajectory data not found: {p}")
    files = sorted(f for f in p.rglob("*.parquet")
                   if not any(part.startswith(".") for part in f.relative_to(p).parts))
    if not files:
        raise UserError(f"no trajectory Parquet files in {p}")
    return files


def read_table(path: str | Path, report: DataReport) -> pa.Table:
    tables = []
    by_folder: dict[Path, list[tuple[Path, dict[bytes, bytes]]]] = {}
    judge_builds = Path(path).is_dir()  # (one part file given as the data is never judged: it stands alone)
    for f in parquet_files(path):
        # one open per part for its metadata and its data: a build that replaced the folder between
        # two opens gave the old build's part count with the new build's rows (1 trajectory of 46,
        # taken as whole); an open file reads as it was, whatever is renamed over it meanwhile
        try:
            part = pq.ParquetFile(f, page_checksum_verification=True)
        except FileNotFoundError:
            raise UserError(f"{f}: gone while the folder was read (a build replaced its parts meanwhile?): "
                            "run again once the build has ended") from None
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a user error
            raise UserError(f"{f}: not a readable Parquet file ({exc})") from None
        with contextlib.closing(part):  # (closed on a refusal too, not when the traceback goes)
            tables.append(_read_part(f, part, report, by_folder if judge_builds else None))
        report.files += 1
    for folder, parts in by_folder.items():
        if (problem := build_problem(parts)) is not None:
            raise UserError(f"{folder} holds {problem}")
        if not any(REWARD_MODE_KEY in meta for _, meta in parts) and _report_says_split(folder):
            report.split_rewards = True  # a build of an earlier version records its mode in its report only
    return pa.concat_tables(tables, promote_options="default")


def _report_says_split(folder: Path) -> bool:
    """Whether ``folder``'s build report says its rewards were split among each rollout's
    trajectories (builds before 2026-12-07 recorded the mode there only; those before 2026-12-06
    named it build_report.json, and their split rewards were trained as whole ones - a probe)."""
    for name in (REPORT_NAME, OLD_REPORT_NAME):
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        return isinstance(data, dict) and data.get("reward_mode") == "split"
    return False


def _read_part(f: Path, part: pq.ParquetFile, report: DataReport,
               by_folder: dict[Path, list[tuple[Path, dict[bytes, bytes]]]] | None) -> pa.Table:
    """One checked part's trajectory columns, from the file opened once (see :func:`read_table`)."""
    try:
        schema = part.schema_arrow
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a user error
        raise UserError(f"{f}: not a readable Parquet file ({exc})") from None
    if by_folder is not None:
        by_folder.setdefault(f.parent, []).append((f, dict(schema.metadata or {})))
    expected = pa.schema([TRAJECTORY_SCHEMA.field(c) for c in REQUIRED])
    problems = missing_columns(schema, expected)
    if problems:
        if {"call_id", "api"} <= set(schema.names):  # the capture's call log, one step early
            raise UserError(f"{f}: a capture's call log, not trajectories: run `polar-train build` on the "
                            "capture folder first and train on its --out folder")
        raise UserError(f"{f}: not a trajectory table: {', '.join(problems)}")
    _check_version(f, schema)
    cols = [c for c in REQUIRED + _OPTIONAL if c in schema.names  # model: only ever shown; rollout_id: a
            and (c not in ("model", "rollout_id") or same_kind(schema.field(c).type, pa.string()))]  # baseline key
    if (schema.metadata or {}).get(REWARD_MODE_KEY) == b"split":
        report.split_rewards = True
    build = (schema.metadata or {}).get(BUILD_ID_KEY)
    if build is not None and build.decode(errors="replace") not in report.build_ids:
        report.build_ids.append(build.decode(errors="replace"))
    try:
        table = part.read(columns=cols, use_threads=False)
    except Exception as exc:  # noqa: BLE001 - corrupt pages behind a valid footer
        raise UserError(f"{f}: unreadable data ({exc})") from None
    return _cast_to_schema(f, table)


def _check_version(f: Path, schema: pa.Schema) -> None:
    """A part written by another version of the trajectory table may mean its columns differently."""
    version = (schema.metadata or {}).get(b"polar_train.version")
    if version is None or version.decode(errors="replace") == TRAJECTORY_VERSION:
        return  # no metadata: written by another tool in our columns (the column checks still apply)
    shown = version.decode(errors="replace")
    newer = shown.isdigit() and TRAJECTORY_VERSION.isdigit() and int(shown) > int(TRAJECTORY_VERSION)
    raise UserError(f"{f}: trajectory table version {shown}, this polar-train reads version {TRAJECTORY_VERSION}"
                    + (": upgrade polar-train" if newer else ""))


def _cast_to_schema(f: Path, table: pa.Table) -> pa.Table:
    """Every column in TRAJECTORY_SCHEMA's type: parts with a float64 temperature next to float32
    ones did not concatenate (pyarrow's ArrowTypeError), a string one failed naming nothing."""
    for i, name in enumerate(table.column_names):
        want = TRAJECTORY_SCHEMA.field(name).type
        have = table.schema.field(i).type
        if have.equals(want):
            continue
        if not same_kind(have, want):
            raise UserError(f"{f}: column {name} is {have}, expected {want}")
        try:
            table = table.set_column(i, TRAJECTORY_SCHEMA.field(name), table.column(i).cast(want))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise UserError(f"{f}: column {name}: cannot read {have} as {want} ({exc})") from None
    return table


def load_trajectories(path: str | Path, *, vocab_size: int, max_completion_length: int | None,
                      report: DataReport) -> list[Trajectory]:
    """Read and check every trajectory; clear ``UserError`` on input no training could use."""
    table = read_table(path, report)
    report.rows = table.num_rows
    if table.num_rows == 0:
        raise UserError(f"no trajectories in {path} (the Parquet files are empty)")
    cols = table.to_pydict()
    n = table.num_rows
    groups = cols.get("group_id") or [None] * n
    tasks = cols.get("task_id") or [None] * n
    temps = cols.get("temperature") or [None] * n
    models = cols.get("model") or [None] * n
    rollouts = cols.get("rollout_id") if cols.get("rollout_id") and not report.split_rewards else [None] * n
    out: list[Trajectory] = []
    any_reward = False
    seen: set[str] = set()
    for i in range(n):
        tid = cols["trajectory_id"][i]
        if tid in seen:  # as the builder treats a repeated call_id: the first is used, the rest counted
            report.dropped_duplicate_id += 1
            continue
        seen.add(tid)
        prompt = cols["prompt_ids"][i] or []
        comp = cols["completion_ids"][i] or []
        mask = cols["loss_mask"][i]
        lps = cols["logprobs"][i]
        if mask is None:  # the builder always writes one: which tokens the model sampled is unknown
            raise UserError(f"trajectory {tid}: loss_mask is null (which tokens the model sampled is unknown): "
                            "rebuild the trajectories with `polar-train build`")
        mask = list(mask)
        lps = [math.nan if v is None else float(v) for v in lps] if lps is not None else [math.nan] * len(comp)
        if len(mask) != len(comp) or len(lps) != len(comp):
            raise UserError(f"trajectory {tid}: completion_ids ({len(comp)}), loss_mask ({len(mask)}) "
                            f"and logprobs ({len(lps)}) differ in length")
        if any(m not in (0, 1) for m in mask):
            raise UserError(f"trajectory {tid}: loss_mask holds values other than 0 and 1")
        if any(v > _LOGPROB_SLACK for v in lps):  # NaN compares False: missing ones stay allowed
            bad = max(v for v in lps if not math.isnan(v))
            raise UserError(f"trajectory {tid}: logprob {bad:g} is above 0 (a probability above 1): these are "
                            "not log-probabilities (another column, or probabilities?)")
        if any(v == -math.inf for v in lps):  # probability 0 for a token the sampler chose; NaN is "not recorded"
            raise UserError(f"trajectory {tid}: logprob -inf (probability 0 for a token the sampler chose): a "
                            "broken logprob; a token without one must be NaN (null)")
        ids = prompt + comp
        if ids and (max(ids) >= vocab_size or min(ids) < 0):
            bad = max(ids) if max(ids) >= vocab_size else min(ids)
            raise UserError(f"trajectory {tid}: token id {bad} is outside the model's vocabulary "
                            f"(size {vocab_size}): wrong --model for this capture?")
        reward = cols["reward"][i]
        if reward is None or (isinstance(reward, float) and math.isnan(reward)):
            report.dropped_no_reward += 1
            continue
        if math.isinf(reward):  # one inf makes its group's mean and std inf: every advantage NaN or 0
            raise UserError(f"trajectory {tid}: reward {reward} is not finite: fix the reward script "
                            "(a missing reward may be null or NaN: such trajectories are left out)")
        if abs(reward) > MAX_ABS_REWARD:  # finite, but inf in the group's float32 mean or std
            raise UserError(f"trajectory {tid}: reward {reward:g} is beyond ±{MAX_ABS_REWARD:g}: the group's "
                            "mean and standard deviation (float32) would overflow; scale the rewards")
        any_reward = True
        if max_completion_length is not None and len(comp) > max_completion_length:
            comp, mask, lps = (comp[:max_completion_length], mask[:max_completion_length],
                               lps[:max_completion_length])
            report.truncated_to_max_length += 1
        if not prompt:
            raise UserError(f"trajectory {tid}: empty prompt_ids")
        if sum(mask) == 0:
            report.dropped_no_trainable_tokens += 1
            continue
        group = groups[i] if groups[i] is not None else tasks[i]
        temperature = None if temps[i] is None else round(float(temps[i]), 4)
        out.append(Trajectory(tid, group if group is not None else f"<single {tid}>",
                              list(prompt), list(comp), mask, lps, float(reward), temperature, models[i],
                              rollouts[i]))
    if not any_reward:
        raise UserError(f"no trajectory in {path} has a reward: attach rewards before training")
    if not out:
        raise UserError(f"no trajectory in {path} has a trainable (loss_mask 1) token")
    # the trajectories kept so far; make_groups narrows this to the trained ones
    report.temperatures = _temperatures(out)
    report.models = _models(out)
    return out


def _models(trajs) -> dict[str, int]:
    """Trajectories by sampler name (each once, a padding copy not again)."""
    return dict(Counter(t.model for t in {id(t): t for t in trajs}.values() if t.model is not None))


def _temperatures(trajs) -> list[float]:
    return sorted({t.temperature for t in trajs if t.temperature is not None})


def modal_group_size(trajs: list[Trajectory], at_least: int = 2) -> int:
    """The most common size (ties: the larger) among the groups of ``at_least`` trajectories or more,
    the default ``num_generations``: groups smaller than that are dropped (``min_group_size``), and
    counting them - a handful of task-less trajectories, each its own group of one - cut the data's
    real groups of 8 into pairs. 1 where no group is that large."""
    sizes = Counter(size for size in Counter(t.group for t in trajs).values() if size >= at_least)
    return max(sizes.items(), key=lambda kv: (kv[1], kv[0]))[0] if sizes else 1


@dataclass
class GroupedData:
    """GRPO rows: ``rows[r]`` lists the ``num_generations`` trajectory indices of dataset row r."""

    trajectories: list[Trajectory]
    rows: list[list[int]]
    row_names: list[str]

    def dataset(self):
        """One row per GRPO group; ``prompt`` is a unique name the rollout function maps back."""
        from datasets import Dataset

        return Dataset.from_dict({"prompt": self.row_names, "row": list(range(len(self.rows)))})


def rollout_of(t: Trajectory) -> str:
    """Who a trajectory stands for in its group's baseline: its rollout, else itself."""
    return t.rollout if t.rollout is not None else f"<trajectory {t.trajectory_id}>"


def rollout_advantages(trajs: list[Trajectory], row: list[int], scale: bool) -> dict[int, float]:
    """GRPO advantages of one group with each rollout counted once: a rollout's value is the mean
    reward of its distinct trajectories in the group (under ``broadcast`` its reward); the group's
    mean and (unbiased) std are taken over those values, and every trajectory of a rollout gets its
    rollout's advantage. Over trajectories, a rollout that forked three times (a rewrite, a
    sub-agent) weighed three times in the baseline, and a padding copy once more."""
    values: dict[str, list[float]] = {}
    for i in set(row):
        values.setdefault(rollout_of(trajs[i]), []).append(trajs[i].reward)
    value = {r: sum(v) / len(v) for r, v in values.items()}
    mean = sum(value.values()) / len(value)
    std = (sum((v - mean) ** 2 for v in value.values()) / (len(value) - 1)) ** 0.5 if len(value) > 1 else 0.0
    return {i: (value[rollout_of(trajs[i])] - mean) / ((std + 1e-4) if scale else 1.0) for i in set(row)}


def make_groups(trajs: list[Trajectory], *, num_generations: int, policy: str, min_group_size: int,
                seed: int, report: DataReport) -> GroupedData:
    rng = random.Random(seed)
    by_group: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        by_group.setdefault(t.group, []).append(i)
    report.group_sizes = dict(Counter(len(v) for v in by_group.values()))
    report.num_generations = num_generations
    largest = max((len(v) for v in by_group.values()), default=0)
    if policy == "pad" and num_generations > 2 * largest:
        # each group padded to num_generations copies: a million (a typo) filled the memory, killed
        raise UserError(f"num_generations {num_generations} is more than twice the largest group ({largest} "
                        f"trajectories): padding would train mostly copies; give at most {2 * largest}")
    rows: list[list[int]] = []
    names: list[str] = []
    for name, members in by_group.items():
        if len(members) < min_group_size:
            report.groups_dropped += 1
            report.trajectories_dropped_in_groups += len(members)
            report.dropped_groups.setdefault(f"below min_group_size {min_group_size}", []).append(name)
            continue
        members = members[:]
        if len(members) > num_generations:
            rng.shuffle(members)
            report.groups_split += 1
        chunks = [members[i:i + num_generations] for i in range(0, len(members), num_generations)]
        for c, chunk in enumerate(chunks):
            if len(chunk) < num_generations:
                if policy == "drop" or len(chunk) < min_group_size:
                    report.groups_dropped += 1
                    report.trajectories_dropped_in_groups += len(chunk)
                    why = (f"remainders below min_group_size {min_group_size}" if len(chunk) < min_group_size
                           else f"remainders short of num_generations {num_generations} (unequal_groups=drop)")
                    report.dropped_groups.setdefault(why, []).append(name)
                    continue
                extra = [rng.choice(chunk) for _ in range(num_generations - len(chunk))]
                report.groups_padded += 1
                report.padding_trajectories += len(extra)
                chunk = chunk + extra
            rows.append(chunk)
            names.append(name if len(chunks) == 1 else f"{name} [{c + 1}/{len(chunks)}]")
            if len({trajs[i].reward for i in chunk}) == 1:
                report.zero_reward_std_rows += 1
            if len(set(chunk)) > len({rollout_of(trajs[i]) for i in chunk}):
                report.rows_with_forks += 1
    report.rows_out = len(rows)
    # what is trained: the rows' trajectories, a padding copy once per copy (it is trained again);
    # what groups dropped is left out here and counted above
    trained = [trajs[i] for row in rows for i in row]
    report.trainable_tokens = sum(sum(t.loss_mask) for t in trained)
    report.trainable_tokens_without_logprob = sum(
        sum(1 for m, v in zip(t.loss_mask, t.logprobs) if m and math.isnan(v)) for t in trained)
    report.temperatures = _temperatures(trained)
    report.models = _models(trained)
    if not rows:
        raise UserError(f"no group of at least {min_group_size} trajectories to train on with "
                        f"num_generations={num_generations} and unequal_groups={policy} "
                        f"(group sizes: {report.group_sizes})")
    return GroupedData(trajs, rows, names)
