"""Statistics over training seeds: means with t-intervals, paired differences, a paired bootstrap over
held-out questions and seeds, sample-efficiency curves.

Pure functions of numbers (numpy and ``scipy.stats.t``); the report (``trace.reporting.report``) calls them on the
per-(arm, seed) results read back from MLflow and the per-question results of the evaluations.
Conventions (docs/method.md, "Statistics over seeds"):

- A value that is not finite (an arm whose run lacks a metric) is left out of its sample; ``n`` counts the
  values kept.
- An interval needs two values: with ``n < 2`` its bounds are NaN and no difference is called real.
- Paired differences pair an arm's value with the baseline's value at the same seed; seeds only one side
  has are left out.
- An interval says which estimator made it (``Interval.estimator``): ``t`` (t-interval over seeds) or
  ``bootstrap`` (``paired_bootstrap``: percentile interval over resampled questions and seeds). A bootstrap
  interval is called real only when the seed-only t-interval of the same difference excludes 0 too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

T_INTERVAL = "t"  # Interval.estimator: Student-t interval over seeds
BOOTSTRAP = "bootstrap"  # Interval.estimator: paired bootstrap over questions and seeds (``paired_bootstrap``)
BOOTSTRAP_RESAMPLES = 10_000  # resamples of ``paired_bootstrap``
BOOTSTRAP_SEED = 0  # its fixed RNG seed: the same results give the same interval, so the same report
_BOOTSTRAP_CHUNK = 1_000  # resamples drawn at once (bounds memory at chunk x questions)


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its two-sided confidence interval.

    Attributes:
        mean: sample mean (NaN when ``n == 0``).
        low: lower bound (NaN when ``n < 2``).
        high: upper bound (NaN when ``n < 2``).
        n: number of finite values the mean is over (for ``bootstrap``: the seeds).
        confidence: the interval's coverage, e.g. 0.95.
        estimator: ``"t"`` (``mean_interval``) or ``"bootstrap"`` (``paired_bootstrap``).
        seed_interval: for ``bootstrap``, the t-interval over seeds of the same difference, which must also
            exclude 0 for the difference to be called real; None otherwise.
    """

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95
    estimator: str = T_INTERVAL
    seed_interval: Interval | None = None

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
        """True when the interval lies wholly above or below 0 and so does ``seed_interval`` if set (False
        without an interval)."""
        own = self.has_interval and (self.low > 0 or self.high < 0)
        return own and (self.seed_interval is None or self.seed_interval.excludes_zero)


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


