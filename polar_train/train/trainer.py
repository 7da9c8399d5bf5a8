"""``RecordedGRPOTrainer``: TRL's ``GRPOTrainer`` fed with recorded trajectories, no generation.

Why a subclass this small: TRL already implements everything off-policy training needs for
vLLM-sampled data - the trainer's own logprobs of the sampled tokens ("old" logprobs), the
truncated importance weight ``min(pi_old / pi_sampler, cap)`` per token, the mismatch metric
``|logprob(trainer) - logprob(sampler)|`` and the weighted loss - but only switches it on when
``use_vllm`` is set. Recorded trajectories are exactly such data (sampled elsewhere, with the
sampler's logprobs), so the subclass switches that code path on around the two methods that
contain it, and supplies the trajectories through ``rollout_func``.

The resulting per-token objective is TRL's: ``clip(pi_theta / pi_old) * A * min(pi_old / mu, cap)``
where ``mu`` is the recorded sampler probability: the ratio against the recorded logprobs is
``(pi_theta / pi_old) * (pi_old / mu)``, its second factor truncated at the cap.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from ..model_load import non_finite_tensors
from .cli import TrainFailure, complete_checkpoint, save_error
from .data import GroupedData, rollout_advantages


def recorded_reward(prompts, completions, recorded_reward, **kwargs) -> list[float]:
    """The reward attached to each trajectory by the builder (forwarded by the rollout)."""
    return [float(r) for r in recorded_reward]


class RecordedGRPOTrainer(GRPOTrainer):
    """GRPO on recorded trajectories with importance sampling against the recorded logprobs."""

    def __init__(self, *, data: GroupedData, **kwargs: Any) -> None:
        self.data = data
        self._row_of = {name: r for r, name in enumerate(data.row_names)}
        if len(self._row_of) != len(data.row_names):
            raise ValueError("GRPO group names are not unique")
        #: Per generation batch (first epoch only): mean |logprob(trainer) - logprob(sampler)|.
        self.first_epoch_mismatch: list[float] = []
        #: The optimizer updates taken before each of those batches (None: not known, an older checkpoint's)
        self.first_epoch_updates: list[int | None] = []
        #: allow_temperature_mismatch let a real mismatch through (set by train's CLI from its data report)
        self.temperature_mismatch_allowed = False
        self.last_batch: dict[str, Any] | None = None  # for tests: the last scored batch
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")
            super().__init__(reward_funcs=[recorded_reward], train_dataset=data.dataset(),
                             rollout_func=self._rollout, **kwargs)
        self._last_loaded_step = None  # read by TRL's vLLM weight-sync check; nothing to sync
        self._saving_checkpoint = False

    # -- checkpoints ----------------------------------------------------------------------------
    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if isinstance(sampler, RepeatSampler):
            sampler = self._epoch_sampler = EpochRepeatSampler(sampler)
        return sampler

    def _run_epoch(self, model, epoch, *args, **kwargs):
        # set_epoch reaches the sampler through the dataloader's wrappers, but not through all of
        # them: several processes resumed mid-epoch wrap it twice (SkipBatchSampler(BatchSamplerShard(
        # ...))), and epoch 1's order came back (a review). Told here, whatever wraps it.
        if getattr(self, "_epoch_sampler", None) is not None:
            self._epoch_sampler.set_epoch(epoch)
        return super()._run_epoch(model, epoch, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """A failed save (a full disk: torch's OSError, tokenizers' plain Exception) is one line,
        naming the checkpoint, not a traceback; ``--resume`` skips the folder it left incomplete."""
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        except Exception as exc:  # noqa: BLE001 - see above
            raise TrainFailure(f"cannot save {folder}: {save_error(exc)}") from None
        finally:
            self._saving_checkpoint = False

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Checkpoints without the tokenizer (33 MB each for Qwen's): ``--resume`` reads it from
        ``--model``; the final adapter keeps its copy."""
        if not self._saving_checkpoint:
            return super()._save(output_dir, state_dict)
        tokenizer, self.processing_class = self.processing_class, None
        try:
            return super()._save(output_dir, state_dict)
        finally:
            self.processing_class = tokenizer

    # -- data ---------------------------------------------------------------------------------
    def _rollout(self, prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
        """Return the recorded trajectories of the groups named by ``prompts``.

        TRL hands each process a contiguous slice of the global batch in which every group
        appears ``num_generations`` times in a row; the global position modulo the group size
        says which member of the group a repeat stands for.
        """
        g = self.num_generations if self.model.training else self.num_generations_eval
        offset = self.accelerator.process_index * len(prompts)
        rows = [self._row_of[p] for p in prompts]
        members = [(row, self.data.rows[row][(offset + i) % g]) for i, row in enumerate(rows)]
        self._batch_members = members  # (row, trajectory index) of each completion: its rollout advantage
        picked = [self.data.trajectories[t] for _, t in members]
        return {
            "prompt_ids": [t.prompt_ids for t in picked],
            "completion_ids": [t.completion_ids for t in picked],
            "logprobs": [t.logprobs for t in picked],
            "env_mask": [t.loss_mask for t in picked],
            "recorded_reward": [t.reward for t in picked],
            "trajectory_id": [t.trajectory_id for t in picked],
        }

    # -- TRL's sampler-correction path, switched on for recorded data -------------------------
    @contextlib.contextmanager
    def _recorded_sampler(self):
        saved = self.use_vllm
        self.use_vllm = True
        self._last_loaded_step = self.state.global_step
        try:
            yield
        finally:
            self.use_vllm = saved

    def _generate_and_score_completions(self, inputs):
        with self._recorded_sampler():
            out = super()._generate_and_score_completions(inputs)
        if self.args.advantage_baseline == "rollout":
            out["advantages"] = self._rollout_advantages(out["advantages"])
        self._log_truncation(out)
        self.last_batch = out
        return out

    def _rollout_advantages(self, trl_advantages: torch.Tensor) -> torch.Tensor:
        """The batch's advantages with each rollout counted once in its group (see
        :func:`~.data.rollout_advantages`), in place of TRL's over trajectories. Each group's
        members are known from the data, so no process needs another's rewards."""
        if len(self._batch_members) != len(trl_advantages):  # a TRL that slices otherwise: never mix the two
            raise RuntimeError(f"advantage_baseline=rollout: {len(self._batch_members)} recorded completions for "
                               f"{len(trl_advantages)} advantages (a TRL version this trainer does not know?); "
                               "set advantage_baseline=trajectory")
        scale = self.scale_rewards != "none"
        by_row: dict[int, dict[int, float]] = {}
        values = []
        for row, t in self._batch_members:
            if row not in by_row:
                by_row[row] = rollout_advantages(self.data.trajectories, self.data.rows[row], scale)
            values.append(by_row[row][t])
        return torch.tensor(values, dtype=trl_advantages.dtype, device=trl_advantages.device)

    def _compute_loss(self, model, inputs):
        with self._recorded_sampler():
            return super()._compute_loss(model, inputs)

    def _log_truncation(self, out: dict[str, Any]) -> None:
        """Share of trainable tokens whose raw weight pi_old / mu fell outside the cap (clipped)."""
        if "old_per_token_logps" not in out or "sampling_per_token_logps" not in out:
            return
        mode = "train" if self.model.training else "eval"
        mask = out["completion_mask"] * out.get("tool_mask", torch.ones_like(out["completion_mask"]))
        diff = torch.nan_to_num((out["old_per_token_logps"] - out["sampling_per_token_logps"]) * mask, nan=0.0)
        if self.vllm_importance_sampling_mode.startswith("sequence"):
            diff, valid = diff.sum(-1), torch.ones(diff.shape[0], dtype=torch.bool, device=diff.device)
        else:
            valid = mask.bool()
        ratio = torch.exp(diff)[valid]
        hi = self.vllm_importance_sampling_clip_max
        lo = self.vllm_importance_sampling_clip_min
        out_of_range = torch.zeros_like(ratio, dtype=torch.bool)
        if hi is not None:
            out_of_range |= ratio > hi
        if lo is not None:
            out_of_range |= ratio < lo
        frac = out_of_range.float().mean() if ratio.numel() else torch.tensor(0.0, device=ratio.device)
        frac = self.accelerator.gather(frac.reshape(1)).mean().item()
        self._metrics[mode]["sampling/importance_sampling_ratio/clipped_frac"].append(frac)
        self._no_mismatch_without_logprobs(out, mask, mode)
        if mode == "train" and self.state.epoch is not None and self.state.epoch < 1.0:
            delta = self._metrics[mode].get("sampling/sampling_logp_difference/mean")
            if delta:
                self.first_epoch_mismatch.append(delta[-1])
                self.first_epoch_updates.append(int(self.state.global_step))
                # the first batch measured (one of rendered calls only has nothing to measure): a run whose
                # first step had no sampler logprob was never warned, however foreign its data (a probe)
                first = math.isfinite(delta[-1]) and sum(map(math.isfinite, self.first_epoch_mismatch)) == 1
                warning = (mismatch_warning(delta[-1], self.args.init_adapter, self.state.global_step,
                                            self.args.temperature, self.args.sampler_logprobs,
                                            self.temperature_mismatch_allowed) if first else None)
                if warning is not None and self.accelerator.is_main_process:
                    tqdm.write(warning, file=sys.stderr)  # at step 1: Ctrl-C before the run is spent (its own line)

    def _no_mismatch_without_logprobs(self, out: dict[str, Any], mask: torch.Tensor, mode: str) -> None:
        """A batch with no trainable token that has a sampler logprob (rendered calls only, e.g.
        Anthropic messages) has no mismatch to measure: TRL logs 0 for it, which reads as a perfect
        match and pulls the first-epoch mean down. Make it NaN (TRL's log leaves NaN out of its
        averages and writes null when nothing is left)."""
        scored = (mask.bool() & ~torch.isnan(out["sampling_per_token_logps"])).sum().reshape(1)
        if self.accelerator.gather(scored).sum().item() > 0:
            return
        for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"):
            values = self._metrics[mode].get(key)
            if values:
                values[-1] = float("nan")


class EpochRepeatSampler(RepeatSampler):
    """TRL's sampler, whose order in epoch ``e`` is the ``e+1``-th permutation of its seeded
    generator however the run got there. TRL's draws one per pass from one generator, so a run
    resumed from a checkpoint at or after an epoch's end replayed epoch 1's order - one group
    trained twice, another not at all, unsaid (a probe). The trainer calls :meth:`set_epoch`
    before each epoch; an uninterrupted run keeps TRL's order."""

    def __init__(self, sampler: RepeatSampler) -> None:
        self.__dict__.update(sampler.__dict__)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle and self.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.seed)
            for _ in range(self.epoch):  # the permutations of the epochs before (TRL's order)
                torch.randperm(self.num_samples, generator=self.generator)
        return super().__iter__()


