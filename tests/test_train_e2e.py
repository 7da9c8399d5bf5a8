"""Capture -> build -> train: trajectories captured through the proxy train with exact logprobs.

An OpenAI SDK agent loop talks to ``polar-train serve`` or real vLLM (tiny model, sampling at
temperature 1, float32) through real mitmdump + our addon; ``polar-train build`` stitches the call log into
trajectories with rewards and task groups; ``polar-train train`` trains on them. The trainer's
logprobs of the sampled tokens must equal what the server sampled with (< 1e-3): token exactness
end to end, through capture, stitching (tool/template tokens masked) and training.
"""

from __future__ import annotations

import argparse
import json

import httpx
import pyarrow.parquet as pq
import pytest
from openai import OpenAI

from tests.support.harness import capture_proxy

pytestmark = pytest.mark.timeout(600)

TASKS = ("fix-add", "fix-sub")
PER_TASK = 4


@pytest.fixture(params=["polar", "vllm"])
def upstream(request) -> str:
    """Our CPU server, and the real vLLM (float32, raw logprobs: its default)."""
    return request.getfixturevalue("vllm_base_url" if request.param == "vllm" else "polar_base_url")


def test_trajectories_captured_through_the_proxy_train_exactly(upstream, tiny_model_dir, tmp_path):
    from polar_train.train.cli import train
    from polar_train.trajectories import BuildOptions, build_trajectories
    from polar_train.trajectories.writer import write_trajectories

    rewards = []
    with capture_proxy(tmp_path, tiny_model_dir) as px:
        for t, task in enumerate(TASKS):
            for k in range(PER_TASK):
                rollout = f"{task}-{k}"
                http = httpx.Client(proxy=f"http://{rollout}:secret@127.0.0.1:{px.port}", timeout=120)
                client = OpenAI(base_url=f"{upstream}/v1", api_key="sk-test", http_client=http)
                messages = [{"role": "system", "content": "You are a coding agent."},
                            {"role": "user", "content": f"Task {task}: make the test pass."}]
                for turn in range(2):
                    resp = client.chat.completions.create(
                        model="tiny", messages=messages, max_tokens=5, temperature=1.0, logprobs=True,
                        seed=1000 * t + 10 * k + turn)
                    messages.append({"role": "assistant", "content": resp.choices[0].message.content})
                    messages.append({"role": "user", "content": f"Test output {turn}: 1 failed."})
                http.close()
                rewards.append({"rollout_id": rollout, "task_id": task, "reward": float(k % 3)})
    reward_file = tmp_path / "rewards.jsonl"
    reward_file.write_text("".join(json.dumps(r) + "\n" for r in rewards))

    built = build_trajectories(px.out, BuildOptions(rewards=str(reward_file), realign=True))
    assert built.trajectories, built.report.table()
    print("\n" + built.report.table())
    traj_dir = tmp_path / "trajectories"
    write_trajectories(built.trajectories, traj_dir)
    table = pq.read_table(traj_dir).to_pydict()
    assert set(table["group_id"]) <= set(TASKS) and all(r is not None for r in table["reward"])

    out = tmp_path / "run"
    args = argparse.Namespace(data=str(traj_dir), model=str(tiny_model_dir), output=str(out), config=None,
                              sets=["learning_rate=5e-3", "max_steps=2", "save_strategy=no"], resume=False)
    summary = train(args)
    assert summary["steps"] == 2
    assert summary["logprob_mismatch_first_step"] is not None
    assert summary["logprob_mismatch_first_step"] < 1e-3
    assert summary["adapter_max_abs_change"] > 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    print(f"\ncapture->build->train: {len(built.trajectories)} trajectories, "
          f"mismatch first step {summary['logprob_mismatch_first_step']:.2e}, data {summary['data']}")
