"""A tiny, seeded, randomly initialised Qwen3 causal LM with the real Qwen3.5 tokenizer.

Why: nothing can be downloaded from a model hub here, yet every part of polar-train (server,
capture, builder, trainer, vLLM) needs a real model with the real vocabulary. Hidden size 64 and
two layers train on two CPU cores; ``head_dim = 32`` because vLLM's CPU attention backend supports
head sizes 32, 64, 80, ... only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

#: The file that marks a folder as a tiny model of ours (its spec), written last.
MARKER = "polar_tiny_model.json"
#: Files are written into a hidden folder of this prefix inside the model folder, then renamed into
#: place: a full disk left config.json beside no weights (a new folder the next run refused as not
#: ours), or an old model's config rewritten beside its old weights.
_PARTIAL = ".tiny-model.partial-"


#: ``--final-norm-weight`` above this only makes the random policy more deterministic: from 32 up
#: every sample of a group is the same (reward std 0, nothing for GRPO to learn; docs/demo.md);
#: an infinite one makes the logits infinite and the probabilities NaN.
MAX_FINAL_NORM_WEIGHT = 100.0


@dataclass
class TinyModelSpec:
    """Shape of the tiny model. The defaults are what ``polar-train tiny-model`` writes."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 65536  # a harness session needs 16k+ (vLLM refuses a longer --max-model-len)
    seed: int = 0
    #: Initial weight of the final RMSNorm. A random model's logits are tiny (|logit| < 2 with
    #: the default 1.0), so its policy is ~uniform over 248k tokens; a larger value gives sampling
    #: and training room to move (see README, "Learning signal").
    final_norm_weight: float = 1.0


def holds_other_files(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds something but no tiny model of ours: a real model's folder named by
    mistake would lose its config and weights. The hidden folder of a write that was killed
    outright (the next write removes it) is no one else's: it made that folder refused."""
    p = Path(folder)
    if not p.is_dir() or (p / MARKER).is_file():
        return False
    return any(not entry.name.startswith(_PARTIAL) for entry in p.iterdir())


def write_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None) -> Path:
    """Write a model directory loadable offline by ``AutoModelForCausalLM``/``AutoTokenizer``.
    A write that fails (a full disk) leaves the folder as it was: removed if this call made it."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from .tokenizer import ENDOFTEXT, IM_END, build_tokenizer

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    tok = build_tokenizer()
    vocab_size = len(tok)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(spec.final_norm_weight)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)],
        pad_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{_PARTIAL}*"):  # a write that was killed outright
        shutil.rmtree(stale, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(prefix=_PARTIAL, dir=out))
    try:
        model.save_pretrained(str(partial), safe_serialization=True)
        tok.save_pretrained(str(partial))
        (partial / MARKER).write_text(json.dumps(asdict(spec), indent=2) + "\n")
        # each file replaces its old self in one rename; the marker last: a folder marked ours is whole
        for path in sorted(partial.iterdir(), key=lambda p: p.name == MARKER):
            os.replace(path, out / path.name)
    except BaseException:
        shutil.rmtree(out if created else partial, ignore_errors=True)
        raise
    partial.rmdir()
    return out
