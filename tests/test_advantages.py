"""Advantage estimators: hand-worked vectors, conventions, and slow path-by-path references."""

import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace.advantages import (
    ESTIMATORS,
    TreeBatch,
    assign_advantages,
    compute_advantages,
    get_estimator,
    group_zscore,
)
from trace.configuration.config import Estimator
from trace.tree import Origin, RewardError, RolloutTree


# ---- tree building (also used by the allocation and metric tests) ----------------------------------------
def make_tree(leaf_paths, rewards, prompt_uid="kgqa/q0", tree_id=None, tokens_per_turn=3):
    """A tree whose leaves are the given label paths (one label per turn), with rewards at the leaves.

    Returns:
        (tree, ids): ``ids[path_prefix]`` is the node id of that prefix; ``ids[()] == 0`` is the root.
    """
    data_source, example_id = prompt_uid.split("/")
    tree = RolloutTree(tree_id=tree_id or f"test/0/{prompt_uid}", prompt_uid=prompt_uid,
                       data_source=data_source, example_id=example_id)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=[1, 2], loss_mask=[0, 0])
    ids = {(): 0}
    for path, reward in zip(leaf_paths, rewards):
        path = tuple(path)
        for depth in range(1, len(path) + 1):
            prefix = path[:depth]
            if prefix not in ids:
                node = tree.add_node(ids[prefix[:-1]], turn_idx=depth - 1, origin=Origin.ROLLOUT,
                                     token_ids=[7] * (tokens_per_turn + 2),
                                     loss_mask=[1] * tokens_per_turn + [0, 0], num_tool_calls=1)
                ids[prefix] = node.node_id
        tree.nodes[ids[path]].reward = reward
    return tree, ids


def chain_tree(parents, leaf_rewards, prompt_uid="kgqa/q0", tree_id=None):
    """A tree from a parent list (``parents[i]`` is the parent of node ``i + 1``), rewards at leaves in id order."""
    data_source, example_id = prompt_uid.split("/")
    tree = RolloutTree(tree_id=tree_id or f"test/0/{prompt_uid}", prompt_uid=prompt_uid,
                       data_source=data_source, example_id=example_id)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
    for parent in parents:
        depth = 0 if parent == 0 else tree.nodes[parent].turn_idx + 1
        tree.add_node(parent, turn_idx=depth, origin=Origin.ROLLOUT, token_ids=[3, 4], loss_mask=[1, 1])
    for leaf, reward in zip(tree.leaves(), leaf_rewards):
        leaf.reward = reward
    return tree


# ---- slow references: loops over paths --------------------------------------------------------------------
def slow_z(values, eps, std_floor, baseline="mean", scale="std"):
    n = len(values)
    if n < 2 or max(values) == min(values):
        return [0.0] * n
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    if std < std_floor:
        return [0.0] * n
    if baseline == "mean":
        centred = [v - mean for v in values]
    else:  # the mean of the other members
        centred = [v - (sum(values) - v) / (n - 1) for v in values]
    return [c / (std + eps) if scale == "std" else c for c in centred]


def slow_clip(value, clip, negative_weight=1.0):
    value = value if clip is None else max(-clip, min(clip, value))
    return negative_weight * value if value < 0 else value


def reward_of(node):
    return 0.0 if node.reward is None else float(node.reward)


def leaves_under(tree, node_id):
    return [leaf for leaf in tree.leaves() if any(n.node_id == node_id for n in tree.path(leaf.node_id))]


def prompt_leaves(trees):
    groups = defaultdict(list)
    for t, tree in enumerate(trees):
        for leaf in tree.leaves():
            groups[tree.prompt_uid].append((t, leaf.node_id, reward_of(leaf)))
    return groups


def rows_to_nodes(trees, row_at):
    """Node advantage = sum over leaf rows through the node of ``row_at(t, leaf_id, node_id)``."""
    out = [np.zeros(len(tree.nodes)) for tree in trees]
    for t, tree in enumerate(trees):
        for leaf in tree.leaves():
            for node in tree.path(leaf.node_id)[1:]:
                out[t][node.node_id] += row_at(t, leaf.node_id, node.node_id)
    return out


