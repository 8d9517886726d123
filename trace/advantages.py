"""Advantage estimators over rollout trees, a registry looked up by name.

Every estimator is a pure function ``fn(trees, *, eps, std_floor, clip) -> list[(N_t,) float64]``: for each
tree, indexed by ``node_id``, the advantage that node's tokens carry in the update. A trajectory is one
*leaf row* (root to leaf). A shared prefix is trained once, so a node carries the **sum** of the advantages
that the leaf rows through it give its tokens; a leaf carries its own row's advantage; the root (the
prompt, never trained) carries 0. Training nodes once with these sums equals training every leaf row
separately (expansion ratio 1 in the flat limit).

Grouping is by explicit ids, never by position:
- the *prompt group* of a leaf is every leaf whose tree has the same ``prompt_uid`` (several trees may
  share a prompt, e.g. DAPO rounds or evaluation samples);
- an *anchor group* is the set of leaves below a branch anchor: a non-root node with >= 2 children, keyed
  by (tree, node_id).

Conventions, fixed once here and tested:
- z-scores use the unbiased std (``ddof=1``) plus ``eps``: ``(r - mean) / (std + eps)``;
- a group of size 1 gives 0 (no baseline exists);
- a group whose rewards are all equal, or whose std is below ``std_floor``, gives exactly 0 (constant
  shaped rewards such as 0.2 must not turn into float noise divided by ``eps``);
- ``clip`` (None = off) bounds ``|advantage|`` of each leaf row before rows are summed into nodes (one
  success among 93 rollouts has z = 92 / sqrt(93) = 9.54 unclipped);
- a truncated leaf (``reward is None``) counts with reward 0, as ``RolloutTree.leaf_rewards`` does;
- an *empty* leaf, whose own turn generated nothing (``loss_mask`` all 0: ``Node.num_generated_tokens == 0``),
  is left out as if it had not been sampled, by every estimator: it joins no prompt, anchor, sibling or
  depth group and no whitening, its row's advantage is 0, and its ancestors get nothing from it (a node
  with only empty leaves below carries 0; an anchor with one live child is no branch anchor). Its own
  tokens train nothing, so it must not move its siblings' baseline either: rewards [1, 0, 0] with the
  first leaf empty give the other two 0, not -0.577. The rollout engine never records such a leaf (every
  turn holds at least one sampled token); hand-built or imported trees may.

Estimators:
- ``grpo``: z-score of each leaf reward within its prompt group (GRPO, arXiv 2402.03300).
- ``tree_grpo`` (default): inter term = the ``grpo`` z-score; intra term = the mean, over the branch anchors
  on the leaf's path, of the leaf's z-score within each anchor group (0 with no anchor); advantage = inter
  + intra, the same for every token of the trajectory (Tree-GRPO, arXiv 2509.21240).
- ``treerpo``: node value = mean leaf reward below the node; a node's advantage = the z-score of its
  value within its sibling group (children of one parent; the children of the roots of one prompt form
  one group); a node without siblings inherits its parent's advantage (0 below the root). Every leaf row
  through a node gives its tokens that node's advantage, so the node carries it times its leaf count
  (TreeRPO, arXiv 2506.05183).
- ``treepo``: for each ancestor of a leaf at depth ``d = 0 .. depth - 1`` (depth 0 = the prompt group)
  whose leaf group holds >= 2 leaves, the leaf's reward minus that group's mean; the terms are averaged
  with the group sizes as weights, then whitened over all leaves of the batch (mean 0, unbiased std 1)
  (TreePO, arXiv 2508.17445). Whitening moves leaves of constant groups off 0 by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from trace.tree import RolloutTree

__all__ = [
    "TreeBatch",
    "LeafAdvantages",
    "group_zscore",
    "grpo_advantages",
    "tree_grpo_advantages",
    "treerpo_advantages",
    "treepo_advantages",
    "ESTIMATORS",
    "get_estimator",
    "compute_advantages",
    "assign_advantages",
]


# ---- flat index over a batch of trees -----------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class TreeBatch:
    """A batch of trees flattened to global node ids (``offsets[t] + node_id``).

    Attributes:
        offsets: (num_trees + 1,) int64 first global id of each tree.
        parent: (G,) int64 global parent id, -1 at roots.
        num_children: (G,) int64.
        leaf: (L,) int64 global id of each leaf, tree by tree, in node-id order.
        leaf_is_empty: (L,) bool, the leaf's own turn has no generated token (``loss_mask`` all 0): it is in
            no group and no pair below (see the module docstring).
        leaf_reward: (L,) float64 leaf rewards (truncated leaves, ``None``, count as 0).
        leaf_prompt: (L,) int64 prompt-group index of each leaf (by ``prompt_uid``).
        prompt_uids: the prompt uids, indexed by prompt-group index (first-seen order).
        node_prompt: (G,) int64 prompt-group index of each node's tree.
        pair_leaf: (P,) int64 leaf index (into ``leaf``) of each (non-empty leaf, strict ancestor) pair.
        pair_node: (P,) int64 global id of the ancestor (roots included).
        subtree_leaves: (G,) int64 non-empty leaves at or below each node.
        subtree_reward: (G,) float64 summed reward of the non-empty leaves at or below each node.
    """

    offsets: np.ndarray
    parent: np.ndarray
    num_children: np.ndarray
    leaf: np.ndarray
    leaf_is_empty: np.ndarray
    leaf_reward: np.ndarray
    leaf_prompt: np.ndarray
    prompt_uids: list
    node_prompt: np.ndarray
    pair_leaf: np.ndarray
    pair_node: np.ndarray
    subtree_leaves: np.ndarray
    subtree_reward: np.ndarray

    @classmethod
    def from_trees(cls, trees: Sequence[RolloutTree]) -> "TreeBatch":
        """Index ``trees``.

        Raises:
            ValueError: a node id that is not its position, or a non-finite leaf reward (names the tree).
        """
        sizes = np.array([len(t.nodes) for t in trees], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        num_nodes = int(offsets[-1])
        parent = np.empty(num_nodes, dtype=np.int64)
        reward = np.zeros(num_nodes, dtype=np.float64)
        has_generated = np.zeros(num_nodes, dtype=bool)
        node_prompt = np.empty(num_nodes, dtype=np.int64)
        prompt_index: dict[str, int] = {}
        for t, tree in enumerate(trees):
            base = int(offsets[t])
            group = prompt_index.setdefault(tree.prompt_uid, len(prompt_index))
            node_prompt[base:base + len(tree.nodes)] = group
            for i, node in enumerate(tree.nodes):
                if node.node_id != i:
                    raise ValueError(f"tree {tree.tree_id}: node at position {i} has node_id {node.node_id}")
                parent[base + i] = -1 if node.parent_id < 0 else base + node.parent_id
                if node.reward is not None:
                    reward[base + i] = float(node.reward)
                has_generated[base + i] = any(node.loss_mask)
        num_children = np.bincount(parent[parent >= 0], minlength=num_nodes).astype(np.int64)
        leaf = np.flatnonzero((num_children == 0) & (parent >= 0)).astype(np.int64)
        leaf_reward = reward[leaf]
        if not np.all(np.isfinite(leaf_reward)):
            bad = int(leaf[~np.isfinite(leaf_reward)][0])
            t = int(np.searchsorted(offsets, bad, side="right") - 1)
            raise ValueError(f"tree {trees[t].tree_id}: leaf node {bad - int(offsets[t])} has a non-finite reward")

        leaf_is_empty = ~has_generated[leaf]
        kept = np.flatnonzero(~leaf_is_empty).astype(np.int64)

        pair_leaf_parts, pair_node_parts = [], []
        current = parent[leaf[kept]]
        leaf_idx = kept
        while current.size:
            alive = current >= 0
            leaf_idx, current = leaf_idx[alive], current[alive]
            pair_leaf_parts.append(leaf_idx)
            pair_node_parts.append(current)
            current = parent[current]
        pair_leaf = np.concatenate(pair_leaf_parts) if pair_leaf_parts else np.zeros(0, dtype=np.int64)
        pair_node = np.concatenate(pair_node_parts) if pair_node_parts else np.zeros(0, dtype=np.int64)

        subtree_leaves = np.bincount(pair_node, minlength=num_nodes).astype(np.int64)
        subtree_leaves[leaf[kept]] += 1
        subtree_reward = np.bincount(pair_node, weights=leaf_reward[pair_leaf], minlength=num_nodes)
        subtree_reward = subtree_reward.astype(np.float64)  # bincount of nothing is int64
        subtree_reward[leaf[kept]] += leaf_reward[kept]
        return cls(offsets=offsets, parent=parent, num_children=num_children, leaf=leaf,
                   leaf_is_empty=leaf_is_empty, leaf_reward=leaf_reward, leaf_prompt=node_prompt[leaf],
                   prompt_uids=list(prompt_index), node_prompt=node_prompt, pair_leaf=pair_leaf, pair_node=pair_node,
                   subtree_leaves=subtree_leaves, subtree_reward=subtree_reward)

    @property
    def num_trees(self) -> int:
        return self.offsets.size - 1

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_uids)

    @property
    def kept_leaves(self) -> np.ndarray:
        """(K,) int64 positions (into ``leaf``) of the non-empty leaves, the only ones that enter groups."""
        return np.flatnonzero(~self.leaf_is_empty).astype(np.int64)

    def is_live(self) -> np.ndarray:
        """(G,) bool: non-root nodes with a non-empty leaf at or below them."""
        return (self.subtree_leaves > 0) & (self.parent >= 0)

    def is_branch_anchor(self) -> np.ndarray:
        """(G,) bool: non-root nodes with >= 2 live children (children with a non-empty leaf below)."""
        live = self.is_live()
        live_children = np.bincount(self.parent[live], minlength=self.parent.size)
        return (live_children >= 2) & (self.parent >= 0)

    def kept_leaf_zscore(self, values: np.ndarray, group: np.ndarray, num_groups: int, eps: float,
                         std_floor: float) -> np.ndarray:
        """(L,) ``group_zscore`` of per-leaf ``values`` over the non-empty leaves only; empty leaves get 0."""
        out = np.zeros(self.leaf.size, dtype=np.float64)
        kept = self.kept_leaves
        out[kept] = group_zscore(np.asarray(values, dtype=np.float64)[kept], group[kept], num_groups, eps,
                                 std_floor)
        return out

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """Cut a (G,) array into per-tree (N_t,) arrays."""
        return [values[self.offsets[t]:self.offsets[t + 1]].copy() for t in range(self.num_trees)]

    def leaf_row_sums(self, leaf_advantage: np.ndarray) -> np.ndarray:
        """(G,) node advantage = sum of the (L,) leaf-row advantages through each non-root node; roots 0.

        The pairs hold only non-empty leaves, so an empty leaf's row adds nothing to its ancestors.
        """
        out = np.zeros(self.parent.size, dtype=np.float64)
        out[self.leaf] = leaf_advantage
        out += np.bincount(self.pair_node, weights=leaf_advantage[self.pair_leaf], minlength=out.size)
        out[self.parent < 0] = 0.0
        return out


@dataclass(frozen=True, eq=False)
class LeafAdvantages:
    """Per-leaf-row advantages of a batch.

    Attributes:
        tree_idx: (L,) int64 position of the leaf's tree in the batch.
        node_id: (L,) int64 the leaf's node id in its tree.
        advantage: (L,) float64 the leaf row's advantage at the leaf's own tokens.
    """

    tree_idx: np.ndarray
    node_id: np.ndarray
    advantage: np.ndarray


# ---- group statistics ----------------------------------------------------------------------------------
def group_zscore(values: np.ndarray, group: np.ndarray, num_groups: int, eps: float, std_floor: float) -> np.ndarray:
    """Z-score of each value within its group, with this module's conventions.

    Args:
        values: (K,) float rewards (any float dtype; computed in float64).
        group: (K,) int64 group index in ``[0, num_groups)``.
        num_groups: number of groups.
        eps: added to the std (> 0).
        std_floor: groups with unbiased std below this give 0.

    Returns:
        (K,) float64 ``(v - mean_g) / (std_g + eps)``, exactly 0 in groups of size 1, in groups of equal
        values, and in groups with ``std_g < std_floor``.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return np.zeros(0, dtype=np.float64)
    count = np.bincount(group, minlength=num_groups)
    mean = np.bincount(group, weights=values, minlength=num_groups) / np.maximum(count, 1)
    deviation = values - mean[group]
    var = np.bincount(group, weights=deviation ** 2, minlength=num_groups) / np.maximum(count - 1, 1)
    std = np.sqrt(var)
    high = np.full(num_groups, -np.inf)
    low = np.full(num_groups, np.inf)
    np.maximum.at(high, group, values)
    np.minimum.at(low, group, values)
    informative = (count >= 2) & (high > low) & (std >= std_floor)
    return np.where(informative[group], deviation / (std[group] + eps), 0.0)


