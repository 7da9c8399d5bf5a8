"""A command's clean-up (stopping its child processes, removing its temporary folders) runs to
the end even when Ctrl-C or SIGTERM comes again while it runs; a third signal quits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.procs import REPO, signals_as_by_default

# main() waits until interrupted; its clean-up then waits for a line on stdin, which the test sends
# only once the second signal has been handled: the signal arrives in the middle of the clean-up.
# The script waits in select() on a signal wake-up pipe as well: a signal that came just before a
# blocking read() began would otherwise wait for the next signal, and the test with it (a CI run
# once hung there until its time ran out).
SCRIPT = textwrap.dedent("""
    import os, select, signal, sys
    from polar_train.cli import run_script

    def wait_for(fd):
        \"\"\"Block until fd is readable (never, for None); a signal's handler runs on the way.\"\"\"
        watched = [woken] + ([fd] if fd is not None else [])
        while fd not in select.select(watched, [], [])[0]:
            os.read(woken, 512)  # the wake-up byte: the handler has run (or raised) by now

    def main():
        try:
            print("ready", flush=True)
            wait_for(None)
        finally:
            print("cleaning", flush=True)
            wait_for(sys.stdin.fileno())
            sys.stdin.readline()
            print("cleaned", flush=True)

    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    sys.exit(run_script(main))
