"""Run the real ``mitmdump`` with the capture addon for tests, and read what it wrote.

Why a helper: every capture test needs the same things - a confdir in a temp folder (tests never
touch ~/.mitmproxy), the CA file clients must trust in regular mode, readiness by port, and a
clean stop (SIGTERM, so the addon's ``done`` hook writes the last part).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import REPO, VENV_BIN, ManagedProcess, free_port, port_open

ADDON = REPO / "addons" / "polar_capture.py"


@dataclass
class Mitm:
    proc: ManagedProcess
    ports: list[int]
    out_dir: Path
    confdir: Path

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return self.proc.stop(sig, timeout=60)


def start_mitm(tmp: Path, *, modes: Sequence[str] = ("regular",), tokenizer: Path | str | None = None,
               options: dict[str, object] | None = None, out_dir: Path | None = None,
               scripts: Sequence[Path] = (ADDON,)) -> Mitm:
    """Start mitmdump; each mode may carry ``@PORT`` or get a free port. Waits until all listen.
    ``scripts``: the addon files to load (a copy of the addon, to reload it by touching it)."""
    out_dir = out_dir or tmp / "captures"
    confdir = tmp / "mitm-conf"
    confdir.mkdir(parents=True, exist_ok=True)
    ports: list[int] = []
    args = [str(VENV_BIN / "mitmdump"), *(a for script in scripts for a in ("-s", str(script))), "--listen-host", "127.0.0.1",
            "--set", f"confdir={confdir}", "--set", f"polar_out={out_dir}",
            "--set", "flow_detail=0", "--set", "ssl_insecure=true"]
    for mode in modes:
        if "@" in mode:
            ports.append(int(mode.rsplit("@", 1)[1]))
            args += ["--mode", mode]
        else:
            port = free_port()
            ports.append(port)
            args += ["--mode", f"{mode}@{port}"]
    if tokenizer is not None:
        args += ["--set", f"polar_tokenizer={tokenizer}"]
    for key, value in (options or {}).items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = ManagedProcess(args, tmp / f"mitmdump-{ports[0]}.log", env=env).start()
    proc.wait_until(lambda: all(port_open(p) for p in ports) and (confdir / "mitmproxy-ca-cert.pem").exists(),
                    60, "mitmdump")
    return Mitm(proc, ports, out_dir, confdir)


@contextlib.contextmanager
def mitm(tmp: Path, **kwargs) -> Iterator[Mitm]:
    m = start_mitm(tmp, **kwargs)
    try:
        yield m
    finally:
        m.stop()


def read_calls(out_dir: Path):
    """All rows of the call log under ``out_dir`` as a list of dicts (dot-files skipped)."""
    import pyarrow.dataset as ds

    calls = Path(out_dir) / "calls"
    files = sorted(p for p in calls.glob("*.parquet") if not p.name.startswith("."))
    if not files:
        return []
    return ds.dataset([str(f) for f in files], format="parquet").to_table().to_pylist()


def rows_of(out_dir: Path, rollout: str) -> list[dict]:
    return [r for r in read_calls(out_dir) if r["rollout_id"] == rollout]


def rid() -> str:
    """A fresh rollout id."""
    return f"h-{uuid.uuid4().hex[:10]}"


def proxy_client(m: Mitm, rollout: str, timeout: float = 30):
    """An httpx client of the proxy in regular mode, the rollout in the proxy credentials (as
    harnesses send it)."""
    import httpx

    return httpx.Client(proxy=f"http://{rollout}:pw-{rollout}@127.0.0.1:{m.port}", timeout=timeout)


def poll(cond, timeout: float, what: str):
    """``cond()`` once it is truthy; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)  # polling a condition with a deadline
    raise TimeoutError(what)


def no_addon_traceback(log: str) -> bool:
    """mitmproxy prints its own tracebacks when it cancels open connections at shutdown; none may
    come from our code (the proxy's or its row worker's)."""
    return "/polar_train/" not in log and 'polar_capture.py", line' not in log
