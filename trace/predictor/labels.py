"""Labelled nodes of rollout trees: the examples every predictor is fitted and scored on.

Every labelled node carries the mean reward of its descendant leaves, weighted by their count
(``RolloutTree.node_success_labels``). Labelled nodes are the root and every non-leaf turn with at least one
descendant leaf; leaves are left out, since a leaf's label is its own verified reward and no allocator ever
scores a finished trajectory.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trace.tree import RolloutTree


def labelled_node_ids(tree: RolloutTree) -> list[int]:
    """Ids of the nodes a predictor is fitted and scored on: the root and every non-leaf turn with a leaf below.

    Args:
        tree: a rollout tree.

    Returns:
        Node ids in increasing order; empty for a root-only tree.
    """
    num_leaves, _ = tree.subtree_stats()
    has_child = np.zeros(len(tree.nodes), dtype=bool)
    for node in tree.nodes[1:]:
        has_child[node.parent_id] = True
    return [int(i) for i in np.flatnonzero(has_child & (num_leaves > 0))]


def check_root_weights(root_weights: Sequence[float], num_trees: int) -> np.ndarray:
    """``root_weights`` as (T,) float64, one finite positive multiplier per tree.

    Raises:
        ValueError: on another length, or a value that is not finite and > 0.
    """
    out = np.asarray(root_weights, dtype=np.float64)
    if out.shape != (num_trees,) or not np.all(np.isfinite(out) & (out > 0)):
        raise ValueError(f"root_weights must be {num_trees} finite positive values, one per tree; got shape "
                         f"{out.shape}")
    return out


def node_examples(trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None
                  ) -> tuple[list[list[int]], np.ndarray, np.ndarray, np.ndarray]:
    """The labelled nodes of every tree with their labels and weights.

    Args:
        trees: rollout trees with rewards at their leaves.
        root_weights: (T,) positive multipliers of each tree's root weight (``exploration_root_weights``: the
            importance weights of exploration groups); ``None`` = 1 for every tree. Turn nodes keep their leaf
            counts.

    Returns:
        ``(node_ids, labels, weights, is_root)``: the labelled node ids per tree (``labelled_node_ids``), and
        over all of them in tree order (N,) float64 success fractions in [0, 1], (N,) float64 leaf counts (a
        root's times its ``root_weights`` entry) and (N,) bool root flags.

    Raises:
        ValueError: if ``root_weights`` is not one finite positive value per tree.
    """
    if root_weights is not None:
        root_weights = check_root_weights(root_weights, len(trees))
    node_ids, labels, weights, is_root = [], [], [], []
    for t, tree in enumerate(trees):
        ids = labelled_node_ids(tree)
        label, weight = tree.node_success_labels()
        roots = np.array([tree.nodes[i].is_root for i in ids], dtype=bool)
        node_ids.append(ids)
        labels.append(label[ids])
        weights.append(weight[ids] * np.where(roots, 1.0 if root_weights is None else root_weights[t], 1.0))
        is_root.append(roots)
    if not trees:
        return [], np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool)
    return node_ids, np.concatenate(labels), np.concatenate(weights), np.concatenate(is_root)