def _clip(values: np.ndarray, clip: float | None) -> np.ndarray:
    if clip is None:
        return values
    if clip <= 0:
        raise ValueError(f"advantages.clip must be > 0 or None, got {clip}")
    return np.clip(values, -clip, clip)


def _check_conventions(eps: float, std_floor: float) -> None:
    if not eps > 0:
        raise ValueError(f"advantages.eps must be > 0, got {eps}")
    if not std_floor >= 0:
        raise ValueError(f"advantages.std_floor must be >= 0, got {std_floor}")


# ---- estimators ----------------------------------------------------------------------------------------
def grpo_advantages(trees: Sequence[RolloutTree], *, eps: float = 1e-6, std_floor: float = 1e-3,
                    clip: float | None = None) -> list[np.ndarray]:
    """GRPO: each leaf row's advantage is its reward's z-score within the prompt group.

    Args:
        trees: rollout trees; leaves are grouped by ``prompt_uid`` across trees.
        eps, std_floor, clip: see the module conventions.

    Returns:
        per tree, (N_t,) float64 node advantages (leaf-row sums; root 0).

    References:
        GRPO, DeepSeekMath (arXiv 2402.03300), eq. 3 (outcome supervision): ``(r - mean) / std``.
    """
    _check_conventions(eps, std_floor)
    batch = TreeBatch.from_trees(trees)
    adv = batch.kept_leaf_zscore(batch.leaf_reward, batch.leaf_prompt, batch.num_prompts, eps, std_floor)
    return batch.split(batch.leaf_row_sums(_clip(adv, clip)))


