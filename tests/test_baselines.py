"""Ablation registry, root rules, expansion rules and DAPO sampling, all at equal trajectory budget."""

import numpy as np
import pytest

from tests.test_advantages import make_tree
from trace.advantages import ESTIMATORS
from trace.allocation.arms import ARMS, get_arm, plan_root_counts
from trace.allocation.dapo import NoMixedGroupError, run_dapo
from trace.allocation.prefix_rules import plan_expansion
from trace.allocation.registry import PREFIX_RULES, ROOT_RULES
from trace.allocation.prefix import allocate_prefixes, candidate_anchors, split_expansion_budget
from trace.allocation.root import allocate_roots
from trace.configuration.config import AllocationConfig

ARM_NAMES = ("grpo", "dapo", "knapsack", "pcl", "tree_random", "treepo", "trace_root", "trace_prefix", "trace",
             "reinforce_ada", "greso", "mopps", "vip")
# the rules that plan without sampling or state (the others: tests/test_allocator_*.py)
PLANNING_ARMS = [a for a in ARM_NAMES if a not in ("dapo", "reinforce_ada", "greso", "mopps", "vip")]


def plan(name, p, budget=128, ratio=1.0, group_size=8, m_min=2, m_max=16, tie_keys=None):
    return plan_root_counts(get_arm(name), p, trajectory_budget=budget, expansion_ratio=ratio,
                            group_size=group_size, m_min=m_min, m_max=m_max, tie_keys=tie_keys)


def rollout_trees(counts, turns=3, seed=0):
    """One tree per active prompt: ``m_i`` trajectories of ``turns`` turns with random rewards."""
    rng = np.random.default_rng(seed)
    trees = []
    for i, m in enumerate(counts):
        if m:
            paths = [(j,) + (0,) * (turns - 1) for j in range(m)]
            trees.append(make_tree(paths, rng.integers(0, 2, m).astype(float).tolist(),
                                   prompt_uid=f"kgqa/q{i}", tree_id=f"t{i}")[0])
    return trees


def all_anchor_probs(trees, value=0.4):
    return {(t, node_id): value for t, tree in enumerate(trees) for node_id, _ in candidate_anchors(tree)}


# ---- registry ----------------------------------------------------------------------------------------------
def test_registry_covers_every_config_ablation_with_valid_rules():
    assert set(ARMS) == set(ARM_NAMES)
    for spec in ARMS.values():
        assert spec.root_rule in ROOT_RULES and spec.prefix_rule in PREFIX_RULES
        assert spec.estimator in ESTIMATORS
    assert get_arm("trace") is ARMS["trace"]
    assert get_arm("treepo").estimator == "treepo"


def test_unknown_ablation_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_arm("ppo")
    for name in ARMS:
        assert name in str(err.value)


# ---- root rules --------------------------------------------------------------------------------------------
def test_grpo_gives_n_each_to_the_first_t_over_n_candidates():
    counts = plan("grpo", np.full(32, np.nan)).counts
    assert counts.tolist() == [8] * 16 + [0] * 16
    counts = plan("grpo", np.full(32, np.nan), budget=130).counts
    assert counts.tolist() == [9, 9] + [8] * 14 + [0] * 16  # remainder of 2 spread over the first groups


def test_pcl_picks_predictions_nearest_one_half_with_tie_keys():
    p = np.array([0.125, 0.5, 0.375, 0.875, 0.625])  # distances 0.375, 0, 0.125, 0.375, 0.125
    assert plan("pcl", p, budget=16).counts.tolist() == [0, 8, 8, 0, 0]
    assert plan("pcl", p, budget=16, tie_keys=[0, 1, 9, 3, 4]).counts.tolist() == [0, 8, 0, 0, 8]


def test_knapsack_never_skips_when_the_budget_allows():
    p = np.array([0.02, 0.5, 0.98, 0.3])
    result = plan("knapsack", p, budget=10, m_max=4)
    assert np.all(result.counts >= 2) and result.counts.sum() == 10
    assert result.info["allow_skip"] is False


def test_knapsack_keeps_the_highest_value_prompts_when_short_of_budget():
    p = np.array([0.0, 0.5, 1.0, 0.45, 0.01, 0.99, 0.6, 0.5])
    result = plan("knapsack", p, budget=6, m_max=4)
    assert result.counts.sum() == 6 and result.info["allow_skip"] is True
    assert set(np.flatnonzero(result.counts)) <= {1, 3, 6, 7}  # the prompts nearest 0.5


