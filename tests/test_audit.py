"""The allocation audit: stage 1's and stage 2's forecasts against the realised mixed groups and flips."""

import math

import numpy as np
import pytest

from trace.allocation.arms import get_arm
from trace.allocation.root import activation_prob
from trace.allocation.samplers import SimulatorSampler
from trace.allocation.step import AnchorChoice, StepResult, allocate_step
from trace.reporting.audit import (
    AUDIT_METRIC_KEYS,
    audit_metrics,
    expected_flips,
    expected_mixed_groups,
    mixed_root_groups,
    realised_flips,
)
from trace.configuration.config import AllocationConfig, PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.simulator import SimulatorEnvironment
from trace.predictor.registry import make_predictor
from trace.training.seeding import candidate_indices, step_rng
from trace.tree import Origin, RolloutTree


# ---- hand-built trees ------------------------------------------------------------------------------------------
def chain(tree, parent, turns, reward, origin=Origin.ROLLOUT, anchor=-1, first_turn=0):
    """Append one trajectory of ``turns`` turns below ``parent``; returns its node ids."""
    ids = []
    for t in range(turns):
        last = t == turns - 1
        node = tree.add_node(parent, turn_idx=first_turn + t, origin=origin, branch_anchor_id=anchor,
                             reward=reward if last else None)
        ids.append(node.node_id)
        parent = node.node_id
    return ids


def new_tree(uid="sim/0"):
    tree = RolloutTree(tree_id=f"t/{uid}", prompt_uid=uid, data_source="sim", example_id=uid.split("/")[1])
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
    return tree


def branched_trees():
    """Tree 0: root rollouts [1, 0] (nodes 1-2, 3-4); anchor 1 (factual 1) gets continuations [1, 1] (no
    flip), anchor 3 (factual 0) gets [0, 1] (flip), and node 8 of a continuation of anchor 3 gets one more
    round below it (node 10, reward 0).
    Tree 1: root rollouts [1, 1] plus an extra root rollout with reward 0: not mixed by its root rollouts."""
    a = new_tree("sim/0")
    first = chain(a, 0, 2, 1.0)   # nodes 1, 2
    second = chain(a, 0, 2, 0.0)  # nodes 3, 4
    chain(a, first[0], 1, 1.0, Origin.BRANCH, first[0], 1)  # 5
    chain(a, first[0], 1, 1.0, Origin.BRANCH, first[0], 1)  # 6
    chain(a, second[0], 1, 0.0, Origin.BRANCH, second[0], 1)  # 7
    cont = chain(a, second[0], 2, 1.0, Origin.BRANCH, second[0], 1)  # 8, 9
    chain(a, cont[0], 1, 0.0, Origin.BRANCH, cont[0], 2)  # 10: round 2 below node 8
    b = new_tree("sim/1")
    chain(b, 0, 1, 1.0)
    chain(b, 0, 1, 1.0)
    chain(b, 0, 1, 0.0, Origin.BRANCH, 0)  # an extra root rollout
    return [a, b]


def test_expected_mixed_groups_is_the_sum_of_activation_probabilities():
    # A(0.5, 2) = 0.5 and A(0.1819, 4) = 0.5510 (docs/method.md test vectors); A(0.3, 1) = 0
    assert expected_mixed_groups([0.5, 0.1819, 0.3], [2, 4, 1]) == pytest.approx(0.5 + 0.5510, abs=1e-4)
    assert expected_mixed_groups([], []) == 0.0
    assert math.isnan(expected_mixed_groups([np.nan, 0.5], [8, 8]))
    with pytest.raises(ValueError, match="one value per root group"):
        expected_mixed_groups([0.5], [2, 2])


def test_a_root_group_is_mixed_by_its_root_rollouts_only():
    a, b = branched_trees()
    assert mixed_root_groups([a, b]) == 1  # tree b's extra root rollout (reward 0) does not count
    assert mixed_root_groups([a, b], [2, 2]) == 1
    with pytest.raises(ValueError, match="m_i = 3"):
        mixed_root_groups([a, b], [2, 3])
    with pytest.raises(ValueError, match="one m_i per"):
        mixed_root_groups([a, b], [2])


def test_expected_flips_is_the_sum_of_v_pref():
    # V_pref(1, 0.3, 2) = 0.91 and V_pref(0, 0.3, 1) = 0.30 (docs/method.md test vectors)
    anchors = [AnchorChoice(0, 1, 1.0, 0.3, 2), AnchorChoice(0, 3, 0.0, 0.3, 1)]
    assert expected_flips(anchors) == pytest.approx(1.21)
    assert expected_flips([]) == 0.0
    assert math.isnan(expected_flips([AnchorChoice(0, 1, 1.0, np.nan, 2)]))


