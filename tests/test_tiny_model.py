"""``polar-train tiny-model`` writes a model directory that loads offline; the seed fixes its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from polar_train.cli import main


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_loads_offline_with_auto_classes(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.head_dim == 32  # vLLM CPU attention needs 32/64/80...
    assert cfg.vocab_size == len(tok) == 248077
    assert sum(p.numel() for p in model.parameters()) < 20_000_000
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), 248077) and torch.isfinite(out).all()
    assert tok.eos_token == "<|im_end|>"


def test_same_seed_same_weights_other_seed_other(tiny_model_dir, tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "a")]) == 0
    assert main(["tiny-model", str(tmp_path / "b"), "--seed", "1"]) == 0
    assert "wrote tiny model" in capsys.readouterr().out
    assert _digest(tmp_path / "a") == _digest(tiny_model_dir)
    assert _digest(tmp_path / "b") != _digest(tiny_model_dir)
    spec = json.loads((tmp_path / "b" / "polar_tiny_model.json").read_text())
    assert spec["seed"] == 1


def test_bad_targets_and_settings_are_refused(tmp_path, capsys):
    assert main(["tiny-model", ""]) == 2  # the current folder, unsaid
    assert 'DIR is empty: name the folder ("." for the current one)' in capsys.readouterr().err
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("keep me")
    assert main(["tiny-model", str(a_file)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert a_file.read_text() == "keep me"
    assert main(["tiny-model", str(tmp_path / "m"), "--final-norm-weight", "0"]) == 2
    assert "--final-norm-weight: more than 0" in capsys.readouterr().err
    for huge in ("inf", "1e300"):  # logits inf, probabilities NaN: the server answered 500s
        assert main(["tiny-model", str(tmp_path / "m"), "--final-norm-weight", huge]) == 2
        assert "--final-norm-weight: more than 0 and at most 100" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    assert main(["tiny-model", str(tmp_path / "m"), "--seed", str(2**64)]) == 2  # left an empty folder
    assert "--seed: 0 to 9223372036854775807" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert not (tmp_path / "m").exists()


def test_a_folder_holding_something_else_is_not_overwritten(tmp_path, capsys):
    # a real model's folder named by mistake keeps its config and weights
    real = tmp_path / "Qwen3.5-4B"
    real.mkdir()
    (real / "config.json").write_text('{"model_type": "qwen3"}')
    assert main(["tiny-model", str(real)]) == 2
    assert "is not empty and holds no tiny model of ours" in capsys.readouterr().err
    assert (real / "config.json").read_text() == '{"model_type": "qwen3"}'
    assert sorted(p.name for p in real.iterdir()) == ["config.json"]
    # an earlier tiny model is rewritten (another seed), an empty folder filled
    assert main(["tiny-model", str(tmp_path / "t")]) == 0
    assert main(["tiny-model", str(tmp_path / "t"), "--seed", "3"]) == 0
    assert json.loads((tmp_path / "t" / "polar_tiny_model.json").read_text())["seed"] == 3
    (tmp_path / "empty").mkdir()
    assert main(["tiny-model", str(tmp_path / "empty")]) == 0
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == sorted(p.name for p in (tmp_path / "empty").iterdir())


def test_a_full_disk_leaves_the_folder_as_it_was(tmp_path, capsys, monkeypatch):
    """A full disk gave a traceback (safetensors' own error) and left config.json without weights,
    a folder the next run refused as not ours; over an old model, its config was rewritten beside
    its old weights."""
    from safetensors import SafetensorError
    from transformers import PreTrainedTokenizerBase, Qwen3ForCausalLM

    def disk_full(self, folder, *args, **kwargs):
        (Path(folder) / "config.json").write_text("{}")  # what a save writes before its weights
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(Qwen3ForCausalLM, "save_pretrained", disk_full)
        assert main(["tiny-model", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"polar-train tiny-model: error: cannot write the tiny model to {tmp_path / 'new'}: Error while "
        "serializing: I/O error: No space left on device (os error 28); the folder is as it was")
    assert not (tmp_path / "new").exists()

    assert main(["tiny-model", str(tmp_path / "old")]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}

    def tokenizer_disk_full(self, folder, *args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerBase, "save_pretrained", tokenizer_disk_full)
        assert main(["tiny-model", str(tmp_path / "old"), "--seed", "3"]) == 2
    assert "No space left on device; the folder is as it was" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before  # no partial folder either

    killed = tmp_path / "killed"  # a first write killed outright (SIGKILL): its hidden folder only
    (killed / ".tiny-model.partial-abc123").mkdir(parents=True)
    (killed / ".tiny-model.partial-abc123" / "config.json").write_text("{}")
    assert main(["tiny-model", str(killed)]) == 0  # it was refused as "holds no tiny model of ours"
    assert not list(killed.glob(".tiny-model.partial-*")) and (killed / "polar_tiny_model.json").is_file()
