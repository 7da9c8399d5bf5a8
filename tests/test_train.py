"""The offline trainer on trajectories sampled from the tiny model itself (float32, exact logprobs).

Every trainer here is the real one (TRL GRPOTrainer subclass + peft LoRA on the tiny model);
the trajectories are sampled with transformers and written in TRAJECTORY_SCHEMA.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from polar_train.cli import UserError
from polar_train.schema import TRAJECTORY_SCHEMA
from polar_train.train.cli import build_trainer, prepare
from polar_train.train.config import TrainConfig, load_config
from polar_train.train.data import DataReport, Trajectory, make_groups
from polar_train.train.sampling import sample_trajectories


def ns(data: Path, model: Path, out: Path, *sets: str, config: str | None = None,
       resume: bool = False) -> argparse.Namespace:
    return argparse.Namespace(data=str(data), model=str(model), output=str(out), config=config,
                              sets=list(sets), resume=resume)


@pytest.fixture(scope="module")
def sampled(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 tasks x 4 trajectories: prompt, sampled turn, tool result (mask 0), sampled turn."""
    d = tmp_path_factory.mktemp("train-traj") / "traj"
    sample_trajectories(tiny_model_dir, d, num_tasks=2, group_size=4, turn_tokens=(6, 4), seed=1)
    return d


def rewrite(src: Path, dst: Path, fn) -> Path:
    """Copy a trajectory folder, transforming its rows (a dict of columns) with ``fn``."""
    table = pq.read_table(next(src.glob("*.parquet")))
    cols = fn(table.to_pydict())
    dst.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pydict(cols, schema=TRAJECTORY_SCHEMA), dst / "part-0.parquet")
    return dst


def test_training_step_is_exact_masked_and_group_relative(sampled, tiny_model_dir, tmp_path):
    trainer, report, _ = build_trainer(ns(sampled, tiny_model_dir, tmp_path / "run",
                                          "learning_rate=1e-3", "max_steps=1"))
    assert report.num_generations == 4 and report.rows_out == 2
    trainer.train()
    batch = trainer.last_batch

    # Same weights, float32: the trainer's logprobs equal the recorded sampler logprobs.
    assert trainer.first_epoch_mismatch and trainer.first_epoch_mismatch[0] < 1e-3
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    assert (~mask).any() and mask.any()  # the tool segment is in the batch, masked
    diff = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"])[mask].abs()
    assert float(diff.max()) < 1e-3

    # Group-relative advantages: one group of 4 recorded trajectories, summing to ~0.
    rewards = torch.tensor(list(trainer._logs["rewards"]["recorded_reward"]))
    adv = batch["advantages"]
    assert adv.shape == (4,) and abs(float(adv.sum())) < 1e-4
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=1e-4)
    data_groups = {}
    for t in trainer.data.trajectories:
        data_groups.setdefault(t.group, []).append(t.reward)
    assert [round(r, 5) for r in sorted(rewards.tolist())] in [sorted(v) for v in data_groups.values()]

    # Masked (tool) tokens receive zero gradient: the loss's gradient w.r.t. the LM head's input
    # (logits = h @ W.T; TRL's fused head never materialises logits) at the position predicting
    # each completion token is exactly 0 where loss_mask is 0, non-zero where it is 1.
    model = trainer.model
    model.train()
    norm = next(m for n, m in model.named_modules() if n.endswith("model.norm"))
    captured = {}

    def keep(_module, _inp, out):
        out.retain_grad()
        captured["h"] = out

    handle = norm.register_forward_hook(keep)
    try:
        loss = trainer.compute_loss(model, batch)
        loss.backward()
    finally:
        handle.remove()
    grad = captured["h"].grad.abs().sum(-1)  # (B, P + C)
    p = batch["prompt_ids"].size(1)
    pred = grad[:, p - 1: -1]  # position p-1+j predicts completion token j
    assert float(pred[~mask].max()) == 0.0
    assert float(grad[:, : p - 1].max()) == 0.0
    nonzero_adv = batch["advantages"].abs() > 1e-3
    assert (pred[nonzero_adv][mask[nonzero_adv]] > 0).all()


def test_a_rollout_that_forked_counts_once_in_its_groups_baseline(sampled, tiny_model_dir, tmp_path):
    """Two trajectories of one rollout (a fork: a history rewrite, a sub-agent) weighed twice in the
    group's mean and std, and a padding copy once more: the losing rollout of a retokenization
    fork stood three times against the winner's once. With `advantage_baseline=rollout` each rollout
    counts once and its trajectories share its advantage; the default, `trajectory`, is TRL's own."""

    def fork(cols):
        first = [i for i, g in enumerate(cols["group_id"]) if g == cols["group_id"][0]]
        for k, i in enumerate(first):  # rollouts: Y (1.0), Z (0.0), X forked into two (0.0 each)
            cols["reward"][i] = 1.0 if k == 0 else 0.0
            cols["rollout_id"][i] = {0: "Y", 1: "Z"}.get(k, "X")
        return cols

    data = rewrite(sampled, tmp_path / "forked", fork)
    trainer, report, _ = build_trainer(ns(data, tiny_model_dir, tmp_path / "run", "max_steps=1",
                                          "per_device_train_batch_size=8", "advantage_baseline=rollout"))
    assert report.rows_with_forks == 1
    assert ("data: 1 GRPO groups hold several trajectories of one rollout (its forks): each rollout counts once in "
            "its group's mean and std, its trajectories share its advantage (advantage_baseline=rollout)"
            in report.lines())
    trainer.train()
    batch = trainer.last_batch
    rollouts = [trainer.data.trajectories[t].rollout for _, t in trainer._batch_members]
    assert sorted(r for r in rollouts if len(r) == 1) == ["X", "X", "Y", "Z"]
    adv = dict(zip(rollouts, batch["advantages"].tolist()))
    std = (1 / 3) ** 0.5  # values 1, 0, 0 over three rollouts: mean 1/3, unbiased std sqrt(1/3)
    assert adv["Y"] == pytest.approx((2 / 3) / (std + 1e-4), abs=1e-4)
    assert adv["X"] == adv["Z"] == pytest.approx((-1 / 3) / (std + 1e-4), abs=1e-4)

    trainer, report, _ = build_trainer(ns(data, tiny_model_dir, tmp_path / "run-t", "max_steps=1",
                                          "per_device_train_batch_size=8"))  # the default: TRL's
    assert ("data: 1 GRPO groups hold several trajectories of one rollout (its forks): each trajectory counts as a "
            "rollout of its own in the baseline (advantage_baseline=trajectory)") in report.lines()
    trainer.train()
    rollouts = [trainer.data.trajectories[t].rollout for _, t in trainer._batch_members]
    adv = dict(zip(rollouts, trainer.last_batch["advantages"].tolist()))
    assert adv["Y"] == pytest.approx(0.75 / (0.5 + 1e-4), abs=1e-4)  # TRL: 1, 0, 0, 0 over four trajectories
    assert adv["X"] == pytest.approx(-0.25 / (0.5 + 1e-4), abs=1e-4)


def test_split_rewards_and_foreign_rollout_ids_leave_each_trajectory_its_own_place(sampled, tiny_model_dir, tmp_path):
    """Under `build --reward-mode split` a forked rollout's trajectories each hold a share of its
    reward: their mean is no rollout's value (a reward-1 rollout forked in three stood at 1/3 against
    an unforked 1). A part another tool wrote with integer rollout ids loaded before the baseline
    read them, and must still."""
    from polar_train.train.data import load_trajectories, read_table

    def fork(cols):
        for i in range(len(cols["rollout_id"])):
            cols["rollout_id"][i] = "same"
        return cols

    data = rewrite(sampled, tmp_path / "split", fork)
    part = next(data.glob("*.parquet"))
    table = pq.read_table(part)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"polar_train.reward_mode": b"split"}),
                   part)
    report = DataReport(advantage_baseline="rollout")
    trajs = load_trajectories(data, vocab_size=300_000, max_completion_length=None, report=report)
    assert report.split_rewards and {t.rollout for t in trajs} == {None}
    assert any("rewards split among each rollout's trajectories (build --reward-mode split)" in line
               for line in report.lines())
    config = prepare(ns(data, tiny_model_dir, tmp_path / "run", "advantage_baseline=rollout"))[0]
    assert config.advantage_baseline == "trajectory"  # what is trained, as the run's summary records it
    # a split build of an earlier version says so in its report only
    pq.write_table(table.replace_schema_metadata({k: v for k, v in table.schema.metadata.items()
                                                  if k != b"polar_train.reward_mode"}), part)
    report = DataReport()
    read_table(data, report)
    assert not report.split_rewards
    (data / "_build_report.json").write_text('{"reward_mode": "split"}')
    report = DataReport()
    read_table(data, report)
    assert report.split_rewards
    # ... under the name builds before 2026-12-06 gave it (their split rewards were trained as whole ones)
    (data / "_build_report.json").rename(data / "build_report.json")
    report = DataReport()
    read_table(data, report)
    assert report.split_rewards
    table = pq.read_table(next(sampled.glob("*.parquet")))
    ints = tmp_path / "ints"
    ints.mkdir()
    pq.write_table(table.set_column(table.schema.get_field_index("rollout_id"), "rollout_id",
                                    pa.array(range(table.num_rows), pa.int64())), ints / "part-0.parquet")
    assert read_table(ints, DataReport()).num_rows == table.num_rows


