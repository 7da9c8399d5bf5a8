"""Several proxies, one capture folder: how capture grows past the one core that a mitmdump's event
loop runs on (docs/capture.md, "More rollouts than one proxy's core carries").

Real mitmdumps with the addon, the real CPU server, the OpenAI SDK as the client. What a user
relies on: every call through any proxy is read back once, each proxy's parts are its own (named
by its process, never overwritten), compact prompts resolve, and the builder sees every rollout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from openai import OpenAI

from polar_train.calllog import list_parts, read_call_log
from polar_train.trajectories import build_trajectories
from tests.support.mitm import start_mitm

pytestmark = pytest.mark.timeout(300)

TURNS = 3
_PART_PID = re.compile(r"part-[0-9TZ]+-(\d+)-\d+\.parquet")


def test_two_proxies_share_one_capture_folder(polar_base_url: str, tmp_path: Path) -> None:
    out = tmp_path / "captures"
    # prompts stored as deltas, and a part every two rows: chains and parts of both proxies interleave
    opts = {"polar_prompt_delta": True, "polar_flush_rows": 2}
    proxies = [start_mitm(tmp_path / f"proxy{i}", modes=[f"reverse:{polar_base_url}"], out_dir=out, options=opts)
               for i in range(2)]
    rollouts: list[str] = []
    try:
        for i, proxy in enumerate(proxies):
            for j in range(2):
                rollout = f"scale-p{i}-r{j}"
                rollouts.append(rollout)
                client = OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test",
                                default_headers={"x-polar-rollout": rollout})
                # a system prompt longer than the 64 tokens a prompt must share to be stored as a delta
                messages = [{"role": "system", "content": "You are a coding agent. Run the tests first. " * 12},
                            {"role": "user", "content": "Fix the failing test."}]
                for k in range(TURNS):
                    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                          temperature=1.0, seed=10 * i + j + 100 * k)
                    messages.append({"role": "assistant", "content": resp.choices[0].message.content})
                    messages.append({"role": "user", "content": f"Test output {k}: 1 failed."})
    finally:
        codes = [proxy.stop() for proxy in proxies]
    assert all(code in (0, None, -15) for code in codes), codes

    pids = {_PART_PID.fullmatch(p.name)[1] for p in list_parts(out)}
    assert len(pids) == 2  # each proxy's row worker wrote parts of its own (the name holds its process id)

    log = read_call_log(out)
    assert not log.problems
    rows = log.table.to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == sorted(r for r in rollouts for _ in range(TURNS))
    assert {(r["status"], r["token_source"]) for r in rows} == {("ok", "server")}
    for r in rows:  # full prompts again, whichever proxy's parts hold their earlier calls
        assert len(r["prompt_token_ids"]) == r["usage_prompt_tokens"]
    stored = read_call_log(out, resolve_prompts=False).table
    assert stored.column("prompt_prefix_call_id").null_count < len(rows)  # some were stored as deltas
    assert stored.column("request_json_base_call_id").null_count < len(rows)  # request texts too
    for rollout in rollouts:  # each request text whole again: the conversation as the client sent it
        calls = sorted((r for r in rows if r["rollout_id"] == rollout), key=lambda r: r["started_at"])
        sent = [json.loads(r["request_json"])["messages"] for r in calls]
        assert [len(m) for m in sent] == [2, 4, 6]
        assert [m[-1]["content"] for m in sent[1:]] == ["Test output 0: 1 failed.", "Test output 1: 1 failed."]

    result = build_trajectories(out)
    assert result.report.calls_used == len(rows)
    assert {t.rollout_id for t in result.trajectories} == set(rollouts)
