"""The build pipeline: read the call log, choose usable calls, stitch, attach labels.

Why a separate step for choosing calls: retries, failed calls and text-only rows are decided
per row before stitching, each with a counted cause, so that nothing is dropped silently.
"""

from __future__ import annotations

import bisect
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from ..calllog import (
    CallLogError,
    _list_values,
    first_rows,
    live_notes,
    live_writers,
    loss_notes,
    nothing_readable,
    part_folder,
    read_call_log,
    resolve_prompt_prefixes,
    shared_rollout_notes,
)
from .report import BuildReport
from .rewards import REWARD_MODES, Labels, RewardFileError, attach, load_labels
from .stitch import IM_START_ID, SPECIAL_START_ID, Stitcher, Trajectory, calls_from_table, common_prefix, text_tail_start
from .tokenbytes import TokenBytes, default_token_bytes, ids_bytes, text_cover

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class BuildOptionsError(ValueError):
    """An option of :class:`BuildOptions` that no build could use: a value of the wrong type or an
    unknown one, an empty path, a tokenizer folder that does not load. One line, naming the option
    (or, for a tokenizer, the folder and why)."""


@dataclass
class BuildOptions:
    """What :func:`build_trajectories` does; checked when the build starts (a wrong value is a
    :class:`BuildOptionsError` before anything is read)."""

    realign: bool = False
    #: ``"broadcast"`` or ``"split"`` (``rewards.REWARD_MODES``).
    reward_mode: str = "broadcast"
    rewards: str | Path | None = None
    tasks: str | Path | None = None
    #: A model/tokenizer folder for byte comparisons (retokenization); default: Qwen3.5.
    tokenizer: str | Path | None = None


@dataclass
class BuildResult:
    """What :func:`build_trajectories` made: the trajectories (write them with
    :func:`~polar_train.trajectories.writer.write_trajectories`), the report (``report.table()``
    prints what ``polar-train build`` prints) and the rewards and tasks read."""

    trajectories: list[Trajectory]
    report: BuildReport
    labels: Labels = field(default_factory=Labels)


class CallSelection(NamedTuple):
    """What :func:`select_calls` chose: ``rows`` to stitch in time order, ``skipped`` rows counted
    by cause, and the rollouts whose id several sessions used (``restarted``: their calls were kept
    per session, not taken for retries of each other)."""

    rows: list[int]
    skipped: Counter
    restarted: frozenset = frozenset()


