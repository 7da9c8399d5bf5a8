"""``polar-train demo``: its cheap pieces. The whole demo (capture → build → train → capture again,
several minutes on CPU) is too slow for CI; ``docs/demo.md`` records a measured run. Here: the
verifier, the command line, the tiny-model reuse rule, and one real capture round (our server,
real ``mitmdump`` with the capture addon) with the smallest sizes."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_train.cli import build_parser, main
from polar_train.demo import (MAX_FINAL_NORM_WEIGHT, MAX_LEARNING_RATE, MAX_TOKENS, MODEL_LEN, DemoConfig, TASKS,
                              _built_spec, _check, capture_round, latin_share)

POLAR = Path(sys.executable).parent / "polar-train"


@pytest.mark.parametrize("text, share", [
    ("", 0.0),
    ("hello world", 1.0),
    ("Hello, World", 11 / 12),
    ("你好", 0.0),
    ("ab12", 0.5),
    ("héllo", 0.8),
])
def test_latin_share_counts_ascii_letters_and_spaces(text: str, share: float) -> None:
    assert latin_share(text) == pytest.approx(share)


def test_demo_help_lists_the_options_with_their_defaults() -> None:
    done = subprocess.run([str(POLAR), "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    d = DemoConfig()
    for option in ("--workdir", "--rounds", "--group-size", "--max-tokens", "--train-steps",
                   "--learning-rate", "--final-norm-weight"):
        assert option in done.stdout
    text = " ".join(done.stdout.split())  # argparse wraps the help lines
    for default in (d.workdir, d.rounds, d.group_size, d.max_tokens, d.train_steps, f"{d.learning_rate:g}",
                    f"{d.final_norm_weight:g}"):
        assert f"default: {default}" in text, default
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--rounds", "-1"], "--rounds: at least 0, got -1"),
    (["--group-size", "1"], "--group-size: at least 2, got 1"),
    (["--max-tokens", "0"], "--max-tokens: at least 1, got 0"),
    (["--train-steps", "0"], "--train-steps: at least 1, got 0"),
    (["--learning-rate", "0"], "--learning-rate: more than 0, got 0"),
    (["--final-norm-weight", "nan"], "--final-norm-weight: more than 0, got nan"),
])
def test_bad_settings_are_refused_before_anything_starts(tmp_path: Path, args: list[str], message: str) -> None:
    work = tmp_path / "demo"
    done = subprocess.run([str(POLAR), "demo", "--workdir", str(work), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and f"polar-train demo: error: {message}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not work.exists()  # nothing was built or captured


@pytest.mark.parametrize("args, message", [
    # each was accepted and failed late: inf trained after a whole capture round, a norm weight of
    # inf made a model whose server answered 500, 99999999 tokens after the model and server started
    (["--learning-rate", "inf"], "--learning-rate: at most 1, got inf"),
    (["--learning-rate", "1e300"], "--learning-rate: at most 1, got 1e+300"),
    (["--learning-rate", "1.0000001"], "--learning-rate: at most 1, got 1.0000001"),  # it read "got 1"
    (["--final-norm-weight", "inf"], "--final-norm-weight: at most 100, got inf"),
    (["--final-norm-weight=-inf"], "--final-norm-weight: more than 0, got -inf"),
    (["--learning-rate", "nan"], "--learning-rate: more than 0, got nan"),
    (["--max-tokens", "99999999"], f"--max-tokens: at most {MAX_TOKENS} (the demo serves a {MODEL_LEN}-token "
                                   "context, and a session's second call holds its first reply too), got 99999999"),
    (["--group-size", "-5"], "--group-size: at least 2, got -5"),
])
def test_out_of_range_settings_are_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    work = tmp_path / "demo"
    assert main(["demo", "--workdir", str(work), *args]) == 2
    assert capsys.readouterr().err == f"polar-train demo: error: {message}\n"
    assert not work.exists()


def test_the_largest_settings_in_range_are_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["demo", "--workdir", "~/demo", "--max-tokens", str(MAX_TOKENS),
                                      "--learning-rate", f"{MAX_LEARNING_RATE}",
                                      "--final-norm-weight", f"{MAX_FINAL_NORM_WEIGHT}"])
    assert _check(args) == tmp_path / "demo"  # `~` is the user's home, not a folder named "~"


def test_a_file_as_workdir_is_refused_and_left_alone(tmp_path: Path) -> None:
    work = tmp_path / "notes.txt"
    work.write_text("mine")
    done = subprocess.run([str(POLAR), "demo", "--workdir", str(work)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"polar-train demo: error: --workdir is a file, not a folder: {work}"
    assert work.read_text() == "mine"


def test_a_workdir_on_a_read_only_file_system_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a traceback (OSError: Read-only file system) where build, train and tiny-model said
    one line; and theirs said "permission denied" for a read-only file system."""
    import os
    from types import SimpleNamespace

    from polar_train.cli import UserError

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY))
    args = argparse.Namespace(workdir=str(tmp_path / "demo"), rounds=1, group_size=2, max_tokens=12, train_steps=1,
                              learning_rate=1e-3, final_norm_weight=1.0)
    with pytest.raises(UserError, match=rf"--workdir {tmp_path / 'demo'}: read-only file system \(cannot create it in"):
        _check(args)
    assert not (tmp_path / "demo").exists()


