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

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..schema import COMPACT_TEXT_COLUMNS
from ..text_delta import text_delta



def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences (vectorised: sessions are long)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def _id_array(ids: Any) -> np.ndarray:
    """``ids`` (a list, or an array where the row worker read them so) as int64 numbers: kept per
    rollout, a long session's context takes 8 bytes an id instead of a Python int's ~36, and is
    compared without converting it again. An id past int64 raises (the row is stored in full)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False)
    return np.asarray(ids if ids is not None else [], dtype=np.int64)


@dataclass
class _Last:
    call_id: str
    context: np.ndarray  # the call's full prompt + its completion


class PromptDeltaEncoder:
    """Rewrites rows in place: remembers the last stored call of each rollout (bounded LRU).

    A row's prompt is made compact only when it shares at least ``min_prefix`` tokens with the
    previous ``ok`` call of its rollout, and that call's row was stored before it (so a reader
    finds it). Rows without a rollout id, without ids, or not ``ok`` keep their prompt. A row's
    request (or response) text is made compact when at least ``min_shared_chars`` of its
    characters are copies of the previous request (response) of its rollout, whatever either
    call's status.
    """

    def __init__(self, min_prefix: int = 64, max_rollouts: int = 4096, min_shared_chars: int = 256) -> None:
        self.min_prefix = min_prefix
        self.max_rollouts = max_rollouts
        self.min_shared_chars = min_shared_chars
        self._last: OrderedDict[str, _Last] = OrderedDict()
        #: per text column: rollout -> (call id, text)
        self._last_text: dict[str, OrderedDict[str, tuple[str, str]]] = {
            c: OrderedDict() for c in COMPACT_TEXT_COLUMNS}

    def encode(self, row: dict[str, Any]) -> dict[str, Any]:
        rollout = row.get("rollout_id")
        if rollout:
            self._encode_prompt(rollout, row)
            for column in COMPACT_TEXT_COLUMNS:
                self._encode_text(rollout, row, column)
        return row

    def _encode_prompt(self, rollout: str, row: dict[str, Any]) -> None:
        prompt = row.get("prompt_token_ids")
        if prompt is None or row.get("status") != "ok":
            return
        full_prompt = _id_array(prompt)
        context = np.concatenate([full_prompt, _id_array(row.get("completion_token_ids"))])
        last = self._last.get(rollout)
        if last is not None:
            n = common_prefix_len(last.context, full_prompt)
            if n >= self.min_prefix:
                row["prompt_token_ids"] = prompt[n:]  # the suffix, a list or an array as it came
                row["prompt_prefix_call_id"] = last.call_id
                row["prompt_prefix_len"] = n
        self._remember(self._last, rollout, _Last(row["call_id"], context))

    def _encode_text(self, rollout: str, row: dict[str, Any], column: str) -> None:
        text = row.get(column)
        if not isinstance(text, str):
            return
        last = self._last_text[column].get(rollout)
        if last is not None:
            plan, literals, copied = text_delta(last[1], text)
            if copied >= self.min_shared_chars:
                row[column] = literals
                row[f"{column}_base_call_id"] = last[0]
                row[f"{column}_delta"] = plan
        self._remember(self._last_text[column], rollout, (row["call_id"], text))

    def _remember(self, last: OrderedDict, rollout: str, value: Any) -> None:
        last[rollout] = value
        last.move_to_end(rollout)
        while len(last) > self.max_rollouts:
            last.popitem(last=False)

    def state(self) -> tuple[OrderedDict[str, _Last], dict[str, OrderedDict[str, tuple[str, str]]]]:
        """What :meth:`restore` returns to (the writer's part may yet fail to be written)."""
        return OrderedDict(self._last), {c: OrderedDict(last) for c, last in self._last_text.items()}

    def restore(self, state: tuple[OrderedDict[str, _Last], dict[str, OrderedDict[str, tuple[str, str]]]]) -> None:
        """Back to ``state``: the rows encoded since were not stored, so nothing may refer to them."""
        self._last = OrderedDict(state[0])
        self._last_text = {c: OrderedDict(last) for c, last in state[1].items()}
