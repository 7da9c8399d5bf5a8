"""The storage, builder and trainer benchmarks still run end to end at a tiny size, each checking
what it checks itself, and refuse bad arguments with a message (no numbers asserted: speed
targets live in the benchmarks, not in tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.procs import REPO

pytestmark = pytest.mark.timeout(300)


def bench(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          timeout=280, cwd=REPO)


def test_storage_bench_reads_back_what_it_wrote() -> None:
    proc = bench("storage.py", "--turns", "3", "--sessions", "2", "--system", "80", "--completion", "10",
                 "--tool", "10", "--rows-per-part", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("the reader's full prompts and request texts equal the written ones in every configuration (checked)"
            in proc.stdout)
    assert sum(line.startswith("2 | ") for line in proc.stdout.splitlines()) == 4  # {json, not} x {full, compact}


def test_build_bench_times_each_session_length() -> None:
    proc = bench("build.py", "--turns", "2", "5", "--min-input-tokens", "2000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["2"], ["5"])]
    assert [r[0] for r in rows] == ["2", "5"], proc.stdout


def test_train_step_bench_splits_a_step() -> None:
    proc = bench("train_step.py", "--groups", "1", "--group-size", "2", "--tokens", "8", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step total" in proc.stdout and "OUTSIDE forward/backward" in proc.stdout, proc.stdout


@pytest.mark.parametrize("script,args,message", [
    ("storage.py", ["--turns", "0"], "--turns: at least 1, got 0"),
    ("storage.py", ["--rows-per-part", "8", "0"], "--rows-per-part: at least 1, got 0"),
    ("build.py", ["--turns", "10", "0"], "--turns: at least 1 each, got 0"),
    ("build.py", ["--min-input-tokens", "0"], "--min-input-tokens: more than 0"),
    ("build.py", ["--min-input-tokens", "inf"], "--min-input-tokens: more than 0 and at most 1e9, got inf"),
    ("cold_cache.py", ["--pauses", "0", "nan"], "--pauses: start with 0"),
    ("storage.py", ["--system", "99999999999"], "at most 5e8 fit in memory"),  # was a 745 GiB MemoryError
    ("cold_cache.py", ["--pauses", "0", "inf"], "--pauses: start with 0"),
    ("train_step.py", ["--steps", "1"], "--steps: at least 2, got 1"),
    ("train_step.py", ["--group-size", "1"], "--group-size: at least 2, got 1"),
    ("train_step.py", ["--model", "/nonexistent-model-dir"], "is not a model folder"),
])
def test_bad_arguments_are_refused(script: str, args: list[str], message: str) -> None:
    proc = bench(script, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_train_step_names_a_model_that_does_not_load(tmp_path) -> None:
    """A folder with a config.json but no weights passed the check and ended in a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    proc = bench("train_step.py", "--groups", "1", "--group-size", "2", "--tokens", "4", "--model", str(tmp_path))
    assert proc.returncode == 2 and f"error: --model {tmp_path}: cannot load it (" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