def test_importance_ratio_uses_recorded_logprobs_and_truncates(sampled, tiny_model_dir, tmp_path):
    """Recorded logprobs shifted by -1 (alternately +1): weight exp(+1) is truncated at the cap 2."""

    def shift(cols):
        cols["logprobs"] = [[v - 1.0 if i % 2 == 0 else v + 1.0 for v in lps]
                            for i, lps in enumerate(cols["logprobs"])]
        return cols

    data = rewrite(sampled, tmp_path / "shifted", shift)
    trainer, _, _ = build_trainer(ns(data, tiny_model_dir, tmp_path / "run", "max_steps=1"))
    trainer.train()
    batch = trainer.last_batch
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    log_w = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"])[mask]
    up, down = log_w > 0, log_w < 0
    assert up.any() and down.any()
    torch.testing.assert_close(log_w.abs(), torch.ones_like(log_w), atol=1e-3, rtol=0)
    ratio = batch["importance_sampling_ratio"][mask]
    assert torch.allclose(ratio[up], torch.tensor(2.0))  # exp(1) = 2.72, truncated at the cap
    torch.testing.assert_close(ratio[down], torch.exp(log_w[down]), atol=1e-5, rtol=1e-5)
    logs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in logs if "loss" in r)
    assert step["sampling/importance_sampling_ratio/clipped_frac"] == pytest.approx(float(up.float().mean()))
    assert step["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0)
    assert step["sampling/sampling_logp_difference/mean"] == pytest.approx(1.0, abs=1e-3)


def test_temperature_must_match_the_recorded_one(sampled, tiny_model_dir, tmp_path):
    args = ns(sampled, tiny_model_dir, tmp_path / "r", "temperature=0.7", "sampler_logprobs=processed")
    with pytest.raises(UserError, match=r"temperature 0.7 differs .* recorded .*\(1\)"):
        prepare(args)
    with pytest.raises(UserError, match="raw sampler logprobs"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "temperature=0.7"))
    config, _, report = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "temperature=0.7",
                                   "allow_temperature_mismatch=true"))
    assert config.temperature == pytest.approx(0.7) and report.temperature_mismatch_allowed
    # the option in a shared config, nothing let through: the mismatch warning must not blame it (a review)
    _, _, report = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "allow_temperature_mismatch=true"))
    assert not report.temperature_mismatch_allowed
    # each advice is one the next run takes: greedy data named as such (temperature=0 is refused), and
    # raw logprobs at 0.7 sent to processed ones at once (--set temperature=0.7 alone is refused next)
    for recorded, words in ((0.0, r"^the trajectories were sampled greedily \(temperature 0\): GRPO learns from how "
                                   r"sampled trajectories of a task differ.* capture again at temperature 1"),
                            (0.7, r"^temperature 1 differs from the sampling temperature recorded in the trajectories "
                                  r"\(0.7\), and raw sampler logprobs .* --logprobs-mode processed_logprobs trains "
                                  r"with --set temperature=0.7 --set sampler_logprobs=processed; raw data needs "
                                  r"capturing again")):
        data = rewrite(sampled, tmp_path / f"t{recorded}", lambda cols: {**cols, "temperature": [recorded] * 8})
        with pytest.raises(UserError, match=words):
            prepare(ns(data, tiny_model_dir, tmp_path / "r"))
    config, _, _ = prepare(ns(data, tiny_model_dir, tmp_path / "r", "temperature=0.7", "sampler_logprobs=processed"))
    assert config.temperature == pytest.approx(0.7)  # (what the message said to set)


def _no_rewards(c):
    c["reward"] = [None] * len(c["reward"])
    return c


def _no_trainable(c):
    c["loss_mask"] = [[0] * len(m) for m in c["loss_mask"]]
    return c


def _big_id(c):
    c["completion_ids"][0][0] = 10_000_000
    return c


def _short_mask(c):
    c["loss_mask"][0] = c["loss_mask"][0][:-1]
    return c


def _empty(c):
    return {k: [] for k in c}


def _inf_reward(c):
    c["reward"][0] = math.inf
    return c


def _huge_reward(c):
    c["reward"][0] = 1e39  # finite here, inf in float32
    return c


def _probabilities(c):
    c["logprobs"][0] = [0.5 if m else math.nan for m in c["loss_mask"][0]]  # probabilities, not logs
    return c


def _neg_inf_logprob(c):
    c["logprobs"][0][0] = -math.inf
    return c


def _null_mask(c):
    c["loss_mask"][0] = None
    return c


@pytest.mark.parametrize("fn, message", [
    (_neg_inf_logprob, r"trajectory .*: logprob -inf \(probability 0 for a token the sampler chose\)"),
    (_null_mask, r"trajectory .*: loss_mask is null"),
    (_no_rewards, "no trajectory .* has a reward"),
    (_inf_reward, r"reward inf is not finite"),
    (_huge_reward, r"reward 1e\+39 is beyond ±1e\+15: the group's mean and standard deviation \(float32\)"),
    (_probabilities, r"logprob 0.5 is above 0 \(a probability above 1\)"),
    (_no_trainable, r"no trajectory .* has a trainable \(loss_mask 1\) token"),
    (_big_id, "token id 10000000 is outside the model's vocabulary"),
    (_short_mask, "differ in length"),
    (_empty, "no trajectories in"),
])
def test_bad_data_is_a_clear_error_before_training(fn, message, sampled, tiny_model_dir, tmp_path):
    data = rewrite(sampled, tmp_path / "bad", fn)
    with pytest.raises(UserError, match=message):
        prepare(ns(data, tiny_model_dir, tmp_path / "r"))


def test_trajectories_written_back_by_pandas_load_as_the_same(sampled, tmp_path):
    """Read with pandas, rescored, written back with ``to_parquet`` (pandas 3 writes every string
    column as large_string): refused as "not a trajectory table: trajectory_id (large_string,
    expected string)", though each value reads the same."""
    import pandas as pd

    from polar_train.train.data import DataReport, load_trajectories

    df = pd.read_parquet(sampled)
    (tmp_path / "rescored").mkdir()
    df.to_parquet(tmp_path / "rescored" / "part-00000.parquet")
    assert pq.read_schema(tmp_path / "rescored" / "part-00000.parquet").field("trajectory_id").type != pa.string()

    def load(path):
        trajs = load_trajectories(path, vocab_size=1 << 20, max_completion_length=None, report=DataReport())
        return sorted((t.trajectory_id, t.prompt_ids, t.completion_ids, t.loss_mask, str(t.logprobs), t.reward,
                       t.group, t.temperature, t.model) for t in trajs)

    assert load(tmp_path / "rescored") == load(sampled)


def test_the_config_built_in_python_refuses_what_the_cli_refuses(tmp_path):
    """``TrainConfig(lora_r=4.5)`` from a script reached torch (a TypeError after the weights
    loaded), ``lora_r="8"`` a comparison's TypeError naming nothing, and ``use_vllm=True`` /
    ``top_p=0.9`` were accepted without a word (the CLI refuses each in one line)."""
    from polar_train.train.config import TrainConfig

    out = str(tmp_path / "run")
    for given, message in ((dict(lora_r=4.5), "lora_r must be an integer, not 4.5"),
                           (dict(lora_r="8"), "lora_r must be an integer, not '8'"),
                           (dict(learning_rate="1e-5"), "learning_rate must be a number, not '1e-5'"),
                           (dict(bf16="yes"), "bf16 must be true or false, not 'yes'"),
                           (dict(use_vllm=True), "use_vllm: this trainer trains recorded trajectories only"),
                           (dict(top_p=0.9), "top_p: this trainer trains recorded trajectories only")):
        with pytest.raises(ValueError, match=re.escape(message)):
            TrainConfig(output_dir=out, **given)
    config = TrainConfig(output_dir=tmp_path / "run", init_adapter=Path("~/adapter"), top_p=1.0, learning_rate=1)
    assert config.output_dir == out and config.init_adapter == str(Path.home() / "adapter")
    # what a notebook's sweep or TRL's own documented values give (the review): taken, as plain values
    import numpy as np

    config = TrainConfig(output_dir=out, lora_r=np.int64(8), learning_rate=np.float32(0.5), ddp_timeout=1800.0,
                         bf16=0, scale_rewards=False)
    assert (config.lora_r, config.learning_rate, config.ddp_timeout, config.bf16, config.scale_rewards) == (
        8, 0.5, 1800, False, "none") and type(config.lora_r) is int