def slow_prompt_z(trees, eps, std_floor, **group):
    z = {}
    for members in prompt_leaves(trees).values():
        for (t, leaf_id, _), value in zip(members, slow_z([m[2] for m in members], eps, std_floor, **group)):
            z[(t, leaf_id)] = value
    return z


def slow_grpo(trees, eps, std_floor, clip, negative_weight=1.0, **group):
    z = slow_prompt_z(trees, eps, std_floor, **group)
    return rows_to_nodes(trees, lambda t, leaf, node: slow_clip(z[(t, leaf)], clip, negative_weight))


def slow_tree_grpo(trees, eps, std_floor, clip, negative_weight=1.0, **group):
    inter = slow_prompt_z(trees, eps, std_floor, **group)
    row = {}
    for t, tree in enumerate(trees):
        children = tree.children()
        for leaf in tree.leaves():
            terms = []
            for anchor in tree.path(leaf.node_id)[1:-1]:
                if len(children[anchor.node_id]) >= 2:
                    members = leaves_under(tree, anchor.node_id)
                    zs = slow_z([reward_of(n) for n in members], eps, std_floor, **group)
                    terms.append(zs[[n.node_id for n in members].index(leaf.node_id)])
            intra = sum(terms) / len(terms) if terms else 0.0
            row[(t, leaf.node_id)] = slow_clip(inter[(t, leaf.node_id)] + intra, clip, negative_weight)
    return rows_to_nodes(trees, lambda t, leaf, node: row[(t, leaf)])


def slow_treerpo(trees, eps, std_floor, clip, negative_weight=1.0, **options):
    def value(t, node_id):
        group = leaves_under(trees[t], node_id)
        return sum(reward_of(n) for n in group) / len(group)

    def siblings(t, node_id):
        tree = trees[t]
        parent = tree.nodes[node_id].parent_id
        if parent == 0:  # first turns of every tree of the prompt
            return [(s, c) for s, other in enumerate(trees) if other.prompt_uid == tree.prompt_uid
                    for c in other.children()[0]]
        return [(t, c) for c in tree.children()[parent]]

    cache = {}

    def advantage(t, node_id):
        if node_id == 0:
            return 0.0
        if (t, node_id) not in cache:
            group = siblings(t, node_id)
            if len(group) == 1:
                cache[(t, node_id)] = advantage(t, trees[t].nodes[node_id].parent_id)
            else:
                zs = slow_z([value(s, c) for s, c in group], eps, std_floor, **options)
                cache[(t, node_id)] = zs[group.index((t, node_id))]
        return cache[(t, node_id)]

    return rows_to_nodes(trees, lambda t, leaf, node: slow_clip(advantage(t, node), clip, negative_weight))


def slow_treepo(trees, eps, std_floor, clip, negative_weight=1.0, baseline="mean", scale="std"):
    groups = prompt_leaves(trees)
    raw = {}
    for t, tree in enumerate(trees):
        for leaf in tree.leaves():
            total = weight = 0.0
            for ancestor in tree.path(leaf.node_id)[:-1]:
                if ancestor.is_root:
                    members = [m[2] for m in groups[tree.prompt_uid]]
                else:
                    members = [reward_of(n) for n in leaves_under(tree, ancestor.node_id)]
                if len(members) >= 2:
                    r = reward_of(leaf)
                    base = (sum(members) / len(members) if baseline == "mean"
                            else (sum(members) - r) / (len(members) - 1))
                    total += len(members) * (r - base)
                    weight += len(members)
            raw[(t, leaf.node_id)] = total / weight if weight else 0.0
    keys = list(raw)
    white = dict(zip(keys, slow_z([raw[k] for k in keys], eps, std_floor, scale=scale)))
    return rows_to_nodes(trees, lambda t, leaf, node: slow_clip(white[(t, leaf)], clip, negative_weight))


