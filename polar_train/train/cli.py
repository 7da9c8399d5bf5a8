"""``polar-train train DATA --model M --output O``: GRPO + LoRA on recorded trajectories.

Why every check runs before the model loads: a bad capture (no rewards, no trainable tokens,
ids beyond the vocabulary, a temperature the trainer cannot reproduce) must fail in seconds
with one line, not after minutes of loading or, worse, train on wrong ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from ..cli import UserError
from ..paths import cannot_write_folder, holds_other_files
from ..tokenizer import TOKENIZER_FILES, holds_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="folder of trajectory Parquet parts (or one .parquet file)")
    p.add_argument("--model", required=True, help="base model directory (or HF model dir)")
    p.add_argument("--output", required=True, help="run folder: checkpoints, metrics, final adapter")
    p.add_argument("--config", default=None, help="train.yaml: GRPOConfig + LoRA + polar options")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one option (repeatable), e.g. --set learning_rate=1e-5")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a LoRA adapter with GRPO on captured trajectories")
    add_arguments(p)
    p.set_defaults(func=run)


def _model_vocab_size(model: str) -> int:
    from transformers import AutoConfig

    from ..model_load import first_line

    try:
        cfg = AutoConfig.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - e.g. a config.json of wrong types (huggingface_hub's own error)
        raise UserError(f"--model {model}: not a model directory ({first_line(exc)})") from None
    return int(cfg.get_text_config().vocab_size)


def _check_temperature(config, report) -> None:
    recorded = report.temperatures
    t = float(config.temperature)
    if config.sampler_logprobs == "raw" and abs(t - 1.0) > 1e-4 and not config.allow_temperature_mismatch:
        raise UserError(
            f"temperature {t:g} with raw sampler logprobs: raw logprobs (vLLM's default) are of the "
            "unscaled distribution and match the trainer's only at temperature 1; capture with vLLM "
            "--logprobs-mode processed_logprobs and --set sampler_logprobs=processed "
            "(or --set allow_temperature_mismatch=true)")
    mismatched = [r for r in recorded if abs(r - t) > 1e-3]
    if mismatched and not config.allow_temperature_mismatch:
        shown = ", ".join(f"{r:g}" for r in recorded)
        raise UserError(
            f"temperature {t:g} differs from the sampling temperature recorded in the trajectories "
            f"({shown}): set --set temperature={recorded[0]:g} (or --set allow_temperature_mismatch=true)")


def prepare(args: argparse.Namespace):
    """Config + checked, grouped data, before any model weights are loaded."""
    from .data import DataReport, load_trajectories, make_groups, modal_group_size, parquet_files

    parquet_files(args.data)  # a missing or empty folder fails before the slow imports
    if not Path(args.model).exists():
        raise UserError(f"--model {args.model}: not found")
    if Path(args.model).is_dir() and not holds_tokenizer(args.model):
        # transformers would build an empty tokenizer without a word, and save it with every checkpoint
        raise UserError(f"--model {args.model}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); the model folder "
                        "supplies the tokenizer too")
    from .config import load_config, user_options

    raw = user_options(args.config, args.sets)
    vocab = _model_vocab_size(args.model)
    report = DataReport()
    trajs = load_trajectories(args.data, vocab_size=vocab,
                              max_completion_length=_max_completion_length(raw), report=report)
    # options the data decides when the user did not: the group size, one group per micro-batch
    g = raw["num_generations"] if "num_generations" in raw else max(2, modal_group_size(trajs))
    defaults = {"num_generations": g, "per_device_train_batch_size": g}
    config = load_config(args.config, args.sets, args.output,
                         {k: v for k, v in defaults.items() if k not in raw})
    grouped = make_groups(trajs, num_generations=config.num_generations, policy=config.unequal_groups,
                          min_group_size=config.min_group_size, seed=config.seed, report=report)
    _check_temperature(config, report)  # the temperatures of what is trained (not of dropped groups)
    return config, grouped, report


def _max_completion_length(raw: dict[str, Any]) -> int | None:
    from .config import TrainConfig

    value = raw.get("max_completion_length", TrainConfig.max_completion_length)
    if value in (None, "None", "none", "null"):
        return None
    try:
        length = int(value)
    except (TypeError, ValueError):
        raise UserError(f"max_completion_length must be an integer, got {value!r}") from None
    if length < 1:  # read before the config is built: the data would all be cut to nothing
        raise UserError(f"max_completion_length must be >= 1, got {length}")
    return length


#: Marks a folder as a run's output (one that stopped before its metrics may be started again).
RUN_MARKER = ".polar-train-run"


def _check_output(out: Path, resume: bool, config) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    if (problem := cannot_write_folder(out, "--output")) is not None:
        raise UserError(problem)
    if resume:
        last = get_last_checkpoint(str(out)) if out.is_dir() else None
        if last is None:
            raise UserError(f"--resume: no checkpoint-* folder in {out}")
        _check_resumable(Path(last), config)
        return last
    if (out / "adapter").exists() or (out / "metrics.jsonl").exists():
        raise UserError(f"{out} already holds a run: use --resume or another --output")
    if holds_other_files(out, RUN_MARKER):
        # TRL writes its model card as README.md there, and runs/ and checkpoint-*/: a user's would go
        raise UserError(f"--output {out} is not empty and holds no run of ours: give a new or empty folder")
    return None


def _check_resumable(checkpoint: Path, config) -> None:
    """Refuse a resume that cannot do what the user asks, before the weights load: a run that
    already finished (its saved schedule ends at learning rate 0: the trainer took one more step
    that changed nothing and called it trained, also with a higher ``max_steps``), or a LoRA of
    another shape than the checkpoint's (torch's size-mismatch traceback)."""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        step, planned = int(state.get("global_step", 0)), int(state.get("max_steps") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        raise UserError(f"--resume: {checkpoint} has no readable trainer_state.json") from None
    if not isinstance(state.get("max_steps", 0), int):  # "3" would reach the trainer: a TypeError there
        raise UserError(f"--resume: {checkpoint}/trainer_state.json: max_steps is not a number")
    if (config.max_steps > 0 and step >= config.max_steps) or (planned > 0 and step >= planned):
        # resuming continues the saved optimizer and schedule, which ended at learning rate 0
        raise UserError(f"--resume: the run in {checkpoint.parent} finished (step {step} of {planned or step}); "
                        f"to train its adapter further, start a new run from it: --set "
                        f"init_adapter={checkpoint.parent / 'adapter'} --output NEW_FOLDER")
    if config.init_adapter:
        return  # its own LoRA shape, checked when it loads
    try:
        saved = json.loads((checkpoint / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return  # not a LoRA checkpoint of ours: the trainer says what it finds
    wanted = {"lora_r": (saved.get("r"), config.lora_r), "lora_alpha": (saved.get("lora_alpha"), config.lora_alpha)}
    changed = [f"{k}={now} (checkpoint: {then})" for k, (then, now) in wanted.items() if then is not None and then != now]
    targets, saved_targets = config.lora_target_modules, saved.get("target_modules")
    if targets != ["all-linear"] and isinstance(saved_targets, (list, str)):  # all-linear: peft saves the names
        then = {saved_targets} if isinstance(saved_targets, str) else set(saved_targets)
        if set(targets) != then:
            changed.append(f"lora_target_modules={','.join(targets)} (checkpoint: {','.join(sorted(then))})")
    if changed:
        raise UserError(f"--resume: {', '.join(changed)}: a resumed run keeps its LoRA shape; give the "
                        "checkpoint's values or start a new --output")


def build_trainer(args: argparse.Namespace):
    """Checked config and data, the model with its LoRA, and the trainer - not yet trained.

    Returns ``(trainer, report, checkpoint)``; ``checkpoint`` is what ``--resume`` continues.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' own deprecation notices, raised from inside TRL: noise for a user of this command
    warnings.filterwarnings("ignore", message=r".*deprecated and will be removed in v6", category=FutureWarning)
    config, grouped, report = prepare(args)
    out = Path(args.output)
    checkpoint = _check_output(out, args.resume, config)
    if config.init_adapter:
        from ..model_load import ModelLoadError, check_adapter_folder

        try:
            check_adapter_folder(config.init_adapter)
        except ModelLoadError as exc:
            raise UserError(f"init_adapter: {exc}") from None
    for line in report.lines():
        print(line, flush=True)

    import torch
    from transformers import AutoTokenizer

    from ..model_load import load_adapter, load_causal_lm
    from .trainer import MetricsFileCallback, MismatchCheckpointCallback, RecordedGRPOTrainer, keep_metrics_until

    dtype = torch.bfloat16 if config.bf16 else torch.float32
    model = load_causal_lm(args.model, dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    peft_config = None
    if config.init_adapter:
        model = load_adapter(model, config.init_adapter, is_trainable=True)
    else:
        peft_config = config.lora_config()
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_MARKER).touch()
    if checkpoint is not None and os.environ.get("RANK", "0") == "0":  # the steps after it are logged again;
        # by the one process that writes metrics.jsonl (accelerate launch starts one per GPU)
        keep_metrics_until(out / "metrics.jsonl", int(Path(checkpoint).name.rsplit("-", 1)[-1]))
    trainer = RecordedGRPOTrainer(model=model, args=config, processing_class=tok, peft_config=peft_config,
                                  data=grouped, callbacks=[MetricsFileCallback(out / "metrics.jsonl")])
    trainer.add_callback(MismatchCheckpointCallback(trainer))
    return trainer, report, checkpoint


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run training; returns the summary that is also written to ``<output>/train_summary.json``."""
    from .trainer import restore_first_epoch_mismatch

    trainer, report, checkpoint = build_trainer(args)
    out = Path(args.output)
    # a resumed run's first step was taken before the checkpoint: its value comes from there
    first_step_known = checkpoint is None or restore_first_epoch_mismatch(trainer, checkpoint)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    result = trainer.train(resume_from_checkpoint=checkpoint)
    changed = max((float((p.detach() - before[n]).abs().max()) for n, p in trainer.model.named_parameters()
                   if n in before), default=0.0)
    adapter_dir = out / "adapter"
    trainer.save_model(str(adapter_dir))
    mism = trainer.first_epoch_mismatch
    measured = [v for v in mism if math.isfinite(v)]  # NaN: a step with no sampler logprob to compare
    first = mism[0] if first_step_known and mism and math.isfinite(mism[0]) else None
    summary = {
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "adapter": str(adapter_dir.resolve()),
        "trajectories": str(Path(args.data).expanduser().resolve()),
        "model": str(Path(args.model).expanduser().resolve()),
        "resumed_from": str(Path(checkpoint).resolve()) if checkpoint else None,
        "adapter_max_abs_change": changed,
        "logprob_mismatch_first_step": first,
        "logprob_mismatch_first_epoch_mean": sum(measured) / len(measured) if measured and first_step_known else None,
        "data": report.__dict__,
    }
    if trainer.accelerator.is_main_process:
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        print(f"trained {summary['steps']} steps; adapter written to {adapter_dir}", flush=True)
        if first is not None:
            print(f"logprob mismatch |trainer - sampler| (mask-1 tokens): first step {first:.3g}, "
                  f"first-epoch mean {summary['logprob_mismatch_first_epoch_mean']:.3g}", flush=True)
    return summary


def run(args: argparse.Namespace) -> int:
    train(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry of ``python -m polar_train.train`` / ``accelerate launch -m polar_train.train``."""
    from ..cli import main as polar_main

    return polar_main(["train", *(sys.argv[1:] if argv is None else argv)])
