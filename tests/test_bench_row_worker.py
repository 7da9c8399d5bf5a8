"""``bench/row_worker.py`` runs and prints its table (no speed asserted: numbers live in the
benchmark); bad arguments get a usage error, not a traceback."""

from __future__ import annotations

import re
import resource
import subprocess
import sys

from tests.support.procs import REPO

SCRIPT = str(REPO / "bench" / "row_worker.py")


def test_row_worker_benchmark_prints_both_paths_per_api_and_size() -> None:
    proc = subprocess.run([sys.executable, SCRIPT, "--repeats", "3", "--request-kb", "0", "4", "--echo-kb", "2",
                           "--tokens", "8"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "api | history KiB | body KiB | re-encoded us | as sent us | as sent / re-encoded" in proc.stdout
    rows = re.findall(r"^(responses|chat) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+)$", proc.stdout, re.M)
    assert [(api, kb) for api, kb, *_ in rows] == [("responses", "0"), ("responses", "4"), ("chat", "0"), ("chat", "4")]
    assert all(int(old) > 0 and int(new) > 0 for *_, old, new, _ in rows)
    assert int(rows[1][2]) > int(rows[0][2])  # the history makes the body larger


def test_row_worker_benchmark_refuses_bad_arguments_with_a_usage_error() -> None:
    for args, message in ((["--repeats", "2"], "--repeats: at least 3"),
                          (["--request-kb", "-1"], "--request-kb and --echo-kb: 0 or more"),
                          (["--tokens", "0"], "--tokens: 1 or more"),
                          (["--echo-kb", "100000000"], "--request-kb and --echo-kb: at most 16384"),  # 1.5 GB, growing
                          (["--tokens", "100000000"], "--tokens: at most 100000 (the stream is built and parsed in "
                                                      "memory, ~5 KB per token), got 100000000")):  # a MemoryError
        proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