#: A first-step mean |trainer - sampler| logprob above this is no precision difference (float32
#: against float32 gives ~1e-5, bf16 against float32 ~1e-2): the trainer's policy is not the one
#: that sampled the data.
FOREIGN_POLICY_MISMATCH = 0.1


def mismatch_warning(first_step: float, init_adapter: str | None, updates_before: int | None = 0,
                     temperature: float = 1.0, sampler_logprobs: str = "raw",
                     temperature_forced: bool = False) -> str | None:
    """What to tell a user whose data another policy sampled (a round captured with an adapter
    trained from the base again, the wrong adapter or base): GRPO's ratio then weighs every
    token by the wrong old policy, silently. ``first_step`` is the first value measured;
    ``updates_before`` the optimizer updates taken before it (None: not known) - after some, part
    of the difference is the policy's own movement. Away from temperature 1 the logprob mode is
    a cause too: processed logprobs declared for raw ones (polar-train serve's, vLLM's default) gave
    the same mismatch, and the warning sent the user after an adapter (a probe); so is a temperature
    mismatch the user allowed (``temperature_forced``: allow_temperature_mismatch let one through)."""
    if not math.isfinite(first_step) or first_step <= FOREIGN_POLICY_MISMATCH:
        return None
    start = f"init_adapter={init_adapter} on --model" if init_adapter else "a fresh LoRA on --model, no init_adapter"
    if updates_before == 0:
        head, verdict = f"first-step logprob mismatch {first_step:.3g}", "is not the one"
    else:
        after = (f"after {updates_before} update{'' if updates_before == 1 else 's'}" if updates_before is not None
                 else "after updates of a resumed run")
        head = (f"logprob mismatch {first_step:.3g} at the first step with sampler logprobs ({after}: part of it "
                "may be the policy's own movement, a high learning_rate's)")
        verdict = "is likely not the one"
    mode = ("" if abs(temperature - 1.0) <= 1e-4 else
            f" Or the recorded logprobs are not {sampler_logprobs} ones (sampler_logprobs={sampler_logprobs} at "
            f"temperature {temperature:g}: raw logprobs - vLLM's default, polar-train serve's - are of the unscaled "
            "distribution, processed ones need vLLM --logprobs-mode processed_logprobs).")
    if temperature_forced:
        verdict = "may not be the one"
        mode = (" Or it is the temperature mismatch allow_temperature_mismatch=true let through: a training "
                "temperature other than the sampler's, or raw logprobs away from temperature 1, gives such a "
                "mismatch by itself.")
    return (f"polar-train train: warning: {head} is far above precision noise (~1e-5 float32, ~1e-2 bf16): the "
            f"policy trained here ({start}) {verdict} that sampled these trajectories. Data captured while an "
            "adapter was served needs init_adapter=<that adapter> and the --model it was served on "
            "(docs/train.md, \"Round after round\")." + mode)