SLOW = {"grpo": slow_grpo, "tree_grpo": slow_tree_grpo, "treerpo": slow_treerpo, "treepo": slow_treepo}


def empty_leaf(tree, node_id, keep_tokens=True):
    """Make a leaf that generated nothing: its tokens stay as context (mask all 0) or it has no tokens."""
    node = tree.nodes[node_id]
    if keep_tokens:
        node.loss_mask = [0] * len(node.token_ids)
    else:
        node.token_ids, node.logprobs, node.loss_mask = [], [], []


def without_empty_leaves(trees):
    """Each tree with every node removed that has no leaf with generated tokens at or below it.

    Returns:
        (pruned trees, per tree the kept node ids in order: ``kept[t][new_id] = old_id``).
    """
    pruned, kept_ids = [], []
    for tree in trees:
        live = [False] * len(tree.nodes)
        for leaf in tree.leaves():
            if leaf.num_generated_tokens > 0:
                for node in tree.path(leaf.node_id):
                    live[node.node_id] = True
        live[0] = True
        copy = RolloutTree(tree_id=tree.tree_id, prompt_uid=tree.prompt_uid, data_source=tree.data_source,
                           example_id=tree.example_id)
        new_id = {}
        for node in tree.nodes:
            if live[node.node_id]:
                new_id[node.node_id] = len(copy.nodes)
                copy.add_node(-1 if node.is_root else new_id[node.parent_id], turn_idx=node.turn_idx,
                              origin=node.origin, token_ids=list(node.token_ids), loss_mask=list(node.loss_mask),
                              reward=node.reward)
        pruned.append(copy)
        kept_ids.append(sorted(new_id, key=new_id.get))
    return pruned, kept_ids


def slow_without_empty_leaves(slow):
    """The slow reference run on the pruned trees; removed nodes carry 0."""
    def run(trees, eps, std_floor, clip):
        pruned, kept_ids = without_empty_leaves(trees)
        out = [np.zeros(len(tree.nodes)) for tree in trees]
        for t, values in enumerate(slow(pruned, eps, std_floor, clip)):
            out[t][kept_ids[t]] = values
        return out
    return run


# ---- registry ----------------------------------------------------------------------------------------------
def test_registry_names_match_the_config_enum():
    assert set(ESTIMATORS) == {e.value for e in Estimator}
    assert get_estimator(Estimator.TREE_GRPO) is ESTIMATORS["tree_grpo"]


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_estimator("gae")
    for name in ESTIMATORS:
        assert name in str(err.value)


# ---- hand-worked vectors -----------------------------------------------------------------------------------
def design_tree_grpo_tree():
    # one prompt, two bare rollouts; rollout 1 branched at anchor A (leaves [1,0,0]), rollout 2 at B ([1,1,0])
    return make_tree([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)], [1, 0, 0, 1, 1, 0])


def leaf_values(tree, values):
    return np.array([values[leaf.node_id] for leaf in tree.leaves()])


def test_tree_grpo_matches_design_vector():
    # inter: rewards [1,0,0,1,1,0], mean 0.5, std sqrt(0.3) -> +-0.9129
    # intra under A [1,0,0]: mean 1/3, std sqrt(1/3) -> 1.1547, -0.5774; under B [1,1,0] -> 0.5774, -1.1547
    tree, _ = design_tree_grpo_tree()
    (values,) = compute_advantages([tree], "tree_grpo", eps=1e-6, std_floor=1e-3)
    np.testing.assert_allclose(leaf_values(tree, values),
                               [2.0676, -1.4902, -1.4902, 1.4902, 1.4902, -2.0676], atol=1e-4)


def test_tree_grpo_anchor_node_carries_the_sum_of_its_leaf_rows():
    tree, ids = design_tree_grpo_tree()
    (values,) = compute_advantages([tree], "tree_grpo")
    # anchor A carries 2.0676 - 1.4902 - 1.4902 = -0.9129 (= 3 * inter mean of its rows + 0 intra sum)
    np.testing.assert_allclose(values[ids[(0,)]], 2.0676 - 2 * 1.4902, atol=1e-4)
    assert values[0] == 0.0