def select_calls(table: pa.Table, token_bytes: Callable[[], TokenBytes] | None = None) -> CallSelection:
    """Row indices to stitch, in time order, and the skipped rows counted by cause.

    Causes: ``superseded_retry`` (another attempt of the same request in the same rollout
    completed; the completed one is kept - the one a later call goes on from, by its ids or, where
    the harness sent the answer back tokenised otherwise, by its text (``token_bytes``: the
    tokenizer's bytes table, loaded only then; default the project's); where several are gone on
    from, they were no retries but conversations of their own, and all are kept), ``status_<status>`` (failed calls),
    ``token_source_none`` (text only), ``no_token_ids`` (ids missing), ``duplicate_call_id``
    (a row whose call id was already seen: only the first is used), ``no_call_id`` (null).
    """
    skipped: Counter = Counter()
    n = table.num_rows
    if n == 0:
        return CallSelection([], skipped)
    status = table.column("status").to_pylist()
    rollout = table.column("rollout_id").to_pylist()
    # a request is its body sent to one API: the same body sent to two endpoints is two requests
    req = [(a, h) if h else None for a, h in zip(table.column("api").to_pylist(),
                                                  table.column("request_hash").to_pylist())]
    attempt = table.column("attempt").to_pylist()
    started = table.column("started_at").to_pylist()
    finished = table.column("finished_at").to_pylist()
    source = table.column("token_source").to_pylist()
    call_id = table.column("call_id").to_pylist()
    has_prompt = ~np.asarray(table.column("prompt_token_ids").is_null(), dtype=bool)
    has_completion = ~np.asarray(table.column("completion_token_ids").is_null(), dtype=bool)

    def when(i: int) -> datetime:
        return started[i] or finished[i] or _EPOCH

    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        if req[i] and rollout[i] is not None:  # calls without a rollout id are no retries of each other:
            groups.setdefault((rollout[i], req[i]), []).append(i)  # a group's sessions all send one prompt
    superseded: set[int] = set()
    continued = _ContinuedAttempts(table, rollout, status, when, token_bytes)
    if restarts := _session_restarts(groups, status, when, continued, attempt, finished):
        # a rollout id used again for a session that sent the same requests (a deterministic one):
        # its calls are no retries of the earlier session's, which keeps its own
        groups = {}
        for i in range(n):
            if req[i] and rollout[i] is not None:
                session = bisect.bisect_right(restarts.get(rollout[i], ()), when(i))
                groups.setdefault((rollout[i], session, req[i]), []).append(i)
    def rank(i: int) -> tuple:  # which attempt stands for a request answered more than once
        return attempt[i] or 0, finished[i] or when(i), call_id[i]

    for rows in groups.values():
        ok = [i for i in rows if status[i] == "ok"]
        if len(ok) > 1 and _sent_side_by_side(ok, attempt, started, finished):
            # no retries: a client asks again only once it gave up on the first attempt (which then
            # is no completed one) - two sub-agents given one task, parallel samples of one prompt;
            # answered alike (a short turn, a low temperature), the second was dropped as a retry.
            # Where later calls went on from some of them only, the others were a hedging client's
            # spares (or a retry whose first attempt still finished): those are dropped
            gone_on = continued.of(ok)
            superseded.update(i for i in rows if status[i] != "ok" or (gone_on and i not in gone_on))
            continue
        if len(rows) > 1 and ok:
            # several attempts completed (a client that timed out and asked again, say): the one the
            # rollout's next call goes on from is what the harness used; else the latest
            candidates = continued.of(ok) if len(ok) > 1 else ok
            if len(candidates) > 1:
                # each went on in a conversation of its own (the same first request twice in a
                # rollout: no retry) - unless they answered alike (temperature 0, a seed): one sample
                kept = continued.distinct(candidates, key=rank)
                if len(kept) > 1:
                    superseded.update(i for i in rows if i not in kept)
                    continue
                candidates = kept
            keep = max(candidates or ok, key=rank)
            superseded.update(i for i in rows if i != keep)
    chosen = []
    seen_ids: set[str] = set()
    for i in range(n):
        if call_id[i] is None:
            skipped["no_call_id"] += 1  # written by hand or by a foreign tool: nothing to name it by
            continue
        if call_id[i] in seen_ids:
            skipped["duplicate_call_id"] += 1  # the same part copied twice, or a writer bug
            continue
        seen_ids.add(call_id[i])
        if i in superseded:
            skipped["superseded_retry"] += 1
        elif status[i] != "ok":
            skipped[f"status_{status[i]}"] += 1
        elif source[i] == "none":
            skipped["token_source_none"] += 1
        elif not (has_prompt[i] and has_completion[i]):
            skipped["no_token_ids"] += 1
        else:
            chosen.append(i)
    chosen.sort(key=lambda i: (when(i), attempt[i] or 0, call_id[i]))
    return CallSelection(chosen, skipped, frozenset(restarts))


def _sent_side_by_side(ok: list[int], attempt: list, started: list, finished: list) -> bool:
    """Whether completed attempts of one request were in flight together, numbered apart by the
    one proxy that saw them all (two chained proxies each number their record of one call 1)."""
    for x, i in enumerate(ok):
        for j in ok[x + 1:]:
            if None in (started[i], started[j], finished[i], finished[j]) or (attempt[i] or 1) == (attempt[j] or 1):
                continue
            if started[i] < finished[j] and started[j] < finished[i]:
                return True
    return False


def _ending_in_failure(table: pa.Table, rollout_ids: list) -> dict[str, str]:
    """Rollouts whose last call (by the time it started) did not complete, with its status: a
    session killed mid-call (``client_disconnected``) or ended on the server's error - trained as
    if it had finished, under a reward that scored an unfinished run (where an earlier call of it
    built a trajectory: the caller keeps those)."""
    last: dict[str, tuple] = {}
    for r, started, finished, status in zip(rollout_ids, *(table.column(c).to_pylist() for c in
                                                          ("started_at", "finished_at", "status"))):
        when = started or finished or _EPOCH
        if r is not None and (r not in last or when >= last[r][0]):
            last[r] = (when, status)
    return {r: status for r, (_, status) in sorted(last.items()) if status != "ok"}


