import numpy as np
import pytest

from trace.tree import (FinishReason, Origin, RewardError, RolloutTree, check_tree_rewards, checked_reward,
                        make_prompt_uid)


def small_tree() -> RolloutTree:
    """root -> a -> b(leaf r=1); root -> c(leaf r=0); a -> d (branch, leaf r=0)."""
    t = RolloutTree("x/0/kgqa/1", "kgqa/1", "kgqa", "1")
    t.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, text="q", token_ids=[1, 2], logprobs=[0, 0], loss_mask=[0, 0])
    t.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, text="a", token_ids=[3, 4, 5], loss_mask=[1, 1, 0])
    t.add_node(1, turn_idx=1, origin=Origin.ROLLOUT, text="b", token_ids=[6], loss_mask=[1], reward=1.0,
               finish_reason=FinishReason.TERMINATED)
    t.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, text="c", token_ids=[7], loss_mask=[1], reward=0.0,
               finish_reason=FinishReason.TERMINATED)
    t.add_node(1, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=1, text="d", token_ids=[8, 9],
               loss_mask=[1, 1], reward=0.0, finish_reason=FinishReason.MAX_TURNS)
    return t


def test_leaves_paths_and_prefixes():
    t = small_tree()
    assert [n.node_id for n in t.leaves()] == [2, 3, 4]
    assert [n.node_id for n in t.path(4)] == [0, 1, 4]
    assert t.prefix_token_ids(2) == [1, 2, 3, 4, 5, 6]
    assert t.prefix_text(4) == "q a d"
    assert t.children() == [[1, 3], [2, 4], [], [], []]


def test_node_labels_are_mean_descendant_leaf_reward_weighted_by_leaf_count():
    label, weight = small_tree().node_success_labels()
    # root: leaves 1, 0, 0 -> 1/3 over 3; node a: leaves 1, 0 -> 0.5 over 2
    np.testing.assert_allclose(label, [1 / 3, 0.5, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(weight, [3, 2, 1, 1, 1])


def test_counts_of_tokens_and_trajectories():
    t = small_tree()
    assert t.num_trajectories() == 3
    assert t.num_generated_tokens() == 2 + 1 + 1 + 2
    assert FinishReason.MAX_TURNS.is_truncated and not FinishReason.TERMINATED.is_truncated


def test_add_node_rejects_missing_parent_and_second_root():
    t = small_tree()
    with pytest.raises(ValueError, match="parent_id 9"):
        t.add_node(9, turn_idx=0, origin=Origin.ROLLOUT)
    with pytest.raises(ValueError, match="already has a root"):
        t.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)


def test_prompt_uids_from_two_sources_never_collide():
    assert make_prompt_uid("hotpotqa", "7") != make_prompt_uid("gsm8k", "7")
    with pytest.raises(ValueError):
        make_prompt_uid("a/b", "1")


@pytest.mark.parametrize("reward", [5, -1, 1.0000001, -0.0001])
def test_a_reward_outside_the_declared_range_is_refused_naming_tree_and_node(reward):
    with pytest.raises(RewardError, match=r"tree t node 4: reward .* outside the environment's reward_range \[0.0, 1"):
        checked_reward(reward, "tree t node 4", (0.0, 1.0))


@pytest.mark.parametrize("reward", ["1", True, None, [1.0], float("nan"), float("inf"), -float("inf")])
def test_a_reward_that_is_not_a_finite_number_is_refused(reward):
    with pytest.raises(RewardError, match="tree t node 4"):
        checked_reward(reward, "tree t node 4", (0.0, 1.0))
    with pytest.raises(RewardError, match="tree t node 4"):
        checked_reward(reward, "tree t node 4")  # no range: type and finiteness still checked


def test_rewards_in_range_come_back_as_python_floats():
    values = [checked_reward(r, "x", (0.0, 1.0)) for r in (0, 1, 0.5, np.float32(0.25), np.int64(1))]
    assert values == [0.0, 1.0, 0.5, 0.25, 1.0] and all(type(v) is float for v in values)
    assert checked_reward(-1.0, "x", (-1.0, 1.0)) == -1.0  # a shaped verifier declares its own range
    assert checked_reward(5, "x") == 5.0  # no range given: only type and finiteness


@pytest.mark.parametrize("reward", ["1", float("nan"), True])
def test_add_node_refuses_a_reward_that_is_not_a_finite_number(reward):
    t = small_tree()
    with pytest.raises(RewardError, match=r"tree x/0/kgqa/1 node 5"):
        t.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, reward=reward, finish_reason=FinishReason.TERMINATED)
    assert len(t.nodes) == 5


def test_check_tree_rewards_names_the_node_out_of_range():
    t = small_tree()
    check_tree_rewards(t, (0.0, 1.0))
    t.nodes[3].reward = 5.0  # set behind add_node's back
    with pytest.raises(RewardError, match=r"tree x/0/kgqa/1 node 3: reward 5.0"):
        check_tree_rewards(t, (0.0, 1.0))
    check_tree_rewards(t)  # 5.0 is finite: without a range it passes


@pytest.mark.parametrize("bad", ["1", True, float("nan")])
def test_every_reward_reader_refuses_a_wrong_reward_set_after_construction(bad):
    t = small_tree()
    assert t.reward_of(t.nodes[2]) == 1.0 and t.reward_of(t.root) == 0.0  # None reads as 0.0
    t.nodes[2].reward = bad  # behind add_node's back
    for read in (lambda: t.reward_of(t.nodes[2]), t.leaf_rewards, t.subtree_stats, t.node_success_labels):
        with pytest.raises(RewardError, match=r"tree x/0/kgqa/1 node 2: reward"):
            read()
