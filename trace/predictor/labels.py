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


def node_examples(trees: Sequence[RolloutTree]) -> tuple[list[list[int]], np.ndarray, np.ndarray, np.ndarray]:
    """The labelled nodes of every tree with their labels and weights.

    Args:
        trees: rollout trees with rewards at their leaves.

    Returns:
        ``(node_ids, labels, weights, is_root)``: the labelled node ids per tree (``labelled_node_ids``), and
        over all of them in tree order (N,) float64 success fractions in [0, 1], (N,) float64 leaf counts and
        (N,) bool root flags.
    """
    node_ids, labels, weights, is_root = [], [], [], []
    for tree in trees:
        ids = labelled_node_ids(tree)
        label, weight = tree.node_success_labels()
        node_ids.append(ids)
        labels.append(label[ids])
        weights.append(weight[ids])
        is_root.append(np.array([tree.nodes[i].is_root for i in ids], dtype=bool))
    if not trees:
        return [], np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool)
    return node_ids, np.concatenate(labels), np.concatenate(weights), np.concatenate(is_root)
