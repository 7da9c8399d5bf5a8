"""The harness runners without a model server: environment, config files, errors, timeouts, pins.

The end-to-end sessions are in test_harness_sessions.py; these check what every session relies on
and fail in seconds: the proxy variables carry the rollout id and nothing bypasses the proxy, the
user's own keys/config never reach the child, no key is ever written to a file, bad input is one
clear error, a hung harness is killed with all its children.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import time
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from polar_train.harnesses import (ClaudeCode, Codex, Harness, HarnessError, ModelServer, Pi, Proxy,
                                   find_binary, get_harness)
from polar_train.cli import main
from polar_train.harnesses.base import MAX_TIMEOUT_S, REPO_ROOT
from tests.support.harness import require_harnesses
from tests.support.procs import free_port

SECRET = "sk-test-DO-NOT-WRITE-0123456789"
ALL = ("codex", "claude-code", "pi")


@pytest.fixture
def ca_cert(tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\nnot parsed here\n-----END CERTIFICATE-----\n")
    return path


@pytest.fixture
def hostile_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user environment that would redirect or bypass the proxy if it leaked into a rollout."""
    for k, v in {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1", "OPENAI_API_KEY": "sk-user",
                 "OPENAI_BASE_URL": "https://api.openai.com/v1", "ANTHROPIC_API_KEY": "sk-ant-user",
                 "ANTHROPIC_BASE_URL": "https://api.anthropic.com", "CODEX_HOME": "/root/.codex",
                 "CLAUDE_CONFIG_DIR": "/root/.claude", "PI_CODING_AGENT_DIR": "/root/.pi/agent",
                 "HTTPS_PROXY": "http://corp-proxy:3128"}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("name", ALL)
def test_environment_routes_through_the_proxy_with_the_rollout_id(name, tmp_path, ca_cert, hostile_env) -> None:
    harness = get_harness(name)
    proxy = Proxy(8123, "rollout-7.a_b~c", ca_cert)
    env = harness.environment(tmp_path, ModelServer("http://127.0.0.1:9000/v1/", api_key=SECRET), proxy)
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        assert env[var] == "http://rollout-7.a_b~c:x@127.0.0.1:8123"
    assert urlsplit(env["HTTPS_PROXY"]).username == proxy.rollout_id
    assert not {"NO_PROXY", "no_proxy"} & env.keys()
    assert env["NODE_EXTRA_CA_CERTS"] == str(ca_cert)
    assert env["HOME"] == str(tmp_path)
    leaked = {k: v for k, v in env.items() if v in ("sk-user", "sk-ant-user", "https://api.openai.com/v1",
                                                     "https://api.anthropic.com", "/root/.codex", "/root/.claude",
                                                     "/root/.pi/agent", "http://corp-proxy:3128")}
    assert not leaked
    assert SECRET in env.values()  # the key travels in the child's environment only


def test_without_a_proxy_no_proxy_variable_is_set(tmp_path, hostile_env) -> None:
    env = Pi().environment(tmp_path, ModelServer("http://127.0.0.1:9000"), None)
    assert not {k for k in env if k.lower().endswith("_proxy")}


@pytest.mark.parametrize("name", ALL)
def test_no_config_file_holds_the_api_key(name, tmp_path, ca_cert) -> None:
    harness = get_harness(name)
    harness.environment(tmp_path, ModelServer("http://127.0.0.1:9000", api_key=SECRET), Proxy(1, "r", ca_cert))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert name == "claude-code" or files  # Codex and Pi write a config file
    for p in files:
        assert SECRET not in p.read_text(errors="replace"), p


def test_codex_config_is_a_responses_provider_read_from_the_environment(tmp_path) -> None:
    env = Codex().configure(tmp_path, ModelServer("http://127.0.0.1:9000", model="qwen"), None)
    config = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    assert config["model"] == "qwen" and config["model_provider"] == "polar"
    assert config["check_for_update_on_startup"] is False and config["analytics"]["enabled"] is False
    assert config["model_providers"]["polar"] == {"name": "polar", "base_url": "http://127.0.0.1:9000/v1",
                                                  "wire_api": "responses", "env_key": "POLAR_API_KEY"}
    assert Path(env["CODEX_HOME"]).is_relative_to(tmp_path)


def test_codex_freeform_apply_patch_writes_a_model_catalog(tmp_path) -> None:
    env = Codex(freeform_apply_patch=True, base_instructions="Be brief.").configure(
        tmp_path, ModelServer("http://127.0.0.1:9000", model="qwen"), None)
    config = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    catalog = json.loads(Path(config["model_catalog_json"]).read_text())
    (entry,) = catalog["models"]
    assert entry["slug"] == "qwen" and entry["apply_patch_tool_type"] == "freeform"
    assert entry["base_instructions"] == "Be brief." and entry["prefer_websockets"] is False
    assert "model_catalog_json" not in tomllib.loads(
        (Path(Codex().configure(tmp_path / "plain", ModelServer("http://h:1"), None)["CODEX_HOME"])
         / "config.toml").read_text())


def test_codex_trusts_the_proxy_ca_through_its_own_variables(tmp_path, ca_cert) -> None:
    env = Codex().configure(tmp_path, ModelServer("http://127.0.0.1:9000"), Proxy(1, "r", ca_cert))
    assert env["CODEX_CA_CERTIFICATE"] == env["SSL_CERT_FILE"] == str(ca_cert)


def test_pi_models_json_names_the_key_variable(tmp_path) -> None:
    env = Pi().configure(tmp_path, ModelServer("https://gpu-box:8000", model="Qwen/Qwen3-8B"), None)
    spec = json.loads((Path(env["PI_CODING_AGENT_DIR"]) / "models.json").read_text())
    provider = spec["providers"]["polar"]
    assert provider["baseUrl"] == "https://gpu-box:8000/v1" and provider["api"] == "openai-completions"
    assert provider["apiKey"] == "POLAR_API_KEY" and env["POLAR_API_KEY"]
    assert provider["models"][0]["id"] == "Qwen/Qwen3-8B"
    assert env["PI_OFFLINE"] == "1"


def test_claude_code_command_is_non_interactive_and_preapproves_tools(tmp_path) -> None:
    harness = ClaudeCode()
    env = harness.configure(tmp_path, ModelServer("http://127.0.0.1:9000"), None)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9000"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == env["DISABLE_TELEMETRY"] == "1"
    argv = harness.command(Path("claude"), "do it", tmp_path, tmp_path, ModelServer("http://h:1", "m"))
    assert argv[:2] == ["claude", "-p"] and argv[-2:] == ["--", "do it"]
    assert "--dangerously-skip-permissions" not in argv  # refused when running as root
    assert argv[argv.index("--allowedTools") + 1] == "Bash Read Edit"


