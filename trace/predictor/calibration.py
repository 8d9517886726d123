"""Calibration and ranking scores of success-probability predictions against leaf outcomes.

A scored item with label ``y`` (a success fraction) and weight ``w`` (a leaf count) stands for its ``w``
descendant leaf outcomes at one prediction ``p``: ``w * y`` successes and ``w * (1 - y)`` failures
(fractional when rewards are). Every score here is computed on those expanded outcomes; Brier score, log
loss and AUC are scikit-learn's on the two-row expansion (one positive row of weight ``w y`` and one
negative row of weight ``w (1 - y)`` per item), ECE is computed here. All scores validate their inputs alike
(``ValueError`` on bad shapes, values outside [0, 1], negative weights or zero total weight).
"""

from __future__ import annotations

from typing import Any

import numpy as np

NUM_ECE_BINS = 10
LOG_LOSS_EPS = 1e-15


def _check_metric_inputs(pred: Any, label: Any, weight: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64)
    y = np.asarray(label, dtype=np.float64)
    w = np.ones_like(p) if weight is None else np.asarray(weight, dtype=np.float64)
    if p.ndim != 1 or y.shape != p.shape or w.shape != p.shape:
        raise ValueError(f"pred, label and weight must be 1-D of one length, got shapes {p.shape}, {y.shape}, "
                         f"{w.shape}")
    for name, arr in (("pred", p), ("label", y)):
        if not np.all((arr >= 0.0) & (arr <= 1.0)):
            raise ValueError(f"{name} must lie in [0, 1] (no NaN); got min {np.nanmin(arr) if arr.size else 0}, "
                             f"max {np.nanmax(arr) if arr.size else 0}")
    if not np.all(w >= 0.0):
        raise ValueError("weight must be >= 0 (no NaN)")
    if not w.sum() > 0.0:
        raise ValueError(f"total weight must be > 0 (got {w.sum()} over {w.size} items): nothing to score")
    return p, y, w