def test_bad_paths_and_options_are_clear_errors(sampled, tiny_model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / ".hidden").mkdir()
    with pytest.raises(UserError, match="no trajectory Parquet files"):
        prepare(ns(tmp_path / "empty", tiny_model_dir, tmp_path / "r"))
    pq.write_table(pa.table({"x": [1]}), tmp_path / "empty" / "other.parquet")
    with pytest.raises(UserError, match="not a trajectory table: trajectory_id"):
        prepare(ns(tmp_path / "empty", tiny_model_dir, tmp_path / "r"))
    (tmp_path / "capture").mkdir()  # the call log handed to train before build: the next step is named
    pq.write_table(pa.table({"call_id": ["c1"], "api": ["openai.chat"]}), tmp_path / "capture" / "part-1.parquet")
    with pytest.raises(UserError, match="a capture's call log, not trajectories: run `polar-train build`"):
        prepare(ns(tmp_path / "capture", tiny_model_dir, tmp_path / "r"))
    with pytest.raises(UserError, match="--model .*nomodel: not found"):
        prepare(ns(sampled, tmp_path / "nomodel", tmp_path / "r"))
    with pytest.raises(UserError, match="--set lerning_rate: unknown option"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "lerning_rate=1"))
    with pytest.raises(UserError, match="invalid float value: 'fast'"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "learning_rate=fast"))
    bad_yaml = tmp_path / "t.yaml"
    bad_yaml.write_text("learning_rate: 1e-4\nnot_an_option: 3\n")
    with pytest.raises(UserError, match="unknown option.*not_an_option"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(bad_yaml)))
    # values TRL would refuse only mid-training, after the weights load, or never
    for setting, message in (("loss_type=foo", "loss_type must be one of grpo, .*vespo, not 'foo'"),
                             ("vllm_importance_sampling_mode=foo", "vllm_importance_sampling_mode must be one of"),
                             ("epsilon=-1", r"^epsilon must be > 0 \(the clip range around 1\), got -1$"),
                             ("epsilon_high=0", r"^epsilon_high must be > 0 \(the clip range around 1\), got 0$"),
                             ("max_completion_length=0", "max_completion_length must be >= 1, got 0")):
        with pytest.raises(UserError, match=message):
            prepare(ns(sampled, tiny_model_dir, tmp_path / "r", setting))
    # ... each of which trained (or crashed mid-run) before: a reversed gradient, nothing learned, a
    # division by zero, torch's TypeError on a null learning rate
    for setting, message in (("num_generations=0", "num_generations must be at least 2 .*, got 0"),
                             ("beta=-0.5", r"beta \(the KL coefficient\) must be a finite number >= 0, got -0.5"),
                             ("vllm_importance_sampling_clip_max=-1", "must be a finite number above 0, got -1"),
                             ("temperature=0", "temperature must be a number above 0 .*, got 0"),
                             ("max_steps=0", r"max_steps must be at least 1, or -1 .*, got 0"),
                             ("max_steps=-5", "max_steps must be at least 1, or -1"),
                             ("num_train_epochs=0", "num_train_epochs must be a finite number above 0"),
                             ("learning_rate=-1", "learning_rate must be a finite number >= 0"),
                             ("learning_rate=inf", "learning_rate must be a finite number >= 0"),  # NaN adapter
                             ("beta=inf", "beta .* must be a finite number >= 0"),
                             ("num_train_epochs=inf", "num_train_epochs must be a finite number above 0"),
                             ("lora_alpha=0", r"lora_alpha must be above 0 \(the LoRA scale is alpha / r\)"),
                             ("min_group_size=0", "min_group_size must be at least 1"),
                             ("gradient_accumulation_steps=0", "gradient_accumulation_steps must be at least 1"),
                             ("lora_r=0", "lora_r must be at least 1"),
                             ("lora_dropout=2", r"lora_dropout must be in \[0, 1\)"),
                             ("report_to=wandb", "report_to wandb: not installed here"),
                             # HfArgumentParser's "arguments are not used: ['tensorboard']" before
                             ("report_to=tensorboard,wandb", "report_to wandb: not installed here"),
                             ("report_to=none,tensorboard", "report_to none,tensorboard: none and all stand alone"),
                             ("output_dir=/elsewhere", "the run folder is --output"),
                             # a probe: "trained 0 steps" with exit 0, or TRL's refusal mid-run
                             ("num_iterations=0", "num_iterations must be at least 1, got 0"),
                             ("top_entropy_quantile=-1", r"top_entropy_quantile must be in \[0, 1\], got -1"),
                             ("save_steps=0", "save_steps must be above 0"),
                             ("scale_rewards=bogus",
                              "scale_rewards must be group, batch or none \\(or TRL's true, false\\), got bogus"),
                             ("advantage_baseline=group", "advantage_baseline must be 'rollout' or 'trajectory', not "
                              "'group'"),
                             ("importance_sampling_level=bogus", "importance_sampling_level must be token or sequence"),
                             ("top_p=0.5", "top_p: this trainer trains recorded trajectories only"),
                             ("per_device_train_batch_size=100000", "a step's generation batch is 100000 trajectories"),
                             ("steps_per_generation=300", "a step's generation batch is 1200 trajectories"),
                             ("num_generations=1000000", "num_generations 1000000 is more than twice the largest "
                                                         "group")):
        with pytest.raises(UserError, match=message):
            prepare(ns(sampled, tiny_model_dir, tmp_path / "r", setting))
    for text, message in (("learning_rate: null\n", "learning_rate: expected a value, got null"),
                          ("learning_rate: {a: 1}\n", "learning_rate: expected a value, got a mapping"),
                          ("1: 2\n", "unknown option.*1"),
                          ("num_generations: 0\n", "num_generations must be at least 2"),
                          ('lora_r: "eight"\n', r"t.yaml: lora_r: expected an integer, got 'eight'")):
        bad_yaml.write_text(text)
        with pytest.raises(UserError, match=message):
            prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(bad_yaml)))
    import importlib.util

    real_find_spec = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as m:  # as on a machine without it (this one may have it)
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
        with pytest.raises(UserError, match="use_liger_kernel needs the liger-kernel package"):
            prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "use_liger_kernel=true"))
    with pytest.raises(UserError, match="advantage_baseline=rollout takes each group's own mean and std "
                                        r"\(scale_rewards group or none, .*set advantage_baseline=trajectory"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "advantage_baseline=rollout", "scale_rewards=batch"))
    # a sampling option at its default sets nothing (a TRL config copied as it is), and save_steps
    # is only read when the run saves by steps
    config = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "top_p=1.0", "top_k=0", "save_strategy=no",
                        "save_steps=0"))[0]
    assert (config.top_p, config.top_k) == (1.0, 0)
    bad_yaml.write_text("# nothing set yet\n")  # TRL refused an empty file in its own words
    assert prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(bad_yaml)))[0].lora_r == TrainConfig.lora_r
    bad_yaml.write_text('lora_r: "8"\nlearning_rate: "1e-4"\n')  # numbers written as strings still read
    config = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(bad_yaml)))[0]
    assert (config.lora_r, config.learning_rate) == (8, 1e-4)
    bad_yaml.write_text("lora_target_modules: q_proj\n")  # one module, not written as a list
    assert prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(bad_yaml)))[0].lora_target_modules == [
        "q_proj"]
    no_tokenizer = tmp_path / "model-without-tokenizer"
    no_tokenizer.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json") and f.is_file():
            (no_tokenizer / f.name).symlink_to(f)
    with pytest.raises(UserError, match="no tokenizer .*the model folder supplies the tokenizer too"):
        prepare(ns(sampled, no_tokenizer, tmp_path / "r"))
    config, _, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "loss_type=cispo", "epsilon_high=5"))
    assert (config.loss_type, config.epsilon_high) == ("cispo", 5.0)


