"""HTTPS serving (for the TLS-intercepting proxy path) and ``--adapter`` (a peft LoRA)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import ssl
import time

import httpx
import openai
import pytest
import torch

from tests.support.procs import free_port, polar_server

REQ = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
       "seed": 11, "return_token_ids": True, "logprobs": True}


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _lora_adapter(tmp_path, tiny_model_dir):
    """A peft LoRA adapter saved with ``save_pretrained`` (as the trainer writes them), and the
    merged model it should serve."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft_model = get_peft_model(base_model, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter_dir))
    return adapter_dir, peft_model.merge_and_unload().eval()


def test_https_with_adapter(tmp_path, tiny_model_dir, logs_dir, polar_base_url):
    """One server start checks both: TLS with a verifying client, and a LoRA adapter applied."""
    cert, key = _self_signed(tmp_path)
    adapter_dir, merged = _lora_adapter(tmp_path, tiny_model_dir)
    ctx = ssl.create_default_context(cafile=str(cert))
    plain = httpx.post(polar_base_url + "/v1/chat/completions", json=REQ, timeout=60).json()
    with polar_server(tiny_model_dir, logs_dir, scheme="https",
                      extra=["--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                             "--adapter", str(adapter_dir)]) as base:
        assert base.startswith("https://")
        with httpx.Client(verify=ctx, timeout=60) as c:
            assert c.get(base + "/health").status_code == 200
            tuned = c.post(base + "/v1/chat/completions", json=REQ).json()
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused",
                               http_client=httpx.Client(verify=ctx))
        assert client.chat.completions.create(model="tiny", messages=REQ["messages"],
                                              max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(httpx.ConnectError):  # an unverifying client must not get through
            httpx.get(base + "/health", timeout=10)
    prompt, out = tuned["prompt_token_ids"], tuned["choices"][0]["token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(merged(torch.tensor([prompt + out])).logits[0].float(), -1)
    got = [e["logprob"] for e in tuned["choices"][0]["logprobs"]["content"]]
    want = [float(ref[len(prompt) - 1 + k, t]) for k, t in enumerate(out)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # the adapter really changed the policy: same seed, other logprobs for the same first token
    with torch.no_grad():
        base_ref = torch.log_softmax(torch.tensor(0.0) + _base_logits(tiny_model_dir, prompt), -1)
    assert abs(float(base_ref[out[0]]) - got[0]) > 1e-3
    assert plain["prompt_token_ids"] == prompt


def _base_logits(model_dir, prompt):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return m(torch.tensor([prompt])).logits[0, -1].float()


@pytest.mark.parametrize("args, msg", [
    (["--model", "{tmp}"], "not a model directory"),
    (["--model", "{model}", "--ssl-certfile", "x.pem"], "go together"),
    (["--model", "{model}", "--adapter", "{tmp}"], "not a peft adapter"),
    (["--model", "{model}", "--script", "{tmp}/missing.yaml"], "scenario file not found"),
    (["--model", "{model}", "--script", "{tmp}"], "scenario file {tmp} is a folder, not a file"),
    (["--model", "{model}", "--ssl-certfile", "{tmp}", "--ssl-keyfile", "{tmp}"], "file {tmp} is a folder, not a file"),
    (["--model", "{model}", "--adapter", "{tmp}/config-only"], "no adapter_model.safetensors or adapter_model.bin"),
    (["--model", "{tmp}/no-weights"], "cannot load the model in"),
    (["--model", "{tmp}/broken-config"], "config.json cannot be read as JSON"),
    (["--model", "{model}", "--max-model-len", "0"], "--max-model-len must be >= 1"),
    # vLLM refuses it; it was served, /v1/models saying 1000000 (a probe)
    (["--model", "{model}", "--max-model-len", "1000000"],
     "--max-model-len 1000000 is above the model's max_position_embeddings (65536, "),
    (["--model", "{model}", "--adapter", "{tmp}/nope"], "--adapter {tmp}/nope: not found"),
    (["--model", "{model}", "--served-model-name", " "], "--served-model-name is empty"),
    (["--model", "{model}", "--chunk-delay-ms", "inf"], "--chunk-delay-ms must be a finite number"),
    # tiny-model's and a request's range; serve took any integer (a probe)
    (["--model", "{model}", "--seed=-1"], "--seed: 0 to 9223372036854775807, got -1"),
    (["--model", "{model}", "--seed", str(2**64)], f"--seed: 0 to 9223372036854775807, got {2**64}"),
    (["--model", "{model}", "--chunk-delay-ms", "nan"], "--chunk-delay-ms must be a finite number"),
    (["--model", "{model}", "--ssl-certfile", "{tmp}/junk.pem", "--ssl-keyfile", "{tmp}/junk.pem"],
     "not a PEM certificate and its key"),
    (["--model", "{tmp}/cut-weights"], "cannot load the model in"),
    # (it was blamed on the tokenizer, whose loader reads config.json too)
    (["--model", "{tmp}/typed-config"], "cannot load the model in {tmp}/typed-config: its config.json: "
                                        "Validation error for field 'hidden_size'"),
    # it served, healthy, and answered every chat request with a 400 blaming the client's messages (a probe)
    (["--model", "{tmp}/bad-template"], "--model {tmp}/bad-template: its chat template (chat_template.jinja) does not compile (line 1): "
                                        "unexpected end of template"),
    (["--model", "{tmp}/bad-extra-template"], "--model {tmp}/bad-extra-template: its chat template "
                                              "(additional_chat_templates/tool_use.jinja) does not compile (line 1)"),
])
def test_bad_start_arguments_are_one_line_errors(tmp_path, tiny_model_dir, capsys, args, msg):
    from polar_train.cli import main

    (tmp_path / "config-only").mkdir()  # an adapter folder without weights: peft would ask the Hub
    (tmp_path / "config-only" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    for name, config in (("no-weights", None), ("broken-config", "{")):
        folder = tmp_path / name  # tokenizer and config, but no (or broken) weights
        folder.mkdir()
        for f in tiny_model_dir.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, folder / f.name)
        if config is not None:
            (folder / "config.json").write_text(config)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    shutil.copytree(tiny_model_dir, tmp_path / "cut-weights")  # a copy that stopped half way
    weights = tmp_path / "cut-weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(tiny_model_dir, tmp_path / "typed-config")  # huggingface_hub's own error type escaped
    config = json.loads((tmp_path / "typed-config" / "config.json").read_text())
    (tmp_path / "typed-config" / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    shutil.copytree(tiny_model_dir, tmp_path / "bad-template")
    (tmp_path / "bad-template" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    shutil.copytree(tiny_model_dir, tmp_path / "bad-extra-template")  # (transformers reads these too)
    (tmp_path / "bad-extra-template" / "additional_chat_templates").mkdir()
    (tmp_path / "bad-extra-template" / "additional_chat_templates" / "tool_use.jinja").write_text("{% if %}")
    argv = ["serve", *[a.format(tmp=tmp_path, model=tiny_model_dir) for a in args],
            "--port", str(free_port())]
    assert main(argv) == 2
    err = capsys.readouterr().err
    msg = msg.format(tmp=tmp_path)
    assert msg in err and "Traceback" not in err and err.strip().count("\n") == 0


def test_an_address_it_cannot_listen_on_is_refused_before_the_model_loads(tiny_model_dir, capsys, monkeypatch):
    import socket

    from polar_train.cli import main
    from polar_train.server import engine

    def no_loading(*args, **kwargs):  # the check must come first: the weights never load
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine.Engine, "__init__", no_loading)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(tiny_model_dir), "--port", str(port)]) == 2
        assert capsys.readouterr().err.strip() == (f"polar-train serve: error: cannot listen on 127.0.0.1:{port}: "
                                                   "Address already in use")
    assert main(["serve", "--model", str(tiny_model_dir), "--host", "no-such-host.invalid"]) == 2
    assert "cannot listen on no-such-host.invalid:8000: " in capsys.readouterr().err


def _encrypt_key(key_path, pass_phrase: bytes):
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    out = key_path.with_name("key-encrypted.pem")
    out.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(pass_phrase)))
    return out


# pexpect forks a pty child that execs at once; the test process's threads do not run in it
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of forkpty:DeprecationWarning")
def test_an_encrypted_key_asks_its_pass_phrase_once(tmp_path, tiny_model_dir):
    """OpenSSL asked at the check before the model loads, and uvicorn asked again: a user typed it
    twice (and a script feeding it once hung). Now it is asked once, in a real terminal (a pty)."""
    import pexpect

    from tests.support.procs import VENV_BIN, port_open

    cert, key = _self_signed(tmp_path)
    encrypted = _encrypt_key(key, b"s3cret phrase")
    port = free_port()
    child = pexpect.spawn(str(VENV_BIN / "polar-train"),
                          ["serve", "--model", str(tiny_model_dir), "--port", str(port),
                           "--ssl-certfile", str(cert), "--ssl-keyfile", str(encrypted)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, encoding="utf-8", timeout=120)
    try:
        child.expect("(?i)pass ?phrase")
        child.sendline("s3cret phrase")
        ctx = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 120
        # the server comes up (no second prompt holds it), and nothing else asks for the phrase
        while not (port_open(port) and _https_ok(f"https://127.0.0.1:{port}/health", ctx)):
            assert child.isalive(), child.before
            assert time.monotonic() < deadline, "serve not up after 120 s"
            if child.expect(["(?i)pass ?phrase", pexpect.TIMEOUT], timeout=0.2) == 0:
                pytest.fail("the pass phrase was asked a second time")
    finally:
        child.terminate(force=True)

    wrong = pexpect.spawn(str(VENV_BIN / "polar-train"),
                          ["serve", "--model", str(tiny_model_dir), "--port", str(free_port()),
                           "--ssl-certfile", str(cert), "--ssl-keyfile", str(encrypted)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, encoding="utf-8", timeout=60)
    try:
        wrong.expect("(?i)pass ?phrase")
        wrong.sendline("not it")
        wrong.expect(pexpect.EOF)
    finally:
        wrong.close(force=True)
    assert wrong.exitstatus == 2
    assert "the pass phrase does not decrypt the key" in wrong.before and "Traceback" not in wrong.before


def _https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        return httpx.get(url, verify=ctx, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_adapter_served_under_the_base_models_name_is_warned_of(tmp_path, tiny_model_dir, capsys):
    """A probe: --adapter without --served-model-name served the adapter as the base folder's name,
    and captures of the base model and of the adapter both recorded model "tiny"."""
    from polar_train.cli import main

    adapter_dir, _ = _lora_adapter(tmp_path, tiny_model_dir)
    # (a bad --chunk-delay-ms ends the start after the adapter's checks: nothing is served)
    for extra, warned in (([], True), (["--served-model-name", "r1"], False)):
        assert main(["serve", "--model", str(tiny_model_dir), "--adapter", str(adapter_dir), *extra,
                     "--chunk-delay-ms", "nan", "--port", str(free_port())]) == 2
        err = capsys.readouterr().err
        assert ("polar-train serve: warning: --adapter without --served-model-name serves the adapter as "
                f"'{tiny_model_dir.resolve().name}', the base model's name" in err) is warned
