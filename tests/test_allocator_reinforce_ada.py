"""Reinforce-Ada's root rule: rounds, retirement, refills and leftovers worked by hand; the budget on the simulator."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_allocation_step import simulator
from trace.allocation.arms import get_arm
from trace.allocation.registry import RootRequest
from trace.allocation.reinforce_ada import is_retired, reinforce_ada_root_rule
from trace.allocation.samplers import SimulatorSampler
from trace.allocation.step import allocate_step
from trace.configuration.config import AllocationConfig
from trace.configuration.config_allocators import ReinforceAdaConfig
from trace.tree import Origin, RolloutTree


class ScriptedPrompts:
    """``sample_groups`` / ``sample_more`` over one-turn rollouts whose rewards are scripted per candidate.

    Candidate ``i``'s rollouts take ``scripts[i]`` in order, whichever round draws them. Later rounds' rollouts
    arrive as ``Origin.BRANCH`` nodes anchored at the root, as the samplers' continuations do, so the rule's
    relabelling is visible. ``calls`` records ``("groups", salt, candidates, n)`` and
    ``("more", salt, {candidate: count})`` in call order.
    """

    def __init__(self, scripts):
        self.scripts = {i: iter(rewards) for i, rewards in enumerate(scripts)}
        self.candidate_of = {}  # id(tree) -> candidate index
        self.calls = []

    def _draw(self, tree, candidate, count, origin, anchor_id):
        for _ in range(count):
            tree.add_node(0, turn_idx=0, origin=origin, branch_anchor_id=anchor_id,
                          reward=next(self.scripts[candidate]))

    def sample_groups(self, candidates, n, salt):
        self.calls.append(("groups", salt, candidates.tolist(), n))
        trees = []
        for i in candidates.tolist():
            tree = RolloutTree(tree_id=f"test/0/ada/q{i}", prompt_uid=f"ada/q{i}", data_source="ada",
                               example_id=f"q{i}")
            tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
            self._draw(tree, i, n, Origin.ROLLOUT, -1)
            self.candidate_of[id(tree)] = i
            trees.append(tree)
        return trees

    def sample_more(self, trees, counts, salt):
        self.calls.append(("more", salt, {self.candidate_of[id(t)]: int(k) for t, k in zip(trees, counts) if k}))
        for tree, k in zip(trees, counts):
            self._draw(tree, self.candidate_of[id(tree)], int(k), Origin.BRANCH, 0)


def run_rule(scripts, budget, *, group_size=2, default_keep=False, **settings_):
    """The rule on ``len(scripts)`` candidates with ``allocation.reinforce_ada`` = ``settings_``; ``keep`` unset is
    None (the exit's n is ``group_size``) unless ``default_keep``, which leaves the config's default."""
    if not default_keep:
        settings_.setdefault("keep", None)
    prompts = ScriptedPrompts(scripts)
    acfg = AllocationConfig(trajectory_budget=max(budget, 4), group_size=group_size,
                            reinforce_ada=ReinforceAdaConfig(**settings_))
    request = RootRequest(pred_success_prob=np.full(len(scripts), np.nan), root_budget=budget,
                          trajectory_budget=budget, group_size=group_size, m_min=2, m_max=16, knapsack_m_min=None,
                          tie_keys=None, exact_max_cells=1, max_retries=0, sample_groups=prompts.sample_groups,
                          sample_more=prompts.sample_more, config=acfg)
    return reinforce_ada_root_rule(request), prompts.calls


# p0's second reward is exactly the threshold 0.7: a negative (positive means > 0.7)
SCRIPTS = [[1.0, 0.7, 0.0],  # p0
           [1.0, 1.0, 1.0, 0.0],  # p1
           [0.0] * 6,  # p2: never a positive
           [0.0, 1.0]]  # p3


def test_the_strict_threshold_makes_a_reward_at_the_threshold_negative():
    # balanced with n = 2 wants 1 positive and 1 negative; 0.7 is not > 0.7
    assert is_retired(np.array([1.0, 0.7]), 2, "balanced", 0.7)
    assert not is_retired(np.array([0.7, 0.7]), 2, "positive_focused", 0.7)
    assert is_retired(np.array([0.7, 0.71]), 2, "positive_focused", 0.7)
    # n = 5: 5 // 2 = 2 positives and 5 - 2 = 3 negatives
    assert not is_retired(np.array([1, 1, 1, 0, 0.7]), 5, "balanced", 0.7)
    assert is_retired(np.array([1, 1, 0, 0, 0.7]), 5, "balanced", 0.7)
    with pytest.raises(ValueError, match="positive_focused"):
        is_retired(np.array([1.0]), 2, "greedy", 0.7)


def test_balanced_rounds_retire_prompts_with_one_positive_and_one_negative():
    """T = 14, round_repeat 2, max_rounds 3, n = 2 (1 positive + 1 negative), 4 candidates.

    initial = 14 // (2 * 2) = 3 prompts.
    round 0 ("ada0"): p0, p1, p2 get 2 each; spent 6. p0 [1, 0.7]: 1 pos, 1 neg -> retired.
        p1 [1, 1]: no negative. p2 [0, 0]: no positive.
    round 1 ("ada1"): active p1, p2 get 2 each; spent 10. p1 [1, 1, 1, 0] -> retired. p2 four 0s (2 rounds).
    round 2 ("ada2"): active p2 gets 2; spent 12. p2 six 0s, its 3rd round: max_rounds reached.
    round 3 ("ada3"): none active: min(4 - 3, max(1, 2 // 2)) = 1 new prompt, p3 gets min(2, 2) = 2; spent 14.
        p3 [0, 1] -> retired.
    counts [2, 4, 6, 2]; 4 rounds, 4 prompts, 3 retired (p2 ran out of rounds without meeting the rule).
    """
    decision, calls = run_rule(SCRIPTS, 14, round_repeat=2, max_rounds=3, mode="balanced")
    assert calls == [("groups", "ada0", [0, 1, 2], 2), ("more", "ada1", {1: 2, 2: 2}), ("more", "ada2", {2: 2}),
                     ("groups", "ada3", [3], 2)]
    assert decision.counts.tolist() == [2, 4, 6, 2] and decision.counts.dtype == np.int64
    assert decision.metrics == {"reinforce_ada/rounds": 4.0, "reinforce_ada/prompts": 4.0,
                                "reinforce_ada/retired": 3.0}
    assert decision.expansion_budget == 0 and decision.trees == decision.sampled_trees
    assert [t.leaf_rewards().tolist() for t in decision.trees] == [[1.0, 0.7], [1.0, 1.0, 1.0, 0.0], [0.0] * 6,
                                                                  [0.0, 1.0]]


def test_positive_focused_retires_at_the_first_positive_and_spreads_the_leftover_once_candidates_run_out():
    """The same scripts, T = 14, mode positive_focused (retire at 1 positive).

    round 0 ("ada0"): p0 [1, 0.7] and p1 [1, 1] retired; p2 [0, 0] not; spent 6.
    round 1 ("ada1"): p2 +2; spent 8.  round 2 ("ada2"): p2 +2 (3rd round, max); spent 10.
    round 3 ("ada3"): none active: min(1, max(1, 4 // 2)) = 1 new prompt, p3 [0, 1] -> retired; spent 12.
    round 4: none active and no candidate left: the 2 left go one by one in tree order ("ada4"):
        2 // 4 = 0 each, the first 2 % 4 = 2 trees +1 -> p0 [1, 0.7, 0], p1 [1, 1, 1].
    counts [3, 3, 6, 2]; 5 sampling rounds; 3 retired.
    """
    decision, calls = run_rule(SCRIPTS, 14, round_repeat=2, max_rounds=3, mode="positive_focused")
    assert calls == [("groups", "ada0", [0, 1, 2], 2), ("more", "ada1", {2: 2}), ("more", "ada2", {2: 2}),
                     ("groups", "ada3", [3], 2), ("more", "ada4", {0: 1, 1: 1})]
    assert decision.counts.tolist() == [3, 3, 6, 2]
    assert decision.metrics == {"reinforce_ada/rounds": 5.0, "reinforce_ada/prompts": 4.0,
                                "reinforce_ada/retired": 3.0}


def test_fresh_candidates_enter_when_every_prompt_retired_early():
    """T = 11, round_repeat 2, n = 2, 6 candidates that all retire at once ([1, 0] each).

    initial = 11 // 4 = 2.
    round 0 ("ada0"): p0, p1 get 2 each, both retired; spent 4, left 7.
    round 1 ("ada1"): none active: min(6 - 2, max(1, 7 // 2)) = 3 new prompts p2, p3, p4 with 2 each; spent 10.
    round 2 ("ada2"): none active, left 1: min(1, max(1, 0)) = 1 new prompt, p5 with min(2, 1) = 1; spent 11.
    counts [2, 2, 2, 2, 2, 1]: no leftover spread (that would put 7 on p0, p1: [6, 5, 0, 0, 0, 0]).
    """
    decision, calls = run_rule([[1.0, 0.0]] * 6, 11, round_repeat=2, max_rounds=4)
    assert calls == [("groups", "ada0", [0, 1], 2), ("groups", "ada1", [2, 3, 4], 2), ("groups", "ada2", [5], 1)]
    assert decision.counts.tolist() == [2, 2, 2, 2, 2, 1]
    assert decision.metrics == {"reinforce_ada/rounds": 3.0, "reinforce_ada/prompts": 6.0,
                                "reinforce_ada/retired": 5.0}  # p5's single positive lacks a negative


def test_a_last_round_gives_what_is_left_in_candidate_order():
    """T = 9, round_repeat 2, max_rounds 4, n = 2, 3 candidates that never see a positive.

    initial = 9 // 4 = 2: round 0 p0, p1 get 2 each (spent 4); round 1 both +2 (spent 8); round 2 left 1:
    p0 gets min(2, 1) = 1, p1 min(2, 0) = 0. p2 never enters: counts [5, 4, 0].
    """
    decision, calls = run_rule([[0.0] * 8] * 3, 9, round_repeat=2, max_rounds=4)
    assert calls == [("groups", "ada0", [0, 1], 2), ("more", "ada1", {0: 2, 1: 2}), ("more", "ada2", {0: 1})]
    assert decision.counts.tolist() == [5, 4, 0]


def test_later_rounds_are_relabelled_bare_rollouts_and_roots_count_every_rollout():
    decision, _ = run_rule(SCRIPTS, 14, round_repeat=2, max_rounds=3, mode="positive_focused")
    for tree in decision.trees:
        assert [n.origin for n in tree.nodes] == [Origin.PROMPT] + [Origin.ROLLOUT] * (len(tree.nodes) - 1)
        assert all(n.branch_anchor_id == -1 for n in tree.nodes)
        assert tree.root.num_branches == tree.num_trajectories()


def test_the_rule_refuses_a_pure_plan_and_a_budget_without_candidates():
    prompts = ScriptedPrompts([])
    common = dict(root_budget=8, trajectory_budget=8, group_size=2, m_min=2, m_max=16, knapsack_m_min=None,
                  tie_keys=None, exact_max_cells=1, max_retries=0)
    with pytest.raises(ValueError, match="allocate_step"):
        reinforce_ada_root_rule(RootRequest(pred_success_prob=np.full(3, np.nan), **common))
    with pytest.raises(ValueError, match="num_candidates"):
        reinforce_ada_root_rule(RootRequest(pred_success_prob=np.zeros(0), sample_groups=prompts.sample_groups,
                                            sample_more=prompts.sample_more, **common))


# ---- the budget on the simulator ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(budget=st.integers(3, 80), num_candidates=st.integers(1, 16), group_size=st.integers(2, 8),
       round_repeat=st.integers(1, 10), max_rounds=st.integers(1, 5),
       mode=st.sampled_from(["balanced", "positive_focused"]), initial_prompts=st.one_of(st.none(), st.integers(1, 6)),
       positive_threshold=st.sampled_from([0.0, 0.5, 0.7]), seed=st.integers(0, 2 ** 16))
def test_every_step_samples_exactly_the_trajectory_budget_as_bare_rollouts(
        budget, num_candidates, group_size, round_repeat, max_rounds, mode, initial_prompts, positive_threshold, seed):
    env, oracle = simulator(seed=seed % 4)
    acfg = AllocationConfig(trajectory_budget=budget, num_candidates=num_candidates, group_size=group_size,
                            reinforce_ada=ReinforceAdaConfig(round_repeat=round_repeat, max_rounds=max_rounds,
                                                             mode=mode, initial_prompts=initial_prompts,
                                                             positive_threshold=positive_threshold))

    def rng_for(salt):
        return np.random.default_rng([seed, sum(map(ord, salt))])

    sampler = SimulatorSampler(env, oracle, np.random.default_rng(seed), rng_for, step=0, ablation="reinforce_ada")
    result = allocate_step(get_arm("reinforce_ada"), env.prompts()[:num_candidates], sampler, acfg, rng_for)
    assert sum(t.num_trajectories() for t in result.sampled_trees) == budget
    assert result.trees == result.sampled_trees and len({t.prompt_uid for t in result.trees}) == len(result.trees)
    assert result.root_counts.sum() == budget and np.all(result.root_counts >= 1)
    for tree in result.sampled_trees:
        assert all(n.origin in (Origin.PROMPT, Origin.ROLLOUT) and n.branch_anchor_id == -1 for n in tree.nodes)
        assert tree.root.num_branches == tree.num_trajectories()


def test_by_default_a_prompt_retires_at_two_positives_and_two_negatives():
    # the original's exit (keep 4 in its script): budget 16, 8 a round, one prompt first (initial 16 // 16 = 1):
    # p0 draws 2 positives and 6 negatives in round 1, enough for 2 + 2: retired, so p1 enters with the other 8.
    # keep = None (n = group_size = 8) would want 4 + 4 and give p0 round 2 instead (the next test).
    assert ReinforceAdaConfig().keep == 4
    scripts = [[1.0, 1.0] + [0.0] * 14, [0.0] * 8]
    by_default, calls = run_rule(scripts, 16, group_size=8, round_repeat=8, default_keep=True)
    assert by_default.counts.tolist() == [8, 8] and calls[1] == ("groups", "ada1", [1], 8)
    # 1 positive + 7 negatives is not enough
    assert not is_retired(np.array([1.0] + [0.0] * 7), ReinforceAdaConfig().keep, "balanced", 0.7)


def test_keep_sets_the_balanced_exit_apart_from_the_group_size():
    # budget 16, 8 a round, one prompt first (initial 16 // 16 = 1): p0 draws 2 positives and 6 negatives in round 1.
    # With n = group_size = 8 it needs 4 and 4: active, round 2 gives it 8 more. With keep = 4 it needs 2 and 2:
    # retired after round 1, so the next candidate p1 enters with the other 8.
    scripts = [[1.0, 1.0] + [0.0] * 14, [0.0] * 8]
    by_group, calls = run_rule(scripts, 16, group_size=8, round_repeat=8)
    assert by_group.counts.tolist() == [16, 0] and calls[1] == ("more", "ada1", {0: 8})
    by_keep, calls = run_rule(scripts, 16, group_size=8, round_repeat=8, keep=4)
    assert by_keep.counts.tolist() == [8, 8] and calls[1] == ("groups", "ada1", [1], 8)
    assert by_keep.metrics["reinforce_ada/retired"] == 1.0
