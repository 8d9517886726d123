"""Statistics over training seeds: means with t-intervals, paired differences, sample-efficiency curves.

Pure functions of numbers (numpy and ``scipy.stats.t``); the report (``trace.report``) calls them on the
per-(arm, seed) results read back from MLflow. Conventions (docs/method.md, "Statistics over seeds"):

- A value that is not finite (an arm whose run lacks a metric) is left out of its sample; ``n`` counts the
  values kept.
- An interval needs two values: with ``n < 2`` its bounds are NaN and no difference is called real.
- Paired differences pair an arm's value with the baseline's value at the same seed; seeds only one side
  has are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its two-sided confidence interval.

    Attributes:
        mean: sample mean (NaN when ``n == 0``).
        low: lower bound (NaN when ``n < 2``).
        high: upper bound (NaN when ``n < 2``).
        n: number of finite values the mean is over.
        confidence: the interval's coverage, e.g. 0.95.
    """

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    @property
    def has_interval(self) -> bool:
        """True when the bounds are defined (two or more values)."""
        return self.n >= 2

    @property
    def half_width(self) -> float:
        """``(high - low) / 2``; NaN without an interval."""
        return (self.high - self.low) / 2 if self.has_interval else float("nan")

    @property
    def excludes_zero(self) -> bool:
        """True when the interval lies wholly above or below 0 (False without an interval)."""
        return self.has_interval and (self.low > 0 or self.high < 0)


def _finite(values: Sequence[float]) -> np.ndarray:
    arr = np.asarray([float(v) for v in values], dtype=np.float64)
    return arr[np.isfinite(arr)]


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r} (e.g. 0.95)")


