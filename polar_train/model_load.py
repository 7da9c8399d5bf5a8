"""Loading a model folder's weights (and a LoRA adapter) with an error a user can act on.

Why: transformers and peft report a folder without weights, a broken ``config.json`` or a broken
adapter as ``OSError``/``ValueError`` deep in their stacks; ``serve`` and ``train`` must say in one
line which folder is wrong and why, not print a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from collections.abc import Iterable
from typing import Any


#: The weight files peft saves and loads for an adapter.
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class ModelLoadError(ValueError):
    """A model or adapter folder that cannot be loaded (the CLI prints it as one line)."""


def first_line(exc: BaseException) -> str:
    """An exception's message as one line (libraries put details on the lines after)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:  # "Validation error for field 'x':" says why below
        return f"{lines[0]} {lines[1]}"
    if isinstance(exc, KeyError) and any(c.isalpha() for c in lines[0]):  # a file without a key the loader reads
        return f"missing key {lines[0]} (a file there is not what the loader expects)"  # (a bare 'added_tokens')
    if not any(c.isalpha() for c in lines[0]):  # a bare number (pickle's KeyError for a junk .bin) says nothing
        return f"{type(exc).__name__}: {lines[0]}"
    return lines[0]


#: What the loaders read from a model or adapter folder (a README or a log there is not read).
_READ_SUFFIXES = frozenset({".json", ".safetensors", ".bin", ".jinja", ".model", ".tiktoken", ".txt"})


def check_readable(folder: str | os.PathLike) -> None:
    """Refuse a folder with a file the loaders read but may not: transformers and peft report an
    unreadable weights file as "No such file or directory", which sends the user looking for a
    file that is there."""
    root = Path(folder)
    try:
        entries = sorted(root.iterdir()) if root.is_dir() else []
    except OSError as exc:
        raise ModelLoadError(f"cannot read {root}: {exc.strerror or exc}") from None
    for path in entries:
        if path.suffix in _READ_SUFFIXES and path.is_file():
            try:
                path.open("rb").close()
            except OSError as exc:
                raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from None


