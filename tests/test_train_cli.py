"""``polar-train train`` as a user runs it: a subprocess, real files in, a loadable adapter out."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from polar_train.cli import UserError
from polar_train.train import cli as train_cli
from polar_train.train.sampling import sample_trajectories

BIN = Path(sys.executable).parent / "polar-train"


def polar_train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trajectories(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("train-cli") / "traj"
    sample_trajectories(tiny_model_dir, d, num_tasks=2, group_size=4, turn_tokens=(5, 3), seed=2)
    (d / ".part-1.parquet.tmp").write_bytes(b"in progress")  # a builder's temporary file: ignored
    return d


def test_train_writes_a_loadable_changed_adapter_and_resumes(trajectories, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                       "--set", "learning_rate=5e-3", "--set", "max_steps=2", "--set", "save_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: 2 GRPO groups of 4" in proc.stdout
    assert "logprob mismatch |trainer - sampler|" in proc.stdout

    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 2
    assert out.stat().st_mode & 0o777 == 0o700  # a run on captured prompts: the owner's only
    assert summary["logprob_mismatch_first_step"] < 1e-3
    # where the run's parts are, for a reader of the summary alone (the notebook, a later run)
    assert summary["trajectories"] == str(trajectories.resolve()) and summary["model"] == str(tiny_model_dir.resolve())
    assert summary["adapter"] == str((out / "adapter").resolve()) and summary["resumed_from"] is None
    assert summary["init_adapter"] is None and "warning" not in proc.stderr  # its own samples: no foreign policy
    # and an unfinished run's marker says where its data is (notebooks/02 reads its build report by it)
    assert json.loads((out / ".polar-train-run").read_text())["trajectories_folder"] == str(trajectories.resolve())
    assert (out / "checkpoint-1" / "polar_first_epoch_mismatch.json").is_file()
    assert summary["adapter_max_abs_change"] > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "loss" in r)
    for key in ("loss", "reward", "reward_std", "clip_ratio/region_mean",
                "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/clipped_frac"):
        assert key in step, key
    assert list((out / "runs").rglob("events.out.tfevents.*")), "no TensorBoard event file"

    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    # the base it was trained on, as an absolute path: serve and init_adapter compare it
    saved_base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert saved_base == str(tiny_model_dir.resolve())
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = torch.tensor([[248045, 872, 198, 9707, 248046, 198, 248045, 74455, 198]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, str(adapter))
        after = tuned(input_ids=ids).logits
    assert float((after - before).abs().max()) > 0

    # a finished run is not resumed: its schedule ended at learning rate 0 (a resumed step changed nothing)
    for steps in ("2", "3"):
        done = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                           "--set", f"max_steps={steps}", "--resume")
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert f"the run in {out} finished (step 2 of 2)" in done.stderr
        assert f"--set init_adapter={out / 'adapter'} --output NEW_FOLDER" in done.stderr
    # a run stopped after its first checkpoint continues from it to the end of its schedule
    import shutil

    shutil.rmtree(out / "checkpoint-2")
    shutil.rmtree(out / "adapter")
    (out / "train_summary.json").unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # the line being written when the run was killed
    before = (out / "checkpoint-1" / "adapter_model.safetensors").read_bytes()
    reshaped = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                           "--set", "max_steps=2", "--set", "lora_r=8", "--resume")
    assert reshaped.returncode == 2 and "Traceback" not in reshaped.stderr
    assert "--resume: lora_r=8 (checkpoint: 16): a resumed run keeps its LoRA options" in reshaped.stderr
    retargeted = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                             "--set", "max_steps=2", "--set", "lora_target_modules=q_proj", "--resume")
    assert retargeted.returncode == 2 and "--resume: lora_target_modules=q_proj (checkpoint: " in retargeted.stderr
    # the schedule's options: a learning rate given at --resume was ignored unsaid, another max_steps
    # mixed two schedules (the run's: learning_rate=5e-3, max_steps=2)
    rescheduled = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                              "--set", "learning_rate=0.5", "--set", "max_steps=3", "--set", "save_steps=1",
                              "--set", "vllm_importance_sampling_clip_max=3", "--resume")  # (a cap: went on unsaid)
    assert rescheduled.returncode == 2 and rescheduled.stderr.strip().splitlines()[-1] == (
        "polar-train train: error: --resume: learning_rate=0.5 (the run: 0.005), max_steps=3 (the run: 2), "
        "vllm_importance_sampling_clip_max=3.0 (the run: 2.0): a resumed "
        "run continues its checkpoint's optimizer, schedule and data order; give the run's values, or start a new "
        "--output (init_adapter= a checkpoint to go on from its weights)"), rescheduled.stderr
    started = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                          "--set", "max_steps=2", "--set", f"init_adapter={out / 'checkpoint-1'}", "--resume")
    assert started.returncode == 2 and "Traceback" not in started.stderr
    assert started.stderr.strip().splitlines()[-1] == (
        f"polar-train train: error: --resume: the run in {out} started from init_adapter=(none: a fresh LoRA), not "
        f"{(out / 'checkpoint-1').resolve()}: resume with the same init_adapter, or start a new --output")
    again = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                        "--set", "learning_rate=5e-3", "--set", "max_steps=2", "--set", "save_steps=1", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((out / "train_summary.json").read_text())
    assert resumed["steps"] == 2 and resumed["resumed_from"] == str((out / "checkpoint-1").resolve())
    assert (out / "checkpoint-2" / "adapter_model.safetensors").read_bytes() != before  # step 2 learned
    # the run's first step was taken before the checkpoint: its mismatch, not step 2's
    assert resumed["logprob_mismatch_first_step"] == summary["logprob_mismatch_first_step"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # step 2 was logged twice
    assert sum("train_runtime" in r for r in rows) == 1
    # measured from the base (the seeded LoRA init), as the uninterrupted run measured it
    assert resumed["adapter_max_abs_change"] == pytest.approx(summary["adapter_max_abs_change"], rel=1e-4)


def test_a_run_resumed_after_its_first_epoch_trains_what_the_uninterrupted_run_trained(trajectories, tiny_model_dir,
                                                                                         tmp_path):
    """Two groups, one a step: four steps are two epochs. Resumed from checkpoint-3 (inside the
    second epoch), the run replayed the first epoch's order - group B twice, group A not at all in
    epoch 2 - and its adapter differed from the uninterrupted run's, unsaid (a probe). TRL's
    sampler drew each epoch's order from one generator that a resumed process never advanced."""
    import shutil

    from safetensors.torch import load_file

    args = ["--model", str(tiny_model_dir), "--set", "max_steps=4", "--set", "save_steps=1",
            "--set", "learning_rate=1e-3", "--set", "report_to=none"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    for out in (full, cut):
        proc = polar_train("train", str(trajectories), "--output", str(out), *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # as if stopped after checkpoint-3: what a kill leaves (the later checkpoint, the adapter, the summary gone)
    shutil.rmtree(cut / "checkpoint-4")
    shutil.rmtree(cut / "adapter")
    (cut / "train_summary.json").unlink()
    resumed = polar_train("train", str(trajectories), "--output", str(cut), *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def rewards(out: Path) -> list[float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [round(r["reward"], 6) for r in rows if "reward" in r]

    order = rewards(full)
    assert len(set(order[:2])) == 2 and sorted(order[2:]) == sorted(order[:2])  # each group once an epoch
    assert rewards(cut) == order
    a, b = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (full, cut))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_data_another_policy_sampled_is_warned_about_at_the_first_step(trajectories, tmp_path):
    """Round k's data trained from the base again (init_adapter forgotten), or on another base:
    GRPO weighs every token by the wrong old policy; the run said nothing (mismatch 0.4 vs 5e-5)."""
    from polar_train.tiny_model import TinyModelSpec, write_tiny_model

    # same vocabulary and shapes, other weights (sharper: a random policy at weight 1 is ~uniform)
    other = write_tiny_model(tmp_path / "other", TinyModelSpec(seed=1, final_norm_weight=16))
    proc = polar_train("train", str(trajectories), "--model", str(other), "--output", str(tmp_path / "run"),
                       "--set", "max_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["logprob_mismatch_first_step"] > 0.1
    warnings = [ln for ln in proc.stderr.splitlines() if "polar-train train: warning: " in ln]
    assert len(warnings) == 2  # at the first step (time to stop it) and again under the summary
    assert "is not the one that sampled these trajectories" in warnings[0]
    assert "(a fresh LoRA on --model, no init_adapter)" in warnings[0] and "init_adapter=<that adapter>" in warnings[0]


def test_another_policy_is_warned_about_where_the_first_step_had_no_sampler_logprob(trajectories, tmp_path):
    """Step 1 of rendered calls only (Anthropic messages: no sampler logprob) measures nothing: the
    run then said nothing at all - no warning, no mismatch line - while step 2 measured 0.2 nats
    against a foreign policy (a probe; whether it warned hung on the shuffle). The first step that
    measures warns, naming the updates before it."""
    import pyarrow.parquet as pq
    from polar_train.schema import TRAJECTORY_SCHEMA
    from polar_train.tiny_model import TinyModelSpec, write_tiny_model

    table = pq.read_table(next(trajectories.glob("*.parquet")))
    cols = table.to_pydict()
    rendered_task = cols["task_id"][0]
    cols["logprobs"] = [[float("nan")] * len(lps) if task == rendered_task else lps
                        for task, lps in zip(cols["task_id"], cols["logprobs"])]
    data = tmp_path / "traj"
    data.mkdir()
    pq.write_table(pa.Table.from_pydict(cols, schema=TRAJECTORY_SCHEMA), data / "part-0.parquet")
    other = write_tiny_model(tmp_path / "other", TinyModelSpec(seed=1, final_norm_weight=16))
    proc = polar_train("train", str(data), "--model", str(other), "--output", str(tmp_path / "run"),
                       "--set", "max_steps=2", "--set", f"seed={RENDERED_FIRST_SEED}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["logprob_mismatch_first_step"] is None  # (the seed puts the rendered group first)
    assert summary["logprob_mismatch_first_measured"] > 0.1
    assert summary["logprob_mismatch_first_measured_after_updates"] == 1
    warnings = [ln for ln in proc.stderr.splitlines() if "polar-train train: warning: " in ln]
    assert len(warnings) == 2, proc.stderr[-3000:]  # at the step that measured, and again under the summary
    assert "at the first step with sampler logprobs (after 1 update: part of it may be the policy's own" in warnings[0]
    assert "is likely not the one that sampled these trajectories" in warnings[0]
    assert "first step none (no sampler logprob: rendered calls only); first measured" in proc.stdout


#: A seed whose shuffle trains the group of the first row first (the test above needs it so)
RENDERED_FIRST_SEED = 0


def test_an_adapter_loaded_on_another_base_folder_is_named(tmp_path):
    """Shapes alike, peft loads an adapter on any base without a word (a second tiny model):
    serve and train say which base it was trained on (a moved copy is warned about too, the line
    says it is fine then); a relative name, as older runs recorded it, is not compared."""
    from polar_train.model_load import adapter_base_note

    base, other, adapter = tmp_path / "base", tmp_path / "other", tmp_path / "adapter"
    for folder in (base, other, adapter):
        folder.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    assert adapter_base_note(adapter, base) is None
    note = adapter_base_note(adapter, other)
    assert note.startswith(f"warning: the adapter in {adapter} was trained on the base model {base}, and is loaded "
                           f"on {other.resolve()}")
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny"}))
    assert adapter_base_note(adapter, other) is None  # a name as typed (older runs): nothing to compare


def test_a_resume_checks_the_init_adapter_shape_against_its_checkpoint(tmp_path):
    """A run of an older version (no init_adapter in its marker) resumed with another init_adapter:
    torch's 60-line size-mismatch traceback after the weights loaded."""
    from polar_train.train.config import TrainConfig

    checkpoint, start = tmp_path / "run" / "checkpoint-1", tmp_path / "start"
    for folder, r in ((checkpoint, 16), (start, 4)):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 32}))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1, "max_steps": 2}))
    config = TrainConfig(output_dir=str(tmp_path / "run"), init_adapter=str(start), use_cpu=True,
                             report_to="none")
    with pytest.raises(UserError, match=r"--resume: init_adapter=.*start has r=4, lora_alpha=32; the checkpoint's "
                                        r"LoRA r=16, lora_alpha=32: resume with the init_adapter the run started from"):
        train_cli._check_resumable(checkpoint, config)
    (start / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 32}))
    train_cli._check_resumable(checkpoint, config)  # the same shape: resumable


