"""What a build did, as ``_build_report.json`` and as the table ``polar-train build`` prints.

Why a report and not just logs: merge ratio, forks by cause and skipped rows tell a user at a
glance whether the capture fits training (e.g. many ``retokenization`` forks → try
``--realign``; many ``superseded_retry`` rows → a flaky server), and scripts can read the JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..terminal import shown


@dataclass
class BuildReport:
    """What a build read, made and found: :meth:`table` is the printed summary and :meth:`to_json`
    the ``_build_report.json`` (its fields: docs/build.md, "What it prints")."""

    source: str = ""
    out: str | None = None
    parts_read: int = 0
    parts_skipped: int = 0
    calls_read: int = 0
    calls_used: int = 0
    rollouts: int = 0
    #: Rollouts in the call log that build no trajectory (every call failed or was skipped).
    rollouts_without_usable_call: list[str] = field(default_factory=list)
    trajectories: int = 0
    forks: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    realign: bool = False
    realigned_calls: int = 0
    truncated_trajectories: int = 0
    calls_without_logprobs: int = 0
    #: calls used whose token count the server reported otherwise (``usage_match`` false): their
    #: completion ids were rendered from the text (no server ids) and are not what was sampled
    usage_mismatch_calls: int = 0
    compact_fast_path: int = 0
    tokens_trained: int = 0
    tokens_total: int = 0
    #: sampled (mask 1) tokens whose logprob the server did not report (NaN in ``logprobs``)
    sampled_without_logprob: int = 0
    reward_mode: str = "broadcast"
    rollouts_with_reward: int = 0
    rollouts_without_reward: int = 0
    #: The rollouts counted in ``rollouts_without_reward`` (a rewards file was given or not).
    unrewarded_rollouts: list[str] = field(default_factory=list)
    rollouts_without_task: int = 0
    #: Rewarded rollouts without a task id: in no group, so the trainer takes each of their
    #: trajectories as a group of one (left out under ``min_group_size``).
    rewarded_without_task: list[str] = field(default_factory=list)
    groups: int = 0
    singleton_groups: list[str] = field(default_factory=list)
    equal_reward_groups: list[str] = field(default_factory=list)
    #: Groups none of whose rollouts the rewards file rewards (the trainer leaves them all out).
    unrewarded_groups: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: What the reader of this build should know of its input as a whole (a capture still being
    #: written, calls its proxy lost, a tokenizer that is not Qwen3.5's): printed before problems.
    notes: list[str] = field(default_factory=list)
    #: Rollouts with a call that started again from the rollout's first prompt after its
    #: conversation had gone on: a rollout id reused for another session (next round) makes its
    #: sessions branches of one rollout, with one reward and one group.
    restarted_rollouts: list[str] = field(default_factory=list)
    #: Trajectories by the model name their calls asked for (the sampler: base or adapter).
    models: dict[str, int] = field(default_factory=dict)
    #: Rollouts whose trajectories asked for different models: a rollout id reused in a later
    #: round (served from its adapter) joins two rounds' sessions under one reward.
    mixed_model_rollouts: dict[str, list[str]] = field(default_factory=dict)
    #: task -> the models its group's trajectories asked for, where several (two rounds in one build)
    mixed_model_groups: dict[str, list[str]] = field(default_factory=dict)
    #: Rollouts whose calls used several wire formats (``openai.chat``, ``anthropic.messages``, ...):
    #: a harness speaks one, so two harnesses ran under one rollout id and share its reward.
    mixed_api_rollouts: dict[str, list[str]] = field(default_factory=dict)
    #: Rollouts whose calls were recorded under several task ids (``x-polar-task``): one rollout id
    #: reused for another task (machines or days numbering their rollouts alike); its trajectories
    #: all join one task's group, with one reward.
    mixed_task_rollouts: dict[str, list[str]] = field(default_factory=dict)
    #: Rollouts whose last call failed (its status): a session killed mid-call or ended on an
    #: error, whose reward scores an unfinished run.
    cut_off_rollouts: dict[str, str] = field(default_factory=dict)
    #: Rollouts whose calls name several harness sessions (``client_session_id``: Codex's and Claude
    #: Code's own ids), by how many: a rollout id reused for another session, whose conversations
    #: alone read as a sub-agent's (``new_conversation`` forks), under one reward and one group.
    mixed_session_rollouts: dict[str, int] = field(default_factory=dict)
    #: Rollouts the rewards file scores that no trajectory has (every call failed or was skipped):
    #: a crashed session, often a low score, gone from its GRPO group's baseline.
    rewarded_without_calls: list[str] = field(default_factory=list)
    #: Open trajectories closed because more conversations were live in one rollout (256) or
    #: among calls without a rollout (1,024) than the builder follows: a later call of theirs forks.
    closed_at_cap: int = 0
    output_parts: list[str] = field(default_factory=list)
    build_id: str | None = None  # as in each part's Parquet metadata (polar_train.build_id)

    @property
    def merge_ratio(self) -> float:
        return self.calls_used / self.trajectories if self.trajectories else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["merge_ratio"] = round(self.merge_ratio, 4)
        return data

    def table(self, max_problems: int = 20, saved: bool = True) -> str:
        """The human summary: one metric per line, then any problems."""

        def counts(d: dict[str, int]) -> str:  # (model names are a client's: shown escaped)
            return ", ".join(f"{shown(k)} {v}" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"

        pct = 100.0 * self.tokens_trained / self.tokens_total if self.tokens_total else 0.0
        rows = [
            ("rollouts", str(self.rollouts) + (f" (and {len(self.rollouts_without_usable_call)} in the call log "
                                               "without a usable call: each failed or was skipped)"
                                               if self.rollouts_without_usable_call else "")),
            ("calls", f"{self.calls_used} used of {self.calls_read} read"),
            ("trajectories", str(self.trajectories) + (f" ({self.truncated_trajectories} end at the length limit)"
                                                       if self.truncated_trajectories else "")),
            ("merge ratio", f"{self.merge_ratio:.2f} calls/trajectory"),
            ("forks by cause", counts(self.forks)),
            ("skipped rows", counts(self.skipped)),
            ("tokens trained / total", f"{self.tokens_trained} / {self.tokens_total} ({pct:.1f}%)"
                                       + (f"; {self.sampled_without_logprob} sampled without logprob"
                                          if self.sampled_without_logprob else "")
                                       + (f"; {self.usage_mismatch_calls} calls whose rendered ids the server "
                                          "counted otherwise" if self.usage_mismatch_calls else "")),
            ("models", counts(self.models) + " (trajectories)" if self.models else "none"),
            ("realigned calls", str(self.realigned_calls) if self.realign else "off (--realign)"),
            ("rewards", f"{self.rollouts_with_reward} rollouts ({self.reward_mode}), "
                        f"{self.rollouts_without_reward} without"
                        + (f" ({_some(self.unrewarded_rollouts)})"
                           if self.rollouts_with_reward and self.unrewarded_rollouts else "")
                        + (f"; {len(self.rewarded_without_calls)} rewarded without a usable call (problems)"
                           if self.rewarded_without_calls else "")
                        + ("; training needs them: build again with --rewards FILE"
                           if self.trajectories and not self.rollouts_with_reward
                           and not self.rewarded_without_calls else "")),
            ("groups (tasks)", f"{self.groups}; size 1: {len(self.singleton_groups)}; "
                               f"all-equal rewards: {len(self.equal_reward_groups)}"
                               + (f"; no reward: {len(self.unrewarded_groups)}" if self.unrewarded_groups else "")),
        ]
        # the lists behind the groups row, right under it (after the rows below they read as theirs)
        if self.singleton_groups:
            rows.append(("", f"size-1 groups: {_some(self.singleton_groups, 10)}"))
        if self.equal_reward_groups:
            rows.append(("", f"all-equal groups: {_some(self.equal_reward_groups, 10)}"))
        if self.unrewarded_groups:
            rows.append(("", f"groups without a reward: {_some(self.unrewarded_groups, 10)}"))
        if self.mixed_model_groups:
            named = _named_lists(self.mixed_model_groups)
            rows.append(("", f"groups of several models: {len(self.mixed_model_groups)} ({named}): two rounds in "
                             "one build? one GRPO baseline for two policies; build each round's capture apart "
                             "(docs/train.md, Round after round)"))
        if self.rewarded_without_task:
            rows.append(("", f"rewarded rollouts without a task: {len(self.rewarded_without_task)} "
                             f"({_some(self.rewarded_without_task)}): in no group, train takes each of their "
                             "trajectories as a group of one (--tasks FILE, or x-polar-task at capture)"))
        if self.parts_skipped:
            rows.insert(0, ("parts", f"{self.parts_read} read, {self.parts_skipped} skipped"))
        if self.closed_at_cap:
            rows.append(("closed at the cap", f"{self.closed_at_cap} open trajectories (more live conversations in "
                                              "one rollout, or without one, than the builder follows: later calls "
                                              "of theirs fork)"))
        if self.restarted_rollouts:
            rows.append(("restarted rollouts", f"{len(self.restarted_rollouts)} sent their first request again "
                                               f"({_some(self.restarted_rollouts)}): one rollout id for several "
                                               "sessions? each needs its own"))
        if self.mixed_model_rollouts:
            named = _named_lists(self.mixed_model_rollouts)
            rows.append(("rollouts of several models", f"{len(self.mixed_model_rollouts)} ({named}): a rollout id "
                                                       "reused in a later round? each session needs its own"))
        if self.mixed_session_rollouts:
            named = _some([f"{shown(r)}: {n} sessions" for r, n in self.mixed_session_rollouts.items()], escaped=True)
            rows.append(("rollouts of several sessions", f"{len(self.mixed_session_rollouts)} ({named}): the "
                                                         "harness named several sessions under one rollout id; "
                                                         "each session needs its own"))
        if self.cut_off_rollouts:
            named = _some([f"{shown(r)}: {st}" for r, st in self.cut_off_rollouts.items()], escaped=True)
            rows.append(("rollouts ending in a failed call", f"{len(self.cut_off_rollouts)} ({named}): sessions cut "
                                                             "off? their rewards score unfinished runs"))
        if self.mixed_api_rollouts:
            named = _some([f"{shown(r)}: {', '.join(a)}" for r, a in self.mixed_api_rollouts.items()], sep="; ",
                          escaped=True)
            rows.append(("rollouts of several APIs", f"{len(self.mixed_api_rollouts)} ({named}): two harnesses "
                                                     "under one rollout id? each session needs its own"))
        if self.mixed_task_rollouts:
            named = _named_lists(self.mixed_task_rollouts)
            rows.append(("rollouts of several tasks", f"{len(self.mixed_task_rollouts)} ({named}): a rollout id "
                                                      "reused for another task? each session needs its own (all "
                                                      "its trajectories join one task's group)"))
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines.extend(f"note: {shown(n, 600)}" for n in self.notes)
        if self.problems:
            lines.append(f"problems ({len(self.problems)}):")
            lines.extend(f"  {shown(p, 400)}" for p in self.problems[:max_problems])
            if len(self.problems) > max_problems:
                lines.append(f"  ... {len(self.problems) - max_problems} more in _build_report.json" if saved else
                             f"  ... {len(self.problems) - max_problems} more (nothing was built: no _build_report.json "
                             "holds them; `polar-train inspect` lists the calls)")
        return "\n".join(lines)


def _named_lists(lists: dict[str, list[str]]) -> str:
    """``id: a, b; id2: c`` for a table line (the first five ids, each shown escaped and cut)."""
    return _some([f"{shown(k)}: {', '.join(map(shown, v))}" for k, v in lists.items()], sep="; ", escaped=True)


def _some(items: list[str], count: int = 5, sep: str = ", ", escaped: bool = False) -> str:
    """The first ``count`` of ``items`` joined, `` ...`` where there are more: a table line names
    examples, the JSON holds them all. Ids are a client's or a labels file's: each is shown escaped
    and cut (``escaped``: the caller did that to the ids inside)."""
    return sep.join(items[:count] if escaped else map(shown, items[:count])) + (" ..." if len(items) > count else "")
