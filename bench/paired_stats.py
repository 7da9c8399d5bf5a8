"""Paired ratios over rounds, with a distribution-free confidence interval for their median.

Why: on a shared 2-core machine one configuration's speed drifts by 20-50 % from round to round
(other processes, CPU frequency), far more than the 5 % a target asks about. Each round measures
the addon and bare mitmdump one after the other, so their ratio in that round cancels most of the
drift; the median of those per-round ratios, with a confidence interval from order statistics (no
assumption about how the noise is distributed), says whether a run *shows* a target met, missed,
or cannot tell at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Coverage asked of the interval (the report says what it got).
LEVEL = 0.90


def coverage(n: int, k: int) -> float:
    """Probability that [x_(k), x_(n+1-k)] of n samples holds the true median: 1 - 2 P(B <= k-1),
    B ~ Binomial(n, 1/2) (each sample falls below the median with probability 1/2)."""
    if n < 1 or not 1 <= k <= (n + 1) // 2:
        return 0.0
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2**n


def median_ci(values: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(low, high, coverage) of the narrowest symmetric order-statistic interval whose coverage is
    at least ``level``; with too few values for that, [min, max] and the smaller coverage it has.
    NaNs (a run with no successful call) are left out."""
    xs = sorted(v for v in values if v == v)
    n = len(xs)
    if not n:
        return float("nan"), float("nan"), 0.0
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(n, k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(n, k)


def verdict(low: float, high: float, cover: float, target: float, higher_is_better: bool,
            level: float = LEVEL) -> str:
    """``met`` / ``missed`` when the whole interval lies on one side of the target, ``unresolved``
    when it straddles it (the noise is larger than the difference), ``too few rounds`` when the
    interval covers less than ``level``."""
    if cover < level or low != low:
        return "too few rounds"
    if higher_is_better:
        return "met" if low >= target else "missed" if high < target else "unresolved"
    return "met" if high <= target else "missed" if low > target else "unresolved"


def main(argv: Sequence[str] | None = None) -> int:
    """The interval and verdict for ratios measured elsewhere (e.g. copied from a run's table), so
    a reader can check a verdict by hand."""
    import argparse
    import statistics

    parser = argparse.ArgumentParser(
        prog="paired_stats.py",
        description="Median of per-round ratios with a distribution-free confidence interval, and "
                    "the verdict against a target (as bench/proxy_overhead.py reports them).")
    parser.add_argument("ratios", nargs="+", type=float, metavar="RATIO",
                        help="one ratio per round, e.g. addon/bare calls/s")
    parser.add_argument("--target", type=float, required=True, help="e.g. 0.95 or 1.05")
    parser.add_argument("--lower-is-better", action="store_true",
                        help="the target is a ceiling (a time ratio), not a floor (a throughput ratio)")
    parser.add_argument("--level", type=float, default=LEVEL, help="coverage asked (default %(default)s)")
    args = parser.parse_args(argv)
    if not all(math.isfinite(v) and v > 0 for v in [*args.ratios, args.target]):  # a ratio of two times or rates
        parser.error("ratios and --target must be finite numbers above 0")
    if not 0.0 < args.level < 1.0:
        parser.error("--level must lie between 0 and 1")
    low, high, cover = median_ci(args.ratios, args.level)
    result = verdict(low, high, cover, args.target, not args.lower_is_better, args.level)
    print(f"median {statistics.median(args.ratios):.3f} [{low:.3f}, {high:.3f}] "
          f"(coverage {cover:.3f}, {len(args.ratios)} rounds): {result}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