def tree_grpo_advantages(trees: Sequence[RolloutTree], *, eps: float = 1e-6, std_floor: float = 1e-3,
                         clip: float | None = None) -> list[np.ndarray]:
    """Tree-GRPO: inter-tree (prompt) z-score plus the mean intra-tree z-score over branch anchors on the path.

    Returns:
        per tree, (N_t,) float64 node advantages (leaf-row sums; root 0).

    References:
        Tree-GRPO, "Tree Search for LLM Agent Reinforcement Learning" (arXiv 2509.21240): advantage =
        intra-tree + inter-tree group-relative terms. Here the intra term averages over every branch anchor
        on the path (an anchor with a constant group contributes 0 to that mean).
    """
    _check_conventions(eps, std_floor)
    batch = TreeBatch.from_trees(trees)
    inter = batch.kept_leaf_zscore(batch.leaf_reward, batch.leaf_prompt, batch.num_prompts, eps, std_floor)
    on_anchor = batch.is_branch_anchor()[batch.pair_node]
    pair_leaf, pair_anchor = batch.pair_leaf[on_anchor], batch.pair_node[on_anchor]
    anchors, anchor_group = np.unique(pair_anchor, return_inverse=True)
    z = group_zscore(batch.leaf_reward[pair_leaf], anchor_group, anchors.size, eps, std_floor)
    num_leaves = batch.leaf.size
    intra_sum = np.bincount(pair_leaf, weights=z, minlength=num_leaves)
    intra_count = np.bincount(pair_leaf, minlength=num_leaves)
    intra = intra_sum / np.maximum(intra_count, 1)
    return batch.split(batch.leaf_row_sums(_clip(inter + intra, clip)))


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
                       clip: float | None = None) -> list[np.ndarray]:
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
    _check_conventions(eps, std_floor)
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
    advantage[turns] = group_zscore(value[turns], sibling_group, keys.size, eps, std_floor)
    only_child = turns[group_size[sibling_group] == 1]
    depth = _node_depth(parent)
    for level in np.unique(depth[only_child]):  # parents are settled before their children
        nodes = only_child[depth[only_child] == level]
        advantage[nodes] = advantage[parent[nodes]]  # a root's advantage is 0
    advantage = _clip(advantage, clip)
    node_adv = advantage * batch.subtree_leaves
    node_adv[parent < 0] = 0.0
    return batch.split(node_adv)


