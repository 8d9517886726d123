"""Forecasts integrated over the truth's spread (trace.predictor.forecast) and the audit's use of them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace.allocation.prefix import prefix_value
from trace.allocation.root import activation_prob
from trace.allocation.step import AnchorChoice, StepResult
from trace.predictor.forecast import ForecastModel, beta_moment, fit_forecast_model
from trace.reporting.audit import anchor_outcomes, integrated_metrics, root_outcomes
from trace.tree import Origin, RolloutTree


def test_beta_moments_match_hand_worked_values():
    # Beta(2, 3): E[x] = 2/5, E[x^2] = 2*3 / (5*6) = 0.2, E[x^0] = 1
    assert beta_moment(0.4, 5.0, [0, 1, 2]) == pytest.approx([1.0, 0.4, 0.2])
    assert beta_moment(0.0, 5.0, 3) == 0.0 and beta_moment(1.0, 5.0, 3) == pytest.approx(1.0)
    assert beta_moment(0.3, math.inf, 2) == pytest.approx(0.09)  # a point mass
    with pytest.raises(ValueError, match="kappa=0"):
        beta_moment(0.5, 0.0, 1)


def test_the_point_model_is_the_allocators_own_formulas():
    point = ForecastModel()
    p = np.array([0.0, 0.1, 0.5, 0.93, 1.0])
    m = np.array([8, 2, 16, 8, 4])
    assert point.mixed_group_prob(p, m) == pytest.approx(activation_prob(p, m))
    r = np.array([1.0, 0.0, 1.0, 0.0, 1.0])
    assert point.flip_prob(r, p, m) == pytest.approx(prefix_value(r, p, m))


def test_a_uniform_spread_gives_the_hand_worked_forecasts():
    uniform = ForecastModel(kappa=2.0)  # q = 0.5, kappa 2: x ~ Beta(1, 1)
    # E[x^m] = 1 / (m + 1): E[A] = 1 - 2 / 9 for m = 8, against 1 - 2 / 256 for the point 0.5 (Jensen)
    assert uniform.mixed_group_prob([0.5], [8]) == pytest.approx([1 - 2 / 9])
    assert ForecastModel().mixed_group_prob([0.5], [8]) == pytest.approx([1 - 2 / 256])
    # after a factual success x ~ Beta(2, 1), E[x] = 2/3: one continuation flips with 1/3 (the point: 1/2)
    assert uniform.flip_prob([1.0], [0.5], [1]) == pytest.approx([1 / 3])
    assert uniform.flip_prob([0.0], [0.5], [1]) == pytest.approx([1 / 3])
    assert uniform.flip_prob([1.0], [0.5], [0]) == pytest.approx([0.0])


def _simulate(rng, num, alpha, beta, kappa, m):
    p = rng.uniform(0.05, 0.95, size=num)
    q = 1 / (1 + np.exp(-(alpha + beta * np.log(p / (1 - p)))))
    x = rng.beta(q * kappa, (1 - q) * kappa)
    return p, rng.binomial(m, x).astype(float), np.full(num, m)


def test_the_fit_recovers_a_known_spread_and_its_forecasts_hold_out_of_sample():
    rng = np.random.default_rng(0)
    p, s, n = _simulate(rng, 4000, 0.4, 0.7, 1.5, 8)
    model = fit_forecast_model(p, s, n)
    assert model.alpha == pytest.approx(0.4, abs=0.12) and model.beta == pytest.approx(0.7, abs=0.12)
    assert model.kappa == pytest.approx(1.5, rel=0.2) and model.num_items == 4000
    # new groups of the same law: the integrated forecast matches the realised mixed groups, the point one does not
    p2, s2, n2 = _simulate(rng, 2000, 0.4, 0.7, 1.5, 8)
    realised = float(np.sum((s2 > 0) & (s2 < n2)))
    integrated = float(np.sum(model.mixed_group_prob(p2, n2)))
    point = float(np.sum(activation_prob(p2, n2)))
    assert abs(integrated - realised) < 4 * math.sqrt(realised)  # within Poisson-like noise
    assert point > 1.3 * realised


def test_too_few_or_uniform_outcomes_keep_the_point_forecast():
    assert fit_forecast_model([0.5] * 7, [1] * 7, [2] * 7) == ForecastModel()
    assert fit_forecast_model([0.5] * 20, [0] * 20, [4] * 20) == ForecastModel()
    with pytest.raises(ValueError, match="successes in"):
        fit_forecast_model([0.5], [3], [2], min_items=1)
    with pytest.raises(ValueError, match="one value per item"):
        fit_forecast_model([0.5, 0.4], [1], [2])
    with pytest.raises(ValueError, match="must be finite"):
        fit_forecast_model([0.5] * 9 + [float("nan")], [1] * 10, [2] * 10)
    with pytest.raises(ValueError, match="integers >= 0"):
        beta_moment(0.5, 2.0, 2.5)


def test_a_fit_on_many_outcomes_per_item_moves_from_its_start():
    # 10^7 outcomes each, truth spread Beta(0.5 * 2000, 0.5 * 2000): the fit must reach a large kappa, not stop near 10
    rng = np.random.default_rng(3)
    p = np.full(50, 0.5)
    n = np.full(50, 10**7)
    s = rng.binomial(n, rng.beta(1000.0, 1000.0, size=50)).astype(float)
    assert fit_forecast_model(p, s, n).kappa == pytest.approx(2000.0, rel=0.5)


def _tree(name, root_p, root_rewards, anchor_p=None, continuations=()):
    """A root with rollouts of 2 turns each (rewards ``root_rewards``); the first rollout's middle node is an
    anchor with forecast ``anchor_p`` and the given continuation rewards."""
    tree = RolloutTree(tree_id=f"t/{name}", prompt_uid=f"u/{name}", data_source="toy", example_id=name)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
    tree.nodes[0].pred_success_prob = root_p
    middles = []
    for reward in root_rewards:
        mid = tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT)
        tree.add_node(mid.node_id, turn_idx=1, origin=Origin.ROLLOUT, reward=float(reward))
        middles.append(mid)
    if continuations:
        anchor = middles[0]
        anchor.pred_success_prob = anchor_p
        anchor.num_branches = len(continuations)
        for reward in continuations:
            tree.add_node(anchor.node_id, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=anchor.node_id,
                          reward=float(reward))
    return tree


def test_extra_root_rollouts_are_not_an_anchor_and_later_rounds_keep_their_factual_leaf():
    # a step whose stage 2 had nowhere to branch: its extra root rollouts hang from the root (anchor id 0)
    extra = _tree("x", 0.4, [1, 0])
    for reward in (1, 1):
        extra.add_node(0, turn_idx=0, origin=Origin.BRANCH, branch_anchor_id=0, reward=float(reward))
    assert anchor_outcomes([extra])[0].size == 0
    # round 1 branches A (node 1) with two continuations; round 2 branches A2, the middle node of one of them
    tree = _tree("r", 0.5, [0], 0.6, [])
    a = tree.nodes[1]
    a.pred_success_prob = 0.6
    mid = tree.add_node(1, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=1)  # continuation of A: 2 turns
    tree.add_node(mid.node_id, turn_idx=2, origin=Origin.BRANCH, branch_anchor_id=1, reward=0.0)
    tree.add_node(1, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=1, reward=1.0)
    mid.pred_success_prob = 0.4  # round 2: A2 = mid, its factual leaf (reward 0) is A's continuation
    for reward in (1, 1):
        tree.add_node(mid.node_id, turn_idx=2, origin=Origin.BRANCH, branch_anchor_id=mid.node_id, reward=float(reward))
    p, s, n = anchor_outcomes([tree])
    # A: the root rollout through it (0) and its continuations (0 below mid, 1); A2: its factual 0 and (1, 1). The
    # continuations of A2 lie below A but came after A's first continuation: they are not A's factual leaves
    assert dict(zip(p.tolist(), zip(s.tolist(), n.tolist()))) == {0.6: (1.0, 3), 0.4: (2.0, 3)}


def test_outcomes_are_read_from_the_trees_the_allocator_sampled():
    trees = [_tree("a", 0.3, [1, 0, 0], 0.6, [1, 1]), _tree("b", None, [1, 1]), _tree("c", 0.8, [1, 1, 0, 1])]
    p, s, n = root_outcomes(trees)
    assert p.tolist() == [0.3, 0.8] and s.tolist() == [1, 3] and n.tolist() == [3, 4]  # "b" has no forecast
    # the anchor of "a": its 2 continuations (1, 1) and the factual rollout through it (1); the continuations
    # are not root rollouts, so its group keeps 3 rollouts
    p, s, n = anchor_outcomes(trees)
    assert p.tolist() == [0.6] and s.tolist() == [3] and n.tolist() == [3]


def test_integrated_metrics_fit_on_earlier_trees_and_forecast_this_step():
    rng = np.random.default_rng(1)
    previous = []
    for i in range(40):  # forecasts of 0.5 whose truth is 0 or 1: every group agrees
        previous.append(_tree(f"p{i}", 0.5, [float(rng.random() < 0.5)] * 4))
    result = StepResult(trees=[], sampled_trees=[], root_pred_success_prob=np.array([0.5, 0.5]),
                        root_counts=np.array([8, 8]),
                        anchors=[AnchorChoice(0, 1, 1.0, 0.5, 2)])
    m = integrated_metrics(result, previous)
    assert m["forecast/root_items"] == 40 and m["forecast/root_kappa"] < 0.2  # all-or-nothing truth
    assert m["audit/integrated_mixed_groups"] < 0.2 * float(np.sum(activation_prob([0.5, 0.5], [8, 8])))
    assert m["forecast/prefix_items"] == 0 and math.isnan(m["forecast/prefix_kappa"])  # no anchors before
    assert m["audit/integrated_flips"] == pytest.approx(prefix_value(1.0, 0.5, 2))  # the point forecast
    none = StepResult(trees=[], sampled_trees=[], root_pred_success_prob=np.array([np.nan]), root_counts=np.array([8]))
    assert math.isnan(integrated_metrics(none, previous)["audit/integrated_mixed_groups"])
    assert integrated_metrics(StepResult(trees=[], sampled_trees=[]), [])["audit/integrated_flips"] == 0.0
