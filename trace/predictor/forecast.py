"""Forecasts of mixed groups and flips that integrate over what the predictor does not know.

The allocators plug a point forecast ``p`` into concave functions: ``A(p, m) = 1 - p^m - (1 - p)^m`` (stage 1)
and ``V_pref(r, v, K) = 1 - [r v^K + (1 - r)(1 - v)^K]`` (stage 2). A predictor that is calibrated but not
sharp (many prompts forecast 0.5, some truly near 0, others near 1) makes ``A(p, m)`` over-forecast by
Jensen's inequality, and a miscalibrated one adds its bias. ``ForecastModel`` instead treats the true success
probability ``x`` of an item with forecast ``p`` as a draw from

    x | p ~ Beta(q kappa, (1 - q) kappa),   q = sigmoid(alpha + beta logit(p)),

a recalibration of the mean (Platt 1999) with a spread ``kappa`` (large: the forecast is sharp; small: true
probabilities pile up near 0 and 1), and takes expectations under it:

- ``E[A] = 1 - E[x^m] - E[(1 - x)^m]``, with ``E[x^m] = (a)_m / (a + b)_m`` for ``x ~ Beta(a, b)``
  (rising factorials; the beta-binomial probability of m successes in m draws);
- ``E[V_pref]`` after the factual trajectory through the anchor, one draw of ``x`` with reward ``r``, is
  observed: the posterior is ``Beta(a + 1, b)`` after a success and ``Beta(a, b + 1)`` after a failure, and
  ``E[V_pref] = 1 - [r E[x^K | success] + (1 - r) E[(1 - x)^K | failure]]``. The anchor was chosen for its
  ``r``; conditioning on ``r`` is what makes the forecast hold for the chosen anchors.

``fit_forecast_model`` fits ``(alpha, beta, kappa)`` by maximum likelihood of the beta-binomial on outcomes
the allocator did not choose by: groups of root rollouts (stage 1 chose them by ``p`` alone, so their
outcomes given ``p`` are unbiased), and anchors' factual trajectory plus continuations (``r`` is in the
likelihood, so choosing by it is ignorable). The training loop fits one model per stage on the previous steps'
trees (``predictor.window_steps``; ``trace.reporting.audit.integrated_metrics``) and forecasts the current step
with it: out of sample.

References:
    Skellam (1948), the beta-binomial distribution; Platt (1999), "Probabilistic outputs for support vector
    machines" (the logistic recalibration); TRACE (arXiv 2606.11119), ``A(p, m)`` and ``V_pref``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ForecastModel", "beta_moment", "fit_forecast_model"]

MIN_ITEMS = 8  # fewer outcomes than this: no fit, the identity model (the point forecast)
_EPS = 1e-6


def beta_moment(mean: Any, kappa: float, power: Any) -> np.ndarray:
    """``E[x^power]`` for ``x ~ Beta(mean kappa, (1 - mean) kappa)``: ``(a)_n / (a + b)_n``.

    Args:
        mean: float array of means in [0, 1].
        kappa: concentration ``a + b > 0``; ``inf`` gives ``mean ** power`` (a point mass).
        power: int array ``n >= 0``, broadcast with ``mean``.

    Returns:
        float64 array; exactly 1 where ``power == 0``, 0 where ``mean == 0 < power``.

    Raises:
        ValueError: ``kappa <= 0``, a mean outside [0, 1] or a power that is not an integer >= 0.
    """
    from scipy.special import poch

    q = np.asarray(mean, dtype=np.float64)
    n = np.asarray(power, dtype=np.float64)
    if not kappa > 0:
        raise ValueError(f"kappa={kappa} must be > 0")
    if np.any(n < 0) or np.any(n != np.round(n)):
        raise ValueError(f"powers must be integers >= 0, got {np.ravel(n)[:5].tolist()}")
    if np.any((q < 0) | (q > 1)) or not np.all(np.isfinite(q)):
        raise ValueError("means must lie in [0, 1]")
    if math.isinf(kappa):
        return np.power(q, n)
    return poch(q * kappa, n) / poch(kappa, n)


@dataclass(frozen=True)
class ForecastModel:
    """``x | p ~ Beta(q kappa, (1 - q) kappa)``, ``q = sigmoid(alpha + beta logit p)`` (module docstring).

    Attributes:
        alpha, beta: the recalibration of the mean (identity: 0, 1).
        kappa: the spread (``inf``: the point forecast).
        num_items: outcomes it was fitted on (0: not fitted).
    """

    alpha: float = 0.0
    beta: float = 1.0
    kappa: float = math.inf
    num_items: int = 0

    def mean(self, pred: Any) -> np.ndarray:
        """(N,) float64 ``q``, the recalibrated forecast of ``pred`` (forecasts in [0, 1])."""
        p = np.clip(np.asarray(pred, dtype=np.float64), _EPS, 1 - _EPS)
        if self.alpha == 0.0 and self.beta == 1.0:
            return np.asarray(pred, dtype=np.float64)
        z = self.alpha + self.beta * np.log(p / (1 - p))
        return 1.0 / (1.0 + np.exp(-z))

    def mixed_group_prob(self, pred: Any, group_size: Any) -> np.ndarray:
        """(N,) ``E[A(x, m)] = 1 - E[x^m] - E[(1 - x)^m]``: the probability that ``m`` rollouts of a prompt with
        forecast ``pred`` hold a success and a failure (0 for ``m < 2``)."""
        q = self.mean(pred)
        m = np.asarray(group_size, dtype=np.float64)
        value = 1.0 - beta_moment(q, self.kappa, m) - beta_moment(1.0 - q, self.kappa, m)
        return np.where(m >= 2, np.clip(value, 0.0, 1.0), 0.0)

    def flip_prob(self, factual_reward: Any, pred: Any, num_continuations: Any) -> np.ndarray:
        """(N,) ``E[V_pref]`` given the factual trajectory's reward ``r`` (module docstring): the probability
        that one of ``K`` continuations ends other than ``r``."""
        r = np.asarray(factual_reward, dtype=np.float64)
        q = self.mean(pred)
        k = np.asarray(num_continuations, dtype=np.float64)
        if math.isinf(self.kappa):
            after_success, after_failure = np.power(q, k), np.power(1.0 - q, k)
        else:  # Beta(a + 1, b) after a success, Beta(a, b + 1) after a failure; both have a + b + 1
            grown = self.kappa + 1.0
            after_success = beta_moment((q * self.kappa + 1.0) / grown, grown, k)
            after_failure = beta_moment(((1.0 - q) * self.kappa + 1.0) / grown, grown, k)
        value = 1.0 - (r * after_success + (1.0 - r) * after_failure)
        return np.where(k > 0, np.clip(value, 0.0, 1.0), 0.0)

    def metrics(self, stage: str) -> dict[str, float]:
        """``forecast/<stage>_{alpha, beta, kappa, items}`` for the step's log (kappa inf logged as NaN)."""
        return {f"forecast/{stage}_alpha": self.alpha, f"forecast/{stage}_beta": self.beta,
                f"forecast/{stage}_kappa": self.kappa if math.isfinite(self.kappa) else float("nan"),
                f"forecast/{stage}_items": float(self.num_items)}