def test_a_model_built_with_another_spec_is_not_reused(tmp_path: Path) -> None:
    assert _built_spec(tmp_path) is None  # nothing there: build
    (tmp_path / "polar_tiny_model.json").write_text("{not json")
    assert _built_spec(tmp_path) is None  # unreadable: build again, no traceback
    (tmp_path / "polar_tiny_model.json").write_text(json.dumps({"final_norm_weight": 8.0}))
    assert _built_spec(tmp_path) == {"final_norm_weight": 8.0}


def test_one_capture_round_records_every_call_and_rewards_every_session(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = DemoConfig(workdir=tmp_path, group_size=1, max_tokens=2)
    mean = capture_round(cfg, tiny_model_dir, None, tmp_path / "round0", 0)
    rewards = [json.loads(line) for line in (tmp_path / "round0" / "rewards.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in rewards) == sorted(t for t, _ in TASKS)
    assert all(0.0 <= r["reward"] <= 1.0 for r in rewards)
    assert mean == pytest.approx(sum(r["reward"] for r in rewards) / len(rewards))
    parts = sorted((tmp_path / "round0" / "captures").rglob("*.parquet"))
    assert parts, "the capture addon wrote no Parquet part"
    calls = [row for part in parts for row in pq.read_table(part).to_pylist()]
    assert len(calls) == 2 * len(TASKS)  # two model calls per session, each recorded once
    assert {c["rollout_id"] for c in calls} == {r["rollout_id"] for r in rewards}
    # mitmproxy's CA private key is not left in the workdir (the reverse proxy needs no CA)
    assert not [p for p in tmp_path.rglob("mitmproxy-ca*")], sorted(tmp_path.rglob("*"))


def test_a_round_serves_the_adapter_under_a_name_of_its_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Every round was served as `tiny`, adapters too: round 1's calls and train's `data: sampled by`
    line could not tell the base from round 0's adapter (docs/train.md: serve each under its own
    name; a probe)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    adapter = tmp_path / "round0" / "run" / "adapter"
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(str(adapter))
    cfg = DemoConfig(workdir=tmp_path, group_size=1, max_tokens=2)
    capture_round(cfg, tiny_model_dir, adapter, tmp_path / "round1", 1)
    calls = [row for part in sorted((tmp_path / "round1" / "captures").rglob("*.parquet"))
             for row in pq.read_table(part).to_pylist()]
    assert len(calls) == 2 * len(TASKS) and {c["model"] for c in calls} == {"round0-adapter"}
    assert {c["status"] for c in calls} == {"ok"}


@pytest.mark.parametrize("files", [
    {"round0/results.csv": "mine"},
    # a file merely named demo_summary.json made any folder an earlier demo's: its round<N>/ deleted (a probe)
    {"demo_summary.json": '{"my": "results"}', "round0/notes.txt": "my notes"},
    # a copy of data/samples/demo: a demo's summary, beside folders no demo writes
    {"demo_summary.json": '{"mean_reward_by_round": [0.1], "config": {}}', "captures/part-0.parquet": "x"},
])
def test_a_workdir_holding_other_files_is_refused_and_left_alone(tmp_path: Path, files: dict[str, str]) -> None:
    # the demo replaces round<N>/, tiny-model/ and its summary in its workdir: someone's would be lost
    work = tmp_path / "project"
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    done = subprocess.run([str(POLAR), "demo", "--workdir", str(work)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"polar-train demo: error: --workdir {work} is not empty and holds no earlier "
                                   "demo (no .polar-demo marker): give a new or empty folder")
    assert {str(p.relative_to(work)): p.read_text() for p in work.rglob("*") if p.is_file()} == files


def test_a_demo_folder_from_before_the_marker_is_still_taken(tmp_path: Path) -> None:
    """Demos before 2026-12-04 left no .polar-demo: their summary (by its keys) or tiny model, with
    nothing a demo does not write, says the folder is one."""
    from polar_train.demo import _check

    args = argparse.Namespace(workdir=str(tmp_path / "old"), rounds=1, group_size=2, max_tokens=12, train_steps=1,
                              learning_rate=1e-3, final_norm_weight=1.0)
    (tmp_path / "old" / "round0").mkdir(parents=True)
    (tmp_path / "old" / "demo_summary.json").write_text('{"mean_reward_by_round": [0.1], "seconds": 3, "config": {}}')
    assert _check(args) == tmp_path / "old"
    (tmp_path / "old" / "demo_summary.json").unlink()
    (tmp_path / "old" / "tiny-model").mkdir()
    (tmp_path / "old" / "tiny-model" / "polar_tiny_model.json").write_text("{}")
    assert _check(args) == tmp_path / "old"


def test_sigterm_stops_the_demo_and_the_server_and_proxy_it_started(tmp_path: Path) -> None:
    # `timeout`, `kill` or a scheduler stop the demo with SIGTERM; its server and proxy run in
    # sessions of their own (Ctrl-C in a terminal must not reach them first), so the demo itself
    # must stop them, as it does on Ctrl-C, instead of leaving them listening
    import signal
    import time

    import psutil

    proc = subprocess.Popen([str(POLAR), "demo", "--workdir", str(tmp_path / "demo"), "--group-size", "2",
                             "--max-tokens", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    demo = psutil.Process(proc.pid)

    def command_lines() -> dict[psutil.Process, str]:
        found = {}
        for child in demo.children():
            try:
                found[child] = " ".join(child.cmdline())
            except psutil.Error:  # a short-lived helper that ended meanwhile
                pass
        return found

    deadline = time.monotonic() + 240
    started: dict[psutil.Process, str] = {}
    while time.monotonic() < deadline and proc.poll() is None and not started:
        found = command_lines()
        if any("mitmdump" in line for line in found.values()):  # the proxy starts after the server
            started = found
        else:
            time.sleep(0.2)  # polling for the proxy to appear
    try:
        assert any("polar_train.cli serve" in line for line in started.values()), (started, proc.poll())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(list(started), timeout=60)
        assert not alive, f"left running: {[started[p] for p in alive]}"
    finally:  # a failure leaves nothing behind in the test run either
        for child in [proc, *started]:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                child.kill()


def test_each_step_is_echoed_as_the_command_a_user_types(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The demo runs ``polar-train`` as ``python -m polar_train.cli`` (any install, its own
    interpreter), and echoed that; the user reads the command they would type."""
    import polar_train.demo as demo
    from polar_train.installed import polar_train_command

    ran: list[list[str]] = []
    monkeypatch.setattr(demo.subprocess, "call", lambda args, env: ran.append(args) or 0)
    demo._run([*polar_train_command(), "build", "caps", "--out", "traj"], "polar-train build")
    demo._run(["/usr/bin/true", "x"], "true")
    assert capsys.readouterr().out == "  $ polar-train build caps --out traj\n  $ true x\n"
    assert ran[0][:3] == [sys.executable, "-m", "polar_train.cli"]


def test_a_rerun_starts_without_the_earlier_runs_results(tmp_path: Path) -> None:
    """``--rounds 0`` after a run of two left round1/ and round2/, captured by adapters it replaced;
    an interrupted rerun left the earlier run's summary and later rounds beside its own half round."""
    from polar_train.demo import remove_earlier_results

    for name in ("round0", "round1", "round2", "round10", "tiny-model", "roundabout"):
        (tmp_path / name).mkdir()
    (tmp_path / "demo_summary.json").write_text("{}")
    (tmp_path / ".polar-demo").touch()
    remove_earlier_results(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".polar-demo", "roundabout", "tiny-model"]


def test_a_server_that_drops_the_call_is_one_line_not_a_traceback() -> None:
    """A proxy restarting mid-call (its addon reloaded) closed the connection without an answer:
    the demo ended in http.client's RemoteDisconnected traceback."""
    import socket
    import threading

    from polar_train.cli import UserError
    from polar_train.demo import post_json

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def drop_one() -> None:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.close()

        threading.Thread(target=drop_one, daemon=True).start()
        with pytest.raises(UserError, match=rf"^POST http://127.0.0.1:{port}/v1/chat/completions failed: Remote end "
                                            r"closed connection without response \(see the server and proxy logs"):
            post_json(f"http://127.0.0.1:{port}/v1/chat/completions", {"x": 1}, timeout=10)
