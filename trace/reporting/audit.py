"""Allocation audit: each step, the allocator's own forecasts against what its trees show.

Two forecasts, each next to the realised count it predicts (docs/method.md#allocation-audit):

- stage 1: ``audit/expected_mixed_groups = sum_i A(p_i, m_i)`` over the step's root groups, against
  ``audit/mixed_groups``, the root groups whose ``m_i`` bare root rollouts are mixed. Only the root rollouts'
  leaves count, never continuations or extra root rollouts, since ``A(p_i, m_i)`` forecasts exactly those;
- stage 2: ``audit/expected_flips = sum_a V_pref(r_a, v_a, K_a)`` over the anchors stage 2 branched, against
  ``audit/flips``, the anchors at least one of whose ``K_a`` continuations ended with a reward other than the
  factual ``r_a``.

A forecast well above its outcome with a calibrated predictor points at the objective; a forecast that misses
its outcome points at the predictor (with the true ``V`` as predictor, realised minus expected has mean 0).
A forecast needs predictions: arms that read none get NaN (the MLflow logger skips non-finite values), while
the realised counts are defined for every arm.

Both forecasts plug a point ``p`` into a concave function, which over-forecasts whenever the predictor is not
sharp. ``integrated_metrics`` gives the same two forecasts integrated over the true probability's spread
around the forecast (``trace.predictor.forecast.ForecastModel``, fitted on the previous steps' outcomes:
``root_outcomes``, ``anchor_outcomes``): ``audit/integrated_mixed_groups`` and ``audit/integrated_flips``.

Invariant: pure functions of the step's record (``trace.allocation.step.StepResult``) and trees; they draw
no random numbers and change nothing.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from trace.allocation.prefix import prefix_value
from trace.allocation.root import activation_prob
from trace.allocation.step import AnchorChoice, StepResult
from trace.predictor.forecast import ForecastModel, fit_forecast_model
from trace.tree import Origin, RolloutTree

__all__ = [
    "AUDIT_METRIC_KEYS",
    "expected_mixed_groups",
    "root_rollout_rewards",
    "mixed_root_groups",
    "expected_flips",
    "continuation_rewards",
    "realised_flips",
    "audit_metrics",
    "root_outcomes",
    "anchor_outcomes",
    "integrated_metrics",
]

AUDIT_METRIC_KEYS = ("audit/groups", "audit/expected_mixed_groups", "audit/mixed_groups", "audit/anchors",
                     "audit/expected_flips", "audit/flips")
INTEGRATED_METRIC_KEYS = ("audit/integrated_mixed_groups", "audit/integrated_flips")


def _is_mixed(rewards: np.ndarray) -> bool:
    """At least 2 rewards and not all equal (``trace.metrics``' notion of a mixed group)."""
    return rewards.size >= 2 and bool(rewards.max() > rewards.min())


def expected_mixed_groups(pred_success_prob, root_counts) -> float:
    """Stage 1's forecast of mixed root groups: ``sum_i A(p_i, m_i)``.

    Args:
        pred_success_prob: (R,) float ``p_i`` in [0, 1] that stage 1 read, one per root group; NaN for an arm
            without a predictor.
        root_counts: (R,) int ``m_i >= 0``, the group's bare root rollouts.

    Returns:
        The expected number of root groups holding both a success and a failure; 0.0 with no group, NaN when
        any ``p_i`` is NaN (no forecast).

    Raises:
        ValueError: shapes differ, or a value is out of range (see ``activation_prob``).

    References:
        TRACE (arXiv 2606.11119), stage 1 objective; docs/method.md#allocation-audit.
    """
    p = np.asarray(pred_success_prob, dtype=np.float64).reshape(-1)
    m = np.asarray(root_counts).reshape(-1)
    if p.shape != m.shape:
        raise ValueError(f"pred_success_prob {p.shape} and root_counts {m.shape} must both hold one value per "
                         "root group")
    if np.isnan(p).any():
        return float("nan")
    return float(np.sum(activation_prob(p, m))) if p.size else 0.0


def root_rollout_rewards(tree: RolloutTree) -> np.ndarray:
    """(m,) float64 rewards of the tree's bare root rollouts (``Origin.ROLLOUT`` leaves; truncated as 0).

    Continuations and extra root rollouts are ``Origin.BRANCH`` nodes and branching never turns a rollout's
    leaf into an inner node, so these are exactly stage 1's ``m`` trajectories.
    """
    return np.array([tree.reward_of(n) for n in tree.leaves() if n.origin == Origin.ROLLOUT],
                    dtype=np.float64)


def mixed_root_groups(trees: Sequence[RolloutTree], root_counts=None) -> int:
    """Root groups whose bare root rollouts are mixed (at least 2, rewards not all equal).

    Args:
        trees: one tree per root group.
        root_counts: (R,) the ``m_i`` stage 1 recorded; when given, each tree must hold exactly that many root
            rollouts.

    Returns:
        The number of mixed root groups.

    Raises:
        ValueError: ``root_counts`` has the wrong length or disagrees with a tree.
    """
    if root_counts is not None:
        counts = np.asarray(root_counts).reshape(-1)
        if counts.size != len(trees):
            raise ValueError(f"root_counts has {counts.size} entries for {len(trees)} trees: record one m_i per "
                             "sampled tree")
    num_mixed = 0
    for t_idx, tree in enumerate(trees):
        rewards = root_rollout_rewards(tree)
        if root_counts is not None and rewards.size != int(counts[t_idx]):
            raise ValueError(f"tree {tree.tree_id}: {rewards.size} root rollouts but stage 1 recorded "
                             f"m_i = {int(counts[t_idx])}; pass the record of the step that sampled these trees")
        num_mixed += _is_mixed(rewards)
    return num_mixed


def expected_flips(anchors: Sequence[AnchorChoice]) -> float:
    """Stage 2's forecast of flipped anchors: ``sum_a V_pref(r_a, v_a, K_a)``.

    Args:
        anchors: the anchors stage 2 branched, with the factual reward ``r``, prediction ``v`` and count ``K``
            the prefix rule saw.

    Returns:
        The expected number of anchors whose continuations produce an outcome opposite to the factual one;
        0.0 with no anchor, NaN when any ``v`` is NaN (a rule that reads no prediction).

    Raises:
        ValueError: ``r`` or ``v`` outside [0, 1], or ``K`` negative (see ``prefix_value``).

    References:
        TRACE (arXiv 2606.11119), stage 2 objective ``V_pref``; docs/method.md#prefix-expansion.
    """
    if not anchors:
        return 0.0
    v = np.array([a.pred_success_prob for a in anchors], dtype=np.float64)
    if np.isnan(v).any():
        return float("nan")
    r = np.array([a.factual_reward for a in anchors], dtype=np.float64)
    k = np.array([a.num_continuations for a in anchors], dtype=np.int64)
    return float(np.sum(prefix_value(r, v, k)))


def continuation_rewards(tree: RolloutTree) -> dict[int, np.ndarray]:
    """``{anchor node id: (K,) float64 rewards}`` of the leaves of each anchor's own continuations.

    A continuation's nodes carry ``branch_anchor_id`` = its anchor, so a later round's continuations below it
    belong to their own anchor, not to this one. Truncated leaves count as 0.
    """
    out: dict[int, list[float]] = {}
    for leaf in tree.leaves():
        if leaf.origin == Origin.BRANCH and leaf.branch_anchor_id >= 0:
            out.setdefault(leaf.branch_anchor_id, []).append(tree.reward_of(leaf))
    return {anchor: np.array(rewards, dtype=np.float64) for anchor, rewards in out.items()}


def realised_flips(trees: Sequence[RolloutTree], anchors: Sequence[AnchorChoice]) -> int:
    """Anchors at least one of whose continuations ended with a reward other than the factual one.

    Rewards are 0 or 1 in every task here, so "other than" is the opposite outcome; it is also the event that
    makes the group of the factual leaf and the anchor's continuations mixed.

    Args:
        trees: the trees stage 2 branched (``StepResult.trees``).
        anchors: the anchors it chose (``StepResult.anchors``).

    Returns:
        The number of flipped anchors.

    Raises:
        ValueError: an anchor's tree index is out of range, or its tree does not hold ``K`` continuations of it.
    """
    per_tree: dict[int, dict[int, np.ndarray]] = {}
    num_flips = 0
    for a in anchors:
        if not 0 <= a.tree_idx < len(trees):
            raise ValueError(f"anchor {a} points at tree {a.tree_idx} of {len(trees)}: pass the trees stage 2 "
                             "branched (StepResult.trees)")
        rewards = per_tree.setdefault(a.tree_idx, continuation_rewards(trees[a.tree_idx])).get(a.node_id, np.zeros(0))
        if rewards.size != a.num_continuations:
            raise ValueError(f"tree {trees[a.tree_idx].tree_id} node {a.node_id}: {rewards.size} continuations, but "
                             f"stage 2 chose K = {a.num_continuations}; pass the trees of the step that chose it")
        num_flips += bool(np.any(rewards != a.factual_reward))
    return num_flips


def audit_metrics(result: StepResult) -> dict[str, float]:
    """The step's allocation audit, keyed as in ``AUDIT_METRIC_KEYS``.

    Args:
        result: the step (``trace.allocation.step.allocate_step``): its sampled trees are the root groups
            (for ``dapo`` every group sampled, kept or not), its trees carry stage 2's anchors.

    Returns:
        ``{"audit/groups": R, "audit/expected_mixed_groups": sum A(p_i, m_i) or NaN, "audit/mixed_groups",
        "audit/anchors": anchors branched, "audit/expected_flips": sum V_pref or NaN, "audit/flips"}``,
        all floats.

    Raises:
        ValueError: the record does not describe the trees (see ``mixed_root_groups``, ``realised_flips``).

    References:
        docs/method.md#allocation-audit.
    """
    groups = result.sampled_trees
    return {
        "audit/groups": float(len(groups)),
        "audit/expected_mixed_groups": expected_mixed_groups(result.root_pred_success_prob, result.root_counts),
        "audit/mixed_groups": float(mixed_root_groups(groups, result.root_counts)),
        "audit/anchors": float(len(result.anchors)),
        "audit/expected_flips": expected_flips(result.anchors),
        "audit/flips": float(realised_flips(result.trees, result.anchors)),
    }


def _columns(rows: list[tuple[float, float, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not rows:
        return np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)
    p, s, n = zip(*rows)
    return np.array(p), np.array(s), np.array(n, dtype=np.int64)


def root_outcomes(trees: Sequence[RolloutTree]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pred, successes, trials)``, (R,) each, of the root groups that carry a forecast: the root's
    ``pred_success_prob`` and its bare root rollouts' rewards (``root_rollout_rewards``, clipped to [0, 1]).
    Stage 1 chose these groups by the forecast alone, so their outcomes given it are not selected."""
    rows = []
    for tree in trees:
        p = tree.nodes[0].pred_success_prob
        rewards = root_rollout_rewards(tree)
        if p is not None and np.isfinite(p) and rewards.size:
            rows.append((float(p), float(np.clip(rewards, 0, 1).sum()), int(rewards.size)))
    return _columns(rows)


def anchor_outcomes(trees: Sequence[RolloutTree]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pred, successes, trials)``, (A,) each, of every branched anchor that carries a forecast: the rewards of
    its own continuations (``continuation_rewards``) and of the leaves below it that existed when it was chosen
    (created before its first continuation: the factual trajectory the rule chose it by, a root rollout in round 1,
    a continuation of an earlier round later; in the likelihood, that choice is ignorable). The root is never an
    anchor: continuations from it are the extra root rollouts of a step whose stage 2 had nowhere to branch."""
    rows = []
    for tree in trees:
        continuations = {a: r for a, r in continuation_rewards(tree).items() if a != 0}
        if not continuations:
            continue
        first = {}  # anchor -> the node id of its first continuation node
        for node in tree.nodes:
            if node.origin == Origin.BRANCH and node.branch_anchor_id in continuations:
                first.setdefault(node.branch_anchor_id, node.node_id)
        factual: dict[int, list[float]] = {}
        for leaf in tree.leaves():
            node = leaf
            while node.parent_id >= 0:
                node = tree.nodes[node.parent_id]
                if node.node_id in continuations and leaf.node_id < first[node.node_id]:
                    factual.setdefault(node.node_id, []).append(tree.reward_of(leaf))
        for anchor, rewards in continuations.items():
            p = tree.nodes[anchor].pred_success_prob
            if p is not None and np.isfinite(p):
                outcomes = np.clip(np.concatenate([rewards, factual.get(anchor, [])]), 0, 1)
                rows.append((float(p), float(outcomes.sum()), int(outcomes.size)))
    return _columns(rows)


def integrated_metrics(result: StepResult, previous_trees: Sequence[RolloutTree],
                       fitted: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The step's forecasts integrated over the spread of the truth around the prediction.

    One ``ForecastModel`` per stage is fitted (``fit_forecast_model``) on ``previous_trees`` (``root_outcomes``,
    ``anchor_outcomes``), then ``audit/integrated_mixed_groups = sum_i E[A(x_i, m_i)]`` and
    ``audit/integrated_flips = sum_a E[V_pref | r_a]`` over this step's root groups and anchors.

    Args:
        result: the step (its forecasts, ``root_counts`` and anchors, as ``audit_metrics`` reads them).
        previous_trees: the earlier steps' trees (the predictor's window), never this step's.
        fitted: ``{"root", "prefix": map}`` (a ``ForecastModel`` or an ``IsotonicMap``) already fitted on
            ``previous_trees`` by ``trace.training.recalibration.step_maps`` (``predictor.recalibrate``): the step's
            forecasts are then recalibrated already, so only the models' spread is applied (mean map the identity);
            None: fit here.

    Returns:
        The two forecasts (NaN, like ``audit_metrics``' point forecasts, for arms that read no prediction) and
        ``forecast/{root,prefix}_{alpha, beta, kappa, items}`` (an isotonic map: kappa and items). With fewer than
        ``forecast.MIN_ITEMS`` outcomes a stage keeps the point forecast (``items`` 0).
    """
    if fitted is None:
        roots = fit_forecast_model(*root_outcomes(previous_trees))
        prefixes = fit_forecast_model(*anchor_outcomes(previous_trees))
    else:
        roots, prefixes = fitted["root"], fitted["prefix"]
    spread = (roots, prefixes) if fitted is None else tuple(ForecastModel(kappa=m.kappa, num_items=m.num_items)
                                                            for m in (roots, prefixes))
    p = np.asarray(result.root_pred_success_prob, dtype=np.float64)
    groups = (float(np.sum(spread[0].mixed_group_prob(p, result.root_counts))) if p.size and not np.isnan(p).any()
              else (0.0 if not p.size else float("nan")))
    anchors = result.anchors
    v = np.array([a.pred_success_prob for a in anchors], dtype=np.float64)
    flips = 0.0 if not anchors else float("nan") if np.isnan(v).any() else float(np.sum(spread[1].flip_prob(
        [a.factual_reward for a in anchors], v, [a.num_continuations for a in anchors])))
    return {"audit/integrated_mixed_groups": groups, "audit/integrated_flips": flips, **roots.metrics("root"),
            **prefixes.metrics("prefix")}