def test_example_config_loads_and_set_overrides_it(sampled, tiny_model_dir, tmp_path):
    repo = Path(__file__).resolve().parents[1]
    config, grouped, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "learning_rate=3e-4",
                                    "lora_target_modules=q_proj,v_proj",
                                    config=str(repo / "data" / "train.yaml")))
    assert config.learning_rate == pytest.approx(3e-4)
    assert config.lora_target_modules == ["q_proj", "v_proj"]
    assert config.vllm_importance_sampling_mode == "token_truncate"
    assert config.num_generations == 4 and config.per_device_train_batch_size == 4
    assert config.bf16 is (torch.cuda.is_available())
    config, _, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "per_device_train_batch_size=8"))
    assert (config.num_generations, config.per_device_train_batch_size) == (4, 8)


def test_the_default_group_size_counts_only_groups_that_train(sampled, tiny_model_dir, tmp_path):
    """Three task-less trajectories (each its own group of one, dropped by min_group_size) made 1 the
    most common size: the default num_generations became 2 and the two real groups of 4 were cut
    into pairs, each trajectory's baseline one random partner."""
    def with_solos(cols):
        extra = {k: v[:3] for k, v in cols.items()}
        for key in ("trajectory_id", "rollout_id", "group_id", "task_id"):
            extra[key] = [f"solo-{i}" for i in range(3)]
        return {k: v + extra[k] for k, v in cols.items()}

    data = rewrite(sampled, tmp_path / "solos", with_solos)
    config, grouped, report = prepare(ns(data, tiny_model_dir, tmp_path / "r"))
    assert (config.num_generations, config.per_device_train_batch_size, len(grouped.rows)) == (4, 4, 2)


def _traj(group: str, i: int, reward: float) -> Trajectory:
    return Trajectory(f"{group}-{i}", group, [1, 2], [3, 4], [1, 1], [-1.0, -1.0], reward)


def test_unequal_groups_are_padded_split_or_dropped_and_reported():
    trajs = ([_traj("a", i, i) for i in range(4)] + [_traj("b", i, i) for i in range(3)]
             + [_traj("c", i, i) for i in range(6)] + [_traj("d", 0, 0.0)])
    report = DataReport()
    g = make_groups(trajs, num_generations=4, policy="pad", min_group_size=2, seed=0, report=report)
    assert all(len(r) == 4 for r in g.rows) and len(g.rows) == 4  # a, b padded, c -> 4 + 2 padded
    assert {trajs[i].group for r in g.rows for i in r} == {"a", "b", "c"}
    assert all(len({trajs[i].group for i in r}) == 1 for r in g.rows)  # never mixes groups
    assert (report.groups_padded, report.padding_trajectories, report.groups_split) == (2, 3, 1)
    assert (report.groups_dropped, report.trajectories_dropped_in_groups) == (1, 1)
    assert any("padded by resampling (3 copies)" in line for line in report.lines())

    report = DataReport()
    g = make_groups(trajs, num_generations=4, policy="drop", min_group_size=2, seed=0, report=report)
    assert len(g.rows) == 2 and report.groups_padded == 0
    assert (report.groups_dropped, report.trajectories_dropped_in_groups) == (3, 6)
    c_rows = [r for r in g.rows if trajs[r[0]].group == "c"]
    assert len(c_rows) == 1 and len(set(c_rows[0])) == 4
    assert math.isclose(sum(report.group_sizes.values()), 4)


def test_init_adapter_continues_an_existing_lora(sampled, tiny_model_dir, tmp_path):
    """``init_adapter``: the trainer starts from the saved adapter's weights, trainable."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    peft_model.save_pretrained(str(tmp_path / "a0"))
    saved = json.loads((tmp_path / "a0" / "adapter_config.json").read_text())
    (tmp_path / "a0" / "adapter_config.json").write_text(json.dumps({**saved, "base_model_name_or_path": "tiny"}))
    with pytest.raises(UserError, match="no adapter_config.json"):
        build_trainer(ns(sampled, tiny_model_dir, tmp_path / "r0", f"init_adapter={tmp_path}"))
    trainer, _, _ = build_trainer(ns(sampled, tiny_model_dir, tmp_path / "r1", f"init_adapter={tmp_path / 'a0'}"))
    lora_b = {n: p for n, p in trainer.model.named_parameters() if "lora_B" in n}
    assert lora_b and all(p.requires_grad for p in lora_b.values())
    assert all(torch.allclose(p, torch.full_like(p, 0.01)) for p in lora_b.values())
    assert not any("k_proj" in n for n in lora_b)  # the saved adapter's targets, not a fresh all-linear LoRA
    # what this run's adapter will record as its base: this --model (peft kept the loaded one's "tiny")
    assert trainer.model.peft_config["default"].base_model_name_or_path == str(tiny_model_dir.resolve())
    # a LoRA option given beside it that the adapter does not have was silently not used
    with pytest.raises(UserError, match=r"^lora_r=8 \(init_adapter: 4\), lora_target_modules=q_proj "
                                        r"\(init_adapter: q_proj,v_proj\): a run from init_adapter continues"):
        build_trainer(ns(sampled, tiny_model_dir, tmp_path / "r2", f"init_adapter={tmp_path / 'a0'}", "lora_r=8",
                         "lora_alpha=8", "lora_target_modules=q_proj"))
    build_trainer(ns(sampled, tiny_model_dir, tmp_path / "r3", f"init_adapter={tmp_path / 'a0'}", "lora_r=4"))
    (tmp_path / "run" / "adapter").mkdir(parents=True)  # a training run's folder named for its adapter
    for f in (tmp_path / "a0").iterdir():
        (tmp_path / "run" / "adapter" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(UserError, match=f"a training run's folder\\? its adapter is {tmp_path / 'run' / 'adapter'}$"):
        build_trainer(ns(sampled, tiny_model_dir, tmp_path / "r4", f"init_adapter={tmp_path / 'run'}"))
    with pytest.raises(UserError, match=f"^init_adapter: {tmp_path / 'nope'}: not found$"):
        build_trainer(ns(sampled, tiny_model_dir, tmp_path / "r5", f"init_adapter={tmp_path / 'nope'}"))


def test_a_step_without_sampler_logprobs_logs_no_mismatch(sampled, tiny_model_dir, tmp_path):
    """Rendered calls (Anthropic messages: no server ids) have no sampler logprob. TRL logged a
    mismatch of 0 for such a step - a perfect match, averaged into the first-epoch mean."""

    def rendered(cols):
        cols["logprobs"] = [[math.nan] * len(lps) for lps in cols["logprobs"]]
        return cols

    data = rewrite(sampled, tmp_path / "rendered", rendered)
    trainer, report, _ = build_trainer(ns(data, tiny_model_dir, tmp_path / "run", "max_steps=1"))
    assert report.trainable_tokens_without_logprob == report.trainable_tokens > 0
    # TensorBoard's callback warned 'Trainer is attempting to log a value of "None" ...' per such key
    notices: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    board = logging.getLogger("transformers.integrations.integration_utils")
    board.addHandler(handler)
    try:
        trainer.train()
    finally:
        board.removeHandler(handler)
    assert not [n for n in notices if "attempting to log" in n]
    step = next(row for row in trainer.state.log_history if "loss" in row)
    assert step["sampling/sampling_logp_difference/mean"] is None
    assert step["sampling/sampling_logp_difference/max"] is None
    assert len(trainer.first_epoch_mismatch) == 1 and math.isnan(trainer.first_epoch_mismatch[0])


def test_the_data_report_names_the_sampling_models(sampled, tiny_model_dir, tmp_path):
    """Round 2's data trained without its adapter passed silently when the adapter had moved little
    (first-step mismatch under the 0.1 warning): the model names the calls asked for are shown,
    and two samplers in one run are warned about."""
    def two_rounds(cols):
        cols["model"] = ["tiny"] * 4 + ["r1"] * 4
        return cols

    _, _, report = prepare(ns(rewrite(sampled, tmp_path / "two", two_rounds), tiny_model_dir, tmp_path / "r2"))
    lines = report.lines()
    assert "data: sampled by r1 4, tiny 4 (model names as served; trajectories)" in lines
    assert any(line.startswith("data: warning: several samplers in one run") for line in lines)

    def one_round(cols):
        cols["model"] = ["r1"] * 8
        return cols

    _, _, report = prepare(ns(rewrite(sampled, tmp_path / "one", one_round), tiny_model_dir, tmp_path / "r1"))
    assert "data: sampled by r1 8 (model names as served; trajectories)" in report.lines()
    assert not any("several samplers" in line for line in report.lines())

    def a_lonely_other(cols):  # the other sampler's one trajectory is a group of 1: dropped, not trained
        cols["model"] = ["tiny"] * 7 + ["r1"]
        cols["group_id"][7] = cols["task_id"][7] = None
        return cols

    _, _, report = prepare(ns(rewrite(sampled, tmp_path / "lonely", a_lonely_other), tiny_model_dir, tmp_path / "r4"))
    assert report.models == {"tiny": 7} and not any("several samplers" in line for line in report.lines())
    table = pq.read_table(next((tmp_path / "one").glob("*.parquet")))
    other = tmp_path / "other-tool"
    other.mkdir()
    pq.write_table(table.set_column(table.schema.get_field_index("model"), "model",  # another tool's ints
                                    pa.array(list(range(8)), pa.int64())), other / "part-0.parquet")
    _, _, report = prepare(ns(other, tiny_model_dir, tmp_path / "r3"))  # only ever shown: not an error
    assert report.models == {} and not any("sampled by" in line for line in report.lines())

def test_the_data_report_counts_what_is_trained_not_what_groups_dropped(sampled, tiny_model_dir, tmp_path):
    """One task group of 4 plus a rollout with a reward but no task (a group of 1, dropped): the
    report's trainable tokens, tokens without a sampler logprob and temperatures were counted at
    load, so they held the dropped rollout's tokens and its temperature."""
    lonely = None

    def one_group_and_a_lonely_rollout(cols):
        nonlocal lonely
        keep = [i for i, g in enumerate(cols["group_id"]) if g == "task-0"]
        lonely = next(i for i, g in enumerate(cols["group_id"]) if g == "task-1")
        out = {k: [v[i] for i in keep + [lonely]] for k, v in cols.items()}
        out["group_id"][-1] = out["task_id"][-1] = None  # a Responses rollout with a reward, no task
        out["logprobs"][-1] = [math.nan] * len(out["logprobs"][-1])  # ... and no sampler logprobs
        out["temperature"] = [None] * len(keep) + [1.0]  # only the lonely rollout recorded one
        return out

    data = rewrite(sampled, tmp_path / "mixed", one_group_and_a_lonely_rollout)
    table = pq.read_table(data).to_pydict()
    kept_tokens = sum(sum(m) for m in table["loss_mask"][:4])
    assert sum(table["loss_mask"][4]) > 0
    _, grouped, report = prepare(ns(data, tiny_model_dir, tmp_path / "r"))
    assert (report.rows, report.rows_out, report.num_generations) == (5, 1, 4)
    assert (report.groups_dropped, report.trajectories_dropped_in_groups) == (1, 1)  # the drop stays visible
    assert report.trainable_tokens == kept_tokens
    assert report.trainable_tokens_without_logprob == 0
    assert report.temperatures == []
    lines = report.lines()
    assert f"data: 1 GRPO groups of 4 ({kept_tokens} trainable tokens)" in lines
    assert "data: 1 groups dropped (1 trajectories)" in lines
    (names,) = report.dropped_groups.values()  # which group, and why: the count alone sent users looking
    assert len(names) == 1 and names[0].startswith("<single ")  # the rollout without a task
    assert f"data: dropped below min_group_size 2: {names[0]!r}" in lines
    assert not any("without a sampler logprob" in line for line in lines)
    assert "data: no sampling temperature recorded: `temperature` cannot be checked" in lines


