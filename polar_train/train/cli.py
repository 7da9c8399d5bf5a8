"""``polar-train train DATA --model M --output O``: GRPO + LoRA on recorded trajectories.

Why every check runs before the model loads: a bad capture (no rewards, no trainable tokens,
ids beyond the vocabulary, a temperature the trainer cannot reproduce) must fail in seconds
with one line, not after minutes of loading or, worse, train on wrong ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..cli import UserError, said_interrupted, signal_status
from ..durable import sync_file, sync_folder, sync_tree
from ..paths import RUN_MARKER, cannot_write_folder, holds_other_files, make_private_dir, user_path
from ..tokenizer import TOKENIZER_FILES, holds_tokenizer


class TrainFailure(Exception):
    """A failure once training has begun, not caused by the input (a full disk while saving, weights
    that became NaN): printed as one line, exit status 1 (:data:`EXIT_FAILED`)."""


#: Exit status of a run that failed while training or saving (bad input is 2, an interrupt 130).
EXIT_FAILED = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", type=user_path, help="folder of trajectory Parquet parts (or one .parquet file)")
    p.add_argument("--model", required=True, type=user_path, help="base model directory (or HF model dir)")
    p.add_argument("--output", required=True, type=user_path, help="run folder: checkpoints, metrics, final adapter")
    p.add_argument("--config", default=None, type=user_path, help="train.yaml: GRPOConfig + LoRA + polar options")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one option (repeatable), e.g. --set learning_rate=1e-5")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a LoRA adapter with GRPO on captured trajectories")
    add_arguments(p)
    p.set_defaults(func=run)


def _text_config(model: str):
    """The model's text config (its vocabulary's size, its width), or the user's one-line error
    where ``model`` is no model folder."""
    from transformers import AutoConfig

    from ..model_load import first_line

    try:
        return AutoConfig.from_pretrained(model).get_text_config()
    except Exception as exc:  # noqa: BLE001 - e.g. a config.json of wrong types (huggingface_hub's own error)
        adapter = (f"; it holds a peft adapter: give its base model as --model, with --set init_adapter={model}"
                   if (Path(model).expanduser() / "adapter_config.json").is_file() else "")
        raise UserError(f"--model {model}: not a model directory ({first_line(exc)}){adapter}") from None


def _model_vocab_size(model: str) -> int:
    return int(_text_config(model).vocab_size)


def _model_width(model: str) -> int | None:
    """The model's hidden size (its text model's), or None where its config does not say."""
    width = getattr(_text_config(model), "hidden_size", None)
    return width if isinstance(width, int) and width > 0 else None


def _check_temperature(config, report) -> None:
    """Refuse a training temperature the recorded logprobs do not fit, unless allow_temperature_mismatch
    (then ``report.temperature_mismatch_allowed`` says it let one through)."""
    recorded = report.temperatures
    t = float(config.temperature)
    report.temperature_mismatch_allowed = bool(config.allow_temperature_mismatch) and (
        (config.sampler_logprobs == "raw" and abs(t - 1.0) > 1e-4) or any(abs(r - t) > 1e-3 for r in recorded))
    if config.sampler_logprobs == "raw" and abs(t - 1.0) > 1e-4 and not config.allow_temperature_mismatch:
        raise UserError(
            f"temperature {t:g} with raw sampler logprobs: raw logprobs (vLLM's default) are of the "
            "unscaled distribution and match the trainer's only at temperature 1; capture with vLLM "
            "--logprobs-mode processed_logprobs and --set sampler_logprobs=processed "
            "(or --set allow_temperature_mismatch=true)")
    mismatched = [r for r in recorded if abs(r - t) > 1e-3]
    if mismatched and not config.allow_temperature_mismatch:
        shown = ", ".join(f"{r:g}" for r in recorded)
        if len(recorded) > 1:  # no one temperature fits: naming the first sent the user into the next error
            raise UserError(
                f"the trajectories record several sampling temperatures ({shown}) and one run trains at one "
                "temperature: split or filter the trajectories by temperature and train each part with its "
                "--set temperature=T (or --set allow_temperature_mismatch=true)")
        r = recorded[0]
        if r < 1e-6:  # the next run's --set temperature=0 is refused: GRPO needs sampled data
            raise UserError(
                f"the trajectories were sampled greedily (temperature {shown}): GRPO learns from how sampled "
                "trajectories of a task differ, and greedy ones do not (their logprobs are of no sampling "
                "distribution either); capture again at temperature 1 (or --set allow_temperature_mismatch=true)")
        if config.sampler_logprobs == "raw" and abs(r - 1.0) > 1e-4:  # --set temperature=r alone is refused next
            raise UserError(
                f"temperature {t:g} differs from the sampling temperature recorded in the trajectories ({shown}), "
                "and raw sampler logprobs (vLLM's default) describe the unscaled distribution, not one at "
                f"{r:g}: data captured with vLLM --logprobs-mode processed_logprobs trains with --set "
                f"temperature={r:g} --set sampler_logprobs=processed; raw data needs capturing again (at "
                "temperature 1, or with processed logprobs) (or --set allow_temperature_mismatch=true)")
        raise UserError(
            f"temperature {t:g} differs from the sampling temperature recorded in the trajectories "
            f"({shown}): set --set temperature={r:g} (or --set allow_temperature_mismatch=true)")


def prepare(args: argparse.Namespace):
    """Config + checked, grouped data, before any model weights are loaded."""
    from .data import DataReport, load_trajectories, make_groups, modal_group_size, parquet_files

    for what, value in (("DATA", args.data), ("--model", args.model), ("--output", args.output)):
        if not str(value).strip():  # Path("") is the current folder: DATA read every Parquet file under it
            raise UserError(f"{what} is empty: name the folder (\".\" for the current one)")
    parquet_files(args.data)  # a missing or empty folder fails before the slow imports
    if not Path(args.model).exists():
        raise UserError(f"--model {args.model}: not found")
    if not Path(args.model).is_dir():  # a file: transformers took it for a hub repo id
        raise UserError(f"--model {args.model}: not a folder; name the model's folder (config.json, weights, tokenizer)")
    if not holds_tokenizer(args.model):
        # transformers would build an empty tokenizer without a word, and save it with every checkpoint
        from ..model_load import run_folder_hint

        adapter = (f"; it holds a peft adapter (a checkpoint?): give its base model as --model, with --set "
                   f"init_adapter={args.model}" if (Path(args.model) / "adapter_config.json").is_file()
                   else run_folder_hint(args.model, "--set init_adapter={}"))
        raise UserError(f"--model {args.model}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); the model folder "
                        f"supplies the tokenizer too{adapter}")
    from .config import load_config, user_options

    raw = user_options(args.config, args.sets)
    vocab = _model_vocab_size(args.model)
    report = DataReport()
    trajs = load_trajectories(args.data, vocab_size=vocab,
                              max_completion_length=_max_completion_length(raw), report=report)
    # options the data decides when the user did not: the group size, one group per micro-batch
    smallest = max(2, _as_int(raw.get("min_group_size")) or 2)  # (a bad value: load_config names it)
    g = raw["num_generations"] if "num_generations" in raw else max(2, modal_group_size(trajs, smallest))
    defaults = {"num_generations": g, "per_device_train_batch_size": g}
    if _as_int(g) is None:  # not a number: the parser's error must name num_generations, not the copy
        del defaults["per_device_train_batch_size"]
    config = load_config(args.config, args.sets, args.output,
                         {k: v for k, v in defaults.items() if k not in raw})
    report.advantage_baseline = config.advantage_baseline
    if report.split_rewards and config.advantage_baseline == "rollout":  # what is trained, as the run records it
        config.advantage_baseline = "trajectory"  # (a split share is no rollout's value: data line says so)
    grouped = make_groups(trajs, num_generations=config.num_generations, policy=config.unequal_groups,
                          min_group_size=config.min_group_size, seed=config.seed, report=report)
    _check_temperature(config, report)  # the temperatures of what is trained (not of dropped groups)
    have, need = len(grouped.rows) * config.num_generations, config.generation_batch_size
    if need and have < need:  # TRL's sampler then yields no batch: "trained 0 steps", exit 0
        raise UserError(f"a step's generation batch is {need} trajectories (per_device_train_batch_size "
                        f"{config.per_device_train_batch_size} x processes {config.world_size} x steps_per_generation "
                        f"{config.steps_per_generation}); the data makes {have} ({len(grouped.rows)} GRPO groups of "
                        f"{config.num_generations}): nothing would train; lower them")
    if report.zero_reward_std_rows == len(grouped.rows) and _first_process():
        print("polar-train train: warning: every GRPO group has equal rewards: the advantages are all 0, "
              "nothing to learn from (build with other --rewards?)", file=sys.stderr, flush=True)
    dropout = config.lora_dropout
    if config.init_adapter:  # the loaded adapter's own dropout applies (a different one is refused)
        loaded = _adapter_config(config.init_adapter).get("lora_dropout")
        dropout = loaded if isinstance(loaded, (int, float)) and not isinstance(loaded, bool) else dropout
    if dropout > 0 and not config.disable_dropout and _first_process():
        # TRL scores the old policy and the mismatch in train mode: the dropout's noise is in both
        print(f"polar-train train: warning: lora_dropout {dropout:g}: its noise enters the importance "
              "weights, the clip ratios and the logprob mismatch (once the adapter is trained: a later round, "
              "init_adapter); disable_dropout=true leaves it out", file=sys.stderr, flush=True)
    return config, grouped, report


def _as_int(value: Any) -> int | None:
    """``value`` as the config reads a whole number (``4``, ``"4"``, YAML's ``4.0``), else None."""
    try:
        number = float(str(value))
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


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


# RUN_MARKER (paths) marks a folder as a run's output (one that stopped before its metrics may be
# started again); it holds the run's identity (:func:`run_identity`), which ``--resume`` must match.
#: Held by the run writing into the folder (:mod:`polar_train.folder_lock`).
RUN_LOCK = ".polar-train.lock"


def run_identity(model: str, trajectories, init_adapter: str | None = None) -> dict[str, Any]:
    """What a resumed run must continue on: the base model's path, the adapter it started from
    and the trained trajectories (a hash of their sorted ids and their number): another one mixed
    two runs into one adapter."""
    import hashlib

    ids = sorted({t.trajectory_id for t in trajectories})
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
    # the rewards apart: a rebuild with another rewards file keeps every id, and a resume on it
    # trained the second half of the run towards other rewards than the first
    rewards = sorted({(t.trajectory_id, float(t.reward).hex()) for t in trajectories})
    rewards_digest = hashlib.sha256("\n".join(f"{i} {r}" for i, r in rewards).encode()).hexdigest()[:16]
    return {"model": str(Path(model).expanduser().resolve()), "trajectories": len(ids), "data": digest,
            "rewards": rewards_digest, "init_adapter": _resolved(init_adapter),
            "init_adapter_weights": adapter_weights_digest(init_adapter)}


def adapter_weights_digest(adapter: str | None) -> str | None:
    """A hash of an adapter folder's weight files: a resume whose ``init_adapter`` path held another
    adapter by then (the next round's, written to the same place) went on, and its summary measured
    the run's change from the wrong weights (a probe). None: no adapter, or none readable here."""
    import hashlib

    if not adapter:
        return None
    folder = Path(adapter).expanduser()
    digest = hashlib.sha256()
    found = False
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        try:
            with open(folder / name, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            found = True
        except OSError:
            continue
    return digest.hexdigest()[:16] if found else None


#: Options a resume cannot change: the checkpoint's optimizer, schedule and data order hold the
#: run's values (a learning rate given at --resume was ignored unsaid; another max_steps mixed
#: two schedules).
RESUME_FIXED = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "max_steps",
                "num_train_epochs", "weight_decay", "optim", "seed", "num_generations", "per_device_train_batch_size",
                "gradient_accumulation_steps", "steps_per_generation", "loss_type", "beta", "temperature",
                "scale_rewards", "epsilon", "epsilon_high",
                # the loss's importance weights and the data's groups and lengths (a probe resumed with
                # another cap of the sampler weight, which changes the loss as epsilon does, unsaid)
                "importance_sampling_level", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "delta", "sampler_logprobs",
                "max_completion_length", "unequal_groups", "min_group_size", "advantage_baseline", "lora_dropout")


def run_options(config) -> dict[str, Any]:
    """The :data:`RESUME_FIXED` options of ``config`` as the run marker records them (JSON values)."""
    def plain(value: Any) -> Any:
        value = getattr(value, "value", value)  # transformers' enums (optim, lr_scheduler_type)
        return value if isinstance(value, (str, int, float, bool, type(None))) else _canonical_json(value)

    return {key: plain(getattr(config, key, None)) for key in RESUME_FIXED}


def _canonical_json(value: Any) -> str:
    # keys sorted: a resume given the same lr_scheduler_kwargs in another order is the same run
    return json.dumps(value, default=str, sort_keys=True)


def _same_option(saved: Any, now: Any) -> bool:
    """Compare a marker's recorded value with this run's; a mapping an earlier version recorded
    in the order it was given compares by content."""
    if saved == now:
        return True
    if isinstance(saved, str) and isinstance(now, str) and saved[:1] in "{[":
        try:
            return _canonical_json(json.loads(saved)) == now
        except ValueError:
            return False
    return False


def _check_same_options(out: Path, options: dict[str, Any], say: bool = True) -> None:
    """Refuse a resume whose :data:`RESUME_FIXED` options differ from those the run started with
    (a marker of an older version recorded fewer, or none: those are named, not compared)."""
    saved = _saved_marker(out).get("options")
    if not isinstance(saved, dict):
        if say:
            print("resume: the run's marker (an earlier version's) records none of its options: give the values the "
                  "run started with (not checked)", flush=True)
        return
    changed = [f"{key}={options[key]} (the run: {saved[key]})" for key in RESUME_FIXED
               if key in saved and key in options and not _same_option(saved[key], options[key])]
    if "advantage_baseline" not in saved and options.get("advantage_baseline") == "rollout":
        # a run started before the option: its groups' baseline was TRL's, per trajectory
        changed.append("advantage_baseline=rollout (the run: trajectory, before the option existed)")
    # (lora_dropout is compared with the checkpoint's adapter_config.json)
    unknown = [key for key in RESUME_FIXED if key not in saved and key not in ("lora_dropout", "advantage_baseline")]
    if unknown and not changed and say:  # a run an earlier version started: these went unrecorded
        print(f"resume: the run's marker (an earlier version's) records no {', '.join(unknown)}: give the values "
              "the run started with (not checked)", flush=True)
    if changed:
        raise UserError(f"--resume: {', '.join(changed)}: a resumed run continues its checkpoint's optimizer, schedule "
                        "and data order; give the run's values, or start a new --output (init_adapter= a checkpoint "
                        "to go on from its weights)")


def _resolved(path: str | None, what: str = "init_adapter") -> str | None:
    """A path as recorded for a later run to compare with (absolute, ``~`` expanded), or None. A
    loop of symbolic links is one line (``init_adapter=`` one: pathlib's RuntimeError traceback)."""
    if not path:
        return None
    try:
        return str(Path(path).expanduser().resolve())
    except (OSError, RuntimeError):
        raise UserError(f"{what} {path} is a loop of symbolic links") from None


def _saved_marker(out: Path) -> dict[str, Any]:
    """What the run marker in ``out`` recorded; empty for a run of an older version (an empty
    marker) or none: nothing to compare."""
    try:
        saved = json.loads((out / RUN_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def unresumable(out: Path) -> str | None:
    """Why a resume in ``out`` cannot be checked against the run it continues (its marker is
    missing or records no model and data), or None. notebooks/02 asks too, before it advises one."""
    start_anew = ("the resume cannot check it continues the same model and data; start a new --output from a "
                  "checkpoint's weights with --set init_adapter=CHECKPOINT")
    if not (out / RUN_MARKER).is_file():  # nothing to check the model and data against: a resume on
        # other trajectories went on unsaid (a copy made with `cp runs/r1/*` leaves the dot file out)
        return (f"{out} has no {RUN_MARKER} (a folder polar-train train did not write, a run of a polar-train "
                "older than the marker (2026-12-04), or its marker was removed): " + start_anew)
    saved = _saved_marker(out)
    if not saved.get("model") or saved.get("data") is None:
        # the first markers (2026-12-04) were empty: a resume on another model and data went on, and
        # rewrote the marker with them (a probe)
        return (f"the {RUN_MARKER} in {out} records no model and data (an earlier version's marker, or a "
                "damaged one): " + start_anew)
    return None


def _check_same_run(out: Path, identity: dict[str, Any]) -> None:
    if (why := unresumable(out)) is not None:
        raise UserError(f"--resume: {why}")
    saved = _saved_marker(out)
    if saved.get("model") not in (None, identity["model"]):
        raise UserError(f"--resume: the run in {out} trained on --model {saved['model']}, not {identity['model']}: "
                        "resume with the same model, or start a new --output")
    if "init_adapter" in saved and saved["init_adapter"] != identity["init_adapter"]:
        # (a marker of an older version has no such key: its checkpoint's LoRA shape is still checked)
        raise UserError(f"--resume: the run in {out} started from init_adapter={saved['init_adapter'] or '(none: a fresh LoRA)'}"
                        f", not {identity['init_adapter'] or '(none)'}: resume with the same init_adapter, or "
                        "start a new --output")
    if saved.get("init_adapter_weights") not in (None, identity["init_adapter_weights"]):  # (older markers: none)
        raise UserError(f"--resume: init_adapter={identity['init_adapter']} holds other weights than when the run in "
                        f"{out} started (fingerprint {saved['init_adapter_weights']}, now "
                        f"{identity['init_adapter_weights'] or 'none readable'}): the run continues from its "
                        "checkpoint, but measures its change from that adapter; put back the adapter it started from, "
                        "or start a new --output")
    if saved.get("data") is not None and (saved.get("data"), saved.get("trajectories")) != (
            identity["data"], identity["trajectories"]):
        raise UserError(f"--resume: the run in {out} trained on other trajectories ({saved.get('trajectories')} "
                        f"with fingerprint {saved.get('data')}; now {identity['trajectories']} with "
                        f"{identity['data']}): resume with the same data, or start a new --output")
    if saved.get("rewards") is not None and saved["rewards"] != identity["rewards"]:  # older markers: none
        raise UserError(f"--resume: the run in {out} trained on these trajectories with other rewards (rebuilt with "
                        "another rewards file?): resume on the data as it was, or start a new --output")


def _write_marker(out: Path, identity: dict[str, Any]) -> None:
    tmp = out / f".{RUN_MARKER}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(identity) + "\n")
        sync_file(tmp)
        tmp.replace(out / RUN_MARKER)
    except BaseException:  # a stray temp file would make the folder "not ours" to the next run
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(out)


def _checkpoint_problem(folder: Path, resumable: bool = True) -> str | None:
    """Why ``folder`` cannot be resumed from (``resumable=False``: used as an adapter), or None.
    The trainer writes the adapter first and trainer_state.json last: a save cut short (Ctrl-C, a
    full disk) lacks one of them."""
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return "no readable trainer_state.json"
    if not isinstance(state, dict):
        return "no readable trainer_state.json"
    return _weights_problem(folder) or (_resume_state_problem(folder) if resumable else None)


#: What a resume reads besides the weights: torch zip archives (transformers writes the optimizer,
#: the schedule and the random state with torch.save). Without an optimizer a resume started a new
#: optimizer and schedule unsaid; one cut short ended in torch's traceback.
_RESUME_STATE = ("optimizer.pt", "scheduler.pt")
#: Where DeepSpeed and FSDP keep the optimizer instead of optimizer.pt.
_OTHER_OPTIMIZERS = ("optimizer.bin", "optimizer_0", "global_step*")


def _resume_state_problem(folder: Path) -> str | None:
    import zipfile

    if not (folder / "optimizer.pt").is_file() and not any(
            any(folder.glob(pattern)) for pattern in _OTHER_OPTIMIZERS):
        return "no optimizer.pt"  # (a save_only_model run writes none: its checkpoints cannot be resumed)
    for path in [*(folder / name for name in _RESUME_STATE), *sorted(folder.glob("rng_state*.pth"))]:
        if not path.is_file():  # a scheduler a DeepSpeed run keeps elsewhere
            continue
        try:
            with zipfile.ZipFile(path) as archive:  # reads the central directory at the end: a cut file fails
                archive.infolist()
        except (OSError, zipfile.BadZipFile):
            return f"{path.name} cut short or unreadable"
    return None


def _weights_problem(folder: Path) -> str | None:
    """Why ``folder``'s adapter weights cannot load, or None: a weights file cut short (a crash,
    a full disk) made ``--resume`` end in safetensors' traceback; an adapter's weights are read
    (small) to tell a diverged run's NaNs."""
    for name in ("adapter_model.safetensors", "model.safetensors", "adapter_model.bin"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                from ..model_load import non_finite_tensors

                with safe_open(str(path), framework="pt") as weights:
                    if name == "adapter_model.safetensors" and non_finite_tensors(  # an earlier version saved
                            (key, weights.get_tensor(key)) for key in weights.keys()):  # a diverged run's NaNs
                        return f"{name} holds non-finite weights (the run diverged)"
            elif path.stat().st_size == 0:
                return f"{name} is empty"
        except Exception:  # noqa: BLE001 - safetensors raises its own error types for a bad header
            return f"{name} cut short or unreadable"
        return None
    return "no adapter weights"


def complete_checkpoint(out: Path, resumable: bool = True,
                        up_to: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint-N in ``out`` that a resume can load (``resumable=False``: whose adapter
    loads, as an ``init_adapter``; ``up_to``: N at most that), and a note per newer one skipped."""
    found = []
    if out.is_dir():
        for d in out.iterdir():
            name, _, step = d.name.rpartition("-")
            if name == "checkpoint" and step.isdigit() and d.is_dir() and (up_to is None or int(step) <= up_to):
                found.append((int(step), d))
    skipped = []
    for _, folder in sorted(found, reverse=True):
        problem = _checkpoint_problem(folder, resumable)
        if problem is None:
            return folder, skipped
        if "non-finite" in problem:  # (a diverged run's save, complete)
            skipped.append(f"{folder.name} ({problem})")
            continue
        why = "its save was cut short" + (", or the run saved its model only (save_only_model)"
                                           if problem == "no optimizer.pt" else "")
        skipped.append(f"{folder.name} ({problem}: {why})")
    return None, skipped


def _check_output(out: Path, resume: bool, config, identity: dict[str, Any], say: bool = True) -> str | None:
    if (problem := cannot_write_folder(out, "--output")) is not None:
        raise UserError(problem)
    if resume:
        last, skipped = complete_checkpoint(out)
        if last is None:
            if skipped:
                raise UserError(f"--resume: no complete checkpoint in {out} ({', '.join(skipped)}): nothing to "
                                "resume from; start again with another --output")
            raise UserError(f"--resume: no checkpoint-* folder in {out}")
        _check_same_run(out, identity)
        _check_resumable(last, config)
        _check_same_options(out, identity["options"], say)
        for note in skipped if say else ():
            print(f"resume: skipping {note}; resuming from {last.name}", flush=True)
        return str(last)
    if (out / "adapter").exists() or (out / "metrics.jsonl").exists():
        if complete_checkpoint(out)[0] is None:  # (--resume would only say there is nothing to resume from)
            raise UserError(f"{out} already holds a run that saved no checkpoint to resume from: give another "
                            "--output (or remove this one)")
        raise UserError(f"{out} already holds a run: use --resume or another --output")
    if holds_other_files(out, RUN_MARKER, RUN_LOCK):
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
    if config.max_steps > 0 and step >= config.max_steps and not (planned > 0 and step >= planned):
        raise UserError(f"--resume: max_steps={config.max_steps} is not above {checkpoint.name}'s step {step}: "
                        f"leave max_steps as the run had it ({planned or 'its value'})")
    if (config.max_steps > 0 and step >= config.max_steps) or (planned > 0 and step >= planned):
        # resuming continues the saved optimizer and schedule, which ended at learning rate 0
        adapter = checkpoint.parent / "adapter"
        if (adapter / "adapter_config.json").is_file() and _weights_problem(adapter) is None:
            raise UserError(f"--resume: the run in {checkpoint.parent} finished (step {step} of {planned or step}); "
                            f"to train its adapter further, start a new run from it: --set "
                            f"init_adapter={adapter} --output NEW_FOLDER")
        raise UserError(f"--resume: the run in {checkpoint.parent} finished (step {step} of {planned or step}), "
                        f"but its adapter was not written (the save was interrupted or failed); {checkpoint.name} "
                        f"holds the weights of step {step}: start a new run from them with --set "
                        f"init_adapter={checkpoint} --output NEW_FOLDER, or use that folder as the adapter")
    try:
        saved = json.loads((checkpoint / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return  # not a LoRA checkpoint of ours: the trainer says what it finds
    if config.init_adapter:  # the run's LoRA is the init adapter's: torch's size-mismatch traceback otherwise
        start = _adapter_config(config.init_adapter)
        shape = {k: (saved.get(k), start.get(k)) for k in ("r", "lora_alpha")}
        if any(then is not None and now is not None and then != now for then, now in shape.values()):
            raise UserError(f"--resume: init_adapter={config.init_adapter} has r={start.get('r')}, lora_alpha="
                            f"{start.get('lora_alpha')}; the checkpoint's LoRA r={saved.get('r')}, lora_alpha="
                            f"{saved.get('lora_alpha')}: resume with the init_adapter the run started from")
        return
    changed = _lora_differences(config, saved, "checkpoint", ("lora_r", "lora_alpha", "lora_dropout",
                                                              "lora_target_modules"))
    if changed:
        raise UserError(f"--resume: {', '.join(changed)}: a resumed run keeps its LoRA options; give the "
                        "checkpoint's values or start a new --output")


#: The LoRA options and the keys peft saves them under in ``adapter_config.json``.
_LORA_KEYS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
              "lora_target_modules": "target_modules"}


def _lora_differences(config, saved: dict[str, Any], saved_as: str, keys: Iterable[str]) -> list[str]:
    """``key=value (saved_as: saved value)`` for each of ``keys`` whose value in ``config`` differs
    from a saved adapter's (a value it does not hold is no difference; ``all-linear`` targets are
    not compared: peft saves the module names it found)."""
    out = []
    for key in keys:
        now, then = getattr(config, key), saved.get(_LORA_KEYS[key])
        if key == "lora_target_modules":
            if now == ["all-linear"] or not isinstance(then, (list, str)):
                continue
            names = {then} if isinstance(then, str) else set(then)
            if set(now) != names:
                out.append(f"{key}={','.join(now)} ({saved_as}: {','.join(sorted(names))})")
        elif then is not None and now != then:
            out.append(f"{key}={now} ({saved_as}: {then})")
    return out


def _adapter_config(folder: str) -> dict[str, Any]:
    """A peft adapter's ``adapter_config.json`` ({} where unreadable: loading it says why)."""
    try:
        value = json.loads((Path(folder) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _check_init_adapter_shape(config, given: dict[str, Any]) -> None:
    """A LoRA option the user gave beside ``init_adapter`` that its adapter does not have: the
    continued adapter keeps its own shape, and the option was silently not used."""
    differ = _lora_differences(config, _adapter_config(config.init_adapter), "init_adapter",
                               [key for key in _LORA_KEYS if key in given])
    if differ:
        raise UserError(f"{', '.join(differ)}: a run from init_adapter continues that adapter with its own LoRA "
                        "shape; leave these options out, or train a fresh LoRA (no init_adapter)")


def _no_null_scalar_notice(record: logging.LogRecord) -> bool:
    """A step without sampler logprobs logs its mismatch as null, which TensorBoard cannot plot:
    its 'attempting to log a value of "None"' warning says nothing a user can act on."""
    message = record.getMessage()
    return not ('attempting to log a value of "None"' in message and "sampling_logp_difference" in message)


def build_trainer(args: argparse.Namespace):
    """Checked config and data, the model with its LoRA, and the trainer - not yet trained.

    Returns ``(trainer, report, checkpoint)``; ``checkpoint`` is what ``--resume`` continues.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' own deprecation notices, raised from inside TRL: noise for a user of this command
    warnings.filterwarnings("ignore", message=r".*deprecated and will be removed in v6", category=FutureWarning)
    # TRL's alias, taken and checked as clip_max (docs/train.md): its notice was two lines of TRL's source
    warnings.filterwarnings("ignore", message=r"The `vllm_importance_sampling_cap` argument is deprecated",
                            category=FutureWarning)
    # TensorBoard's notice for a metric logged as null by design (docs/train.md): read as an error
    logging.getLogger("transformers.integrations.integration_utils").addFilter(_no_null_scalar_notice)
    config, grouped, report = prepare(args)
    out = Path(args.output)
    identity = {**run_identity(args.model, grouped.trajectories, config.init_adapter), "options": run_options(config)}
    if config.init_adapter:
        from ..model_load import ModelLoadError, check_adapter_folder
        from .config import user_options

        try:
            check_adapter_folder(config.init_adapter)
        except ModelLoadError as exc:
            raise UserError(f"init_adapter: {exc}") from None
        _check_init_adapter_shape(config, user_options(args.config, args.sets))
    checkpoint = _check_output(out, args.resume, config, identity, say=_first_process())
    for line in report.lines() if _first_process() else ():
        print(line, flush=True)

    import torch
    from transformers import AutoTokenizer

    from ..model_load import adapter_base_note, first_line, load_adapter, load_causal_lm, lora_target_problems

    dtype = torch.bfloat16 if config.bf16 else torch.float32
    # by its absolute path: peft records it in the adapter (base_model_name_or_path), which
    # serve and a later init_adapter compare with the model they load it on
    try:  # before the weights: a tokenizer_config.json without its tokenizer.json failed after them, in 5 lines
        tok = AutoTokenizer.from_pretrained(args.model)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, OSError, TypeError, ...
        raise UserError(f"--model {args.model}: its tokenizer does not load ({first_line(exc)})") from None
    if not config.init_adapter and config.lora_target_modules != ["all-linear"]:
        if problems := lora_target_problems(args.model, config.lora_target_modules):
            raise UserError(f"lora_target_modules on the model in {args.model}: {'; '.join(problems)}")
    if not config.init_adapter and (width := _model_width(args.model)) and config.lora_r > width:
        # a rank past a layer's width adds nothing; 99999999999 asked torch for 25 TB, a traceback after the weights
        raise UserError(f"lora_r {config.lora_r} is above the model's hidden size {width}: a LoRA's rank is at "
                        "most its layers' width (8-64 is usual)")
    if tok.pad_token_id is None and tok.eos_token_id is None:  # TRL pads batches with it: its traceback then
        raise UserError(f"--model {args.model}: its tokenizer has neither a pad_token nor an eos_token to pad "
                        "batches with: set pad_token in its tokenizer_config.json")
    model = load_causal_lm(str(Path(args.model).expanduser().resolve()), dtype)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    peft_config = None
    if config.init_adapter:
        model = load_adapter(model, config.init_adapter, is_trainable=True)
        if (note := adapter_base_note(config.init_adapter, args.model)) is not None and _first_process():
            print(f"polar-train train: init_adapter: {note}", file=sys.stderr, flush=True)
        for adapter_config in model.peft_config.values():  # peft keeps the one it loaded: record this run's
            adapter_config.base_model_name_or_path = _resolved(args.model, "--model")
    else:
        peft_config = config.lora_config()
    try:
        make_private_dir(out)  # checkpoints and metrics of a run on captured prompts: the owner's only
    except OSError as exc:  # what the check before could not foresee (/proc, a folder made meanwhile)
        raise UserError(f"--output {out}: cannot make it: {exc.strerror or exc}") from None
    lock = _hold_run_lock(out, args.resume) if _first_process() else None
    try:
        if lock is not None and args.resume:  # another run in the folder may have gone on meanwhile
            again = _check_output(out, True, config, identity, say=False)
            if again != checkpoint:
                raise UserError(f"--resume: the run in {out} went on while this one loaded its model (its newest "
                                f"complete checkpoint is now {Path(again).name}): run the command again")
        trainer = _make_trainer(args, out, config, identity, checkpoint, model, tok, peft_config, grouped)
        trainer.temperature_mismatch_allowed = report.temperature_mismatch_allowed  # (the first-step warning's)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    trainer.polar_run_lock = lock  # released when train() ends
    return trainer, report, checkpoint


def _first_process() -> bool:
    """Whether this is the process that writes the run's files and says what it does: the only one,
    or rank 0 of ``accelerate launch``/``torchrun`` (each of the others would repeat every line)."""
    return os.environ.get("RANK", "0") == "0"


def _hold_run_lock(out: Path, resume: bool):
    """Lock ``out`` for this run; a second run into it meanwhile is refused (both said they wrote the
    adapter, and the second's replaced the first's). The folder is checked again under the lock: a
    run that finished while this one loaded its model holds an adapter now."""
    from ..folder_lock import hold_folder_lock

    try:
        lock = hold_folder_lock(out, RUN_LOCK, f"another polar-train train is writing into {out}; wait for it to "
                                               "end or choose another --output")
    except FileExistsError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"--output {out}: cannot lock it: {exc.strerror or exc}") from None
    if not resume and ((out / "adapter").exists() or (out / "metrics.jsonl").exists()):
        lock.close()
        raise UserError(f"{out} already holds a run (written while this one loaded its model): use --resume or "
                        "another --output")
    return lock


def resumed_identity(marker: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """What a resume records in the run marker: only what the run recorded. An earlier version's
    marker holds fewer options (this resume's values of the others are not the run's, and were not
    checked), and no adapter fingerprint (the adapter at the path now is not known to be the one the
    run started from: recorded, it would have let a later resume from another adapter pass)."""
    saved = marker.get("options")
    options = {k: v for k, v in identity["options"].items() if k in saved} if isinstance(saved, dict) else None
    kept = {k: v for k, v in identity.items() if k != "options"} | ({"options": options} if options is not None else {})
    if "init_adapter_weights" not in marker:
        kept.pop("init_adapter_weights", None)
    return kept


def _make_trainer(args, out: Path, config, identity: dict[str, Any], checkpoint, model, tok, peft_config, grouped):
    """The marker written and the trainer made, under the run's lock."""
    from .trainer import (
        DivergenceCallback,
        LastStepLogCallback,
        MetricsFileCallback,
        MismatchCheckpointCallback,
        RecordedGRPOTrainer,
        keep_metrics_until,
    )

    if checkpoint is not None:
        identity = resumed_identity(_saved_marker(out), identity)
    if _first_process():
        try:
            # where the data is: notebooks/02 finds an unfinished run's build report by it
            _write_marker(out, {**identity, "trajectories_folder": _resolved(args.data, "DATA")})
        except OSError as exc:
            raise TrainFailure(f"cannot write {out / RUN_MARKER}: {exc.strerror or exc}") from None
    if checkpoint is not None and _first_process():  # the steps after it are logged again;
        # by the one process that writes metrics.jsonl (accelerate launch starts one per GPU)
        try:
            keep_metrics_until(out / "metrics.jsonl", int(Path(checkpoint).name.rsplit("-", 1)[-1]))
        except OSError as exc:
            raise TrainFailure(f"cannot rewrite {out / 'metrics.jsonl'} for the resume ({exc.strerror or exc}); "
                               "it is as it was") from None
    trainer = RecordedGRPOTrainer(model=model, args=config, processing_class=tok, peft_config=peft_config,
                                  data=grouped, callbacks=[MetricsFileCallback(out / "metrics.jsonl")])
    trainer.add_callback(MismatchCheckpointCallback(trainer))
    trainer.add_callback(DivergenceCallback(trainer, out / "metrics.jsonl"))
    trainer.add_callback(LastStepLogCallback())
    return trainer


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run training; returns the summary that is also written to ``<output>/train_summary.json``."""
    trainer, report, checkpoint = build_trainer(args)  # its checks come before the slow imports
    try:
        return _train(args, trainer, report, checkpoint)
    finally:
        if trainer.polar_run_lock is not None:
            trainer.polar_run_lock.close()


def _train(args: argparse.Namespace, trainer, report, checkpoint) -> dict[str, Any]:
    from .trainer import mismatch_warning, restore_first_epoch_mismatch, stall_warning, stalled_steps

    out = Path(args.output)
    # a resumed run's first step was taken before the checkpoint: its value comes from there
    first_step_known = checkpoint is None or restore_first_epoch_mismatch(trainer, checkpoint)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    def end_progress_line() -> None:
        for callback in trainer.callback_handler.callbacks:  # end tqdm's line before ours
            if getattr(callback, "training_bar", None) is not None:
                callback.training_bar.close()

    try:
        result = trainer.train(resume_from_checkpoint=checkpoint)
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C; SIGTERM (timeout, a scheduler) as SystemExit
        if signal_status(exc) is None:
            raise  # not a signal
        if trainer.accelerator.is_main_process:
            end_progress_line()
            _report_interrupt(out, trainer.state.global_step, trainer.args.save_steps)
        raise said_interrupted(exc) from None
    except Exception:  # a failed save, an option TRL refuses mid-run: its line was printed after the bar's
        end_progress_line()
        raise
    from ..model_load import non_finite_tensors

    trained = {n: p.detach() for n, p in trainer.model.named_parameters() if n in before}
    broken = non_finite_tensors(trained.items())
    if broken:  # an adapter of NaNs "trained successfully" (e.g. an inf learning rate, a NaN bound)
        raise TrainFailure(f"training ended with non-finite adapter weights ({len(broken)} of {len(trained)} "
                           f"tensors, e.g. {broken[0]}) at step {trainer.state.global_step}: no adapter written; "
                           "lower learning_rate or check the options that scale the loss")
    changed = max((float((p - before[n]).abs().max()) for n, p in trained.items()), default=0.0)
    adapter_dir = out / "adapter"
    _save_adapter(trainer, adapter_dir)
    mism = trainer.first_epoch_mismatch
    measured = [v for v in mism if math.isfinite(v)]  # NaN: a step with no sampler logprob to compare
    first = mism[0] if first_step_known and mism and math.isfinite(mism[0]) else None
    # step 1 without a sampler logprob (rendered calls only): the first batch that had one, and the updates before it
    at = next((i for i, v in enumerate(mism) if math.isfinite(v)), None) if first_step_known else None
    first_measured = mism[at] if at is not None else None
    updates_before = trainer.first_epoch_updates[at] if at is not None else None
    summary = {
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "adapter": str(adapter_dir.resolve()),
        "trajectories": str(Path(args.data).expanduser().resolve()),
        "model": str(Path(args.model).expanduser().resolve()),
        "init_adapter": _resolved(trainer.args.init_adapter),
        "resumed_from": str(Path(checkpoint).resolve()) if checkpoint else None,
        "adapter_max_abs_change": changed,
        "logprob_mismatch_first_step": first,
        "logprob_mismatch_first_epoch_mean": sum(measured) / len(measured) if measured and first_step_known else None,
        "logprob_mismatch_first_measured": first_measured,
        "logprob_mismatch_first_measured_after_updates": updates_before,
        "stalled_steps": stalled_steps(trainer.state.log_history),
        "data": report.__dict__,
    }
    if trainer.accelerator.is_main_process:
        text = json.dumps(_finite_or_null(summary), indent=2, default=str, allow_nan=False) + "\n"
        _write_summary(out, text, adapter_dir)
        steps = summary["steps"]
        print(f"trained {steps} step{'' if steps == 1 else 's'}; adapter written to {adapter_dir}", flush=True)
        if first_measured is not None:
            where = (f"first step {first:.3g}" if first is not None else
                     f"first step none (no sampler logprob: rendered calls only); first measured {first_measured:.3g}"
                     + (f" after {updates_before} update{'' if updates_before == 1 else 's'}"
                        if updates_before is not None else ""))
            print(f"logprob mismatch |trainer - sampler| (mask-1 tokens): {where}, "
                  f"first-epoch mean {summary['logprob_mismatch_first_epoch_mean']:.3g}", flush=True)
            if (warning := mismatch_warning(first_measured, trainer.args.init_adapter,
                                            0 if first is not None else updates_before,
                                            trainer.args.temperature, trainer.args.sampler_logprobs,
                                            report.temperature_mismatch_allowed)) is not None:
                print(warning, file=sys.stderr, flush=True)
        if (warning := stall_warning(summary["stalled_steps"], trainer.args.learning_rate)) is not None:
            print(warning, file=sys.stderr, flush=True)
    return summary


def _write_summary(out: Path, text: str, adapter_dir: Path) -> None:
    """``train_summary.json`` whole or not at all (a temporary file renamed): written in place, a
    Ctrl-C left it empty, and a resume refused the finished run, so it stayed so. An interrupt here
    says that the adapter is complete."""
    final = out / "train_summary.json"
    tmp = out / f".train_summary.json.{os.getpid()}.tmp"
    try:
        tmp.write_text(text)
        sync_file(tmp)
        tmp.replace(final)
        sync_folder(out)
    except (KeyboardInterrupt, SystemExit) as exc:
        tmp.unlink(missing_ok=True)
        print(f"polar-train train: interrupted after the adapter was written ({adapter_dir} is complete); "
              f"{final.name} not written", file=sys.stderr, flush=True)
        raise said_interrupted(exc) from None
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TrainFailure(f"cannot write {final}: {exc.strerror or exc} ({adapter_dir} is complete)") from None


def _save_adapter(trainer, adapter_dir: Path) -> None:
    """Write the trained adapter whole or not at all: into a hidden folder, renamed to ``adapter``
    when complete. Written in place, a Ctrl-C during the save left an empty ``adapter/``, and the
    run could be neither resumed (it had finished) nor used (no weights there). Only the main
    process touches the folders (the others' ``save_model`` writes nothing)."""
    out = adapter_dir.parent
    main = trainer.accelerator.is_main_process
    partial = out / f".{adapter_dir.name}.partial-{os.getpid()}"
    if main:
        for stale in out.glob(f".{adapter_dir.name}.partial-*"):  # a save killed outright
            shutil.rmtree(stale, ignore_errors=True)

    def kept() -> str:
        last, _ = complete_checkpoint(out, resumable=False)  # its weights, as an init_adapter
        return (f"{last.name} holds the adapter of step {last.name.rsplit('-', 1)[-1]}: start a new run from it "
                f"with --set init_adapter={last}" if last else "")

    try:
        trainer.save_model(str(partial))
    except (KeyboardInterrupt, SystemExit) as exc:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
            print(f"polar-train train: interrupted while writing the adapter, none written"
                  f"{'; ' + k if (k := kept()) else ''}", file=sys.stderr, flush=True)
        raise said_interrupted(exc) from None
    except Exception as exc:  # noqa: BLE001 - a full disk: OSError from torch, a plain Exception from tokenizers
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        raise TrainFailure(f"cannot write the adapter to {adapter_dir}: {save_error(exc)}"
                           f"{f' ({k})' if (k := kept()) else ''}") from None
    if not main:
        return
    old = out / f".{adapter_dir.name}.old-{os.getpid()}"
    try:  # an earlier adapter (a resumed run that wrote one) is moved aside, not deleted first
        sync_tree(partial)  # on disk before its name is: a power cut leaves no adapter of empty files
        if adapter_dir.exists() or adapter_dir.is_symlink():
            adapter_dir.replace(old)
        partial.replace(adapter_dir)
        sync_folder(out)
    except OSError as exc:  # the new adapter stays whole where it was written
        raise TrainFailure(f"cannot put the adapter in place at {adapter_dir}: {exc.strerror or exc}; it is "
                           f"complete in {partial}") from None
    if old.is_symlink() or old.is_file():
        old.unlink(missing_ok=True)
    else:
        shutil.rmtree(old, ignore_errors=True)


def save_error(exc: BaseException) -> str:
    """The first line of a save's error: ``No space left on device`` rather than a traceback."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if "unexpected pos" in first:  # torch's zip writer, whatever stopped the write (it drops the OSError)
        return "the file was cut short while written (a full disk, a quota or a file-size limit?)"
    return first


def _finite_or_null(value: Any) -> Any:
    """``value`` with NaN and infinities as None: ``json.dumps`` wrote a bare NaN (not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def _report_interrupt(out: Path, step: int, save_steps: float) -> None:
    """Ctrl-C ended the run with exit 130 and not a word on what is left to continue from."""
    last, _ = complete_checkpoint(out)
    if last is not None:
        print(f"polar-train train: interrupted at step {step}; continue with --resume (from {last.name})",
              file=sys.stderr, flush=True)
    else:
        again = ("start again with another --output" if (out / "metrics.jsonl").exists() else
                 "run again (the same --output is fine: nothing was logged there yet)")  # as _check_output says
        print(f"polar-train train: interrupted at step {step}, before any checkpoint was saved (save_steps="
              f"{save_steps:g}): nothing to resume; {again}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        train(args)
    except TrainFailure as exc:
        print(f"polar-train train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return 0


def main(argv: list[str] | None = None) -> int:
    """``polar-train train ARGS`` from Python (``python -m polar_train.train`` runs it as the program)."""
    from ..cli import main as polar_main

    return polar_main(["train", *(sys.argv[1:] if argv is None else argv)])
