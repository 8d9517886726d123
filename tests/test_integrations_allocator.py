"""RolloutAllocator and the verl recipe functions (trace/integrations/): no torch, no TRL, no verl."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trace.configuration.config import AllocationConfig
from trace.integrations import RolloutAllocator
from trace.integrations.verl_recipe import plan_rollout_n, rewards_by_prompt
from trace.tree import Origin, RolloutTree

PLANNING_ARMS = ("grpo", "trace_root", "knapsack", "pcl", "greso", "mopps", "vip")
IDS = [f"math/{i}" for i in range(8)]


def _config(**update) -> AllocationConfig:
    return AllocationConfig(**{"trajectory_budget": 40, "num_candidates": 8, "group_size": 4, "m_min": 2,
                               "m_max": 8, "expansion_ratio": 0.0, **update})


def _history(allocator: RolloutAllocator) -> None:
    # 3 of 8 prompts always solved, 3 never, 2 half the time
    allocator.observe(IDS, [[1.0] * 20 if i < 3 else [0.0] * 20 if i < 6 else [1.0, 0.0] * 4 for i in range(8)],
                      [f"question {i}" for i in range(8)])


@pytest.mark.parametrize("arm", PLANNING_ARMS)
@pytest.mark.parametrize("budget", [16, 40, 64])
def test_every_planning_arm_spends_exactly_the_budget_within_bounds(arm, budget):
    allocator = RolloutAllocator(arm, _config(), seed=3)
    _history(allocator)
    allocation = allocator.allocate(IDS, [f"question {i}" for i in range(8)], trajectory_budget=budget)
    assert allocation.counts.sum() == budget and allocation.expansion_budget == 0
    assert allocation.counts.min() >= 0
    if arm != "vip":  # vip sizes groups by its own variance rule, not by m_max
        assert allocation.counts.max() <= 8


def test_trace_gives_more_to_the_prompts_whose_outcome_is_uncertain():
    allocator = RolloutAllocator("trace_root", _config())
    _history(allocator)
    counts = allocator.allocate(IDS, trajectory_budget=16).counts
    # 16 trajectories: the two half-solved prompts get the most, the always/never solved ones the least
    assert counts[6:].min() > counts[:6].max()


def test_state_survives_a_json_round_trip_and_resumes_the_same_draws():
    allocator = RolloutAllocator("mopps", _config(), seed=5)
    _history(allocator)
    restored = RolloutAllocator("mopps", _config(), seed=0)
    restored.load_state_dict(json.loads(json.dumps(allocator.state_dict())))
    assert restored.state_dict() == allocator.state_dict()
    np.testing.assert_array_equal(restored.allocate(IDS).counts, allocator.allocate(IDS).counts)
    with pytest.raises(ValueError, match="arm 'mopps'"):
        RolloutAllocator("greso", _config()).load_state_dict(allocator.state_dict())


def test_observe_reports_effective_ratio_and_forecast_vs_realised():
    allocator = RolloutAllocator("trace_root", _config())
    _history(allocator)
    allocation = allocator.allocate(IDS, trajectory_budget=16)
    rewards = [[1.0, 0.0] + [1.0] * (int(c) - 2) if i == 6 else [1.0] * int(c)
               for i, c in enumerate(allocation.counts) if c]
    active = [IDS[i] for i in np.flatnonzero(allocation.counts)]
    metrics = allocator.observe(active, rewards)
    # one mixed group of counts[6] trajectories out of 16
    assert metrics["allocation/realised_mixed_groups"] == 1
    assert metrics["allocation/effective_ratio"] == pytest.approx(allocation.counts[6] / 16)
    assert metrics["allocation/forecast_mixed_groups"] == pytest.approx(allocation.forecast_mixed_groups)
    assert 0 < allocation.forecast_mixed_groups <= len(active)


def test_rules_that_sample_while_they_allocate_need_the_callers_samplers():
    with pytest.raises(ValueError):
        RolloutAllocator("dapo", _config()).allocate(IDS)


def _two_turn_tree(prompt_id: str, rewards) -> RolloutTree:
    tree = RolloutTree(tree_id=f"t/{prompt_id}", prompt_uid=prompt_id, data_source="math", example_id=prompt_id)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
    for reward in rewards:
        first = tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, token_ids=[5], loss_mask=[1])
        tree.add_node(first.node_id, turn_idx=1, origin=Origin.ROLLOUT, token_ids=[6], loss_mask=[1], reward=reward)
    return tree


def test_trace_plans_stage_two_over_the_callers_trees():
    allocator = RolloutAllocator("trace", _config(expansion_ratio=1.0))
    _history(allocator)
    allocation = allocator.allocate(IDS, trajectory_budget=32)
    assert allocation.counts.sum() == 16 and allocation.expansion_budget == 16  # M = round(32 / 2)
    active = np.flatnonzero(allocation.counts)
    counts = allocation.counts
    trees = [_two_turn_tree(IDS[i], [1.0, 0.0] * (int(counts[i]) // 2) + [1.0] * (int(counts[i]) % 2)) for i in active]
    plan = allocator.plan_continuations(trees)
    assert sum(plan.values()) == 16
    assert all(trees[t].nodes[node].turn_idx == 0 for t, node in plan)  # anchors are non-terminal prefixes
    with pytest.raises(ValueError, match="one per active prompt"):
        allocator.plan_continuations(trees[::-1])


def test_verl_plan_drops_skipped_prompts_and_sets_rollout_n_to_the_allocation():
    allocator = RolloutAllocator("trace_root", _config())
    _history(allocator)
    uids = [f"uuid-{i}" for i in range(8)]
    plan = plan_rollout_n(allocator, uids, IDS, None, trajectory_budget=16)
    counts = plan.allocation.counts
    assert plan.rollout_n.sum() == 16 and plan.rollout_n.min() >= 1
    np.testing.assert_array_equal(plan.keep_rows, np.flatnonzero(counts))
    np.testing.assert_array_equal(plan.rollout_n, counts[counts > 0])
    assert plan.uid_to_prompt_id == {uids[i]: IDS[i] for i in plan.keep_rows}


def test_verl_rewards_are_grouped_by_uid_not_by_position():
    mapping = {"u-a": "math/1", "u-b": "math/2"}
    ids, groups = rewards_by_prompt(["u-b", "u-a", "u-b", "u-a", "u-a"], [1, 0, 0, 1, 1], mapping)
    assert ids == ["math/2", "math/1"]
    np.testing.assert_array_equal(groups[0], [1.0, 0.0])
    np.testing.assert_array_equal(groups[1], [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="not in this step's plan"):
        rewards_by_prompt(["u-c"], [1.0], mapping)


def test_the_framework_free_api_imports_without_torch_trl_or_verl():
    code = ("import sys, trace.integrations, trace.integrations.verl_recipe; "
            "bad = [m for m in ('torch', 'trl', 'verl', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], check=True)


# ---- input checks: each refused before any state changes ------------------------------------------------
def test_an_unknown_arm_names_the_argument_and_the_valid_arms():
    with pytest.raises(ValueError, match=r"RolloutAllocator\(arm='nope'\).*grpo, dapo, knapsack") as err:
        RolloutAllocator("nope")
    assert "params.yaml" not in str(err.value)


def test_an_empty_prompt_list_is_named_as_such():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        RolloutAllocator("grpo", _config()).allocate([])


@pytest.mark.parametrize("arm", ["grpo", "pcl", "greso", "mopps", "trace_root"])
@pytest.mark.parametrize("budget, error, match", [
    (-5, ValueError, r"trajectory_budget=-5 is below allocation.m_min=2"),
    (0, ValueError, r"trajectory_budget=0 is below allocation.m_min=2"),
    (1, ValueError, r"trajectory_budget=1 is below allocation.m_min=2.*pass trajectory_budget >= 2"),
    (float("nan"), ValueError, r"trajectory_budget=nan is not a whole number"),
    (31.7, ValueError, r"trajectory_budget=31.7 is not a whole number"),
    ("32", TypeError, r"trajectory_budget='32' is not a number"),
])
def test_a_budget_that_is_not_a_whole_number_of_at_least_m_min_is_refused(arm, budget, error, match):
    allocator = RolloutAllocator(arm, _config(), seed=1)
    before = allocator.state_dict()
    with pytest.raises(error, match=match):
        allocator.allocate(IDS, trajectory_budget=budget)
    assert allocator.state_dict() == before


def test_an_integral_float_budget_is_taken_and_stage_two_names_expansion_ratio():
    assert RolloutAllocator("grpo", _config()).allocate(IDS, trajectory_budget=31.0).counts.sum() == 31
    with pytest.raises(ValueError, match="leaves 1 root trajectories.*expansion_ratio"):
        RolloutAllocator("trace", _config(expansion_ratio=1.0)).allocate(IDS, trajectory_budget=2)


def test_counts_above_m_max_are_refused_not_spread_over_too_few_candidates():
    # 3 candidates cannot hold 32 trajectories at m_max=8 each (grpo used to give 11, 11, 10)
    with pytest.raises(ValueError, match=r"trajectory_budget=32 .* 3 candidate prompts .*m_max=8.*<= 24"):
        RolloutAllocator("grpo", _config()).allocate(IDS[:3], trajectory_budget=32)
    # uniform groups of group_size=8 above m_max=4: refused, and greso's record of candidates left as it was
    allocator = RolloutAllocator("greso", _config(group_size=8, m_max=4), seed=0)
    before = allocator.state_dict()
    with pytest.raises(ValueError, match=r"would give a prompt 8 trajectories, more than allocation.m_max=4"):
        allocator.allocate(IDS, trajectory_budget=16)
    assert allocator.state_dict() == before


@pytest.mark.parametrize("arm", ["trace_root", "knapsack", "greso", "mopps", "vip"])
@pytest.mark.parametrize("bad", [float("nan"), 1.5, -0.5, float("inf")])
def test_observe_refuses_rewards_outside_0_1_before_any_state_changes(arm, bad):
    allocator = RolloutAllocator(arm, _config(), seed=2)
    _history(allocator)
    allocation = allocator.allocate(IDS, [f"question {i}" for i in range(8)], trajectory_budget=16)
    active = [IDS[i] for i in np.flatnonzero(allocation.counts)]
    rewards = [[1.0, 0.0] + [1.0] * (int(c) - 2) for c in allocation.counts if c]
    rewards[-1][0] = bad
    before = json.dumps(allocator.state_dict(), allow_nan=False)
    with pytest.raises(ValueError, match=rf"prompt '{active[-1]}' has reward {bad!r}, not a finite value in \[0, 1\]"):
        allocator.observe(active, rewards)
    assert json.dumps(allocator.state_dict(), allow_nan=False) == before  # strict JSON, unchanged
    rewards[-1][0] = 1.0
    allocator.observe(active, rewards)  # the corrected outcome is taken
    assert allocator.step == 2


def test_observe_refuses_prompts_and_group_sizes_the_last_allocation_did_not_sample():
    allocator = RolloutAllocator("mopps", _config(), seed=0)
    allocation = allocator.allocate(IDS, trajectory_budget=16)
    active = [IDS[i] for i in np.flatnonzero(allocation.counts)]
    skipped = IDS[int(np.flatnonzero(allocation.counts == 0)[0])]
    before = allocator.state_dict()
    with pytest.raises(ValueError, match=rf"prompt '{skipped}' was not sampled by the last allocate"):
        allocator.observe([skipped], [[1.0] * 4])
    with pytest.raises(ValueError, match=rf"prompt '{active[0]}' has 3 rewards, the last allocate gave it 4"):
        allocator.observe(active, [[1.0] * 3] + [[1.0] * 4] * (len(active) - 1))
    with pytest.raises(ValueError, match="repeat"):
        allocator.observe([active[0], active[0]], [[1.0] * 4, [1.0] * 4])
    assert allocator.state_dict() == before


def test_a_state_without_its_keys_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"lacks 'step', 'seed', 'rule_state', 'predictor'"):
        RolloutAllocator("trace_root", _config()).load_state_dict({"format_version": 1, "arm": "trace_root"})


def test_the_arm_lists_of_the_docs_are_the_registrys():
    from trace.allocation.arms import ARMS
    from trace.integrations import planning_arms, predictor_arms, stage2_arms

    assert set(predictor_arms()) == {"knapsack", "pcl", "trace_root", "trace_prefix", "trace"}
    assert set(stage2_arms()) == {"tree_random", "treepo", "trace_prefix", "trace"}
    assert set(planning_arms()) == set(ARMS) - {"dapo", "reinforce_ada"}
    docs = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    for name, arms in (("predictor_arms", predictor_arms()), ("stage2_arms", stage2_arms())):
        listed = re.search(rf"`{name}\(\)`: ([^)]*)\)", docs)
        assert listed, f"docs/integrations.md no longer lists {name}()"
        assert re.findall(r"`(\w+)`", listed.group(1)) == list(arms)


@pytest.mark.parametrize("arm", ["trace_root", "pcl"])
def test_exploration_groups_go_to_uniformly_drawn_prompts_whatever_their_forecast(arm):
    from trace.allocation.arms import ARMS
    from trace.allocation.step import exploration_draw
    from trace.training.seeding import step_rng

    plain = RolloutAllocator(arm, _config(), seed=4)
    explored = RolloutAllocator(arm, _config(explore_groups=2), seed=4)
    for allocator in (plain, explored):
        _history(allocator)
    before = plain.allocate(IDS, trajectory_budget=16)
    after = explored.allocate(IDS, trajectory_budget=16)
    drawn = exploration_draw(ARMS[arm], 8, 2, lambda salt: step_rng(4, 1, salt))  # the step after _history
    assert before.counts[drawn].tolist() != [4, 4]  # by forecast alone they get other counts
    assert after.counts[drawn].tolist() == [4, 4] and after.counts.sum() == 16  # a group each, inside the budget
    assert after.metrics["allocation/explore_groups"] == 2.0 and "allocation/explore_groups" not in before.metrics
    # the root rule spent the rest on the other prompts
    rest = np.setdiff1d(np.arange(8), drawn)
    assert after.counts[rest].sum() == 8
    with pytest.raises(ValueError, match="explore_groups=2 x group_size=4 leaves the root rule of"):
        explored.allocate(IDS[:2], trajectory_budget=16)  # no candidate left to the rule
    with pytest.raises(ValueError, match="explore_groups=2 x group_size=4 leaves the root rule of"):
        explored.allocate(IDS, trajectory_budget=8)  # no trajectory left to it
    # arms that do not pass over prompts by forecast draw nothing: the same counts as without
    for other in ("grpo", "knapsack", "mopps"):
        a, b = RolloutAllocator(other, _config(), seed=4), RolloutAllocator(other, _config(explore_groups=2), seed=4)
        np.testing.assert_array_equal(a.allocate(IDS).counts, b.allocate(IDS).counts)
