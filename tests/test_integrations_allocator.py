"""RolloutAllocator and the verl recipe functions (trace/integrations/): no torch, no TRL, no verl."""
from __future__ import annotations

import json
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