def _session_restarts(groups: dict[tuple, list[int]], status: list, when, continued: "_ContinuedAttempts",
                      attempt: list, finished: list) -> dict[Any, list[datetime]]:
    """Per rollout, the times a session started again under its id: a completed call sending a
    request an earlier call of the rollout sent and a later call had already gone on from. A
    retry is sent while the harness still waits for the answer, never after it went on from it;
    without this, a second run of a deterministic session (each call equal to one of the first
    run's) was taken call by call for retries answered alike, and the first run lost its calls.

    Also a session's first request (its prompt holds no earlier call's of the rollout) completed
    and numbered attempt 1 after every earlier completed attempt had ended, and gone on from by no
    later call: the proxy that numbered it had not seen them (it was restarted - the next day's run
    of a one-call session under the same id - or it is another proxy). A later turn numbered 1, or
    one the conversation went on from, is no such sign: a row worker that died (killed, out of
    memory) before writing the first attempt's row has its successor number the retry 1, and the
    harness goes on from the retry (captures of earlier versions: any replaced worker). Where the
    attempts overlap in time it is one call recorded by two chained proxies, which stays one."""
    restarts: dict[Any, set[datetime]] = {}
    for (rollout_id, _), rows in groups.items():
        if len(rows) < 2:  # (most requests are sent once)
            continue
        ok = sorted((i for i in rows if status[i] == "ok"), key=when)
        if len(ok) < 2:
            continue
        gone_on: datetime | None = None  # the earliest a later call went on from an attempt so far
        ended: datetime | None = None  # the latest an attempt so far ended
        for c in ok:  # one pass over the rollout per attempt: sessions under one id cost linearly
            first = continued.first_gone_on(c, ok)
            numbered_afresh = (attempt[c] == 1 and ended is not None and ended < when(c) and first is None
                               and not continued.goes_on_from_an_earlier_call(c, ok))
            if numbered_afresh or (gone_on is not None and gone_on < when(c)):
                restarts.setdefault(rollout_id, set()).add(when(c))
            if first is not None and (gone_on is None or first < gone_on):
                gone_on = first
            end = finished[c] or when(c)
            ended = end if ended is None else max(ended, end)
    return {r: sorted(times) for r, times in restarts.items()}


