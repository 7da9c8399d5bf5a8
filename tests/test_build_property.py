"""Property test of the stitcher on random agent conversations (hypothesis).

Why: the hand-written cases pin each fork cause; this checks the invariants on any mix of tool
turns, new user messages (which drop earlier reasoning) and BPE drift, against an independent
oracle computed from the rows themselves: a trajectory per non-extending transition, exact
streams, aligned logprobs, compact storage giving the same result, ``--realign`` merging
exactly the pure-drift transitions.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_train.trajectories import BuildOptions, build_trajectories
from tests.support.calls import Conversation, compact, encode, write_parts
from tests.test_build_stitch import assert_aligned

HELLO, HEL, LO = 9419, 31628, 379

turn = st.tuples(st.sampled_from(["tool", "user"]), st.booleans(), st.booleans())  # (next, reasoning, drift)


def extends(prev: dict, nxt: dict, completion: list[int] | None = None) -> bool:
    before = prev["prompt_token_ids"] + (completion if completion is not None else prev["completion_token_ids"])
    return nxt["prompt_token_ids"][: len(before)] == before


def make_session(turns) -> tuple[list[dict], list[list[int]]]:
    """Rows of one conversation and each call's canonical (undrifted) completion ids."""
    conv = Conversation(rollout_id="prop")
    conv.user("start")
    rows, canonical = [], []
    for k, (nxt, reasoning, drift) in enumerate(turns):
        content = f"Hello step {k}"
        msg = conv.assistant_message(content, f"think {k}" if reasoning else None,
                                     [("ls", {"k": k})] if nxt == "tool" else None)
        ids = encode(conv.tok, conv.completion_text(msg))
        canonical.append(ids)
        sampled = ids
        if drift and HELLO in ids:
            i = ids.index(HELLO)
            sampled = ids[:i] + [HEL, LO] + ids[i + 1:]
        rows.append(conv.assistant(content, reasoning=msg.get("reasoning_content"),
                                   tool_calls=[("ls", {"k": k})] if nxt == "tool" else None,
                                   completion_ids=sampled))
        if nxt == "tool":
            conv.tool(f"out {k}", tool_call_id="call_0")
        else:
            conv.user(f"next {k}")
    return rows, canonical


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(turn, min_size=1, max_size=6))
def test_random_conversations_keep_every_invariant(turns):
    rows, canonical = make_session(turns)
    breaks = [not extends(a, b) for a, b in zip(rows, rows[1:])]
    # pure drift: the transition would extend had the model sampled the canonical ids
    drift_only = [brk and extends(a, b, canonical[k]) for k, (brk, a, b) in
                  enumerate(zip(breaks, rows, rows[1:]))]
    with tempfile.TemporaryDirectory() as tmp:
        write_parts(Path(tmp) / "full", rows)
        write_parts(Path(tmp) / "compact", compact(rows))
        plain = build_trajectories(Path(tmp) / "full")
        packed = build_trajectories(Path(tmp) / "compact")
        merged = build_trajectories(Path(tmp) / "full", BuildOptions(realign=True))

    assert plain.report.calls_used == len(rows)
    assert len(plain.trajectories) == 1 + sum(breaks)
    assert plain.report.forks.get("retokenization", 0) == sum(drift_only)
    by_id = {r["call_id"]: r for r in rows}
    for t in plain.trajectories:
        mine = [by_id[c] for c in t.call_ids]
        assert_aligned(t, mine)
        ids, _, _ = t.completion_arrays()
        assert t.prompt.tolist() + ids.tolist() == mine[-1]["prompt_token_ids"] + mine[-1]["completion_token_ids"]
    assert [t.call_ids for t in packed.trajectories] == [t.call_ids for t in plain.trajectories]
    for a, b in zip(plain.trajectories, packed.trajectories):
        for x, y in zip(a.completion_arrays(), b.completion_arrays()):
            np.testing.assert_array_equal(x, y)
    assert len(merged.trajectories) == 1 + sum(breaks) - sum(drift_only)
    assert merged.report.realigned_calls == sum(drift_only)
    for t in merged.trajectories:
        assert_aligned(t, [by_id[c] for c in t.call_ids])
