"""The statistics of the report (and of the study's comparisons): t intervals of a mean, intervals
cut to a metric's range, the paired t-test. Scores are in percent."""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

ALPHA = 0.05  # two-sided, paired t-test against the family's best model
SCORE_RANGE = (0.0, 100.0)  # every metric is a percentage
MIN_SEEDS = 3  # below this a 95% t-interval is too wide to mean much (2 seeds: 12.7 sd/sqrt(2))


class Interval(NamedTuple):
    """A mean and the half-width of its 95% t confidence interval (unpacks as (mean, half))."""

    mean: float
    half: float

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def within(self, bounds: tuple[float, float] = SCORE_RANGE) -> tuple[float, float, bool]:
        """(low, high, clipped): the interval cut to the metric's range."""
        clipped = self.low < bounds[0] or self.high > bounds[1]
        return max(self.low, bounds[0]), min(self.high, bounds[1]), clipped


def mean_ci(values: list[float]) -> Interval:
    """The mean and the half-width of its 95% t interval: t_{0.975, n-1} sd / sqrt(n) (0 for one
    value)."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return Interval(m, 0.0)
    from scipy import stats  # optional: [eval] extra

    return Interval(m, float(stats.t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)))


def bounded_interval(
    mean: float, half: float, bounds: tuple[float, float] = SCORE_RANGE
) -> tuple[float, float, bool]:
    """(low, high, clipped): mean -+ half, cut to the metric's range."""
    return Interval(mean, half).within(bounds)


def add_interval(row: dict) -> dict:
    """Adds ci_low / ci_high / ci_clipped to a row with score and ci95 (None score: no interval)."""
    if row.get("score") is None:
        row.update(ci_low=None, ci_high=None, ci_clipped=False)
    else:
        low, high, clipped = bounded_interval(row["score"], row["ci95"] or 0.0)
        row.update(ci_low=low, ci_high=high, ci_clipped=clipped)
    return row


def paired_t(a: list[float], b: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of scipy.stats.ttest_rel(a, b). Differences that are all equal have no
    variance (scipy gives nan or inf): all zero -> (0, 1), else (+-inf, 0)."""
    d = [x - y for x, y in zip(a, b, strict=True)]  # paired: one score each
    if max(d) - min(d) <= 1e-12:
        m = statistics.mean(d)
        return (0.0, 1.0) if abs(m) <= 1e-12 else (math.copysign(math.inf, m), 0.0)
    from scipy import stats  # optional: [eval] extra

    res = stats.ttest_rel(a, b)
    return float(res.statistic), float(res.pvalue)