def _file(folder: Path) -> Path:
    path = folder / "notes.txt"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("make, message", [
    (lambda p: ModelServer("localhost:8000"), "must start with http:// or https://"),
    (lambda p: Proxy(8080, ""), "rollout id must be"),
    (lambda p: Proxy(8080, "a:b"), "rollout id must be"),
    (lambda p: Proxy(8080, "r" * 129), "rollout id must be"),
    (lambda p: Proxy(8080, "r", p / "missing.pem"), "CA certificate not found"),
    (lambda p: get_harness("aider"), "unknown harness 'aider'"),
    (lambda p: Pi().run(p / "nowhere", "x", ModelServer("http://127.0.0.1:1")), "work directory not found"),
    (lambda p: Pi().run(_file(p), "x", ModelServer("http://127.0.0.1:1")), "work directory is a file, not a folder"),
    (lambda p: Pi().run(p, " \n", ModelServer("http://127.0.0.1:1")), "the prompt is empty"),
    (lambda p: Pi().run(p, "x", ModelServer("http://127.0.0.1:1"), home=_file(p)), "home is a file, not a folder"),
    (lambda p: Pi().run(p, "x", ModelServer("http://127.0.0.1:1"), timeout=float("inf")), "timeout: more than 0"),
])
def test_bad_input_is_one_clear_error(make, message, tmp_path) -> None:
    with pytest.raises(HarnessError, match=re.escape(message)):
        make(tmp_path)


def test_a_missing_binary_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(HarnessError, match="run scripts/install-harnesses"):
        find_binary("codex", prefix=tmp_path)


