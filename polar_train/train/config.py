"""The trainer's one configuration: TRL's ``GRPOConfig`` fields, our data fields, LoRA fields.

Why one dataclass read by TRL's ``TrlParser``: a ``train.yaml`` is then written exactly like a
TRL config (flat keys, ``env:`` block), ``GRPOConfig`` options work unchanged (those that cannot on
recorded data with a LoRA are refused up front: docs/train.md), and
``--set key=value`` is parsed with the same type coercion as TRL's own command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from trl import GRPOConfig, TrlParser

from ..cli import UserError
from ..paths import expand_home, not_a_file
from ..yaml_errors import yaml_problem


#: TRL's vLLM importance-sampling modes (its error message, raised only mid-training, lists these).
_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: TRL's importance_sampling_level values (others it refuses only mid-training).
_IS_LEVELS = ("token", "sequence")
#: The loss types whose clipped ratio TRL (1.16) also clamps at ``delta`` (the others ignore it).
_DELTA_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _documented_loss_types() -> tuple[str, ...]:
    """The loss types GRPOConfig's own help lists ("Supported values are 'grpo', ..."), so the list
    follows the installed TRL; empty (no check) if that sentence is not there."""
    import re

    help_text = next((f.metadata.get("help", "") for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type"), "")
    sentence = re.search(r"Supported values are (.*?)\.", help_text)
    return tuple(re.findall(r"'([a-z_]+)'", sentence.group(1))) if sentence else ()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class TrainConfig(GRPOConfig):
    """``GRPOConfig`` plus what training on recorded trajectories needs.

    Defaults that differ from TRL's (and why):
      * ``bf16``: auto - on when CUDA is available, off on CPU (float32 keeps the trainer's
        logprobs equal to a float32 sampler's; TRL's default is always on).
      * ``use_cpu``: auto - on when no CUDA device is visible.
      * ``vllm_importance_sampling_mode`` = ``token_truncate``, ``vllm_importance_sampling_clip_max``
        = 2.0: TRL's vLLM importance-sampling options are reused for the recorded sampler -
        the per-token weight ``min(pi_old / pi_sampler, cap)`` (truncated importance sampling).
      * ``num_train_epochs`` = 1, ``logging_steps`` = 1, ``report_to`` = tensorboard,
        ``max_completion_length`` = 8192 (agent trajectories are long; longer ones are truncated,
        and reported).
      * ``num_generations``: taken from the data (the most common group size) when not set;
        ``per_device_train_batch_size``: ``num_generations`` when not set.
    """

    # ---- overridden GRPOConfig defaults -------------------------------------------------------
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; default: on with CUDA."})
    use_cpu: bool | None = field(default=None, metadata={"help": "Train on CPU; default: when no CUDA."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the trajectories."})
    logging_steps: float = field(default=1, metadata={"help": "Log metrics every N optimizer steps."})
    report_to: None | str | list[str] = field(
        default_factory=lambda: ["tensorboard"],
        metadata={"help": "Integrations to report to (TensorBoard logs go under <output>/runs)."},
    )
    max_completion_length: int | None = field(
        default=8192, metadata={"help": "Completions longer than this are truncated (and reported)."}
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={"help": "How recorded sampler logprobs weight the loss: token_truncate | token_mask | "
                  "sequence_truncate | sequence_mask (TRL's vLLM option, applied to the recorded sampler)."},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=2.0, metadata={"help": "Cap of the importance weight pi_old / pi_sampler."}
    )

    # ---- recorded data ------------------------------------------------------------------------
    allow_temperature_mismatch: bool = field(
        default=False,
        metadata={"help": "Train although `temperature` differs from the sampling temperature recorded "
                  "in the trajectories (the importance ratios are then wrong)."},
    )
    sampler_logprobs: str = field(
        default="raw",
        metadata={"help": "What the recorded logprobs are: `raw` (log-softmax of unscaled logits: vLLM's "
                  "default) or `processed` (after temperature: vLLM `--logprobs-mode processed_logprobs`). "
                  "Raw logprobs are only comparable at temperature 1."},
    )
    unequal_groups: str = field(
        default="pad",
        metadata={"help": "Groups whose size differs from num_generations: `pad` (fill by resampling the "
                  "group's own trajectories; larger groups are split) or `drop`. Always reported."},
    )
    min_group_size: int = field(
        default=2, metadata={"help": "Smaller groups are dropped: one trajectory has no group baseline."}
    )
    advantage_baseline: str = field(
        default="trajectory",
        metadata={"help": "Whom a GRPO group's reward mean and std are taken over: `trajectory` (TRL's: every "
                  "trajectory in the group, a fork of a rollout or a padding copy too) or `rollout` (each "
                  "rollout once, however many trajectories it forked into - a history rewrite, a sub-agent - "
                  "its trajectories sharing its advantage). `rollout` needs scale_rewards group or none."},
    )
    init_adapter: str | None = field(
        default=None,
        metadata={"help": "Continue training this peft adapter (e.g. the one that served the capture) "
                  "instead of a fresh LoRA."},
    )

    # ---- LoRA (peft) --------------------------------------------------------------------------
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Modules that get LoRA; `all-linear` = every linear layer but the output head "
                  "(a LoRA on lm_head would be ignored by TRL's fused loss)."},
    )

    def __post_init__(self) -> None:
        # the CLI converts and checks what a YAML or --set says before this; a script that builds the
        # config itself got lora_r=4.5 into torch (a TypeError after the weights loaded) and use_vllm
        # or top_p accepted without a word
        if isinstance(self.scale_rewards, (bool, str)) and str(self.scale_rewards).lower() in ("true", "false"):
            # TRL's own documented booleans (`--set scale_rewards=false`, YAML `false`, Python False)
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        self._check_types()
        self._refuse_generation_options()
        cuda = _cuda()
        if self.use_cpu is None:
            self.use_cpu = not cuda
        if self.bf16 is None:
            self.bf16 = cuda and not self.use_cpu and not self.fp16
        if self.sampler_logprobs not in ("raw", "processed"):
            raise ValueError(f"sampler_logprobs must be 'raw' or 'processed', not {self.sampler_logprobs!r}")
        if self.unequal_groups not in ("pad", "drop"):
            raise ValueError(f"unequal_groups must be 'pad' or 'drop', not {self.unequal_groups!r}")
        if self.advantage_baseline not in ("rollout", "trajectory"):
            raise ValueError(f"advantage_baseline must be 'rollout' or 'trajectory', not {self.advantage_baseline!r}")
        if "lm_head" in (self.lora_target_modules or []):
            raise ValueError("lora_target_modules must not contain lm_head: TRL's fused loss ignores it")
        # values TRL itself only refuses mid-training (after the weights load) or never
        losses = _documented_loss_types()
        if losses and self.loss_type not in losses:
            raise ValueError(f"loss_type must be one of {', '.join(losses)}, not {self.loss_type!r}")
        if self.vllm_importance_sampling_mode not in _IS_MODES:
            raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(_IS_MODES)}, "
                             f"not {self.vllm_importance_sampling_mode!r}")
        for name in ("epsilon", "epsilon_high"):  # (only what was given: epsilon_high None is epsilon's)
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (the clip range around 1), got {getattr(self, name):g}")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}")
        if isinstance(self.init_adapter, str) and self.init_adapter.strip().lower() in ("", "none", "null"):
            self.init_adapter = None  # `--set init_adapter=none` over a YAML's: a fresh LoRA (not a folder "none")
        if isinstance(self.init_adapter, str):  # `--set init_adapter=~/runs/r1/adapter`: no shell expands it
            try:
                self.init_adapter = expand_home(self.init_adapter)
            except ValueError as exc:
                raise ValueError(f"init_adapter {exc}") from None
        if isinstance(self.lora_target_modules, str):  # YAML `lora_target_modules: q_proj`, not a list
            self.lora_target_modules = [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]
        self._refuse_what_cannot_hold()
        if self.mask_truncated_completions:
            # TRL calls every completion that does not end in EOS truncated; a recorded agent trajectory
            # ends in whatever the harness stopped at, so every token was masked and nothing trained
            raise ValueError("mask_truncated_completions is not supported on recorded trajectories: TRL "
                             "would mask every trajectory not ending in EOS and train nothing (trajectories "
                             "longer than max_completion_length are truncated and reported instead)")
        self._check_ranges()
        if isinstance(self.report_to, str) and self.report_to.strip().lower() in ("none", "all"):
            self.report_to = self.report_to.strip().lower()  # `None`: "None: not installed here" (a probe)
        if isinstance(self.report_to, str) and "," in self.report_to:  # --set report_to=tensorboard,wandb
            self.report_to = [v.strip() for v in self.report_to.split(",") if v.strip()]
        if isinstance(self.report_to, list) and len(self.report_to) > 1 and {"none", "all"} & set(self.report_to):
            raise ValueError(f"report_to {','.join(self.report_to)}: none and all stand alone; name the "
                             "integrations, or none")
        self._check_dict_options()
        batch_set_by_user = self.generation_batch_size is not None or self.steps_per_generation is not None
        try:
            super().__post_init__()
        except ValueError as exc:
            if batch_set_by_user or "must be divisible by num_generations" not in str(exc):
                raise
            # TRL names its internal generation_batch_size, which the user never set
            raise ValueError(
                f"per_device_train_batch_size ({self.per_device_train_batch_size}) x "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) x processes "
                f"({self.world_size}) = {self.generation_batch_size} must be a multiple of num_generations "
                f"({self.num_generations}): each step trains whole GRPO groups") from None
        # after TRL's post-init: it copies the deprecated vllm_importance_sampling_cap into clip_max
        self._check_importance_bounds()
        self._check_reporting()
        self._check_scheduler_kwargs()

    def _check_dict_options(self) -> None:
        """``lr_scheduler_kwargs`` given as text (``--set 'lr_scheduler_kwargs={...}'``) is JSON of a
        mapping: transformers parses only text that starts with ``{`` and says nothing of the option
        in its JSON error; any other text stayed text and met ``**`` in the scheduler after the
        weights loaded."""
        value = self.lr_scheduler_kwargs
        if not isinstance(value, str):
            return
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"lr_scheduler_kwargs: not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"lr_scheduler_kwargs must be a mapping ({{\"min_lr\": 1e-7}}), got {value!r}")
        self.lr_scheduler_kwargs = parsed  # (transformers parses only text that starts with "{": " {" stayed text)

    def _check_scheduler_kwargs(self) -> None:
        """Each key of ``lr_scheduler_kwargs`` is a parameter of ``lr_scheduler_type``'s schedule:
        ``{min_lr: 1e-7}`` with the default linear schedule was a TypeError after the weights loaded."""
        kwargs = self.lr_scheduler_kwargs
        if not kwargs or not isinstance(kwargs, dict):
            return
        from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
        from transformers.trainer_utils import SchedulerType

        kind = SchedulerType(self.lr_scheduler_type)
        function = TYPE_TO_SCHEDULER_FUNCTION.get(kind)
        if function is None:
            return
        params = inspect.signature(function).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        # what get_scheduler passes itself; constant schedules are given no kwargs at all
        own = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}
        takes = [] if kind in (SchedulerType.CONSTANT, SchedulerType.CONSTANT_WITH_WARMUP) else \
            [n for n in params if n not in own]
        if unknown := sorted(set(kwargs) - set(takes)):
            hint = "; min_lr needs lr_scheduler_type cosine_with_min_lr" if "min_lr" in unknown else ""
            raise ValueError(f"lr_scheduler_kwargs: {', '.join(unknown)} is no option of lr_scheduler_type "
                             f"{kind.value} (its options: {', '.join(takes) or 'none'}{hint})")

    def _check_types(self) -> None:
        """Each option of a plain type (bool, int, float, str, list) holds one, converted where the
        meaning is plain: a numpy number is its Python number, an int a float, a whole float
        (1800.0) an int, 0/1 a bool, a path a string; None is left to the option's own checks."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kinds = _hint_kinds(f.name)
            if value is None or kinds is None:
                continue
            converted = value.item() if isinstance(value, numbers.Number) and hasattr(value, "item") else value
            if isinstance(converted, os.PathLike) and str in kinds:
                converted = os.fspath(converted)
            elif isinstance(converted, float) and int in kinds and float not in kinds and converted.is_integer():
                converted = int(converted)
            elif (bool in kinds and int not in kinds and not isinstance(converted, bool)
                  and isinstance(converted, int) and converted in (0, 1)):
                converted = bool(converted)
            if converted is not value:
                setattr(self, f.name, value := converted)
            if isinstance(value, bool):  # (a bool is an int to isinstance)
                fits = bool in kinds
            else:
                fits = ((int in kinds and isinstance(value, int))
                        or (float in kinds and isinstance(value, (int, float)))
                        or (str in kinds and isinstance(value, str))
                        or (list in kinds and isinstance(value, (list, tuple, str))))
            if not fits:
                wanted = " or ".join(_KIND_NAMES[k] for k in (bool, int, float, str, list) if k in kinds)
                raise ValueError(f"{f.name} must be {wanted}, not {value!r}")

    def _refuse_generation_options(self) -> None:
        """TRL's options for generating (vLLM, sampling) set to anything but their defaults."""
        for f in dataclasses.fields(self):
            if _is_generation_option(f.name) and f.default is not dataclasses.MISSING:
                value = getattr(self, f.name)
                if value != f.default and not _is_default(f.name, value):
                    raise ValueError(f"{f.name}: this trainer trains recorded trajectories only and generates "
                                     "nothing (no vLLM): sample with your server through the capture proxy, "
                                     "then build and train")

    def _refuse_what_cannot_hold(self) -> None:
        """GRPOConfig options that fail here after the weights load (a traceback), go unused without a
        word, or break the recorded logprobs' exactness (a probe of every option people change)."""
        if self.hub_token:  # pickled as given into every training_args.bin (adapter/ too)
            raise ValueError("hub_token: a token given as an option is written into every training_args.bin "
                             "(the adapter folder's too): set the HF_TOKEN environment variable instead")
        if self.cast_lm_head_to_fp32:  # TRL's cast assumes a model without an adapter: AttributeError
            raise ValueError("cast_lm_head_to_fp32 is not supported with the LoRA adapter this trainer trains "
                             "(TRL's cast assumes a model without one)")
        if self.sync_ref_model:
            raise ValueError("sync_ref_model is not supported with LoRA (TRL refuses it for a PEFT model): the "
                             "reference is the model without the adapter")
        if self.neftune_noise_alpha is not None:
            raise ValueError("neftune_noise_alpha is not supported: its noise on the embeddings makes the trainer's "
                             "logprobs differ from the recorded ones (a first-step mismatch of ~4 nats), and the "
                             "importance weights with them")
        if self.model_init_kwargs and str(self.model_init_kwargs).strip().lower() not in ("{}", "null", "none"):
            raise ValueError("model_init_kwargs is not used: polar-train loads the model itself (float32 on CPU, "
                             "bf16 on a GPU: bf16=...)")
        if self.fp16 and (self.use_cpu or not _cuda()):
            raise ValueError("fp16 needs a CUDA GPU: on CPU the run is float32 whatever it says (bf16=true "
                             "is CPU's half precision)")
        need_positive = {"sapo_temperature_pos": self.sapo_temperature_pos,
                         "sapo_temperature_neg": self.sapo_temperature_neg}
        for name, value in need_positive.items():
            if self.loss_type == "sapo" and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number above 0 (SAPO divides by it), got {value}")
        # TRL checks this only where vLLM samples (use_vllm); here the recorded logprobs play its part
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction and \
                self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
            raise ValueError("loss_type vespo needs vllm_importance_sampling_mode token_truncate or token_mask "
                             f"(it weighs tokens, not sequences), got {self.vllm_importance_sampling_mode}")

    def _check_ranges(self) -> None:
        """Values TRL, transformers or torch refuse only after the weights load, with a traceback
        (``num_generations=0``: a division by zero), or never: a negative ``beta`` or importance-weight
        cap trains "successfully" with a reversed gradient, ``max_steps=0`` writes an untrained adapter."""
        def need(ok: bool, what: str, value: Any) -> None:
            if not ok:
                raise ValueError(f"{what}, got {value}")

        need(self.num_generations is not None and self.num_generations >= 2, "num_generations must be at least 2 "
             "(GRPO compares the trajectories of a group)", self.num_generations)
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size must be at least 1",
             self.per_device_train_batch_size)
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be at least 1",
             self.gradient_accumulation_steps)
        for name in ("steps_per_generation", "generation_batch_size"):  # TRL's words after the weights loaded
            if getattr(self, name) is not None:
                need(getattr(self, name) >= 1, f"{name} must be at least 1", getattr(self, name))
        if str(getattr(self.logging_strategy, "value", self.logging_strategy)) == "steps":
            need(self.logging_steps > 0, "logging_steps must be above 0 (a step count, or a fraction of the run "
                 "below 1)", self.logging_steps)  # (-1 was taken: one averaged row at the end)
        need(math.isfinite(self.temperature) and self.temperature > 0, "temperature must be a number above 0 "
             "(the sampler's temperature)", self.temperature)
        need(math.isfinite(self.beta) and self.beta >= 0, "beta (the KL coefficient) must be a finite number "
             ">= 0", self.beta)
        need(math.isfinite(self.learning_rate) and self.learning_rate >= 0, "learning_rate must be a finite "
             "number >= 0", self.learning_rate)  # inf trained "successfully" into an adapter of NaNs
        need(self.max_steps >= 1 or self.max_steps == -1, "max_steps must be at least 1, or -1 (then "
             "num_train_epochs decides)", self.max_steps)
        if self.max_steps == -1:
            need(0 < self.num_train_epochs < math.inf, "num_train_epochs must be a finite number above 0 "
                 "(or set max_steps)", self.num_train_epochs)
        # optimizer numbers: NaN weight decay or a zero epsilon made the adapter NaN at step 1, said as a
        # divergence ("lower learning_rate"); a NaN max_grad_norm turned clipping off without a word
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay must be a finite number "
             ">= 0", self.weight_decay)
        need(math.isfinite(self.adam_epsilon) and self.adam_epsilon > 0, "adam_epsilon must be a finite number "
             "above 0 (it keeps Adam's division finite)", self.adam_epsilon)
        for name in ("adam_beta1", "adam_beta2"):
            need(0 <= getattr(self, name) < 1, f"{name} must be in [0, 1)", getattr(self, name))
        if self.max_grad_norm is not None:
            need(not math.isnan(self.max_grad_norm) and self.max_grad_norm >= 0, "max_grad_norm must be a number "
                 ">= 0 (0: no clipping)", self.max_grad_norm)
        need(self.lora_r >= 1, "lora_r must be at least 1", self.lora_r)
        need(self.lora_alpha > 0, "lora_alpha must be above 0 (the LoRA scale is alpha / r)", self.lora_alpha)
        need(self.min_group_size >= 1, "min_group_size must be at least 1", self.min_group_size)
        need(0 <= self.lora_dropout < 1, "lora_dropout must be in [0, 1)", self.lora_dropout)
        need(0 <= self.seed < 2**32, "seed must be in 0 .. 4294967295 (numpy's range)", self.seed)
        need(self.num_iterations >= 1, "num_iterations must be at least 1", self.num_iterations)
        need(0 <= self.top_entropy_quantile <= 1, "top_entropy_quantile must be in [0, 1]", self.top_entropy_quantile)
        if str(getattr(self.save_strategy, "value", self.save_strategy)) == "steps":
            need(self.save_steps > 0, "save_steps must be above 0 (a step count, or a fraction of the run below 1)",
                 self.save_steps)
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        need(scale in ("group", "batch", "none"), "scale_rewards must be group, batch or none (or TRL's true, "
             "false)", self.scale_rewards)
        aggregation = getattr(self, "multi_objective_aggregation", "sum_then_normalize")
        if self.advantage_baseline == "rollout" and (scale == "batch" or aggregation != "sum_then_normalize"):
            raise ValueError("advantage_baseline=rollout takes each group's own mean and std (scale_rewards group or "
                             f"none, multi_objective_aggregation sum_then_normalize); with scale_rewards={scale!r} and "
                             f"multi_objective_aggregation={aggregation!r} set advantage_baseline=trajectory")
        self._check_delta()
        need(self.importance_sampling_level in _IS_LEVELS, "importance_sampling_level must be "
             f"{' or '.join(_IS_LEVELS)}", self.importance_sampling_level)
        if self.use_liger_kernel:
            import importlib.util

            need(importlib.util.find_spec("liger_kernel") is not None, "use_liger_kernel needs the liger-kernel "
                 "package (pip install liger-kernel; a GPU kernel)", self.use_liger_kernel)

    def _check_delta(self) -> None:
        """TRL's two-sided clipping clamps the ratio pi / pi_old at ``delta`` before its clipped
        minimum: below ``1 + epsilon`` that clamp, not the clip range, decides for tokens of positive
        advantage, and at or below 1 (``delta: 0.2``, taken for epsilon) their loss is constant - a
        run "trained" only on its bad trajectories, unsaid. TRL documents the bound ("recommended >
        1 + ε")."""
        if self.delta is None:
            return
        if self.loss_type not in _DELTA_LOSSES:  # TRL reads delta in those losses only: a setting without effect
            raise ValueError(f"delta has no effect with loss_type {self.loss_type} (TRL clamps at delta only for "
                             f"{', '.join(_DELTA_LOSSES)}); leave delta out")
        name, upper = ("epsilon_high", self.epsilon_high) if self.epsilon_high is not None else ("epsilon", self.epsilon)
        if not self.delta >= 1 + upper:  # (NaN too; at 1 + epsilon_high the cap is the usual clipping)
            raise ValueError(f"delta must be at least 1 + {name} = {1 + upper:g}, got {self.delta:g}: TRL caps the ratio "
                             "pi/pi_old at delta, so a token of positive advantage whose ratio reaches delta gets no "
                             "gradient (at or below 1: every such token); leave delta out for one-sided clipping")

    def _check_importance_bounds(self) -> None:
        """The importance-weight bounds, as TRL will use them: a cap <= 0 (also one given through the
        deprecated ``vllm_importance_sampling_cap``) reversed every token's gradient, and a NaN bound
        passed TRL's comparisons and trained an adapter of NaNs."""
        hi, lo = self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_clip_min
        name = ("vllm_importance_sampling_cap" if self.vllm_importance_sampling_cap is not None
                else "vllm_importance_sampling_clip_max")
        if hi is not None and not (math.isfinite(hi) and hi > 0):
            raise ValueError(f"{name} (the cap of the importance weight) must be a finite number above 0, got {hi}")
        if lo is not None and not (math.isfinite(lo) and lo >= 0):
            raise ValueError("vllm_importance_sampling_clip_min (the lower bound of the importance weight) must "
                             f"be a finite number >= 0, got {lo}")

    def _check_reporting(self) -> None:
        """An integration named in ``report_to`` whose package is missing fails in transformers only
        once the weights are loaded (``WandbCallback requires wandb to be installed``)."""
        from transformers.integrations import get_available_reporting_integrations

        available = get_available_reporting_integrations()
        missing = [name for name in self.report_to or [] if name not in available]
        if missing:
            raise ValueError(f"report_to {', '.join(missing)}: not installed here (installed: "
                             f"{', '.join(available) or 'none'}); pip install it or --set report_to=none")

    def lora_config(self):
        from peft import LoraConfig

        targets: Any = self.lora_target_modules
        if targets == ["all-linear"]:
            targets = "all-linear"
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")


