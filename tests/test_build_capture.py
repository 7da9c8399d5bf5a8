"""The builder on a real capture: an OpenAI SDK agent loop → real mitmdump + our addon →
``polar-train serve`` (tiny model, sampling) → ``polar-train build``.

Why this test besides the hand-built logs: here nobody but the server chose the token ids. The
tiny model samples random tokens; the client sends the *text* back, so the next prompt is the
chat template's re-tokenisation of it, and BPE drift happens for real. Checked: every sampled
token in a trajectory carries the logprob the client itself received from the server, forks are
explained by the independent prefix check, and ``--realign`` merges the drifted ones.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

from polar_train.trajectories import BuildOptions, build_trajectories
from tests.support.harness import call_rows, capture_proxy

pytestmark = pytest.mark.timeout(300)

TURNS = 4
ROLLOUTS = ("cap-r1", "cap-r2")


@pytest.fixture(scope="module")
def capture(polar_base_url: str, tiny_model_dir: Path, tmp_path_factory) -> tuple[Path, dict]:
    """Two rollouts of TURNS calls each; returns (capture folder, client-side logprobs per call)."""
    work = tmp_path_factory.mktemp("build-capture")
    seen: dict[str, list[list[float]]] = {}
    with capture_proxy(work, tiny_model_dir) as px:
        for r, rollout in enumerate(ROLLOUTS):
            http = httpx.Client(proxy=f"http://{rollout}:secret@127.0.0.1:{px.port}", timeout=60)
            client = OpenAI(base_url=f"{polar_base_url}/v1", api_key="sk-test", http_client=http)
            messages = [{"role": "system", "content": "You are a coding agent."},
                        {"role": "user", "content": "Fix the failing test."}]
            seen[rollout] = []
            for k in range(TURNS):
                resp = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=6, temperature=1.0, logprobs=True,
                    seed=100 * r + k)
                choice = resp.choices[0]
                seen[rollout].append([c.logprob for c in choice.logprobs.content])
                messages.append({"role": "assistant", "content": choice.message.content})
                messages.append({"role": "user", "content": f"Test output {k}: 1 failed."})
            http.close()
    return px.out, seen


def test_real_capture_builds_with_exact_logprobs_and_explained_forks(capture):
    out, seen = capture
    rows = call_rows(out)
    assert len(rows) == TURNS * len(ROLLOUTS) and {r["token_source"] for r in rows} == {"server"}
    plain = build_trajectories(out)
    realigned = build_trajectories(out, BuildOptions(realign=True))
    for result in (plain, realigned):
        assert result.report.calls_used == len(rows) and result.report.skipped == {}
        by_call = {r["call_id"]: r for r in rows}
        for t in result.trajectories:
            first = by_call[t.call_ids[0]]
            assert t.prompt.tolist() == first["prompt_token_ids"]
            ids, mask, lps = t.completion_arrays()
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
            runs = list(zip(edges[::2], edges[1::2]))
            assert len(runs) == len(t.call_ids)
            for (a, b), cid in zip(runs, t.call_ids):
                row = by_call[cid]
                k = [r["call_id"] for r in rows if r["rollout_id"] == row["rollout_id"]].index(cid)
                assert ids[a:b].tolist() == row["completion_token_ids"]
                # the logprobs the client got from the server, token for token
                np.testing.assert_array_equal(lps[a:b], np.asarray(seen[row["rollout_id"]][k], np.float32))
            assert np.isnan(lps[mask == 0]).all()
    # forks are exactly the calls whose prompt does not extend the previous call's tokens
    expected_forks = 0
    for rollout in ROLLOUTS:
        mine = [r for r in rows if r["rollout_id"] == rollout]
        for prev, nxt in zip(mine, mine[1:]):
            before = prev["prompt_token_ids"] + prev["completion_token_ids"]
            expected_forks += nxt["prompt_token_ids"][: len(before)] != before
    assert len(plain.trajectories) == len(ROLLOUTS) + expected_forks
    assert sum(plain.report.forks.values()) == expected_forks
    # random text: the only possible rewrites are BPE drift (same bytes) or broken UTF-8 at a cut
    assert set(plain.report.forks) <= {"retokenization", "history_rewrite"}
    assert len(realigned.trajectories) == len(ROLLOUTS) + plain.report.forks.get("history_rewrite", 0)
    assert realigned.report.realigned_calls == plain.report.forks.get("retokenization", 0)
    print(f"\nreal capture: forks {plain.report.forks}, realigned {realigned.report.realigned_calls}")
