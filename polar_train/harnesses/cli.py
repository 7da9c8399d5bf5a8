"""``polar-train harness``: run one real harness session (Codex, Claude Code, Pi) through the proxy.

Why a command: collecting rollouts means running the unmodified harness many times with the right
environment (private home, proxy credentials = rollout id, CA trust); this is that, once per call.
The API key comes from ``$POLAR_API_KEY`` (never from the command line, which others can read).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("harness", help="run Codex, Claude Code or Pi non-interactively through the proxy")
    p.add_argument("name", choices=["codex", "claude-code", "pi"], help="which harness")
    p.add_argument("prompt", help="the task, as a user would type it")
    p.add_argument("--workdir", default=".", help="the repository the session works in (default: .)")
    p.add_argument("--server", required=True,
                   help="model server root URL, e.g. http://127.0.0.1:8000 (vLLM, SGLang, polar-train serve)")
    p.add_argument("--model", default="tiny", help="model name the server serves (default: tiny)")
    p.add_argument("--proxy-port", type=int, default=None,
                   help="port of `mitmdump -s addons/polar_capture.py` on 127.0.0.1 (omit: no proxy)")
    p.add_argument("--rollout", default=None, help="rollout id, sent as the proxy user name")
    p.add_argument("--ca-cert", default=None,
                   help="mitmproxy CA certificate (default: ~/.mitmproxy/mitmproxy-ca-cert.pem)")
    p.add_argument("--home", default=None,
                   help="private HOME/config dir: new, empty or one an earlier run made (default: a new temporary dir)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the session is killed")
    p.add_argument("--freeform-apply-patch", action="store_true",
                   help="codex only: describe the model in a model catalog so Codex offers its freeform "
                        "apply_patch tool (with a short system prompt of ours)")
    p.set_defaults(func=_run)


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


def _run(args: argparse.Namespace) -> int:
    from ..cli import UserError
    from . import DEFAULT_API_KEY, Harness, HarnessError, ModelServer, Proxy, get_harness
    from .base import absolute, check_timeout

    try:
        check_timeout(args.timeout, "--timeout")
        server = ModelServer(args.server, args.model, os.environ.get("POLAR_API_KEY") or DEFAULT_API_KEY)
        proxy = None
        if args.proxy_port is not None:
            if not 0 < args.proxy_port < 65536:
                raise UserError("--proxy-port must be in 1..65535")
            if not args.rollout:
                raise UserError("--proxy-port needs --rollout (the id the calls are recorded under)")
            ca = Path(args.ca_cert or Path.home() / ".mitmproxy" / "mitmproxy-ca-cert.pem")
            proxy = Proxy(args.proxy_port, args.rollout, ca)  # made absolute there
        elif args.rollout or args.ca_cert:
            raise UserError(f"{'--rollout' if args.rollout else '--ca-cert'} needs --proxy-port")
        options = {}
        if args.freeform_apply_patch:
            if args.name != "codex":
                raise UserError("--freeform-apply-patch is a Codex option")
            options["freeform_apply_patch"] = True
        # relative to the caller, not to the work directory the harness runs in
        if args.home is not None and not args.home.strip():
            raise HarnessError("--home is empty: name a folder, or leave it out for a temporary one")
        workdir = Harness.check_inputs(args.workdir, args.prompt, args.home)
        home = absolute(args.home) if args.home else None
        _check_listening(server.base_url, "the model server")
        if proxy is not None:
            _check_listening(f"http://{proxy.host}:{proxy.port}", "the proxy (mitmdump -s addons/polar_capture.py)")
        run = get_harness(args.name, **options).run(workdir, args.prompt, server, proxy, home, args.timeout)
    except HarnessError as exc:
        raise UserError(str(exc)) from None
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    if not run.ok:  # the temporary home stays: its logs and session files say what happened
        print(f"polar-train harness: {run.harness} exited "
              f"{run.returncode}{' (timed out)' if run.timed_out else ''} after {run.seconds:.1f}s "
              f"(home: {run.home})", file=sys.stderr)
        return run.returncode if run.returncode > 0 else 1
    if home is None:  # one temporary home per session would pile up over a training run's rollouts
        shutil.rmtree(run.home, ignore_errors=True)
    return 0