def test_grpo_matches_hand_computed_zscores():
    # rewards [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 -> [1.5, -0.5, -0.5, -0.5]
    tree, _ = make_tree([(0,), (1,), (2,), (3,)], [1, 0, 0, 0])
    (values,) = compute_advantages([tree], "grpo", eps=1e-6)
    np.testing.assert_allclose(leaf_values(tree, values), [1.5, -0.5, -0.5, -0.5], atol=1e-5)


def test_grpo_groups_leaves_by_prompt_uid_across_trees():
    # the two trees of prompt "kgqa/a" form one group [1, 0]; prompt "kgqa/b" alone is constant
    tree_a1, _ = make_tree([(0,)], [1.0], prompt_uid="kgqa/a", tree_id="t1")
    tree_a2, _ = make_tree([(0,)], [0.0], prompt_uid="kgqa/a", tree_id="t2")
    tree_b, _ = make_tree([(0,), (1,)], [1.0, 1.0], prompt_uid="kgqa/b", tree_id="t3")
    out = compute_advantages([tree_a1, tree_a2, tree_b], "grpo", eps=1e-6)
    z = 0.5 / math.sqrt(0.5)
    np.testing.assert_allclose([out[0][1], out[1][1]], [z, -z], atol=1e-5)
    assert np.all(out[2] == 0.0)


