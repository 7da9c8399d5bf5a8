"""Compact storage of a rollout's calls: a call's prompt as "the first n tokens of the previous call
of its rollout (prompt + completion), then this suffix", and its request and response texts as
copies of blocks of the previous call's, the new text between (:mod:`polar_train.text_delta`).

Why: an agent's call k+1 resends everything of call k plus the new tool output, so full prompts
grow quadratically with the turns of a session (a 50-turn session stores each early token ~50
times), and so does the request's JSON (the same conversation as text, the tool definitions after
it); a Responses reply echoes the instructions and tools every call. The call-log schema has the
columns for it (``prompt_prefix_call_id``, ``prompt_prefix_len``; ``request_json_base_call_id``,
``request_json_delta``, the same two for ``response_json``) and
:func:`polar_train.calllog.read_calls` expands them, so every reader still sees full ids and
texts. This module only decides what to store; it runs on the writer's thread.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..schema import COMPACT_TEXT_COLUMNS, delta_columns
from ..text_delta import equal_run, text_delta


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences (vectorised: sessions are long)."""
    n = min(len(a), len(b))
    return equal_run(np.asarray(a[:n], dtype=np.int64), np.asarray(b[:n], dtype=np.int64))


def _id_array(ids: Any) -> np.ndarray:
    """``ids`` (a list, or an array where the row worker read them so) as int64 numbers: kept per
    rollout, a long session's context takes 8 bytes an id instead of a Python int's ~36, and is
    compared without converting it again. An id past int64 raises (the row is stored in full)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False)
    return np.asarray(ids if ids is not None else [], dtype=np.int64)


#: Every this many rows of a rollout, one is stored in full: a compact row is read through the rows
#: before it, so a part lost or damaged costs the rollout's calls up to its next full row, not all
#: its later calls (at most ~1/32 more bytes for a long session).
FULL_EVERY = 32

#: A text longer than this is stored whole and not remembered: finding a delta of two 200 MB
#: bodies (below ``polar_max_body_mb``) would take gigabytes and minutes on the writer's thread.
MAX_DELTA_CHARS = 16 << 20


@dataclass
class _Last:
    call_id: str
    context: np.ndarray  # the call's full prompt + its completion


class _Recent:
    """The last value of each rollout; the least recently used go first past ``max_items`` or
    ``max_bytes`` (a long run's finished rollouts would otherwise keep their contexts and texts -
    megabytes each - until thousands of newer ones pushed them out). A rollout whose value was
    dropped has its next call stored in full."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, rollout: str) -> Any:
        entry = self.items.get(rollout)
        return None if entry is None else entry[0]

    def put(self, rollout: str, value: Any, nbytes: int) -> None:
        old = self.items.pop(rollout, None)
        if old is not None:
            self.nbytes -= old[1]
        self.items[rollout] = (value, nbytes)
        self.nbytes += nbytes
        while self.items and (len(self.items) > self.max_items or self.nbytes > self.max_bytes):
            self.nbytes -= self.items.popitem(last=False)[1][1]

    def copy(self) -> _Recent:
        other = _Recent(self.max_items, self.max_bytes)
        other.items, other.nbytes = OrderedDict(self.items), self.nbytes
        return other