""")


def _start() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=signals_as_by_default)  # (under nohup or as a background job: its hang-up or interrupt case hung)
    assert proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize("first,second,code", [
    (signal.SIGINT, signal.SIGINT, 130),
    (signal.SIGTERM, signal.SIGINT, 128 + signal.SIGTERM),
    (signal.SIGTERM, signal.SIGTERM, 128 + signal.SIGTERM),
    # the terminal closed: Python's default skipped the clean-up (the demo's server and proxy ran on)
    (signal.SIGHUP, signal.SIGTERM, 128 + signal.SIGHUP),
])
def test_a_second_signal_does_not_cut_the_clean_up_short(first, second, code) -> None:
    proc = _start()
    try:
        proc.send_signal(first)
        assert proc.stdout.readline() == "cleaning\n"
        proc.send_signal(second)
        assert "still stopping child processes" in proc.stderr.readline()
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "cleaned\n"  # it used to end here with a traceback
        assert proc.wait(60) == code
    finally:
        proc.kill()
        proc.wait()


def test_a_third_signal_quits_at_once() -> None:
    proc = _start()
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "cleaning\n"
        proc.send_signal(signal.SIGINT)
        assert "interrupt once more to quit at once" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130  # without the line on stdin: the clean-up was given up
        assert proc.stdout.read() == "" and "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_a_signal_after_the_command_finished_keeps_its_status() -> None:
    """A SIGTERM in the interpreter's teardown (half a second after a build's "wrote N
    trajectories") ended the process with 143: a finished build read as failed by its script.
    Only the program ends so: a script that calls ``main`` keeps its own signals."""
    script = textwrap.dedent("""
        import atexit, signal, sys
        from polar_train import cli
        status = cli.main(["inspect", "data/samples/demo/captures"])
        print("main", status, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
        atexit.register(lambda: signal.raise_signal(signal.SIGTERM))  # as if sent while it winds down
        cli.program(["inspect", "data/samples/demo/captures"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "main 0 True" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_a_caller_in_python_gets_its_ctrl_c_after_the_commands_line(capsys, monkeypatch) -> None:
    """``cli.main`` in a notebook's loop over captures: a Ctrl-C stopped the build (exit status
    130) and the loop ran on to the next one; it now reaches the caller, after the line."""
    from polar_train import cli, inspect

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(inspect, "_cmd_inspect", interrupted)  # (the parser is built per call)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["inspect", "data/samples/demo/captures"])
    assert capsys.readouterr().err.strip() == "polar-train inspect: interrupted (SIGINT)"
    assert cli._main(["inspect", "data/samples/demo/captures"], keep_signal=False) == 130


def test_an_interrupted_harness_session_reaches_a_caller_in_python_too(capsys) -> None:
    """The review: ``harness`` caught its own Ctrl-C and returned 130, so ``cli.main`` in a loop of
    sessions ran on as before the change for the other commands."""
    import argparse

    from polar_train.cli import _run_command
    from polar_train.harnesses.cli import _interrupted

    def interrupted_session(args):
        try:
            raise KeyboardInterrupt  # as Harness.run raises it once it has ended the session
        except KeyboardInterrupt as exc:
            _interrupted(exc, "pi")

    args = argparse.Namespace(command="harness", func=interrupted_session)
    with pytest.raises(KeyboardInterrupt):
        _run_command(args, keep_signal=True)
    assert _run_command(args) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "polar-train harness: interrupted (SIGINT) before the pi session started"] * 2


@pytest.mark.parametrize("exc, status, line", [
    (KeyboardInterrupt(), 130, "polar-train inspect: interrupted (SIGINT)"),
    (SystemExit(128 + signal.SIGTERM), 143, "polar-train inspect: interrupted (SIGTERM)"),
])
def test_an_interrupt_a_command_did_not_report_gets_one_line(exc, status, line, capsys) -> None:
    """Ctrl-C while a command imported, checked or loaded (train's first seconds) and SIGTERM in
    a demo exited 130/143 without a word."""
    import argparse

    from polar_train.cli import _run_command, said_interrupted

    def raising(args):
        raise exc

    assert _run_command(argparse.Namespace(command="inspect", func=raising)) == status
    assert capsys.readouterr().err.strip() == line
    said = said_interrupted(type(exc)(*exc.args))

    def reported(args):
        print("polar-train inspect: interrupted; what is left", file=sys.stderr)
        raise said

    assert _run_command(argparse.Namespace(command="inspect", func=reported)) == status
    assert capsys.readouterr().err.strip() == "polar-train inspect: interrupted; what is left"

    def exits(args):
        raise SystemExit(2)  # no signal: not an interrupt

    with pytest.raises(SystemExit):
        _run_command(argparse.Namespace(command="inspect", func=exits))


def test_a_signal_the_caller_ignores_stays_ignored() -> None:
    """Under ``nohup`` (SIGHUP ignored) a hang-up must not stop the command: the handler that
    unwinds is installed only for signals the caller left to their default."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGTERM)  # delivered after the hang-up: the first to stop it
        assert proc.stdout.readline() == "cleaning\n"
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "cleaned\n"
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_a_terminal_that_cannot_show_a_name_or_a_full_disk_behind_stdout_is_no_input_error(tmp_path) -> None:
    """``PYTHONIOENCODING=ascii`` (or a non-UTF-8 locale) and an ``é`` in ``--out``: the build was done,
    then its table raised UnicodeEncodeError (a ValueError: exit 2, "error", no table); ``> /dev/full``
    ended in a traceback after the build was written."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "tr_é"
    proc = subprocess.run([sys.executable, "-m", "polar_train", "build", "data/samples/demo/captures", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"to {str(out).replace('é', chr(92) + 'xe9')} (report:" in proc.stdout and (out / "part-00000.parquet").is_file()
    # a C locale without UTF-8 mode: stdout's errors are surrogateescape, which raised on an é too
    from tests.support.calls import make_row, write_parts

    write_parts(tmp_path / "cap", [make_row(call_id="c1", rollout_id="café", prompt_ids=[1, 2], completion_ids=[3])])
    c_locale = {k: v for k, v in os.environ.items() if not k.startswith("LC_")} | {
        "LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0", "HF_HUB_OFFLINE": "1"}
    c_locale.pop("PYTHONIOENCODING", None)
    proc = subprocess.run([sys.executable, "-m", "polar_train", "inspect", str(tmp_path / "cap")], capture_output=True,
                          cwd=REPO, env=c_locale, timeout=300)
    assert proc.returncode == 0 and b"caf\\xe9" in proc.stdout, proc.stderr[-2000:]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "polar_train", "inspect", "data/samples/demo/captures"],
                              stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "polar-train inspect: error: cannot write the result to standard output: No space left on device"]


def test_every_command_behind_a_full_disk_ends_in_one_line(tmp_path) -> None:
    """``addon``, ``tiny-model`` and ``train`` print along the way, not through the table printer
    ``inspect`` and ``build`` use: ``> /dev/full`` ended each in a traceback (``tiny-model`` after
    writing its model); ``--help`` lost its text and exited 0, unsaid."""
    runs = {"addon": ["addon"], "tiny-model": ["tiny-model", str(tmp_path / "tiny")], "help": ["--help"],
            "build help": ["build", "--help"]}
    said = {}
    with open("/dev/full", "w") as full:
        for name, args in runs.items():
            proc = subprocess.run([sys.executable, "-m", "polar_train", *args], stdout=full, stderr=subprocess.PIPE,
                                  text=True, cwd=REPO, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            said[name] = (proc.returncode, [line for line in proc.stderr.splitlines() if line and "Writing model shards" not in line])
    line = "error: cannot write the result to standard output: No space left on device"
    assert said == {"addon": (1, [f"polar-train addon: {line}"]), "tiny-model": (1, [f"polar-train tiny-model: {line}"]),
                    "help": (1, [f"polar-train: {line}"]), "build help": (1, [f"polar-train: {line}"])}
    assert (tmp_path / "tiny" / "config.json").is_file()  # its work was done; only the line about it was lost
    proc = subprocess.run(f"{sys.executable} -m polar_train --help | head -1", shell=True, capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.stdout.startswith("usage: polar-train") and proc.stderr == ""  # a reader that left: no error
    proc = subprocess.run(f"{sys.executable} -m polar_train addon >&-", shell=True, capture_output=True, text=True,
                          cwd=REPO, timeout=300)  # no stdout at all (sys.stdout None): as before, quiet
    assert (proc.returncode, proc.stderr) == (0, "")


def test_output_lost_before_a_command_failed_is_said_too(tmp_path) -> None:
    """A command that printed (buffered: stdout is a file) and then failed: its own error line came,
    and the lost output went unsaid - or, before, Python's "Exception ignored ... OSError" and 120."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import polar_train.cli as cli\n"
        "built = cli.build_parser\n"
        "def build_parser():\n"
        "    parser = built()\n"
        "    def fail(args):\n"
        "        print('half a table')\n"
        "        raise cli.UserError('bad input')\n"
        "    parser._subparsers._group_actions[0].choices['addon'].set_defaults(func=fail)\n"
        "    return parser\n"
        "cli.build_parser = build_parser\n"
        "cli.program(['addon'])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a file's stdout is
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, str(script)], stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env=env, timeout=300)
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [
        "polar-train addon: error: bad input",
        "polar-train: error: cannot write the result to standard output: No space left on device"])