def test_padding_copies_count_as_trained_and_every_trained_temperature_is_reported():
    """A padded group's copies are trained again (once per copy), so their tokens count; a split
    group's every part is trained; a dropped group's tokens and temperature are not reported."""
    def traj(group, i, temperature, logprob=-1.0):
        return Trajectory(f"{group}-{i}", group, [1, 2], [3, 4, 5], [1, 0, 1], [logprob, math.nan, logprob],
                          float(i), temperature)

    trajs = ([traj("a", i, 0.7) for i in range(3)]  # padded with one copy
             + [traj("b", i, 1.0, logprob=math.nan) for i in range(5)]  # split: 4, and 1 left over: dropped
             + [traj("c", 0, 0.3)])  # a group of 1: dropped
    report = DataReport(temperatures=[0.3, 0.7, 1.0])  # what load saw
    g = make_groups(trajs, num_generations=4, policy="pad", min_group_size=2, seed=0, report=report)
    trained = [i for row in g.rows for i in row]
    assert len(trained) == 8 and report.padding_trajectories == 1  # a: 3 + 1 copy; b: 4
    assert report.trainable_tokens == 2 * len(trained)
    assert report.trainable_tokens_without_logprob == 2 * sum(1 for i in trained if trajs[i].group == "b")
    assert report.temperatures == [0.7, 1.0]
    assert (report.groups_dropped, report.trajectories_dropped_in_groups) == (2, 2)


def test_a_flipped_bit_in_a_trajectory_part_is_an_error_never_other_ids(tmp_path):
    """The builder writes page checksums and the trainer's reader verifies them. Without them more
    than half of all single-bit flips in a part were read as other ids or logprobs (trained without a
    word); with them a flip in a page's data is a one-line UserError. A page's header is not under
    its checksum: the few flips there that still decode are the bound (2 of 4,390 bytes here)."""
    from polar_train.train.data import read_table
    from polar_train.trajectories import build_trajectories
    from polar_train.trajectories.writer import write_trajectories
    from tests.support.calls import Conversation, write_parts

    rows = []
    for k in range(12):
        conv = Conversation(rollout_id=f"r{k}")
        conv.user(f"task {k}: count the files")
        rows.append(conv.assistant("", tool_calls=[("ls", {"path": "."})]))
        conv.tool("a.txt\nb.txt" * (k + 1))
        rows.append(conv.assistant(f"{k + 2} files."))
    write_parts(tmp_path / "cap", rows)
    write_trajectories(build_trajectories(tmp_path / "cap").trajectories, tmp_path / "t")
    (part,) = sorted((tmp_path / "t").glob("part-*.parquet"))
    want = read_table(tmp_path / "t", DataReport())
    data = part.read_bytes()
    footer = int.from_bytes(data[-8:-4], "little") + 8
    probe = tmp_path / "probe"
    probe.mkdir()
    errors, silent, flips = 0, [], range(4, len(data) - footer, 11)
    for pos in flips:
        (probe / part.name).write_bytes(data[:pos] + bytes([data[pos] ^ (1 << (pos % 8))]) + data[pos + 1:])
        try:
            got = read_table(probe, DataReport())
        except UserError as exc:
            assert "unreadable data" in str(exc) or "not a readable Parquet file" in str(exc)
            errors += 1
            continue
        if str(got.to_pydict()) != str(want.to_pydict()):  # str: NaN logprobs compare equal
            silent.append(pos)
    assert errors > len(flips) / 2
    assert len(silent) <= len(flips) / 100, silent


def _part(src: Path, dst: Path, name: str, fn=None, metadata: dict | None = None) -> Path:
    """Write one trajectory part of ``src``'s rows (``fn`` may change the table) into ``dst``."""
    table = pq.read_table(next(src.glob("*.parquet")))
    table = pa.Table.from_pydict(table.to_pydict(), schema=TRAJECTORY_SCHEMA)
    if fn is not None:
        table = fn(table)
    if metadata is not None:
        table = table.replace_schema_metadata(metadata)
    dst.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, dst / name)
    return dst


def _temperature_as(kind):
    def cast(table):
        i = table.column_names.index("temperature")
        col = table.column(i).cast(pa.float64()) if kind == "float64" else pa.array(["hot"] * table.num_rows)
        return table.set_column(i, pa.field("temperature", col.type), col)
    return cast


def test_parts_of_other_column_types_versions_or_copied_twice(sampled, tiny_model_dir, tmp_path):
    """A float64 temperature in one part and float32 in another was pyarrow's ArrowTypeError; a string
    one failed naming no file; a newer table version was read as ours; a part copied twice was
    trained twice."""
    mixed = _part(sampled, tmp_path / "mixed", "part-0.parquet")
    _part(sampled, mixed, "part-1.parquet", lambda t: _temperature_as("float64")(
        t.set_column(0, "trajectory_id", pa.array([f"b-{v}" for v in t.column(0).to_pylist()]))))
    _, grouped, report = prepare(ns(mixed, tiny_model_dir, tmp_path / "r"))
    assert report.rows == 16 and report.temperatures == [1.0] and report.dropped_duplicate_id == 0

    words = _part(sampled, tmp_path / "words", "part-0.parquet", _temperature_as("string"))
    with pytest.raises(UserError, match=r"part-0.parquet: column temperature is string, expected float"):
        prepare(ns(words, tiny_model_dir, tmp_path / "r"))

    newer = _part(sampled, tmp_path / "newer", "part-0.parquet",
                  metadata={"polar_train.table": "trajectories", "polar_train.version": "2"})
    with pytest.raises(UserError, match=r"part-0.parquet: trajectory table version 2, this polar-train reads "
                                        r"version 1: upgrade polar-train"):
        prepare(ns(newer, tiny_model_dir, tmp_path / "r"))

    twice = _part(sampled, tmp_path / "twice", "part-0.parquet")
    _part(sampled, twice, "part-0 (copy).parquet")
    _, grouped, report = prepare(ns(twice, tiny_model_dir, tmp_path / "r"))
    assert (report.rows, report.dropped_duplicate_id, report.rows_out, len(grouped.trajectories)) == (16, 8, 2, 8)
    assert ("data: 8 trajectories dropped: trajectory_id already read (a part copied twice?); the first is used"
            in report.lines())