def test_a_resume_whose_init_adapter_path_holds_other_weights_is_refused(tmp_path):
    """The path is the same, its adapter another (the next round's written there): the resume went on,
    and its summary measured the run's change from the wrong weights (a probe). Unchanged weights, or
    a marker of an earlier version (no fingerprint), resume."""
    from types import SimpleNamespace

    out, start = tmp_path / "run", tmp_path / "start"
    out.mkdir()
    start.mkdir()
    (start / "adapter_model.safetensors").write_bytes(b"round 2 weights")
    data = [SimpleNamespace(trajectory_id="t1", reward=1.0)]
    identity = train_cli.run_identity(str(tmp_path / "m"), data, str(start))
    assert identity["init_adapter_weights"] is not None
    train_cli._write_marker(out, identity)
    train_cli._check_same_run(out, train_cli.run_identity(str(tmp_path / "m"), data, str(start)))
    (start / "adapter_model.safetensors").write_bytes(b"round 1 weights")
    now = train_cli.run_identity(str(tmp_path / "m"), data, str(start))
    with pytest.raises(UserError) as caught:
        train_cli._check_same_run(out, now)
    assert str(caught.value) == (
        f"--resume: init_adapter={start.resolve()} holds other weights than when the run in {out} started "
        f"(fingerprint {identity['init_adapter_weights']}, now {now['init_adapter_weights']}): the run continues "
        "from its checkpoint, but measures its change from that adapter; put back the adapter it started from, or "
        "start a new --output")
    older = {k: v for k, v in identity.items() if k != "init_adapter_weights"}
    train_cli._write_marker(out, older)
    train_cli._check_same_run(out, now)  # an earlier version's marker: nothing to compare
    # ... and the resume does not record the adapter there now as the run's start (a review)
    assert "init_adapter_weights" not in train_cli.resumed_identity(older, {**now, "options": {}})
    assert train_cli.resumed_identity(identity, {**now, "options": {}})["init_adapter_weights"] == \
        now["init_adapter_weights"]
    # the first markers (2026-12-04) were empty: a resume went on with another model and data, and
    # wrote them into the marker (a probe); nothing to check against is refused, as no marker is
    for marker in ("", "{}", '{"options": {}}'):
        (out / train_cli.RUN_MARKER).write_text(marker)
        with pytest.raises(UserError) as caught:
            train_cli._check_same_run(out, now)
        assert str(caught.value) == (
            f"--resume: the .polar-train-run in {out} records no model and data (an earlier version's marker, or a "
            "damaged one): the resume cannot check it continues the same model and data; start a new --output from "
            "a checkpoint's weights with --set init_adapter=CHECKPOINT")


def test_bad_input_exits_2_with_one_line(trajectories, tiny_model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = polar_train("train", str(empty), "--model", str(tiny_model_dir), "--output", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"polar-train train: error: no trajectory Parquet files in {empty}"
    assert "Traceback" not in proc.stderr
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(tmp_path / "r"),
                       "--config", str(empty))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"polar-train train: error: config file {empty} is a folder, not a file"
    project = tmp_path / "project"  # TRL would write its model card over the project's README.md
    project.mkdir()
    (project / "README.md").write_text("my project")
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(project))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (f"polar-train train: error: --output {project} is not empty "
                                                    "and holds no run of ours: give a new or empty folder")
    assert (project / "README.md").read_text() == "my project" and len(list(project.iterdir())) == 1
    loop = tmp_path / "loop"  # pathlib's RuntimeError traceback (a probe)
    loop.symlink_to(loop)
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(tmp_path / "r"),
                       "--set", f"init_adapter={loop}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"polar-train train: error: init_adapter {loop} is a loop of symbolic links"
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(tmp_path / "r"),
                       "--set", "lora_r=99999999999")  # torch's allocation traceback after the weights (a probe)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "polar-train train: error: lora_r 99999999999 is above the model's hidden size 64: a LoRA's rank is at most "
        "its layers' width (8-64 is usual)")
    assert not (tmp_path / "r").exists()