def stalled_steps(log_history: list[dict[str, Any]]) -> list[int]:
    """Logged steps that learned nothing although they had something to learn: gradient norm 0
    while some group's rewards differed and no token's ratio was clipped. A learning rate that
    saturates the policy (1e12: every distribution uniform after one step, every gradient 0 after)
    ran to its end and exited 0 with an adapter that no later step changed, unsaid."""
    def number(row: dict[str, Any], key: str) -> float | None:
        value = row.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    stalled = []
    for row in log_history:
        spread, weight_max = number(row, "frac_reward_zero_std"), number(row, "sampling/importance_sampling_ratio/max")
        # the sampler correction's weights masked (or all but zeroed) every token: another policy sampled the data
        # (the first-step mismatch warning says so), not a saturated one (a probe: "learning_rate 1e-06 too high?")
        corrected_away = (number(row, "sampling/importance_sampling_ratio/clipped_frac") or 0) >= 1 \
            or (weight_max is not None and weight_max < 1e-6)
        if number(row, "grad_norm") == 0 and spread is not None and spread < 1 and "step" in row \
                and not (number(row, "clip_ratio/region_mean") or 0) > 0 and not corrected_away:
            stalled.append(int(row["step"]))
    return stalled


def stall_warning(stalled: list[int], learning_rate: float) -> str | None:
    """What to tell a user whose run stalled (:func:`stalled_steps`)."""
    if not stalled:
        return None
    # (logged steps: with logging_steps > 1 each stands for its window, its grad_norm the last step's)
    where = (f"step {stalled[0]}" if len(stalled) == 1 else f"{len(stalled)} logged steps ({stalled[0]}..{stalled[-1]})")
    return (f"polar-train train: warning: {where} learned nothing: gradient norm 0 although rewards differed within "
            f"a group and no token was clipped - the policy saturated (learning_rate {learning_rate:g} too high?) or "
            "no completion token was trainable; metrics.jsonl has each step's grad_norm and entropy")


