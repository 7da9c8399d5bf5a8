"""The storage, builder and trainer benchmarks still run end to end at a tiny size, each checking
what it checks itself, and refuse bad arguments with a message (no numbers asserted: speed
targets live in the benchmarks, not in tests)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from tests.support.procs import REPO

pytestmark = pytest.mark.timeout(300)


def cap_memory() -> None:
    """4 GiB of address space: a size that slips past a check ends in a MemoryError, not a full machine."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def bench(script: str, *args: str, capped: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          timeout=280, cwd=REPO, preexec_fn=cap_memory if capped else None)


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
    # the per-token and Mtok/s columns include the write, which "build s" leaves out: the note says so
    assert "ns/... tok and Mtok/s take build s + write s" in proc.stdout, proc.stdout


def test_build_bench_counts_a_session_s_input_in_closed_form() -> None:
    """The size check needs each session's input up front, in closed form (a loop over a huge --turns
    took minutes before the refusal): it must equal the turn-by-turn sum."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_build", REPO / "bench" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)  # not `import build`: pypa's build package has that name
    per_turn = build.COMPLETION_TOKENS + build.GLUE_TOKENS
    for turns in (1, 2, 10, 999, 1000):
        assert build.input_per_session(turns) == sum(build.SYSTEM_TOKENS + k * per_turn + build.COMPLETION_TOKENS
                                                     for k in range(turns))
    assert build.input_per_session(1000) == 50_390_000  # the documented table's 1,000-turn row


def test_train_step_bench_splits_a_step() -> None:
    proc = bench("train_step.py", "--groups", "1", "--group-size", "2", "--tokens", "8", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step total" in proc.stdout and "OUTSIDE forward/backward" in proc.stdout, proc.stdout


def test_train_step_help_says_the_second_turn_samples_half() -> None:
    """The sampler is given (tokens, tokens // 2): the help said "per turn"."""
    proc = bench("train_step.py", "--help")
    assert proc.returncode == 0 and "tokens sampled in the first turn, half as many in the" in proc.stdout, proc.stdout


@pytest.mark.parametrize("script,args,message", [
    ("storage.py", ["--turns", "0"], "--turns: at least 1, got 0"),
    ("storage.py", ["--rows-per-part", "8", "0"], "--rows-per-part: at least 1, got 0"),
    ("build.py", ["--turns", "10", "0"], "--turns: at least 1 each, got 0"),
    ("build.py", ["--min-input-tokens", "0"], "--min-input-tokens: more than 0"),
    ("build.py", ["--min-input-tokens", "inf"], "--min-input-tokens: more than 0 and at most 1e9, got inf"),
    # sizes that cannot fit in memory (MemoryError tracebacks): one session of ~2e10 prompt ids; 1e9
    # input tokens of short sessions (~25 GB at the peak); the same in compact storage; a --turns whose
    # session count took minutes before it was refused
    ("build.py", ["--turns", "20000"], "--turns 20000: these sizes make about 2e+10 input tokens; at most 3.2e+08 "
                                       "fit in memory (~25 bytes each at the peak, 8 GB)"),
    ("build.py", ["--turns", "10", "--min-input-tokens", "1e9"], "--turns 10: these sizes make about 1e+09 input "
                                                                 "tokens; at most 3.2e+08 fit in memory"),
    ("build.py", ["--turns", "20000", "--compact"], "at most 1.3e+09 fit in memory (~6 bytes each at the peak"),
    ("build.py", ["--turns", "10", "1000000000"], "--turns 1000000000: these sizes make about 5e+19 input tokens"),
    ("cold_cache.py", ["--pauses", "0", "nan"], "--pauses: start with 0"),
    ("storage.py", ["--system", "99999999999"], "at most 5e8 fit in memory"),  # was a 745 GiB MemoryError
    ("cold_cache.py", ["--pauses", "0", "inf"], "--pauses: start with 0"),
    ("train_step.py", ["--steps", "1"], "--steps: at least 2, got 1"),
    ("train_step.py", ["--group-size", "1"], "--group-size: at least 2, got 1"),
    ("train_step.py", ["--model", "/nonexistent-model-dir"], "is not a model folder"),
])
def test_bad_arguments_are_refused(script: str, args: list[str], message: str) -> None:
    proc = bench(script, *args, capped=True)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_train_step_names_a_model_that_does_not_load(tmp_path) -> None:
    """A folder with a config.json but no weights passed the check and ended in a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    proc = bench("train_step.py", "--groups", "1", "--group-size", "2", "--tokens", "4", "--model", str(tmp_path))
    assert proc.returncode == 2 and f"error: --model {tmp_path}: cannot load it (" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