class _ContinuedAttempts:
    """Which completed attempts of one request a later call of their rollout goes on from (its
    prompt starts with the attempt's prompt + completion). Only asked for requests with several
    completed attempts (rare); the prompts of that rollout alone are read then (compact ones
    resolved within it), as arrays: never the whole capture's.

    An attempt whose ids no later prompt goes on from is compared by text: a harness sends the
    answer back as text, and the server's tokenisation of it need not be the sampled one
    (``Hel`` + ``lo`` sampled, ``Hello`` in the next prompt). Without that, the highest attempt
    was kept whichever the harness had used; and where only the attempts no id matched were
    compared, a second session's re-tokenised attempt of the same request was dropped."""

    def __init__(self, table: pa.Table, rollout: list, status: list, when,
                 token_bytes: Callable[[], TokenBytes] | None = None) -> None:
        self.table, self.rollout, self.status, self.when = table, rollout, status, when
        self._token_bytes = token_bytes or default_token_bytes  # called only where text is compared
        self._rows_of: dict | None = None
        self._ids: dict = {}  # rollout -> {row: (prompt, completion)} as numpy arrays (None: unknown)
        self._said: dict[int, bytes] = {}  # attempts found by their text -> what their completion says

    def _load(self, rollout_id) -> dict:
        if self._rows_of is None:
            self._rows_of = {}
            for i, r in enumerate(self.rollout):
                self._rows_of.setdefault(r, []).append(i)
        rows = self._rows_of[rollout_id]
        part, _problems = resolve_prompt_prefixes(self.table.take(rows))  # unresolvable prompts stay null
        p_vals, p_offs, p_valid = _list_values(part.column("prompt_token_ids"))
        c_vals, c_offs, c_valid = _list_values(part.column("completion_token_ids"))
        ids = {}
        for k, i in enumerate(rows):
            ids[i] = (p_vals[p_offs[k]:p_offs[k + 1]] if p_valid[k] else None,
                      c_vals[c_offs[k]:c_offs[k + 1]] if c_valid[k] else None)
        return ids

    def _later_prompts(self, a: int, attempts: list[int], ids: dict):
        """``(row, prompt)`` of the completed calls of ``a``'s rollout sent no earlier than ``a``
        (its fellow attempts aside): the calls that could go on from it."""
        for j, (later, _) in ids.items():
            if j not in attempts and self.status[j] == "ok" and self.when(j) >= self.when(a) and later is not None:
                yield j, later

    def _rollout_ids(self, row: int) -> dict:
        rollout_id = self.rollout[row]
        if rollout_id not in self._ids:
            self._ids[rollout_id] = self._load(rollout_id)
        return self._ids[rollout_id]

    def of(self, attempts: list[int]) -> list[int]:
        ids = self._rollout_ids(attempts[0])
        out = []
        for a in attempts:
            prompt, completion = ids[a]
            if prompt is None or completion is None:
                continue
            history = np.concatenate([prompt, completion])
            if any(_extends(later, history) for _, later in self._later_prompts(a, attempts, ids)):
                out.append(a)
        by_text = self._of_by_text([a for a in attempts if a not in out], attempts, ids)
        return sorted(out + by_text, key=attempts.index)

    def goes_on_from_an_earlier_call(self, a: int, attempts: list[int]) -> bool:
        """Whether ``a``'s prompt holds an earlier completed call's of its rollout (``attempts`` aside)
        as its beginning: ``a`` is a later turn of a conversation, not a session's first request."""
        ids = self._rollout_ids(a)
        prompt = ids[a][0]
        if prompt is None:
            return True  # unknown: taken for a later turn (a retry stays a retry)
        for j, (earlier, _) in ids.items():
            if (j not in attempts and self.status[j] == "ok" and self.when(j) < self.when(a)
                    and earlier is not None and len(earlier) < len(prompt) and _extends(prompt, earlier)):
                return True
        return False

    def first_gone_on(self, a: int, attempts: list[int]) -> datetime | None:
        """When a later call (not one of ``attempts``) first went on from attempt ``a``, by its ids or
        its text; None if none did. Leaves what :meth:`distinct` compares by as it was."""
        ids = self._rollout_ids(a)
        prompt, completion = ids[a]
        if prompt is None or completion is None:
            return None
        history = np.concatenate([prompt, completion])
        lo = text_tail_start(prompt, len(prompt))
        first = None
        for j, later in self._later_prompts(a, attempts, ids):
            if (first is None or self.when(j) < first) and (
                    _extends(later, history) or self._says_again(later, history, completion, lo)):
                first = self.when(j)
        return first

    def _says_again(self, later: np.ndarray, history: np.ndarray, completion: np.ndarray, lo: int) -> bool:
        """Whether ``later`` holds ``history`` (an attempt's prompt + completion) by its text (see
        :meth:`_of_by_text`); the tokenizer is loaded only where ``later`` gets that far."""
        if not len(completion):
            return False
        d = common_prefix(later, history)
        if not lo <= d < len(history):
            return False
        tb = self._token_bytes()
        want = ids_bytes(tb, history[d:])  # the later prompt's bytes start with them
        covered = text_cover(tb, later[d:], want) if want else None
        return covered is not None and covered[1] and (
            completion[-1] >= SPECIAL_START_ID
            or (d + covered[0] < len(later) and later[d + covered[0]] >= SPECIAL_START_ID))

    def _of_by_text(self, candidates: list[int], attempts: list[int], ids: dict) -> list[int]:
        """The attempts a later prompt goes on from by what it says: its ids agree up to the
        prompt's last text at least (the generation prompt's ``assistant\\n`` may merge with a
        completion that starts with a newline), and from where they part its bytes start with
        the attempt's, to the attempt's end: its last id is a stop token, or a special token (the
        template's ``<|im_end|>``) follows it in the later prompt - an attempt that said "Hel" is
        no answer a prompt saying "Hello there" went on from. The tokenizer is loaded only where
        some later prompt gets that far."""
        out = []
        for a in candidates:
            prompt, completion = ids[a]
            if prompt is None or completion is None or not len(completion):
                continue
            history = np.concatenate([prompt, completion])
            lo = text_tail_start(prompt, len(prompt))
            for _, later in self._later_prompts(a, attempts, ids):
                if self._says_again(later, history, completion, lo):
                    self._said[a] = _reply_text(self._token_bytes(), completion)
                    out.append(a)
                    break
        return out

    def distinct(self, rows: list[int], key: Callable[[int], Any]) -> list[int]:
        """Of ``rows`` (attempts :meth:`of` found gone on from), one per distinct prompt +
        completion: the one ``key`` ranks highest where several are alike (alike in text where
        they were found by their text: the later prompt cannot tell one tokenisation from another)."""
        ids = self._ids[self.rollout[rows[0]]]
        by_text = any(i in self._said for i in rows)  # then all by text: one found by ids may say the same
        best: dict[bytes, int] = {}
        for i in rows:
            prompt, completion = ids[i]
            said = self._said.get(i)
            if said is None and by_text:
                said = _reply_text(self._token_bytes(), completion)
            sample = prompt.tobytes() + b"|" + (completion.tobytes() if said is None else b"text:" + said)
            if sample not in best or key(i) > key(best[sample]):
                best[sample] = i
        return sorted(best.values())


