"""Support for the real-harness tests: the task repo, mitmdump with our addon, reading its rows.

Why a witness addon beside ours: "every model call is one row" needs a count that does not come
from the addon under test; ``flow_witness.py`` logs every HTTP flow mitmproxy itself completed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_train.harnesses import find_binary
from polar_train.harnesses.base import HarnessError

from .procs import REPO, VENV_BIN, ManagedProcess, free_port, port_open

TASK_REPO = REPO / "data" / "repos" / "calc"
SCENARIOS = REPO / "data" / "scenarios" / "fix-add.yaml"
TASK_PROMPT = "The test in test_calc.py fails. Fix calc.py so that it passes."
FINAL_ANSWER = ("Fixed add() in calc.py: it subtracted b instead of adding it. "
                "All 40 cases of test_calc pass now.")
WITNESS = Path(__file__).with_name("flow_witness.py")
MODEL_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
BINARIES = {"codex": "codex", "claude-code": "claude", "pi": "pi"}

# Fixed identity and dates: the commit hash is the same on every run, and Claude Code puts the
# git log into its system prompt.
_GIT_ENV = {"GIT_AUTHOR_NAME": "polar", "GIT_AUTHOR_EMAIL": "polar@example.invalid",
            "GIT_COMMITTER_NAME": "polar", "GIT_COMMITTER_EMAIL": "polar@example.invalid",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def not_the_capture_proxy(port: int) -> str:
    """``polar-train harness``'s refusal of a --proxy-port that answered without the capture mark."""
    return (f"polar-train harness: error: --proxy-port {port}: 127.0.0.1:{port} answered GET "
            f"http://127.0.0.1:{port}/v1/models without the capture addon's mark: it is the model server "
            "itself or a proxy without the capture addon (mitmdump -s addons/polar_capture.py, or "
            '"$(polar-train addon)"; an addon older than this polar-train marks nothing), and the session '
            "would go unrecorded\n")


def require_harnesses(*names: str) -> None:
    """Fail loudly when a harness is missing (CI installs them), or skip with POLAR_SKIP_HARNESSES=1."""
    missing = []
    for name in names:
        try:
            find_binary(BINARIES[name])
        except HarnessError:
            missing.append(name)
    if missing:
        if os.environ.get("POLAR_SKIP_HARNESSES") == "1":
            pytest.skip(f"POLAR_SKIP_HARNESSES=1 and not installed: {', '.join(missing)}")
        pytest.fail(f"harnesses not installed: {', '.join(missing)}: run scripts/install-harnesses "
                    "(make test does)")


def make_task_repo(dest: Path) -> Path:
    """A fresh git checkout of ``data/repos/calc`` at ``dest`` (one commit, fixed hash)."""
    shutil.copytree(TASK_REPO, dest, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, **_GIT_ENV}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "calc: add()"]):
        subprocess.run(["git", *args], cwd=dest, env=env, check=True, capture_output=True)
    return dest


def repo_test_passes(repo: Path) -> tuple[bool, str]:
    """Run the task's own test the way the scenario does; (passed, output)."""
    proc = subprocess.run([sys.executable, "-m", "unittest", "test_calc"], cwd=repo, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return proc.returncode == 0, proc.stdout + proc.stderr


def repo_diff(repo: Path) -> str:
    """What the session changed in the repo (tracked files)."""
    return subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout


@dataclass
class CaptureProxy:
    """A running ``mitmdump -s addons/polar_capture.py`` (plus the witness) on a free port."""

    port: int
    confdir: Path
    out: Path
    witness_log: Path
    process: ManagedProcess

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def witnessed_model_flows(self) -> list[dict]:
        """Flows to a model path that mitmproxy completed, as the witness logged them."""
        if not self.witness_log.exists():
            return []
        flows = [json.loads(line) for line in self.witness_log.read_text().splitlines() if line.strip()]
        return [f for f in flows if f["path"].split("?")[0] in MODEL_PATHS]


@contextlib.contextmanager
def capture_proxy(work: Path, tokenizer_dir: Path | None = None, timeout: float = 60,
                  upstream_self_signed: bool = False,
                  options: dict[str, str] | None = None) -> Iterator[CaptureProxy]:
    """mitmdump with our addon, its CA in a private confdir (never ~/.mitmproxy); stopped on exit.

    ``upstream_self_signed``: accept the test server's self-signed certificate (``ssl_insecure``).
    ``options``: more ``--set NAME=VALUE`` for the addon.

    Stopping it (SIGTERM: mitmproxy runs the addon's ``done``) flushes every row, so a test reads
    the call log after the ``with`` block.
    """
    port = free_port()
    confdir, out = work / "mitm-conf", work / "captures"
    confdir.mkdir(parents=True, exist_ok=True)
    witness_log = work / "witness.jsonl"
    args = [str(VENV_BIN / "mitmdump"), "--listen-host", "127.0.0.1", "-p", str(port),
            "--set", f"confdir={confdir}", "--set", "termlog_verbosity=warn", "--set", "flow_detail=0",
            "-s", str(REPO / "addons" / "polar_capture.py"), "--set", f"polar_out={out}",
            "-s", str(WITNESS), "--set", f"witness_log={witness_log}"]  # after ours: it sees the client's side
    if tokenizer_dir is not None:
        args += ["--set", f"polar_tokenizer={tokenizer_dir}"]
    if upstream_self_signed:
        args += ["--set", "ssl_insecure=true"]
    for name, value in (options or {}).items():
        args += ["--set", f"{name}={value}"]
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = ManagedProcess(args, work / f"mitmdump-{port}.log", env=env, cwd=str(REPO)).start()
    proxy = CaptureProxy(port, confdir, out, witness_log, proc)
    try:
        proc.wait_until(lambda: port_open(port) and proxy.ca_cert.exists(), timeout, "mitmdump")
        yield proxy
    finally:
        rc = proc.stop()
        if rc not in (0, None, -15):
            print(f"mitmdump exited {rc}:\n{proc.log()[-3000:]}")


def call_rows(out: Path, rollout_id: str | None = None) -> list[dict]:
    """Rows of the call log (optionally one rollout's), in the order the calls started."""
    from polar_train.calllog import read_calls

    rows = read_calls(out).to_pylist()
    if rollout_id is not None:
        rows = [r for r in rows if r["rollout_id"] == rollout_id]
    return sorted(rows, key=lambda r: r["started_at"])


def first_divergence(prefix: list[int], ids: list[int]) -> int | None:
    """Index of the first token where ``prefix`` is not a prefix of ``ids`` (None: it is)."""
    for i, tok in enumerate(prefix):
        if i >= len(ids) or ids[i] != tok:
            return i
    return None
