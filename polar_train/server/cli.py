"""``polar-train serve``: argument parsing and start-up (model, optional adapter and script)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import re
import sys
from pathlib import Path

from ..paths import not_a_file, user_path


#: Seconds a Ctrl-C or SIGTERM waits for open streams to end before it cuts them: a request
#: without max_tokens streams up to the context length, and the stop looked hung for minutes.
SHUTDOWN_GRACE_S = 5.0


#: ``--max-model-len auto`` (or -1): the model's ``max_position_embeddings``, as vLLM takes it.
AUTO = -1


def _check_template_compiles(model: Path) -> None:
    """A chat template with a syntax error started a healthy-looking server whose every chat request
    was a 400 blaming the client's messages (a probe): it is the model folder's fault, said before
    the weights load. Read from the files the tokenizer reads it from (``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template``: one text, or named ones)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from ..cli import UserError

    found: dict[str, str] = {}
    if (model / "chat_template.jinja").is_file():
        found["chat_template.jinja"] = (model / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    else:
        try:
            given = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):  # (the tokenizer's loader says what is wrong there)
            given = None
        if isinstance(given, str):
            found["tokenizer_config.json"] = given
        elif isinstance(given, list):
            found.update((f"tokenizer_config.json ({t.get('name')})", t["template"]) for t in given
                         if isinstance(t, dict) and isinstance(t.get("template"), str))
    extra = model / "additional_chat_templates"  # (transformers reads these too: named templates)
    for path in sorted(extra.glob("*.jinja")) if extra.is_dir() else ():
        found[f"additional_chat_templates/{path.name}"] = path.read_text(encoding="utf-8", errors="replace")
    for where, template in found.items():
        try:
            _compile_jinja_template(template)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateSyntaxError (its line), or any compile failure
            line = getattr(exc, "lineno", None)
            raise UserError(f"--model {model}: its chat template ({where}) does not compile"
                            + (f" (line {line})" if line else "") + f": {exc}") from None


def human_readable_int(value: str) -> int:
    """vLLM's ``--max-model-len`` forms: an integer, ``auto`` (or -1: :data:`AUTO`), or a number with a
    decimal (k, m, g, t) or binary (K, M, G, T) suffix - a vLLM command line copied here was refused
    at ``32k`` (a probe)."""
    text = value.strip()
    if text.lower() == "auto":
        return AUTO
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r} (an integer, 32k / 32K, or auto)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to "
                                         f"use {number}{suffix.lower()} instead?")
    return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model on CPU with vLLM's wire format (OpenAI chat, "
                                     "responses, Anthropic messages)")
    p.add_argument("--model", required=True, type=user_path,
                   help="model directory (e.g. from `polar-train tiny-model`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model directory's name)")
    p.add_argument("--ssl-certfile", default=None, type=user_path, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, type=user_path,
                   help="private key of --ssl-certfile (PEM; an encrypted one asks its pass phrase at the terminal)")
    p.add_argument("--script", default=None, type=user_path,
                   help="answer from this scenario file instead of sampling (docs/scenario-format.md)")
    p.add_argument("--adapter", default=None, type=user_path,
                   help="a peft LoRA adapter directory to apply to the model")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of requests that bring none (default: none, a random sample)")
    p.add_argument("--max-model-len", type=human_readable_int, default=4096,
                   help="context length (prompt + completion; vLLM's forms: 32768, 32k = 32,000, 32K = 32,768, auto = "
                        "the model's max_position_embeddings; default: 4096)")
    p.add_argument("--chunk-delay-ms", type=float, default=0.0,
                   help="wait this long between streamed tokens (benchmarks; default: 0)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level; info logs a line per request (default: warning)")
    p.set_defaults(func=_serve)


def _check_model_config(model: Path) -> dict:
    """Refuse a model folder whose config.json is no JSON object before the slow imports."""
    from ..cli import UserError

    try:
        config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{model}/config.json cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UserError(f"{model}/config.json holds no JSON object")
    return config


def _check_can_listen(host: str, port: int) -> None:
    """Bind the address once before the model loads: a port in use or a host that does not
    resolve is one line now, not uvicorn's error after the weights are in memory."""
    import socket

    from ..cli import UserError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _check_tls(certfile: str, keyfile: str) -> str | None:
    """Load the certificate and key once before the model loads: a file that is no PEM, or a key
    that does not belong to the certificate, is one line now, not uvicorn's ``ssl.SSLError``
    traceback after the weights are in memory. An encrypted key's pass phrase is asked here once
    and returned for uvicorn (OpenSSL asked for it at this check and again at uvicorn's)."""
    import getpass
    import ssl
    import warnings

    from ..cli import UserError

    asked: list[str] = []

    def pass_phrase() -> str:
        if not asked:
            try:
                with warnings.catch_warnings(record=True) as said:  # Python's warning quoted its source line
                    warnings.simplefilter("always", getpass.GetPassWarning)
                    asked.append(getpass.getpass(f"pass phrase of --ssl-keyfile {keyfile}: "))
                if any(issubclass(w.category, getpass.GetPassWarning) for w in said):
                    print("polar-train serve: warning: no terminal to hide the pass phrase in: it was read as typed",
                          file=sys.stderr, flush=True)
            except EOFError:
                raise UserError(f"--ssl-keyfile {keyfile} is encrypted and no pass phrase could be read "
                                "(run serve from a terminal, or give a key without a pass phrase)") from None
        return asked[0]

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=pass_phrase)
    except ssl.SSLError as exc:
        if asked:
            raise UserError(f"--ssl-keyfile {keyfile}: the pass phrase does not decrypt the key, or the key "
                            f"does not belong to --ssl-certfile {certfile} ({exc.reason or exc})") from None
        raise UserError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a PEM certificate and its "
                        f"key ({exc.reason or exc})") from None
    except OSError as exc:
        raise UserError(f"cannot read --ssl-certfile {certfile} / --ssl-keyfile {keyfile}: "
                        f"{exc.strerror or exc}") from None
    return asked[0] if asked else None