def _neg_log_likelihood(params: np.ndarray, logit_p: np.ndarray, successes: np.ndarray, trials: np.ndarray,
                        shrink: float = 0.0) -> float:
    from scipy.special import betaln

    alpha, beta, log_kappa = params
    penalty = shrink * (alpha ** 2 + (beta - 1.0) ** 2) / (2.0 * logit_p.size)  # a Gaussian prior at the identity
    q = np.clip(1.0 / (1.0 + np.exp(-(alpha + beta * logit_p))), _EPS, 1 - _EPS)
    kappa = math.exp(log_kappa)
    a, b = q * kappa, (1.0 - q) * kappa
    # the binomial coefficient does not depend on the parameters; the mean per item keeps the optimiser's
    # relative tolerance meaningful for any number of outcomes
    return -float(np.mean(betaln(a + successes, b + trials - successes) - betaln(a, b))) + penalty


def fit_forecast_model(pred: Any, successes: Any, trials: Any, min_items: int = MIN_ITEMS,
                       shrink: float = 0.0) -> ForecastModel:
    """Maximum-likelihood ``(alpha, beta, kappa)`` of the beta-binomial ``s_i ~ BetaBin(n_i, q_i kappa,
    (1 - q_i) kappa)``, ``q_i = sigmoid(alpha + beta logit p_i)``.

    Args:
        pred: (N,) float forecasts ``p_i`` in [0, 1].
        successes: (N,) float ``s_i``, successes among the item's outcomes (0/1 rewards summed).
        trials: (N,) int ``n_i >= 1`` outcomes.
        min_items: fewer items than this (or outcomes all alike): the identity model, unfitted.
        shrink: the precision, in items, of a Gaussian prior on ``(alpha, beta - 1)`` at 0 (maximum a posteriori);
            0 (the default) is maximum likelihood.

    Returns:
        ``ForecastModel`` (``alpha`` in [-10, 10], ``beta`` in [0, 5], ``kappa`` in [0.05, 10^4]; L-BFGS-B from
        the identity with ``kappa = 10`` and with the method-of-moments ``kappa``, the better optimum kept).

    Raises:
        ValueError: lengths differ, a value is not finite, a forecast outside [0, 1], ``n_i < 1`` or ``s_i``
            outside [0, n_i].
    """
    from scipy.optimize import minimize

    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    s = np.asarray(successes, dtype=np.float64).reshape(-1)
    n = np.asarray(trials, dtype=np.float64).reshape(-1)
    if not p.shape == s.shape == n.shape:
        raise ValueError(f"pred {p.shape}, successes {s.shape} and trials {n.shape} must hold one value per item")
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(s)) and np.all(np.isfinite(n))):
        raise ValueError("forecasts, successes and trials must be finite (leave items without a forecast out)")
    if np.any((p < 0) | (p > 1)) or np.any(n < 1) or np.any((s < 0) | (s > n)):
        raise ValueError("forecasts must lie in [0, 1], trials be >= 1 and successes in [0, trials]")
    rate = s.sum() / max(n.sum(), 1.0)
    if p.size < min_items or rate in (0.0, 1.0):
        return ForecastModel()
    pc = np.clip(p, _EPS, 1 - _EPS)
    logit_p = np.log(pc / (1 - pc))
    # two starts: kappa = 10, and the method of moments (Var x = q (1 - q) / (kappa + 1) beyond the binomial noise),
    # which a steep likelihood (many outcomes per item) needs; the better optimum is kept
    r = s / n
    excess = float(np.var(r - p) - np.mean(r * (1 - r) / n))
    moments = rate * (1 - rate) / excess - 1.0 if excess > 0 else 1e4
    bounds = [(-10.0, 10.0), (0.0, 5.0), (math.log(0.05), math.log(1e4))]
    results = [minimize(_neg_log_likelihood, np.array([0.0, 1.0, math.log(k)]), args=(logit_p, s, n, shrink),
                        method="L-BFGS-B", bounds=bounds, options={"ftol": 1e-12, "gtol": 1e-8})
               for k in (10.0, float(np.clip(moments, 0.05, 1e4)))]
    result = min(results, key=lambda res: res.fun)
    alpha, beta, log_kappa = (float(v) for v in result.x)
    return ForecastModel(alpha, beta, math.exp(log_kappa), int(p.size))