def paired_bootstrap(values: np.ndarray, baseline: np.ndarray, confidence: float = 0.95,
                     num_resamples: int = BOOTSTRAP_RESAMPLES, rng_seed: int = BOOTSTRAP_SEED) -> Interval:
    """Mean difference ``values - baseline`` over seeds and held-out questions, with a percentile interval
    from a paired bootstrap that resamples questions and seeds.

    Every policy answers the same held-out questions, so a difference is paired by question (and, against
    another arm, by seed). One resample draws S seeds and Q questions with replacement, independently, and
    takes the mean difference over the drawn (seed, question) cells; the interval is the
    ``(1 - c) / 2`` and ``(1 + c) / 2`` quantiles of ``num_resamples`` such means. Resampling questions puts
    the evaluation's own sampling error (of both sides) into the interval, which a t-interval over seeds
    leaves out; a ``baseline`` of one evaluation (Q,) is resampled with the questions, so its error is in it.

    Args:
        values: float array (S, Q): per training seed (row) and held-out question (column) the arm's score,
            e.g. its greedy reward (1.0 correct, 0.0 wrong).
        baseline: float array (S, Q), the baseline at the same seeds and questions (paired by seed and
            question), or (Q,) a single evaluation (the warmup policy) compared with every seed.
        confidence: coverage in (0, 1).
        num_resamples: bootstrap resamples, at least 1.
        rng_seed: seed of ``numpy.random.default_rng``: fixed, so the same inputs give the same interval.

    Returns:
        ``Interval`` with ``estimator = "bootstrap"``: ``mean`` the mean difference over all S x Q cells,
        ``low``/``high`` the percentile bounds, ``n = S`` and ``seed_interval`` the t-interval
        (``mean_interval``) of the S per-seed mean differences. With ``S < 2`` there are no bounds: one
        seed says nothing of the spread between training runs.

    Raises:
        ValueError: ``values`` is not 2-D, ``baseline``'s shape is neither (S, Q) nor (Q,), there are no
            questions, a value is not finite, ``num_resamples < 1`` or ``confidence`` outside (0, 1).

    References:
        Efron & Tibshirani, "An Introduction to the Bootstrap" (1993), ch. 13 (the percentile interval).
        Owen, "The pigeonhole bootstrap", Annals of Applied Statistics 1(2) (2007): rows and columns of a
        crossed design (here seeds and questions) resampled independently. Miller, "Adding Error Bars to
        Evals" (arXiv 2411.00640): question sampling error and paired differences of evaluations.
        docs/method.md, "Statistics over seeds".
    """
    _check_confidence(confidence)
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be at least 1, got {num_resamples}")
    arm = np.asarray(values, dtype=np.float64)
    base = np.asarray(baseline, dtype=np.float64)
    if arm.ndim != 2:
        raise ValueError(f"values must be (seeds, questions), got shape {arm.shape}")
    num_seeds, num_questions = arm.shape
    if base.shape not in (arm.shape, (num_questions,)):
        raise ValueError(f"baseline must be (seeds, questions) = {arm.shape} or one evaluation "
                         f"({num_questions},), got shape {base.shape}")
    if num_questions == 0:
        raise ValueError("paired_bootstrap needs at least one question")
    diffs = arm - base  # (S, Q)
    if not np.isfinite(diffs).all():
        raise ValueError("paired_bootstrap needs finite scores: leave a seed or question without a result "
                         "out before the call")
    nan = float("nan")
    seed_interval = mean_interval(diffs.mean(axis=1).tolist(), confidence)
    mean = float(diffs.mean()) if num_seeds else nan
    if num_seeds < 2:
        return Interval(mean, nan, nan, num_seeds, confidence, BOOTSTRAP, seed_interval)
    rng = np.random.default_rng(rng_seed)
    means = np.empty(num_resamples)
    for start in range(0, num_resamples, _BOOTSTRAP_CHUNK):
        size = min(_BOOTSTRAP_CHUNK, num_resamples - start)
        seed_idx = rng.integers(0, num_seeds, size=(size, num_seeds))  # (b, S)
        question_idx = rng.integers(0, num_questions, size=(size, num_questions))  # (b, Q)
        # the mean over the drawn cells weighs each seed and question by how often it was drawn
        seed_counts = _row_counts(seed_idx, num_seeds)  # (b, S)
        question_counts = _row_counts(question_idx, num_questions)  # (b, Q)
        means[start:start + size] = ((seed_counts @ diffs) * question_counts).sum(axis=1) / (
            num_seeds * num_questions)
    low, high = np.quantile(means, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return Interval(mean, float(low), float(high), num_seeds, confidence, BOOTSTRAP, seed_interval)


def _row_counts(indices: np.ndarray, size: int) -> np.ndarray:
    """(b, k) draws of indices below ``size`` -> (b, size) float64 counts of each index per row."""
    offsets = (indices + size * np.arange(indices.shape[0])[:, None]).ravel()
    return np.bincount(offsets, minlength=indices.shape[0] * size).reshape(indices.shape[0], size).astype(np.float64)


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


def interval_from_dict(data: Mapping | None) -> Interval | None:
    """An ``Interval`` from its ``reports/metrics.json`` form (``{"mean", "low", "high", "n", "estimator",
    "seed_interval"}``, null bounds for undefined ones; ``trace.reporting.report_json``), so a committed report's
    differences can be judged again (``trace.reporting.verdicts``).

    Args:
        data: the JSON object, or None.

    Returns:
        The interval at 0.95 (the report's coverage), or None for None or an object without a finite mean.
    """
    if not data or not isinstance(data.get("mean"), (int, float)):
        return None
    nan = float("nan")
    value = lambda key: float(data[key]) if isinstance(data.get(key), (int, float)) else nan  # noqa: E731
    return Interval(value("mean"), value("low"), value("high"), int(data.get("n") or 0), 0.95,
                    str(data.get("estimator") or T_INTERVAL), interval_from_dict(data.get("seed_interval")))


MIN_EVALUATIONS = 3  # a curve with fewer evaluations cannot place a crossing: tokens to target is refused


@dataclass(frozen=True)
class TargetCrossings:
    """One arm's generated tokens to a target accuracy over its seeds, censored seeds kept.

    Attributes:
        target: the accuracy to reach.
        reached: seed -> tokens at the first crossing (``tokens_to_target``).
        censored: seed -> the tokens its curve ended at without reaching the target (right-censored: the
            crossing, if any, lies beyond).
        median: the median over all seeds, a censored seed counted above every crossing; NaN when half the
            seeds or more are censored (the median is then beyond the runs).
    """

    target: float
    reached: dict[int, float]
    censored: dict[int, float]
    median: float

    @property
    def num_seeds(self) -> int:
        return len(self.reached) + len(self.censored)


def crossing_target(warmup: float, baseline_finals: Sequence[float], declared: float | None = None) -> float:
    """The accuracy whose crossing the sample-efficiency table reads: ``declared`` when given, else the warmup
    plus half of the baseline's mean gain, ``warmup + (mean(baseline_finals) - warmup) / 2``.

    Half the gain is reached early and on the steep part of the baseline's curve, where most of its seeds
    cross it; the baseline's own final mean (which it reaches at about half its seeds, by construction) is not
    used.

    Args:
        warmup: the warmup policy's held-out accuracy (the curves' start).
        baseline_finals: the baseline's (``grpo``'s) final in-training accuracy per seed; non-finite left out.
        declared: ``report.target_accuracy``, or None.

    Returns:
        The target accuracy (NaN without a finite final and no ``declared``).

    References:
        docs/method.md, "Statistics over seeds" (tokens to a target accuracy).
    """
    if declared is not None:
        return float(declared)
    finals = _finite(baseline_finals)
    return float(warmup + (finals.mean() - warmup) / 2.0) if finals.size else float("nan")


def target_refusal(target: float, warmup: float, num_evaluations: Sequence[int]) -> str | None:
    """Why tokens to ``target`` must not be reported, or None when it may.

    Args:
        target: the accuracy to reach (``crossing_target``).
        warmup: the warmup's accuracy, where every curve starts.
        num_evaluations: per curve (arm and seed) its number of in-training evaluations.

    Returns:
        A reason when the target is not finite, at or below ``warmup`` (every policy "reaches" it at its first
        evaluation, so the number measures tokens per evaluation interval), or a curve has fewer than
        ``MIN_EVALUATIONS`` evaluations (too few to place a crossing); None otherwise.
    """
    if not math.isfinite(target):
        return "no target: the baseline has no final in-training accuracy and none is declared"
    if math.isfinite(warmup) and target <= warmup:
        return (f"the target {target:.3f} is at or below the warmup's {warmup:.3f}: every curve starts at or "
                "above it, so the tokens would measure the first evaluation interval, not learning")
    if num_evaluations and min(num_evaluations) < MIN_EVALUATIONS:
        return (f"a curve has {min(num_evaluations)} in-training evaluations, fewer than {MIN_EVALUATIONS}: too "
                "few to place a crossing (lower train.eval_every)")
    return None


def tokens_to_target_censored(curves: Mapping[int, tuple[Sequence[float], Sequence[float]]],
                              target: float) -> TargetCrossings:
    """Per seed the first crossing of ``target`` (``tokens_to_target``), a seed that never reaches it kept as
    censored at its curve's last tokens, and the median over all seeds.

    Args:
        curves: seed -> ``(cumulative generated tokens, accuracy)`` at its evaluations, shape (E,) each.
        target: the accuracy to reach.

    Returns:
        ``TargetCrossings``; the median is the middle of the seeds ordered by crossing, every censored seed
        after every crossing (defined while fewer than half the seeds are censored).

    References:
        Kaplan & Meier, "Nonparametric estimation from incomplete observations", JASA 53(282) (1958): with
        right-censored times the median is read where the estimated survival falls to 1/2; with censoring after
        every event, as here, that is the order statistic.
    """
    reached: dict[int, float] = {}
    censored: dict[int, float] = {}
    for seed in sorted(curves):
        tokens, accuracy = curves[seed]
        hit = tokens_to_target(tokens, accuracy, target)
        if hit is None:
            censored[seed] = float(tokens[-1]) if len(tokens) else float("nan")
        else:
            reached[seed] = hit
    n = len(reached) + len(censored)
    median = float("nan")
    if n and len(censored) * 2 < n:
        ordered = sorted(reached.values()) + [math.inf] * len(censored)
        median = ordered[(n - 1) // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        median = median if math.isfinite(median) else float("nan")
    return TargetCrossings(float(target), reached, censored, float(median))
