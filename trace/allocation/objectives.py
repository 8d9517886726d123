"""The stage-1 objectives: what a root allocation of ``m`` rollouts to a prompt of success probability ``p``
is worth.

- ``groups`` (the paper's): ``A(p, m) = 1 - p^m - (1 - p)^m``, the probability that the group activates
  (holds a success and a failure); the sum over prompts is the expected number of mixed groups.
- ``leaves``: ``m A(p, m)``, the expected number of root leaves that lie in a mixed group; the sum over
  prompts is the expected numerator of ``effective_ratio`` over root rollouts, whose denominator (the
  root budget) the allocation does not change.

Both are 0 at ``m in {0, 1}``. ``A`` has non-increasing increments for ``m >= 1`` (concave on
``[m_min, m_max]``); ``m A`` does not (for small ``p`` it grows like ``p m^2``), which the solvers in
``trace.allocation.root`` account for.

References:
    TRACE (arXiv 2606.11119), stage 1 root allocation objective; docs/method.md, "Root allocation".
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROOT_OBJECTIVES", "activation_prob", "activation_increment", "check_root_objective",
           "objective_table", "objective_value"]

ROOT_OBJECTIVES: tuple[str, ...] = ("groups", "leaves")


def _as_probs(pred_success_prob, name: str) -> np.ndarray:
    p = np.asarray(pred_success_prob, dtype=np.float64)
    if not np.all(np.isfinite(p)) or np.any(p < 0.0) or np.any(p > 1.0):
        bad = p[~(np.isfinite(p) & (p >= 0.0) & (p <= 1.0))]
        raise ValueError(f"{name} must be finite probabilities in [0, 1]; got {bad[:5].tolist()} "
                         "(clip the predictor's output to [0, 1])")
    return p


def activation_prob(pred_success_prob, num_rollouts):
    """Probability that ``m`` independent rollouts hold both a success and a failure.

    Args:
        pred_success_prob: float or array, success probability ``p`` in [0, 1].
        num_rollouts: int or int array ``m >= 0`` (broadcast against ``p``).

    Returns:
        float64 array (or scalar) ``A(p, m) = 1 - p^m - (1 - p)^m`` for ``m >= 2``; exactly 0 for
        ``m in {0, 1}`` (``0**0 == 1`` in floating point would otherwise give ``A(p, 0) = -1``).
        ``1 - (1 - p)^m`` is computed as ``-expm1(m * log1p(-p))`` to keep precision for small ``p``.

    Raises:
        ValueError: ``p`` outside [0, 1] or not finite, or ``m`` negative or not integral.

    References:
        TRACE (arXiv 2606.11119), stage 1: ``A(p, m)``, the activation probability of a group of ``m``.
    """
    p = _as_probs(pred_success_prob, "pred_success_prob")
    m = np.asarray(num_rollouts)
    if m.dtype.kind not in "iu":
        if not np.all(np.isfinite(m)) or np.any(m != np.round(m)):
            raise ValueError(f"num_rollouts must be integers, got {np.ravel(m)[:5].tolist()}")
    if np.any(m < 0):
        raise ValueError(f"num_rollouts must be >= 0, got {np.ravel(m)[np.ravel(m) < 0][:5].tolist()}")
    p, mf = np.broadcast_arrays(p, m.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        value = -np.expm1(mf * np.log1p(-p)) - np.power(p, mf)
    value = np.where(mf >= 2.0, np.clip(value, 0.0, 1.0), 0.0)
    return value[()] if value.ndim == 0 else value


def activation_increment(pred_success_prob, num_rollouts):
    """Gain of one more rollout: ``A(p, m + 1) - A(p, m)`` in closed form, without cancellation.

    Args:
        pred_success_prob: float or array ``p`` in [0, 1].
        num_rollouts: int or int array ``m >= 1`` (broadcast against ``p``).

    Returns:
        float64 ``p (1 - p) (p^(m-1) + (1 - p)^(m-1))``; non-increasing in ``m``.

    Raises:
        ValueError: ``m < 1``.

    References:
        TRACE (arXiv 2606.11119), stage 1: the increments of ``A`` shrink with ``m`` for ``m >= 1``.
    """
    p = np.asarray(pred_success_prob, dtype=np.float64)
    m = np.asarray(num_rollouts, dtype=np.float64)
    if np.any(m < 1):
        raise ValueError("activation_increment is defined for m >= 1 (the 0 -> 1 step is 0, then jumps)")
    return p * (1.0 - p) * (np.power(p, m - 1.0) + np.power(1.0 - p, m - 1.0))


def check_root_objective(root_objective: str) -> str:
    """Return ``root_objective`` if it names a stage-1 objective.

    Raises:
        ValueError: naming ``allocation.root_objective`` and the valid values.
    """
    if root_objective not in ROOT_OBJECTIVES:
        raise ValueError(f"allocation.root_objective={root_objective!r} is not a stage-1 objective; "
                         f"use one of {list(ROOT_OBJECTIVES)}")
    return root_objective


def objective_table(pred_success_prob, num_rollouts, root_objective: str = "groups") -> np.ndarray:
    """Value of giving ``m`` rollouts to a prompt of success probability ``p``, under one objective.

    Args:
        pred_success_prob: float array ``p`` in [0, 1], e.g. (B, 1).
        num_rollouts: int array ``m >= 0`` broadcast against ``p``, e.g. (1, W).
        root_objective: ``"groups"``: ``A(p, m)``; ``"leaves"``: ``m A(p, m)``.

    Returns:
        float64 array of the broadcast shape (e.g. (B, W)).

    Raises:
        ValueError: an unknown objective, or inputs ``activation_prob`` refuses.

    References:
        TRACE (arXiv 2606.11119), stage 1 (``groups``); docs/method.md, "Root allocation" (``leaves``).
    """
    check_root_objective(root_objective)
    value = np.asarray(activation_prob(pred_success_prob, num_rollouts), dtype=np.float64)
    if root_objective == "leaves":
        value = value * np.asarray(num_rollouts, dtype=np.float64)
    return value


def objective_value(pred_success_prob, counts, root_objective: str = "groups") -> float:
    """The objective of one allocation: ``sum_i A(p_i, m_i)`` (groups) or ``sum_i m_i A(p_i, m_i)`` (leaves).

    Args:
        pred_success_prob: (B,) float ``p_i`` in [0, 1].
        counts: (B,) int ``m_i >= 0``.
        root_objective: ``"groups"`` or ``"leaves"``.

    Returns:
        The sum as a Python float.

    Raises:
        ValueError: as ``objective_table``.
    """
    return float(np.sum(objective_table(pred_success_prob, counts, root_objective)))