def test_an_anchor_flips_when_one_of_its_own_continuations_differs_from_the_factual_reward():
    trees = branched_trees()
    round_one = [AnchorChoice(0, 1, 1.0, 0.9, 2), AnchorChoice(0, 3, 0.0, 0.2, 2)]
    assert realised_flips(trees, round_one) == 1  # anchor 1: [1, 1] against 1; anchor 3: [0, 1] against 0
    # node 8 (factual 1) flips through its own continuation (node 10, reward 0), which is not anchor 3's
    assert realised_flips(trees, [AnchorChoice(0, 8, 1.0, 0.5, 1)]) == 1
    assert realised_flips(trees, [AnchorChoice(0, 1, 0.0, 0.5, 2)]) == 1
    with pytest.raises(ValueError, match="chose K = 3"):
        realised_flips(trees, [AnchorChoice(0, 1, 1.0, 0.5, 3)])
    with pytest.raises(ValueError, match="tree 2 of 2"):
        realised_flips(trees, [AnchorChoice(2, 1, 1.0, 0.5, 2)])


def test_audit_metrics_reads_the_step_record():
    trees = branched_trees()
    result = StepResult(trees=trees, sampled_trees=trees, root_pred_success_prob=np.array([0.5, 0.5]),
                        root_counts=np.array([2, 2]),
                        anchors=[AnchorChoice(0, 1, 1.0, 0.3, 2), AnchorChoice(0, 3, 0.0, 0.3, 2)])
    out = audit_metrics(result)
    assert tuple(out) == AUDIT_METRIC_KEYS
    # A(0.5, 2) = 0.5 twice; V_pref(1, 0.3, 2) = 0.91, V_pref(0, 0.3, 2) = 0.51
    assert out == pytest.approx({"audit/groups": 2.0, "audit/expected_mixed_groups": 1.0, "audit/mixed_groups": 1.0,
                                 "audit/anchors": 2.0, "audit/expected_flips": 1.42, "audit/flips": 1.0})


# ---- the step's record on the simulator --------------------------------------------------------------------
ACFG = AllocationConfig(trajectory_budget=128, num_candidates=32, group_size=8, m_max=16)


def simulated(arm, env, predictor, step, acfg=ACFG):
    pool = env.prompts("train")
    idx = candidate_indices(len(pool), acfg.num_candidates, 0, step)
    sampler = SimulatorSampler(env, predictor, step_rng(0, step, "sim-roots"),
                               lambda salt: step_rng(0, step, f"sim-{salt}"), step=step, ablation=arm)
    return allocate_step(get_arm(arm), [pool[i] for i in idx], sampler, acfg, lambda salt: step_rng(0, step, salt))


def oracle_simulator(clip=0.0, num_prompts=256):
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=num_prompts), seed=0)
    return env, make_predictor(PredictorConfig(kind=PredictorKind.ORACLE, clip=clip), env=env)


def node_records(trees):
    return [[(n.node_id, n.parent_id, n.reward, n.num_branches, n.pred_success_prob, n.origin, n.branch_anchor_id)
             for n in t.nodes] for t in trees]


@pytest.mark.parametrize("arm", ["trace", "trace_prefix", "tree_random", "grpo", "dapo"])
def test_the_step_records_its_root_counts_predictions_and_anchors(arm):
    env, oracle = oracle_simulator()
    result = simulated(arm, env, oracle, 0)
    assert result.root_counts.tolist() == [sum(n.origin == Origin.ROLLOUT for n in t.leaves())
                                           for t in result.sampled_trees]
    preds = [t.root.pred_success_prob for t in result.sampled_trees]
    if get_arm(arm).uses_predictor:
        assert result.root_pred_success_prob.tolist() == preds
    else:
        assert np.isnan(result.root_pred_success_prob).all() and len(preds) == len(result.sampled_trees)
    branches = sum(n.num_branches for t in result.trees for n in t.nodes[1:])
    assert sum(a.num_continuations for a in result.anchors) == branches
    for a in result.anchors:
        node = result.trees[a.tree_idx].nodes[a.node_id]
        assert a.num_continuations == node.num_branches
        assert (a.pred_success_prob == node.pred_success_prob) if get_arm(arm).prefix_rule == "trace" \
            else math.isnan(a.pred_success_prob)
        # one round: the factual reward is that of the bare rollout through the anchor
        factual = [leaf.reward for leaf in result.trees[a.tree_idx].leaves() if leaf.origin == Origin.ROLLOUT
                   and a.node_id in {n.node_id for n in result.trees[a.tree_idx].path(leaf.node_id)}]
        assert [a.factual_reward] == factual