def _extends(later: np.ndarray, history: np.ndarray) -> bool:
    """Whether prompt ``later`` starts with ``history`` (an attempt's prompt + completion)."""
    return len(later) >= len(history) and np.array_equal(later[:len(history)], history)


def _reply_text(tb: TokenBytes, completion: np.ndarray) -> bytes:
    """What a completion says, its closing stop tokens left out (a server may leave them out)."""
    end = len(completion)
    while end and completion[end - 1] >= SPECIAL_START_ID:
        end -= 1
    return ids_bytes(tb, completion[:end]) or b""


def _token_bytes_factory(tokenizer_dir: str | Path | None):
    """The stitcher's token-bytes table of a tokenizer folder the user named, loaded at once: a
    folder that does not load fails before the (possibly long) read, not only when some capture
    needs a byte comparison. None: the built-in tokenizer, loaded only when needed. With it, the
    report's note on a tokenizer that is not Qwen3.5's, or None."""
    if tokenizer_dir is None:
        return None, None
    from ..tokenizer import load_tokenizer
    from .tokenbytes import token_bytes_of

    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as exc:  # not found, a file, no tokenizer files, does not load: its one line
        raise BuildOptionsError(str(exc)) from exc
    table = token_bytes_of(tokenizer)
    return (lambda: table), _foreign_chat_ids_note(tokenizer, tokenizer_dir)


def _foreign_chat_ids_note(tokenizer, tokenizer_dir) -> str | None:
    """A line for the report where ``--tokenizer`` is not a Qwen3.5 ChatML tokenizer: the fork
    causes are told apart by Qwen3.5's special-token ids (``<|im_start|>`` is 248045), so with
    another model's ids the forks are found exactly but may be labelled by the wrong cause - and
    ``--realign`` continues only those labelled ``retokenization``."""
    if tokenizer.get_vocab().get("<|im_start|>") == IM_START_ID:
        return None
    return (f"--tokenizer {tokenizer_dir} is not Qwen3.5's (its <|im_start|> is not id {IM_START_ID}): forks are "
            "found by exact ids as ever, but their causes are told by Qwen3.5's special-token ids, so a fork may be "
            "labelled by the wrong cause (and --realign continues only those labelled retokenization)")


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and isinstance(os.fspath(value), str)


