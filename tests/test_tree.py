import numpy as np
import pytest

from trace.tree import FinishReason, Origin, RolloutTree, make_prompt_uid


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
