"""A batch of rollout trees flattened to global node ids, and the group statistics the estimators share.

Groups are by explicit ids (prompt uids, anchor node ids), never by position; an empty leaf (no generated
token in its own turn) is in no group and no leaf-ancestor pair. The conventions of ``group_zscore`` are
those of ``trace.advantages`` (package docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from trace.tree import RolloutTree


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
            no group and no pair below (see ``trace.advantages``).
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
            ValueError: a node id that is not its position (names the tree).
            RewardError: a reward that is not a finite real number, e.g. ``"1"``, ``True`` or NaN set on a node
                after ``add_node`` (``RolloutTree.reward_of``; names the tree, the node and the value).
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
                reward[base + i] = tree.reward_of(node)
                has_generated[base + i] = any(node.loss_mask)
        num_children = np.bincount(parent[parent >= 0], minlength=num_nodes).astype(np.int64)
        leaf = np.flatnonzero((num_children == 0) & (parent >= 0)).astype(np.int64)
        leaf_reward = reward[leaf]

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
                         std_floor: float, *, baseline: str = "mean", scale: str = "std") -> np.ndarray:
        """(L,) ``group_zscore`` of per-leaf ``values`` over the non-empty leaves only; empty leaves get 0."""
        out = np.zeros(self.leaf.size, dtype=np.float64)
        kept = self.kept_leaves
        out[kept] = group_zscore(np.asarray(values, dtype=np.float64)[kept], group[kept], num_groups, eps,
                                 std_floor, baseline=baseline, scale=scale)
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
BASELINES = ("mean", "leave_one_out")
SCALES = ("std", "none")


def check_group_options(baseline: str, scale: str, negative_weight: float) -> None:
    """Refuse an unknown baseline or scale, or a negative weight outside [0, 1].

    Raises:
        ValueError: naming the option, the value and the valid values.
    """
    if baseline not in BASELINES:
        raise ValueError(f"advantages.baseline must be one of {list(BASELINES)}, got {baseline!r}")
    if scale not in SCALES:
        raise ValueError(f"advantages.scale must be one of {list(SCALES)}, got {scale!r}")
    if not 0.0 <= negative_weight <= 1.0:
        raise ValueError(f"advantages.negative_weight must be in [0, 1], got {negative_weight}")


def group_zscore(values: np.ndarray, group: np.ndarray, num_groups: int, eps: float, std_floor: float, *,
                 baseline: str = "mean", scale: str = "std") -> np.ndarray:
    """Z-score of each value within its group, with the conventions of ``trace.advantages``.

    Args:
        values: (K,) float rewards (any float dtype; computed in float64).
        group: (K,) int64 group index in ``[0, num_groups)``.
        num_groups: number of groups.
        eps: added to the std (> 0).
        std_floor: groups with unbiased std below this give 0.
        baseline: ``"mean"`` subtracts the group mean; ``"leave_one_out"`` subtracts the mean of the *other*
            members, ``v - (S - v) / (n - 1) = n / (n - 1) * (v - mean)`` (RLOO).
        scale: ``"std"`` divides by ``std + eps``; ``"none"`` keeps the centred value (Dr. GRPO).

    Returns:
        (K,) float64 ``(v - baseline_g) / (std_g + eps)`` (or unscaled), exactly 0 in groups of size 1, in
        groups of equal values, and in groups with ``std_g < std_floor``, whatever the options.

    References:
        GRPO (arXiv 2402.03300), eq. 3; RLOO, Ahmadian et al. 2024 (arXiv 2402.14740), eq. 4 (leave-one-out
        baseline); Dr. GRPO, Liu et al. 2025 (arXiv 2503.20783), section 3.1 (no std normalisation).
    """
    check_group_options(baseline, scale, 1.0)
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
    if baseline == "leave_one_out":
        deviation = deviation * (count / np.maximum(count - 1, 1))[group]
    if scale == "std":
        deviation = deviation / (std[group] + eps)
    return np.where(informative[group], deviation, 0.0)