def treepo_advantages(trees: Sequence[RolloutTree], *, eps: float = 1e-6, std_floor: float = 1e-3,
                      clip: float | None = None) -> list[np.ndarray]:
    """TreePO: size-weighted mean over depths of (reward - mean of the leaves sharing the prefix), whitened.

    Returns:
        per tree, (N_t,) float64 node advantages (leaf-row sums; root 0).

    References:
        TreePO (arXiv 2508.17445): segment-tree advantages from subgroups sharing each prefix, combined
        across depths weighted by subgroup size, normalised over the global batch. Subgroups of one leaf
        (no baseline) are left out.
    """
    _check_conventions(eps, std_floor)
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
    total = np.bincount(batch.pair_leaf, weights=weight * diff, minlength=num_leaves)
    weight_sum = np.bincount(batch.pair_leaf, weights=weight, minlength=num_leaves)
    raw = np.divide(total, weight_sum, out=np.zeros(num_leaves), where=weight_sum > 0)
    whitened = batch.kept_leaf_zscore(raw, np.zeros(num_leaves, dtype=np.int64), 1, eps, std_floor)
    return batch.split(batch.leaf_row_sums(_clip(whitened, clip)))


ESTIMATORS: dict[str, Callable[..., list[np.ndarray]]] = {
    "grpo": grpo_advantages,
    "tree_grpo": tree_grpo_advantages,
    "treerpo": treerpo_advantages,
    "treepo": treepo_advantages,
}


