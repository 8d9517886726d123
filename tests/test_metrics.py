"""Rollout metrics: the DESIGN vector, hand-worked trees, and a slow reference for the effective ratio."""

import numpy as np
import pytest
from hypothesis import given, settings

from tests.test_advantages import empty_leaf, leaves_under, make_tree, reward_of, tree_batches, without_empty_leaves
from trace.metrics import (
    ROLLOUT_METRIC_KEYS,
    active_prompt_ratio,
    anchor_contrast,
    effective_leaves,
    effective_ratio,
    effective_token_ratio,
    mixed_group_ratio,
    rollout_metrics,
)
from trace.tree import RewardError


def flat_groups():
    # three prompts with terminal groups [1,1,1,1], [1,0,0,0], [0,0]
    return [
        make_tree([(i,) for i in range(4)], [1, 1, 1, 1], prompt_uid="kgqa/a", tree_id="a")[0],
        make_tree([(i,) for i in range(4)], [1, 0, 0, 0], prompt_uid="kgqa/b", tree_id="b")[0],
        make_tree([(i,) for i in range(2)], [0, 0], prompt_uid="kgqa/c", tree_id="c")[0],
    ]


def test_effective_ratio_matches_design_vector():
    assert effective_ratio(flat_groups()) == pytest.approx(0.4)  # 4 of 10 leaves


def test_effective_leaves_flags_follow_tree_leaf_order():
    flags = effective_leaves(flat_groups())
    assert [f.tolist() for f in flags] == [[False] * 4, [True] * 4, [False] * 2]


def test_prompt_and_group_ratios_on_flat_groups():
    trees = flat_groups()
    assert active_prompt_ratio(trees) == pytest.approx(1 / 3)
    assert active_prompt_ratio(trees, num_candidates=6) == pytest.approx(1 / 6)  # 3 skipped prompts
    assert mixed_group_ratio(trees) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="num_candidates"):
        active_prompt_ratio(trees, num_candidates=2)


def test_effective_token_ratio_counts_shared_prefix_tokens_once():
    # prompt a: root -> x (3 tokens) -> {l1: 1, l2: 0} is mixed: x, l1, l2 effective (9 tokens);
    # prompt b: root -> {y: 1, z: 1} is constant (6 tokens). 9 / 15 = 0.6
    mixed, _ = make_tree([(0, 0), (0, 1)], [1, 0], prompt_uid="kgqa/a", tree_id="a", tokens_per_turn=3)
    constant, _ = make_tree([(0,), (1,)], [1, 1], prompt_uid="kgqa/b", tree_id="b", tokens_per_turn=3)
    assert effective_token_ratio([mixed, constant]) == pytest.approx(0.6)
    assert effective_ratio([mixed, constant]) == pytest.approx(0.5)


def test_mixed_group_ratio_counts_anchor_groups():
    # prompt group [1,0,0,1,1,0] mixed; anchor A [1,0,0] mixed; anchor B [1,1,1] constant: 2 of 3
    tree, _ = make_tree([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)], [1, 0, 0, 1, 1, 1])
    assert mixed_group_ratio([tree]) == pytest.approx(2 / 3)


def test_anchor_contrast_prefers_true_probability_over_prediction():
    tree, ids = make_tree([(0, 0), (0, 1), (1,)], [1, 0, 0])
    anchor = tree.nodes[ids[(0,)]]
    anchor.num_branches, anchor.pred_success_prob, anchor.true_success_prob = 1, 0.5, 0.1
    assert anchor_contrast([tree]) == pytest.approx(0.09)
    anchor.true_success_prob = None
    assert anchor_contrast([tree]) == pytest.approx(0.25)
    anchor.num_branches = 0
    assert anchor_contrast([tree]) == 0.0


def test_rollout_metrics_keys_and_hand_values():
    trees = flat_groups()
    out = rollout_metrics(trees)
    assert tuple(out) == ROLLOUT_METRIC_KEYS
    assert all(isinstance(v, float) for v in out.values())
    assert out["effective_ratio"] == pytest.approx(0.4)
    assert out["reward/mean"] == pytest.approx(5 / 10)
    assert out["turns/mean"] == 1.0
    assert out["tokens/generated"] == 10 * 3
    assert out["tools/calls"] == 10
    assert out["rollout/trajectories"] == 10
    assert out["rollout/prompts"] == 3


def test_an_empty_leaf_is_in_no_group_but_counts_as_sampled():
    # prompt a: rewards [1, 0, 0] with the rewarded leaf empty -> its group is [0, 0], not mixed;
    # prompt b: [1, 0], mixed. Effective: b's 2 of 5 sampled leaves, and b's 6 of the 12 generated tokens.
    a, ids = make_tree([(0,), (1,), (2,)], [1.0, 0.0, 0.0], prompt_uid="kgqa/a", tree_id="a")
    empty_leaf(a, ids[(0,)])
    b, _ = make_tree([(0,), (1,)], [1.0, 0.0], prompt_uid="kgqa/b", tree_id="b")
    assert effective_ratio([a, b]) == pytest.approx(2 / 5)
    assert [f.tolist() for f in effective_leaves([a, b])] == [[False] * 3, [True] * 2]
    assert effective_token_ratio([a, b]) == pytest.approx(6 / 12)
    assert mixed_group_ratio([a, b]) == pytest.approx(1 / 2)
    assert active_prompt_ratio([a, b]) == pytest.approx(1 / 2)
    assert rollout_metrics([a, b])["rollout/trajectories"] == 5.0


def test_metrics_of_an_empty_step_are_zero():
    out = rollout_metrics([])
    assert all(v == 0.0 for v in out.values())


def slow_effective_ratio(trees):
    by_prompt = {}
    for tree in trees:
        by_prompt.setdefault(tree.prompt_uid, []).extend(reward_of(leaf) for leaf in tree.leaves())
    flags = []
    for tree in trees:
        children = tree.children()
        for leaf in tree.leaves():
            groups = [by_prompt[tree.prompt_uid]]
            groups += [[reward_of(n) for n in leaves_under(tree, a.node_id)]
                       for a in tree.path(leaf.node_id)[1:-1] if len(children[a.node_id]) >= 2]
            flags.append(any(len(g) >= 2 and max(g) > min(g) for g in groups))
    return float(np.mean(flags)) if flags else 0.0


@settings(max_examples=40, deadline=None)
@given(trees=tree_batches())
def test_effective_ratio_matches_slow_reference(trees):
    assert effective_ratio(trees) == pytest.approx(slow_effective_ratio(trees))
    assert 0.0 <= effective_token_ratio(trees) <= 1.0


@settings(max_examples=40, deadline=None)
@given(trees=tree_batches(with_empty_leaves=True))
def test_effective_leaves_with_empty_leaves_are_those_of_the_trees_without_them(trees):
    pruned, _ = without_empty_leaves(trees)
    num_sampled = sum(len(tree.leaves()) for tree in trees)
    num_effective = slow_effective_ratio(pruned) * sum(len(tree.leaves()) for tree in pruned)
    assert effective_ratio(trees) * num_sampled == pytest.approx(num_effective)


@pytest.mark.parametrize("bad", ["1", True])
def test_rollout_metrics_refuse_a_reward_of_the_wrong_type_set_after_construction(bad):
    trees = flat_groups()
    trees[1].nodes[2].reward = bad  # prompt b's second leaf, behind add_node's back
    with pytest.raises(RewardError, match=rf"tree b node 2: reward {bad!r} .*not a number"):
        rollout_metrics(trees)
