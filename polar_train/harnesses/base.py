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

import base64
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar
from urllib.parse import quote, urlsplit

from ..capture.identity import CAPTURE_MARK, CAPTURE_TARGET, PROBE_HEADER
from ..paths import holds_other_files, make_private_dir

#: Where ``scripts/install-harnesses`` puts the pinned harnesses (``.harnesses/node_modules/.bin``).
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HARNESS_PREFIX = REPO_ROOT / ".harnesses"
_IN_CHECKOUT = (REPO_ROOT / "scripts" / "install-harnesses").is_file()

#: Environment variables passed through from the caller: what a child needs to find its tools
#: (node, python3, git) and behave like a normal terminal session. Nothing with keys or proxies.
#: (``TMPDIR`` is not: it points into the private home, see :meth:`Harness.environment`.)
_PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "USER", "LOGNAME", "SHELL",
                    "PYENV_ROOT", "PYENV_VERSION")

#: Set to a fresh id in every session's environment: the processes that carry it are the session's,
#: also those that left its process group (Claude Code and Pi start their tools with ``setsid``).
SESSION_VAR = "POLAR_HARNESS_SESSION"
#: Variables (any case) that would send a session around the capture proxy: never given to one.
BYPASS_ENV = ("NO_PROXY", "ALL_PROXY")

#: Rollout ids travel in a URL's user part and a Basic auth header: keep them to unreserved characters.
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")

#: Placeholder key: local servers ignore it, but every harness refuses to start without one.
DEFAULT_API_KEY = "polar-local"

#: The longest session a run can wait for: ``subprocess`` waits in ``poll()``, which takes a C int of
#: milliseconds (a larger timeout is an OverflowError after the session has started). About 24.8 days.
MAX_TIMEOUT_S = (2**31 - 1) // 1000


class HarnessError(Exception):
    """The harness could not be run (missing binary, bad option): one clear line for the user."""


