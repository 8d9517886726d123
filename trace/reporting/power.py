"""Power of the report's paired differences: the standard errors behind an interval, the minimum detectable
difference at 80 % power (two-sided 5 %), and the seeds and held-out questions that reach a margin.

Pure functions of ``trace.reporting.statistics.Interval`` (``scipy.stats``), used by ``trace.reporting.verdicts``
(``judge``) for the report and the docs tables alike. docs/method.md, "Statistics over seeds", states the model:
the seed component is the t-interval's standard error (exact with the noncentral t), the question component what
the paired bootstrap adds beyond it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trace.reporting.statistics import BOOTSTRAP, Interval

ALPHA = 0.05  # family-wise error rate of every family, and the two-sided level of the power calculation
POWER = 0.80  # the power the minimum detectable difference is computed at
MAX_SEEDS = 1_000  # seeds_needed searches up to this many seeds


def _z(q: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(q))


def _quantile(q: float, df: float) -> float:
    """The q-quantile of Student's t with ``df`` degrees of freedom (the normal one for ``df = inf``)."""
    from scipy.stats import t

    return _z(q) if math.isinf(df) else float(t.ppf(q, df))


def standard_errors(iv: Interval) -> tuple[float, float, float]:
    """``(se below the mean, se above it, degrees of freedom)`` that reproduce one interval (not its
    ``seed_interval``).

    Args:
        iv: a t-interval over ``n`` seeds (df ``n - 1``, symmetric) or a bootstrap percentile interval (df
            ``inf``: its near sides read as normal ones, which may differ).

    Returns:
        NaNs without an interval (``n < 2``).

    References:
        docs/method.md, "Statistics over seeds" (p-values from the intervals).
    """
    nan = float("nan")
    if not iv.has_interval or not all(math.isfinite(x) for x in (iv.mean, iv.low, iv.high)):
        return nan, nan, nan
    df = math.inf if iv.estimator == BOOTSTRAP else float(iv.n - 1)
    q = _quantile((1.0 + iv.confidence) / 2.0, df)
    return (iv.mean - iv.low) / q, (iv.high - iv.mean) / q, df



def minimum_detectable_difference(se: float, df: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true difference a two-sided test at ``alpha`` rejects with probability ``power``.

    With ``df`` finite, the noncentrality ``d / se`` at which the noncentral t (``df``) exceeds the critical
    value ``t_{1 - alpha/2, df}`` with probability ``power`` (the far tail left out); with ``df = inf``,
    ``(z_{1 - alpha/2} + z_{power}) se``.

    Args:
        se: the difference's standard error (> 0), e.g. ``standard_errors``.
        df: degrees of freedom (``n - 1`` seeds, or ``inf``).
        alpha: two-sided level in (0, 1).
        power: in (0, 1).

    Returns:
        The difference, in ``se``'s unit; NaN for a non-finite or non-positive ``se`` or ``df < 1``.

    References:
        Cohen, "Statistical Power Analysis for the Behavioral Sciences", 2nd ed. (1988), ch. 2 (the t-test's
        power through the noncentral t).
    """
    from scipy.optimize import brentq
    from scipy.stats import nct

    if not (math.isfinite(se) and se > 0 and df >= 1):
        return float("nan")
    if math.isinf(df):
        return (_z(1 - alpha / 2) + _z(power)) * se
    crit = _quantile(1 - alpha / 2, df)
    noncentrality = brentq(lambda nc: float(nct.sf(crit, df, nc)) - power, 0.0, 1e3)
    return noncentrality * se


@dataclass(frozen=True)
class Power:
    """The power of one paired comparison at its observed variance.

    Attributes:
        mdd: minimum detectable difference at ``POWER``, two-sided ``ALPHA``: the larger of ``mdd_seeds`` and
            ``mdd_bootstrap`` (both intervals must exclude 0).
        mdd_seeds: that of the t-test over seeds (noncentral t, ``n - 1`` df).
        mdd_bootstrap: that of the bootstrap interval (normal), NaN without one.
        question_se: the question component's standard error ``sqrt(se_boot^2 - se_t^2)`` (0 when the bootstrap
            is not wider), NaN without a bootstrap interval.
        seeds_needed: seeds at which ``mdd_seeds`` reaches the margin, the question count unchanged (None:
            not within ``MAX_SEEDS``).
        questions_factor: the multiple of the present held-out questions at which the question component alone
            detects the margin (NaN without a bootstrap interval).
    """

    mdd: float
    mdd_seeds: float
    mdd_bootstrap: float
    question_se: float
    seeds_needed: int | None
    questions_factor: float


def power_of(iv: Interval, margin: float, alpha: float = ALPHA, power: float = POWER) -> Power:
    """Minimum detectable differences of one paired difference and the seeds and questions that reach
    ``margin``.

    The seed component is the t-interval's standard error ``se_t`` over ``n`` seeds, which scales as
    ``sqrt(n / n')`` with ``n'`` seeds (the per-seed means' own question noise stays in it). The question
    component is what the bootstrap adds, ``se_q^2 = se_b^2 - se_t^2`` (``se_b`` the mean of its two sides'
    standard errors), and scales as ``Q / Q'`` with ``Q'`` questions.

    Args:
        iv: a paired difference (t, or bootstrap with its ``seed_interval``).
        margin: delta > 0.
        alpha: two-sided level.
        power: the power asked.

    Returns:
        ``Power``; NaN fields without the interval they need.

    References:
        docs/method.md, "Statistics over seeds" (power); ``minimum_detectable_difference``.
    """
    nan = float("nan")
    t_iv = iv.seed_interval if iv.seed_interval is not None else iv
    se_low, se_high, df = standard_errors(t_iv)
    se_t = (se_low + se_high) / 2
    mdd_seeds = minimum_detectable_difference(se_t, df, alpha, power)
    seeds_needed = None
    if math.isfinite(mdd_seeds):
        n = t_iv.n
        for n_new in range(2, MAX_SEEDS + 1):
            if minimum_detectable_difference(se_t * math.sqrt(n / n_new), n_new - 1, alpha, power) <= margin:
                seeds_needed = n_new
                break
    mdd_boot, question_se, factor = nan, nan, nan
    if iv.estimator == BOOTSTRAP:
        b_low, b_high, _ = standard_errors(iv)
        se_b = (b_low + b_high) / 2
        mdd_boot = minimum_detectable_difference(se_b, math.inf, alpha, power)
        if math.isfinite(se_b) and math.isfinite(se_t):
            question_se = math.sqrt(max(se_b ** 2 - se_t ** 2, 0.0))
            # (z + z) se_q sqrt(Q / Q') <= margin  <=>  Q' / Q >= ((z + z) se_q / margin)^2
            factor = (minimum_detectable_difference(question_se, math.inf, alpha, power) / margin) ** 2 \
                if question_se > 0 else 0.0
    mdd = max(x for x in (mdd_seeds, mdd_boot) if math.isfinite(x)) if math.isfinite(mdd_seeds) else nan
    return Power(mdd, mdd_seeds, mdd_boot, question_se, seeds_needed, factor)