def _expanded_outcomes(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(2N,) binary outcomes, scores and weights: item i as a success of weight ``w_i y_i`` and a failure of
    weight ``w_i (1 - y_i)``, both scored ``p_i``. Both classes are always present (possibly at weight 0)."""
    outcome = np.concatenate([np.ones(p.size), np.zeros(p.size)])
    return outcome, np.concatenate([p, p]), np.concatenate([w * y, w * (1.0 - y)])


def brier_score(pred: Any, label: Any, weight: Any = None) -> float:
    """Weighted Brier score of predictions against (expanded) binary outcomes.

    Args:
        pred: (N,) float predicted success probabilities in [0, 1].
        label: (N,) float success fractions in [0, 1]; item i stands for ``weight[i] * label[i]`` successes
            and ``weight[i] * (1 - label[i])`` failures, all predicted ``pred[i]``.
        weight: (N,) float >= 0 outcome counts (leaf counts); ``None`` = all 1.

    Returns:
        ``sum_i w_i [y_i (1 - p_i)^2 + (1 - y_i) p_i^2] / sum_i w_i`` in [0, 1]; lower is better
        (``sklearn.metrics.brier_score_loss`` on the expanded outcomes).

    Raises:
        ValueError: on mismatched shapes, values outside [0, 1], negative weights or zero total weight.

    References:
        Brier (1950), "Verification of forecasts expressed in terms of probability", Monthly Weather Review
        78(1). With binary labels this is the usual mean squared error.
    """
    p, y, w = _check_metric_inputs(pred, label, weight)
    outcome, score, outcome_weight = _expanded_outcomes(p, y, w)
    from sklearn import metrics as sk_metrics  # here: importing sklearn takes a second
    return float(sk_metrics.brier_score_loss(outcome, score, sample_weight=outcome_weight, pos_label=1.0))


def log_loss(pred: Any, label: Any, weight: Any = None, eps: float = LOG_LOSS_EPS) -> float:
    """Weighted binary cross-entropy (nats) of predictions against (expanded) binary outcomes.

    Args:
        pred: (N,) float predicted success probabilities in [0, 1]; clipped to ``[eps, 1 - eps]``.
        label: (N,) float success fractions in [0, 1] (see ``brier_score``).
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.
        eps: clip of the predictions so a confident miss costs ``-log(eps)`` rather than infinity.

    Returns:
        ``-sum_i w_i [y_i log p_i + (1 - y_i) log(1 - p_i)] / sum_i w_i`` (nats); lower is better
        (``sklearn.metrics.log_loss`` on the expanded outcomes).

    Raises:
        ValueError: as ``brier_score``.
    """
    p, y, w = _check_metric_inputs(pred, label, weight)
    p = np.clip(p, eps, 1.0 - eps)
    outcome, score, outcome_weight = _expanded_outcomes(p, y, w)
    from sklearn import metrics as sk_metrics  # here: importing sklearn takes a second
    return float(sk_metrics.log_loss(outcome, score, sample_weight=outcome_weight, labels=[0.0, 1.0]))


def expected_calibration_error(pred: Any, label: Any, weight: Any = None, num_bins: int = NUM_ECE_BINS) -> float:
    """Weighted expected calibration error over equal-width probability bins.

    Bin b holds the items with ``b / num_bins <= p < (b + 1) / num_bins`` (the last bin includes 1.0).

    Args:
        pred: (N,) float predictions in [0, 1].
        label: (N,) float success fractions in [0, 1].
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.
        num_bins: number of equal-width bins (>= 1).

    Returns:
        ``sum_b (W_b / W) |mean_w(p in b) - mean_w(y in b)| = sum_b |sum_{i in b} w_i (p_i - y_i)| / W``,
        in [0, 1]; 0 is perfectly calibrated.

    Raises:
        ValueError: as ``brier_score``, or ``num_bins < 1``.

    References:
        Naeini, Cooper, Hauskrecht (2015), "Obtaining well calibrated probabilities using Bayesian binning",
        AAAI; Guo et al. (2017), arXiv 1706.04599, eq. 3 (here with outcome weights).
    """
    if num_bins < 1:
        raise ValueError(f"num_bins={num_bins} must be >= 1")
    p, y, w = _check_metric_inputs(pred, label, weight)
    bins = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
    gap = np.bincount(bins, weights=w * (p - y), minlength=num_bins)
    return float(np.sum(np.abs(gap)) / np.sum(w))


def roc_auc(pred: Any, label: Any, weight: Any = None) -> float:
    """Weighted area under the ROC curve of predictions against (expanded) binary outcomes, ties counted half.

    Item i contributes positive mass ``w_i y_i`` and negative mass ``w_i (1 - y_i)`` at score ``p_i``. The AUC
    is the probability that a random positive outcome scores higher than a random negative one:
    ``sum_{i,j} pos_i neg_j (1[p_i > p_j] + 0.5 * 1[p_i = p_j]) / (sum pos * sum neg)``
    (``sklearn.metrics.roc_auc_score`` on the expanded outcomes).

    Args:
        pred: (N,) float scores in [0, 1].
        label: (N,) float success fractions in [0, 1].
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.

    Returns:
        AUC in [0, 1] (0.5 = no ranking skill); ``nan`` when there are no positive or no negative outcomes.

    Raises:
        ValueError: as ``brier_score``.

    References:
        Hanley and McNeil (1982), "The meaning and use of the area under a ROC curve", Radiology 143(1)
        (the Mann-Whitney statistic with ties counted half).
    """
    p, y, w = _check_metric_inputs(pred, label, weight)
    outcome, score, outcome_weight = _expanded_outcomes(p, y, w)
    if outcome_weight[:p.size].sum() <= 0.0 or outcome_weight[p.size:].sum() <= 0.0:
        return float("nan")
    from sklearn import metrics as sk_metrics  # here: importing sklearn takes a second
    return float(sk_metrics.roc_auc_score(outcome, score, sample_weight=outcome_weight))