def test_a_config_that_does_not_fit_the_weights_is_one_line_naming_a_tensor(trajectories, tiny_model_dir, tmp_path):
    """transformers printed a ~20-line LOAD REPORT table, then blamed ``ignore_mismatched_sizes``,
    an argument the user never set."""
    wide = tmp_path / "wide"
    wide.mkdir()
    for f in tiny_model_dir.iterdir():
        (wide / f.name).write_bytes(f.read_bytes())
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    proc = polar_train("train", str(trajectories), "--model", str(wide), "--output", str(tmp_path / "r"),
                       "--set", "max_steps=1")
    assert proc.returncode == 2
    assert re.fullmatch(rf"polar-train train: error: cannot load the model in {re.escape(str(wide))}: its config.json "
                        r"does not fit its weights \(model\..+?\.weight: weights \[\d+(, \d+)?\], config "
                        r"\[\d+(, \d+)?\]\)", proc.stderr.strip().splitlines()[-1])
    assert "LOAD REPORT" not in proc.stderr and "ignore_mismatched_sizes" not in proc.stderr


def test_a_load_that_succeeds_still_logs_its_load_report_once(tiny_model_dir, tmp_path):
    """The report is held back only to be dropped where the load fails on a size mismatch: a model that
    loads with a weight it does not use still says so, once (each handler saw the record)."""
    import logging

    from safetensors.torch import load_file, save_file

    from polar_train.model_load import load_causal_lm

    extra = tmp_path / "extra"
    extra.mkdir()
    for f in tiny_model_dir.iterdir():
        (extra / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(extra / "model.safetensors"))
    save_file({**weights, "unused.weight": torch.zeros(2)}, str(extra / "model.safetensors"), metadata={"format": "pt"})
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    above: list[str] = []  # Python's own handlers, which transformers hands its records to under CI=1
    python_handler = logging.Handler()
    python_handler.emit = lambda record: above.append(record.getMessage())
    board = logging.getLogger("transformers")
    board.addHandler(handler)
    logging.getLogger().addHandler(python_handler)
    propagate, board.propagate = board.propagate, True
    try:
        load_causal_lm(extra, torch.float32)
    finally:
        board.removeHandler(handler)
        logging.getLogger().removeHandler(python_handler)
        board.propagate = propagate
    assert [m for m in seen if "LOAD REPORT" in m and "unused.weight" in m] and \
        len([m for m in seen if "LOAD REPORT" in m]) == 1
    assert len([m for m in above if "LOAD REPORT" in m]) == 1  # (twice: once unheld, once handed on)


def test_a_model_or_adapter_folder_that_does_not_load_is_one_line(trajectories, tiny_model_dir, tmp_path):
    no_weights = tmp_path / "no-weights"  # config and tokenizer, the weights not (yet) copied
    no_weights.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (no_weights / f.name).write_bytes(f.read_bytes())
    proc = polar_train("train", str(trajectories), "--model", str(no_weights), "--output", str(tmp_path / "r1"),
                       "--set", "max_steps=1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"polar-train train: error: cannot load the model in {no_weights}: ")
    assert "Traceback" not in proc.stderr

    adapter = tmp_path / "adapter"  # its config but no weights: peft would look it up on the Hub
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(tmp_path / "r2"),
                       "--set", "max_steps=1", "--set", f"init_adapter={adapter}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"polar-train train: error: init_adapter: {adapter} is not a peft adapter "
        "(no adapter_model.safetensors or adapter_model.bin)")
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()

    a_file = tmp_path / "a-file"
    a_file.write_text("notes")
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(a_file))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"polar-train train: error: --output is a file, not a folder: {a_file}"
    assert a_file.read_text() == "notes"


def test_weights_cut_short_or_a_config_of_wrong_types_is_one_error(tiny_model_dir, tmp_path):
    """safetensors' own error type and transformers' dataclass validation error escaped as
    tracebacks (from serve and train alike: both load through load_causal_lm)."""
    import torch

    from polar_train.model_load import ModelLoadError, load_causal_lm

    cut, typed = tmp_path / "cut", tmp_path / "typed"
    for folder in (cut, typed):
        folder.mkdir()
        for f in tiny_model_dir.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    config = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    for folder in (cut, typed):
        with pytest.raises(ModelLoadError, match=f"cannot load the model in {folder}: "):
            load_causal_lm(folder, torch.float32)


def test_an_adapter_of_another_base_model_names_the_mismatch(tmp_path):
    # serve and train load adapters through load_adapter: torch's first line alone says only
    # "Error(s) in loading state_dict"; the user needs to know the adapter is for another model
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from polar_train.model_load import ModelLoadError, load_adapter

    def tiny(hidden: int) -> Qwen3ForCausalLM:
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=16))

    get_peft_model(tiny(32), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ModelLoadError, match=r"its weights do not fit .*another base model\?\): size mismatch for "
                                             r".*q_proj\.lora_A.*: adapter\(\[4, 32\]\), model\(\[4, 64\]\)$"):
        load_adapter(tiny(64), tmp_path / "adapter")


