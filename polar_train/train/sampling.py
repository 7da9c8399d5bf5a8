"""Trajectories made by sampling a model with transformers, written in ``TRAJECTORY_SCHEMA``.

Why: tests and the benchmark need trajectories whose sampler logprobs are known exactly (same
weights, float32), with tool/template tokens in between, without the capture stack. Each
trajectory is: prompt (chat template, never trained) -> sampled turn (mask 1) -> a tool result
and the next assistant header (mask 0, logprob NaN) -> a second sampled turn (mask 1).
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..schema import TRAJECTORY_SCHEMA

#: reward(completion_ids, loss_mask) -> float
RewardFn = Callable[[list[int], list[int]], float]


def low_id_share(completion_ids: list[int], loss_mask: list[int]) -> float:
    """Share of sampled tokens with an id below 100 000 (varies among samples of a random model)."""
    sampled = [t for t, m in zip(completion_ids, loss_mask) if m]
    return sum(t < 100_000 for t in sampled) / max(1, len(sampled))


def _sample_turn(model, ids: list[int], n: int, temperature: float, raw_logprobs: bool, gen):
    """Sample ``n`` tokens after ``ids``; returns (tokens, logprobs) with exact float32 scoring.

    Gumbel-max sampling (argmax of logits/T + Gumbel noise) is exact and, over a 248k vocabulary,
    much cheaper on CPU than ``torch.multinomial``; only the last position's logits are computed.
    """
    import torch

    tokens: list[int] = []
    logps: list[float] = []
    past = None
    inp = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            out = model(input_ids=inp, cache=past, use_cache=True, logits_to_keep=1)
            past = out.cache
            logits = out.logits[0, -1].float()
            scaled = torch.log_softmax(logits / temperature, dim=-1)
            u = torch.rand(scaled.shape, generator=gen).clamp_(min=1e-20)
            tok = int(torch.argmax(scaled - torch.log(-torch.log(u))))
            lp = torch.log_softmax(logits, dim=-1)[tok] if raw_logprobs else scaled[tok]
            tokens.append(tok)
            logps.append(float(lp))
            inp = torch.tensor([[tok]])
    return tokens, logps


def sample_trajectories(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    num_tasks: int = 2,
    group_size: int = 4,
    turn_tokens: Sequence[int] = (6, 4),
    temperature: float = 1.0,
    raw_logprobs: bool = False,
    reward_fn: RewardFn = low_id_share,
    seed: int = 0,
    part_name: str = "part-0.parquet",
) -> Path:
    """Sample ``num_tasks`` groups of ``group_size`` trajectories into ``out_dir/part_name``.

    ``raw_logprobs=True`` records log-softmax of the unscaled logits (what vLLM reports by
    default); otherwise the logprob under the distribution actually sampled from (``logits/T``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    # one-token decode steps are too small to share between threads; on a busy machine the
    # threads' synchronisation made sampling ~10x slower
    torch.set_num_threads(1)
    try:
        return _sample_all(model, tok, gen, Path(out_dir), num_tasks, group_size, turn_tokens,
                           temperature, raw_logprobs, reward_fn, part_name)
    finally:
        torch.set_num_threads(threads)


def _sample_all(model, tok, gen, out: Path, num_tasks, group_size, turn_tokens, temperature,
                raw_logprobs, reward_fn, part_name) -> Path:
    rows: dict[str, list] = {f.name: [] for f in TRAJECTORY_SCHEMA}
    for task in range(num_tasks):
        messages = [{"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": f"Task {task}: list the files."}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        for _ in range(group_size):
            completion: list[int] = []
            mask: list[int] = []
            logps: list[float] = []
            for turn, n in enumerate(turn_tokens):
                if turn:
                    between = ("<|im_end|>\n<|im_start|>user\n<tool_response>\nREADME.md\n"
                               "</tool_response><|im_end|>\n<|im_start|>assistant\n")
                    glue = tok.encode(between, add_special_tokens=False)
                    completion += glue
                    mask += [0] * len(glue)
                    logps += [math.nan] * len(glue)
                sampled, lps = _sample_turn(model, prompt_ids + completion, n, temperature,
                                            raw_logprobs, gen)
                completion += sampled
                mask += [1] * len(sampled)
                logps += lps
            rows["trajectory_id"].append(uuid.uuid4().hex)
            rows["rollout_id"].append(uuid.uuid4().hex)
            rows["group_id"].append(f"task-{task}")
            rows["task_id"].append(f"task-{task}")
            rows["prompt_ids"].append(prompt_ids)
            rows["completion_ids"].append(completion)
            rows["loss_mask"].append(mask)
            rows["logprobs"].append(logps)
            rows["reward"].append(float(reward_fn(completion, mask)))
            rows["num_calls"].append(len(turn_tokens))
            rows["call_ids"].append([uuid.uuid4().hex for _ in turn_tokens])
            rows["token_source"].append("server")
            rows["truncated"].append(False)
            rows["realigned"].append(False)
            rows["fork_cause"].append(None)
            rows["model"].append("tiny")
            rows["temperature"].append(temperature)
    out.mkdir(parents=True, exist_ok=True)
    path = out / part_name
    pq.write_table(pa.Table.from_pydict(rows, schema=TRAJECTORY_SCHEMA), path, write_page_checksum=True)
    return path
