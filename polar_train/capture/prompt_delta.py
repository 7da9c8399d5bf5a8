"""Compact prompt storage: a call's prompt as "the first n tokens of the previous call of its rollout
(prompt + completion), then this suffix".

Why: an agent's call k+1 resends everything of call k plus the new tool output, so full prompts
grow quadratically with the turns of a session (a 50-turn session stores each early token ~50
times). The call-log schema has the two columns for it (``prompt_prefix_call_id``,
``prompt_prefix_len``) and :func:`polar_train.calllog.read_calls` expands them, so every reader
still sees full ids. This module only decides what to store; it runs on the writer's thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .id_arrays import as_list


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences (vectorised: sessions are long)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


@dataclass
class _Last:
    call_id: str
    context: list[int]  # the call's full prompt + its completion


class PromptDeltaEncoder:
    """Rewrites rows in place: remembers the last stored call of each rollout (bounded LRU).

    A row is made compact only when it shares at least ``min_prefix`` tokens with the previous
    call of its rollout, and that call's row was stored before it (so a reader finds it). Rows
    without a rollout id, without ids, or not ``ok`` are stored as they are.
    """

    def __init__(self, min_prefix: int = 64, max_rollouts: int = 4096) -> None:
        self.min_prefix = min_prefix
        self.max_rollouts = max_rollouts
        self._last: OrderedDict[str, _Last] = OrderedDict()

    def encode(self, row: dict[str, Any]) -> dict[str, Any]:
        rollout, prompt = row.get("rollout_id"), row.get("prompt_token_ids")
        if not rollout or prompt is None or row.get("status") != "ok":
            return row
        # lists, also where the row worker read the ids as arrays
        full_prompt = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
        completion = as_list(row.get("completion_token_ids")) or []
        last = self._last.get(rollout)
        if last is not None:
            n = common_prefix_len(last.context, full_prompt)
            if n >= self.min_prefix:
                row["prompt_token_ids"] = full_prompt[n:]
                row["prompt_prefix_call_id"] = last.call_id
                row["prompt_prefix_len"] = n
        self._last[rollout] = _Last(row["call_id"], full_prompt + list(completion))
        self._last.move_to_end(rollout)
        while len(self._last) > self.max_rollouts:
            self._last.popitem(last=False)
        return row

    def state(self) -> OrderedDict[str, _Last]:
        """What :meth:`restore` returns to (the writer's part may yet fail to be written)."""
        return OrderedDict(self._last)

    def restore(self, state: OrderedDict[str, _Last]) -> None:
        """Back to ``state``: the rows encoded since were not stored, so nothing may refer to them."""
        self._last = OrderedDict(state)