@pytest.mark.parametrize("keep", [1000, 0.5])
def test_an_adapter_with_weights_cut_short_is_one_error(tmp_path, keep):
    """safetensors' SafetensorError is not an OSError: `serve --adapter` and `init_adapter` ended
    in a traceback for a copy cut short."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from polar_train.model_load import ModelLoadError, load_adapter

    def tiny() -> Qwen3ForCausalLM:
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=16))

    adapter = tmp_path / "adapter"
    get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(adapter)
    weights = adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=f"cannot load the adapter in {adapter}: "):
        load_adapter(tiny(), adapter)


def _args(data: Path, model: Path, out: Path, *sets: str, resume: bool = False) -> argparse.Namespace:
    return argparse.Namespace(data=str(data), model=str(model), output=str(out), config=None,
                              sets=["report_to=none", *sets], resume=resume)


def test_a_failed_save_or_non_finite_weights_is_one_line_exit_1(trajectories, tiny_model_dir, tmp_path,
                                                               monkeypatch, capsys):
    """A full disk while saving a checkpoint or the adapter was a traceback; an adapter of NaNs was
    written with exit 0 and a train_summary.json holding a bare NaN (not JSON). No real training
    here: ``train`` is replaced, the saving is real."""
    from transformers import AutoTokenizer
    from transformers.trainer_utils import TrainOutput

    from polar_train.train.trainer import RecordedGRPOTrainer

    trainer, _, _ = train_cli.build_trainer(_args(trajectories, tiny_model_dir, tmp_path / "r0", "max_steps=1",
                                                  "save_only_model=true"))
    trainer._save_checkpoint(trainer.model, None)
    checkpoint = tmp_path / "r0" / "checkpoint-0"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "trainer_state.json").is_file()
    assert not (checkpoint / "tokenizer.json").exists()  # --resume reads it from --model: 33 MB saved per save

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", disk_full)
        with pytest.raises(train_cli.TrainFailure, match=f"^cannot save {checkpoint}: No space left on device$"):
            trainer._save_checkpoint(trainer.model, None)

    def nan_loss(self, *args, **kwargs):
        return TrainOutput(0, float("nan"), {})

    monkeypatch.setattr(RecordedGRPOTrainer, "train", nan_loss)
    assert train_cli.run(_args(trajectories, tiny_model_dir, tmp_path / "r1")) == 0
    summary = json.loads((tmp_path / "r1" / "train_summary.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"{c} in train_summary.json"))
    assert summary["train_loss"] is None

    tokenizer_class = type(AutoTokenizer.from_pretrained(str(tiny_model_dir)))

    def tokenizers_disk_full(*args, **kwargs):
        raise Exception("No space left on device (os error 28)")  # tokenizers' error is no OSError

    with monkeypatch.context() as m:
        m.setattr(tokenizer_class, "save_pretrained", tokenizers_disk_full)
        capsys.readouterr()
        assert train_cli.run(_args(trajectories, tiny_model_dir, tmp_path / "r2")) == train_cli.EXIT_FAILED == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"polar-train train: error: cannot write the adapter to {tmp_path / 'r2' / 'adapter'}: "
            "No space left on device (os error 28)")

    def nan_weights(self, *args, **kwargs):
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    param.fill_(float("nan"))
        return TrainOutput(0, 0.0, {})

    monkeypatch.setattr(RecordedGRPOTrainer, "train", nan_weights)
    assert train_cli.run(_args(trajectories, tiny_model_dir, tmp_path / "r3")) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("polar-train train: error: training ended with non-finite adapter weights (")
    assert not (tmp_path / "r3" / "adapter").exists() and not (tmp_path / "r3" / "train_summary.json").exists()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(RecordedGRPOTrainer, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_cli.run(_args(trajectories, tiny_model_dir, tmp_path / "r4", "save_steps=50"))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "polar-train train: interrupted at step 0, before any checkpoint was saved (save_steps=50): nothing to "
        "resume; run again (the same --output is fine: nothing was logged there yet)")
    # and so it is: nothing there refuses a new run
    assert train_cli._check_output(tmp_path / "r4", False, None, {}) is None
    # a run that logged steps but saved no checkpoint: --resume would only say there is nothing to resume from
    (tmp_path / "r4" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.1}\n')
    with pytest.raises(UserError) as held:
        train_cli._check_output(tmp_path / "r4", False, None, {})
    assert str(held.value) == (f"{tmp_path / 'r4'} already holds a run that saved no checkpoint to resume from: "
                               "give another --output (or remove this one)")

    def terminated(self, *args, **kwargs):  # SIGTERM (timeout, a scheduler), as polar_train.cli raises it
        raise SystemExit(143)

    monkeypatch.setattr(RecordedGRPOTrainer, "train", terminated)
    with pytest.raises(SystemExit) as stopped:  # it ended with 143 and no line, where Ctrl-C said what was left
        train_cli.run(_args(trajectories, tiny_model_dir, tmp_path / "r5", "save_steps=50"))
    assert stopped.value.code == 143 and stopped.value.polar_said
    assert "polar-train train: interrupted at step 0" in capsys.readouterr().err.strip().splitlines()[-1]


def test_an_interrupted_run_resumes_from_its_last_complete_checkpoint_on_the_same_data(
        trajectories, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C exited 130 without a word; a checkpoint cut short made --resume refuse with no way on;
    a resume with another --model or other data went on silently."""
    from polar_train.train.trainer import MetricsFileCallback

    out = tmp_path / "run"
    log = MetricsFileCallback.on_log

    def ctrl_c_at_step_2(self, args, state, control, logs=None, **kwargs):
        log(self, args, state, control, logs=logs, **kwargs)
        if state.global_step == 2:  # logged, not yet saved
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(MetricsFileCallback, "on_log", ctrl_c_at_step_2)
        with pytest.raises(KeyboardInterrupt):
            train_cli.run(_args(trajectories, tiny_model_dir, out, "max_steps=2", "save_steps=1",
                                "learning_rate=5e-3"))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "polar-train train: interrupted at step 2; continue with --resume (from checkpoint-1)")
    cut_short = out / "checkpoint-2"  # the save the interrupt (or a full disk) cut short: weights, no state
    cut_short.mkdir()
    (cut_short / "adapter_model.safetensors").write_bytes(b"")

    other_model = tmp_path / "other-model"  # the same files elsewhere: another --model all the same
    other_model.mkdir()
    for f in tiny_model_dir.iterdir():
        (other_model / f.name).symlink_to(f)
    with pytest.raises(UserError, match=f"^--resume: the run in {out} trained on --model {tiny_model_dir.resolve()}, "
                                        f"not {other_model}: resume with the same model"):
        train_cli.run(_args(trajectories, other_model, out, "max_steps=2", resume=True))
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    table = pq.read_table(trajectories)
    pq.write_table(table.slice(0, 4).replace_schema_metadata(table.schema.metadata), fewer / "part-0.parquet")
    with pytest.raises(UserError, match=f"^--resume: the run in {out} trained on other trajectories \\(8 with "
                                        "fingerprint [0-9a-f]+; now 4 with [0-9a-f]+\\): resume with the same data"):
        train_cli.run(_args(fewer, tiny_model_dir, out, "max_steps=2", resume=True))
    rescored = tmp_path / "rescored"  # the same trajectories rebuilt with another rewards file
    rescored.mkdir()
    rewards = [1.0 - r for r in table.column("reward").to_pylist()]
    pq.write_table(table.set_column(table.schema.get_field_index("reward"), "reward",
                                    pa.array(rewards, table.schema.field("reward").type)),
                   rescored / "part-0.parquet")
    with pytest.raises(UserError, match=f"^--resume: the run in {out} trained on these trajectories with other "
                                        "rewards \\(rebuilt with another rewards file\\?\\)"):
        train_cli.run(_args(rescored, tiny_model_dir, out, "max_steps=2", resume=True))

    with pytest.raises(UserError, match="^--resume: lora_dropout=0.3 \\(checkpoint: 0.0\\): a resumed run keeps"):
        train_cli.run(_args(trajectories, tiny_model_dir, out, "max_steps=2", "save_steps=1", "learning_rate=5e-3",
                            "lora_dropout=0.3", resume=True))  # (a marker of an earlier version has none of it)
    marker = out / ".polar-train-run"  # without it nothing was checked: other data went on unsaid
    marker.rename(tmp_path / "marker")
    with pytest.raises(UserError, match=f"^--resume: {out} has no .polar-train-run \\(a folder polar-train train "
                                        "did not write, a run of a polar-train older than the marker \\(2026-12-04\\), or its marker was removed\\)"):
        train_cli.run(_args(fewer, tiny_model_dir, out, "max_steps=2", resume=True))
    (tmp_path / "marker").rename(marker)
    # a run an earlier version started: its marker records fewer options; those it lacks are named
    # (not checked), and the resume does not record its own values of them as the run's
    saved = json.loads(marker.read_text())
    marker.write_text(json.dumps({**saved, "options": {k: v for k, v in saved["options"].items()
                                                       if not k.startswith(("vllm_importance", "max_completion"))}}))

    capsys.readouterr()
    assert train_cli.run(_args(trajectories, tiny_model_dir, out, "max_steps=2", "save_steps=1",
                               "learning_rate=5e-3", resume=True)) == 0
    said = capsys.readouterr().out
    assert ("resume: skipping checkpoint-2 (no readable trainer_state.json: its save was cut short); "
            "resuming from checkpoint-1") in said
    assert said.count("resume: the run's marker (an earlier version's) records no vllm_importance_sampling_correction, "
                      "vllm_importance_sampling_mode, vllm_importance_sampling_clip_min, "
                      "vllm_importance_sampling_clip_max, max_completion_length: give the values the run started "
                      "with (not checked)") == 1  # (not again at the check under the lock)
    assert not any(k.startswith("vllm_importance") for k in json.loads(marker.read_text())["options"])
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["resumed_from"] == str((out / "checkpoint-1").resolve())
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()