class PromptDeltaEncoder:
    """Rewrites rows in place: remembers the last stored call of each rollout (bounded LRU: at most
    ``max_rollouts`` rollouts and ``max_mb`` of contexts and texts, half for the token ids).

    A row's prompt is made compact only when it shares at least ``min_prefix`` tokens with the
    previous ``ok`` call of its rollout, and that call's row was stored before it (so a reader
    finds it). Rows without a rollout id, without ids, or not ``ok`` keep their prompt. A row's
    request (or response) text is made compact when at least ``min_shared_chars`` of its
    characters are copies of the previous request (response) of its rollout, whatever either
    call's status.
    """

    def __init__(self, min_prefix: int = 64, max_rollouts: int = 4096, min_shared_chars: int = 256,
                 max_mb: int = 1024, full_every: int = FULL_EVERY) -> None:
        self.min_prefix = min_prefix
        self.min_shared_chars = min_shared_chars
        self.full_every = full_every
        budget = max_mb << 20
        self._last = _Recent(max_rollouts, budget // 2)
        #: per text column: rollout -> (call id, text)
        self._last_text = {c: _Recent(max_rollouts, budget // (2 * len(COMPACT_TEXT_COLUMNS)))
                           for c in COMPACT_TEXT_COLUMNS}
        #: rollout -> rows stored since its last full one
        self._since_full = _Recent(max_rollouts, max_rollouts * 64)

    def encode(self, row: dict[str, Any]) -> dict[str, Any]:
        rollout = row.get("rollout_id")
        if rollout:
            # each compact row is read through the one before: a lost part cost every later call of its
            # rollout (a probe: 0.8 % of the rows, 31 % of the calls). Every FULL_EVERY-th row of a chain
            # (prompts: the ok rows with ids; texts: every row) is stored whole instead.
            prompts, texts = self._since_full.get(rollout) or (0, 0)
            if row.get("prompt_token_ids") is not None and row.get("status") == "ok":
                whole = prompts + 1 >= self.full_every
                self._encode_prompt(rollout, row, whole)
                prompts = 0 if whole else prompts + 1
            whole = texts + 1 >= self.full_every
            for column in COMPACT_TEXT_COLUMNS:
                self._encode_text(rollout, row, column, whole)
            texts = 0 if whole else texts + 1
            self._since_full.put(rollout, (prompts, texts), 64)
        return row

    def _encode_prompt(self, rollout: str, row: dict[str, Any], whole: bool = False) -> None:
        """``row``'s prompt as a suffix of the rollout's last one (unless ``whole``), kept as what
        the rollout's next prompt refers to."""
        prompt = row.get("prompt_token_ids")
        if prompt is None or row.get("status") != "ok":
            return
        full_prompt = _id_array(prompt)
        context = np.concatenate([full_prompt, _id_array(row.get("completion_token_ids"))])
        last = None if whole else self._last.get(rollout)
        if last is not None:
            n = common_prefix_len(last.context, full_prompt)
            if n >= self.min_prefix:
                row["prompt_token_ids"] = prompt[n:]  # the suffix, a list or an array as it came
                row["prompt_prefix_call_id"] = last.call_id
                row["prompt_prefix_len"] = n
        self._last.put(rollout, _Last(row["call_id"], context), context.nbytes)

    def _encode_text(self, rollout: str, row: dict[str, Any], column: str, whole: bool = False) -> None:
        """``row``'s text in ``column`` as a delta of the rollout's last one (unless ``whole``), kept
        as what the rollout's next text refers to."""
        text = row.get(column)
        if not isinstance(text, str) or len(text) > MAX_DELTA_CHARS:
            return
        last = None if whole else self._last_text[column].get(rollout)
        if last is not None:
            plan, literals, copied = text_delta(last[1], text)
            if copied >= self.min_shared_chars:
                row[column] = literals
                base_column, delta_column = delta_columns(column)
                row[base_column], row[delta_column] = last[0], plan
        self._last_text[column].put(rollout, (row["call_id"], text), sys.getsizeof(text))

    def state(self) -> tuple[_Recent, dict[str, _Recent], _Recent]:
        """What :meth:`restore` returns to (the writer's part may yet fail to be written)."""
        return (self._last.copy(), {c: last.copy() for c, last in self._last_text.items()},
                self._since_full.copy())

    def restore(self, state: tuple[_Recent, dict[str, _Recent], _Recent]) -> None:
        """Back to ``state``: the rows encoded since were not stored, so nothing may refer to them."""
        self._last = state[0].copy()
        self._last_text = {c: last.copy() for c, last in state[1].items()}
        self._since_full = state[2].copy()
