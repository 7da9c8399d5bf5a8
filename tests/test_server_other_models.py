"""``polar-train serve`` (and train's checks) on models that are not the shipped tiny Qwen: a
probe built Llama-3, Gemma-2 and GPT-2 style models and found serve never stopped at their
end-of-turn token, served Gemma-2's logits without its final soft-capping (0.7 nats off), and
answered every GPT-2 request with a 500. Tiny random models with a byte-level BPE tokenizer
trained here on a few lines (no download)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polar_train.model_load import ModelLoadError
from polar_train.server.engine import Engine, SamplingParams
from tests.support.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set r = 'model' if m['role'] == 'assistant' else 'user' %}"
                  "<start_of_turn>{{ r }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(folder: Path, specials: list[str], template: str | None, **named: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = (ROOT / "README.md").read_text().splitlines()[:200]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return tok


def _model(folder: Path, model_type: str, generation_eos: list[int] | None = None, **config) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    model.save_pretrained(str(folder))
    if generation_eos is not None:
        GenerationConfig(eos_token_id=generation_eos).save_pretrained(str(folder))


def _llama_config(vocab: int, **more) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, **more)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    """Llama-3 style: the tokenizer's eos is <|end_of_text|>, a turn ends with <|eot_id|>, which
    only generation_config.json lists."""
    folder = tmp_path_factory.mktemp("llama3") / "m"
    tok = _tokenizer(folder, LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
                     eos_token="<|end_of_text|>")
    ids = {s: tok.token_to_id(s) for s in LLAMA3_SPECIALS}
    _model(folder, "llama", [ids["<|end_of_text|>"], ids["<|eot_id|>"]],
           **_llama_config(tok.get_vocab_size(), tie_word_embeddings=True, eos_token_id=ids["<|end_of_text|>"]))
    return folder


def _forced(engine: Engine, token: int, n: int = 3) -> list:
    """Generate up to ``n`` tokens with ``token`` forced by logit_bias."""
    prompt = engine.tokenizer.encode("Hello there", add_special_tokens=False)
    return list(engine.generate(prompt, SamplingParams(max_tokens=n, logit_bias={token: 100.0}, seed=1)))


def test_serve_stops_at_the_models_own_end_of_turn_and_eos_tokens(llama3: Path, tmp_path: Path) -> None:
    engine = Engine(llama3)
    eot, eos = (engine.tokenizer.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|end_of_text|>"))
    assert engine.stop_token_ids == {eot, eos}
    for token, named in ((eot, eot), (eos, None)):  # (vLLM names a generation-config eos in stop_reason)
        steps = _forced(engine, token)
        assert [s.token_id for s in steps] == [token], "generation went on past the model's stop token"
        assert (steps[-1].finish.reason, steps[-1].finish.stop_reason) == ("stop", named)

    # Gemma style: <unk> is no stop (an unknown ChatML name converted to it, and it stopped)
    gemma = tmp_path / "gemma"
    tok = _tokenizer(gemma, GEMMA_SPECIALS, GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                     unk_token="<unk>")
    ids = {s: tok.token_to_id(s) for s in GEMMA_SPECIALS}
    _model(gemma, "llama", [ids["<eos>"], ids["<end_of_turn>"]], **_llama_config(tok.get_vocab_size()))
    engine = Engine(gemma)
    assert engine.stop_token_ids == {ids["<eos>"], ids["<end_of_turn>"]}
    assert [s.finish for s in _forced(engine, ids["<unk>"])][-1].reason == "length"


def _model_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].log_softmax(-1)


def test_serve_gives_the_models_own_logprobs_for_gemma2_and_gpt2(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    gemma = tmp_path / "gemma2"
    tok = _tokenizer(gemma, GEMMA_SPECIALS, GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                     unk_token="<unk>")
    _model(gemma, "gemma2", **_llama_config(tok.get_vocab_size(), final_logit_softcapping=30.0, pad_token_id=0))
    model = AutoModelForCausalLM.from_pretrained(str(gemma), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(40.0)  # large logits: where the soft-capping shows
    model.save_pretrained(str(gemma))
    gpt2 = tmp_path / "gpt2"
    tok = _tokenizer(gpt2, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML, eos_token="<|im_end|>",
                     pad_token="<|endoftext|>")
    _model(gpt2, "gpt2", vocab_size=tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=2, n_positions=256)
    for folder in (gemma, gpt2):
        engine = Engine(folder)
        prompt = engine.tokenizer.encode("The proxy records", add_special_tokens=False)
        steps = list(engine.generate(prompt, SamplingParams(max_tokens=4, seed=3, temperature=1.0)))
        completion = [s.token_id for s in steps]
        reference = _model_logprobs(folder, prompt + completion)
        expected = [float(reference[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]
        assert [s.logprob for s in steps] == pytest.approx(expected, abs=1e-4), folder.name
        scored = engine.score(prompt, completion)
        assert [s.logprob for s in scored] == pytest.approx(expected, abs=1e-4), folder.name


def test_a_model_whose_logits_serve_cannot_reproduce_is_refused_at_start(tmp_path: Path) -> None:
    """A forward that changes the logits after the head in a way serve does not know: refused at
    start, not served off by nats. (Here a Llama whose config.json carries a soft-capping value
    its forward ignores: serve applies it, the model does not.)"""
    folder = tmp_path / "odd"
    tok = _tokenizer(folder, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML, eos_token="<|im_end|>")
    _model(folder, "llama", **_llama_config(tok.get_vocab_size(), final_logit_softcapping=0.01))
    with pytest.raises(ModelLoadError, match=r"LlamaForCausalLM's logits are not its head's output \(they differ "
                                              r"by up to .*\): its forward changes them in a way polar-train serve"):
        Engine(folder)


def test_other_templates_and_tokenizers_are_refused_before_the_weights_load(llama3: Path, tmp_path: Path) -> None:
    """Scripted mode with a Llama-3 template answered every request with a 500 and a traceback;
    train on a tokenizer with neither pad nor eos ended in TRL's traceback after the weights
    loaded; GPT-2's Conv1D layers were not listed as LoRA targets."""
    script = ROOT / "data" / "scenarios" / "fix-add.yaml"
    proc = subprocess.run([sys.executable, "-m", "polar_train", "serve", "--model", str(llama3), "--script",
                           str(script), "--port", str(free_port()), "--max-model-len", "512"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "polar-train serve: error: --script needs a model whose chat template renders ChatML turns")

    from polar_train.model_load import lora_target_problems

    gpt2 = tmp_path / "gpt2"
    tok = _tokenizer(gpt2, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML)  # no pad, no eos
    _model(gpt2, "gpt2", vocab_size=tok.get_vocab_size(), n_embd=64, n_layer=2, n_head=2, n_positions=256)
    assert lora_target_problems(gpt2, ["q_proj"]) == ["q_proj names no module",
                                                      "its linear layers: c_attn, c_fc, c_proj; or all-linear"]
    data = tmp_path / "traj"
    from polar_train.train.sampling import sample_trajectories

    sample_trajectories(gpt2, data, num_tasks=2, group_size=2, turn_tokens=(3, 2), seed=1)
    proc = subprocess.run([sys.executable, "-m", "polar_train", "train", str(data), "--model", str(gpt2), "--output",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"polar-train train: error: --model {gpt2}: its tokenizer has neither a pad_token nor an eos_token to pad "
        "batches with: set pad_token in its tokenizer_config.json")
    assert "Loading weights" not in proc.stderr


def test_a_build_with_another_models_tokenizer_says_the_fork_causes_are_qwens(llama3: Path) -> None:
    """The fork causes are told by Qwen3.5's special-token ids: with another model's tokenizer the
    build labelled forks by the wrong cause (history_rewrite for a retokenization, which --realign
    then did not continue), unsaid."""
    from polar_train.trajectories import BuildOptions, build_trajectories

    capture = ROOT / "data" / "samples" / "demo" / "captures"
    assert not any(p.startswith("--tokenizer") for p in build_trajectories(capture, BuildOptions()).report.notes)
    report = build_trajectories(capture, BuildOptions(tokenizer=llama3)).report
    assert report.notes == [(
        f"--tokenizer {llama3} is not Qwen3.5's (its <|im_start|> is not id 248045): forks are found by exact ids as "
        "ever, but their causes are told by Qwen3.5's special-token ids, so a fork may be labelled by the wrong cause "
        "(and --realign continues only those labelled retokenization)")]
    assert f"\nnote: --tokenizer {llama3} is not Qwen3.5's" in report.table()


def test_rendered_anthropic_turns_end_with_the_templates_own_end_of_turn(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The capture renders a Messages reply's ids with the chat template and cut the tokenizer's
    eos (+ newline) off the turn: a Gemma turn kept `<end_of_turn>` and its newline in the
    completion (never sampled, then trained), and a stopped one got `<eos>` appended too."""
    from polar_train.capture.render import Renderer

    gemma = tmp_path / "gemma"
    _tokenizer(gemma, GEMMA_SPECIALS, GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
               unk_token="<unk>")
    renderer = Renderer(str(gemma))
    assert renderer.turn_closing() == "<end_of_turn>\n"
    messages = [{"role": "user", "content": "Say hi"}]
    reply = {"role": "assistant", "content": "Hello there"}
    body = renderer.encode("Hello there")
    assert renderer.completion_ids(messages, None, reply, stopped=False) == body
    end_of_turn = renderer.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert renderer.completion_ids(messages, None, reply, stopped=True) == [*body, end_of_turn]

    qwen = Renderer(str(tiny_model_dir))  # ChatML: as before
    assert qwen.turn_closing() == "<|im_end|>\n"
    ids = qwen.completion_ids(messages, None, reply, stopped=True)
    assert ids[-1] == qwen.tokenizer.convert_tokens_to_ids("<|im_end|>") and ids[:-1] == qwen.completion_ids(
        messages, None, reply, stopped=False)


def test_an_adapter_given_as_the_model_is_named_so(tmp_path: Path) -> None:
    """``--model runs/r1/adapter`` said only "not a model directory (no config.json)"."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    proc = subprocess.run([sys.executable, "-m", "polar_train", "serve", "--model", str(adapter)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"polar-train serve: error: {adapter} is not a model directory (no config.json) but a peft adapter: give its "
        "base model as --model and this folder as --adapter")
    from polar_train.cli import UserError
    from polar_train.train import cli as train_cli

    with pytest.raises(UserError, match=re.escape(f"--model {adapter}: not a model directory (") + r".*\); it holds a "
                       + re.escape(f"peft adapter: give its base model as --model, with --set init_adapter={adapter}")
                       + "$"):
        train_cli._model_vocab_size(str(adapter))
