"""Session fixtures shared by every test module: the tiny model, our server, real vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.procs import polar_server, vllm_available, vllm_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (seed 0), written once per test session."""
    from polar_train.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from polar_train.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def polar_base_url(tiny_model_dir: Path, logs_dir: Path):
    """``polar-train serve`` on the tiny model (sampling mode), once per session."""
    with polar_server(tiny_model_dir, logs_dir) as base:
        yield base


#: How the suite's vLLM runs (docs/vllm.md): tool calls parsed from <tool_call> blocks like our
#: server does (Codex/Claude Code send tool_choice "auto", which vLLM refuses without these).
VLLM_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="session")
def vllm_base_url(tiny_model_dir: Path, logs_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The real vLLM CPU server on the tiny model, started once for the whole run.

    CI installs .venv-vllm (make test), so these tests run there; without it they fail loudly
    rather than skip, unless POLAR_SKIP_VLLM=1 is set on a developer's machine.
    """
    if not vllm_available():
        if os.environ.get("POLAR_SKIP_VLLM") == "1":
            pytest.skip("POLAR_SKIP_VLLM=1 and .venv-vllm missing")
        pytest.fail(".venv-vllm is missing: run scripts/install-vllm-cpu (make test does)")
    with vllm_server(tiny_model_dir, logs_dir, tmp_path_factory.mktemp("vllm-cache"),
                     extra=VLLM_FLAGS) as base:
        yield base