def test_treepo_matches_design_vector_before_whitening():
    # paths 0/0/0, 0/0/1, 0/1/0, 0/1/1 (root, turn 1, turn 2) with rewards [1,0,0,0]:
    # leaf 1: (4 * 0.75 + 2 * 0.5) / 6 = 0.6667; leaf 2: (4 * -0.25 + 2 * -0.5) / 6 = -0.3333;
    # leaves 3, 4: (4 * -0.25 + 2 * 0) / 6 = -0.1667. Then whitened over the batch.
    tree, _ = make_tree([(0, 0), (0, 1), (1, 0), (1, 1)], [1, 0, 0, 0])
    raw = np.array([0.6667, -0.3333, -0.1667, -0.1667])
    raw_exact = np.array([4 / 6, -2 / 6, -1 / 6, -1 / 6])
    np.testing.assert_allclose(raw, raw_exact, atol=1e-4)
    (values,) = compute_advantages([tree], "treepo", eps=1e-6)
    expected = (raw_exact - raw_exact.mean()) / (raw_exact.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(leaf_values(tree, values), expected, atol=1e-9)


def test_treerpo_hand_worked_with_an_only_child_inheriting():
    # root -> x -> c -> {l1: 1, l2: 0};  root -> y (leaf, 0).
    # first turns {x: 0.5, y: 0}: z = +-0.25 / 0.35355 = +-0.7071; c is x's only child: inherits 0.7071;
    # {l1: 1, l2: 0}: +-0.7071. Nodes carry advantage x leaf count: x and c 1.4142.
    tree, ids = make_tree([(0, 0, 0), (0, 0, 1), (1,)], [1, 0, 0])
    (values,) = compute_advantages([tree], "treerpo", eps=0.0 + 1e-12, std_floor=0.0)
    r = 1 / math.sqrt(2)
    expected = {(0,): 2 * r, (0, 0): 2 * r, (0, 0, 0): r, (0, 0, 1): -r, (1,): -r}
    for path, value in expected.items():
        assert values[ids[path]] == pytest.approx(value, abs=1e-9)


# ---- conventions -----------------------------------------------------------------------------------------
def test_group_of_one_gets_zero():
    tree, _ = make_tree([(0, 0)], [1.0])
    for name in ESTIMATORS:
        (values,) = compute_advantages([tree], name)
        assert np.all(values == 0.0), name


@pytest.mark.parametrize("shaped", [0.1, 0.2])
@pytest.mark.parametrize("std_floor", [0.0, 1e-3])
def test_constant_shaped_rewards_give_exactly_zero(shaped, std_floor):
    reward = float(np.float32(shaped))  # float32 rewards widened to float64, as a reward model returns them
    tree, _ = make_tree([(0, 0), (0, 1), (1, 0), (2,)], [reward] * 4)
    for name in ("grpo", "tree_grpo", "treerpo"):
        (values,) = compute_advantages([tree], name, std_floor=std_floor)
        assert np.all(values == 0.0), name


def test_std_floor_zeroes_a_nearly_constant_group():
    # std of [0.2, 0.2005] is 3.5e-4 < 1e-3
    tree, _ = make_tree([(0,), (1,)], [0.2, 0.2005])
    (values,) = compute_advantages([tree], "grpo", std_floor=1e-3)
    assert np.all(values == 0.0)
    (values,) = compute_advantages([tree], "grpo", std_floor=0.0)
    assert abs(values[1]) > 0.5


def test_one_success_in_93_gives_9_54_and_clip_bounds_it():
    # mean 1/93, unbiased std sqrt(1/93): z = (92/93) * sqrt(93) = 92 / sqrt(93) = 9.540
    tree, _ = make_tree([(i,) for i in range(93)], [1.0] + [0.0] * 92)
    (values,) = compute_advantages([tree], "grpo", clip=None)
    assert values[1] == pytest.approx((92 / 93) / (math.sqrt(1 / 93) + 1e-6), rel=1e-9)
    assert values[1] == pytest.approx(9.54, abs=5e-3)
    (clipped,) = compute_advantages([tree], "grpo", clip=5.0)
    assert clipped[1] == 5.0
    assert clipped[2] == pytest.approx(-1 / math.sqrt(93), rel=1e-5)


def test_truncated_leaf_counts_as_reward_zero():
    tree, _ = make_tree([(0,), (1,)], [1.0, None])
    twin, _ = make_tree([(0,), (1,)], [1.0, 0.0])
    np.testing.assert_array_equal(compute_advantages([tree], "grpo")[0], compute_advantages([twin], "grpo")[0])


def test_group_zscore_matches_numpy_per_group():
    values = np.array([1.0, 0.0, 3.0, 5.0, 2.0, 2.0])
    group = np.array([0, 0, 1, 1, 2, 2])
    z = group_zscore(values, group, 3, eps=1e-6, std_floor=0.0)
    for g in range(3):
        v = values[group == g]
        expected = 0.0 if v.max() == v.min() else (v - v.mean()) / (v.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(z[group == g], expected)


def test_invalid_conventions_are_refused():
    tree, _ = make_tree([(0,), (1,)], [1.0, 0.0])
    with pytest.raises(ValueError, match="advantages.eps"):
        compute_advantages([tree], "grpo", eps=0.0)
    with pytest.raises(ValueError, match="advantages.clip"):
        compute_advantages([tree], "grpo", clip=-1.0)


@pytest.mark.parametrize("keep_tokens", [True, False], ids=["mask_all_zero", "no_tokens"])
def test_an_empty_leaf_does_not_shift_its_siblings_in_any_estimator(keep_tokens):
    # rewards [1, 0, 0] with the first leaf empty: the group is the two others, [0, 0], constant -> 0.
    # (Counted, it would give them (0 - 1/3) / sqrt(1/3) = -0.577.)
    tree, ids = make_tree([(0,), (1,), (2,)], [1.0, 0.0, 0.0])
    empty_leaf(tree, ids[(0,)], keep_tokens=keep_tokens)
    for name in ESTIMATORS:
        (values,) = compute_advantages([tree], name)
        assert np.all(values == 0.0), (name, values)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_tree_with_an_empty_leaf_matches_the_tree_without_it(name):
    # leaf (1, 1) is empty: anchor (1,) is left with one live child, so it is no branch anchor any more
    paths = [(0, 0), (0, 1), (1, 0), (1, 1), (2,)]
    tree, ids = make_tree(paths, [1.0, 0.0, 0.0, 1.0, 1.0])
    empty_leaf(tree, ids[(1, 1)])
    twin, twin_ids = make_tree([p for p in paths if p != (1, 1)], [1.0, 0.0, 0.0, 1.0])
    (values,) = compute_advantages([tree], name, std_floor=0.0)
    (expected,) = compute_advantages([twin], name, std_floor=0.0)
    for path, node_id in twin_ids.items():
        assert values[ids[path]] == pytest.approx(expected[node_id], abs=1e-12), path
    assert values[ids[(1, 1)]] == 0.0
    assert np.abs(expected).max() > 0.1  # a non-trivial comparison


def test_a_node_whose_leaves_are_all_empty_carries_zero():
    tree, ids = make_tree([(0, 0), (0, 1), (1,), (2,)], [1.0, 1.0, 0.0, 1.0])
    empty_leaf(tree, ids[(0, 0)])
    empty_leaf(tree, ids[(0, 1)])
    for name in ESTIMATORS:
        (values,) = compute_advantages([tree], name)
        assert values[ids[(0,)]] == 0.0 and values[ids[(0, 0)]] == 0.0, name
        assert values[ids[(1,)]] != 0.0, name  # the group is (1,) and (2,): [0, 1]


# ---- assign_advantages -------------------------------------------------------------------------------------
def test_assign_advantages_sets_every_non_root_node_and_returns_leaf_rows():
    tree, ids = design_tree_grpo_tree()
    other, _ = make_tree([(0,), (1,)], [0.0, 1.0], prompt_uid="kgqa/q1", tree_id="t2")
    rows = assign_advantages([tree, other], "tree_grpo", eps=1e-6, std_floor=1e-3, clip=None)
    assert tree.root.advantage is None and other.root.advantage is None
    assert all(node.advantage is not None for t in (tree, other) for node in t.nodes[1:])
    assert rows.tree_idx.tolist() == [0] * 6 + [1] * 2
    assert rows.node_id[:6].tolist() == [leaf.node_id for leaf in tree.leaves()]
    np.testing.assert_allclose(rows.advantage[:6], [2.0676, -1.4902, -1.4902, 1.4902, 1.4902, -2.0676], atol=1e-4)
    assert tree.nodes[ids[(0,)]].advantage == pytest.approx(sum(rows.advantage[:3]))


def test_node_sums_equal_flat_leaf_row_training():
    # training each leaf row separately (every token of the row carries the row's advantage) equals training
    # each node once with the summed advantage: same token-weighted total. (treerpo rows vary along the path;
    # its sums are checked against the path-by-path reference below.)
    tree, _ = make_tree([(0, 0, 0), (0, 0, 1), (0, 1), (1, 0), (1, 1, 0), (1, 1, 1)], [1, 0, 0, 1, 1, 0])
    tokens = np.arange(len(tree.nodes), dtype=float) + 1.0
    for name in ("grpo", "tree_grpo", "treepo"):
        rows = assign_advantages([tree], name)
        node_side = sum(node.advantage * tokens[node.node_id] for node in tree.nodes[1:])
        row_side = sum(adv * sum(tokens[n.node_id] for n in tree.path(int(leaf))[1:])
                       for leaf, adv in zip(rows.node_id, rows.advantage))
        assert node_side == pytest.approx(row_side, abs=1e-9), name
        assert abs(node_side) > 1e-3, name  # a non-trivial check


# ---- fast == slow, fuzzed ----------------------------------------------------------------------------------
@st.composite
def tree_batches(draw, with_empty_leaves=False):
    trees = []
    for t in range(draw(st.integers(1, 4))):
        uid = draw(st.sampled_from(["kgqa/a", "kgqa/b", "math/a"]))
        num_turns = draw(st.integers(1, 10))
        parents = [draw(st.integers(0, i)) for i in range(num_turns)]
        kind = draw(st.sampled_from(["binary", "shaped", "constant"]))
        num_leaves = sum(1 for i in range(1, num_turns + 1) if i not in parents)
        if kind == "binary":
            rewards = draw(st.lists(st.sampled_from([0.0, 1.0, None]), min_size=num_leaves, max_size=num_leaves))
        elif kind == "shaped":
            rewards = draw(st.lists(st.floats(0, 1, width=32), min_size=num_leaves, max_size=num_leaves))
        else:
            rewards = [float(np.float32(draw(st.sampled_from([0.1, 0.2, 1.0]))))] * num_leaves
        tree = chain_tree(parents, rewards, prompt_uid=uid, tree_id=f"t{t}")
        if with_empty_leaves:
            for leaf in tree.leaves():
                kind = draw(st.sampled_from(["generated", "generated", "masked", "no_tokens"]))
                if kind != "generated":
                    empty_leaf(tree, leaf.node_id, keep_tokens=kind == "masked")
        trees.append(tree)
    return trees


@settings(max_examples=60, deadline=None)
@given(trees=tree_batches(), eps=st.sampled_from([1e-6, 1e-2]), std_floor=st.sampled_from([0.0, 1e-3]),
       clip=st.sampled_from([None, 1.5]))
def test_estimators_match_slow_references_and_stay_finite(trees, eps, std_floor, clip):
    for name, slow in SLOW.items():
        fast = compute_advantages(trees, name, eps=eps, std_floor=std_floor, clip=clip)
        ref = slow(trees, eps, std_floor, clip)
        for f, r in zip(fast, ref):
            assert np.all(np.isfinite(f)), name
            np.testing.assert_allclose(f, r, atol=1e-9, err_msg=name)


@settings(max_examples=60, deadline=None)
@given(trees=tree_batches(with_empty_leaves=True), eps=st.sampled_from([1e-6, 1e-2]),
       std_floor=st.sampled_from([0.0, 1e-3]), clip=st.sampled_from([None, 1.5]))
def test_estimators_with_empty_leaves_equal_the_trees_without_them(trees, eps, std_floor, clip):
    for name, slow in SLOW.items():
        fast = compute_advantages(trees, name, eps=eps, std_floor=std_floor, clip=clip)
        ref = slow_without_empty_leaves(slow)(trees, eps, std_floor, clip)
        for tree, f, r in zip(trees, fast, ref):
            np.testing.assert_allclose(f, r, atol=1e-9, err_msg=name)
            for leaf in tree.leaves():
                if leaf.num_generated_tokens == 0:
                    assert f[leaf.node_id] == 0.0, name


@settings(max_examples=30, deadline=None)
@given(trees=tree_batches())
def test_all_equal_groups_give_zero_for_group_relative_estimators(trees):
    for tree in trees:
        for leaf in tree.leaves():
            leaf.reward = 1.0
    for name in ("grpo", "tree_grpo", "treerpo", "treepo"):
        assert all(np.all(v == 0.0) for v in compute_advantages(trees, name)), name


def test_tree_batch_pairs_list_every_strict_ancestor():
    tree, ids = make_tree([(0, 0, 0), (0, 1), (1,)], [1, 0, 1])
    batch = TreeBatch.from_trees([tree])
    pairs = {(int(batch.leaf[i]), int(n)) for i, n in zip(batch.pair_leaf, batch.pair_node)}
    assert pairs == {(ids[(0, 0, 0)], ids[(0, 0)]), (ids[(0, 0, 0)], ids[(0,)]), (ids[(0, 0, 0)], 0),
                     (ids[(0, 1)], ids[(0,)]), (ids[(0, 1)], 0), (ids[(1,)], 0)}
    assert batch.subtree_leaves[ids[(0,)]] == 2 and batch.subtree_reward[0] == 2.0


@pytest.mark.parametrize("bad", ["1", True])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_a_reward_of_the_wrong_type_set_after_construction_stops_every_estimator(estimator, bad):
    # add_node refuses "1" and True; a reward assigned to the node afterwards must not be read as 1.0
    tree, ids = make_tree([(0,), (1,)], [1.0, 0.0])
    tree.nodes[ids[(1,)]].reward = bad
    with pytest.raises(RewardError, match=rf"tree test/0/kgqa/q0 node {ids[(1,)]}: reward {bad!r} .*not a number"):
        compute_advantages([tree], estimator)


# ---- baseline, scale and negative weight (advantages.baseline / scale / negative_weight) -------------------
# One prompt, rewards [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
ONE_IN_FOUR = [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("options, expected", [
    ({}, [1.5, -0.5, -0.5, -0.5]),  # (r - 0.25) / 0.5
    ({"scale": "none"}, [0.75, -0.25, -0.25, -0.25]),  # Dr. GRPO: r - 0.25
    ({"baseline": "leave_one_out", "scale": "none"}, [1.0, -1 / 3, -1 / 3, -1 / 3]),  # RLOO: 1 - 0, 0 - 1/3
    ({"baseline": "leave_one_out"}, [2.0, -2 / 3, -2 / 3, -2 / 3]),  # RLOO / 0.5
    ({"negative_weight": 0.25}, [1.5, -0.125, -0.125, -0.125]),  # 0.25 * -0.5
    ({"negative_weight": 0.0, "scale": "none"}, [0.75, 0.0, 0.0, 0.0]),  # successes only
])
def test_grpo_options_match_hand_worked_vectors(options, expected):
    tree, ids = make_tree([(0,), (1,), (2,), (3,)], ONE_IN_FOUR)
    adv = compute_advantages([tree], "grpo", eps=1e-12, **options)[0]
    np.testing.assert_allclose([adv[ids[(i,)]] for i in range(4)], expected, atol=1e-9)


def test_negative_weight_applies_after_the_clip():
    # one failure in 93: z = -92 / sqrt(93) = -9.54, clipped to -5, then weighted: -2.5 (not 0.5 * -9.54 = -4.77)
    tree, ids = make_tree([(i,) for i in range(93)], [0.0] + [1.0] * 92)
    plain = compute_advantages([tree], "grpo", clip=5.0)[0]
    half = compute_advantages([tree], "grpo", clip=5.0, negative_weight=0.5)[0]
    assert half[ids[(0,)]] == pytest.approx(-2.5)
    assert half[ids[(1,)]] == pytest.approx(plain[ids[(1,)]]) and plain[ids[(1,)]] > 0  # successes unweighted


def test_options_keep_constant_groups_at_exactly_zero():
    tree, _ = make_tree([(0,), (1,), (2,)], [0.2, 0.2, 0.2])
    for name in ESTIMATORS:
        for options in ({"scale": "none"}, {"baseline": "leave_one_out"}, {"negative_weight": 0.0}):
            assert np.all(compute_advantages([tree], name, **options)[0] == 0.0), (name, options)


def test_unknown_options_are_refused_with_the_valid_values():
    tree, _ = make_tree([(0,), (1,)], [1.0, 0.0])
    with pytest.raises(ValueError, match="advantages.baseline must be one of"):
        compute_advantages([tree], "grpo", baseline="median")
    with pytest.raises(ValueError, match="advantages.scale must be one of"):
        compute_advantages([tree], "grpo", scale="mad")
    with pytest.raises(ValueError, match=r"advantages.negative_weight must be in \[0, 1\]"):
        compute_advantages([tree], "grpo", negative_weight=1.5)


@settings(max_examples=40, deadline=None)
@given(trees=tree_batches(), baseline=st.sampled_from(["mean", "leave_one_out"]),
       scale=st.sampled_from(["std", "none"]), negative_weight=st.sampled_from([1.0, 0.3, 0.0]),
       clip=st.sampled_from([None, 1.5]))
def test_estimator_options_match_slow_references(trees, baseline, scale, negative_weight, clip):
    for name, slow in SLOW.items():
        fast = compute_advantages(trees, name, eps=1e-6, std_floor=1e-3, clip=clip, baseline=baseline, scale=scale,
                                  negative_weight=negative_weight)
        ref = slow(trees, 1e-6, 1e-3, clip, negative_weight=negative_weight, baseline=baseline, scale=scale)
        for f, r in zip(fast, ref):
            np.testing.assert_allclose(f, r, atol=1e-9, err_msg=f"{name} {baseline} {scale} {negative_weight}")
