"""``polar-train demo``: the whole loop on an embedded default, on CPU, in minutes.

Why a command and not a shell script: it must run the same on any machine with ``make demo``,
start and stop its servers by pid, and fail with one clear line when a step fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from .cli import UserError

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback only
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


@contextlib.contextmanager
def running(args: list[str], log: Path, ready_url: str | None = None, ready_port: int | None = None,
            what: str = "process", timeout: float = 180) -> Iterator[subprocess.Popen]:
    """Start a child process, wait until it answers, stop it (by pid, its whole group) afterwards."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise UserError(f"{what} exited with code {proc.returncode}; see {log}")
            if ready_url and _get(ready_url):
                break
            if ready_port:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", ready_port)) == 0:
                        break
            if time.monotonic() > deadline:
                raise UserError(f"{what} did not become ready in {timeout:.0f}s; see {log}")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_demo(workdir: Path) -> int:
    from .tiny_model import write_tiny_model

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "tiny-model"
    if not (model_dir / "config.json").exists():
        print(f"[1/3] building the tiny model in {model_dir}")
        write_tiny_model(model_dir)
    else:
        print(f"[1/3] tiny model already in {model_dir}")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"[2/3] starting polar-train serve on {base}")
    with running([str(BIN / "polar-train"), "serve", "--model", str(model_dir), "--port", str(port),
                  "--served-model-name", "tiny"],
                 workdir / "logs" / "serve.log", ready_url=base + "/health", what="polar-train serve"):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Write a haiku about tokens."}],
                "max_tokens": 16, "temperature": 1.0, "seed": 0, "return_token_ids": True, "logprobs": True}
        resp = post_json(base + "/v1/chat/completions", body)
        choice = resp["choices"][0]
        print("[3/3] one chat call, token level:")
        print(f"  prompt_token_ids     {resp['prompt_token_ids']}")
        print(f"  completion token_ids {choice['token_ids']}")
        lps = [round(c["logprob"], 3) for c in (choice.get("logprobs") or {}).get("content", [])]
        print(f"  logprobs             {lps}")
        print(f"  text                 {choice['message']['content']!r}")
    return 0


def _cmd(args: argparse.Namespace) -> int:
    return run_demo(Path(args.workdir))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the demo loop on the embedded default (CPU)")
    p.add_argument("--workdir", default="runs/demo", help="where the demo writes (default: runs/demo)")
    p.set_defaults(func=_cmd)