def test_a_run_interrupted_while_writing_its_adapter_names_the_weights_it_left(
        trajectories, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the final save left an empty adapter/ and no word: --resume said the run had
    finished and pointed at that adapter, which init_adapter then refused (no adapter_config.json)."""
    import re
    import shutil

    from polar_train.train.trainer import RecordedGRPOTrainer

    out = tmp_path / "run"
    save = RecordedGRPOTrainer.save_model

    def ctrl_c_in_the_final_save(self, output_dir=None, _internal_call=False):
        save(self, output_dir, _internal_call)
        if not _internal_call:  # checkpoints save with _internal_call=True
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(RecordedGRPOTrainer, "save_model", ctrl_c_in_the_final_save)
        with pytest.raises(KeyboardInterrupt):
            train_cli.run(_args(trajectories, tiny_model_dir, out, "max_steps=1", "save_steps=1"))
    checkpoint = out / "checkpoint-1"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "polar-train train: interrupted while writing the adapter, none written; checkpoint-1 holds the adapter "
        f"of step 1: start a new run from it with --set init_adapter={checkpoint}")
    assert not (out / "adapter").exists() and not list(out.glob(".adapter*"))
    with pytest.raises(UserError, match=re.escape(
            f"--resume: the run in {out} finished (step 1 of 1), but its adapter was not written (the save was "
            f"interrupted or failed); checkpoint-1 holds the weights of step 1: start a new run from them with "
            f"--set init_adapter={checkpoint} --output NEW_FOLDER")):
        train_cli.run(_args(trajectories, tiny_model_dir, out, "max_steps=1", resume=True))
    rename = Path.replace

    def no_rename_into_adapter(self, target):
        if Path(target).name == "adapter":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return rename(self, target)

    with monkeypatch.context() as m:  # the adapter written, its rename refused: the weights stay, named
        m.setattr(Path, "replace", no_rename_into_adapter)
        with pytest.raises(train_cli.TrainFailure, match=r"^cannot put the adapter in place at .*/next/adapter: "
                                                         r"Invalid cross-device link; it is complete in "
                                                         r".*/next/\.adapter\.partial-\d+$") as caught:
            train_cli.train(_args(trajectories, tiny_model_dir, tmp_path / "next", "max_steps=1",
                                  f"init_adapter={checkpoint}"))
    partial = Path(str(caught.value).rsplit(" ", 1)[-1])
    assert (partial / "adapter_model.safetensors").is_file() and (partial / "adapter_config.json").is_file()
    assert train_cli.run(_args(trajectories, tiny_model_dir, tmp_path / "next2", "max_steps=1",
                               f"init_adapter={checkpoint}")) == 0
    assert (tmp_path / "next2" / "adapter" / "adapter_model.safetensors").is_file()

    # a newer checkpoint whose weights were cut short (a crash, a full disk) is skipped, not a traceback
    for step, weights in ((2, b""), (3, (checkpoint / "adapter_model.safetensors").read_bytes()[:1000])):
        newer = out / f"checkpoint-{step}"
        shutil.copytree(checkpoint, newer)
        (newer / "adapter_model.safetensors").write_bytes(weights)
    # and one whose optimizer, schedule or random state is cut short or missing: torch's traceback
    # at --resume, or (no optimizer.pt) a new optimizer and schedule unsaid
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "scheduler.pt").is_file()
    cut = {4: ("optimizer.pt", 1000), 5: ("scheduler.pt", 100), 6: ("rng_state.pth", 10), 7: ("optimizer.pt", None)}
    for step, (name, size) in cut.items():
        newer = out / f"checkpoint-{step}"
        shutil.copytree(checkpoint, newer)
        if size is None:
            (newer / name).unlink()
        else:
            (newer / name).write_bytes((checkpoint / name).read_bytes()[:size])
    last, skipped = train_cli.complete_checkpoint(out)
    assert last == checkpoint and skipped == [
        "checkpoint-7 (no optimizer.pt: its save was cut short, or the run saved its model only (save_only_model))",
        *(f"checkpoint-{step} ({name} cut short or unreadable: its save was cut short)"
          for step, name in ((6, "rng_state.pth"), (5, "scheduler.pt"), (4, "optimizer.pt"))),
        *(f"checkpoint-{step} (adapter_model.safetensors cut short or unreadable: its save was cut short)"
          for step in (3, 2))]
    # as an init_adapter (what a run interrupted while writing its adapter names) the weights suffice
    assert train_cli.complete_checkpoint(out, resumable=False)[0] == out / "checkpoint-7"
    deepspeed = out / "checkpoint-7" / "global_step7"  # DeepSpeed keeps its optimizer there, not in optimizer.pt
    deepspeed.mkdir()
    assert train_cli._resume_state_problem(out / "checkpoint-7") is None


def test_an_empty_path_is_refused_not_taken_for_the_current_folder(trajectories, tiny_model_dir, tmp_path,
                                                                   monkeypatch, capsys):
    """``polar-train train ""`` trained on every Parquet file under the current folder (an unset
    variable as DATA), and ``inspect ""`` read the current folder too; build refused it already."""
    from polar_train.cli import main

    monkeypatch.chdir(trajectories if trajectories.is_dir() else trajectories.parent)  # data right here
    for argv, message in (
            (["train", "", "--model", str(tiny_model_dir), "--output", str(tmp_path / "r")],
             'polar-train train: error: DATA is empty: name the folder ("." for the current one)'),
            (["train", ".", "--model", " ", "--output", str(tmp_path / "r")],
             'polar-train train: error: --model is empty: name the folder ("." for the current one)'),
            (["train", ".", "--model", str(tiny_model_dir), "--output", ""],
             'polar-train train: error: --output is empty: name the folder ("." for the current one)'),
            (["inspect", ""], 'polar-train inspect: error: the capture folder is empty: name it ("." for the '
                              'current one)')):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert not (tmp_path / "r").exists()


def test_an_unusable_adapter_or_config_file_is_named_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """A probe's hand-edited adapters and files: peft's type errors ("'<=' not supported between
    instances of 'str' and 'int'", "list indices must be integers"), lines of its warnings before
    the error for another adapter type, an unreadable weights file reported as "No such file or
    directory", a junk pickle as a bare "174812789", a binary config as the codec's words."""
    import torch
    from peft import LoraConfig, get_peft_model

    from polar_train.model_load import ModelLoadError, check_adapter_folder, load_adapter, load_causal_lm
    from polar_train.train.config import read_yaml

    def adapter(name: str, config: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(config)
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
        return folder

    for name, config, message in (
            ("r-word", '{"peft_type": "LORA", "r": "sixteen"}', "r must be a positive number, got 'sixteen'"),
            ("r-zero", '{"r": 0}', "r must be a positive number, got 0"),
            ("alpha", '{"r": 4, "lora_alpha": null, "x": 1}', None),
            ("a-list", "[1, 2]", "not a JSON object of adapter options"),
            ("prefix", '{"peft_type": "PREFIX_TUNING"}', "peft_type 'PREFIX_TUNING': only LoRA adapters are "
                                                         "trained and served here"),
            ("garbage", "{r: 4", "not valid JSON (Expecting property name enclosed in double quotes")):
        folder = adapter(name, config)
        if message is None:
            check_adapter_folder(folder)  # fine: null is peft's default
            continue
        with pytest.raises(ModelLoadError) as caught:
            check_adapter_folder(folder)
        assert str(caught.value).startswith(f"{folder / 'adapter_config.json'}: {message}")

    locked = adapter("locked", '{"peft_type": "LORA", "r": 4}')
    opened = Path.open

    def refuse(self, *args, **kwargs):
        if self.name.endswith(".safetensors") and self.parent.name in ("locked", "locked-model"):
            raise PermissionError(13, "Permission denied", str(self))
        return opened(self, *args, **kwargs)

    model_copy = tmp_path / "locked-model"
    model_copy.mkdir()
    for f in tiny_model_dir.iterdir():
        (model_copy / f.name).symlink_to(f)
    with monkeypatch.context() as m:
        m.setattr(Path, "open", refuse)
        with pytest.raises(ModelLoadError, match=f"^cannot read {locked / 'adapter_model.safetensors'}: "
                                                 "Permission denied$"):
            check_adapter_folder(locked)
        with pytest.raises(ModelLoadError, match=f"^cannot read {model_copy / 'model.safetensors'}: "
                                                 "Permission denied$"):
            load_causal_lm(model_copy, torch.float32)

    model = load_causal_lm(tiny_model_dir, torch.float32)
    pickled = tmp_path / "pickled"
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(str(pickled))
    (pickled / "adapter_model.safetensors").unlink()
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x02junk that is no pickle of tensors" * 4)
    with pytest.raises(ModelLoadError, match=f"^cannot load the adapter in {pickled} \\(adapter_model.bin\\): "
                                             r"\w+Error: "):
        load_adapter(load_causal_lm(tiny_model_dir, torch.float32), pickled)

    binary = tmp_path / "train.yaml"
    binary.write_bytes(b"\xff\xfe\x00lora_r: 4")
    with pytest.raises(UserError, match=f"^{binary}: not UTF-8 text \\(byte 0xff at offset 0\\)$"):
        read_yaml(str(binary))


def test_a_resume_with_max_steps_at_or_below_the_checkpoint_names_max_steps(tmp_path) -> None:
    """``--set max_steps=3 --resume`` on a run interrupted at step 4 of 8 said the run had finished
    and its adapter was not written; a metrics.jsonl the resume cannot rewrite left a stray copy."""
    from types import SimpleNamespace

    from polar_train.train.trainer import keep_metrics_until

    checkpoint = tmp_path / "run" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4, "max_steps": 8}))
    config = SimpleNamespace(max_steps=3, init_adapter=None)
    with pytest.raises(UserError) as caught:
        train_cli._check_resumable(checkpoint, config)
    # (not "or give a larger one": a larger max_steps is another schedule, which a resume refuses)
    assert str(caught.value) == ("--resume: max_steps=3 is not above checkpoint-4's step 4: leave max_steps as the "
                                 "run had it (8)")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text('{"step": 4}\n{"step": 5}\n')
    def refused(self, target):  # chattr +i on metrics.jsonl: the rename onto it is refused
        raise PermissionError(1, "Operation not permitted")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "replace", refused)
        with pytest.raises(OSError):
            keep_metrics_until(metrics, 4)
    assert metrics.read_text() == '{"step": 4}\n{"step": 5}\n' and not list((tmp_path / "run").glob(".metrics*"))


