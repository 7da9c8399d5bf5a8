"""The ``polar-train`` command: one sub-command per job, each a thin wrapper over a module.

Why argparse with lazy imports: ``polar-train --help`` must answer instantly, while the jobs need
torch/transformers, which take seconds to import.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TextIO

from .paths import user_path
from .terminal import escape_unencodable_output, printable


class UserError(Exception):
    """An error caused by the user's input: printed as one clear line, exit code 2, no traceback."""


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from .tiny_model import MAX_FINAL_NORM_WEIGHT, TinyModelSpec, write_tiny_model
    from .tiny_model import holds_other_files as holds_other_model_files

    if not args.dir.strip():  # Path("") is the current folder, which other commands refuse to guess
        raise UserError('DIR is empty: name the folder ("." for the current one)')
    target = Path(args.dir).expanduser()
    if target.exists() and not target.is_dir():
        raise UserError(f"{target} exists and is not a folder")
    if not 0 < args.final_norm_weight <= MAX_FINAL_NORM_WEIGHT:  # inf: logits inf, NaN probabilities
        raise UserError(f"--final-norm-weight: more than 0 and at most {MAX_FINAL_NORM_WEIGHT:g}, "
                        f"got {args.final_norm_weight:g}")
    if not 0 <= args.seed < 2**63:  # torch's seed is an int64: refused here, before the folder exists
        raise UserError(f"--seed: 0 to {2**63 - 1}, got {args.seed}")
    spec = TinyModelSpec(seed=args.seed, final_norm_weight=args.final_norm_weight)
    from safetensors import SafetensorError

    try:
        if holds_other_model_files(target):
            # a real model's folder named by mistake would lose its config and weights
            raise UserError(f"{target} is not empty and holds no tiny model of ours: choose a new or empty folder")
        out = write_tiny_model(target, spec)
    except (OSError, SafetensorError) as exc:  # safetensors' own error for a full disk
        reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else
                  (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        raise UserError(f"cannot write the tiny model to {target}: {reason}; the folder is as it was") from None
    print(f"wrote tiny model to {out}")
    return 0


def _add_tiny_model(sub: argparse._SubParsersAction) -> None:
    from .tiny_model import MAX_FINAL_NORM_WEIGHT  # (light: the demo's options name it too)

    p = sub.add_parser("tiny-model", help="write a tiny random Qwen3 model with the Qwen3.5 tokenizer")
    p.add_argument("dir", type=user_path, help="output model directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--final-norm-weight", type=float, default=1.0,
                   help="initial weight of the final RMSNorm (larger = sharper random policy; more than 0, at "
                        f"most {MAX_FINAL_NORM_WEIGHT:g}; default: 1)")
    p.set_defaults(func=_cmd_tiny_model)


def _cmd_addon(args: argparse.Namespace) -> int:
    from .installed import NotInstalled, addon_script

    try:
        print(addon_script())
    except NotInstalled as exc:
        raise UserError(str(exc)) from None
    return 0


def _add_addon(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("addon", help="print the path of the capture addon script, for mitmdump -s",
                       description='print the path of the capture addon script: mitmdump -s "$(polar-train addon)" '
                                   "--set polar_out=DIR ... (in a checkout it is addons/polar_capture.py)")
    p.set_defaults(func=_cmd_addon)


#: Sub-commands register here: (module path, function name) of an ``add_parser(sub)`` function.
_LAZY_COMMANDS: list[tuple[str, str]] = [
    ("polar_train.server.cli", "add_parser"),
    ("polar_train.inspect", "add_parser"),
    ("polar_train.build_cli", "add_parser"),
    ("polar_train.train.cli", "add_parser"),
    ("polar_train.demo", "add_parser"),
    ("polar_train.harnesses.cli", "add_parser"),
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="polar-train",
        description="RL training for coding agents without changing the agent: capture (mitmproxy addon), "
                    "build trajectories, train GRPO + LoRA.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tiny_model(sub)
    _add_addon(sub)
    for module, fn in _LAZY_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a sub-command not built yet
            if exc.name and exc.name.startswith("polar_train"):
                continue
            raise
        adder: Callable[[argparse._SubParsersAction], None] = getattr(mod, fn)
        adder(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-command's own parser (its usage, its ``polar-train CMD`` name)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _unrecognized(command: str, extra: list[str]) -> str:
    message = f"unrecognized arguments: {' '.join(extra)}"
    if command in ("build", "inspect") and not extra[0].startswith("-"):
        message += ("; one capture folder per command: put several under one parent folder (every folder "
                    "below it is read)")
    return message


class _Unwinding:
    """Signal handlers for a command's run. SIGTERM (``kill``, ``timeout``, a job scheduler)
    unwinds like Ctrl-C: the ``finally`` blocks that stop a command's child processes (the demo's
    server and proxy, a harness session, a benchmark's proxies, all in sessions of their own) run,
    where Python's default would leave them running. A second signal while those blocks run is
    noted, not raised: it used to cut the clean-up short and leave the children behind. A third
    quits at once, for a clean-up that hangs."""

    def __init__(self, program: str = "polar-train") -> None:
        self.signals = 0
        self.program = program  # who says it: the benchmarks are scripts of their own

    def __call__(self, signum: int, frame: object) -> None:
        self.signals += 1
        if self.signals == 2:
            print(f"{self.program}: still stopping child processes and removing temporary files; "
                  "interrupt once more to quit at once (leaving them)", file=sys.stderr, flush=True)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


#: The signals that stop a command by unwinding it (its clean-up runs), each with exit 128 + N.
UNWINDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _sigterm_unwinds(program: str = "polar-train") -> Iterator[None]:
    """:class:`_Unwinding` for the block (from the main thread only: the one that may set it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _Unwinding(program)
    # SIGHUP too (the terminal closed, an ssh session dropped): the children, in sessions of their own,
    # never get it, and Python's default skipped the clean-up: the demo's server and proxy ran on, the
    # proxy's CA key left in /tmp. A signal the caller ignores (nohup, a background job's SIGINT) stays so.
    previous = {s: signal.signal(s, handler) for s in UNWINDING_SIGNALS
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)


def run_script(main_function: Callable[[], int | None]) -> int:
    """Run a script's ``main`` (the benchmarks') as the CLI runs a command: SIGTERM unwinds like
    Ctrl-C, so the ``finally`` blocks that stop its child processes and remove its temporary
    folders run (Python's default skips them), and an interrupt ends with one line, not a
    traceback. Returns the exit status."""
    with _sigterm_unwinds(Path(sys.argv[0]).name or "polar-train"):
        try:
            return int(main_function() or 0)
        except UserError as exc:  # e.g. a model folder the trainer refuses, in bench/train_step.py
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, SystemExit) as exc:  # SIGTERM as SystemExit(143): it ended unsaid
            status = signal_status(exc)
            if status is None:
                raise
            print(f"interrupted ({signal_name(status)})", file=sys.stderr)
            return status


def main(argv: Sequence[str] | None = None) -> int:
    """``polar-train ARGS`` from Python: the command's exit status. A Ctrl-C (or SIGTERM) that
    stops the command, once it has cleaned up and said so, reaches the caller as its
    ``KeyboardInterrupt`` (``SystemExit``): a notebook's loop over captures stops, where a returned
    130 let it run on. A usage error (an unknown option, a missing argument) is said on stderr and
    returned as 2 (argparse's ``SystemExit`` escaped a caller that read the status); paths may be
    ``Path`` objects."""
    if isinstance(argv, (str, bytes)):  # iterated, "build" was the commands b, u, i, ...
        raise TypeError(f"argv: a list of arguments, e.g. ['inspect', 'captures'], not one string: {argv!r}")
    if argv is not None:
        argv = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv]
    return _main(argv, keep_signal=True)


def _main(argv: Sequence[str] | None, keep_signal: bool) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the command's parser (argparse's top-level one said "polar-train: error")
            _command_parser(parser, args.command).error(_unrecognized(args.command, extra))
    except SystemExit as exc:  # argparse's: a usage error said (2), or --help printed (0)
        if not keep_signal:
            raise
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    with _sigterm_unwinds(f"polar-train {args.command}"):  # (a second signal's note names the command)
        return _run_command(args, keep_signal)


def program(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``polar-train`` program (its console script, ``python -m polar_train.cli``, and
    ``python -m polar_train.train``): :func:`main`, then the process ends. Only here is a signal
    after the command answered with the command's status (:func:`_finish_on_signal`): a caller
    of :func:`main` (a script, a notebook) keeps its own Ctrl-C."""
    escape_unencodable_output()
    if sys.stdout is not None:
        sys.stdout = _GuardedOutput(sys.stdout)
    try:
        status = _main(argv, keep_signal=False)
    except OutputError as failed:  # argparse's help, written to a full disk
        _say_lost(failed)
        sys.exit(1)
    except SystemExit as exc:  # argparse's own exits: --help (0), a usage error (2)
        if _output_lost():  # `--help > /dev/full` lost the help, and exit 0 said nothing
            sys.exit(exc.code if isinstance(exc.code, int) and exc.code else 1)
        raise
    if _output_lost():  # what a command printed before it failed or was interrupted: said too
        status = status or 1
    _finish_on_signal(status)
    sys.exit(status)


def _output_lost() -> bool:
    """Flush the program's stdout; where what it held cannot be written, say so (one line)."""
    try:
        _flush_output()
    except OutputError as failed:
        _say_lost(failed)
        return True
    return False


def _say_lost(failed: OutputError) -> None:
    print(f"polar-train: error: {failed}", file=sys.stderr)


class _GuardedOutput:
    """The program's stdout: a write the system refuses (a full disk behind ``>``) raises
    :class:`OutputError` - one line and exit 1 from any command - where the commands that print
    along the way (``addon``, ``tiny-model``, ``train``, ``demo``) ended in a traceback. From
    then on stdout goes nowhere (Python's own flush at exit stays quiet). A reader that left
    (``| head``) is still a BrokenPipeError, each command's to take."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._refused(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._refused(exc) from None

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def _refused(self, exc: OSError) -> OutputError:
        _to_devnull(self._stream)
        return OutputError(f"cannot write the result to standard output: {exc.strerror or exc}")

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, reconfigure, ...
        if name == "_stream":  # a copy (copy.copy) has none yet: no endless lookup
            raise AttributeError(name)
        return getattr(self._stream, name)


def _flush_output() -> None:
    """Flush stdout now, while a failure can still be said (:class:`_GuardedOutput`); a reader
    that left is no failure: stdout goes nowhere from here on. (No stdout at all - started with
    it closed, ``>&-`` - is None: nothing to flush.)"""
    if sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _to_devnull(sys.stdout)


def _to_devnull(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null: what it still holds goes nowhere, quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):
        pass


class OutputError(Exception):
    """A command's result could not be written to standard output (a full disk behind ``>``)."""


def _finish_on_signal(status: int) -> None:
    """The command's work is done and said; the interpreter's teardown (freeing a build's arrays,
    pyarrow's and torch's pools) takes up to half a second. A SIGTERM or Ctrl-C then ended the
    process with 143 and no line after "wrote N trajectories": a finished build read as failed by
    the script that sent it. It now ends with the command's own status."""
    def finish(signum: int, frame: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, OutputError):
                pass
        os._exit(status)

    if threading.current_thread() is threading.main_thread():
        for s in UNWINDING_SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, finish)


def said_interrupted(exc: BaseException) -> BaseException:
    """Mark an interrupt whose command printed its own line (what is left, how to go on), so the
    CLI adds none; returns ``exc`` for ``raise said_interrupted(exc)``."""
    exc.polar_said = True  # type: ignore[attr-defined]
    return exc


def signal_status(exc: BaseException) -> int | None:
    """The exit status of an interrupt: 130 for Ctrl-C, 128 + N for :class:`_Unwinding`'s
    ``SystemExit`` of signal N; None for any other exit (not a signal: not the caller's to report)."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code > 128:
        return exc.code
    return None


def signal_name(status: int) -> str:
    """``SIGTERM`` for 143: the signal an interrupt's exit status stands for."""
    try:
        return signal.Signals(status - 128).name
    except ValueError:
        return f"signal {status - 128}"


def _run_command(args: argparse.Namespace, keep_signal: bool = False) -> int:
    try:
        status = int(args.func(args) or 0)
        if isinstance(sys.stdout, _GuardedOutput):  # the program's: what is still buffered fails here, said
            _flush_output()
        return status
    except (KeyboardInterrupt, SystemExit) as exc:
        status = signal_status(exc)
        if status is None:
            raise
        if not getattr(exc, "polar_said", False):  # stopped while importing, checking or loading:
            # a word, not a silent 130 (docs promise one line)
            print(f"polar-train {args.command}: interrupted ({signal_name(status)})"
                  + ("; its rounds so far are left unfinished: run the demo again to start over (the train "
                     "line above, if any, is of one step inside it)" if args.command == "demo" else ""),
                  file=sys.stderr, flush=True)
        if keep_signal:  # a caller in Python: its own Ctrl-C, after the command's clean-up and its line
            raise (KeyboardInterrupt() if status == 128 + signal.SIGINT else SystemExit(status)) from None
        return status
    except OutputError as exc:  # the work is done (a build's --out written): not the input's fault
        print(f"polar-train {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (UserError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
            ValueError) as exc:  # one line: a path or id in it (a file's name, a labels file's) printed escaped
        print(f"polar-train {args.command}: error: {printable(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError as exc:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # `polar-train CMD | head`: the reader left; no traceback, as a shell's SIGPIPE
            _to_devnull(sys.stdout)  # Python's own flush at exit
            return 128 + signal.SIGPIPE
        print(f"polar-train {args.command}: error: {exc}", file=sys.stderr)  # another pipe (a child, a socket)
        return 1


def print_out(text: str) -> None:
    """Print a command's result after its work is done (a build's table): a reader that left
    (``| head``) is not an error then, and stdout goes nowhere from here on."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _to_devnull(sys.stdout)
    except OSError as exc:  # `> /dev/full`, a full disk: said in one line; Python's flush at exit stays quiet
        _to_devnull(sys.stdout)
        raise OutputError(f"cannot write the result to standard output: {exc.strerror or exc}") from None


if __name__ == "__main__":
    # run as polar_train.cli, not as __main__: the commands raise polar_train.cli.UserError, which
    # this file's own copy (__main__.UserError) would not catch (a traceback, exit 1)
    from polar_train.cli import program as _program

    _program()