def test_importance_weight_bounds_are_checked_as_trl_uses_them(sampled, tiny_model_dir, tmp_path):
    """TRL copies the deprecated cap into clip_max after our range check ran: a cap of -1 reversed
    every gradient; a NaN lower bound trained an adapter of NaNs."""
    for setting, message in (
            ("vllm_importance_sampling_cap=-1", r"vllm_importance_sampling_cap \(the cap of the importance weight\) "
                                                r"must be a finite number above 0, got -1"),
            ("vllm_importance_sampling_clip_max=inf", "clip_max .* must be a finite number above 0, got inf"),
            ("vllm_importance_sampling_clip_min=nan", "clip_min .* must be a finite number >= 0, got nan"),
            ("vllm_importance_sampling_clip_min=-1", "clip_min .* must be a finite number >= 0, got -1")):
        with pytest.raises(UserError, match=message):
            prepare(ns(sampled, tiny_model_dir, tmp_path / "r", setting))
    config, _, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "vllm_importance_sampling_clip_min=0.5"))
    assert (config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max) == (0.5, 2.0)


def test_yaml_values_are_checked_against_the_option_types(sampled, tiny_model_dir, tmp_path):
    """TRL hands YAML values to the dataclass as YAML typed them: ``lora_r: 4.5`` reached peft."""
    yaml_file = tmp_path / "t.yaml"
    for text, message in (("lora_r: 4.5\n", "lora_r: expected an integer, got 4.5"),
                          ("max_steps: 1.5\n", "max_steps: expected an integer, got 1.5"),
                          ("lora_target_modules: 5\n", r"lora_target_modules: expected a list \(or a comma-separated "
                                                       r"string\), got 5"),
                          ("lora_target_modules: [1, 2]\n", "lora_target_modules: expected a list of strings"),
                          ("max_steps: true\n", "max_steps: expected an integer, got True"),
                          ("bf16: 2\n", "bf16: expected true or false, got 2"),
                          # TRL sets os.environ[key] = str(value): an OSError traceback, an unnamed ValueError
                          ('env: {"": x}\n', "env: '' is no environment variable name"),
                          ('env: {"A=B": x}\n', "env: 'A=B' is no environment variable name"),
                          ("env: {POLAR_PROBE: null}\n", "env: POLAR_PROBE: expected a value"),
                          ("env: [1]\n", "env: expected a mapping of NAME: value, got list")):
        yaml_file.write_text(text)
        with pytest.raises(UserError, match=f"^{yaml_file}: {message}"):
            prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(yaml_file)))
    yaml_file.write_text("lora_r: 4.0\nmax_steps: 2\nlearning_rate: 1\nlora_target_modules: q_proj,v_proj\n")
    config, _, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(yaml_file)))
    assert (config.lora_r, type(config.lora_r), config.max_steps) == (4, int, 2)
    assert config.learning_rate == 1.0 and config.lora_target_modules == ["q_proj", "v_proj"]


def test_options_that_would_generate_or_train_nothing_are_refused(sampled, tiny_model_dir, tmp_path):
    """``use_vllm`` ended in vLLM's ImportError; ``mask_truncated_completions`` masked every recorded
    trajectory (none ends in EOS for TRL) and reported success."""
    for setting in ("use_vllm=true", "vllm_mode=server", "vllm_server_port=8001"):
        key = setting.split("=")[0]
        with pytest.raises(UserError, match=f"^--set {key}: this trainer trains recorded trajectories only"):
            prepare(ns(sampled, tiny_model_dir, tmp_path / "r", setting))
    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text("use_vllm: true\n")
    with pytest.raises(UserError, match="use_vllm: this trainer trains recorded trajectories only"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(yaml_file)))
    with pytest.raises(UserError, match="mask_truncated_completions is not supported on recorded trajectories"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "mask_truncated_completions=true"))


def test_errors_name_the_users_option_not_a_derived_one(sampled, tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match=r"^--set num_generations: invalid int value: 'four'$"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "num_generations=four"))  # named TRL's --num-generations
    # a value with a leading '-' was taken for an option: "expected one argument"
    with pytest.raises(UserError, match=r"^learning_rate must be a finite number >= 0, got -inf$"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "learning_rate=-inf"))
    with pytest.raises(UserError, match=r"^seed must be in 0 \.\. 4294967295 \(numpy's range\), got -1$"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "seed=-1"))  # said by numpy after the weights loaded
    twice = tmp_path / "twice.yaml"
    twice.write_text("learning_rate: 1.0e-5\nmax_steps: 2\nlearning_rate: 2.0e-5\n")
    with pytest.raises(UserError, match=rf"^{twice}: line 3: learning_rate is given twice"):
        load_config(str(twice), [], str(tmp_path / "r"))  # the last value won unsaid
    merged = tmp_path / "merged.yaml"  # YAML's merge key is no duplicate (it was refused as not valid YAML)
    merged.write_text("learning_rate: 2.0e-5\n<<: {max_steps: 3}\n")
    config = load_config(str(merged), [], str(tmp_path / "r"))
    assert (config.learning_rate, config.max_steps) == (2.0e-5, 3)
    odd = tmp_path / "odd.yaml"  # a list as a key: a TypeError escaped as a traceback
    odd.write_text("? [a, b]\n: 1\n")
    with pytest.raises(UserError, match=rf"^{odd}: not valid YAML"):
        load_config(str(odd), [], str(tmp_path / "r"))
    assert load_config(None, [], "-run").output_dir == "-run"  # "--set output_dir: expected one argument"
    assert not (tmp_path / "r").exists()
    with pytest.raises(UserError, match=r"^per_device_train_batch_size \(3\) x gradient_accumulation_steps \(1\) x "
                                        r"processes \(1\) = 3 must be a multiple of num_generations \(4\)"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "per_device_train_batch_size=3"))

    def two_temperatures(cols):
        cols["temperature"] = [0.7 if g == "task-0" else 1.0 for g in cols["group_id"]]
        return cols

    data = rewrite(sampled, tmp_path / "two", two_temperatures)
    for setting in ("temperature=0.7", "temperature=1"):
        with pytest.raises(UserError, match=r"record several sampling temperatures \(0.7, 1\) .* split or filter"):
            prepare(ns(data, tiny_model_dir, tmp_path / "r", setting, "sampler_logprobs=processed"))


def test_a_yaml_syntax_error_names_its_line_column_and_problem(tmp_path):
    """Only PyYAML's context was kept ("not valid YAML (while parsing a flow sequence)"): neither
    where in a long train.yaml nor what was wrong (serve --script says both)."""
    config = tmp_path / "t.yaml"
    for text, message in (
            ("learning_rate: 1.0e-5\nlora_r: [8\nseed: 1\n",
             "expected ',' or ']', but got ':' at line 3, column 5 (while parsing a flow sequence started at line 2, "
             "column 9)"),
            ("learning_rate: 1.0e-5\nlora_r:\t8\n",
             "found character '\\t' that cannot start any token at line 2, column 8 (while scanning for the next "
             "token)")):
        config.write_text(text)
        with pytest.raises(UserError, match=f"^{re.escape(f'{config}: not valid YAML: {message}')}$"):
            load_config(str(config), [], str(tmp_path / "r"))