def t_quantile(n: int, confidence: float = 0.95) -> float:
    """The two-sided Student-t critical value ``t_{(1+c)/2, n-1}`` for a mean over ``n`` values.

    Args:
        n: sample size, at least 2.
        confidence: coverage in (0, 1).

    Returns:
        e.g. 4.303 for ``n = 3`` at 0.95.

    Raises:
        ValueError: ``n < 2`` or ``confidence`` outside (0, 1).
    """
    from scipy.stats import t

    _check_confidence(confidence)
    if n < 2:
        raise ValueError(f"a t-interval needs at least 2 values, got n={n}")
    return float(t.ppf((1.0 + confidence) / 2.0, n - 1))


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of ``values`` and its t-interval ``mean +- t_{(1+c)/2, n-1} * s / sqrt(n)``.

    Args:
        values: one value per seed (float); non-finite values are left out.
        confidence: coverage in (0, 1).

    Returns:
        ``Interval``; ``s`` is the sample standard deviation (``ddof=1``). One value: the value, no bounds;
        none: all NaN with ``n = 0``.

    Raises:
        ValueError: ``confidence`` outside (0, 1).

    References:
        docs/method.md, "Statistics over seeds" (the t-interval of a mean, Student 1908).
    """
    _check_confidence(confidence)
    arr = _finite(values)
    nan = float("nan")
    if arr.size == 0:
        return Interval(nan, nan, nan, 0, confidence)
    mean = float(arr.mean())
    if arr.size == 1:
        return Interval(mean, nan, nan, 1, confidence)
    half = t_quantile(arr.size, confidence) * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    return Interval(mean, mean - half, mean + half, int(arr.size), confidence)


def paired_difference(values: Mapping[int, float], baseline: Mapping[int, float],
                      confidence: float = 0.95) -> Interval:
    """Mean and t-interval of the per-seed differences ``values[s] - baseline[s]``.

    Args:
        values: seed -> the arm's value.
        baseline: seed -> the baseline arm's value (``grpo``).
        confidence: coverage in (0, 1).

    Returns:
        ``mean_interval`` of the differences over the seeds both map to a finite value (sorted by seed).

    Raises:
        ValueError: ``confidence`` outside (0, 1).

    References:
        docs/method.md, "Statistics over seeds" (the paired t-interval: one pair per seed).
    """
    diffs = [float(values[s]) - float(baseline[s]) for s in sorted(set(values) & set(baseline))
             if math.isfinite(float(values[s])) and math.isfinite(float(baseline[s]))]
    return mean_interval(diffs, confidence)


def tokens_to_target(tokens: Sequence[float], accuracy: Sequence[float], target: float) -> float | None:
    """Generated tokens at which an accuracy curve first reaches ``target``, linearly interpolated.

    The curve's points are taken in the given order (cumulative tokens increase). If the first point already
    reaches the target, its tokens are returned; otherwise, at the first point ``i`` with
    ``accuracy[i] >= target``, the crossing between points ``i-1`` and ``i`` is placed by linear
    interpolation: ``x = x_{i-1} + (target - y_{i-1}) / (y_i - y_{i-1}) * (x_i - x_{i-1})``.

    Args:
        tokens: cumulative generated tokens at each evaluation, shape (E,).
        accuracy: held-out accuracy at the same evaluations, shape (E,).
        target: the accuracy to reach (e.g. ``grpo``'s final accuracy).

    Returns:
        The tokens (float), or None when the curve never reaches ``target`` (also for an empty curve).

    Raises:
        ValueError: ``tokens`` and ``accuracy`` differ in length.

    References:
        docs/method.md, "Statistics over seeds" (tokens to a target accuracy).
    """
    xs = [float(x) for x in tokens]
    ys = [float(y) for y in accuracy]
    if len(xs) != len(ys):
        raise ValueError(f"tokens ({len(xs)}) and accuracy ({len(ys)}) must have one value per evaluation")
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (target - y0) / (y - y0) * (x - x0)
    return None


def common_grid(curves: Sequence[tuple[Sequence[float], Sequence[float]]], num: int = 50) -> np.ndarray:
    """``num`` evenly spaced x values on which every curve is defined: from the largest first x to the
    smallest last x of the curves.

    Args:
        curves: ``(xs, ys)`` per seed, xs increasing.
        num: grid points, at least 1.

    Returns:
        float64 array (num,), or (0,) when the curves share no x range or there are none.

    Raises:
        ValueError: ``num < 1``.
    """
    if num < 1:
        raise ValueError(f"num must be at least 1, got {num}")
    spans = [(float(xs[0]), float(xs[-1])) for xs, _ in curves if len(xs)]
    if not spans:
        return np.zeros(0)
    lo, hi = max(s[0] for s in spans), min(s[1] for s in spans)
    if hi < lo:
        return np.zeros(0)
    return np.linspace(lo, hi, num) if hi > lo else np.array([lo])


def curve_band(curves: Sequence[tuple[Sequence[float], Sequence[float]]], grid: Sequence[float],
               confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean curve and pointwise t-interval band of several seeds' curves on a common grid.

    Each curve is linearly interpolated onto ``grid`` (``numpy.interp``); a grid point outside a curve's
    x range is NaN for that curve and left out of that point's sample.

    Args:
        curves: ``(xs, ys)`` per seed, xs increasing.
        grid: x values, shape (G,).
        confidence: coverage in (0, 1).

    Returns:
        ``(mean, low, high)``, float64 arrays (G,); the bounds are NaN where fewer than 2 seeds cover a point.

    Raises:
        ValueError: ``confidence`` outside (0, 1).

    References:
        docs/method.md, "Statistics over seeds" (pointwise interval bands).
    """
    grid_arr = np.asarray(grid, dtype=np.float64)
    rows = []
    for xs, ys in curves:
        xs_a, ys_a = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
        row = np.full(grid_arr.shape, np.nan)
        if xs_a.size:
            inside = (grid_arr >= xs_a[0]) & (grid_arr <= xs_a[-1])
            row[inside] = np.interp(grid_arr[inside], xs_a, ys_a)
        rows.append(row)
    stats = [mean_interval([r[g] for r in rows], confidence) for g in range(grid_arr.size)]
    return (np.array([s.mean for s in stats]), np.array([s.low for s in stats]),
            np.array([s.high for s in stats]))