def test_the_audit_changes_no_tree_and_draws_nothing():
    env, oracle = oracle_simulator()
    result = simulated("trace", env, oracle, 3)
    before = node_records(result.trees)
    state = np.random.get_state()[1].copy()
    first = audit_metrics(result)
    assert node_records(result.trees) == before and (np.random.get_state()[1] == state).all()
    assert audit_metrics(result) == first
    assert node_records(simulated("trace", env, oracle, 3).trees) == before


def test_arms_without_predictions_have_no_forecast_but_realised_counts():
    env, oracle = oracle_simulator()
    result = simulated("tree_random", env, oracle, 0)
    out = audit_metrics(result)
    assert math.isnan(out["audit/expected_mixed_groups"]) and math.isnan(out["audit/expected_flips"])
    # uniform roots: M = T / (1 + N) = 64 root rollouts in groups of n = 8
    assert out["audit/groups"] == len(result.sampled_trees) == 8 and out["audit/anchors"] > 0 and 0 < out["audit/flips"] <= out["audit/anchors"]
    out = audit_metrics(simulated("trace_root", env, oracle, 0))
    assert out["audit/anchors"] == out["audit/flips"] == out["audit/expected_flips"] == 0.0


def audit_z_scores(arm, env, predictor, num_steps, acfg=ACFG, count_shift=0):
    """z = sum(realised - forecast) / sqrt(sum Var) over steps, for mixed groups and flips.

    Given ``p_i`` and ``m_i``, group ``i`` is mixed with probability ``A(p_i, m_i)``; given ``(r, v, K)``, an
    anchor flips with probability ``V_pref(r, v, K)``. The outcomes are independent Bernoullis, so the sums'
    variance is ``sum A (1 - A)`` (``sum V_pref (1 - V_pref)``). The forecast is the audit's own, or with
    ``count_shift != 0`` one recomputed here with ``m_i + count_shift`` and ``K + count_shift``.
    """
    from trace.allocation.prefix import prefix_value

    diff = np.zeros(2)
    var = np.zeros(2)
    for step in range(num_steps):
        result = simulated(arm, env, predictor, step, acfg)
        a = activation_prob(result.root_pred_success_prob, result.root_counts + count_shift)
        v = prefix_value([x.factual_reward for x in result.anchors], [x.pred_success_prob for x in result.anchors],
                         [x.num_continuations + count_shift for x in result.anchors])
        out = audit_metrics(result)
        forecast = ([out["audit/expected_mixed_groups"], out["audit/expected_flips"]] if count_shift == 0
                    else [a.sum(), v.sum()])
        diff += [out["audit/mixed_groups"] - forecast[0], out["audit/flips"] - forecast[1]]
        var += [np.sum(a * (1 - a)), np.sum(v * (1 - v))]
    return diff / np.sqrt(var)


def test_with_the_true_values_realised_minus_expected_is_zero_on_average():
    env, oracle = oracle_simulator(clip=0.0)
    z_groups, z_flips = audit_z_scores("trace", env, oracle, num_steps=60)
    assert abs(z_groups) < 3.5 and abs(z_flips) < 3.5
    # the same check rejects forecasts with m_i and K off by one
    for shift in (-1, 1):
        z_groups, z_flips = audit_z_scores("trace", env, oracle, num_steps=60, count_shift=shift)
        assert abs(z_groups) > 4.5 and abs(z_flips) > 4.5


def test_two_rounds_audit_each_anchor_once_against_its_own_continuations():
    env, oracle = oracle_simulator(clip=0.0)
    acfg = ACFG.model_copy(update={"rounds": 2})
    result = simulated("trace", env, oracle, 0, acfg)
    keys = [(a.tree_idx, a.node_id) for a in result.anchors]
    assert len(keys) == len(set(keys)) and sum(a.num_continuations for a in result.anchors) == 64
    assert any(result.trees[t].nodes[n].origin == Origin.BRANCH for t, n in keys)  # round-2 anchors
    z_groups, z_flips = audit_z_scores("trace", env, oracle, num_steps=30, acfg=acfg)
    assert abs(z_groups) < 3.5 and abs(z_flips) < 3.5


def test_a_miscalibrated_predictor_shows_as_a_forecast_above_the_outcome():
    # clipping the true values to [0.2, 0.8] makes the U-shaped prompts and prefixes look contested: both
    # stages expect more than the simulator delivers
    env, clipped = oracle_simulator(clip=0.2)
    z_groups, z_flips = audit_z_scores("trace", env, clipped, num_steps=20)
    assert z_groups < -4.5 and z_flips < -3