def test_a_bad_boolean_in_the_config_file_names_the_file_not_set(tmp_path):
    """``bf16: "maybe"`` in the YAML was reported as ``--set bf16: Truthy value expected ...``,
    though no --set was given."""
    config = tmp_path / "t.yaml"
    for key, value in (("bf16", "maybe"), ("allow_temperature_mismatch", "sure")):
        config.write_text(f'{key}: "{value}"\n')
        with pytest.raises(UserError, match=f"^{re.escape(f'{config}: {key}: expected true or false, got {value!r}')}$"):
            load_config(str(config), [], str(tmp_path / "r"))
    config.write_text('bf16: "no"\nallow_temperature_mismatch: "yes"\n')  # argparse's words for a bool are taken
    loaded = load_config(str(config), [], str(tmp_path / "r"))
    assert (loaded.bf16, loaded.allow_temperature_mismatch) == (False, True)


def test_an_option_given_twice_with_set_is_refused(tmp_path):
    """``--set lora_r=8 --set lora_r=4`` trained r=4 unsaid; the same key twice in the YAML is refused."""
    with pytest.raises(UserError, match=r"^--set lora_r is given twice \(the last one would win unsaid\)$"):
        load_config(None, ["lora_r=8", "lora-r=4"], str(tmp_path / "r"))


def test_delta_at_or_below_one_plus_epsilon_is_refused(tmp_path):
    """TRL clamps the ratio at ``delta``: ``delta: 0.2`` (taken for epsilon) gave every token of positive
    advantage a constant loss, and the run "trained" on its bad trajectories only, with exit 0."""
    out = str(tmp_path / "r")
    for sets, bound in ((["delta=0.2"], "1 + epsilon = 1.2, got 0.2"), (["delta=-1"], "1 + epsilon = 1.2, got -1"),
                        (["delta=1.19"], "1 + epsilon = 1.2, got 1.19"),
                        (["epsilon_high=0.28", "delta=1.25"], "1 + epsilon_high = 1.28, got 1.25"),
                        (["delta=nan"], "1 + epsilon = 1.2, got nan")):
        with pytest.raises(UserError, match=rf"^delta must be at least {re.escape(bound)}: TRL caps the ratio pi/pi_old "
                                            "at delta, so a token of positive advantage .* no gradient"):
            load_config(None, sets, out)
    assert load_config(None, ["delta=1.5"], out).delta == 1.5
    assert load_config(None, ["delta=1.2"], out).delta == 1.2  # (at 1 + epsilon: the usual clipping)
    for loss in ("cispo", "sapo", "vespo"):  # TRL never reads delta there: a setting without effect, refused
        with pytest.raises(UserError, match=rf"^delta has no effect with loss_type {loss} \(TRL clamps at delta only "
                                            "for grpo, bnpo, dr_grpo, dapo, luspo\); leave delta out"):
            load_config(None, [f"loss_type={loss}", "delta=1.5"], out)


def test_a_generation_option_at_its_default_is_taken_and_epsilon_names_what_was_given(tmp_path):
    """A copied TRL config's ``use_vllm: false`` was refused as generating (``top_p: 1.0`` was taken),
    and ``epsilon=-0.2`` said "got -0.2 and None", naming an epsilon_high never set."""
    out = str(tmp_path / "r")
    config = tmp_path / "t.yaml"
    config.write_text("use_vllm: false\nvllm_mode: colocate\n")
    loaded = load_config(str(config), ["use_vllm=False", "vllm_server_port=8000"], out)
    assert (loaded.use_vllm, loaded.vllm_mode) == (False, "colocate")
    for sets in (["use_vllm=true"], ["vllm_mode=server"]):
        with pytest.raises(UserError, match="this trainer trains recorded trajectories only"):
            load_config(None, sets, out)
    with pytest.raises(UserError, match=r"^epsilon must be > 0 \(the clip range around 1\), got -0.2$"):
        load_config(None, ["epsilon=-0.2"], out)


def test_no_learning_signal_is_said_and_a_model_file_or_broken_tokenizer_is_one_line(sampled, tiny_model_dir, tmp_path,
                                                                                    capsys):
    """A probe's runs: equal rewards in every group trained an unchanged adapter with exit 0 and
    a stdout line only; ``--model config.json`` gave transformers' repo-id message; a
    tokenizer_config.json without tokenizer.json failed after the weights loaded, in 5 lines."""
    equal = rewrite(sampled, tmp_path / "equal", lambda c: {**c, "reward": [0.5] * len(c["reward"])})
    prepare(ns(equal, tiny_model_dir, tmp_path / "r"))
    assert capsys.readouterr().err == ("polar-train train: warning: every GRPO group has equal rewards: the advantages "
                                       "are all 0, nothing to learn from (build with other --rewards?)\n")
    prepare(ns(sampled, tiny_model_dir, tmp_path / "r"))
    assert "equal rewards" not in capsys.readouterr().err
    with pytest.raises(UserError, match=r"^--model .*config.json: not a folder; name the model's folder"):
        prepare(ns(sampled, tiny_model_dir / "config.json", tmp_path / "r"))
    broken = tmp_path / "model-with-half-a-tokenizer"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "tokenizer.json" and f.is_file():
            (broken / f.name).symlink_to(f)
    with pytest.raises(UserError, match=r"^--model .*: its tokenizer does not load \(") as caught:
        build_trainer(ns(sampled, broken, tmp_path / "r2", "report_to=none"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "r2").exists()  # refused before anything was written


@pytest.mark.parametrize("setting, message", [
    ("cast_lm_head_to_fp32=true", "cast_lm_head_to_fp32 is not supported with the LoRA adapter"),
    ("sync_ref_model=true", "sync_ref_model is not supported with LoRA"),
    ("neftune_noise_alpha=5", "neftune_noise_alpha is not supported: its noise on the embeddings"),
    ('model_init_kwargs={"dtype": "bfloat16"}', "model_init_kwargs is not used: polar-train loads the model itself"),
    ("fp16=true,use_cpu=true", "fp16 needs a CUDA GPU"),
    ("hub_token=hf_PROBE", "hub_token: a token given as an option is written into every training_args.bin"),
    ("loss_type=sapo,sapo_temperature_pos=0", "sapo_temperature_pos must be a finite number above 0"),
    ("loss_type=vespo,vllm_importance_sampling_mode=sequence_truncate",
     "loss_type vespo needs vllm_importance_sampling_mode token_truncate or token_mask"),
    # the docs' own example without its schedule, and text that is no mapping: TypeErrors after the weights loaded
    ('lr_scheduler_kwargs={"min_lr": 1e-7}', "lr_scheduler_kwargs: min_lr is no option of lr_scheduler_type linear "
                                             "(its options: none; min_lr needs lr_scheduler_type cosine_with_min_lr)"),
    ('lr_scheduler_kwargs={"min_lr_ratio":0.1},lr_scheduler_type=cosine_with_min_lr',
     "lr_scheduler_kwargs: min_lr_ratio is no option of lr_scheduler_type cosine_with_min_lr (its options: "
     "num_cycles, min_lr, min_lr_rate)"),
    ("lr_scheduler_kwargs=[1]", "lr_scheduler_kwargs must be a mapping"),
    # an adapter of NaNs at step 1 said as a divergence ("lower learning_rate"); clipping off unsaid (a probe)
    ("weight_decay=nan", "weight_decay must be a finite number >= 0, got nan"),
    ("adam_epsilon=0", "adam_epsilon must be a finite number above 0"),
    ("adam_beta2=1", "adam_beta2 must be in [0, 1), got 1.0"),
    ("max_grad_norm=nan", "max_grad_norm must be a number >= 0 (0: no clipping), got nan"),
    ("report_to=", "--set report_to: empty value"),
    # TRL's words after the weights loaded ("batch_size should be a positive integer"); -1 taken (a probe)
    ("steps_per_generation=0", "steps_per_generation must be at least 1, got 0"),
    ("steps_per_generation=-1", "steps_per_generation must be at least 1, got -1"),
    ("logging_steps=-1", "logging_steps must be above 0"),
    ("lora_target_modules= ", "--set lora_target_modules: empty value"),
    ("lr_scheduler_kwargs={bad", "lr_scheduler_kwargs: not valid JSON (Expecting property name"),
    ('lr_scheduler_kwargs= {"min_lr": 1e-7}', "lr_scheduler_kwargs: min_lr is no option"),  # " {" stayed text (review)
])
def test_options_that_fail_late_go_unused_or_break_exactness_are_refused(sampled, tiny_model_dir, tmp_path,
                                                                         setting, message):
    """A probe of the GRPOConfig options: a traceback after the weights loaded (cast_lm_head_to_fp32,
    sync_ref_model), a first-step mismatch of 4 nats trained on (neftune), options that did nothing
    (model_init_kwargs, fp16 on CPU), a NaN adapter after training (SAPO's temperature 0), and TRL's
    VESPO check, which it runs only where vLLM samples."""
    with pytest.raises(UserError, match=f"^{re.escape(message)}"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", *setting.split(",")))


def test_trls_documented_values_and_mappings_are_taken(sampled, tiny_model_dir, tmp_path, capsys):
    """``scale_rewards`` true/false (TRL documents them) were refused; a YAML mapping for a dict option
    (``lr_scheduler_kwargs``) was refused where --set took its JSON; lora_dropout's noise is said."""
    for value, scale in (("true", "group"), ("false", "none")):
        config, _, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", f"scale_rewards={value}"))
        assert config.scale_rewards == scale
    yaml_file = tmp_path / "t.yaml"
    # (1e-7 without a dot: a string to PyYAML, a number to JSON; it reached the scheduler as "1e-7")
    yaml_file.write_text("scale_rewards: false\nlr_scheduler_type: cosine_with_min_lr\n"
                         "lr_scheduler_kwargs: {min_lr: 1e-7}\nlora_dropout: 0.1\n")
    config, _, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(yaml_file)))
    assert config.scale_rewards == "none" and config.lr_scheduler_kwargs == {"min_lr": 1.0e-7}
    assert "warning: lora_dropout 0.1: its noise enters the importance weights" in capsys.readouterr().err
    config, _, _ = prepare(ns(sampled, tiny_model_dir, tmp_path / "r", "report_to=None"))  # "None: not installed"
    assert config.report_to in ([], ["none"], "none")
    for fresh in ("none", ""):  # clears a YAML's init_adapter: a fresh LoRA (not a folder named "none"; the review)
        assert prepare(ns(sampled, tiny_model_dir, tmp_path / "r", f"init_adapter={fresh}"))[0].init_adapter is None
    for empty in ("{}", "null"):  # sets nothing: not refused as unused
        assert prepare(ns(sampled, tiny_model_dir, tmp_path / "r", f"model_init_kwargs={empty}"))[0] is not None
    yaml_file.write_text("generation_kwargs: {top_k: 5}\n")  # a sampler's option stays refused as a mapping too
    with pytest.raises(UserError, match="generation_kwargs"):
        prepare(ns(sampled, tiny_model_dir, tmp_path / "r", config=str(yaml_file)))


