"""``polar-train harness``: run one real harness session (Codex, Claude Code, Pi) through the proxy.

Why a command: collecting rollouts means running the unmodified harness many times with the right
environment (private home, proxy credentials = rollout id, CA trust); this is that, once per call.
The API key comes from ``$POLAR_API_KEY`` (never from the command line, which others can read).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit
from typing import NoReturn

from ..paths import user_path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("harness", help="run Codex, Claude Code or Pi non-interactively through the proxy")
    p.add_argument("name", choices=["codex", "claude-code", "pi"], help="which harness")
    p.add_argument("prompt", help="the task, as a user would type it")
    p.add_argument("--workdir", default=".", type=user_path, help="the repository the session works in (default: .)")
    p.add_argument("--server", required=True,
                   help="model server root URL, e.g. http://127.0.0.1:8000 (vLLM, SGLang, polar-train serve)")
    p.add_argument("--model", default="tiny", help="model name the server serves (default: tiny)")
    p.add_argument("--proxy-port", type=int, default=None,
                   help="port of `mitmdump -s addons/polar_capture.py` on 127.0.0.1 (omit: no proxy)")
    p.add_argument("--rollout", default=None,
                   help="rollout id, sent as the proxy user name (1-128 of A-Z a-z 0-9 . _ ~ -; with --proxy-port)")
    p.add_argument("--ca-cert", default=None, type=user_path,
                   help="mitmproxy CA certificate (default for an https:// server: "
                        "~/.mitmproxy/mitmproxy-ca-cert.pem; an http:// server needs none)")
    p.add_argument("--home", default=None, type=user_path,
                   help="private HOME/config dir: new, empty or one an earlier run made (default: a new temporary dir)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the session is killed (default: 600)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="one more environment variable for the harness, e.g. Claude Code's "
                        "CLAUDE_CODE_AUTO_COMPACT_WINDOW=100000 (repeatable; not for secrets: a command line "
                        "can be read by other users; variables the session sets itself are refused)")
    p.add_argument("--freeform-apply-patch", action="store_true",
                   help="codex only: describe the model in a model catalog so Codex offers its freeform "
                        "apply_patch tool (with a short system prompt of ours)")
    p.set_defaults(func=_run)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _named_values(items: list[str]) -> dict[str, str]:
    """``--env NAME=VALUE`` items as a mapping (a later NAME wins, as in ``env(1)``)."""
    from ..cli import UserError
    from .base import BYPASS_ENV

    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not _ENV_NAME.fullmatch(name):
            raise UserError(f"--env: expected NAME=VALUE with NAME of letters, digits and _, got {item!r}")
        if "\0" in value:
            raise UserError(f"--env {name}: a value cannot hold a NUL character")
        if name.upper() in BYPASS_ENV:  # before the connection checks: said first
            raise UserError(f"--env {name}: it would send the session around the capture proxy")
        out[name] = value
    return out


def _check_listening(url: str, what: str, timeout: float = 3.0) -> None:
    """Refuse to start a session whose server or proxy does not accept connections: a harness
    would retry until ``--timeout`` (Codex reconnects for minutes) and say only "network error"."""
    from ..cli import UserError

    parts = urlsplit(url)
    try:
        port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UserError(f"{what}: bad port in {url!r}") from None
    host = parts.hostname or ""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise UserError(f"cannot connect to {what} at {host}:{port} ({reason}); is it running?") from None


#: Exit status of a session that ran past ``--timeout``, as ``timeout(1)`` gives.
TIMEOUT_EXIT = 124


def _check_served(models: dict | None, server) -> None:
    """Refuse a ``--model`` that vLLM (or ``polar-train serve``) does not list: the harness ran
    anyway, printed the server's 404 in its own words (Codex retried it for a minute) and exited 1,
    its calls recorded as errors. Other servers may serve names they do not list (Ollama's
    ``qwen3`` for ``qwen3:latest``, a gateway's wildcard route): a warning there; a server that
    lists no models (or cannot be asked) is left to answer for itself."""
    from ..cli import UserError

    entries = [m for m in (models or {}).get("data") or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    ids = [m["id"] for m in entries]
    if not ids or server.model in ids:
        return
    shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
    said = f"--model {server.model}: the server at {server.base_url} does not serve it (GET /v1/models lists {shown})"
    if all(m.get("owned_by") == "vllm" for m in entries):  # vLLM's listing (ours too): it answers 404 to others
        raise UserError(said)
    print(f"polar-train harness: warning: {said}; going on, as this server may serve names it does not list",
          file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    from ..cli import UserError
    from . import DEFAULT_API_KEY, HARNESSES, Harness, HarnessError, ModelServer, Proxy, get_harness
    from .base import NotTheCaptureProxy, absolute, check_timeout, server_models
    from .base import MIN_COMPACTING_WINDOW, served_context_length

    run = None
    try:
        check_timeout(args.timeout, "--timeout")
        try:
            server = ModelServer(args.server, args.model, os.environ.get("POLAR_API_KEY") or DEFAULT_API_KEY)
        except HarnessError as exc:
            raise UserError(f"--server: {exc}") from None
        proxy = None
        if args.proxy_port is not None:
            if not 0 < args.proxy_port < 65536:
                raise UserError("--proxy-port must be in 1..65535")
            if not args.rollout:
                raise UserError("--proxy-port needs --rollout (the id the calls are recorded under)")
            ca = None  # an http:// server: no TLS through the proxy, no CA to trust
            if args.ca_cert or server.base_url.startswith("https://"):
                ca = Path(args.ca_cert or Path.home() / ".mitmproxy" / "mitmproxy-ca-cert.pem")
            proxy = Proxy(args.proxy_port, args.rollout, ca)  # made absolute there
        elif args.rollout or args.ca_cert:
            raise UserError(f"{'--rollout' if args.rollout else '--ca-cert'} needs --proxy-port")
        extra_env = _named_values(args.env)
        options: dict[str, object] = {}
        if args.freeform_apply_patch:
            if args.name != "codex":
                raise UserError("--freeform-apply-patch is a Codex option")
            options["freeform_apply_patch"] = True
        # relative to the caller, not to the work directory the harness runs in
        if args.home is not None and not args.home.strip():
            raise HarnessError("--home is empty: name a folder, or leave it out for a temporary one")
        workdir = Harness.check_inputs(args.workdir, args.prompt, args.home)
        home = absolute(args.home, "home") if args.home else None
        _check_listening(server.base_url, "the model server")
        if proxy is not None:
            where = "the proxy (mitmdump -s addons/polar_capture.py)"
            _check_listening(f"http://{proxy.host}:{proxy.port}", where)
            proxy.check_ca_cert()
            # something listens there; is it a proxy that reaches the server? (else: a silent wait
            # until --timeout). A GET of /v1/models is not a model call: the capture records no row.
            try:
                models = server_models(server, proxy, tunnels=args.name if HARNESSES[args.name].tunnels else None,
                                       warn=lambda line: print(f"polar-train harness: warning: {line}",
                                                               file=sys.stderr, flush=True))
            except NotTheCaptureProxy as exc:
                raise UserError(f"--proxy-port {proxy.port}: {exc}") from None
            except HarnessError as exc:
                raise UserError(f"{where} at {proxy.host}:{proxy.port} did not pass a request on to the "
                                f"model server: {exc}") from None
        else:
            try:
                models = server_models(server, capturing=False)
            except HarnessError:
                models = None  # not an OpenAI-compatible list: the harness meets the server as it is
        _check_served(models, server)
        window = served_context_length(models, server.model) if models is not None else None
        if window:
            options["context_window"] = window  # asked already: the harness runner need not ask again
        harness = get_harness(args.name, **options)
        if window and window < harness.smallest_context:
            why = (f"below {MIN_COMPACTING_WINDOW:,} {args.name} is not told to compact, so a session ends at the "
                   "server's limit" if harness.smallest_context >= MIN_COMPACTING_WINDOW else
                   f"{args.name} compacts, but one long tool output overflows less than "
                   f"{harness.smallest_context:,}")
            first = (f"; its first request alone is ~{harness.first_request_tokens:,} tokens"
                     if harness.first_request_tokens else "")
            print(f"polar-train harness: warning: the server's context length is {window:,} tokens: {why}{first}; "
                  "serve with --max-model-len 32768 or more (docs/harnesses.md, \"Server context\")",
                  file=sys.stderr, flush=True)
        run = harness.run(workdir, args.prompt, server, proxy, home, args.timeout, extra_env=extra_env)
    except HarnessError as exc:
        raise UserError(str(exc)) from None
    except (KeyboardInterrupt, SystemExit) as exc:
        _interrupted(exc, args.name)
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    if run.timed_out:
        print(f"polar-train harness: {run.harness} timed out after {args.timeout:g} s, killed "
              f"(home: {run.home})", file=sys.stderr)
        return TIMEOUT_EXIT
    if not run.ok:  # the temporary home stays: its logs and session files say what happened
        print(f"polar-train harness: {run.harness} exited {run.returncode} after {run.seconds:.1f}s "
              f"(home: {run.home})", file=sys.stderr)
        return run.returncode if run.returncode > 0 else 1
    if not run.final_message:  # Pi exits 0 with no answer when its compaction call fails
        print(f"polar-train harness: {run.harness} exited 0 without a final answer after {run.seconds:.1f}s, "
              f"counted as a failure (home: {run.home})", file=sys.stderr)
        return 1
    if home is None:  # one temporary home per session would pile up over a training run's rollouts
        shutil.rmtree(run.home, ignore_errors=True)
    return 0


def _interrupted(exc: KeyboardInterrupt | SystemExit, name: str) -> NoReturn:
    """Ctrl-C or SIGTERM (polar_train.cli's ``_Unwinding`` raises ``SystemExit(128 + signal)``):
    the session has been ended by ``Harness.run``; print what it wrote and one line, and raise it
    on, said: the program exits as the shell would (130, 143), a caller of ``cli.main`` in Python
    gets its Ctrl-C (a loop over sessions stops)."""
    from ..cli import said_interrupted, signal_name, signal_status

    code = signal_status(exc)
    if code is None:
        raise exc  # not a signal: not ours to report
    what = signal_name(code)
    run = getattr(exc, "harness_run", None)
    if run is None:
        print(f"polar-train harness: interrupted ({what}) before the {name} session started", file=sys.stderr)
        raise said_interrupted(exc) from None
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    print(f"polar-train harness: interrupted ({what}); the {name} session was ended after {run.seconds:.1f}s "
          f"(home: {run.home})", file=sys.stderr)
    raise said_interrupted(exc) from None