class _Parser(TrlParser):
    """TrlParser whose errors are one clear line (a ``UserError``), not a usage dump and exit, and
    which takes the YAML's values as :func:`read_yaml` checked and converted them (TRL hands them to
    the dataclass as YAML typed them: argparse converts only string defaults)."""

    def __init__(self, *args: Any, yaml_values: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yaml_values = yaml_values or {}

    def error(self, message: str):  # noqa: D401 - argparse hook
        # argparse names TRL's option ("argument --max_steps/--max-steps: invalid int value: 'nan'");
        # its values come from --set (the YAML's are defaults, not parsed): name the user's words
        m = re.fullmatch(r"argument --(\w+)(?:/--[\w-]+)?: (.*)", message, flags=re.S)
        if m and m[1] == "output_dir":  # from --output, not --set
            raise UserError(f"--output: {m[2]}")
        if m and m[1] in _FIELDS:
            raise UserError(f"--set {m[1]}: {m[2]}")
        raise UserError(f"bad configuration: {message}")

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        return super().set_defaults_with_config(**{**kwargs, **self.yaml_values})


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _type_hints() -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(TrainConfig)
    except Exception:  # noqa: BLE001 - an annotation this Python cannot resolve: no YAML type checks
        return {}


_HINTS = _type_hints()


def _type_text(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


#: Each option's declared type as text, from the classes' annotations: transformers' HfArgumentParser
#: rewrites a union's ``Field.type`` in place (``dict | str | None`` became ``str``), and TRL's
#: fields are ours, so a check that read ``Field.type`` after any parse of GRPOConfig (a script's
#: own, before it imported this module) judged by another type.
_FIELD_TYPES = {name: _type_text(_HINTS[name]) if name in _HINTS else str(f.type) for name, f in _FIELDS.items()}


#: TRL's sampling options, which only its own generation reads: on recorded data they did nothing,
#: unsaid (temperature is read: the trainer's logprobs are taken at the sampler's temperature).
_SAMPLING_OPTIONS = frozenset({"top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs"})


def _is_generation_option(key: str) -> bool:
    """TRL's options for generating with vLLM (its importance-sampling options apply to recorded data)
    and for sampling."""
    return key == "use_vllm" or key in _SAMPLING_OPTIONS or (
        key.startswith("vllm_") and not key.startswith("vllm_importance_sampling_"))


def _is_default(key: str, value: Any) -> bool:
    """Whether ``value`` (as given: a --set string or a YAML value) is the option's default: a TRL
    config copied with ``top_p: 1.0`` or ``use_vllm: false`` sets nothing."""
    default = _FIELDS[key].default
    if value is None or str(value).strip().lower() in ("none", "null", ""):
        return default is None
    if isinstance(default, bool):
        from transformers.hf_argparser import string_to_bool

        try:
            return string_to_bool(value if isinstance(value, bool) else str(value)) is default
        except argparse.ArgumentTypeError:
            return False
    if isinstance(default, str):
        return str(value).strip() == default
    try:
        return default is not None and float(value) == float(default)
    except (TypeError, ValueError):
        return False


def _refuse_generation_option(where: str, key: str, value: Any) -> None:
    """Refuse a generation option set to anything but its default (which generates nothing)."""
    if _is_generation_option(key) and not _is_default(key, value):
        raise UserError(f"{where}{key}: this trainer trains recorded trajectories only and generates nothing "
                        "(no vLLM): sample with your server through the capture proxy, then build and train")


def _hint_kinds(key: str) -> set[type] | None:
    """The plain types a field accepts (bool, int, float, str, list), or None when it takes others
    too (enums, dicts): those are left to TRL."""
    import types
    import typing

    hint = _HINTS.get(key)
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds: set[type] = set()
    for arg in args:
        if arg is type(None):
            continue
        arg = typing.get_origin(arg) or arg
        if arg not in (bool, int, float, str, list):
            return None
        kinds.add(arg)
    return kinds or None


def _list_item_kind(key: str) -> type | None:
    import typing

    for arg in (typing.get_args(_HINTS.get(key)) or ()) + (_HINTS.get(key),):
        if typing.get_origin(arg) is list and typing.get_args(arg):
            item = typing.get_args(arg)[0]
            return item if item in (str, int, float) else None
    return None


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               list: "a list (or a comma-separated string)"}


def _yaml_value(key: str, value: Any) -> Any:
    """``value`` converted to the field's type, or ValueError: ``lora_r: 4.5`` or ``max_steps: 1.5``
    reached the trainer (a TypeError after the weights loaded), ``lora_target_modules: 5`` too."""
    kinds = _hint_kinds(key)
    if key == "scale_rewards" and isinstance(value, bool):  # TRL documents true (group) and false (none)
        return "group" if value else "none"
    if kinds is None:
        return value
    wanted = " or ".join(_KIND_NAMES[k] for k in (bool, int, float, str, list) if k in kinds)
    bad = ValueError(f"expected {wanted}, got {value!r}")
    if isinstance(value, str):
        if kinds == {bool}:  # `bf16: "maybe"`: argparse would convert it as a default and blame --set
            from transformers.hf_argparser import string_to_bool  # (what argparse converts --set with)

            try:
                return string_to_bool(value)
            except argparse.ArgumentTypeError:
                raise bad from None
        if list in kinds and str not in kinds:
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif str not in kinds and bool not in kinds:
            # `lora_r: "eight"`: argparse would convert it as a default and blame --set
            for kind in (int, float):
                if kind in kinds:
                    try:
                        return kind(value)
                    except ValueError:
                        pass
            raise bad
        else:
            return value  # argparse converts string defaults, with its own message
    if isinstance(value, bool):
        if bool in kinds:
            return value
        raise bad
    if isinstance(value, int):
        if int in kinds:
            return value
        if float in kinds:
            return float(value)
        if str in kinds:  # `run_name: 7`
            return str(value)
        raise bad
    if isinstance(value, float):
        if float in kinds:
            return value
        if int in kinds and value.is_integer():
            return int(value)
        if str in kinds and int not in kinds:
            return str(value)
        raise bad
    if isinstance(value, list):
        if list not in kinds:
            raise bad
        item = _list_item_kind(key)
        if item is str and not all(isinstance(v, str) for v in value):
            raise ValueError(f"expected a list of strings, got {value!r}")
        if item in (int, float) and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ValueError(f"expected a list of numbers, got {value!r}")
        return value
    raise bad


def parse_sets(sets: list[str]) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{k: v}`` with a clear error for an unknown key or a missing ``=``."""
    out: dict[str, str] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UserError(f"--set expects key=value, got {item!r}")
        if key not in _FIELDS:
            raise UserError(f"--set {key}: unknown option (see docs/train.md or data/train.yaml)")
        if key == "output_dir":
            raise UserError("--set output_dir: the run folder is --output")
        # (an optional path or number may be cleared - `init_adapter=` over a YAML's -; a list is not)
        clears = ("None" in _FIELD_TYPES[key] or "Optional" in _FIELD_TYPES[key]) and "list" not in _FIELD_TYPES[key]
        if not value.strip() and not clears:  # `--set report_to=` was "report_to : not installed" (a probe)
            raise UserError(f"--set {key}: empty value (leave the option out for its default)")
        _refuse_generation_option("--set ", key, value)
        if key in out:  # as in the YAML: argparse kept the last one without a word
            raise UserError(f"--set {key} is given twice (the last one would win unsaid)")
        out[key] = value
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(key, line)
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML lets the last one win
    without a word, so an edit below an old value of the same option did nothing visible."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)  # merge keys (<<: *defaults) first, as the safe loader does
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
            except TypeError:  # a list or mapping as a key: the safe loader's own error says so
                break
        return super().construct_mapping(node, deep)


#: A number JSON reads as one and YAML 1.1 (PyYAML) as a string: ``1e-7`` (no dot in the mantissa).
_YAML_STRING_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _json_numbers(value: Any) -> Any:
    """``value`` (a YAML mapping's content) with the numbers PyYAML read as strings made numbers, as
    JSON (``--set``) reads them: ``{min_lr: 1e-7}`` reached the scheduler as ``"1e-7"``, a TypeError
    after the weights loaded."""
    if isinstance(value, dict):
        return {k: _json_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_numbers(v) for v in value]
    if isinstance(value, str) and _YAML_STRING_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def read_yaml(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if (problem := not_a_file(p, "config file")) is not None:
        raise UserError(problem)
    try:
        data = yaml.load(p.read_text("utf-8"), Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as exc:
        raise UserError(f"{p}: line {exc.line}: {exc.key} is given twice (the last one would win unsaid)") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{p}: not valid YAML: {yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:  # a binary file given by mistake: the codec's words named no file
        raise UserError(f"{p}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read {p}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: must contain a YAML mapping of option: value")
    unknown = sorted(str(k) for k in data if k != "env" and k not in _FIELDS)
    if unknown:
        raise UserError(f"{p}: unknown option(s) {', '.join(unknown)} (see docs/train.md)")
    if "output_dir" in data:
        raise UserError(f"{p}: output_dir: the run folder is given as --output")
    for key, value in data.items():
        # TRL hands YAML values to the dataclass unconverted: a null or a mapping reached torch's
        # optimizer (a TypeError mid-training) instead of being refused here
        if key == "env":
            _check_env_block(p, value)
            continue
        if isinstance(value, dict):
            if "dict" in _FIELD_TYPES[key]:  # lr_scheduler_kwargs: {min_lr: 1.0e-7}, as --set takes JSON
                _refuse_generation_option(f"{p}: ", key, value)  # (generation_kwargs: the sampler's, not ours)
                data[key] = _json_numbers(value)
                continue
            raise UserError(f"{p}: {key}: expected a value, got a mapping")
        if value is None and "None" not in _FIELD_TYPES[key] and "Optional" not in _FIELD_TYPES[key]:
            raise UserError(f"{p}: {key}: expected a value, got null (leave the option out for its default)")
        _refuse_generation_option(f"{p}: ", key, value)
        if value is not None:
            try:
                data[key] = _yaml_value(key, value)
            except ValueError as exc:
                raise UserError(f"{p}: {key}: {exc}") from None
    return data


def _check_env_block(path: Path, env: Any) -> None:
    """TRL sets each ``env:`` entry with ``os.environ[key] = str(value)``: an empty name was an
    OSError traceback, a name with ``=`` a ValueError naming nothing, and ``null`` set the word None."""
    if not isinstance(env, dict):
        raise UserError(f"{path}: env: expected a mapping of NAME: value, got {type(env).__name__}")
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise UserError(f"{path}: env: {name!r} is no environment variable name")
        if value is None or isinstance(value, (dict, list)) or "\0" in str(value):
            raise UserError(f"{path}: env: {name}: expected a value (a string or a number), got "
                            f"{'null' if value is None else type(value).__name__}")


def load_config(config_path: str | None, sets: list[str], output_dir: str,
                data_defaults: dict[str, Any] | None = None) -> TrainConfig:
    """Read ``train.yaml`` the way TRL does, apply ``--set`` overrides, then ``data_defaults``
    for options the user set nowhere (e.g. ``num_generations`` from the data's group size)."""
    user = read_yaml(config_path)
    overrides = parse_sets(sets)
    args: list[str] = []
    if config_path is not None and user:  # an empty file (or comments only): TRL refused it in its words
        args += ["--config", str(config_path)]
    for key, value in {**(data_defaults or {}), **overrides}.items():
        if key in user and key not in overrides:
            continue
        args.append(f"--{key}")
        ftype = _FIELD_TYPES[key]  # the annotation's text (this module's annotations are strings)
        # a field that may also be one str (report_to) is parsed as a str: the list is split after
        one_str = "str" in {alternative.strip() for alternative in ftype.split("|")}
        if "list" in ftype and not one_str and "," in str(value):
            args += [v.strip() for v in str(value).split(",") if v.strip()]
        else:  # one word: a value such as -inf or -1 was taken for an option ("expected one argument")
            args[-1] = f"--{key}={value}"
    args.append(f"--output_dir={output_dir}")  # one word: a folder named -run is no option
    try:
        parser = _Parser(dataclass_types=[TrainConfig], yaml_values={k: v for k, v in user.items() if k != "env"})
        (config,) = parser.parse_args_and_config(args=args)
    except ValueError as exc:  # a value __post_init__ (ours or TRL's) refuses: the user's input
        raise UserError(str(exc)) from None
    return config


def user_options(config_path: str | None, sets: list[str]) -> dict[str, Any]:
    """Options the user gave explicitly: the YAML's, overridden by ``--set`` (values as given)."""
    return {**{k: v for k, v in read_yaml(config_path).items() if k != "env"}, **parse_sets(sets)}