def test_cli_errors_are_one_line_without_traceback(tmp_path) -> None:
    cmd = [str(Path(sys.executable).parent / "polar-train"), "harness", "pi", "fix it", "--server",
           "http://127.0.0.1:1", "--workdir", str(tmp_path), "--proxy-port", "8080"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("polar-train harness: error: --proxy-port needs --rollout "
                                   "(the id the calls are recorded under)")
    proc = subprocess.run([*cmd[:-2], "--timeout", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2  # not a session killed at once
    assert proc.stderr.strip() == (f"polar-train harness: error: --timeout: more than 0 and at most "
                                   f"{MAX_TIMEOUT_S} seconds, got 0")
    # a CA given without a proxy would be ignored: the user meant to capture
    proc = subprocess.run([*cmd[:-2], "--ca-cert", str(tmp_path / "ca.pem")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "polar-train harness: error: --ca-cert needs --proxy-port"
    proc = subprocess.run([*cmd[:-2], "--home", ""], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2  # not a temporary home taken in silence
    assert proc.stderr.strip() == ("polar-train harness: error: --home is empty: name a folder, or leave it out "
                                   "for a temporary one")


def test_a_server_or_proxy_that_does_not_listen_is_refused_before_the_session(tmp_path) -> None:
    """Codex would reconnect until --timeout and say only "network error"."""
    closed = free_port()  # nothing listens there
    polar = str(Path(sys.executable).parent / "polar-train")
    proc = subprocess.run([polar, "harness", "codex", "fix it", "--server", f"http://127.0.0.1:{closed}",
                           "--workdir", str(tmp_path), "--timeout", "600"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"polar-train harness: error: cannot connect to the model server at "
                                   f"127.0.0.1:{closed} (Connection refused); is it running?")
    with socket.create_server(("127.0.0.1", 0)) as listening:  # a server that accepts connections
        port = listening.getsockname()[1]
        ca = tmp_path / "ca.pem"
        ca.write_text("-----BEGIN CERTIFICATE-----\n")
        proc = subprocess.run([polar, "harness", "codex", "fix it", "--server", f"http://127.0.0.1:{port}",
                               "--workdir", str(tmp_path), "--proxy-port", str(closed), "--rollout", "r1",
                               "--ca-cert", str(ca)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"polar-train harness: error: cannot connect to the proxy (mitmdump -s "
                                   f"addons/polar_capture.py) at 127.0.0.1:{closed} (Connection refused); is it running?")

    # an http:// server needs no CA: a machine where mitmdump never wrote one gets to the proxy check
    # (it used to stop at "proxy CA certificate not found", contrary to docs/harnesses.md)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        proc = subprocess.run([polar, "harness", "pi", "fix it", "--server", f"http://127.0.0.1:{port}",
                               "--workdir", str(tmp_path), "--proxy-port", str(closed), "--rollout", "r1"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 2 and "cannot connect to the proxy" in proc.stderr, proc.stderr


@dataclass
class _ShellSession(Harness):
    """A 'harness' that starts a background child and hangs: checks the runner's timeout path."""

    pidfile: Path = Path()

    def __post_init__(self) -> None:
        self.name, self.binary = "shell", "sh"

    def configure(self, home, server, proxy):
        return {}

    def command(self, exe, prompt, workdir, home, server):
        return [str(exe), "-c", f"sleep 300 & echo $! > {self.pidfile}; echo started; wait"]


def test_a_hung_session_is_killed_with_its_children(tmp_path) -> None:
    harness = _ShellSession(pidfile=tmp_path / "child.pid")
    start = time.monotonic()
    run = harness.run(tmp_path, "x", ModelServer("http://127.0.0.1:1"), None, home=tmp_path / "home", timeout=2)
    assert run.timed_out and not run.ok and run.final_message == ""
    assert "started" in run.stdout
    assert time.monotonic() - start < 30
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)  # polling for the kill to land, not synchronising on time
    assert not _alive(child), "the background child of the harness survived the timeout"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_installed_versions_are_the_pinned_ones() -> None:
    require_harnesses(*ALL)
    script = (REPO_ROOT / "scripts" / "install-harnesses").read_text()
    pins = {k: re.search(rf"^{k}=(\S+)$", script, re.M).group(1)
            for k in ("CODEX_VERSION", "CLAUDE_CODE_VERSION", "PI_VERSION")}
    env = {**os.environ, "HOME": "/nonexistent-home", "DISABLE_AUTOUPDATER": "1", "PI_OFFLINE": "1"}
    for binary, key in (("codex", "CODEX_VERSION"), ("claude", "CLAUDE_CODE_VERSION"), ("pi", "PI_VERSION")):
        out = subprocess.run([str(find_binary(binary)), "--version"], capture_output=True, text=True,
                             timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert pins[key] in out.stdout + out.stderr, (binary, out.stdout, out.stderr)


@dataclass
class _QuickSession(_ShellSession):
    """A 'harness' that writes its config into the home, as the real ones do, and ends at once."""

    def configure(self, home, server, proxy):
        (home / ".codex").mkdir(exist_ok=True)
        (home / ".codex" / "config.toml").write_text("written by the session\n")
        return {}

    def command(self, exe, prompt, workdir, home, server):
        return [str(exe), "-c", "echo done"]


def test_a_home_with_someone_elses_files_is_not_overwritten(tmp_path) -> None:
    # `--home ~` taken for "my home" would replace the user's ~/.codex/config.toml
    mine = tmp_path / "me"
    (mine / ".codex").mkdir(parents=True)
    (mine / ".codex" / "config.toml").write_text("the user's own config\n")
    with pytest.raises(HarnessError, match="is not empty and was not made by polar-train harness"):
        _QuickSession().run(tmp_path, "x", ModelServer("http://127.0.0.1:1"), home=mine, timeout=30)
    assert (mine / ".codex" / "config.toml").read_text() == "the user's own config\n"
    # a home a session made is reused by the next one, as is an empty folder
    home = tmp_path / "home"
    for _ in range(2):
        assert _QuickSession().run(tmp_path, "x", ModelServer("http://127.0.0.1:1"), home=home, timeout=30).ok
    assert home.stat().st_mode & 0o777 == 0o700  # made here: the owner's only (configs, transcripts)
    (tmp_path / "empty").mkdir()
    assert _QuickSession().run(tmp_path, "x", ModelServer("http://127.0.0.1:1"), home=tmp_path / "empty", timeout=30).ok


def test_sigterm_to_the_command_ends_the_harness_session(tmp_path) -> None:
    """`kill`/`timeout` on `polar-train harness` must not leave the agent running: the session sits
    in a process group of its own, and only the command's cleanup reaches it."""
    import signal

    import psutil

    require_harnesses("pi")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers: the session waits
        port = silent.getsockname()[1]
        proc = subprocess.Popen([str(Path(sys.executable).parent / "polar-train"), "harness", "pi", "fix it",
                                 "--server", f"http://127.0.0.1:{port}", "--workdir", str(tmp_path),
                                 "--home", str(tmp_path / "home"), "--timeout", "600"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        command = psutil.Process(proc.pid)
        session: list[psutil.Process] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not session and proc.poll() is None:
            session = command.children(recursive=True)
            if not session:
                time.sleep(0.1)  # polling for the harness to start
        try:
            assert session, "the harness session did not start"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 128 + signal.SIGTERM
            _, alive = psutil.wait_procs(session, timeout=30)
            assert not alive, f"left running: {alive}"
        finally:
            for p in [proc, *session]:
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    p.kill()


@pytest.mark.parametrize("value", ["inf", "1e7", "nan", "-1"])
def test_a_timeout_subprocess_cannot_wait_for_is_refused_before_the_session(value, tmp_path, capsys) -> None:
    # inf and 1e7 were an OverflowError traceback from communicate() once the session had started
    home = tmp_path / "home"
    assert main(["harness", "pi", "fix it", "--server", "http://127.0.0.1:1", "--workdir", str(tmp_path),
                 "--home", str(home), "--timeout", value]) == 2
    assert capsys.readouterr().err == (f"polar-train harness: error: --timeout: more than 0 and at most "
                                       f"{MAX_TIMEOUT_S} seconds, got {float(value):g}\n")
    assert not home.exists()


def test_the_timeout_bound_is_the_longest_wait_subprocess_accepts() -> None:
    """``communicate()`` waits in ``poll()`` (milliseconds in a C int): the bound must be what it takes."""
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.communicate(b"x", timeout=MAX_TIMEOUT_S) == (b"x", None)
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        try:
            with pytest.raises(OverflowError):
                proc.communicate(b"x", timeout=MAX_TIMEOUT_S + 1)
        finally:
            proc.kill()


@dataclass
class _EnvSession(_ShellSession):
    """A 'harness' that prints where it runs and the paths it was given."""

    def command(self, exe, prompt, workdir, home, server):
        return [str(exe), "-c", 'echo "$HOME"; echo "$NODE_EXTRA_CA_CERTS"; pwd']


def test_relative_and_home_relative_paths_are_the_callers(tmp_path, monkeypatch) -> None:
    # the harness runs in the work directory: a relative home or CA file passed on as given would
    # name a folder inside the user's repository (Pi created wd/h-rel/.pi there and found no provider)
    (tmp_path / "wd").mkdir()
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "x.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    monkeypatch.chdir(tmp_path)
    run = _EnvSession().run("wd", "x", ModelServer("http://127.0.0.1:1"), Proxy(1, "r", Path("conf/x.pem")),
                            home="~/h", timeout=30)
    assert run.ok, run.describe()
    base = tmp_path.resolve()
    assert run.stdout.splitlines() == [str(base / "me" / "h"), str(base / "conf" / "x.pem"), str(base / "wd")]
    assert run.home == base / "me" / "h" and run.workdir == base / "wd"
    assert sorted(p.name for p in (tmp_path / "wd").iterdir()) == []


class _RefusingServer(http.server.BaseHTTPRequestHandler):
    """A model server that records every request body and answers 400: the session ends at once."""

    bodies: list[dict]

    def do_POST(self) -> None:
        self.bodies.append(json.loads(self.rfile.read(int(self.headers.get("content-length") or 0))))
        payload = b'{"error": {"message": "recorded", "type": "invalid_request_error"}}'
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_HEAD(self) -> None:  # Claude Code's connection warm-up
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_server() -> Iterator[tuple[str, list[dict]]]:
    bodies: list[dict] = []
    handler = type("Handler", (_RefusingServer,), {"bodies": bodies})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _strings(value: object) -> Iterator[str]:
    """Every string in a decoded JSON request."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


@pytest.mark.parametrize("name", ALL)
def test_a_prompt_that_starts_with_a_dash_reaches_the_model_as_typed(name, tmp_path, refusing_server) -> None:
    """A markdown bullet is a prompt, not an option: each real CLI used to refuse it (Pi "Unknown
    option", Codex "unexpected argument", Claude Code "unknown option") before any model call."""
    require_harnesses(name)
    url, bodies = refusing_server
    prompt = "- fix the failing test\n- then run it"
    run = get_harness(name).run(tmp_path, prompt, ModelServer(url), home=tmp_path / "home", timeout=120)
    assert bodies, run.describe()
    assert any(prompt in _strings(body) for body in bodies), run.describe()


def test_a_relative_home_is_not_made_inside_the_work_directory(tmp_path, monkeypatch, refusing_server) -> None:
    """`--workdir wd --home h-rel`: Pi reads the config the command wrote (it asks the server),
    and nothing is written into the user's repository."""
    require_harnesses("pi")
    url, bodies = refusing_server
    (tmp_path / "wd").mkdir()
    monkeypatch.chdir(tmp_path)
    main(["harness", "pi", "say hi", "--server", url, "--workdir", "wd", "--home", "h-rel", "--timeout", "120"])
    assert bodies  # was: Error: Unknown provider "polar"
    assert (tmp_path / "h-rel" / ".pi" / "agent" / "models.json").is_file()
    assert list((tmp_path / "wd").iterdir()) == []


@pytest.mark.parametrize("succeeds", [True, False])
def test_the_command_removes_a_temporary_home_after_a_good_session(succeeds, tmp_path, monkeypatch, capsys) -> None:
    """One temporary home per session was left in /tmp, for every rollout of a training run; a
    failed session's stays (its files say what happened), and is named."""
    import polar_train.harnesses as harnesses

    @dataclass
    class Session(_QuickSession):
        def command(self, exe, prompt, workdir, home, server):
            return [str(exe), "-c", "echo done" if succeeds else "echo broken >&2; exit 3"]

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: Session())
    work = tmp_path / "work"
    work.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts: the server check passes
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        code = main(["harness", "pi", "fix it", "--server", url, "--workdir", str(work)])
        homes = list(temp.iterdir())
        if succeeds:
            assert code == 0 and homes == []
        else:
            assert code == 3 and len(homes) == 1 and (homes[0] / ".codex" / "config.toml").is_file()
            assert f"(home: {homes[0]})" in capsys.readouterr().err
        # a home the user named is theirs to keep, whatever the session did
        main(["harness", "pi", "fix it", "--server", url, "--workdir", str(work), "--home", str(tmp_path / "mine")])
        assert (tmp_path / "mine" / ".codex" / "config.toml").is_file()


# -- ending everything a session started; interrupts; homes ------------------------------------------

@dataclass
class _DetachingSession(_ShellSession):
    """A 'harness' whose tool leaves its session as Claude Code and Pi start tools (``setsid``),
    then hangs (or ends at once): a process-group kill misses the tool."""

    hang: bool = True

    def command(self, exe, prompt, workdir, home, server):
        detach = f"setsid sh -c 'echo $$ > {self.pidfile}; exec sleep 300' >/dev/null 2>&1 </dev/null &"
        wait = f"while [ ! -s {self.pidfile} ]; do sleep 0.05; done; echo started; : > {self.pidfile}.said"
        return [str(exe), "-c", f"{detach} {wait}; {'sleep 300' if self.hang else 'true'}"]


def _wait_gone(pid: int, seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)  # polling for the kill to land
    return not _alive(pid)


@pytest.mark.parametrize("hang", [True, False], ids=["timeout", "normal-end"])
def test_tools_in_a_session_of_their_own_are_ended_with_the_session(hang, tmp_path) -> None:
    """Claude Code and Pi start tools with setsid: `sleep` kept running after the session's timeout."""
    harness = _DetachingSession(pidfile=tmp_path / "tool.pid", hang=hang)
    run = harness.run(tmp_path, "x", ModelServer("http://127.0.0.1:1"), None, home=tmp_path / "home",
                      timeout=3 if hang else 30)
    assert run.timed_out is hang and "started" in run.stdout
    assert _wait_gone(int((tmp_path / "tool.pid").read_text())), "the detached tool outlived the session"


class _LeavesAServer(_ShellSession):
    """A 'harness' that starts a server with `&` (its stdout still the session's pipe) and exits 0."""

    def command(self, exe, prompt, workdir, home, server):
        started = f"while [ ! -s {self.pidfile} ]; do sleep 0.05; done"
        return [str(exe), "-c", f"sh -c 'echo $$ > {self.pidfile}; exec sleep 300' & {started}; echo done"]


def test_a_process_left_holding_the_pipes_is_ended_not_waited_for(tmp_path) -> None:
    """The harness exited 0 but a process it started with `&` kept its stdout open: the run waited
    out the whole --timeout and reported a timeout."""
    harness = _LeavesAServer(pidfile=tmp_path / "server.pid")
    run = harness.run(tmp_path, "x", ModelServer("http://127.0.0.1:1"), None, home=tmp_path / "home", timeout=60)
    assert run.returncode == 0 and not run.timed_out and "done" in run.stdout
    assert _wait_gone(int((tmp_path / "server.pid").read_text()))


@pytest.mark.parametrize("signum", [2, 15], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_ends_the_session_keeps_its_home_and_says_so(signum, tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C/SIGTERM used to exit 130/143 in silence: the output dropped, the temporary home left
    behind unnamed, the detached tools running."""
    import polar_train.harnesses as harnesses

    pidfile = tmp_path / "tool.pid"
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: _DetachingSession(pidfile=pidfile))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again

    def interrupt() -> None:
        deadline = time.monotonic() + 30
        said = Path(f"{pidfile}.said")  # written after "started" went into the pipe
        while time.monotonic() < deadline and not said.exists():
            time.sleep(0.05)  # polling for the session to start its tool and say so
        os.kill(os.getpid(), signum)  # handled in the main thread, inside main()'s handlers

    from polar_train.cli import _main

    with socket.create_server(("127.0.0.1", 0)) as server:
        thread = threading.Thread(target=interrupt)
        thread.start()
        # the program's status (cli.main hands a caller in Python the interrupt itself)
        code = _main(["harness", "pi", "fix it", "--server", f"http://127.0.0.1:{server.getsockname()[1]}",
                      "--workdir", str(tmp_path), "--timeout", "120"], keep_signal=False)
        thread.join()
    out = capsys.readouterr()
    assert code == 128 + signum
    (home,) = temp.iterdir()  # kept, as after a failed session, and named
    assert "started" in out.out
    name = "SIGINT" if signum == 2 else "SIGTERM"
    assert re.search(rf"^polar-train harness: interrupted \({name}\); the pi session was ended after "
                     rf"[0-9.]+s \(home: {re.escape(str(home))}\)$", out.err, re.M), out.err
    assert _wait_gone(int(pidfile.read_text()))


def test_a_harness_that_cannot_start_leaves_no_home(tmp_path, monkeypatch, capsys) -> None:
    """A binary that is not executable: PermissionError from Popen, and a temporary home left behind."""
    import polar_train.harnesses as harnesses

    prefix = tmp_path / "prefix"
    (prefix / "node_modules" / ".bin").mkdir(parents=True)
    (prefix / "node_modules" / ".bin" / "sh").write_text("#!/bin/sh\n")  # mode 0644
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(HarnessError, match=r"cannot start shell \(.*\): Permission denied"):
        _QuickSession(prefix=prefix).run(tmp_path, "x", ModelServer("http://127.0.0.1:1"), timeout=30)
    assert list(temp.iterdir()) == []
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: _QuickSession(prefix=prefix))
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert main(["harness", "pi", "x", "--server", f"http://127.0.0.1:{server.getsockname()[1]}",
                     "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polar-train harness: error: cannot start shell (") and err.count("\n") == 1
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("name", ALL)
def test_temporary_files_go_into_the_private_home(name, tmp_path, monkeypatch) -> None:
    """Claude Code wrote tool output under the caller's TMPDIR ($TMPDIR/claude-0/...), never removed."""
    monkeypatch.setenv("TMPDIR", "/var/tmp")
    env = get_harness(name).environment(tmp_path, ModelServer("http://127.0.0.1:1"), None)
    assert env["TMPDIR"] == str(tmp_path / "tmp") and (tmp_path / "tmp").is_dir()


@dataclass
class _SilentSession(_QuickSession):
    """A 'harness' that exits 0 and says nothing: Pi after a failed compaction."""

    def command(self, exe, prompt, workdir, home, server):
        return [str(exe), "-c", "exit 0"]


def test_exit_0_without_a_final_answer_is_a_failure(tmp_path, monkeypatch, capsys) -> None:
    """Pi exits 0 with no output when its compaction call fails: that was counted a success."""
    import polar_train.harnesses as harnesses

    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: _SilentSession())
    with socket.create_server(("127.0.0.1", 0)) as server:
        code = main(["harness", "pi", "x", "--server", f"http://127.0.0.1:{server.getsockname()[1]}",
                     "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    match = re.fullmatch(r"polar-train harness: shell exited 0 without a final answer after [0-9.]+s, counted as a "
                         r"failure \(home: (.*)\)\n", err)
    assert code == 1 and match, err
    assert Path(match.group(1)).is_dir()  # kept, as after any failed session
    import shutil
    shutil.rmtree(match.group(1))


class _ModelsServer(http.server.BaseHTTPRequestHandler):
    """A server's /v1/models (vLLM's shape, with ``max_model_len``), also as a plain HTTP proxy
    would pass it on (absolute-form path); records what each request carried."""

    seen: list[dict]
    #: Mark the answer to the harness check's probe as the capture addon does (False: a model
    #: server on the proxy port, which answers the absolute-form GET itself).
    marks = True
    owner = "vllm"  # vLLM's listing; Ollama's says "library"

    def do_GET(self) -> None:
        from polar_train.capture.identity import CAPTURE_MARK, PROBE_HEADER

        self.seen.append({"path": self.path, "proxy_auth": self.headers.get("proxy-authorization")})
        payload = json.dumps({"object": "list", "data": [
            {"id": "other", "max_model_len": 99, "owned_by": self.owner},
            {"id": "tiny", "max_model_len": 4096, "owned_by": self.owner},
            {"id": "big", "max_model_len": 32768, "owned_by": self.owner}]}).encode()
        self.send_response(200)
        if self.marks and self.headers.get(PROBE_HEADER):
            self.send_header(CAPTURE_MARK, "1")
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def models_server() -> Iterator[tuple[int, list[dict]]]:
    seen: list[dict] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_ModelsServer,), {"seen": seen}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_pi_takes_its_context_window_from_the_server(tmp_path, models_server) -> None:
    """A hard-coded 65536 beyond the server's limit: Pi outgrew it and exited 0 with no answer."""
    port, _ = models_server

    def window(url: str, folder: str) -> int:
        env = Pi().configure(tmp_path / folder, ModelServer(url, model="tiny"), None)
        return json.loads((Path(env["PI_CODING_AGENT_DIR"]) / "models.json").read_text()
                          )["providers"]["polar"]["models"][0]["contextWindow"]

    assert window(f"http://127.0.0.1:{port}", "served") == 4096
    assert window(f"http://127.0.0.1:{free_port()}", "unreachable") == 65536  # the default
    env = Pi(context_window=1000).configure(tmp_path / "given", ModelServer(f"http://127.0.0.1:{port}"), None)
    assert '"contextWindow": 1000' in (Path(env["PI_CODING_AGENT_DIR"]) / "models.json").read_text()



def test_an_adapter_served_by_vllm_has_its_base_models_window() -> None:
    """vLLM lists a LoRA adapter (``--lora-modules r1=DIR``, round 2 onwards) without a length,
    under its ``parent``: the harnesses were told no window (Pi assumed 65536 against a 4096
    server, Codex and Claude Code none), so a long session ended in the server's 400."""
    from polar_train.harnesses.base import served_context_length

    models = {"object": "list", "data": [
        {"id": "tiny", "object": "model", "owned_by": "vllm", "root": "/m/tiny", "parent": None,
         "max_model_len": 4096},
        {"id": "r1", "object": "model", "owned_by": "vllm", "root": "runs/r1/adapter", "parent": "tiny",
         "max_model_len": None}]}
    assert served_context_length(models, "r1") == 4096
    assert served_context_length(models, "tiny") == 4096
    orphan = {"data": [{"id": "r1", "parent": "gone", "max_model_len": None}, {"id": "x", "max_model_len": 9}]}
    assert served_context_length(orphan, "r1") is None


def test_codex_takes_its_context_window_from_the_server(tmp_path, models_server) -> None:
    """Codex knows no window for a model it does not know: a session past the server's context
    length ended in the server's 400 ("maximum context length is 10000 tokens") where, told the
    window, Codex compacts the conversation and goes on."""
    port, _ = models_server

    def config(folder: str, harness: Codex, url: str, model: str = "big") -> dict:
        env = harness.configure(tmp_path / folder, ModelServer(url, model=model), None)
        return tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())

    assert config("served", Codex(), f"http://127.0.0.1:{port}")["model_context_window"] == 32768
    assert "model_context_window" not in config("unreachable", Codex(), f"http://127.0.0.1:{free_port()}")
    assert config("given", Codex(context_window=20000), f"http://127.0.0.1:{port}")["model_context_window"] == 20000
    # below Codex's first prompt and a summary, a window makes it compact again and again until the
    # timeout (a probe: 276 calls), where the server's 400 ended the session at once
    assert "model_context_window" not in config("small", Codex(), f"http://127.0.0.1:{port}", model="tiny")
    assert "model_context_window" not in config("given-small", Codex(context_window=4096), f"http://127.0.0.1:{port}")
    mine = Codex(extra_config={"model_context_window": 7, "model_auto_compact_token_limit": 5})
    assert config("own", mine, f"http://127.0.0.1:{port}")["model_context_window"] == 7  # the caller's own wins


def test_claude_code_compacts_within_the_servers_context(tmp_path, models_server, monkeypatch) -> None:
    """Claude Code assumes a 200k window for a model it does not know (and raises a smaller
    auto-compaction window to 100k): a session past a 32k server's context ended in its 400. The
    threshold is set from the server's context; the caller's own --env wins."""
    from polar_train.harnesses.claude_code import compaction_env

    port, _ = models_server
    url = f"http://127.0.0.1:{port}"
    assert compaction_env(32768) == {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000",
                                     "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "26.21"}  # 80 % of 32,768 tokens
    assert compaction_env(262144) == {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "262144"}
    env = ClaudeCode().configure(tmp_path / "big", ModelServer(url, model="big"), None)
    assert env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] == "26.21"
    small = ClaudeCode().configure(tmp_path / "small", ModelServer(url, model="tiny"), None)  # 4096: too
    assert not set(small) & {"CLAUDE_CODE_AUTO_COMPACT_WINDOW", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"}  # small

    @dataclass
    class _Printing(ClaudeCode):  # the real environment, a shell in place of claude
        def __post_init__(self) -> None:
            self.name, self.binary = "claude-code", "sh"

        def command(self, exe, prompt, workdir, home, server):
            return [str(exe), "-c", 'echo "$CLAUDE_CODE_AUTO_COMPACT_WINDOW $CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"']

    run = _Printing().run(tmp_path, "x", ModelServer(url, model="big"), timeout=30,
                          extra_env={"CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "5"})
    assert run.ok and run.stdout.strip() == "100000 5"


def test_claude_codes_output_budget_fits_a_small_server(tmp_path, models_server) -> None:
    """Claude Code asks max_tokens 32000 of a model it does not know: a server of less context
    refused every call ("max_tokens=32000 cannot be greater than max_model_len=4096"); a probe's
    sessions ran from 6k up with a quarter of the context. The caller's own value wins."""
    port, _ = models_server
    url = f"http://127.0.0.1:{port}"
    small = ClaudeCode().configure(tmp_path / "small", ModelServer(url, model="tiny"), None)
    assert small["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "1024"  # a quarter of 4,096
    big = ClaudeCode().configure(tmp_path / "big", ModelServer(url, model="big"), None)
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in big  # 32,768: the default fits
    unknown = ClaudeCode().configure(tmp_path / "unknown", ModelServer(f"http://127.0.0.1:{free_port()}"), None)
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in unknown
    mine = ClaudeCode(max_output_tokens=300).configure(tmp_path / "mine", ModelServer(url, model="tiny"), None)
    assert mine["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "300"
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" in ClaudeCode().overridable_env  # --env wins too


def test_pis_compaction_fits_a_small_server(tmp_path, models_server) -> None:
    """Pi compacts past contextWindow - 16384 and asks its summary call for 13,107 tokens: below
    64k it summarised after its answer, a call a 4k-16k server refused. A quarter of the context
    each; a home's own settings stay and win; a broken settings file is one clear error."""
    port, _ = models_server
    url = f"http://127.0.0.1:{port}"

    def settings(folder: str, model: str = "tiny") -> dict:
        Pi().configure(tmp_path / folder, ModelServer(url, model=model), None)
        path = tmp_path / folder / ".pi" / "agent" / "settings.json"
        return json.loads(path.read_text()) if path.exists() else {}

    assert settings("small") == {"compaction": {"reserveTokens": 1024, "keepRecentTokens": 1024}}
    assert settings("big", "big") == {"compaction": {"reserveTokens": 8192, "keepRecentTokens": 8192}}
    Pi().configure(tmp_path / "default", ModelServer(f"http://127.0.0.1:{free_port()}"), None)  # 65536 assumed
    assert not (tmp_path / "default" / ".pi" / "agent" / "settings.json").exists()
    own = tmp_path / "own" / ".pi" / "agent"
    own.mkdir(parents=True)
    (own / "settings.json").write_text('{"theme": "dark", "compaction": {"reserveTokens": 2000}}')
    assert settings("own") == {"theme": "dark", "compaction": {"reserveTokens": 2000, "keepRecentTokens": 1024}}
    (own / "settings.json").write_text("{oops")
    with pytest.raises(HarnessError, match=r"settings.json: not readable JSON"):
        settings("own")
    assert (own / "settings.json").read_text() == "{oops"  # left as it was
    # a home used again against a larger server: the 4k server's values do not stay (Pi would
    # compact a 128k context with an 819-token summary); the caller's own value does
    reused = tmp_path / "reused" / ".pi" / "agent"
    assert settings("reused") == {"compaction": {"reserveTokens": 1024, "keepRecentTokens": 1024}}
    Pi(context_window=131072).configure(tmp_path / "reused", ModelServer(url, model="tiny"), None)
    assert json.loads((reused / "settings.json").read_text()) == {}
    (reused / "settings.json").write_text('{"compaction": {"keepRecentTokens": 500}}')
    assert settings("reused", "big") == {"compaction": {"reserveTokens": 8192, "keepRecentTokens": 500}}
    Pi(context_window=131072).configure(tmp_path / "reused", ModelServer(url, model="tiny"), None)
    assert json.loads((reused / "settings.json").read_text()) == {"compaction": {"keepRecentTokens": 500}}

def test_the_proxy_check_goes_through_the_proxy_with_the_rollout_id(tmp_path, models_server, monkeypatch,
                                                                     capsys) -> None:
    """Before the session: one GET /v1/models through the proxy (a model call it is not), which also
    gives Pi its context window. The caller's NO_PROXY must not send it around the proxy."""
    import polar_train.harnesses as harnesses

    port, seen = models_server
    chosen: list[dict] = []
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: chosen.append(options) or _QuickSession())
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    ca = tmp_path / "ca.pem"
    ca.write_text(Path(__import__("certifi").where()).read_text())  # any PEM ssl loads
    with socket.create_server(("127.0.0.1", 0)) as server:
        server_port = server.getsockname()[1]
        assert main(["harness", "pi", "x", "--server", f"http://127.0.0.1:{server_port}", "--workdir", str(tmp_path),
                     "--home", str(tmp_path / "home"), "--proxy-port", str(port), "--rollout", "r-7",
                     "--ca-cert", str(ca)]) == 0, capsys.readouterr().err
        err = capsys.readouterr().err
    assert seen == [{"path": f"http://127.0.0.1:{server_port}/v1/models", "proxy_auth": "Basic ci03Ong="}]  # r-7:x
    assert chosen == [{"context_window": 4096}]
    # a 4k server: the session would end at its limit (Codex's first request alone did not fit)
    assert err.startswith("polar-train harness: warning: the server's context length is 4,096 tokens: below "
                          "16,384 pi is not told to compact, so a session ends at the server's limit; serve with "
                          "--max-model-len 32768 or more"), err  # _QuickSession: the base class's floor
    from polar_train.harnesses.base import MIN_COMPACTING_WINDOW

    assert Pi().smallest_context == 8192 and Codex().smallest_context == ClaudeCode().smallest_context == \
        MIN_COMPACTING_WINDOW
    like_pi = _QuickSession()  # what Pi's floor says: it compacts, a long tool output overflows
    like_pi.smallest_context, like_pi.first_request_tokens = Pi().smallest_context, Pi().first_request_tokens
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: like_pi)
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert main(["harness", "pi", "x", "--server", f"http://127.0.0.1:{server.getsockname()[1]}", "--workdir",
                     str(tmp_path), "--home", str(tmp_path / "home"), "--proxy-port", str(port), "--rollout", "r-8",
                     "--ca-cert", str(ca)]) == 0
    assert capsys.readouterr().err.startswith(
        "polar-train harness: warning: the server's context length is 4,096 tokens: pi compacts, but one long tool "
        "output overflows less than 8,192; its first request alone is ~1,400 tokens; serve with --max-model-len 32768")


def test_a_model_the_server_does_not_serve_is_refused_before_the_session(tmp_path, models_server, monkeypatch,
                                                                        capsys) -> None:
    """``--model`` a typo: the harness ran anyway and printed the server's 404 in its own words (Codex
    retried it for a minute), its calls recorded as errors. Asked directly and through the proxy."""
    import polar_train.harnesses as harnesses

    port, seen = models_server
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: pytest.fail("a session started"))
    base = f"http://127.0.0.1:{port}"
    assert main(["harness", "pi", "x", "--server", base, "--model", "tinny", "--workdir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"polar-train harness: error: --model tinny: the server at {base} does not "
                                       "serve it (GET /v1/models lists other, tiny, big)\n")
    with socket.create_server(("127.0.0.1", 0)) as server:  # the proxy check's answer says it too
        behind = f"http://127.0.0.1:{server.getsockname()[1]}"
        assert main(["harness", "pi", "x", "--server", behind, "--model", "tinny", "--workdir", str(tmp_path),
                     "--proxy-port", str(port), "--rollout", "r1"]) == 2
    assert capsys.readouterr().err == (f"polar-train harness: error: --model tinny: the server at {behind} does not "
                                       "serve it (GET /v1/models lists other, tiny, big)\n")
    assert len(seen) == 2


def test_a_model_another_server_does_not_list_is_a_warning(tmp_path, monkeypatch, capsys) -> None:
    """Ollama serves qwen3 for qwen3:latest, a gateway names it by a wildcard: a server other than
    vLLM may serve names it does not list, so the session goes on, warned."""
    import polar_train.harnesses as harnesses

    started: list[dict] = []
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: started.append(options) or _QuickSession())
    seen: list[dict] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             type("H", (_ModelsServer,), {"seen": seen, "owner": "library"}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["harness", "pi", "x", "--server", base, "--model", "qwen3", "--workdir", str(tmp_path),
                     "--home", str(tmp_path / "home")]) == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert capsys.readouterr().err.startswith(
        f"polar-train harness: warning: --model qwen3: the server at {base} does not serve it (GET /v1/models lists "
        "other, tiny, big); going on, as this server may serve names it does not list\n")
    assert len(started) == 1


def test_a_wrong_service_on_the_proxy_port_or_a_bad_ca_is_refused_before_the_session(tmp_path, refusing_server,
                                                                                      capsys) -> None:
    """Something listens on --proxy-port but is no proxy (or a CA file TLS cannot load): the session
    used to wait in silence until --timeout."""
    url, _ = refusing_server  # an HTTP server, not a proxy: it answers GET with 501
    port = urlsplit(url).port
    ca = tmp_path / "ca.pem"
    ca.write_text(Path(__import__("certifi").where()).read_text())
    with socket.create_server(("127.0.0.1", 0)) as server:
        args = ["harness", "pi", "x", "--server", f"http://127.0.0.1:{server.getsockname()[1]}", "--workdir",
                str(tmp_path), "--proxy-port", str(port), "--rollout", "r1", "--timeout", "600"]
        assert main([*args, "--ca-cert", str(ca)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"polar-train harness: error: the proxy (mitmdump -s addons/polar_capture.py) at "
                              f"127.0.0.1:{port} did not pass a request on to the model server: GET ") and \
            err.endswith(" answered HTTP 501 Unsupported method ('GET')\n"), err
        ca.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
        assert main([*args, "--ca-cert", str(ca)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"polar-train harness: error: proxy CA certificate {ca} cannot be loaded as a PEM "
                              "certificate (") and err.count("\n") == 1, err


def test_a_model_server_on_the_proxy_port_is_refused_before_the_session(tmp_path, capsys) -> None:
    """--proxy-port naming the model server itself: vLLM answers the absolute-form GET of the
    check as a proxy would, and the session ran unrecorded (exit 0, no row), the proxy
    credentials sent to the server. The capture addon marks its answer; this one has no mark."""
    seen: list[dict] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_ModelsServer,), {"seen": seen, "marks": False}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert main(["harness", "pi", "x", "--server", f"http://127.0.0.1:{port}", "--workdir", str(tmp_path),
                     "--proxy-port", str(port), "--rollout", "r1", "--timeout", "600"]) == 2
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    err = capsys.readouterr().err
    from tests.support.harness import not_the_capture_proxy

    assert err == not_the_capture_proxy(port)
    assert len(seen) == 1  # the check only: no session started


def test_a_reverse_mode_capture_proxy_is_refused_for_a_harness_that_tunnels(tmp_path, models_server, monkeypatch,
                                                                             capsys) -> None:
    """The capture proxy of the docs' first example listens in reverse mode: the check's GET went to its
    target and came back marked, then Pi's CONNECT tunnel was refused there ("Connection error." after
    21 s, nothing recorded). Codex and Claude Code send absolute-form requests, which such a port
    records (a probe with the real CLIs): for them it stays allowed. The real mitmdump, one regular
    and one reverse listener."""
    import polar_train.harnesses as harnesses
    from tests.support.mitm import mitm

    port, seen = models_server
    started: list[dict] = []
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: started.append(options) or _QuickSession())
    server = f"http://127.0.0.1:{port}"
    with mitm(tmp_path / "proxy", modes=("regular", f"reverse:{server}")) as proxy:
        regular, reverse = proxy.ports
        args = ["x", "--server", server, "--workdir", str(tmp_path), "--home", str(tmp_path / "home"), "--rollout", "r1"]
        assert main(["harness", "pi", *args, "--proxy-port", str(regular)]) == 0, capsys.readouterr().err
        assert main(["harness", "codex", *args, "--proxy-port", str(reverse)]) == 0, capsys.readouterr().err
        assert len(started) == 2
        capsys.readouterr()
        assert main(["harness", "pi", *args, "--proxy-port", str(reverse)]) == 2
    assert capsys.readouterr().err == (
        f"polar-train harness: error: --proxy-port {reverse}: 127.0.0.1:{reverse} is a capture proxy in reverse mode "
        "(mitmdump --mode reverse:URL), which refuses the CONNECT tunnel pi reaches its server through: give a "
        "regular-mode port (leave --mode out, or add --mode regular@PORT and give that PORT)\n")
    assert len(started) == 2 and len(seen) == 3  # each check reached the server; no third session
    assert [name for name, cls in harnesses.HARNESSES.items() if cls.tunnels] == ["pi"]


def test_a_reverse_mode_proxy_whose_target_is_another_server_is_said(tmp_path, models_server, monkeypatch,
                                                                      capsys) -> None:
    """Codex and Claude Code through a reverse listener: every call goes to the listener's target,
    whatever --server names; a target other than --server sent the session to another server unsaid.
    The real mitmdump, a reverse listener to one server, --server naming it and then a second one."""
    import polar_train.harnesses as harnesses
    from polar_train.harnesses.base import same_endpoint
    from tests.support.mitm import mitm

    port, seen = models_server
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_ModelsServer,), {"seen": []}))
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: _QuickSession())
    try:
        with mitm(tmp_path / "proxy", modes=(f"reverse:http://127.0.0.1:{port}",)) as proxy:
            (reverse,) = proxy.ports
            common = ["x", "--workdir", str(tmp_path), "--home", str(tmp_path / "home"), "--rollout", "r1",
                      "--proxy-port", str(reverse)]
            for server in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
                assert main(["harness", "codex", *common, "--server", server]) == 0
                assert "reverse mode" not in capsys.readouterr().err
            elsewhere = f"http://127.0.0.1:{other.server_address[1]}"
            assert main(["harness", "claude-code", *common, "--server", elsewhere]) == 0
    finally:
        other.shutdown()
        other.server_close()
        thread.join()
    assert capsys.readouterr().err.splitlines()[:1] == [
        f"polar-train harness: warning: the capture proxy at 127.0.0.1:{reverse} listens in reverse mode and sends "
        f"every call to its target http://127.0.0.1:{port}, not to --server {elsewhere}"]
    assert same_endpoint("http://[::1]:80", "http://[::1]") and not same_endpoint("https://h:443", "http://h:443")


def test_names_the_system_refuses_are_one_line(tmp_path, capsys) -> None:
    """ENAMETOOLONG and symlink loops were tracebacks (OSError from exists(), RuntimeError from resolve())."""
    long_name = tmp_path / ("a" * 300)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for bad in (long_name, loop / "x"):
        for call in (lambda: Harness.check_inputs(bad, "x"), lambda: Harness.check_inputs(tmp_path, "x", bad),
                     lambda: Proxy(1, "r", bad)):
            with pytest.raises(HarnessError):
                call()
        for option in ("--workdir", "--home", "--ca-cert"):
            args = ["harness", "pi", "x", "--server", "http://127.0.0.1:1", "--workdir", str(tmp_path),
                    option, str(bad)] + (["--proxy-port", "1", "--rollout", "r"] if option == "--ca-cert" else [])
            assert main(args) == 2
            err = capsys.readouterr().err
            assert err.startswith("polar-train harness: error: ") and err.count("\n") == 1, err
            assert "Traceback" not in err


def test_a_timeout_exits_124_and_says_so(tmp_path, monkeypatch, capsys) -> None:
    import polar_train.harnesses as harnesses

    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: _ShellSession(pidfile=tmp_path / "c.pid"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        code = main(["harness", "pi", "x", "--server", f"http://127.0.0.1:{server.getsockname()[1]}",
                     "--workdir", str(tmp_path), "--home", str(tmp_path / "home"), "--timeout", "1.5"])
    assert code == 124  # as timeout(1): not an ordinary failure
    assert capsys.readouterr().err.endswith(f"polar-train harness: shell timed out after 1.5 s, killed "
                                            f"(home: {tmp_path / 'home'})\n")


def test_server_urls(tmp_path, capsys) -> None:
    assert ModelServer("HTTP://127.0.0.1:8000/V1").base_url == "http://127.0.0.1:8000/V1"  # the path is the server's
    assert ModelServer("HTTPS://Host:8000/v1/").base_url == "https://Host:8000"
    for url, why in (("http://[::1", "Invalid IPv6 URL"), ("http://h:99999", "Port out of range"),
                     ("http://", "names no host")):
        assert main(["harness", "pi", "x", "--server", url, "--workdir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("polar-train harness: error: --server: model server URL") and why in err, err


@dataclass
class _SettingSession(_QuickSession):
    """A 'harness' that prints one variable of its environment."""

    def command(self, exe, prompt, workdir, home, server):
        return [str(exe), "-c", 'echo "window=$CLAUDE_CODE_AUTO_COMPACT_WINDOW lang=$LANG"']


def test_more_environment_variables_reach_the_harness_but_not_the_sessions_own(tmp_path, monkeypatch, capsys) -> None:
    """The runner gives the harness a clean environment, so a harness setting (Claude Code's
    auto-compaction threshold) could not be given at all; one the session sets itself (its home,
    the proxy) must not be overridden, which would undo its isolation or routing."""
    import polar_train.harnesses as harnesses

    server = ModelServer("http://127.0.0.1:1")
    run = _SettingSession().run(tmp_path, "x", server, timeout=30,
                            extra_env={"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "LANG": "C.UTF-8"})
    assert run.ok and run.stdout.strip() == "window=100000 lang=C.UTF-8"
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    for name in ("HOME", "HTTPS_PROXY", "POLAR_HARNESS_SESSION"):
        with pytest.raises(HarnessError, match=f"environment variable {name} is set by the shell session itself"):
            _SettingSession().run(tmp_path, "x", server, Proxy(1, "r"), timeout=30, extra_env={name: "/elsewhere"})
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY"):  # set by habit, they would bypass the capture
        with pytest.raises(HarnessError, match=f"environment variable {name} would send the shell session "
                                               "around the capture proxy"):
            _SettingSession().run(tmp_path, "x", server, Proxy(1, "r"), timeout=30, extra_env={name: "127.0.0.1"})
    assert list(temp.iterdir()) == []  # the temporary home of a refused session is removed
    monkeypatch.setattr(harnesses, "get_harness", lambda name, **options: _SettingSession())
    with socket.create_server(("127.0.0.1", 0)) as listening:
        base = ["harness", "claude-code", "x", "--server", f"http://127.0.0.1:{listening.getsockname()[1]}",
                "--workdir", str(tmp_path)]
        assert main([*base, "--env", "CLAUDE_CODE_AUTO_COMPACT_WINDOW=1", "--env",
                     "CLAUDE_CODE_AUTO_COMPACT_WINDOW=120000"]) == 0
        assert capsys.readouterr().out.startswith("window=120000 ")  # the later one wins, as in env(1)
        for bad, message in (("WINDOW", "--env: expected NAME=VALUE with NAME of letters, digits and _, got 'WINDOW'"),
                             ("1X=2", "--env: expected NAME=VALUE with NAME of letters, digits and _, got '1X=2'"),
                             ("HOME=/x", "environment variable HOME is set by the shell session itself (its home, "
                                         "proxy, CA, server, key or settings): it cannot be given"),
                             ("no_proxy=127.0.0.1", "--env no_proxy: it would send the session around the capture "
                                                    "proxy")):
            assert main([*base, "--env", bad]) == 2
            assert capsys.readouterr().err == f"polar-train harness: error: {message}\n"
        # said before the proxy is tried: a proxy that is down is not what the user hears of first
        assert main([*base, "--proxy-port", str(free_port()), "--rollout", "r", "--env", "NO_PROXY=x"]) == 2
        assert capsys.readouterr().err == ("polar-train harness: error: --env NO_PROXY: it would send the session "
                                           "around the capture proxy\n")
