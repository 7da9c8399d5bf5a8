"""Stitch model calls into trajectories by token prefix; fork, with a named cause, where they diverge.

Why prefix merge: an agent's call k+1 normally sends back everything of call k (prompt +
sampled completion) plus tool output. One trajectory then holds the whole episode once: the
first prompt, then sampled tokens (trained, with the sampler's logprobs) interleaved with tool
output and template glue (not trained). Wherever the next prompt does *not* start with what
came before, merging would train on tokens the model never produced in that context, so the
call starts a new trajectory and the reason is recorded.

Linear time: per rollout only the open trajectories' prompt space is kept (one append-only
int32 buffer each = the last call's full prompt + completion); a new prompt is compared against
it once, with O(1) pre-checks first, so each input token is read once. Nothing is
re-tokenised; earlier calls are never rescanned. A compactly stored prompt that continues its
reference's trajectory is not even compared: its suffix is appended, O(new tokens).

Fork causes (``fork_cause`` of the new trajectory):

``retokenization``
    the next prompt carries the same *text* as the sampled completion, tokenised differently
    (BPE drift on re-rendering). With ``realign`` the call continues the trajectory instead:
    the sampled ids are kept and the next prompt's tokens resume where the texts agree.
``history_rewrite``
    the harness or template changed earlier turns: reasoning of earlier turns dropped after a
    new user message (``<think>`` removed), edited messages. (A changed system prompt or tool list
    reads as ``new_conversation``: it differs where a sub-agent differs from its parent.)
``compaction``
    the context shrank: earlier turns were replaced (e.g. by a summary) - also where the summary
    comes first and the task's own user turn, kept whole, after it (Pi), or replaces the task
    and the recent turns are kept (Pi 0.73).
``new_conversation``
    shares no complete user turn with any open trajectory: a sub-agent, a parallel thread, a
    side request (title, summary) with its own prompt. A rollout's main conversation is the one
    without a cause: its first, unless a later new conversation holds more calls (a side
    request came first).
``branch``
    the prompt is a strict prefix of an open trajectory: a rewind or a parallel sample.
``sampler_change``
    the prompt continues a trajectory but the model or temperature changed; one trajectory
    has one sampler, so the trainer can recompute its logprobs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .tokenbytes import TokenBytes, ids_bytes, text_cover, withheld_at_end

SPECIAL_START_ID = 248044  # Qwen3.5 special tokens are 248044..248076
IM_START_ID = 248045
IM_END_ID = 248046
THINK_ID = 248068
USER_ID = 846

#: How far back into the last prompt a re-tokenisation may reach (the ``assistant\n`` header).
_MAX_PROMPT_TAIL = 8

FORK_CAUSES = ("retokenization", "history_rewrite", "compaction", "new_conversation", "branch",
               "sampler_change")
#: Forks that rewrote the conversation they left (which then stays open only until the rewrite is
#: gone on from: see ``Trajectory.moved_on_from``).
_REWRITES = frozenset({"retokenization", "history_rewrite", "compaction"})
#: Finish reasons of a reply cut at its token limit: chat and Responses ("length", as the capture
#: records Responses' max_output_tokens), Anthropic Messages ("max_tokens").
CUT_BY_MAX_TOKENS = frozenset({"length", "max_tokens"})
#: Open trajectories kept per rollout (least recently extended are closed first). A call looks
#: through its rollout's open trajectories, so more live conversations than this in one pool
#: (calls arriving in turn) close each other's and merge nothing: 32 and 128 were too few for
#: 33 parallel sub-agents or 129 anonymous sessions (each then one trajectory per call). Closing
#: is counted (``closed_at_cap`` in the report).
MAX_OPEN_PER_ROLLOUT = 256
MAX_OPEN_ANONYMOUS = 1024


@dataclass(eq=False)
class Call:
    """One usable call: ids as numpy views, sampler settings, and where it came from.

    A compactly stored call has ``prefix_ref``/``prefix_len`` set and ``prompt`` holds only
    the stored suffix until the stitcher resolves it (see :meth:`Stitcher.add`).
    """

    call_id: str
    rollout_id: str | None
    task_id: str | None
    model: str | None
    temperature: float | None
    token_source: str | None
    finish_reason: str | None
    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray  # float32, len(completion); NaN where the server reported none
    prefix_ref: str | None = None
    prefix_len: int | None = None
    #: the harness's own session id (Codex's, Claude Code's): calls without a rollout id are
    #: pooled per session where they name one
    session_id: str | None = None


def _pool_key(call: Call) -> str | tuple[str, str] | None:
    """The pool of open trajectories a call is matched against: its rollout's; for a call without a
    rollout id, its harness session's (two sessions that sent the same first turns - Codex's
    environment context - read as one conversation compacted), else the anonymous pool."""
    if call.rollout_id is not None or call.session_id is None:
        return call.rollout_id
    return ("session", call.session_id)


@dataclass(eq=False)  # identity: pools use `in` / remove, and fields hold arrays
class Trajectory:
    trajectory_id: str
    rollout_id: str | None
    task_id: str | None
    model: str | None
    temperature: float | None
    prompt: np.ndarray
    fork_cause: str | None
    #: The first user turn: ``prompt[first_user_start:first_user_end]`` (both 0 without one).
    first_user_start: int = 0
    first_user_end: int = 0
    ids: list[np.ndarray] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    token_sources: set[str] = field(default_factory=set)
    #: Prompt space: ``buf[:match_len]`` = the last call's full prompt + its completion, i.e.
    #: what the next prompt must start with. Append-only (grown by copying), so a slice
    #: ``buf[:n]`` taken earlier stays valid: compact prompts resolve against it for free.
    buf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    match_len: int = 0
    last_prompt_len: int = 0
    truncated: bool = False
    realigned: bool = False
    last_used: int = 0
    #: The trajectory this one forked from as a rewrite of its history (retokenization,
    #: history_rewrite, compaction), kept open until a later call goes on from this one: a side
    #: request that rewrites the history once (Claude Code's summary call sends the history
    #: without its last turn) must not close the conversation it left.
    moved_on_from: "Trajectory | None" = None
    #: The pool it is open in (:func:`_pool_key` of its first call)
    pool_key: str | tuple[str, str] | None = None
    #: The stitcher's clock when this trajectory forked (a parent extended later has gone on too).
    forked_at: int = 0
    group_id: str | None = None
    reward: float | None = None
    #: How ``reward`` was given (``attach``'s mode): under ``split`` it is a share of the rollout's,
    #: which the writer records for the trainer's baseline.
    reward_mode: str | None = None

    def match(self) -> np.ndarray:
        return self.buf[:self.match_len]

    def match_at(self, i: int) -> int:
        return int(self.buf[i])

    def match_tail(self, start: int) -> np.ndarray:
        return self.buf[start:self.match_len]

    def append_prompt_space(self, *parts: np.ndarray) -> None:
        need = self.match_len + sum(len(p) for p in parts)
        if need > len(self.buf):
            grown = np.empty(max(need, 2 * len(self.buf), 1024), np.int32)
            grown[:self.match_len] = self.buf[:self.match_len]
            self.buf = grown
        for p in parts:
            self.buf[self.match_len:self.match_len + len(p)] = p
            self.match_len += len(p)

    def reset_prompt_space(self, prompt: np.ndarray) -> None:
        """Start the prompt space over at ``prompt`` (a new buffer: old slices stay valid)."""
        self.buf = np.zeros(0, np.int32)
        self.match_len = 0
        self.append_prompt_space(prompt)

    def add_glue(self, glue: np.ndarray) -> None:
        if len(glue):
            self.ids.append(glue)
            self.sampled.append(False)
            self.logprobs.append(np.full(len(glue), np.nan, np.float32))
            self.append_prompt_space(glue)

    def add_call(self, call: Call) -> None:
        """Append a sampled completion; the prompt space must already hold the call's prompt."""
        self.ids.append(call.completion)
        self.sampled.append(True)
        self.logprobs.append(call.logprobs)
        self.call_ids.append(call.call_id)
        if call.token_source:
            self.token_sources.add(call.token_source)
        self.last_prompt_len = self.match_len
        self.append_prompt_space(call.completion)
        self.truncated = call.finish_reason in CUT_BY_MAX_TOKENS
        if self.task_id is None:
            self.task_id = call.task_id

    @property
    def last_call_id(self) -> str:
        return self.call_ids[-1]

    @property
    def token_source(self) -> str | None:
        if not self.token_sources:
            return None
        return next(iter(self.token_sources)) if len(self.token_sources) == 1 else "mixed"

    def completion_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(completion_ids int32, loss_mask int8, logprobs float32) of the whole trajectory."""
        if not self.ids:
            return np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros(0, np.float32)
        ids = np.concatenate(self.ids).astype(np.int32, copy=False)
        mask = np.concatenate([np.full(len(c), 1 if s else 0, np.int8)
                               for c, s in zip(self.ids, self.sampled)])
        lps = np.concatenate(self.logprobs).astype(np.float32, copy=False)
        return ids, mask, lps


def text_tail_start(ids: np.ndarray, end: int) -> int:
    """Where the text that ``ids[:end]`` ends with starts: back to the last special token, at most
    ``_MAX_PROMPT_TAIL`` ids (a prompt's ``assistant\n`` after its ``<|im_start|>``)."""
    lo = end
    while lo > max(0, end - _MAX_PROMPT_TAIL) and ids[lo - 1] < SPECIAL_START_ID:
        lo -= 1
    return lo


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _first_user_turn(prompt: np.ndarray) -> tuple[int, int]:
    """Where the first user turn lies: from its ``<|im_start|>`` to just past its ``<|im_end|>``
    ((0, 0) when there is none)."""
    starts = np.flatnonzero(prompt[:-1] == IM_START_ID)
    for s in starts:
        if prompt[s + 1] == USER_ID:
            ends = np.flatnonzero(prompt[s:] == IM_END_ID)
            return int(s), (int(s + ends[0] + 1) if len(ends) else len(prompt))
    return 0, 0


def _holds_later(prompt: np.ndarray, turn: np.ndarray, after: int) -> bool:
    """Whether ``prompt`` holds ``turn`` (a whole user turn) starting past index ``after``."""
    return len(turn) >= 2 and _holds(prompt[after + 1:], turn)


def _holds(prompt: np.ndarray, piece: np.ndarray) -> bool:
    """Whether ``prompt`` holds ``piece`` anywhere (candidates by its first token, then compared)."""
    n = len(piece)
    if n == 0 or n > len(prompt):
        return False
    for c in np.flatnonzero(prompt[:len(prompt) - n + 1] == piece[0]):
        if np.array_equal(prompt[c:c + n], piece):
            return True
    return False


#: Shortest piece of a conversation taken as evidence that a prompt kept it (a turn of a few
#: tokens, ``<|im_end|>`` alone, could be in any conversation). A tool result counts from its
#: ``<|im_start|>``: ~8 of its tokens are the template's. A sampled reply is the model's own
#: words: Claude Code keeps the last one however short ("All three commands ran: alpha, beta,
#: gamma." is 12 tokens with its ``<|im_end|>``).
_MIN_KEPT_PIECE = 16
_MIN_KEPT_REPLY = 8


def _keeps_later_turns(t: "Trajectory", prompt: np.ndarray, last: int = 4) -> bool:
    """Whether ``prompt`` holds one of the last pieces of ``t`` past its first prompt: a tool
    result (from its ``<|im_start|>`` on: between special tokens the template tokenises a turn the
    same wherever it stands) or a sampled reply. A compaction that summarised the task away but
    kept the recent turns (Pi 0.73) does; a sub-agent or side request, a conversation of its own,
    does not."""
    seen = 0
    for ids, sampled in zip(reversed(t.ids), reversed(t.sampled)):
        if not sampled:
            starts = np.flatnonzero(ids == IM_START_ID)
            ids = ids[starts[0]:] if len(starts) else ids[:0]
        if len(ids) < (_MIN_KEPT_REPLY if sampled else _MIN_KEPT_PIECE):
            continue
        if _holds(prompt, ids):
            return True
        seen += 1
        if seen == last:
            break
    return False


def _replaced_later_turns(t: "Trajectory", prompt: np.ndarray, d: int, last: int = 8) -> bool:
    """Whether ``prompt`` keeps none of ``t``'s turns after the divergence ``d``, of which there
    were two or more to look for (the last ``last`` looked at): the turns were replaced, as by Codex's
    summary after the task's own turn, which may be longer than what it replaced. A history
    rewrite (an argument re-serialised, a message edited) keeps the turns that follow it."""
    if t.realigned:  # its pieces no longer sit where their lengths say
        return False
    end, checked = t.match_len, 0
    for ids, sampled in zip(reversed(t.ids), reversed(t.sampled)):
        piece_end, start = end, end - len(ids)
        end = start
        if piece_end <= d:
            break
        if start < d:
            continue  # the piece the divergence lies in
        if not sampled:
            starts = np.flatnonzero(ids == IM_START_ID)
            ids = ids[starts[0]:] if len(starts) else ids[:0]
        if len(ids) < (_MIN_KEPT_REPLY if sampled else _MIN_KEPT_PIECE):
            continue
        if _holds(prompt[d:], ids):
            return False
        checked += 1
        if checked == last:
            break
    return checked >= 2


def _temperature(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _same_sampler(t: Trajectory, call: Call) -> bool:
    """Same model and temperature (unknown equals only unknown)."""
    a, b = _temperature(t.temperature), _temperature(call.temperature)
    same_temp = (a is None and b is None) or (a is not None and b is not None and abs(a - b) < 1e-6)
    return t.model == call.model and same_temp


@dataclass
class StitchStats:
    forks: Counter = field(default_factory=Counter)
    realigned_calls: int = 0
    #: Compact calls extended in O(new tokens), without comparing or expanding the prompt.
    compact_fast_path: int = 0
    unresolved: int = 0
    problems: list[str] = field(default_factory=list)
    #: Open trajectories closed because their pool was full (a later call of theirs forks).
    closed_at_cap: int = 0
    #: Rollouts a call started again from their first prompt, after that prompt's conversation
    #: had gone on (calls per rollout): one rollout id used for several sessions, most likely.
    restarts: Counter = field(default_factory=Counter)


class Stitcher:
    """Feeds calls in time order; keeps open trajectories per rollout; emits all at the end.

    ``fallback_prompt(call_id)`` returns the full prompt of a compact call whose reference was
    not stitched here (e.g. it points at a failed call), or a message saying why it cannot.
    """

    def __init__(self, *, realign: bool = False, token_bytes: TokenBytes | None = None,
                 token_bytes_factory=None, fallback_prompt=None, named_rollouts: frozenset[str] = frozenset()):
        self.realign = realign
        #: the rollout ids the capture names: a conversation without one is never given one of them
        self._named_rollouts = named_rollouts
        self._token_bytes = token_bytes
        self._token_bytes_factory = token_bytes_factory
        self._fallback_prompt = fallback_prompt
        self.trajectories: list[Trajectory] = []
        self.open: dict[str | tuple[str, str] | None, list[Trajectory]] = {}  # by _pool_key
        self.stats = StitchStats()
        self._clock = 0
        self._counter: Counter = Counter()
        self._went_on: set[str | None] = set()  # rollouts that went past their first prompt
        #: rollout -> the first prompt of its first trajectory: that trajectory may be closed (a
        #: retokenization fork went on from it), and its first prompt lives on only as a prefix
        #: of the fork's, where its length was no longer known
        self._opening_prompts: dict[str | None, list[np.ndarray]] = {}
        #: call id -> (trajectory, prompt-space buffer, prompt end, prompt + completion end)
        self._where: dict[str, tuple[Trajectory, np.ndarray, int, int]] = {}

    # --- helpers ----------------------------------------------------------------------
    def token_bytes(self) -> TokenBytes:
        if self._token_bytes is None:
            if self._token_bytes_factory is None:
                from .tokenbytes import default_token_bytes

                self._token_bytes_factory = default_token_bytes
            self._token_bytes = self._token_bytes_factory()
        return self._token_bytes

    def _new_id(self, rollout: str) -> str:
        n = self._counter[rollout]
        self._counter[rollout] += 1
        return f"{rollout}#{n}"

    def _opens_conversation(self, rollout_id: str | None, prompt: np.ndarray) -> bool:
        """Whether ``prompt`` is the rollout's very first prompt (a second session of an anonymous
        GRPO group, or a rollout id used again for the next session)."""
        return any(len(first) == len(prompt) and np.array_equal(first, prompt)
                   for first in self._opening_prompts.get(rollout_id, ()))

    def _record(self, t: Trajectory, call: Call) -> None:
        self._where[call.call_id] = (t, t.buf, t.last_prompt_len, t.match_len)

    def _anonymous_rollout(self, call: Call) -> str:
        """``conv-<first call id>`` for a conversation sent without a rollout id; another name where
        a client named a rollout so (its calls and the conversation were one rollout, one reward)."""
        name, n = f"conv-{call.call_id}", 1
        while name in self._named_rollouts:
            n += 1
            name = f"conv-{call.call_id}-{n}"
        return name

    def _start(self, call: Call, rollout_id: str | None, cause: str | None) -> Trajectory:
        key = _pool_key(call)
        t = Trajectory(
            trajectory_id=self._new_id(rollout_id or "anon"), rollout_id=rollout_id,
            task_id=call.task_id, model=call.model, temperature=call.temperature,
            prompt=call.prompt, fork_cause=cause)
        t.first_user_start, t.first_user_end = _first_user_turn(call.prompt)
        t.pool_key = key
        t.reset_prompt_space(call.prompt)
        t.add_call(call)
        t.last_used = self._clock
        self._record(t, call)
        self.trajectories.append(t)
        if cause is None:  # (not a sub-agent's or side request's: sent again, it is no new session)
            self._opening_prompts.setdefault(rollout_id, []).append(call.prompt)
        pool = self.open.setdefault(key, [])
        pool.append(t)
        cap = MAX_OPEN_PER_ROLLOUT if call.rollout_id is not None else MAX_OPEN_ANONYMOUS
        if len(pool) > cap:
            pool.sort(key=lambda x: x.last_used)
            self.stats.closed_at_cap += len(pool) - cap
            del pool[: len(pool) - cap]
        if cause:
            self.stats.forks[cause] += 1
        return t

    def _gone_on_from(self, t: Trajectory) -> None:
        """A later call went on from ``t``: the conversation ``t`` rewrote has moved on (its old
        tokens will not come back), so it is closed - unless it went on itself after the fork (a
        side agent's rewrite going on beside the main conversation, which must stay open)."""
        self._went_on.add(t.pool_key)
        left, t.moved_on_from = t.moved_on_from, None
        pool = self.open.get(t.pool_key, [])
        if left is not None and left.last_used <= t.forked_at and left in pool:
            pool.remove(left)

    def _extend(self, t: Trajectory, call: Call, glue: np.ndarray) -> Trajectory:
        self._gone_on_from(t)
        t.add_glue(glue)
        t.add_call(call)
        t.last_used = self._clock
        self._record(t, call)
        return t

    @staticmethod
    def _extends(t: Trajectory, prompt: np.ndarray) -> bool:
        m = t.match_len
        if len(prompt) < m:
            return False
        # O(1) rejections first: the last token (often <|im_end|> in every conversation), the one
        # before it (the reply's own), the middle and the first; a pool holds hundreds
        if m and (prompt[m - 1] != t.buf[m - 1] or prompt[m // 2] != t.buf[m // 2] or prompt[0] != t.buf[0]
                  or (m > 1 and prompt[m - 2] != t.buf[m - 2])):
            return False
        return bool(np.array_equal(prompt[:m], t.buf[:m]))

    def _retokenized_at(self, t: Trajectory, prompt: np.ndarray, d: int) -> int | None:
        """Where ``prompt`` resumes after saying the same bytes as the sampled tail ``t[d:]``.

        Only divergences inside the last completion qualify (earlier tokens were already
        checked against a prompt) - or in the text that the generation prompt ends with (the
        ``assistant\n`` after ``<|im_start|>``), because re-rendering can merge it with the start
        of the completion: a completion that begins with newlines re-tokenises ``"\n" + "\n\n"``
        as one ``"\n\n\n"`` token. A reply cut inside a character is compared without the ids its
        text left out (the client never had them to send back). Returns the index in ``prompt`` or None.
        """
        if d < text_tail_start(t.buf, t.last_prompt_len) or d >= t.match_len:
            return None
        if SPECIAL_START_ID <= t.match_at(d):
            return None  # a special token: no tokenisation of text produces it
        end = t.match_len
        if t.buf[end - 1] < SPECIAL_START_ID:  # a reply cut short (no <|im_end|>): maybe inside a character
            end -= withheld_at_end(self.token_bytes(), t.buf[t.last_prompt_len:end])
            if d >= end:  # only what the reply's text left out differs: the prompt goes on from here
                return d
        if d < len(prompt) and SPECIAL_START_ID <= prompt[d]:
            return None  # (on the prompt's side too: before the tokenizer loads, where it need not)
        tb = self.token_bytes()
        want = ids_bytes(tb, t.buf[d:end])
        if want is None:
            return None  # an id that names no token: nothing to compare
        covered = text_cover(tb, prompt[d:], want)
        return d + covered[0] if covered is not None and covered[1] else None

    def _retokenized_sibling(self, pool: list[Trajectory], parent: Trajectory,
                             prompt: np.ndarray) -> tuple[Trajectory, int] | None:
        """Another open trajectory whose last reply ``prompt`` says again in other tokens, where the
        parent (the longest common prefix) explains it otherwise. Sessions that send one first prompt
        (a GRPO group, with or without rollout ids) share a prefix, and one session's fork may agree
        with a later prompt further than that prompt's own session: the first or furthest of them was
        taken, and a re-tokenised reply read as a compaction of another session (of its rollout, for
        anonymous calls). Each candidate is checked where it parts from ``prompt``."""
        tb = None
        for t in pool:
            end = t.last_prompt_len  # the reply starts there; its text tail at most _MAX_PROMPT_TAIL before
            if t is parent or t is parent.moved_on_from or len(prompt) <= end or t.match_len <= end:
                continue  # (the trajectory the parent rewrote: its reply the parent holds re-tokenised)
            if prompt[end - 1] != t.buf[end - 1] or prompt[0] != t.buf[0] or prompt[end // 2] != t.buf[end // 2]:
                continue  # O(1) first: t's prompt must be the call's too (a pool holds up to 1,024)
            d = common_prefix(prompt, t.match())
            if d >= t.match_len or d >= len(prompt) or d < end - _MAX_PROMPT_TAIL:
                continue
            tb = tb or self.token_bytes()
            a, b = tb(int(t.buf[d])), tb(int(prompt[d]))  # the same text from d: the same first byte, but
            if a and b and a[0] != b[0] and a[0] < 0x80 and b[0] < 0x80:  # for a composed character (NFC)
                continue
            if (j := self._retokenized_at(t, prompt, d)) is not None:
                return t, j
        return None

    def _classify(self, t: Trajectory, prompt: np.ndarray, d: int) -> tuple[str, int | None]:
        if d == len(prompt):
            return "branch", None
        j = self._retokenized_at(t, prompt, d)
        if j is not None:
            return "retokenization", j
        if d < t.first_user_end:
            # the system and tools kept, the first user turn changed, and that turn found whole later:
            # a summary put before the task (Pi). A changed system or tool block (a side request, a
            # new tool list) is no compaction, even where it moves the same user turn along - also
            # where the first call had none: a system block put before the task parts from it at the
            # turn's role (<|im_start|> alike, "system" for "user"), a summary turn after its role
            kept = d > t.first_user_start + 1
            if kept and _holds_later(prompt, t.buf[t.first_user_start:t.first_user_end], t.first_user_start):
                return "compaction", None  # the task's turn kept, moved behind a summary (Pi)
            if kept and _keeps_later_turns(t, prompt):
                return "compaction", None  # the task summarised away, its recent turns kept (Pi 0.73)
            return "new_conversation", None
        if t.match_at(d) == THINK_ID:
            return "history_rewrite", None
        if len(prompt) < t.match_len or _replaced_later_turns(t, prompt, d):
            return "compaction", None
        return "history_rewrite", None

    def _full_prompt(self, call: Call) -> np.ndarray | None:
        """The full prompt of a compact call: a prefix of its reference's prompt space + suffix."""
        where = self._where.get(call.prefix_ref)
        n = call.prefix_len
        if where is not None:
            _, buf, _, end = where
            if n is None or n < 0 or n > end:
                self.stats.problems.append(
                    f"call {call.call_id}: prompt_prefix_len {n} outside 0..{end} of call {call.prefix_ref}")
                return None
            return np.concatenate([buf[:n], call.prompt])
        full = self._fallback_prompt(call.call_id) if self._fallback_prompt else None
        if full is None or isinstance(full, str):
            self.stats.problems.append(
                full or f"call {call.call_id}: prompt prefix refers to unknown call {call.prefix_ref}")
            return None
        return full

    def settle_main_conversations(self) -> None:
        """Give each rollout's main conversation ``fork_cause`` None: its first trajectory, unless a
        later ``new_conversation`` of the rollout holds more calls. A side request (Claude Code's
        title call) sent just before the agent's first call was the rollout's first trajectory,
        and the agent's whole episode was labelled the new conversation."""
        first: dict[str | None, Trajectory] = {}
        for t in self.trajectories:
            if t.fork_cause is None and t.rollout_id is not None:
                first.setdefault(t.rollout_id, t)
        for t in self.trajectories:
            root = first.get(t.rollout_id)
            if root is not None and t.fork_cause == "new_conversation" and len(t.call_ids) > len(root.call_ids):
                root.fork_cause, t.fork_cause = "new_conversation", None
                first[t.rollout_id] = t

    # --- main entry ---------------------------------------------------------------------
    def add(self, call: Call) -> Trajectory | None:
        """Extend an open trajectory of the call's rollout with ``call``, or fork a new one.

        Returns None (and counts the call as unresolved) when a compact prompt cannot be
        resolved.
        """
        self._clock += 1
        key = call.rollout_id
        pool = self.open.get(_pool_key(call), [])
        if call.prefix_ref is not None:
            where = self._where.get(call.prefix_ref)
            if where is not None:
                t, buf, _, end = where
                if (t.last_call_id == call.prefix_ref and buf is t.buf and end == t.match_len
                        and call.prefix_len == end and t in pool and _same_sampler(t, call)):
                    self.stats.compact_fast_path += 1  # O(new tokens): nothing to compare
                    return self._extend(t, call, call.prompt)
            full = self._full_prompt(call)
            if full is None:
                self.stats.unresolved += 1
                return None
            call.prompt, call.prefix_ref, call.prefix_len = full, None, None
        # 1. extension: the longest open trajectory whose prompt space the prompt starts with
        best: Trajectory | None = None
        for t in pool:
            if (best is None or t.match_len > best.match_len) and self._extends(t, call.prompt):
                best = t
        if best is None and key is None:
            # a conversation without a rollout id whose calls name their session only in part (parts
            # written before the column, a request without the header) goes on across the pools: a
            # call that names one from the pool of calls that name none, and the other way round - never
            # from another session's (its fork would join that session's rollout: a review)
            named = call.session_id is not None
            for pool_key, other in (((None, self.open.get(None, [])),) if named else self.open.items()):
                if isinstance(pool_key, str) or (pool_key is None) != named:
                    continue  # (a named rollout's pool, or one of the call's own kind)
                for t in other:
                    if (best is None or t.match_len > best.match_len) and self._extends(t, call.prompt):
                        best = t
        if best is not None:
            if _same_sampler(best, call):
                return self._extend(best, call, call.prompt[best.match_len:])
            return self._start(call, best.rollout_id, "sampler_change")
        if not pool:
            return self._start(call, key if key is not None else self._anonymous_rollout(call), None)
        # 2. fork: classify against the open trajectory sharing the longest prefix
        parent, d = None, -1
        prompt = call.prompt
        for t in pool:
            # a rewrite nothing went on from yet (a side request) loses a tie to the conversation it
            # rewrote: after Claude Code's summary call, the compacted prompt parts from both at once
            tie_wins = parent is not None and parent.moved_on_from is t
            # O(1) first: only a trajectory that agrees at the best divergence so far can beat it
            if not tie_wins and 0 <= d < min(len(prompt), t.match_len) and prompt[d] != t.buf[d]:
                continue
            dt = common_prefix(prompt, t.match())
            if dt > d or (dt == d and tie_wins):
                parent, d = t, dt
        assert parent is not None
        cause, resume = self._classify(parent, call.prompt, d)
        if cause not in ("branch", "retokenization"):
            sibling = self._retokenized_sibling(pool, parent, prompt)
            if sibling is not None:
                parent, resume = sibling
                cause = "retokenization"
        from_the_start = cause == "branch" and self._opens_conversation(parent.rollout_id, call.prompt)
        if from_the_start and key is None:  # anonymous: the same first request again is another session
            return self._start(call, self._anonymous_rollout(call), None)  # (a GRPO group sent without ids)
        if from_the_start and key in self._went_on:  # the rollout had gone on (in any of its trajectories)
            self.stats.restarts[key] += 1  # a parallel sample of the first prompt looks so too: a note only
        if cause == "retokenization" and self.realign and _same_sampler(parent, call):
            assert resume is not None
            parent.realigned = True
            self.stats.realigned_calls += 1
            glue = call.prompt[resume:]
            parent.reset_prompt_space(call.prompt[:resume])  # prompt space follows the prompt
            return self._extend(parent, call, glue)
        if key is None and cause == "new_conversation":  # anonymous: a new conversation = new rollout
            return self._start(call, self._anonymous_rollout(call), None)
        if not from_the_start:
            self._went_on.add(key)  # the rollout went past its first prompt (a restart can be told)
        child = self._start(call, parent.rollout_id, cause)
        if cause in _REWRITES:
            self._gone_on_from(parent)  # a rewrite of a rewrite: the first one was gone on from
            child.moved_on_from, child.forked_at = parent, self._clock  # closed once a call goes on from it
        return child


def calls_from_table(table: pa.Table, rows: np.ndarray | None = None) -> list[Call]:
    """``Call`` objects for the given row indices of a call-log table (compact or resolved).

    Ids are numpy views into the table's flat buffers: no per-token Python objects.
    """
    from ..calllog import _list_values

    p_vals, p_offs, _ = _list_values(table.column("prompt_token_ids"))
    c_vals, c_offs, _ = _list_values(table.column("completion_token_ids"))
    lp_col = table.column("completion_logprobs").combine_chunks()
    if len(lp_col):
        lp_offs = np.asarray(lp_col.offsets, dtype=np.int64)
        lp_vals = np.asarray(lp_col.values.fill_null(np.nan), dtype=np.float32)
        lp_valid = ~np.asarray(lp_col.is_null(), dtype=bool)
    cols = {name: table.column(name).to_pylist() for name in
            ("call_id", "rollout_id", "task_id", "model", "temperature", "token_source", "finish_reason",
             "prompt_prefix_call_id", "prompt_prefix_len")}
    sessions = (table.column("client_session_id").to_pylist() if "client_session_id" in table.column_names
                else [None] * table.num_rows)
    out = []
    for i in (range(table.num_rows) if rows is None else rows):
        i = int(i)
        completion = c_vals[c_offs[i]:c_offs[i + 1]]
        lp = None
        if len(lp_col) and lp_valid[i] and lp_offs[i + 1] - lp_offs[i] == len(completion):
            lp = lp_vals[lp_offs[i]:lp_offs[i + 1]]
        out.append(Call(
            call_id=cols["call_id"][i], rollout_id=cols["rollout_id"][i], task_id=cols["task_id"][i],
            model=cols["model"][i], temperature=cols["temperature"][i],
            token_source=cols["token_source"][i], finish_reason=cols["finish_reason"][i],
            prompt=p_vals[p_offs[i]:p_offs[i + 1]], completion=completion,
            logprobs=lp if lp is not None else np.full(len(completion), np.nan, np.float32),
            prefix_ref=cols["prompt_prefix_call_id"][i], prefix_len=cols["prompt_prefix_len"][i],
            session_id=sessions[i]))
    return out
