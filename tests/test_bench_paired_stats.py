"""The benchmark's verdicts rest on ``bench/paired_stats.py``: its interval must hold the median
as often as it claims, for noise of any shape, and a verdict must follow the interval."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from tests.support.procs import REPO

sys.path.insert(0, str(REPO / "bench"))
from paired_stats import coverage, median_ci, verdict  # noqa: E402


def test_coverage_is_the_binomial_sum():
    assert coverage(5, 1) == pytest.approx(1 - 2 / 32)  # [min, max] of 5
    assert coverage(10, 2) == pytest.approx(1 - 2 * 11 / 1024)
    assert coverage(4, 1) < 0.90 <= coverage(5, 1)
    assert coverage(3, 3) == 0.0  # past the middle: no interval


def test_interval_is_the_narrowest_with_the_asked_coverage():
    xs = [float(i) for i in range(1, 11)]
    random.Random(1).shuffle(xs)
    low, high, cover = median_ci(xs)
    assert (low, high) == (2.0, 9.0) and cover == pytest.approx(0.9785, abs=1e-4)  # k=3 would cover 0.89
    assert median_ci([3.0, float("nan"), 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, pytest.approx(0.9375))


@pytest.mark.parametrize("draw,true_median", [
    (lambda r: r.expovariate(1.0), math.log(2)),          # skewed, like latencies
    (lambda r: r.uniform(0.9, 1.3), 1.1),
    (lambda r: 1.0 + r.gauss(0, 0.2) ** 3, 1.0),         # heavy-ish tails
])
def test_the_interval_holds_the_median_as_often_as_it_claims(draw, true_median):
    rng = random.Random(7)
    for n in (5, 10, 12):
        trials = 3000
        hits = 0
        for _ in range(trials):
            low, high, cover = median_ci([draw(rng) for _ in range(n)])
            hits += low <= true_median <= high
        assert abs(hits / trials - cover) < 0.025, (n, hits / trials, cover)


def test_verdict_follows_the_interval():
    assert verdict(0.96, 0.99, 0.94, 0.95, higher_is_better=True) == "met"
    assert verdict(0.90, 0.94, 0.94, 0.95, higher_is_better=True) == "missed"
    assert verdict(0.93, 0.99, 0.94, 0.95, higher_is_better=True) == "unresolved"
    assert verdict(0.98, 1.04, 0.94, 1.05, higher_is_better=False) == "met"
    assert verdict(1.06, 1.20, 0.94, 1.05, higher_is_better=False) == "missed"
    assert verdict(1.00, 1.10, 0.94, 1.05, higher_is_better=False) == "unresolved"
    assert verdict(0.98, 0.99, 0.75, 0.95, higher_is_better=True) == "too few rounds"


def test_the_script_gives_a_verdict_for_ratios_given_by_hand():
    """A reader checks a table's verdict from its per-round ratios (the script printed nothing)."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "bench" / "paired_stats.py"), *args],
                              capture_output=True, text=True, timeout=60)

    met = run("0.96", "0.97", "0.99", "0.95", "0.98", "--target", "0.95")
    assert met.returncode == 0 and met.stdout.strip().endswith(": met"), met
    assert "[0.950, 0.990]" in met.stdout
    missed = run("1.2", "1.3", "1.1", "1.4", "1.25", "1.3", "--target", "1.05", "--lower-is-better")
    assert missed.stdout.strip().endswith(": missed"), missed
    assert run("1", "2", "--target", "1.5").stdout.strip().endswith(": too few rounds")
    bad = run("1", "nan", "--target", "1")
    assert bad.returncode == 2 and "must be finite" in bad.stderr and "Traceback" not in bad.stderr
    negative = run("-1", "0.97", "0.99", "0.95", "0.98", "--target", "0.95")  # gave "[-1.000, 0.990] unresolved"
    assert negative.returncode == 2 and "finite numbers above 0" in negative.stderr
