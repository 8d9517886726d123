"""The advantage estimators ``grpo``, ``tree_grpo``, ``treerpo``, ``treepo`` and their registry by name.

Every estimator is a pure function ``fn(trees, *, eps, std_floor, clip, baseline, scale, negative_weight) ->
list[(N_t,) float64]`` with the
conventions of ``trace.advantages`` (package docstring); ``get_estimator`` looks one up by name and an
unknown name raises with the valid list.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from trace.advantages.batch import LeafAdvantages, TreeBatch, check_group_options, group_zscore
from trace.tree import RolloutTree


def _clip(values: np.ndarray, clip: float | None) -> np.ndarray:
    if clip is None:
        return values
    if clip <= 0:
        raise ValueError(f"advantages.clip must be > 0 or None, got {clip}")
    return np.clip(values, -clip, clip)


def _weigh_negatives(values: np.ndarray, negative_weight: float) -> np.ndarray:
    """Scale the negative entries by ``negative_weight`` (1 = unchanged): after the clip, before the row sums."""
    if negative_weight == 1.0:
        return values
    return np.where(values < 0, negative_weight * values, values)


def _rows(values: np.ndarray, clip: float | None, negative_weight: float) -> np.ndarray:
    return _weigh_negatives(_clip(values, clip), negative_weight)


def _check_conventions(eps: float, std_floor: float, baseline: str = "mean", scale: str = "std",
                       negative_weight: float = 1.0) -> None:
    check_group_options(baseline, scale, negative_weight)
    if not eps > 0:
        raise ValueError(f"advantages.eps must be > 0, got {eps}")
    if not std_floor >= 0:
        raise ValueError(f"advantages.std_floor must be >= 0, got {std_floor}")


# ---- estimators ----------------------------------------------------------------------------------------
def grpo_advantages(trees: Sequence[RolloutTree], *, eps: float = 1e-6, std_floor: float = 1e-3,
        clip: float | None = None, baseline: str = "mean", scale: str = "std",
        negative_weight: float = 1.0) -> list[np.ndarray]:
    """GRPO: each leaf row's advantage is its reward's z-score within the prompt group.

    Args:
        trees: rollout trees; leaves are grouped by ``prompt_uid`` across trees.
        eps, std_floor, clip, baseline, scale, negative_weight: see the conventions of ``trace.advantages``.

    Returns:
        per tree, (N_t,) float64 node advantages (leaf-row sums; root 0).

    References:
        GRPO, DeepSeekMath (arXiv 2402.03300), eq. 3 (outcome supervision): ``(r - mean) / std``.
    """
    _check_conventions(eps, std_floor, baseline, scale, negative_weight)
    batch = TreeBatch.from_trees(trees)
    adv = batch.kept_leaf_zscore(batch.leaf_reward, batch.leaf_prompt, batch.num_prompts, eps, std_floor,
                                 baseline=baseline, scale=scale)
    return batch.split(batch.leaf_row_sums(_rows(adv, clip, negative_weight)))


def tree_grpo_advantages(trees: Sequence[RolloutTree], *, eps: float = 1e-6, std_floor: float = 1e-3,
        clip: float | None = None, baseline: str = "mean", scale: str = "std",
        negative_weight: float = 1.0) -> list[np.ndarray]:
    """Tree-GRPO: inter-tree (prompt) z-score plus the mean intra-tree z-score over branch anchors on the path.

    Returns:
        per tree, (N_t,) float64 node advantages (leaf-row sums; root 0).

    References:
        Tree-GRPO, "Tree Search for LLM Agent Reinforcement Learning" (arXiv 2509.21240): advantage =
        intra-tree + inter-tree group-relative terms. Here the intra term averages over every branch anchor
        on the path (an anchor with a constant group contributes 0 to that mean).
    """
    _check_conventions(eps, std_floor, baseline, scale, negative_weight)
    batch = TreeBatch.from_trees(trees)
    inter = batch.kept_leaf_zscore(batch.leaf_reward, batch.leaf_prompt, batch.num_prompts, eps, std_floor,
                                   baseline=baseline, scale=scale)
    on_anchor = batch.is_branch_anchor()[batch.pair_node]
    pair_leaf, pair_anchor = batch.pair_leaf[on_anchor], batch.pair_node[on_anchor]
    anchors, anchor_group = np.unique(pair_anchor, return_inverse=True)
    z = group_zscore(batch.leaf_reward[pair_leaf], anchor_group, anchors.size, eps, std_floor, baseline=baseline,
                     scale=scale)
    num_leaves = batch.leaf.size
    intra_sum = np.bincount(pair_leaf, weights=z, minlength=num_leaves)
    intra_count = np.bincount(pair_leaf, minlength=num_leaves)
    intra = intra_sum / np.maximum(intra_count, 1)
    return batch.split(batch.leaf_row_sums(_rows(inter + intra, clip, negative_weight)))


def _node_depth(parent: np.ndarray) -> np.ndarray:
    depth = np.zeros(parent.size, dtype=np.int64)
    current = parent.copy()
    alive = current >= 0
    while alive.any():
        depth[alive] += 1
        current[alive] = parent[current[alive]]
        alive = current >= 0
    return depth


def treerpo_advantages(trees: Sequence[RolloutTree], *, eps: float = 1e-6, std_floor: float = 1e-3,
        clip: float | None = None, baseline: str = "mean", scale: str = "std",
        negative_weight: float = 1.0) -> list[np.ndarray]:
    """TreeRPO: each node's value (mean leaf reward below) z-scored within its sibling group.

    Sibling groups: the children of one parent; the first turns of all trees of one prompt form one
    group. A node that is its parent's only child inherits the parent's advantage (0 below the root).
    The node carries its advantage times its leaf count (once per leaf row through it).

    Returns:
        per tree, (N_t,) float64 node advantages (leaf-row sums; root 0).

    References:
        TreeRPO (arXiv 2506.05183): step-level rewards as expected leaf rewards, normalised within
        step-level (sibling) groups.
    """
    _check_conventions(eps, std_floor, baseline, scale, negative_weight)
    batch = TreeBatch.from_trees(trees)
    parent = batch.parent
    num_nodes = parent.size
    value = batch.subtree_reward / np.maximum(batch.subtree_leaves, 1)
    turns = np.flatnonzero(batch.is_live())  # a node with only empty leaves below is in no sibling group
    under_root = parent[parent[turns]] < 0
    # sibling-group key: prompt index for first turns, num_prompts + parent id otherwise
    key = np.where(under_root, batch.node_prompt[turns], batch.num_prompts + parent[turns])
    keys, sibling_group = np.unique(key, return_inverse=True)
    group_size = np.bincount(sibling_group, minlength=keys.size)
    advantage = np.zeros(num_nodes, dtype=np.float64)
    advantage[turns] = group_zscore(value[turns], sibling_group, keys.size, eps, std_floor, baseline=baseline,
                                    scale=scale)
    only_child = turns[group_size[sibling_group] == 1]
    depth = _node_depth(parent)
    for level in np.unique(depth[only_child]):  # parents are settled before their children
        nodes = only_child[depth[only_child] == level]
        advantage[nodes] = advantage[parent[nodes]]  # a root's advantage is 0
    advantage = _rows(advantage, clip, negative_weight)
    node_adv = advantage * batch.subtree_leaves
    node_adv[parent < 0] = 0.0
    return batch.split(node_adv)


def treepo_advantages(trees: Sequence[RolloutTree], *, eps: float = 1e-6, std_floor: float = 1e-3,
        clip: float | None = None, baseline: str = "mean", scale: str = "std",
        negative_weight: float = 1.0) -> list[np.ndarray]:
    """TreePO: size-weighted mean over depths of (reward - mean of the leaves sharing the prefix), whitened.

    Returns:
        per tree, (N_t,) float64 node advantages (leaf-row sums; root 0).

    References:
        TreePO (arXiv 2508.17445): segment-tree advantages from subgroups sharing each prefix, combined
        across depths weighted by subgroup size, normalised over the global batch. Subgroups of one leaf
        (no baseline) are left out.
    """
    _check_conventions(eps, std_floor, baseline, scale, negative_weight)
    batch = TreeBatch.from_trees(trees)
    num_leaves = batch.leaf.size
    kept = batch.kept_leaves
    prompt_count = np.bincount(batch.leaf_prompt[kept], minlength=batch.num_prompts)
    prompt_mean = np.bincount(batch.leaf_prompt[kept], weights=batch.leaf_reward[kept],
                              minlength=batch.num_prompts) / np.maximum(prompt_count, 1)
    at_root = batch.parent[batch.pair_node] < 0
    group_size = np.where(at_root, prompt_count[batch.leaf_prompt[batch.pair_leaf]],
                          batch.subtree_leaves[batch.pair_node]).astype(np.float64)
    node_mean = batch.subtree_reward / np.maximum(batch.subtree_leaves, 1)
    group_mean = np.where(at_root, prompt_mean[batch.leaf_prompt[batch.pair_leaf]], node_mean[batch.pair_node])
    weight = np.where(group_size >= 2, group_size, 0.0)
    diff = batch.leaf_reward[batch.pair_leaf] - group_mean
    if baseline == "leave_one_out":  # the mean of the subgroup's other leaves: n / (n - 1) times the difference
        diff = diff * group_size / np.maximum(group_size - 1, 1)
    total = np.bincount(batch.pair_leaf, weights=weight * diff, minlength=num_leaves)
    weight_sum = np.bincount(batch.pair_leaf, weights=weight, minlength=num_leaves)
    raw = np.divide(total, weight_sum, out=np.zeros(num_leaves), where=weight_sum > 0)
    whitened = batch.kept_leaf_zscore(raw, np.zeros(num_leaves, dtype=np.int64), 1, eps, std_floor, scale=scale)
    return batch.split(batch.leaf_row_sums(_rows(whitened, clip, negative_weight)))


ESTIMATORS: dict[str, Callable[..., list[np.ndarray]]] = {
    "grpo": grpo_advantages,
    "tree_grpo": tree_grpo_advantages,
    "treerpo": treerpo_advantages,
    "treepo": treepo_advantages,
}


def get_estimator(name) -> Callable[..., list[np.ndarray]]:
    """Look up an estimator by name (a string or ``trace.configuration.config.Estimator``).

    Raises:
        ValueError: unknown name; the message lists the valid names.
    """
    key = getattr(name, "value", name)
    try:
        return ESTIMATORS[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {', '.join(ESTIMATORS)} "
                         "(set advantages.estimator in params.yaml)") from None


def compute_advantages(trees: Sequence[RolloutTree], estimator="tree_grpo", *, eps: float = 1e-6,
                       std_floor: float = 1e-3, clip: float | None = None, baseline: str = "mean",
                       scale: str = "std", negative_weight: float = 1.0) -> list[np.ndarray]:
    """Node advantages of every tree by the named estimator, without touching the trees.

    Returns:
        per tree, (N_t,) float64 indexed by ``node_id``; root 0.

    Raises:
        ValueError: unknown estimator or invalid conventions.
        RewardError: a reward that is not a finite real number (``"1"``, ``True``, NaN), naming the tree, the
            node and the value (``RolloutTree.reward_of``).
    """
    return get_estimator(estimator)(trees, eps=eps, std_floor=std_floor, clip=clip, baseline=baseline, scale=scale,
                                    negative_weight=negative_weight)


def assign_advantages(trees: Sequence[RolloutTree], estimator="tree_grpo", eps: float = 1e-6,
                      std_floor: float = 1e-3, clip: float | None = None, baseline: str = "mean",
                      scale: str = "std", negative_weight: float = 1.0) -> LeafAdvantages:
    """Set ``node.advantage`` on every non-root node and return the per-leaf-row advantages.

    Args:
        trees: the step's rollout trees (modified in place: ``advantage`` of every non-root node; the root's
            stays ``None`` since prompt tokens are never trained).
        estimator: a name in ``ESTIMATORS``.
        eps, std_floor, clip, baseline, scale, negative_weight: the ``advantages`` keys of the same names.

    Returns:
        ``LeafAdvantages`` of every leaf, tree by tree in node-id order.

    Raises:
        ValueError: unknown estimator or invalid conventions.
    """
    node_advantages = compute_advantages(trees, estimator, eps=eps, std_floor=std_floor, clip=clip,
                                         baseline=baseline, scale=scale, negative_weight=negative_weight)
    tree_idx, node_id, advantage = [], [], []
    for t, (tree, values) in enumerate(zip(trees, node_advantages)):
        has_child = np.zeros(len(tree.nodes), dtype=bool)
        for node in tree.nodes[1:]:
            has_child[node.parent_id] = True
        for node in tree.nodes:
            if node.is_root:
                continue
            node.advantage = float(values[node.node_id])
            if not has_child[node.node_id]:
                tree_idx.append(t)
                node_id.append(node.node_id)
                advantage.append(node.advantage)
    return LeafAdvantages(tree_idx=np.array(tree_idx, dtype=np.int64), node_id=np.array(node_id, dtype=np.int64),
                          advantage=np.array(advantage, dtype=np.float64))