def _checked(folder, options) -> BuildOptions:
    """The options to build with, after checking them and ``folder``'s type (cheap checks only:
    a wrong value fails at once, not after the read and stitch, and is never taken for another)."""
    if options is None:
        options = BuildOptions()
    elif not isinstance(options, BuildOptions):
        raise BuildOptionsError(f"options must be a BuildOptions (polar_train.trajectories), "
                                f"got {type(options).__name__}")
    if not _is_path(folder):
        raise CallLogError(f"call-log folder must be a path (str or os.PathLike), got {type(folder).__name__}")
    if not isinstance(options.realign, bool):  # "no" or 0 read as a truth value would be taken for another
        raise BuildOptionsError(f"realign must be True or False, got {options.realign!r}")
    if not isinstance(options.reward_mode, str) or options.reward_mode not in REWARD_MODES:
        raise BuildOptionsError(f"reward_mode must be one of {', '.join(REWARD_MODES)}, got {options.reward_mode!r}")
    for name, what in (("rewards", "a file"), ("tasks", "a file"),
                       ("tokenizer", "a model or tokenizer folder")):
        value = getattr(options, name)
        if value is None:
            continue
        if not _is_path(value):
            raise BuildOptionsError(f"{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}")
        if not os.fspath(value):  # Path("") is the current folder
            raise BuildOptionsError(f"empty {name} path: name {what}, or leave the option out")
    return options


def sampling_notes(temperatures: list[float | None], top_ps: list[float | None]) -> list[str]:
    """Sampler settings train cannot see or undo: a call that left temperature or top_p to the
    server sampled with its defaults - vLLM's are the model's generation_config.json (Qwen3's:
    temperature 0.6, top_k 20, top_p 0.95) unless it runs with ``--generation-config vllm`` -, and
    ``top_p`` < 1 truncated the distribution its recorded (whole-distribution) logprobs describe."""
    notes = []
    unsent = sum(1 for t, p in zip(temperatures, top_ps) if t is None or p is None)
    if unsent:
        notes.append(f"{unsent} of {len(temperatures)} calls left temperature or top_p to the server: vLLM then "
                     "samples with the model's generation_config.json (Qwen3's: temperature 0.6, top_k 20, top_p "
                     "0.95) unless started with --generation-config vllm, which train cannot see (docs/train.md, "
                     "Which server settings give correct ratios)")
    truncated = sum(1 for p in top_ps if p is not None and p < 1 - 1e-6)
    if truncated:
        notes.append(f"{truncated} of {len(top_ps)} calls were sampled with top_p < 1: the trainer cannot reproduce "
                     "the truncated distribution their tokens came from (recorded logprobs are of the whole one), so "
                     "the GRPO ratio and importance weights are biased (capture with top_p 1)")
    return notes


def _fallback_resolver(table: pa.Table):
    """Full prompts of compact calls whose reference the stitcher did not see (rare: a reference
    to a superseded retry). Resolved a rollout at a time, on first need (the writer's references
    stay within a rollout); the whole table once, for a prompt its rollout does not resolve."""
    rows: dict[str, object] = {}
    why: dict[str, str] = {}
    state: dict[str, object] = {}

    def resolve(take: list[int] | None) -> None:
        resolved, problems = resolve_prompt_prefixes(table if take is None else table.take(take))
        ids = resolved.column("call_id").to_pylist()
        vals, offs, valid = _list_values(resolved.column("prompt_token_ids"))
        for i, cid in enumerate(ids):
            rows[cid] = vals[offs[i]:offs[i + 1]] if valid[i] else None
        why.update((p.call_id, str(p)) for p in problems if p.call_id is not None)

    def full_prompt(call_id: str):
        if call_id not in rows:
            if "rows_of" not in state:
                rollouts = table.column("rollout_id").to_pylist()
                rows_of: dict = {}
                for i, r in enumerate(rollouts):
                    rows_of.setdefault(r, []).append(i)
                state.update(rows_of=rows_of, rollouts=rollouts,
                             row_of=first_rows(table.column("call_id").to_pylist()))
            i = state["row_of"].get(call_id)
            if i is not None:
                resolve(state["rows_of"][state["rollouts"][i]])
        if rows.get(call_id) is None and not state.get("whole"):
            state["whole"] = True  # a reference out of its rollout (a part written by another tool)?
            resolve(None)
        full = rows.get(call_id)
        return full if full is not None else why.get(call_id, f"call {call_id}: unresolved prompt")

    return full_prompt