def test_knapsack_gives_every_candidate_its_own_floor_while_trace_root_may_skip():
    p = np.random.default_rng(3).random(32)
    kwargs = dict(trajectory_budget=128, expansion_ratio=1.0, group_size=8, m_min=8, m_max=16)
    knapsack = plan_root_counts(get_arm("knapsack"), p, knapsack_m_min=2, **kwargs)
    assert knapsack.counts.min() >= 2 and knapsack.counts.sum() == 128
    assert knapsack.info["allow_skip"] is False
    np.testing.assert_array_equal(knapsack.counts, allocate_roots(p, 128, 2, 16, allow_skip=False).counts)
    trace_root = plan_root_counts(get_arm("trace_root"), p, knapsack_m_min=2, **kwargs)
    assert set(np.unique(trace_root.counts)) <= {0} | set(range(8, 17))  # m_min 8 holds for trace_root
    assert (trace_root.counts == 0).any()


def test_knapsack_floor_above_m_max_fails_at_config_load():
    with pytest.raises(ValueError, match="knapsack_m_min"):
        AllocationConfig(m_min=2, m_max=4, knapsack_m_min=6)


def test_trace_root_spends_the_whole_budget_through_allocate_roots():
    p = np.random.default_rng(0).random(32)
    result = plan("trace_root", p)
    np.testing.assert_array_equal(result.counts, allocate_roots(p, 128, 2, 16).counts)
    assert result.expansion_budget == 0 and "gap" in result.info


@pytest.mark.parametrize("budget,ratio", [(128, 1.0), (130, 0.5), (64, 3.0), (128, 0.0)])
def test_trace_splits_roots_and_continuations_like_the_config(budget, ratio):
    p = np.random.default_rng(1).random(32)
    result = plan("trace", p, budget=budget, ratio=ratio)
    root_budget = AllocationConfig(trajectory_budget=budget, expansion_ratio=ratio).root_budget
    assert result.counts.sum() == root_budget
    assert result.expansion_budget == budget - root_budget


def test_dapo_is_refused_by_the_planner():
    with pytest.raises(ValueError, match="run_dapo"):
        plan("dapo", np.zeros(4))


# ---- equal budget ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PLANNING_ARMS)
@pytest.mark.parametrize("budget,ratio,num_candidates", [(128, 1.0, 32), (130, 0.5, 20), (64, 3.0, 40)])
def test_every_rule_samples_exactly_the_trajectory_budget(name, budget, ratio, num_candidates):
    p = np.random.default_rng(2).random(num_candidates)
    roots = plan(name, p, budget=budget, ratio=ratio)
    active = np.flatnonzero(roots.counts)
    trees = rollout_trees(roots.counts)
    per_tree = split_expansion_budget(roots.counts[active], roots.expansion_budget)
    expansion = plan_expansion(get_arm(name), trees, all_anchor_probs(trees), per_tree,
                               np.random.default_rng(3), treepo_width=2)
    assert expansion.unspent == 0
    assert int(roots.counts.sum()) + expansion.total == budget
    for (t, node_id), k in expansion.counts.items():
        assert k > 0 and node_id in dict(candidate_anchors(trees[t]))


# ---- expansion rules -------------------------------------------------------------------------------------
def test_trace_expansion_is_allocate_prefixes_on_each_tree():
    trees = rollout_trees([3, 4], seed=5)
    probs = {key: 0.1 + 0.8 * ((key[1] * 37) % 10) / 10 for key in all_anchor_probs(trees)}
    result = plan_expansion(get_arm("trace"), trees, probs, [3, 4], np.random.default_rng(0))
    for t, tree in enumerate(trees):
        anchors = candidate_anchors(tree)
        expected = allocate_prefixes([a[1] for a in anchors], [probs[(t, a[0])] for a in anchors], [3, 4][t],
                                     tie_keys=[a[0] for a in anchors])
        got = [result.counts.get((t, a[0]), 0) for a in anchors]
        assert got == expected.tolist()


def test_trace_expansion_needs_every_anchor_scored():
    trees = rollout_trees([2])
    probs = all_anchor_probs(trees)
    probs.pop(next(iter(probs)))
    with pytest.raises(KeyError, match="score every candidate anchor"):
        plan_expansion(get_arm("trace"), trees, probs, [2], np.random.default_rng(0))


def test_random_expansion_is_reproducible_and_uses_only_candidates():
    trees = rollout_trees([4, 4])
    spec = get_arm("tree_random")
    first = plan_expansion(spec, trees, None, [5, 3], np.random.default_rng(7))
    second = plan_expansion(spec, trees, None, [5, 3], np.random.default_rng(7))
    assert first.counts == second.counts and first.total == 8
    assert sum(k for (t, _), k in first.counts.items() if t == 0) == 5


