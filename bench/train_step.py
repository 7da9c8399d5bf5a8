"""Benchmark: where a `polar-train train` step spends its time.

Samples trajectories from a tiny model (or --model), trains a few GRPO steps on them with the real
trainer, and splits each optimizer step into the model's forward passes (the no-grad scoring pass
that gives the "old" logprobs, the training pass), its backward, and everything else (rollout
lookup, padding, advantages, importance weights, metrics, optimizer). Prints a table; the number
that matters is the share outside forward/backward: the trainer's own overhead.

    .venv/bin/python bench/train_step.py [--model DIR] [--groups 4] [--group-size 8] [--tokens 48] [--steps 4] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: a fresh tiny model)")
    ap.add_argument("--groups", type=int, default=4, help="GRPO groups (default 4)")
    ap.add_argument("--group-size", type=int, default=8, help="trajectories per group (default 8)")
    ap.add_argument("--tokens", type=int, default=48,
                    help="tokens sampled in the first turn, half as many in the second (2 turns + tool glue; default 48)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps, the first left out of the means (default 4)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    for name, value, low in (("--groups", a.groups, 1), ("--group-size", a.group_size, 2),
                             ("--tokens", a.tokens, 1), ("--steps", a.steps, 2), ("--threads", a.threads, 0)):
        if value < low:  # a GRPO group needs two completions; the timing leaves the first step out
            ap.error(f"{name}: at least {low}, got {value}")
    if a.model and not (Path(a.model) / "config.json").is_file():
        ap.error(f"--model: {a.model} is not a model folder (no config.json)")

    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    # torch makes its compile cache folder (TMPDIR/torchinductor_USER) when a model loads: in ours, removed after
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp / "torchinductor"))
    try:
        import torch

        if a.threads:
            torch.set_num_threads(a.threads)
        from transformers import TrainerCallback

        from polar_train.cli import UserError
        from polar_train.model_load import first_line
        from polar_train.tiny_model import write_tiny_model
        from polar_train.train.cli import build_trainer
        from polar_train.train.sampling import sample_trajectories

        model = a.model or str(write_tiny_model(tmp / "tiny"))
        t0 = time.perf_counter()
        try:
            sample_trajectories(model, tmp / "traj", num_tasks=a.groups, group_size=a.group_size,
                                turn_tokens=(a.tokens, a.tokens // 2), seed=0)
        except (OSError, ValueError) as exc:  # no weights, a config.json that is no JSON: a traceback
            raise UserError(f"--model {model}: cannot load it ({first_line(exc)})") from None
        sample_s = time.perf_counter() - t0
        args = argparse.Namespace(data=str(tmp / "traj"), model=model, output=str(tmp / "run"), config=None,
                                  resume=False, sets=[f"max_steps={a.steps}", "learning_rate=1e-4",
                                                      "report_to=none", "save_strategy=no"])
        trainer, report, _ = build_trainer(args)

        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        acc: dict[str, float] = defaultdict(float)
        per_step: list[dict[str, float]] = []
        mark: dict[str, float] = {}

        def pre(_m, _a, _k):
            sync()
            mark["fwd"] = time.perf_counter()

        def post(_m, _a, _k, _o):
            sync()
            key = "forward (train)" if torch.is_grad_enabled() else "forward (scoring, no grad)"
            acc[key] += time.perf_counter() - mark["fwd"]

        trainer.model.register_forward_pre_hook(pre, with_kwargs=True)
        trainer.model.register_forward_hook(post, with_kwargs=True)
        backward = trainer.accelerator.backward

        def timed_backward(loss, **kw):
            sync()
            s = time.perf_counter()
            backward(loss, **kw)
            sync()
            acc["backward"] += time.perf_counter() - s

        trainer.accelerator.backward = timed_backward
        rollout = trainer.rollout_func

        def timed_rollout(prompts, tr):
            s = time.perf_counter()
            out = rollout(prompts, tr)
            acc["rollout lookup"] += time.perf_counter() - s
            return out

        trainer.rollout_func = timed_rollout

        class Steps(TrainerCallback):
            def on_step_begin(self, *_a, **_k):
                sync()
                acc.clear()
                mark["step"] = time.perf_counter()

            def on_pre_optimizer_step(self, *_a, **_k):
                sync()
                mark["opt"] = time.perf_counter()

            def on_optimizer_step(self, *_a, **_k):
                sync()
                acc["optimizer step"] += time.perf_counter() - mark["opt"]

            def on_step_end(self, *_a, **_k):
                sync()
                acc["step total"] = time.perf_counter() - mark["step"]
                per_step.append(dict(acc))

        trainer.add_callback(Steps())
        trainer.train()

        steps = per_step[1:] if len(per_step) > 1 else per_step  # the first step warms up
        keys = ["forward (scoring, no grad)", "forward (train)", "backward", "rollout lookup", "optimizer step"]
        mean = {k: statistics.mean(s.get(k, 0.0) for s in steps) for k in keys + ["step total"]}
        total = mean["step total"]
        model_s = mean[keys[0]] + mean[keys[1]] + mean["backward"]
        outside = total - model_s
        tokens = report.trainable_tokens / max(1, report.rows_out) * (trainer.args.per_device_train_batch_size
                                                                      / trainer.num_generations)
        print(f"\nmodel {a.model or 'a fresh tiny model'} | {report.rows_out} groups x {trainer.num_generations} | "
              f"batch {trainer.args.per_device_train_batch_size} trajectories/step (~{tokens:.0f} trainable "
              f"tokens) | {'CUDA bf16' if trainer.args.bf16 else 'CPU float32'} | "
              f"torch threads {torch.get_num_threads()} | sampling took {sample_s:.1f} s")
        print(f"{'part of an optimizer step':34s} {'mean s':>9s} {'share':>7s}")
        for k in keys:
            print(f"{k:34s} {mean[k]:9.3f} {mean[k] / total:7.1%}")
        other = outside - mean["rollout lookup"] - mean["optimizer step"]
        print(f"{'other (TRL bookkeeping, metrics)':34s} {other:9.3f} {other / total:7.1%}")
        print(f"{'step total':34s} {total:9.3f} {1:7.1%}")
        print(f"{'OUTSIDE forward/backward':34s} {outside:9.3f} {outside / total:7.1%}"
              f"   (averaged over {len(steps)} steps after the first)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the tiny model, the trajectories, the run: ~90 MB


if __name__ == "__main__":
    from polar_train.cli import run_script

    sys.exit(run_script(main))
