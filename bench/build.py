"""Benchmark of ``polar-train build``: sessions of 10, 100 and 1,000 turns, per-token cost and tokens/s.

Run: ``.venv/bin/python bench/build.py [--turns 10 100 1000] [--min-input-tokens 4e6] [--compact]``

Why synthetic ids: rendering 1,000-turn conversations through the chat template would measure
the template, not the builder. Each session here has the shape of a real agent log: a system
prompt, then per turn a sampled completion ending in ``<|im_end|>`` and a tool output of glue
tokens; the prompt of call k+1 is the prompt of call k + its completion + the glue, so the
input (sum of prompt lengths) grows quadratically with the turns while the trajectory grows
linearly. The builder must be linear in the tokens it reads: the "ns/input tok" column must
not grow from 10 to 1,000 turns. With ``--compact`` the call log stores prompts compactly (prefix
reference + suffix), the way long sessions may be written. The per-token and Mtok/s columns take
build + write time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_train.schema import CALL_LOG_SCHEMA  # noqa: E402
from polar_train.trajectories import BuildOptions, build_trajectories  # noqa: E402
from polar_train.trajectories.stitch import IM_END_ID  # noqa: E402
from polar_train.trajectories.writer import write_trajectories  # noqa: E402

SYSTEM_TOKENS = 400
COMPLETION_TOKENS = 40
GLUE_TOKENS = 60
#: Peak memory per input token, measured at 10 to 1,000 turns: every call's full prompt is made in
#: memory, copied into Arrow and read back by the builder; compact storage keeps the int32 prompts
#: (its stored suffixes are views of them) and little else.
PEAK_BYTES_PER_INPUT_TOKEN = {False: 25, True: 6}
#: What one size may need: more than a laptop's free memory is a MemoryError after minutes.
MAX_PEAK_BYTES = 8e9


def _list(chunks: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum([len(c) for c in chunks], out=offsets[1:])
    flat = np.concatenate(chunks) if chunks else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def session_table(turns: int, rollouts: int, seed: int, compact: bool) -> tuple[pa.Table, int]:
    """Call-log rows of ``rollouts`` sessions of ``turns`` calls each; returns (table, input tokens)."""
    rng = np.random.default_rng(seed)
    prompts, completions, logprobs = [], [], []
    call_ids, rollout_ids, refs, ref_lens = [], [], [], []
    input_tokens = 0
    t0 = np.datetime64("2026-12-02T12:00:00", "us")
    for r in range(rollouts):
        prompt = rng.integers(0, 240_000, SYSTEM_TOKENS, dtype=np.int32)
        prev_id = None
        for k in range(turns):
            completion = rng.integers(0, 240_000, COMPLETION_TOKENS, dtype=np.int32)
            completion[-1] = IM_END_ID
            cid = f"r{r}-c{k}"
            if compact and prev_id is not None:
                stored = prompt[len(prompt) - GLUE_TOKENS:]
                refs.append(prev_id)
                ref_lens.append(len(prompt) - GLUE_TOKENS)
            else:
                stored = prompt
                refs.append(None)
                ref_lens.append(None)
            prompts.append(stored)
            completions.append(completion)
            logprobs.append(-rng.random(COMPLETION_TOKENS, dtype=np.float32))
            call_ids.append(cid)
            rollout_ids.append(f"r{r}")
            input_tokens += len(prompt) + len(completion)
            glue = rng.integers(0, 240_000, GLUE_TOKENS, dtype=np.int32)
            prompt = np.concatenate([prompt, completion, glue])
            prev_id = cid
    n = len(call_ids)
    starts = t0 + np.arange(n) * np.timedelta64(10, "ms")
    cols = {
        "call_id": pa.array(call_ids), "rollout_id": pa.array(rollout_ids),
        "api": pa.array(["openai.chat"] * n), "status": pa.array(["ok"] * n),
        "model": pa.array(["tiny"] * n), "token_source": pa.array(["server"] * n),
        "temperature": pa.array(np.ones(n, np.float32)), "finish_reason": pa.array(["stop"] * n),
        "started_at": pa.array(starts, pa.timestamp("us", tz="UTC")),
        "prompt_token_ids": _list(prompts, pa.int32()),
        "completion_token_ids": _list(completions, pa.int32()),
        "completion_logprobs": _list(logprobs, pa.float32()),
        "prompt_prefix_call_id": pa.array(refs, pa.string()),
        "prompt_prefix_len": pa.array(ref_lens, pa.int32()),
    }
    arrays = [cols.get(f.name, pa.nulls(n, f.type)) for f in CALL_LOG_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=CALL_LOG_SCHEMA), input_tokens


def input_per_session(turns: int) -> int:
    """Sum of prompt + completion lengths of one session of ``turns`` calls (closed form: a loop
    over a huge --turns would hang before the size is refused)."""
    per_turn = COMPLETION_TOKENS + GLUE_TOKENS
    return turns * (SYSTEM_TOKENS + COMPLETION_TOKENS) + per_turn * turns * (turns - 1) // 2


def sessions_for(turns: int, min_input_tokens: float) -> int:
    """Enough sessions of ``turns`` calls for ``min_input_tokens`` input tokens, at least one."""
    return max(1, math.ceil(min_input_tokens / input_per_session(turns)))


def bench_one(turns: int, rollouts: int, compact: bool, workdir: Path) -> dict:
    """Time ``build_trajectories`` (read + select + stitch + labels) and the Parquet write."""
    table, input_tokens = session_table(turns, rollouts, seed=turns, compact=compact)
    cap = workdir / f"cap-{turns}"
    (cap / "calls").mkdir(parents=True)
    pq.write_table(table, cap / "calls" / "part-00000.parquet")
    stored = len(table.column("prompt_token_ids").combine_chunks().values)
    del table
    t0 = time.perf_counter()
    result = build_trajectories(cap, BuildOptions())
    t1 = time.perf_counter()
    write_trajectories(result.trajectories, workdir / f"out-{turns}")
    t2 = time.perf_counter()
    trajs = result.trajectories
    assert len(trajs) == rollouts and all(t.fork_cause is None for t in trajs), "sessions must merge"
    return {"turns": turns, "rollouts": rollouts, "calls": result.report.calls_used, "stored": stored,
            "input": input_tokens, "output": result.report.tokens_total, "build": t1 - t0,
            "write": t2 - t1, "total": t2 - t0, "fast": result.report.compact_fast_path}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[10, 100, 1000], help="session lengths (default 10 100 1000)")
    ap.add_argument("--min-input-tokens", type=float, default=4e6,
                    help="enough sessions per size for this many input tokens (default 4e6), so "
                         "fixed costs do not hide the per-token cost")
    ap.add_argument("--compact", action="store_true", help="store prompts compactly (prefix + suffix)")
    args = ap.parse_args(argv)
    if min(args.turns) < 1:
        ap.error(f"--turns: at least 1 each, got {min(args.turns)}")
    if not 0 < args.min_input_tokens <= 1e9:  # nan and inf fail too; 1e9 tokens is hours of building
        ap.error(f"--min-input-tokens: more than 0 and at most 1e9, got {args.min_input_tokens:g}")
    args.turns = list(dict.fromkeys(args.turns))  # a size given twice is measured once
    per_token = PEAK_BYTES_PER_INPUT_TOKEN[args.compact]
    for turns in args.turns:  # each size is built whole in memory: refuse up front, not with a MemoryError
        tokens = sessions_for(turns, args.min_input_tokens) * input_per_session(turns)
        if tokens * per_token > MAX_PEAK_BYTES:
            ap.error(f"--turns {turns}: these sizes make about {tokens:.2g} input tokens; at most "
                     f"{MAX_PEAK_BYTES / per_token:.2g} fit in memory (~{per_token} bytes each at the peak, "
                     f"{MAX_PEAK_BYTES / 1e9:.0f} GB): lower --turns or --min-input-tokens")
    storage = "compact (prefix ref + suffix)" if args.compact else "full prompts"
    print(f"per turn {COMPLETION_TOKENS} sampled + {GLUE_TOKENS} tool tokens; system prompt "
          f"{SYSTEM_TOKENS}; storage {storage}; {os.cpu_count()} CPUs")
    head = (f"{'turns':>6} {'sessions':>8} {'calls':>6} {'input tok':>12} {'stored tok':>11} "
            f"{'traj tok':>10} {'build s':>7} {'write s':>7} {'ns/input tok':>12} {'ns/traj tok':>11} "
            f"{'input Mtok/s':>12} {'traj Mtok/s':>11}")
    print(head)
    print("-" * len(head))
    with tempfile.TemporaryDirectory(prefix="polar-bench-build-") as tmp:
        for turns in args.turns:
            rollouts = sessions_for(turns, args.min_input_tokens)
            r = bench_one(turns, rollouts, args.compact, Path(tmp))
            print(f"{r['turns']:>6} {r['rollouts']:>8} {r['calls']:>6} {r['input']:>12,} "
                  f"{r['stored']:>11,} {r['output']:>10,} {r['build']:>7.3f} {r['write']:>7.3f} "
                  f"{1e9 * r['total'] / r['input']:>12.2f} {1e9 * r['total'] / r['output']:>11.1f} "
                  f"{r['input'] / r['total'] / 1e6:>12.1f} {r['output'] / r['total'] / 1e6:>11.2f}")
    print("input tok = sum of prompt + completion lengths of all calls; stored tok = prompt ids on "
          "disk; traj tok = prompt + completion ids of the trajectories written; ns/... tok and "
          "Mtok/s take build s + write s (build s alone leaves the Parquet write out).")
    return 0


if __name__ == "__main__":
    from polar_train.cli import run_script

    sys.exit(run_script(main))
