"""Start real processes (our server, vLLM, mitmdump, harnesses) for tests, and stop them by pid.

Why not sleeps: every start waits on a readiness probe (a TCP connect or an HTTP health check)
with a deadline, and fails with the process's own log when the deadline passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback only
            return 200 <= r.status < 300
    except Exception:
        return False


def signals_as_by_default() -> None:
    """In the child: SIGHUP and SIGINT at their defaults, also under ``nohup make test`` or as a
    shell's background job (``make test &``: SIGINT ignored), whose SIG_IGN children inherit and
    the commands rightly leave ignored: the tests that hang up or interrupt them then hung."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class ManagedProcess:
    """A child process with its log file; ``stop()`` ends it (and its process group)."""

    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: str | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
            start_new_session=True, preexec_fn=signals_as_by_default,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready`` until true; fail with the log if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if ready():
                return
            time.sleep(0.1)  # polling a readiness probe, not synchronising on time
        raise TimeoutError(f"{what} not ready after {timeout}s:\n{self.log()[-4000:]}")

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def polar_server(model_dir: Path | str, log_dir: Path, extra: Sequence[str] = (),
                 host: str = "127.0.0.1", scheme: str = "http", timeout: float = 120) -> Iterator[str]:
    """Run ``polar-train serve`` on a free port; yields its base URL (``http://127.0.0.1:P``)."""
    port = free_port()
    args = [str(VENV_BIN / "polar-train"), "serve", "--model", str(model_dir),
            "--host", host, "--port", str(port), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = ManagedProcess(args, log_dir / f"polar-serve-{port}.log", env=env).start()
    base = f"{scheme}://{host}:{port}"
    try:
        if scheme == "http":
            p.wait_until(lambda: http_ok(base + "/health"), timeout, "polar-train serve")
        else:
            p.wait_until(lambda: port_open(port, host), timeout, "polar-train serve")
        yield base
    finally:
        p.stop()


VLLM_VENV = REPO / ".venv-vllm"


def vllm_available() -> bool:
    return (VLLM_VENV / "bin" / "vllm").exists()


@contextlib.contextmanager
def vllm_server(model_dir: Path | str, log_dir: Path, cache_dir: Path, extra: Sequence[str] = (),
                timeout: float = 400) -> Iterator[str]:
    """Run the real ``vllm serve`` (CPU build, .venv-vllm) on a free loopback port.

    Its caches live under ``cache_dir`` (never the user's home). Yields the base URL after
    ``/health`` answers and a warm-up request went through (the first request takes seconds).
    """
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
        "HF_HOME": str(cache_dir / "hf"),
        "XDG_CACHE_HOME": str(cache_dir / "xdg"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    for k in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(k, None)
    args = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(model_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
            "--dtype", "float32", "--enforce-eager", *extra]
    p = ManagedProcess(args, log_dir / f"vllm-{port}.log", env=env).start()
    base = f"http://127.0.0.1:{port}"
    try:
        p.wait_until(lambda: http_ok(base + "/health"), timeout, "vllm serve")
        import json

        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "warm up"}],
                             "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=120).read()  # noqa: S310 - loopback only
        yield base
    finally:
        p.stop()