def build_trajectories(folder: str | Path, options: BuildOptions | None = None) -> BuildResult:
    """Trajectories (not yet written) and the report for the call log in ``folder``.

    Every unusable input is a ``ValueError``, each with one line to show: ``CallLogError`` for the
    folder (missing, empty path, no readable part), ``RewardFileError`` for ``rewards``/``tasks``
    files, ``BuildOptionsError`` for an option of the wrong type or value and a ``tokenizer`` folder
    that does not load. Options, the folder's existence, the label files' existence and type and
    the tokenizer are checked before the call log is read; the label files' rows after it (they are
    judged against the rollouts it holds).
    """
    options = _checked(folder, options)
    part_folder(folder)  # a missing or empty-named folder fails before a tokenizer folder loads (seconds)
    if options.rewards is not None or options.tasks is not None:
        from .rewards import check_file

        for p in (options.rewards, options.tasks):
            if p is not None:
                check_file(p)  # fail before the (possibly long) read
    token_bytes_factory, tokenizer_note = _token_bytes_factory(options.tokenizer)
    # the stitcher resolves compact prompts; the texts are not needed (most of a long session's bytes)
    live_before = live_writers(folder, [])  # (a proxy that stops during the read: still said)
    log = read_call_log(folder, resolve_prompts=False, skip=frozenset({"request_json", "response_json"}))
    table = log.table
    report = BuildReport(source=str(folder), realign=options.realign, reward_mode=options.reward_mode,
                         parts_read=len(log.parts), calls_read=table.num_rows)
    report.parts_skipped = sum(1 for p in log.problems if p.call_id is None)
    if not log.parts:  # every part skipped: unusable, as an empty folder is (a table of zeros hid it)
        raise CallLogError(nothing_readable(folder, log.problems))
    report.notes.extend(live_notes(live_before, live_writers(folder, log.parts)))
    report.notes.extend(loss_notes(folder, log.parts))
    report.notes.extend(shared_rollout_notes(log))
    if tokenizer_note is not None:
        report.notes.append(tokenizer_note)
    report.problems.extend(str(p) for p in log.problems)
    rows, skipped, restarted = select_calls(table, token_bytes_factory)
    report.skipped = dict(skipped)
    calls = calls_from_table(table, np.asarray(rows, dtype=np.int64))
    report.calls_without_logprobs = sum(1 for c in calls if len(c.logprobs) and np.isnan(c.logprobs).all())
    # a rendered completion (no server ids) the server counted otherwise: its trained ids are a guess
    # (server ids are exact whatever usage says: n > 1 counts every choice)
    chosen = pa.array(rows, type=pa.int64())
    usage = table.column("usage_match").take(chosen).to_pylist()
    sources = table.column("token_source").take(chosen).to_pylist()
    report.usage_mismatch_calls = sum(1 for u, src in zip(usage, sources) if u is False and src == "rendered")
    report.notes.extend(sampling_notes(table.column("temperature").take(chosen).to_pylist(),
                                       table.column("top_p").take(chosen).to_pylist()))
    stitcher = Stitcher(realign=options.realign,
                        token_bytes_factory=token_bytes_factory,
                        fallback_prompt=_fallback_resolver(table),
                        # every row's: a client's rollout whose calls all failed is named in a rewards file too
                        named_rollouts=frozenset(r for r in table.column("rollout_id").unique().to_pylist()
                                                 if r is not None))
    for call in calls:
        stitcher.add(call)
    stitcher.settle_main_conversations()
    trajectories = stitcher.trajectories
    if stitcher.stats.unresolved:
        report.skipped["unresolved_prompt"] = stitcher.stats.unresolved
    report.problems.extend(stitcher.stats.problems)
    report.compact_fast_path = stitcher.stats.compact_fast_path
    report.calls_used = len(calls) - stitcher.stats.unresolved
    report.trajectories = len(trajectories)
    report.rollouts = len({t.rollout_id for t in trajectories})
    report.forks = dict(stitcher.stats.forks)
    report.restarted_rollouts = sorted(set(stitcher.stats.restarts) | restarted)
    models_of: dict[str, set[str]] = {}
    for t in trajectories:
        name = t.model if t.model is not None else "(none)"
        report.models[name] = report.models.get(name, 0) + 1
        if t.rollout_id:
            models_of.setdefault(t.rollout_id, set()).add(name)
    report.mixed_model_rollouts = {r: sorted(m) for r, m in sorted(models_of.items()) if len(m) > 1}
    rollout_ids = table.column("rollout_id").to_pylist()
    apis_of: dict[str, set[str]] = {}
    for r, api in zip((rollout_ids[i] for i in rows), table.column("api").take(chosen).to_pylist()):
        if r is not None and api is not None:
            apis_of.setdefault(r, set()).add(api)
    report.mixed_api_rollouts = {r: sorted(a) for r, a in sorted(apis_of.items()) if len(a) > 1}
    tasks_of: dict[str, set[str]] = {}
    for r, task in zip((rollout_ids[i] for i in rows), table.column("task_id").take(chosen).to_pylist()):
        if r is not None and task is not None:
            tasks_of.setdefault(r, set()).add(task)
    report.mixed_task_rollouts = {r: sorted(t) for r, t in sorted(tasks_of.items()) if len(t) > 1}
    sessions_of: dict[str, set[str]] = {}
    for r, session in zip((rollout_ids[i] for i in rows), table.column("client_session_id").take(chosen).to_pylist()):
        if r is not None and session is not None:
            sessions_of.setdefault(r, set()).add(session)
    report.mixed_session_rollouts = {r: len(s) for r, s in sorted(sessions_of.items()) if len(s) > 1}
    report.closed_at_cap = stitcher.stats.closed_at_cap
    report.realigned_calls = stitcher.stats.realigned_calls
    known = {r for r in rollout_ids if r is not None}
    known |= {t.rollout_id for t in trajectories if t.rollout_id}  # the conv-<call id> ones build names
    labels = load_labels(options.rewards, options.tasks, known)
    report.problems.extend(labels.problems)
    groups = attach(trajectories, labels, options.reward_mode)
    built = {t.rollout_id for t in trajectories}
    report.rollouts_without_usable_call = sorted(known - built)  # inspect counts them among its rollouts
    report.cut_off_rollouts = {r: status for r, status in _ending_in_failure(table, rollout_ids).items() if r in built}
    report.rewarded_without_calls = sorted(r for r in labels.rewards if r not in built)
    if labels.rewards and trajectories and not labels.rewards.keys() & built:
        # every reward fell on a rollout without a usable call: the build would train on nothing
        some = ", ".join(repr(r) for r in report.rewarded_without_calls[:3])
        more = " ..." if len(report.rewarded_without_calls) > 3 else ""
        raise RewardFileError(f"no reward in {options.rewards} lands on a trajectory: the rollouts it rewards "
                              f"({some}{more}) have no usable call (each failed or was skipped)")
    report.problems.extend(f"rollout {r!r} has a reward but no usable call (each failed or was skipped): "
                           "it is missing from its group" for r in report.rewarded_without_calls)
    report.groups = groups.groups
    # a group whose rollouts asked for different models: the models of each rollout (a harness's side
    # calls to a small model are in every rollout alike, and a rollout reused is named above)
    rollout_models: dict[tuple[str, str], set[str]] = {}
    for t in trajectories:
        if t.task_id is not None:
            rollout_models.setdefault((t.task_id, t.rollout_id), set()).add(t.model if t.model is not None else "(none)")
    models_in: dict[str, set[frozenset[str]]] = {}
    for (task, _), models in rollout_models.items():
        models_in.setdefault(task, set()).add(frozenset(models))
    report.mixed_model_groups = {g: sorted(set().union(*m)) for g, m in sorted(models_in.items()) if len(m) > 1}
    report.singleton_groups = groups.singleton_groups
    report.equal_reward_groups = groups.equal_reward_groups
    report.unrewarded_groups = groups.unrewarded_groups
    report.rollouts_without_task = groups.rollouts_without_task
    report.rewarded_without_task = groups.rewarded_without_task
    report.rollouts_without_reward = groups.rollouts_without_reward
    report.unrewarded_rollouts = groups.unrewarded_rollouts
    report.rollouts_with_reward = report.rollouts - groups.rollouts_without_reward
    for t in trajectories:
        trained = sum(len(c) for c, s in zip(t.ids, t.sampled) if s)
        report.tokens_trained += trained
        report.sampled_without_logprob += sum(int(np.isnan(lp).sum()) for lp, s in zip(t.logprobs, t.sampled) if s)
        report.tokens_total += len(t.prompt) + sum(len(c) for c in t.ids)
        report.truncated_trajectories += int(t.truncated)
    return BuildResult(trajectories=trajectories, report=report, labels=labels)