def test_treepo_branches_shallowest_depth_first_at_fixed_width():
    tree, ids = make_tree([(0, 0, 0), (1, 0, 0)], [1.0, 0.0])  # anchors (0,), (1,) at turn 0; (0,0), (1,0) at turn 1
    spec = get_arm("treepo")
    five = plan_expansion(spec, [tree], None, [5], np.random.default_rng(0), treepo_width=2).counts
    assert five[(0, ids[(0,)])] == 2 and five[(0, ids[(1,)])] == 2
    assert five.get((0, ids[(0, 0)]), 0) + five.get((0, ids[(1, 0)]), 0) == 1
    ten = plan_expansion(spec, [tree], None, [10], np.random.default_rng(0), treepo_width=2).counts
    shallow = sorted([ten[(0, ids[(0,)])], ten[(0, ids[(1,)])]])
    assert shallow == [2, 4] and ten[(0, ids[(0, 0)])] == ten[(0, ids[(1, 0)])] == 2  # one pass of 8, then 2


def test_anchorless_trees_hand_their_budget_to_the_others():
    with_anchors_a = rollout_trees([2], turns=3)[0]
    one_turn = rollout_trees([3], turns=1)[0]
    with_anchors_b = rollout_trees([2], turns=2)[0]
    trees = [with_anchors_a, one_turn, with_anchors_b]
    result = plan_expansion(get_arm("tree_random"), trees, None, [4, 6, 2], np.random.default_rng(0))
    assert result.budget_per_tree.tolist() == [8, 0, 4]  # 6 split 4:2
    assert result.total == 12 and result.unspent == 0


def test_without_any_anchor_the_budget_is_returned_unspent():
    trees = rollout_trees([3, 2], turns=1)
    result = plan_expansion(get_arm("trace"), trees, {}, [3, 5], np.random.default_rng(0))
    assert result.counts == {} and result.unspent == 8


def test_arms_without_expansion_refuse_continuations():
    trees = rollout_trees([2])
    with pytest.raises(ValueError, match="no prefix expansion"):
        plan_expansion(get_arm("grpo"), trees, None, [2], np.random.default_rng(0))
    assert plan_expansion(get_arm("grpo"), trees, None, [0], np.random.default_rng(0)).total == 0


# ---- dapo --------------------------------------------------------------------------------------------------
def mixed_when(predicate, calls=None):
    def rollout_fn(candidates, n):
        if calls is not None:
            calls.append(candidates.tolist())
        return [np.array([1.0] + [0.0] * (n - 1)) if predicate(c) else np.zeros(n) for c in candidates.tolist()]
    return rollout_fn


def test_dapo_filters_all_equal_groups_within_the_budget():
    calls = []
    result = run_dapo(mixed_when(lambda c: c % 3 == 0, calls), num_candidates=32, group_size=4,
                      trajectory_budget=32, max_retries=4, rng=np.random.default_rng(0))
    assert result.num_rounds == 1 and len(calls) == 1 and len(calls[0]) == 8
    assert result.num_trajectories == 32 and result.unspent == 0
    assert result.kept_candidates.tolist() == [c for c in calls[0] if c % 3 == 0]
    assert all(r.max() > r.min() for r in result.kept_rewards)


def test_dapo_refills_dropped_slots_with_fresh_candidates_until_it_finds_one():
    target = 11
    result = run_dapo(mixed_when(lambda c: c == target), num_candidates=16, group_size=4,
                      trajectory_budget=64, max_retries=16, rng=np.random.default_rng(1), target_groups=1)
    sampled = result.sampled_candidates.tolist()
    assert result.kept_candidates.tolist() == [target] and sampled[-1] == target
    assert len(set(sampled)) == len(sampled)  # every candidate sampled at most once
    assert result.num_rounds == len(sampled)  # one refill round per dropped group
    assert result.num_trajectories == 4 * len(sampled) <= 64


def test_dapo_never_exceeds_the_budget_while_refilling():
    result = run_dapo(mixed_when(lambda c: c % 4 == 0), num_candidates=40, group_size=4, trajectory_budget=24,
                      max_retries=10, rng=np.random.default_rng(2), target_groups=4)
    assert result.num_trajectories <= 24
    assert result.num_trajectories + result.unspent == 24
    assert len(result.kept_candidates) <= 4


