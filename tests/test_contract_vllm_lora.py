"""Contract: an adapter ``polar-train train`` writes is served by vLLM as ``polar-train serve``
serves it (README step 5, round 2 onwards: ``vllm serve --enable-lora --lora-modules r1=ADAPTER``).

Round 2's trajectories are sampled from the adapter, and the trainer's old logprobs are the
sampler's: if vLLM loaded the adapter otherwise (another module naming, a scale, a module left
out), round 2 would train against logprobs of another policy. Greedy tokens and their logprobs
from both servers must agree, and differ from the base model's (the adapter is applied).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import VLLM_FLAGS
from tests.support.procs import polar_server, vllm_available, vllm_server

pytestmark = pytest.mark.vllm

ASK = {"messages": [{"role": "user", "content": "Hello there, fix the failing test"}], "max_tokens": 8,
       "temperature": 0, "logprobs": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA trained two steps by ``polar-train train`` (a learning rate that moves it visibly)."""
    from polar_train.train import cli as train_cli
    from polar_train.train.sampling import sample_trajectories

    work = tmp_path_factory.mktemp("lora")
    sample_trajectories(tiny_model_dir, work / "traj", num_tasks=2, group_size=4, turn_tokens=(5, 3), seed=3)
    args = argparse.Namespace(data=str(work / "traj"), model=str(tiny_model_dir), output=str(work / "run"),
                              config=None, resume=False,
                              sets=["report_to=none", "max_steps=2", "learning_rate=5e-2", "save_strategy=no"])
    assert train_cli.run(args) == 0
    return work / "run" / "adapter"


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, adapter: Path, logs_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    if not vllm_available():
        pytest.fail(".venv-vllm is missing: run scripts/install-vllm-cpu (make test does)")
    lora = ["--enable-lora", "--lora-modules", f"r1={adapter}", "--max-lora-rank", "16", *VLLM_FLAGS]
    with vllm_server(tiny_model_dir, logs_dir, tmp_path_factory.mktemp("vllm-lora-cache"), lora) as vllm, \
            polar_server(tiny_model_dir, logs_dir, ["--adapter", str(adapter), "--served-model-name", "r1"]) as ours:
        yield vllm, ours


def greedy(base: str, model: str) -> tuple[list[int], list[float]]:
    r = httpx.post(base + "/v1/chat/completions", json={"model": model, **ASK}, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def test_vllm_serves_a_trained_adapter_as_serve_does(servers) -> None:
    vllm, ours = servers
    listed = {m["id"]: m.get("parent") for m in httpx.get(vllm + "/v1/models", timeout=30).json()["data"]}
    assert listed == {"tiny": None, "r1": "tiny"}
    vllm_ids, vllm_lps = greedy(vllm, "r1")
    our_ids, our_lps = greedy(ours, "r1")
    assert vllm_ids == our_ids
    assert max(abs(a - b) for a, b in zip(vllm_lps, our_lps)) < 1e-4
    base_ids, base_lps = greedy(vllm, "tiny")
    assert (base_ids, base_lps) != (vllm_ids, vllm_lps)  # the adapter is applied, not passed over