def _serve(args: argparse.Namespace) -> int:
    from ..cli import UserError

    model = Path(args.model)
    if not (model / "config.json").is_file():
        from ..model_load import run_folder_hint

        adapter = " but a peft adapter: give its base model as --model and this folder as --adapter" if (
            model / "adapter_config.json").is_file() else run_folder_hint(model, "--adapter {}")
        raise UserError(f"{model} is not a model directory (no config.json){adapter}")
    if args.seed is not None and not 0 <= args.seed < 2**63:  # as tiny-model's and a request's (torch: int64)
        raise UserError(f"--seed: 0 to {2**63 - 1}, got {args.seed}")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise UserError("--ssl-certfile and --ssl-keyfile go together")
    for option, f in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if f and (problem := not_a_file(f)) is not None:
            raise UserError(f"{option}: {problem}")
    if args.adapter:
        from ..model_load import ModelLoadError, check_adapter_folder

        try:
            check_adapter_folder(args.adapter)
        except ModelLoadError as exc:
            raise UserError(f"--adapter {exc}") from None
        if args.served_model_name is None:  # each call records the name it asked for: the policy that sampled it
            print(f"polar-train serve: warning: --adapter without --served-model-name serves the adapter as "
                  f"{model.resolve().name!r}, the base model's name: a capture cannot tell its calls from the base "
                  "model's; name it, e.g. --served-model-name r1", file=sys.stderr, flush=True)
    if not 0 <= args.chunk_delay_ms < float("inf"):  # NaN fails too: a stream would never end
        raise UserError(f"--chunk-delay-ms must be a finite number >= 0, got {args.chunk_delay_ms}")
    if not 0 < args.port < 65536:
        raise UserError("--port must be in 1..65535")
    if args.max_model_len < 1 and args.max_model_len != AUTO:
        raise UserError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UserError("--served-model-name is empty: give the name clients send (left out: the model "
                        "folder's name)")  # a model named "" served: a client could name it in no header
    config = _check_model_config(model)
    _check_template_compiles(model)
    longest = config.get("max_position_embeddings")
    if args.max_model_len == AUTO:  # vLLM's auto: the model's own context
        if not (isinstance(longest, int) and not isinstance(longest, bool) and longest > 0):
            raise UserError(f"--max-model-len auto: {model}/config.json names no max_position_embeddings; give a length")
        args.max_model_len = longest
    if isinstance(longest, int) and not isinstance(longest, bool) and 0 < longest < args.max_model_len:
        # vLLM refuses it too: positions past the model's were never trained (its RoPE table ends there)
        raise UserError(f"--max-model-len {args.max_model_len} is above the model's max_position_embeddings "
                        f"({longest}, {model}/config.json): give at most {longest}")
    _check_can_listen(args.host, args.port)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    script = None
    if args.script:
        from .script import Script, ScriptError

        from ..tokenizer import load_tokenizer
        from .script import check_template

        try:
            script = Script.load(args.script)
            try:
                tokenizer = load_tokenizer(model)
            except Exception:  # noqa: BLE001 - the model's loader says what is wrong with it, below
                tokenizer = None
            if tokenizer is not None:
                check_template(tokenizer)
        except ScriptError as exc:
            raise UserError(str(exc)) from None
    # last of the checks: an encrypted key's pass phrase is typed once the cheap checks passed
    key_pass_phrase = _check_tls(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None

    import uvicorn

    from .app import Server, build_app
    from .engine import Engine

    engine = Engine(model, adapter=args.adapter, seed=args.seed, max_model_len=args.max_model_len)
    name = args.served_model_name or model.resolve().name
    app = build_app(Server(engine, name, script, args.chunk_delay_ms))
    from .access_log import log_config

    # vLLM's request lines, their query strings (a client's ?key=...) cut off
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=log_config(),
                            ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                            ssl_keyfile_password=key_pass_phrase, timeout_keep_alive=30,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    from .stopping import StoppingServer

    server = StoppingServer(config)
    # not uvicorn.run, which swallows the Ctrl-C it re-raises after its shutdown (exit 0, no line):
    # here it reaches the CLI, which says "interrupted (SIGINT)" and exits 130, as for SIGTERM 143
    try:
        server.run()
    finally:  # streams cut at the stop: their sampling threads end before the interpreter does
        from .completion import stop_generation

        stop_generation(SHUTDOWN_GRACE_S)
    if server.hung_up:  # after the same graceful stop as SIGTERM's: 129 and the CLI's one line
        raise SystemExit(128 + signal.SIGHUP)
    if not server.started:
        return 1  # uvicorn logged why (the checks before the model loaded foresee the usual causes)
    return 0