def test_a_loaded_adapters_dropout_is_said_too(sampled, tiny_model_dir, tmp_path, capsys):
    """The warning looked at lora_dropout alone; from init_adapter the loaded adapter's dropout
    applies (its noise was in a round-2 mismatch of 3.5e-3, unsaid)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_dropout": 0.2}))
    prepare(ns(sampled, tiny_model_dir, tmp_path / "r", f"init_adapter={adapter}"))
    assert "warning: lora_dropout 0.2: its noise enters the importance weights" in capsys.readouterr().err
    prepare(ns(sampled, tiny_model_dir, tmp_path / "r", f"init_adapter={adapter}", "disable_dropout=true"))
    assert "lora_dropout" not in capsys.readouterr().err


def test_option_types_hold_after_a_scripts_own_parse_of_grpoconfig(tmp_path):
    """transformers' HfArgumentParser rewrites a union's ``Field.type`` in place, and TrainConfig's
    fields are GRPOConfig's: a script that parsed GRPOConfig before importing polar_train had a YAML
    mapping for ``lr_scheduler_kwargs`` refused ("expected a value, got a mapping")."""
    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text("lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr: 1.0e-7}\n")
    script = ("import sys\n"
              "from transformers import HfArgumentParser\n"
              "from trl import GRPOConfig\n"
              "HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(\n"
              "    args=['--output_dir', sys.argv[2], '--use_cpu', '--bf16', 'false'])\n"
              "from polar_train.train.config import load_config\n"
              "print(load_config(sys.argv[1], [], sys.argv[2]).lr_scheduler_kwargs)\n")
    done = subprocess.run([sys.executable, "-c", script, str(yaml_file), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "{'min_lr': 1e-07}"


def test_the_data_report_names_the_builds_it_read():
    """train_summary.json's data names the builds trained on: notebook 02 showed the report of a
    folder rebuilt since the run as the run's data."""
    from polar_train.train.data import read_table

    sample = Path(__file__).resolve().parents[1] / "data" / "samples" / "demo" / "trajectories"
    report = DataReport()
    read_table(sample, report)
    assert report.build_ids == [json.loads((sample / "_build_report.json").read_text())["build_id"]]


def test_a_checkpoint_keeps_the_updates_before_each_mismatch_and_an_older_one_still_reads(tmp_path):
    """The mismatch file holds each batch's value and the updates before it (the warning names them
    where step 1 measured nothing); an older checkpoint's list of values alone still resumes."""
    from types import SimpleNamespace

    from polar_train.train.trainer import MISMATCH_FILE, restore_first_epoch_mismatch

    trainer = SimpleNamespace(first_epoch_mismatch=[], first_epoch_updates=[])
    (tmp_path / MISMATCH_FILE).write_text('{"values": [null, 0.25], "updates": [0, 1]}\n')
    assert restore_first_epoch_mismatch(trainer, tmp_path)
    assert math.isnan(trainer.first_epoch_mismatch[0]) and trainer.first_epoch_mismatch[1] == 0.25
    assert trainer.first_epoch_updates == [0, 1]
    (tmp_path / MISMATCH_FILE).write_text("[null, 0.25]\n")  # before the updates were kept
    assert restore_first_epoch_mismatch(trainer, tmp_path)
    assert trainer.first_epoch_updates == [None, None] and trainer.first_epoch_mismatch[1] == 0.25
    (tmp_path / MISMATCH_FILE).write_text('{"values": "x"}\n')
    assert not restore_first_epoch_mismatch(trainer, tmp_path)


def test_the_mismatch_warning_names_the_logprob_mode_away_from_temperature_1():
    """Processed logprobs declared for raw ones (serve's, vLLM's default) at temperature 0.7 gave a
    first-step mismatch of 0.19, and the warning sent the user after a wrong init_adapter alone (a
    probe). At temperature 1 the two modes agree: nothing more is said there."""
    from polar_train.train.trainer import mismatch_warning

    warned = mismatch_warning(0.191, None, 0, 0.7, "processed")
    assert "is not the one that sampled these trajectories" in warned
    assert warned.endswith("Or the recorded logprobs are not processed ones (sampler_logprobs=processed at temperature "
                           "0.7: raw logprobs - vLLM's default, polar-train serve's - are of the unscaled distribution, "
                           "processed ones need vLLM --logprobs-mode processed_logprobs).")
    assert "sampler_logprobs" not in mismatch_warning(0.191, None, 0, 1.0, "raw")
    assert mismatch_warning(0.05, None, 0, 0.7, "processed") is None
    # a temperature mismatch the user let through is named as the likely cause (a review)
    forced = mismatch_warning(0.4, None, 0, 0.7, "raw", temperature_forced=True)
    assert "(a fresh LoRA on --model, no init_adapter) may not be the one that sampled" in forced
    assert forced.endswith("Or it is the temperature mismatch allow_temperature_mismatch=true let through: a training "
                           "temperature other than the sampler's, or raw logprobs away from temperature 1, gives such "
                           "a mismatch by itself.")


def test_each_epoch_tells_the_sampler_its_number_whatever_wraps_it(sampled, tiny_model_dir, tmp_path, monkeypatch):
    """Several processes resumed mid-epoch wrap the sampler twice (SkipBatchSampler(BatchSamplerShard(
    BatchSampler))), where no set_epoch reaches it: epoch 1's order came back (a review). The trainer
    tells it before each epoch; its order in epoch e is the (e+1)-th permutation of TRL's seeded
    generator, as an uninterrupted run draws them."""
    import transformers
    from trl.trainer.utils import RepeatSampler

    trainer, _, _ = build_trainer(ns(sampled, tiny_model_dir, tmp_path / "run", "max_steps=1"))
    trainer.get_train_dataloader()
    sampler = trainer._epoch_sampler
    seen = []
    monkeypatch.setattr(transformers.Trainer, "_run_epoch",
                        lambda self, model, epoch, *args, **kwargs: seen.append(sampler.epoch))
    trainer._run_epoch(None, 3)
    assert seen == [3]
    plain = RepeatSampler(list(range(sampler.num_samples)), mini_repeat_count=sampler.mini_repeat_count,
                          batch_size=sampler.batch_size, repeat_count=sampler.repeat_count, seed=sampler.seed)
    orders = [list(plain) for _ in range(4)]  # TRL's: one generator, one draw per pass
    assert len({tuple(o) for o in orders}) > 1
    for epoch in (3, 0, 2):
        sampler.set_epoch(epoch)
        assert list(sampler) == orders[epoch]
