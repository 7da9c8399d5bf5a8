"""Run a real, unmodified coding-agent harness non-interactively, optionally through our proxy.

Why a private HOME/config dir per run: a harness reads and writes its config, sessions and caches
under the user's home; a rollout must neither see nor change the user's own setup, and two
concurrent rollouts must not share state. Why a clean environment (not ``os.environ``): a user's
``OPENAI_API_KEY``/``ANTHROPIC_*``/``NO_PROXY`` would silently redirect or bypass the proxy.

The rollout id travels as the proxy user name (``HTTPS_PROXY=http://ROLLOUT:x@127.0.0.1:PORT``):
all three harnesses send it as ``Proxy-Authorization`` (see docs/harness-wire-notes.md).
API keys are only ever passed in the environment of the child process, never written to a file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from ..paths import holds_other_files

#: Where ``scripts/install-harnesses`` puts the pinned harnesses (``.harnesses/node_modules/.bin``).
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HARNESS_PREFIX = REPO_ROOT / ".harnesses"

#: Environment variables passed through from the caller: what a child needs to find its tools
#: (node, python3, git) and behave like a normal terminal session. Nothing with keys or proxies.
_PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL",
                    "PYENV_ROOT", "PYENV_VERSION")

#: Rollout ids travel in a URL's user part and a Basic auth header: keep them to unreserved characters.
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")

#: Placeholder key: local servers ignore it, but every harness refuses to start without one.
DEFAULT_API_KEY = "polar-local"

#: The longest session a run can wait for: ``subprocess`` waits in ``poll()``, which takes a C int of
#: milliseconds (a larger timeout is an OverflowError after the session has started). About 24.8 days.
MAX_TIMEOUT_S = (2**31 - 1) // 1000


class HarnessError(Exception):
    """The harness could not be run (missing binary, bad option): one clear line for the user."""


def absolute(path: Path | str) -> Path:
    """``path`` with ``~`` expanded, made absolute against the caller's directory: the harness runs
    in the work directory, where a relative home or CA file would name another place."""
    return Path(path).expanduser().resolve()


def check_timeout(seconds: float, name: str = "timeout") -> float:
    """``seconds``, once known to be a timeout a session can be waited for (finite, in range)."""
    if not 0 < seconds <= MAX_TIMEOUT_S:  # also refuses nan
        raise HarnessError(f"{name}: more than 0 and at most {MAX_TIMEOUT_S} seconds, got {seconds:g}")
    return seconds


@dataclass(frozen=True)
class ModelServer:
    """The model server the harness should talk to (vLLM, SGLang, ``polar-train serve``).

    ``base_url`` is the server root without ``/v1`` (``http://127.0.0.1:8000``); each harness adds
    the path prefix its SDK expects.
    """

    base_url: str
    model: str = "tiny"
    api_key: str = DEFAULT_API_KEY

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise HarnessError(f"model server URL must start with http:// or https://, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/").removesuffix("/v1"))


#: The file that marks a home folder as one a session of ours made (and may write into again).
HOME_MARKER = ".polar-harness-home"


@dataclass(frozen=True)
class Proxy:
    """Our mitmproxy: where it listens, which rollout the run belongs to, and its CA certificate."""

    port: int
    rollout_id: str
    ca_cert: Path | None = None
    host: str = "127.0.0.1"
    secret: str = "x"

    def __post_init__(self) -> None:
        if not _ROLLOUT_ID.fullmatch(self.rollout_id or ""):
            raise HarnessError("rollout id must be 1-128 characters of A-Z a-z 0-9 . _ ~ - "
                               f"(it is sent as the proxy user name), got {self.rollout_id!r}")
        if self.ca_cert is not None:
            object.__setattr__(self, "ca_cert", absolute(self.ca_cert))  # Node reads it from the work dir
            if not self.ca_cert.is_file():
                raise HarnessError(f"proxy CA certificate not found: {self.ca_cert}")

    @property
    def url(self) -> str:
        return f"http://{self.rollout_id}:{quote(self.secret, safe='')}@{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Proxy variables in both spellings; never a NO_PROXY (it would bypass loopback)."""
        env = {k: self.url for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")}
        if self.ca_cert is not None:
            env["NODE_EXTRA_CA_CERTS"] = str(self.ca_cert)  # Node adds it to its bundled roots
        return env


@dataclass
class HarnessRun:
    """What one harness session did: its exit status, its output and its final answer."""

    harness: str
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    final_message: str
    workdir: Path
    home: Path
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        """A short failure report (exit status and the tail of both streams)."""
        return (f"{self.harness} exited {self.returncode}{' (timed out)' if self.timed_out else ''} "
                f"after {self.seconds:.1f}s\n--- stdout ---\n{self.stdout[-3000:]}\n"
                f"--- stderr ---\n{self.stderr[-3000:]}")


def find_binary(name: str, prefix: Path | None = None) -> Path:
    """The harness executable: ``$POLAR_HARNESS_PREFIX`` or ``.harnesses/``, else ``PATH``."""
    prefix = Path(prefix or os.environ.get("POLAR_HARNESS_PREFIX") or DEFAULT_HARNESS_PREFIX)
    candidate = prefix / "node_modules" / ".bin" / name
    if candidate.exists():
        return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise HarnessError(f"{name!r} not found under {prefix}/node_modules/.bin or on PATH: "
                       "run scripts/install-harnesses")


@dataclass
class Harness(ABC):
    """One harness: how to configure it in a private home and the command line that runs it."""

    name: str = field(init=False, default="")
    binary: str = field(init=False, default="")
    prefix: Path | None = None

    @abstractmethod
    def configure(self, home: Path, server: ModelServer, proxy: Proxy | None) -> dict[str, str]:
        """Write the harness's config files under ``home``; return its environment variables."""

    @abstractmethod
    def command(self, exe: Path, prompt: str, workdir: Path, home: Path, server: ModelServer) -> list[str]:
        """The argv of one non-interactive session (a prompt in it must follow ``--``: it may start
        with ``-``, as a markdown bullet does)."""

    def prompt_input(self, prompt: str) -> str | None:
        """What the session reads on stdin: None (closed) when the prompt is in the argv."""
        return None

    def final_message(self, stdout: str, home: Path) -> str:
        """The harness's final answer (default: its stdout, stripped)."""
        return stdout.strip()

    def environment(self, home: Path, server: ModelServer, proxy: Proxy | None) -> dict[str, str]:
        env = {k: os.environ[k] for k in _PASSTHROUGH_ENV if k in os.environ}
        env.setdefault("PATH", os.defpath)
        env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                    "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local/share"),
                    "XDG_STATE_HOME": str(home / ".local/state"), "TERM": "dumb", "NO_COLOR": "1",
                    "CI": "1"})
        if proxy is not None:
            env.update(proxy.env())
        env.update(self.configure(home, server, proxy))
        return env

    @staticmethod
    def check_inputs(workdir: Path | str, prompt: str, home: Path | str | None = None) -> Path:
        """The session's work directory, resolved, once the user's inputs are known to be usable."""
        workdir = absolute(workdir)
        home = absolute(home) if home is not None else None
        if not workdir.exists():
            raise HarnessError(f"work directory not found: {workdir}")
        if not workdir.is_dir():
            raise HarnessError(f"work directory is a file, not a folder: {workdir}")
        if not prompt.strip():
            raise HarnessError("the prompt is empty: give the task as the harness's user would type it")
        if home is not None and Path(home).exists() and not Path(home).is_dir():
            raise HarnessError(f"home is a file, not a folder: {home}")
        if home is not None and holds_other_files(home, HOME_MARKER):
            # the harness's own config files there (~/.codex/config.toml, ...) would be overwritten
            raise HarnessError(f"home {home} is not empty and was not made by polar-train harness: its "
                               "harness config files would be overwritten; give a new or empty folder")
        return workdir

    def run(self, workdir: Path | str, prompt: str, server: ModelServer, proxy: Proxy | None = None,
            home: Path | str | None = None, timeout: float = 300) -> HarnessRun:
        """Run one session in ``workdir`` and wait for it (``home``: a fresh temporary dir if not given).

        On timeout the whole process group is killed: harnesses spawn shells and helpers.
        """
        check_timeout(timeout)
        workdir = self.check_inputs(workdir, prompt, home)
        exe = find_binary(self.binary, self.prefix)
        home = absolute(home) if home is not None else Path(tempfile.mkdtemp(prefix=f"polar-{self.name}-home-"))
        home.mkdir(parents=True, exist_ok=True)
        (home / HOME_MARKER).touch()  # a later run may reuse this home (see check_inputs)
        env = self.environment(home, server, proxy)
        argv = self.command(exe, prompt, workdir, home, server)
        stdin_text = self.prompt_input(prompt)
        start = time.monotonic()
        timed_out = False
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
                                text=True, errors="replace", start_new_session=True)
        try:
            out, err = proc.communicate(stdin_text, timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:  # a child that left the group still holds the pipes
                out, err = "", "(output lost: a child process outside the session kept its pipes open)"
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        seconds = time.monotonic() - start
        rc = proc.returncode
        final = self.final_message(out, home) if rc == 0 and not timed_out else ""
        return HarnessRun(self.name, argv, rc, out, err, final, workdir, home, seconds, timed_out)