def absolute(path: Path | str, what: str = "path") -> Path:
    """``path`` with ``~`` expanded, made absolute against the caller's directory: the harness runs
    in the work directory, where a relative home or CA file would name another place. A name the
    system refuses (too long, a symlink loop) is a :class:`HarnessError`, not a traceback."""
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: "Symlink loop from ..." (Python < 3.13)
        raise HarnessError(f"{what} {str(path)[:200]!r}: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """The short cause of an OS-level error (``File name too long``), else its message."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


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
        url = self.base_url
        if not url[:8].lower().startswith(("http://", "https://")):
            raise HarnessError(f"model server URL must start with http:// or https://, got {url!r}")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a port that is not one
        except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535"
            raise HarnessError(f"model server URL {url!r}: {exc}") from None
        if not parts.hostname:
            raise HarnessError(f"model server URL {url!r} names no host")
        url = parts.scheme.lower() + url[len(parts.scheme):]  # HTTP:// is http://; harnesses want lower case
        object.__setattr__(self, "base_url", url.rstrip("/").removesuffix("/v1"))


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
            # Node reads it from the work dir: absolute
            object.__setattr__(self, "ca_cert", absolute(self.ca_cert, "proxy CA certificate"))
            try:
                found = self.ca_cert.is_file()
            except OSError as exc:
                raise HarnessError(f"proxy CA certificate {self.ca_cert}: {_reason(exc)}") from None
            if not found:
                raise HarnessError(f"proxy CA certificate not found: {self.ca_cert}")

    def check_ca_cert(self) -> None:
        """Refuse a CA file that TLS cannot load: Codex would fail every call, Node ignore it with a
        warning, and the session wait until its timeout."""
        if self.ca_cert is None:
            return
        try:
            ssl.create_default_context(cafile=str(self.ca_cert))
        except (ssl.SSLError, OSError) as exc:
            raise HarnessError(f"proxy CA certificate {self.ca_cert} cannot be loaded as a PEM "
                               f"certificate ({_reason(exc)})") from None

    @property
    def url(self) -> str:
        return f"http://{self.rollout_id}:{quote(self.secret, safe='')}@{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Proxy variables in both spellings; never a NO_PROXY (it would bypass loopback)."""
        env = {k: self.url for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")}
        if self.ca_cert is not None:
            env["NODE_EXTRA_CA_CERTS"] = str(self.ca_cert)  # Node adds it to its bundled roots
        return env


class NotTheCaptureProxy(HarnessError):
    """The proxy port answered, but not as the capture proxy: nothing would be recorded."""


def server_models(server: ModelServer, proxy: Proxy | None = None, timeout: float = 5.0,
                  capturing: bool = True, tunnels: str | None = None,
                  warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``GET SERVER/v1/models`` (through ``proxy`` when given, with the rollout's credentials and
    trusting its CA), the way the harness will reach the server: the model list, or a
    :class:`HarnessError` saying in one line what answered instead; through a proxy also
    :class:`NotTheCaptureProxy` where the answer lacks the capture addon's mark (``capturing=False``:
    only the model list is wanted), or where ``tunnels`` (a harness that reaches even an http://
    server through a CONNECT tunnel: Pi) meets a reverse-mode listener, which refuses tunnels. The
    capture addon records only POSTs to model paths, so this request never becomes a row. ``warn``
    hears of a reverse-mode listener whose target is another server than ``server``: every call of
    the session goes there (the model list came from there too)."""
    url = server.base_url + "/v1/models"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {server.api_key}",
                                                   "Accept": "application/json"})
    context = None
    if proxy is not None:
        # set by hand: urllib's ProxyHandler would honour the caller's NO_PROXY and go around it
        request.set_proxy(f"{proxy.host}:{proxy.port}", "http")
        credentials = base64.b64encode(f"{proxy.rollout_id}:{proxy.secret}".encode()).decode()
        request.add_header("Proxy-Authorization", f"Basic {credentials}")  # on the CONNECT for https
        request.add_header(PROBE_HEADER, "1")  # the capture addon marks its answer (see below)
        if proxy.ca_cert is not None and server.base_url.startswith("https://"):
            proxy.check_ca_cert()
            context = ssl.create_default_context(cafile=str(proxy.ca_cert))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),  # never the caller's proxies
                                         urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=timeout) as response:  # noqa: S310 - the user's server
            body = response.read(4 << 20)
            mark, target = response.headers.get(CAPTURE_MARK), response.headers.get(CAPTURE_TARGET)
    except urllib.error.HTTPError as exc:
        raise HarnessError(f"GET {url} answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise HarnessError(f"GET {url} failed ({_reason(reason) if isinstance(reason, BaseException) else reason})") from None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a service that does not speak HTTP
        raise HarnessError(f"GET {url} failed ({_reason(exc)})") from None
    try:
        models = json.loads(body)
    except ValueError:
        models = None
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        raise HarnessError(f"GET {url} did not answer with a model list (not an OpenAI-compatible server?)")
    if proxy is not None and capturing and tunnels and mark == "reverse":
        # the check's absolute-form GET went to the reverse target, as Codex's and Claude Code's calls
        # do (recorded), but Pi's CONNECT tunnel is refused there ("Connection error." after 21 s)
        raise NotTheCaptureProxy(f"{proxy.host}:{proxy.port} is a capture proxy in reverse mode (mitmdump --mode "
                                 f"reverse:URL), which refuses the CONNECT tunnel {tunnels} reaches its server "
                                 "through: give a regular-mode port (leave --mode out, or add --mode regular@PORT "
                                 "and give that PORT)")
    if proxy is not None and mark == "reverse" and target and warn is not None \
            and not same_endpoint(target, server.base_url):
        warn(f"the capture proxy at {proxy.host}:{proxy.port} listens in reverse mode and sends every call to its "
             f"target {target}, not to --server {server.base_url}")
    if proxy is not None and capturing and mark is None:
        # the model server itself on the proxy port answers an absolute-form GET too: the
        # session would run, unrecorded, with the proxy credentials sent to the server
        raise NotTheCaptureProxy(f"{proxy.host}:{proxy.port} answered GET {url} without the capture addon's mark: "
                                 "it is the model server itself or a proxy without the capture addon (mitmdump -s "
                                 "addons/polar_capture.py, or \"$(polar-train addon)\"; an addon older than this "
                                 "polar-train marks nothing), and the session would go unrecorded")
    return models


def same_endpoint(a: str, b: str) -> bool:
    """Whether two URLs name the same server: scheme, port (its default where none is given) and
    host - the same name, or names that resolve to a common address (``localhost`` and ``127.0.0.1``)."""
    def parts(url: str) -> tuple[str, str, int | None]:
        split = urlsplit(url)
        try:
            port = split.port
        except ValueError:
            port = None
        return split.scheme.lower(), (split.hostname or "").lower(), port or {"http": 80, "https": 443}.get(split.scheme.lower())

    (scheme_a, host_a, port_a), (scheme_b, host_b, port_b) = parts(a), parts(b)
    if (scheme_a, port_a) != (scheme_b, port_b):
        return False
    if host_a == host_b:
        return True

    def addresses(host: str) -> set[str]:
        try:
            return {info[4][0] for info in socket.getaddrinfo(host, port_a, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            return set()
    return bool(addresses(host_a) & addresses(host_b))


def served_context_length(models: dict[str, Any], model: str) -> int | None:
    """``max_model_len`` of ``model`` in a /v1/models answer (vLLM and ``polar-train serve`` give
    it; the only entry's when none has that id), else None. A LoRA adapter that vLLM serves
    (``--lora-modules r1=DIR``) is listed without one, under its ``parent``: the base model's
    length is the adapter's (round 2 onwards samples from the adapter)."""
    entries = [m for m in models.get("data") or [] if isinstance(m, dict)]

    def length(entry: dict[str, Any]) -> int | None:
        value = entry.get("max_model_len")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    chosen = [m for m in entries if m.get("id") == model] or (entries if len(entries) == 1 else [])
    if not chosen:
        return None
    if (value := length(chosen[0])) is None and (parent := chosen[0].get("parent")):
        value = next((length(m) for m in entries if m.get("id") == parent and length(m)), None)
    return value


def served_window(server: ModelServer, proxy: Proxy | None = None) -> int | None:
    """The server's context length for ``server.model``, or None when it does not say or cannot be
    asked (asked the way the session reaches it: through ``proxy``)."""
    try:
        return served_context_length(server_models(server, proxy, capturing=False), server.model)
    except HarnessError:
        return None


#: The smallest server context a harness is told of as its own window: below it the conversation
#: after a compaction (first prompt, summary, last turn) can still be over the limit - Codex then
#: compacts again and again until the timeout (a probe: 276 calls), Claude Code gives up
#: ("Autocompact is thrashing") - where the server's 400 ended the session at once.
MIN_COMPACTING_WINDOW = 16384


def compacting(window: int | None) -> int | None:
    """``window`` where a harness should compact within it; None where it is unknown or below
    :data:`MIN_COMPACTING_WINDOW`."""
    return window if window and window >= MIN_COMPACTING_WINDOW else None


def compacting_window(given: int | None, server: ModelServer, proxy: Proxy | None) -> int | None:
    """:func:`compacting` of ``given``, else of the server's context length."""
    return compacting(given or served_window(server, proxy))


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
    chosen = prefix or os.environ.get("POLAR_HARNESS_PREFIX")
    prefix = Path(chosen or DEFAULT_HARNESS_PREFIX)
    candidate = prefix / "node_modules" / ".bin" / name
    if candidate.exists():
        return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    # an installed package has no checkout around it: its .harnesses/ is no place to name
    where = f"under {prefix}/node_modules/.bin or on PATH" if chosen or _IN_CHECKOUT else "on PATH"
    raise HarnessError(f"{name!r} not found {where}: run scripts/install-harnesses in a polar-train checkout "
                       "(the pinned versions), or set POLAR_HARNESS_PREFIX to the npm prefix that holds it")


@dataclass
class Harness(ABC):
    """One harness: how to configure it in a private home and the command line that runs it."""

    name: str = field(init=False, default="")
    binary: str = field(init=False, default="")
    prefix: Path | None = None
    #: Variables the session sets that a caller's ``extra_env`` may set otherwise (the harness's
    #: own settings, such as a compaction threshold derived from the server).
    overridable_env: tuple[str, ...] = field(init=False, default=())
    #: About how many tokens (Qwen vocabulary) the first request of a session takes: instructions
    #: and tool schemas, before any work (measured through the proxy; for the small-context warning).
    first_request_tokens: int = field(init=False, default=0)
    #: Below this server context ``polar-train harness`` warns: the harness is not told to compact
    #: there (Codex, Claude Code), or compacts but a long tool output overflows it (Pi).
    smallest_context: int = field(init=False, default=MIN_COMPACTING_WINDOW)
    #: Whether the harness reaches even an http:// server through its proxy by a CONNECT tunnel (Pi's
    #: SDK), which a reverse-mode listener refuses; Codex and Claude Code send absolute-form requests.
    tunnels: ClassVar[bool] = False

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
        # Claude Code keeps tool output and session folders under $TMPDIR (0644, never removed):
        # inside the home, they go with it and no other user can read them
        (home / "tmp").mkdir(mode=0o700, exist_ok=True)
        env.update({"HOME": str(home), "TMPDIR": str(home / "tmp"), "XDG_CONFIG_HOME": str(home / ".config"),
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
        workdir = absolute(workdir, "work directory")
        home = absolute(home, "home") if home is not None else None
        try:
            Harness._check_folders(workdir, home)
        except OSError as exc:  # a name too long for the file system, a folder we may not read
            raise HarnessError(f"{exc.filename or workdir}: {_reason(exc)}") from None
        if not prompt.strip():
            raise HarnessError("the prompt is empty: give the task as the harness's user would type it")
        return workdir

    @staticmethod
    def _check_folders(workdir: Path, home: Path | None) -> None:
        if not workdir.exists():
            raise HarnessError(f"work directory not found: {workdir}")
        if not workdir.is_dir():
            raise HarnessError(f"work directory is a file, not a folder: {workdir}")
        if home is not None and home.exists() and not home.is_dir():
            raise HarnessError(f"home is a file, not a folder: {home}")
        if home is not None and holds_other_files(home, HOME_MARKER):
            # the harness's own config files there (~/.codex/config.toml, ...) would be overwritten
            raise HarnessError(f"home {home} is not empty and was not made by polar-train harness: its "
                               "harness config files would be overwritten; give a new or empty folder")

    def run(self, workdir: Path | str, prompt: str, server: ModelServer, proxy: Proxy | None = None,
            home: Path | str | None = None, timeout: float = 300,
            extra_env: Mapping[str, str] | None = None) -> HarnessRun:
        """Run one session in ``workdir`` and wait for it (``home``: a fresh temporary dir if not given).

        However the session ends (normally, timeout, Ctrl-C, SIGTERM unwinding as SystemExit), every
        process it started is ended, also tools started in a session of their own (see
        :func:`kill_session`). A temporary home no session ran in (the harness could not start, an
        interrupt before the start) is removed. An interrupt during the session is re-raised after
        the clean-up with the partial :class:`HarnessRun` as its ``harness_run`` attribute (the home
        stays, as after any failed session). ``extra_env``: more variables for the harness (its own
        settings, e.g. Claude Code's auto-compaction threshold); one the session sets itself (home,
        proxy, CA, server, key) is refused, as it would undo the session's isolation or routing.
        """
        check_timeout(timeout)
        workdir = self.check_inputs(workdir, prompt, home)
        exe = find_binary(self.binary, self.prefix)
        temporary = home is None
        home = absolute(home, "home") if home is not None else Path(tempfile.mkdtemp(prefix=f"polar-{self.name}-home-"))
        try:
            try:
                make_private_dir(home)  # the harness's config, sessions and transcripts
                (home / HOME_MARKER).touch()  # a later run may reuse this home (see check_inputs)
            except OSError as exc:
                raise HarnessError(f"cannot make the home {home}: {_reason(exc)}") from None
            env = self.environment(home, server, proxy)
            for name in extra_env or {}:
                if name.upper() in BYPASS_ENV:  # the session sets none: they would
                    raise HarnessError(f"environment variable {name} would send the {self.name} session "
                                       "around the capture proxy: it cannot be given")  # (not) reach it
                if name == SESSION_VAR or (name in env and name not in _PASSTHROUGH_ENV
                                           and name not in self.overridable_env):
                    raise HarnessError(f"environment variable {name} is set by the {self.name} session itself "
                                       "(its home, proxy, CA, server, key or settings): it cannot be given")
            env.update(extra_env or {})
            marker = uuid.uuid4().hex
            env[SESSION_VAR] = marker
            argv = self.command(exe, prompt, workdir, home, server)
            stdin_text = self.prompt_input(prompt)
            start = time.monotonic()
            try:
                proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
                                        start_new_session=True)
            except OSError as exc:  # not executable, a broken interpreter line, ...
                raise HarnessError(f"cannot start {self.name} ({exe}): {_reason(exc)}") from None
        except BaseException:
            if temporary:
                shutil.rmtree(home, ignore_errors=True)
            raise
        return _Session(self, proc, marker, argv, workdir, home, start).wait(stdin_text, timeout)


def session_processes(marker: str) -> list[int]:
    """Pids of the processes whose environment holds ``SESSION_VAR=marker`` (Linux ``/proc`` only;
    elsewhere none are found and only the session's process group is ended). A process that
    cleared its environment before an ``exec`` (``env -i``) is not found."""
    needle = f"{SESSION_VAR}={marker}".encode()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(name))
    return pids


def kill_session(marker: str, grace: float = 2.0, limit: float = 30.0) -> None:
    """End every process of a session: SIGTERM, SIGKILL after ``grace`` seconds, again until none is
    left (a dying shell may still fork). Why not the process group: Claude Code and Pi start each
    tool command with ``setsid``, so a tool's ``sleep``, server or test run would outlive a group kill."""
    end = time.monotonic() + limit
    while (pids := session_processes(marker)) and time.monotonic() < end:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if sig == signal.SIGTERM:
                wait_until = time.monotonic() + grace
                while (pids := session_processes(marker)) and time.monotonic() < wait_until:
                    time.sleep(0.05)  # polling /proc for the processes to go
                if not pids:
                    break


def _pump(stream: IO[bytes], sink: list[bytes]) -> threading.Thread:
    """Read a pipe into ``sink`` in a thread: what was read is there even after an interrupt."""
    def read() -> None:
        with contextlib.suppress(OSError, ValueError):
            for chunk in iter(lambda: stream.read1(65536), b""):
                sink.append(chunk)
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _feed(stream: IO[bytes], text: str) -> threading.Thread:
    """Write the prompt to stdin and close it, in a thread (a child that never reads blocks only it)."""
    def write() -> None:
        with contextlib.suppress(OSError, ValueError):  # BrokenPipeError: the child left without reading
            stream.write(text.encode("utf-8"))
        with contextlib.suppress(OSError, ValueError):
            stream.close()
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def _text(chunks: list[bytes]) -> str:
    """Decoded output with universal newlines, as ``subprocess``'s text mode gave it."""
    return b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


#: How long the pipes may stay open after the harness exited, before what holds them is ended.
_PIPE_GRACE_S = 2.0


@dataclass
class _Session:
    """One started harness process: waiting for it, collecting its output, ending all it started."""

    harness: Harness
    proc: subprocess.Popen
    marker: str
    argv: list[str]
    workdir: Path
    home: Path
    start: float

    def wait(self, stdin_text: str | None, timeout: float) -> HarnessRun:
        out: list[bytes] = []
        err: list[bytes] = []
        readers = [_pump(self.proc.stdout, out), _pump(self.proc.stderr, err)]  # type: ignore[arg-type]
        if stdin_text is not None:
            _feed(self.proc.stdin, stdin_text)  # type: ignore[arg-type]
        timed_out = False
        try:
            try:
                self.proc.wait(timeout)
                for reader in readers:  # the harness is done; what it left running (a server started
                    # with `&` holding the pipes) is ended below, not waited for until the timeout
                    reader.join(max(0.0, min(_PIPE_GRACE_S, self.start + timeout - time.monotonic())))
            except subprocess.TimeoutExpired:
                timed_out = True
        except BaseException as exc:  # Ctrl-C, SIGTERM (SystemExit), anything else: nothing left running
            self.end(readers, err)
            exc.harness_run = self.result(out, err, timed_out=False)  # type: ignore[attr-defined]
            exc.add_note(f"polar-train: the {self.harness.name} session was ended; its home: {self.home}")
            raise
        self.end(readers, err)  # also after a normal end: tool processes it left behind
        return self.result(out, err, timed_out)

    def end(self, readers: list[threading.Thread], err: list[bytes]) -> None:
        """Kill what the session started, reap it, and collect the rest of its output."""
        kill_session(self.marker)
        if self.proc.poll() is None:  # without /proc: its process group at least
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 15
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        if any(reader.is_alive() for reader in readers):
            err.append(b"\n(output cut: a process outside the session kept its pipes open)\n")

    def result(self, out: list[bytes], err: list[bytes], timed_out: bool) -> HarnessRun:
        stdout, stderr = _text(out), _text(err)
        rc = self.proc.returncode if self.proc.returncode is not None else -1
        final = self.harness.final_message(stdout, self.home) if rc == 0 and not timed_out else ""
        return HarnessRun(self.harness.name, self.argv, rc, stdout, stderr, final, self.workdir, self.home,
                          time.monotonic() - self.start, timed_out)