def test_dapo_without_any_mixed_group_raises_its_own_error_naming_the_retry_key():
    with pytest.raises(NoMixedGroupError, match="allocation.dapo_max_retries") as err:
        run_dapo(mixed_when(lambda c: False), num_candidates=8, group_size=4, trajectory_budget=16,
                 max_retries=2, rng=np.random.default_rng(0))
    assert err.value.num_rounds == 1 and err.value.num_trajectories == 16  # round 1 spent the whole budget


def test_dapo_lets_an_error_of_the_rollouts_through_unchanged():
    from trace.envs.qa import RetrieverError

    def unreachable(candidates, n):
        raise RetrieverError("retriever http://127.0.0.1:9/retrieve did not answer")

    with pytest.raises(RetrieverError) as err:
        run_dapo(unreachable, num_candidates=8, group_size=4, trajectory_budget=16, max_retries=2,
                 rng=np.random.default_rng(0))
    assert not isinstance(err.value, NoMixedGroupError)


def test_dapo_retry_bound_is_respected():
    calls = []
    with pytest.raises(NoMixedGroupError) as err:
        run_dapo(mixed_when(lambda c: False, calls), num_candidates=50, group_size=2, trajectory_budget=100,
                 max_retries=3, rng=np.random.default_rng(0), target_groups=2)
    assert len(calls) == 4 and err.value.num_rounds == 4  # round 1 plus three retries


def test_an_unsplittable_root_budget_fails_at_config_load_naming_the_arm_and_key():
    from trace.configuration.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as err:
        config_from_dict({"allocation": {"num_candidates": 4, "m_min": 8, "m_max": 16},
                          "train": {"ablations": ["grpo", "knapsack"]}})
    message = str(err.value)
    assert "train.ablations has knapsack" in message and "allocation.knapsack_m_min=2" in message
    assert "[8, 64]" in message and "{" not in message  # the message, not the section's whole mapping
    # the same budget is fine for arms without stage 1
    config_from_dict({"allocation": {"num_candidates": 4, "m_min": 8, "m_max": 16}, "train": {"ablations": ["grpo"]}})


# ---- the stage-1 objective -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arm", ["trace", "trace_root"])
def test_root_objective_reaches_the_trace_rule(arm):
    p = np.random.default_rng(7).beta(0.3, 0.3, size=32)
    kwargs = dict(trajectory_budget=128, expansion_ratio=1.0, group_size=8, m_min=4, m_max=16)
    spec = get_arm(arm)
    groups = plan_root_counts(spec, p, **kwargs)
    leaves = plan_root_counts(spec, p, root_objective="leaves", **kwargs)
    budget = 64 if spec.has_expansion else 128
    np.testing.assert_array_equal(groups.counts, allocate_roots(p, budget, 4, 16).counts)
    np.testing.assert_array_equal(leaves.counts, allocate_roots(p, budget, 4, 16, root_objective="leaves").counts)
    assert leaves.counts.sum() == budget and not np.array_equal(groups.counts, leaves.counts)
    # fewer, larger groups: a group's value grows with its size under leaves
    assert np.count_nonzero(leaves.counts) < np.count_nonzero(groups.counts)
    assert groups.info["root_objective"] == "groups" and leaves.info["root_objective"] == "leaves"
    expected = float(np.sum(leaves.counts * (1 - p ** leaves.counts - (1 - p) ** leaves.counts)))
    assert leaves.info["objective"] == pytest.approx(expected)


def test_knapsack_keeps_its_own_objective_under_leaves():
    p = np.random.default_rng(8).random(16)
    groups = plan("knapsack", p, budget=64)
    leaves = plan_root_counts(get_arm("knapsack"), p, trajectory_budget=64, expansion_ratio=1.0, group_size=8,
                              m_min=2, m_max=16, root_objective="leaves")
    np.testing.assert_array_equal(groups.counts, leaves.counts)
    assert leaves.info["root_objective"] == "groups"


def test_unknown_root_objective_is_refused_with_the_key():
    with pytest.raises(ValueError, match=r"allocation\.root_objective='prompts'.*\['groups', 'leaves'\]"):
        plan_root_counts(get_arm("trace"), np.full(4, 0.5), trajectory_budget=16, expansion_ratio=1.0,
                         group_size=8, m_min=2, m_max=8, root_objective="prompts")


def test_allocation_config_validates_the_root_objective():
    assert AllocationConfig().root_objective == "groups"
    assert AllocationConfig(root_objective="leaves").root_objective == "leaves"
    with pytest.raises(ValueError, match=r"root_objective\s+Input should be 'groups' or 'leaves'"):
        AllocationConfig(root_objective="prompts")