#: Written into each checkpoint: the first-epoch mismatch list so far, so a resumed run's summary
#: still reports the run's first step (the resumed process only sees the steps after the checkpoint).
MISMATCH_FILE = "polar_first_epoch_mismatch.json"


class MismatchCheckpointCallback(TrainerCallback):
    """Keep :attr:`RecordedGRPOTrainer.first_epoch_mismatch` with every checkpoint."""

    def __init__(self, trainer: RecordedGRPOTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            values = [v if math.isfinite(v) else None for v in self.trainer.first_epoch_mismatch]
            saved = {"values": values, "updates": self.trainer.first_epoch_updates}
            try:
                (folder / MISMATCH_FILE).write_text(json.dumps(saved) + "\n")
            except OSError as exc:
                raise TrainFailure(f"cannot save {folder / MISMATCH_FILE}: {save_error(exc)}") from None


def restore_first_epoch_mismatch(trainer: RecordedGRPOTrainer, checkpoint: str | Path) -> bool:
    """Load the lists :class:`MismatchCheckpointCallback` saved (older versions: the values alone,
    their updates unknown); False for a checkpoint without them (then the first step's value is
    not known)."""
    try:
        saved = json.loads((Path(checkpoint) / MISMATCH_FILE).read_text())
    except (OSError, ValueError):
        return False
    values, updates = (saved.get("values"), saved.get("updates")) if isinstance(saved, dict) else (saved, None)
    if not isinstance(values, list) or not all(v is None or isinstance(v, (int, float)) for v in values):
        return False
    if not (isinstance(updates, list) and len(updates) == len(values)
            and all(u is None or (isinstance(u, int) and not isinstance(u, bool)) for u in updates)):
        updates = [None] * len(values)
    trainer.first_epoch_mismatch = [float("nan") if v is None else float(v) for v in values]
    trainer.first_epoch_updates = list(updates)
    return True


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the logged rows after ``step`` from ``metrics.jsonl``: a run resumed from the checkpoint
    of ``step`` logs the later steps again (each would be there twice)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a line cut short when the run was killed
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the file stays as it was, and no stray copy beside it
        raise


def last_good_checkpoint(out: Path, step: int) -> Path | None:
    """The newest ``checkpoint-N`` (N at most ``step``) whose adapter loads and is finite: the
    weights a new run goes on from (a newer one of an earlier try, a NaN one an earlier version
    saved, or one cut short is no such)."""
    return complete_checkpoint(out, resumable=False, up_to=step)[0]


class DivergenceCallback(TrainerCallback):
    """Stop at the first optimizer step that leaves a trained weight NaN or infinite, before its
    checkpoint is saved: a run that diverged at step 2 went on to its last step, saved a checkpoint
    of NaNs at each ``save_steps`` and logged a loss of 0, and only its end said so; a user (and the
    training notebook) then took the last checkpoint, all NaN, to continue from."""

    def __init__(self, trainer: RecordedGRPOTrainer, metrics: Path) -> None:
        self.trainer = trainer
        self.metrics = metrics

    def on_step_end(self, args, state, control, **kwargs):
        trained = [(n, p) for n, p in self.trainer.model.named_parameters() if p.requires_grad]
        broken = non_finite_tensors(trained)
        if not broken:
            return
        problem = (f"training diverged at step {state.global_step}: non-finite adapter weights ({len(broken)} of "
                   f"{len(trained)} tensors, e.g. {broken[0]}); stopped before saving them")
        if state.is_world_process_zero:  # a row that says why the run ended, for whoever reads metrics.jsonl
            with contextlib.suppress(OSError):
                with open(self.metrics, "a") as f:
                    f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, "error": problem}) + "\n")
        last = last_good_checkpoint(Path(args.output_dir), state.global_step)
        earlier = (f"{last.name} holds the weights before (a new --output with --set init_adapter={last} goes on "
                   "from them); " if last else "")
        raise TrainFailure(f"{problem}; {earlier}lower learning_rate or check the options that scale the loss")


class LastStepLogCallback(TrainerCallback):
    """Log the run's last step too: with ``logging_steps`` above 1 the steps after the last logging
    step had their loss and gradient norm in no row (TRL folded their other metrics into the totals
    row), so a user saw the end of a run only as the average ``train_loss``."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps and args.logging_strategy == "steps":
            control.should_log = True
        return control


class MetricsFileCallback(TrainerCallback):
    """Append every logged metrics dict to ``metrics.jsonl`` (one JSON object per log)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step, "epoch": state.epoch,
               "time_s": round(time.time() - self.start, 3)}
        non_finite = []
        for k, v in logs.items():
            if isinstance(v, float) and not math.isfinite(v):
                row[k] = None  # (JSON has no NaN)
                non_finite.append(k)
            else:
                row[k] = v
        if non_finite:  # a null alone read as "no value there" (no sampler logprob), a NaN loss too
            row["non_finite"] = non_finite
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as exc:
            raise TrainFailure(f"cannot write {self.path}: {save_error(exc)}") from None