def get_estimator(name) -> Callable[..., list[np.ndarray]]:
    """Look up an estimator by name (a string or ``trace.config.Estimator``).

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
                       std_floor: float = 1e-3, clip: float | None = None) -> list[np.ndarray]:
    """Node advantages of every tree by the named estimator, without touching the trees.

    Returns:
        per tree, (N_t,) float64 indexed by ``node_id``; root 0.
    """
    return get_estimator(estimator)(trees, eps=eps, std_floor=std_floor, clip=clip)


def assign_advantages(trees: Sequence[RolloutTree], estimator="tree_grpo", eps: float = 1e-6,
                      std_floor: float = 1e-3, clip: float | None = None) -> LeafAdvantages:
    """Set ``node.advantage`` on every non-root node and return the per-leaf-row advantages.

    Args:
        trees: the step's rollout trees (modified in place: ``advantage`` of every non-root node; the root's
            stays ``None`` since prompt tokens are never trained).
        estimator: a name in ``ESTIMATORS``.
        eps, std_floor, clip: ``advantages.eps``, ``advantages.std_floor``, ``advantages.clip``.

    Returns:
        ``LeafAdvantages`` of every leaf, tree by tree in node-id order.

    Raises:
        ValueError: unknown estimator or invalid conventions.
    """
    node_advantages = compute_advantages(trees, estimator, eps=eps, std_floor=std_floor, clip=clip)
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