def test_a_refusal_before_the_weights_comes_before_the_trainer_imports(trajectories, tmp_path) -> None:
    """``polar-train train DATA --model typo`` took 20 s to say "not found": train() imported the
    trainer module (TRL, peft, torch) before its checks ran."""
    script = ("import sys\nfrom polar_train.cli import main\n"
              f"status = main(['train', {str(trajectories)!r}, '--model', {str(tmp_path / 'typo')!r}, "
              f"'--output', {str(tmp_path / 'r')!r}])\n"
              "print(status, sorted(m for m in ('polar_train.train.trainer', 'trl', 'peft', 'torch') "
              "if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.stderr.strip() == f"polar-train train: error: --model {tmp_path / 'typo'}: not found"
    assert proc.stdout.strip() == "2 []"


@pytest.mark.parametrize(("targets", "problem"), [
    ("foo_proj,q_proj", "foo_proj names no module"),
    ("mlp", "mlp names Qwen3MLP blocks, which LoRA cannot adapt"),
    ("all-linear,q_proj", "all-linear stands alone (every linear layer), not in a list of names"),  # "names no module"
])
def test_lora_target_modules_the_model_lacks_are_named_before_the_weights_load(
        trajectories, tiny_model_dir, tmp_path, targets, problem) -> None:
    """peft said "Target modules {'foo_proj'} not found" (or dumped the whole block for ``mlp``)
    only after the weights loaded: minutes for a 4B model."""
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(tmp_path / "r"),
                       "--set", f"lora_target_modules={targets}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"polar-train train: error: lora_target_modules on the model in {tiny_model_dir}: {problem}; its linear "
        "layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj; or all-linear")
    assert "Loading weights" not in proc.stderr + proc.stdout


def test_trls_deprecated_alias_is_taken_without_its_notice(trajectories, tiny_model_dir, tmp_path) -> None:
    """vllm_importance_sampling_cap (TRL's alias of clip_max, checked as it) printed TRL's
    FutureWarning - two lines of TRL's source - before our one-line refusal."""
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(tmp_path / "r"),
                       "--set", "vllm_importance_sampling_cap=-1")
    assert proc.returncode == 2
    assert proc.stderr == ("polar-train train: error: vllm_importance_sampling_cap (the cap of the importance weight) "
                           "must be a finite number above 0, got -1.0\n")


