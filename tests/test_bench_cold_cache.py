"""``bench/cold_cache.py`` runs and prints its table (no speed asserted: numbers live in the
benchmark); bad arguments get a usage error, not a traceback."""

from __future__ import annotations

import re
import resource
import subprocess
import sys

from tests.support.procs import REPO

SCRIPT = str(REPO / "bench" / "cold_cache.py")


def test_cold_cache_benchmark_prints_a_row_per_work_with_a_ratio_per_pause() -> None:
    proc = subprocess.run([sys.executable, SCRIPT, "--repeats", "3", "--pauses", "0", "1", "2", "--echo-kb", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "work | 0 ms | 1 ms | 2 ms | 1 ms / loop | 2 ms / loop" in proc.stdout
    for work in ("request", "response.created", "mitmproxy head"):
        row = re.search(rf"^{re.escape(work)} \| (.+)$", proc.stdout, re.M)
        assert row is not None, proc.stdout
        cells = [float(c) for c in row.group(1).split(" | ")]
        assert len(cells) == 5 and all(c > 0 for c in cells)


def test_cold_cache_benchmark_refuses_bad_arguments_with_a_usage_error() -> None:
    for args, message in ((["--pauses", "5", "50"], "--pauses: start with 0"),
                          (["--echo-kb", "0"], "--echo-kb: at least 1"), (["--repeats", "2"], "--repeats: at least 3"),
                          # a 10 GB request: a MemoryError traceback (row_worker and proxy_overhead refused it)
                          (["--echo-kb", "10000000"], "--echo-kb: at most 16384 (16 MiB per request), got 10000000")):
        proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