def load_causal_lm(model_dir: str | os.PathLike, dtype: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` of a local folder, failures as :class:`ModelLoadError`."""
    from transformers import AutoModelForCausalLM

    check_readable(model_dir)
    with _held_load_reports() as reports:
        try:
            return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - any failure here is the folder's: cut or corrupt weights
            # (safetensors' own error type), a config.json of wrong types (a dataclass validation error)
            mismatch = _size_mismatch(reports) if "ignore_mismatched_sizes" in str(exc) else None
            if mismatch is not None:
                reports.clear()  # (said in the one line instead; another failure's message points to it)
                raise ModelLoadError(f"cannot load the model in {Path(model_dir)}: its config.json does not fit "
                                     f"its weights ({mismatch})") from None
            raise ModelLoadError(f"cannot load the model in {Path(model_dir)}: {first_line(exc)}") from None


@contextlib.contextmanager
def _held_load_reports():
    """Hold back transformers' LOAD REPORT while a model loads: where the load then fails on a
    config that does not fit the weights, its ~20-line table came before an error that blamed
    ``ignore_mismatched_sizes``, an argument the user never set. A load that succeeds logs it."""
    import logging

    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            if not any(record is h for h in held):  # (each of several handlers sees it)
                held.append(record)
            return False
        return True

    root = logging.getLogger("transformers")
    catcher = logging.NullHandler()  # (where transformers has no handler, Python's last resort printed it)
    handlers = [*root.handlers, catcher]
    for handler in handlers:  # the records its children hand up to its handlers
        handler.addFilter(hold)
    root.addHandler(catcher)
    root.addFilter(hold)  # and its own
    propagate, root.propagate = root.propagate, False  # (CI=1 makes it propagate: Python's handlers too)
    try:
        yield held
    finally:
        root.propagate = propagate
        root.removeFilter(hold)
        root.removeHandler(catcher)
        for handler in handlers:
            handler.removeFilter(hold)
        for record in held:
            root.handle(record)


def _size_mismatch(reports: list) -> str | None:
    """The report's first ``MISMATCH`` row, as "KEY: checkpoint SHAPE, config SHAPE"."""
    import re

    for record in reports:
        for line in record.getMessage().splitlines():
            cells = [c.strip() for c in line.split("|")]
            found = re.search(r"ckpt: torch\.Size\((\[.*?\])\) vs model: ?torch\.Size\((\[.*?\])\)", line)
            if len(cells) >= 2 and "MISMATCH" in cells[1] and found:
                return f"{cells[0]}: weights {found.group(1)}, config {found.group(2)}"
    return None


def lora_target_problems(model_dir: str | os.PathLike, targets: list[str]) -> list[str]:
    """What is wrong with each of ``targets`` (peft's list form: a module name or its last dotted
    parts) on the model in ``model_dir``: it names no module, or only modules LoRA cannot adapt (a
    block such as ``mlp``); empty when all are fine or the model cannot be built here (its loader
    says why). Why: peft says so only after the weights loaded (minutes for a 4B model), the block
    case in a many-line dump of the block; the model built on torch's meta device costs no memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    adaptable = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                 torch.nn.MultiheadAttention, Conv1D)  # peft's LoRA layer types

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    except Exception:  # noqa: BLE001 - a config the loader refuses: load_causal_lm says it in one line
        return []
    modules = list(model.named_modules())
    problems = []
    for target in targets:
        kinds = {type(m).__name__: isinstance(m, adaptable)
                 for n, m in modules if n == target or n.endswith("." + target)}
        if target == "all-linear" and not kinds:  # peft reads it literally in a list: "names no module ...; or all-linear"
            problems.append("all-linear stands alone (every linear layer), not in a list of names")
        elif not kinds:
            problems.append(f"{target} names no module")
        elif not any(kinds.values()):
            problems.append(f"{target} names {', '.join(sorted(kinds))} blocks, which LoRA cannot adapt")
    if problems:
        # (GPT-2's are transformers' Conv1D: listed none, though all-linear and c_attn work)
        head = {n.rsplit(".", 1)[-1] for n, m in modules if m is model.get_output_embeddings()}
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules if isinstance(m, (torch.nn.Linear, Conv1D))} - head)
        problems.append(f"its linear layers: {', '.join(linear)}; or all-linear")
    return problems


def run_folder_hint(folder: str | os.PathLike, option: str) -> str:
    """What to say of a training run's folder given where a model folder is expected (``--model
    runs/r1``: "no tokenizer", "no config.json", and no word of the adapter inside); ``option``
    names the adapter's option, ``{}`` where its path goes."""
    inside = Path(folder).expanduser() / "adapter"
    if not (inside / "adapter_config.json").is_file():
        return ""
    return f"; a training run's folder? give its base model as --model, with {option.format(inside)}"


def check_adapter_folder(adapter_dir: str | os.PathLike) -> None:
    """Refuse a folder that is not a saved peft adapter before any weights are loaded (without
    its files peft would look the folder up on the Hub and report a malformed repository id)."""
    folder = Path(adapter_dir)
    if not folder.exists():
        raise ModelLoadError(f"{folder}: not found")
    if not (folder / "adapter_config.json").is_file():
        inside = folder / "adapter"
        hint = (f"; a training run's folder? its adapter is {inside}"
                if (inside / "adapter_config.json").is_file() else "")
        raise ModelLoadError(f"{folder} is not a peft adapter (no adapter_config.json){hint}")
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ModelLoadError(f"{folder} is not a peft adapter (no {' or '.join(ADAPTER_WEIGHTS)})")
    check_readable(folder)
    _check_lora_config(folder / "adapter_config.json")


def _check_lora_config(path: Path) -> None:
    """A LoRA adapter_config.json, or one line saying what is wrong with it: peft's own errors for
    a hand-edited file were a type error ("'<=' not supported between instances of 'str' and 'int'")
    or a list index, after lines of its warnings for another adapter type."""
    try:
        config = json.loads(path.read_text("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({first_line(exc)})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a JSON object of adapter options")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelLoadError(f"{path}: peft_type {kind!r}: only LoRA adapters are trained and served here")
    for key, number in (("r", int), ("lora_alpha", (int, float))):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, number) or value <= 0):
            raise ModelLoadError(f"{path}: {key} must be a positive number, got {value!r}")


def adapter_base_note(adapter_dir: str | os.PathLike, model_dir: str | os.PathLike) -> str | None:
    """A warning when the adapter says it was trained on another base model folder than the one it
    is loaded on. Shapes alike, peft loads it without a word and the policy is neither (a second
    tiny model, another fine-tune of one base). ``polar-train train`` records the base as an
    absolute path; a relative name or a Hub id is not compared (nothing to compare it with)."""
    try:
        saved = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(saved, str) or not os.path.isabs(saved):
        return None
    here = Path(model_dir).expanduser().resolve()
    if Path(saved).resolve() == here:
        return None
    return (f"warning: the adapter in {adapter_dir} was trained on the base model {saved}, and is loaded on {here} "
            "(a moved copy is fine; another model of the same shapes gives a policy that is neither)")


def load_adapter(model: Any, adapter_dir: str | os.PathLike, **kwargs: Any) -> Any:
    """``PeftModel.from_pretrained`` of a local adapter folder, failures as :class:`ModelLoadError`."""
    from peft import PeftModel

    check_adapter_folder(adapter_dir)
    try:
        with warnings.catch_warnings():  # transformers' deprecation notices from inside peft: noise to a user
            warnings.filterwarnings("ignore", message=r".*deprecated and will be removed in v6", category=FutureWarning)
            loaded = PeftModel.from_pretrained(model, str(adapter_dir), **kwargs)
    except Exception as exc:  # noqa: BLE001 - the folder's fault, e.g. safetensors' SafetensorError for cut weights
        text = str(exc)
        if "size mismatch" in text:  # torch's first line only says "Error(s) in loading state_dict"
            base = getattr(model, "name_or_path", "") or "this model"
            raise ModelLoadError(f"cannot load the adapter in {Path(adapter_dir)}: its weights do not fit {base} "
                                 f"(an adapter trained on another base model?): {_first_mismatch(text)}") from None
        folder = Path(adapter_dir)
        if not (folder / "adapter_model.safetensors").is_file():  # a pickle's errors do not name the file
            raise ModelLoadError(f"cannot load the adapter in {folder} (adapter_model.bin): "
                                 f"{first_line(exc)}") from None
        raise ModelLoadError(f"cannot load the adapter in {folder}: {first_line(exc)}") from None
    # a diverged run's weights (an earlier version saved them in its checkpoints): served, every
    # answer was garbage; trained from, the first step "diverged" and blamed the learning rate
    broken = non_finite_tensors((name, param) for name, param in loaded.named_parameters() if "lora_" in name)
    if broken:
        raise ModelLoadError(f"cannot load the adapter in {Path(adapter_dir)}: {len(broken)} of its tensors hold NaN or "
                             f"infinite values (e.g. {broken[0]}): the weights of a run that diverged")
    return loaded


def non_finite_tensors(named: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity (a diverged run's weights)."""
    import torch

    return [name for name, tensor in named if not bool(torch.isfinite(tensor.detach()).all())]


def _first_mismatch(text: str) -> str:
    """torch's first ``size mismatch for NAME: ...`` line, shortened to the name and both shapes."""
    line = next(ln.strip() for ln in text.splitlines() if "size mismatch" in ln)
    return line.replace("copying a param with shape torch.Size", "adapter").replace(
        " from checkpoint, the shape in current model is torch.Size", ", model").rstrip(".")