def test_a_second_run_into_the_same_output_meanwhile_is_refused(trajectories, tiny_model_dir, tmp_path,
                                                                 monkeypatch, capsys):
    """Two runs into one --output both said "adapter written"; the second's replaced the first's and
    metrics.jsonl held both runs' steps. A run that finished while another loaded its model is seen
    under the lock. A Ctrl-C while the summary is written leaves no empty train_summary.json (it
    stayed empty: a resume refuses a finished run) and says that the adapter is complete. No real
    training here: ``train`` is replaced, the saving and the locking are real."""
    from transformers.trainer_utils import TrainOutput

    from polar_train.train.trainer import RecordedGRPOTrainer

    monkeypatch.setattr(RecordedGRPOTrainer, "train", lambda self, *a, **k: TrainOutput(0, 0.0, {}))
    out = tmp_path / "run"
    first, _, _ = train_cli.build_trainer(_args(trajectories, tiny_model_dir, out))  # holds the folder
    capsys.readouterr()
    with pytest.raises(UserError, match=f"^another polar-train train is writing into {out}; wait for it to end"):
        train_cli.run(_args(trajectories, tiny_model_dir, out))
    first.polar_run_lock.close()

    from polar_train import model_load

    loading = model_load.load_causal_lm
    later = tmp_path / "later"

    def another_run_finishes_meanwhile(*args, **kwargs):
        later.mkdir(mode=0o700)
        (later / "metrics.jsonl").write_text("{}\n")
        return loading(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(model_load, "load_causal_lm", another_run_finishes_meanwhile)
        with pytest.raises(UserError, match=f"^{later} already holds a run \\(written while this one loaded"):
            train_cli.run(_args(trajectories, tiny_model_dir, later))
    assert (later / "metrics.jsonl").read_text() == "{}\n"

    replace = Path.replace

    def ctrl_c_at_the_summary(self, target):
        if Path(target).name == "train_summary.json":
            raise KeyboardInterrupt
        return replace(self, target)

    summary_cut = tmp_path / "summary-cut"
    with monkeypatch.context() as m:
        m.setattr(Path, "replace", ctrl_c_at_the_summary)
        with pytest.raises(KeyboardInterrupt):
            train_cli.run(_args(trajectories, tiny_model_dir, summary_cut))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"polar-train train: interrupted after the adapter was written ({summary_cut / 'adapter'} is complete); "
        "train_summary.json not written")
    assert (summary_cut / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in summary_cut.iterdir() if "summary" in p.name) == []
    from polar_train.folder_lock import hold_folder_lock

    for folder in (out, summary_cut):  # the runs let their locks go (refused, interrupted, or done)
        hold_folder_lock(folder, train_cli.RUN_LOCK, "held").close()

    # a resume picks its checkpoint before the model loads (minutes for a large one): a run that went
    # on meanwhile is seen under the lock (it resumed from the stale checkpoint, cut the other's metrics)
    going = tmp_path / "going"
    trainer, _, _ = train_cli.build_trainer(_args(trajectories, tiny_model_dir, going, "max_steps=3"))
    trainer.create_optimizer_and_scheduler(num_training_steps=3)
    trainer.state.global_step = 1
    trainer._save_checkpoint(trainer.model, None)
    trainer.polar_run_lock.close()

    def the_other_run_saves_step_2(*args, **kwargs):
        import shutil

        shutil.copytree(going / "checkpoint-1", going / "checkpoint-2")
        state = json.loads((going / "checkpoint-2" / "trainer_state.json").read_text())
        (going / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({**state, "global_step": 2}))
        return loading(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(model_load, "load_causal_lm", the_other_run_saves_step_2)
        with pytest.raises(UserError, match=f"^--resume: the run in {going} went on while this one loaded its model "
                                            "\\(its newest complete checkpoint is now checkpoint-2\\)"):
            train_cli.run(_args(trajectories, tiny_model_dir, going, "max_steps=3", resume=True))


def test_two_processes_train_one_run_data_parallel(tiny_model_dir, tmp_path) -> None:
    """train.md says ``accelerate launch -m polar_train.train ...`` trains data-parallel; never run
    before (CI has one CPU device, no GPU). ``torchrun`` with two CPU processes is that path (gloo
    for NCCL): the two share each step's groups, and the run's files and lines come from one of
    them (each used to print the data report; metrics, marker and adapter must not be doubled)."""
    from tests.support.procs import VENV_BIN, free_port

    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()), "-m", "polar_train.train",
                           str(Path(__file__).parents[1] / "data" / "samples" / "demo" / "trajectories"),
                           "--model", str(tiny_model_dir), "--output", str(out), "--set", "max_steps=2",
                           "--set", "report_to=none"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("data: ") and "trajectories in" in line for line in lines) == 1
    assert sum(line.startswith("trained 2 steps; adapter written to") for line in lines) == 1
    summary = json.loads((out / "train_summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]  # one process writes them
    groups = summary["data"]["rows_out"]  # GRPO groups; a step takes one per process (batch = a group)
    assert metrics[0]["epoch"] == pytest.approx(2 / groups)  # one process alone: 1 / groups per step
    assert summary["steps"] == 2 and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_two_processes_resumed_mid_epoch_train_what_the_uninterrupted_run_trained(tiny_model_dir, tmp_path) -> None:
    """Two processes, four groups (two a step, so two steps an epoch), resumed from checkpoint-3:
    the sampler, wrapped twice there (SkipBatchSampler(BatchSamplerShard(...))), never heard its
    epoch, and step 4 trained step 2's groups again (a review)."""
    import shutil

    from safetensors.torch import load_file

    from tests.support.procs import VENV_BIN, free_port

    data = tmp_path / "traj"
    sample_trajectories(tiny_model_dir, data, num_tasks=4, group_size=4, turn_tokens=(5, 3), seed=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

    def train(out: Path, *extra: str) -> None:
        proc = subprocess.run([str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                               "--master_port", str(free_port()), "-m", "polar_train.train", str(data),
                               "--output", str(out), "--model", str(tiny_model_dir), "--set", "max_steps=4",
                               "--set", "save_steps=1", "--set", "learning_rate=1e-3", "--set", "report_to=none",
                               *extra], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

    full, cut = tmp_path / "full", tmp_path / "cut"
    train(full)
    train(cut)
    shutil.rmtree(cut / "checkpoint-4")
    shutil.rmtree(cut / "adapter")
    (cut / "train_summary.json").unlink()
    train(cut, "--resume")

    def rewards(out: Path) -> list[float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [round(r["reward"], 6) for r in rows if "reward" in r]

    assert rewards(cut) == rewards(full) and len(rewards(full)) == 4
    a, b = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (full, cut))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_the_run_files_are_on_disk_before_their_names(trajectories, tiny_model_dir, tmp_path, monkeypatch) -> None:
    """A rename can reach the disk before the data of the file it names: after a power cut the
    adapter, the summary or the marker were there by name and empty. Each is flushed under its
    temporary name, and its folder after the rename. No real training: the saving is real."""
    from transformers.trainer_utils import TrainOutput

    from polar_train.train.trainer import RecordedGRPOTrainer
    from tests.support.fsync import recorded_fsyncs

    monkeypatch.setattr(RecordedGRPOTrainer, "train", lambda self, *a, **k: TrainOutput(0, 0.0, {}))
    synced = recorded_fsyncs(monkeypatch)
    out = tmp_path / "run"
    train_cli.run(_args(trajectories, tiny_model_dir, out))
    names = [Path(p).name for p in synced]
    assert any(n.startswith(f".{train_cli.RUN_MARKER}.") for n in names)
    assert any(n.startswith(".train_summary.json.") for n in names)
    weights = [p for p in synced if Path(p).name == "adapter_model.safetensors"]
    assert weights and all(Path(p).parent.name.startswith(".adapter.partial-") for p in weights)
    assert synced.count(str(out)) >= 3  # the folder after each rename: marker, adapter, summary


def test_a_failed_flush_of_the_marker_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    """An fsync error (EIO) left the marker's temporary file, and the next run into the folder was
    refused as "holds no run of ours"; a file system that cannot flush at all (EINVAL) is no error."""
    import errno

    from polar_train import durable

    def failing(code: int):
        def fsync(fd: int) -> None:
            raise OSError(code, os.strerror(code))
        return fsync

    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(durable.os, "fsync", failing(errno.EIO))
    with pytest.raises(OSError):
        train_cli._write_marker(out, {"model": "m"})
    assert sorted(p.name for p in out.iterdir()) == []
    monkeypatch.setattr(durable.os, "fsync", failing(errno.EINVAL))
    train_cli._write_marker(out, {"model": "m"})
    assert sorted(p.name for p in out.iterdir()) == [train_cli.RUN_MARKER]


def test_a_resume_with_the_same_scheduler_kwargs_in_another_order_is_the_same_run(tmp_path) -> None:
    """The marker recorded ``lr_scheduler_kwargs`` as JSON in the order given: a resume with the
    same mapping in another order was refused as another schedule (markers of earlier versions
    hold the given order: compared by content)."""
    from types import SimpleNamespace

    out = tmp_path / "run"
    out.mkdir()
    def config(kwargs):
        return SimpleNamespace(**{**{key: None for key in train_cli.RESUME_FIXED}, "lr_scheduler_kwargs": kwargs})

    first = train_cli.run_options(config({"min_lr": 1e-7, "num_cycles": 2}))
    for recorded in (first["lr_scheduler_kwargs"], '{"min_lr": 1e-07, "num_cycles": 2}'):  # ours; an earlier version's
        (out / train_cli.RUN_MARKER).write_text(json.dumps({"options": {**first, "lr_scheduler_kwargs": recorded}}))
        train_cli._check_same_options(out, train_cli.run_options(config({"num_cycles": 2, "min_lr": 1e-7})))
        with pytest.raises(UserError, match=r"^--resume: lr_scheduler_kwargs=\{\"min_lr\": 1e-07, \"num_cycles\": 3\}"):
            train_cli._check_same_options(out, train_cli.run_options(config({"num_cycles": 3, "min_lr": 1e-7})))


def test_a_run_that_diverges_stops_at_that_step_and_saves_no_nan_checkpoint(trajectories, tiny_model_dir, tmp_path):
    """A learning rate of 1e30 made the adapter NaN at step 2; the run went on to max_steps, saved
    NaN checkpoints, logged a loss of 0, and only its end said so: the training notebook then
    offered the last checkpoint (all NaN) to continue from. Real training, a few tiny steps."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                       "--set", "learning_rate=1e30", "--set", "optim=sgd", "--set", "max_steps=4",
                       "--set", "save_steps=1", "--set", "per_device_train_batch_size=4",
                       "--set", "gradient_accumulation_steps=1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    step = int(re.match(r"polar-train train: error: training diverged at step (\d+): non-finite adapter weights "
                        r"\(\d+ of \d+ tensors, e\.g\. [\w.]+\); stopped before saving them; ", line)[1])
    assert step < 4 and not (out / "adapter").exists() and not (out / "train_summary.json").exists()
    saved = sorted(out.glob("checkpoint-*"))
    assert [d.name for d in saved] == [f"checkpoint-{n}" for n in range(1, step)]
    for checkpoint in saved:
        assert all(bool(torch.isfinite(t).all()) for t in load_file(checkpoint / "adapter_model.safetensors").values())
    assert saved, line  # (the first step's update is finite here: one checkpoint to go on from)
    assert f"{saved[-1].name} holds the weights before (a new --output with --set init_adapter={saved[-1]}" in line
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step and rows[-1]["error"].startswith(f"training diverged at step {step}: ")


def test_the_last_steps_after_the_last_logging_step_are_logged(trajectories, tiny_model_dir, tmp_path):
    """With logging_steps=2 and 3 steps, step 3's loss and gradient norm were in no row of
    metrics.jsonl (TRL folded its other metrics into the totals row): the run's end was seen only
    as the average train_loss (a session's own check). Real training, three tiny steps."""
    out = tmp_path / "run"
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                       "--set", "max_steps=3", "--set", "logging_steps=2", "--set", "per_device_train_batch_size=4",
                       "--set", "gradient_accumulation_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 3]
    assert [r["step"] for r in rows if "grad_norm" in r] == [2, 3]
    last = next(r for r in rows if r["step"] == 3 and "loss" in r)
    assert "reward" in last and "sampling/sampling_logp_difference/mean" in last
    assert [r["step"] for r in rows if "train_runtime" in r] == [3]


def test_a_run_whose_policy_saturated_says_which_steps_learned_nothing(trajectories, tiny_model_dir, tmp_path):
    """A learning rate of 1e12 made every distribution uniform after step 1; every later gradient
    was 0 though rewards differed, and the run exited 0 with an adapter no later step changed,
    unsaid (a probe). Real training, a few tiny steps; the healthy run's summary has no such step."""
    out = tmp_path / "run"
    proc = polar_train("train", str(trajectories), "--model", str(tiny_model_dir), "--output", str(out),
                       "--set", "learning_rate=1e12", "--set", "max_steps=3", "--set", "per_device_train_batch_size=4",
                       "--set", "gradient_accumulation_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"grad_norm"' in x]
    assert rows[0]["grad_norm"] > 0 and all(r["grad_norm"] == 0 and r["frac_reward_zero_std"] < 1 for r in rows[1:])
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["stalled_steps"] == [2, 3]
    assert ("polar-train train: warning: 2 logged steps (2..3) learned nothing: gradient norm 0 although rewards differed "
            "within a group and no token was clipped - the policy saturated (learning_rate 1e+12 too high?)") in proc.stderr
    from polar_train.train.trainer import stall_warning, stalled_steps

    healthy = [{"step": 1, "grad_norm": 0.3, "frac_reward_zero_std": 0.0},
               {"step": 2, "grad_norm": 0.0, "frac_reward_zero_std": 1.0},  # nothing to learn: no stall
               {"step": 3, "grad_norm": 0.0, "frac_reward_zero_std": 0.5, "clip_ratio/region_mean": 0.2},  # clipped
               {"step": 4, "train_runtime": 1.0},
               # every token masked by the sampler correction, or weighed ~1e-42: another policy sampled the data
               # (the mismatch warning's case), not a saturated one (a probe: "learning_rate 1e-06 too high?")
               {"step": 5, "grad_norm": 0.0, "frac_reward_zero_std": 0.0,
                "sampling/importance_sampling_ratio/clipped_frac": 1.0},
               {"step": 6, "grad_norm": 0.0, "frac_reward_zero_std": 0.0, "sampling/importance_sampling_ratio/max": 1e-42}]
    assert stalled_steps(healthy) == [] and stall_warning([], 1e-5) is None


def test_a_nan_adapter_is_refused_as_init_adapter_and_skipped_as_a_checkpoint(tiny_model_dir, tmp_path):
    """Checkpoints an earlier version saved after a run diverged hold NaN weights: the training
    notebook and --resume took the newest one, and init_adapter= it trained (or served) NaNs."""
    from peft import LoraConfig, get_peft_model

    from polar_train.model_load import ModelLoadError, load_adapter, load_causal_lm

    run = tmp_path / "run"
    for step in (1, 2):
        peft_model = get_peft_model(load_causal_lm(tiny_model_dir, torch.float32),
                                    LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
        if step == 2:
            with torch.no_grad():
                next(p for n, p in peft_model.named_parameters() if "lora_B" in n).fill_(float("nan"))
        checkpoint = run / f"checkpoint-{step}"
        peft_model.save_pretrained(str(checkpoint))
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (checkpoint / "optimizer.pt").write_bytes(b"")
    last, skipped = train_cli.complete_checkpoint(run, resumable=False)
    assert last == run / "checkpoint-1"
    assert skipped == ["checkpoint-2 (adapter_model.safetensors holds non-finite weights (the run diverged))"]
    with pytest.raises(ModelLoadError, match=re.escape(
            f"cannot load the adapter in {run / 'checkpoint-2'}: 1 of its tensors hold NaN or infinite values (e.g. ")):
        load_adapter(load_causal_lm(tiny_model_dir, torch.float32), run / "checkpoint-2")
    assert load_adapter(load_causal_lm(tiny_model_dir, torch.float32), run / "checkpoint-1") is not None


def test_metrics_name_the_values_that_were_nan_or_infinite(tmp_path) -> None:
    """A NaN loss was written as null, which also means "no value" (a step without sampler
    logprobs): the training notebook read a diverging run's NaNs as missing logprobs."""
    from types import SimpleNamespace

    from polar_train.train.trainer import MetricsFileCallback

    path = tmp_path / "metrics.jsonl"
    callback = MetricsFileCallback(path)
    state = SimpleNamespace(is_world_process_zero=True, global_step=3, epoch=1.0)
    callback.on_log(None, state, None, logs={"loss": float("nan"), "grad_norm": float("inf"), "reward": 0.5,
                                             DIFF_KEY: None})
    callback.on_log(None, state, None, logs={"loss": 0.25})
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["loss"] is None and first["grad_norm"] is None and first[DIFF_KEY] is None
    assert first["non_finite"] == ["loss", "grad_norm"] and first["reward"] == 0.5
    assert second["loss"] == 0.25 and "non_finite" not in second


DIFF_KEY = "sampling/sampling_logp_difference/mean"


def test_the_divergence_message_names_the_last_good_checkpoint_up_to_its_step(tmp_path) -> None:
    """The review: the message named the highest-numbered checkpoint folder - a NaN one an earlier
    version saved, one of a later step from an earlier try, or an empty folder."""
    from safetensors.torch import save_file

    from polar_train.train.trainer import last_good_checkpoint

    def checkpoint(step: int, value: float | None) -> None:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if value is not None:
            save_file({"base_model.model.q_proj.lora_B.weight": torch.full((2, 2), value)},
                      str(folder / "adapter_model.safetensors"))
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))

    checkpoint(2, 0.5)
    checkpoint(3, float("nan"))
    checkpoint(4, None)  # a save cut short
    checkpoint(6, 0.25)  # beyond the step the run diverged at (an earlier try's)
    assert last_good_checkpoint(tmp_path, 5) == tmp_path / "checkpoint-2"
    assert last_good_checkpoint(tmp_path, 6) == tmp_path / "checkpoint-6"
    assert last_good_checkpoint(tmp_path, 1) is None


def test_a_save_cut_short_says_why_not_torchs_zip_writer() -> None:
    """A checkpoint save under a file-size limit (a full disk, a quota) ended in "[enforce fail at
    inline_container.cc:672] . unexpected pos 199488 vs 199376": torch's zip writer drops the OSError."""
    from polar_train.train.cli import save_error

    torch_says = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 199488 vs 199376")
    assert save_error(torch_says) == ("the file was cut short while written (a full disk, a quota or a file-size "
                                      "limit?)")
    assert save_error(OSError(28, "No space left on device", "x.pt")) == "No space left on device: x.pt"


def test_a_run_started_before_the_rollout_baseline_is_not_resumed_under_it(tmp_path) -> None:
    """A run begun before `advantage_baseline` existed trained with TRL's per-trajectory baseline;
    resumed under the new default its remaining steps switched baseline, said only as "not checked"."""
    from types import SimpleNamespace

    out = tmp_path / "run"
    out.mkdir()

    def options(baseline):
        return train_cli.run_options(SimpleNamespace(**{**{key: None for key in train_cli.RESUME_FIXED},
                                                        "advantage_baseline": baseline}))

    older = {k: v for k, v in options("trajectory").items() if k != "advantage_baseline"}
    (out / train_cli.RUN_MARKER).write_text(json.dumps({"options": older}))
    with pytest.raises(UserError, match=r"^--resume: advantage_baseline=rollout \(the run: trajectory, before the "
                                        r"option existed\)"):
        train_cli._check_same_options(out, options("rollout"))
    train_cli._check_same_options(out, options("trajectory"))
    (out / train_cli.RUN_MARKER).write_text(json.dumps({"options": options("rollout")}))
    train_cli._check_same_options(out, options("rollout"))
