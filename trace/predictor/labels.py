"""Labelled nodes of rollout trees: the examples every predictor is fitted and scored on.

Labelled nodes are the root and every non-leaf turn with at least one descendant leaf; leaves are left out, since
a leaf's label is its own verified reward and no allocator ever scores a finished trajectory. Each carries a mean
reward and a weight, the number of outcomes it stands for (``predictor.labels``):

- ``subtree`` (default): every leaf below the node (``RolloutTree.node_success_labels``).
- ``branch_point``: only the trajectories sampled at or above the node (``branch_point_labels``). A root rollout
  counts for every node on its path; a continuation counts for its anchor and the nodes below, not for the
  anchor's ancestors. Stage 2 picks anchors by their forecast and their factual reward, so the continuations
  below an ancestor are draws from the futures of a node chosen with the outcome in view, not from the
  ancestor's own; ``subtree`` labels pull such ancestors, the roots most, toward the anchors' values.
"""

from __future__ import annotations

from typing import Sequence, get_args

import numpy as np

from trace.configuration.config_predictor import LabelScheme
from trace.tree import Origin, RolloutTree

LABEL_SCHEMES = get_args(LabelScheme)  # the values predictor.labels accepts


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


def branch_point_labels(tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
    """Per node: the mean reward of the trajectories sampled at or above it, and their number.

    A leaf's trajectory branched from the root (a root rollout) or from its ``branch_anchor_id`` (a continuation);
    it counts for every node from the leaf up to that branch point, the branch point included. Every node's
    outcomes are then draws from its own future under the policy: none of them was sampled below a node that
    the allocator chose after seeing an outcome through it. Unbiased where stage 2 chooses anchors by their
    factual reward, as ``subtree`` labels are not (module docstring; docs/method.md#success-predictor).

    Args:
        tree: a rollout tree with rewards at its leaves.

    Returns:
        ``(label, weight)``: (N,) float64 mean reward (0 where no trajectory counts) and (N,) float64 count,
        indexed by ``node_id``. A root-only tree gives zeros.

    Raises:
        RewardError: a leaf whose reward is not a finite real number (``RolloutTree.reward_of``).
        ValueError: a continuation whose ``branch_anchor_id`` is not an ancestor of its leaf.
    """
    n = len(tree.nodes)
    has_child = np.zeros(n, dtype=bool)
    for node in tree.nodes[1:]:
        has_child[node.parent_id] = True
    count, reward_sum = np.zeros(n), np.zeros(n)
    for leaf in tree.nodes[1:]:
        if has_child[leaf.node_id]:
            continue
        stop = leaf.branch_anchor_id if leaf.origin == Origin.BRANCH and leaf.branch_anchor_id >= 0 else 0
        reward, node_id = tree.reward_of(leaf), leaf.node_id
        while True:
            count[node_id] += 1.0
            reward_sum[node_id] += reward
            if node_id == stop:
                break
            node_id = tree.nodes[node_id].parent_id
            if node_id < 0:
                raise ValueError(f"tree {tree.tree_id}: leaf {leaf.node_id} names branch anchor {stop}, which is "
                                 "not on its path to the root; the tree's branch_anchor_id fields are corrupt")
    return np.divide(reward_sum, count, out=np.zeros(n), where=count > 0), count


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


def node_examples(trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None,
                  scheme: str = "subtree") -> tuple[list[list[int]], np.ndarray, np.ndarray, np.ndarray]:
    """The labelled nodes of every tree with their labels and weights.

    Args:
        trees: rollout trees with rewards at their leaves.
        root_weights: (T,) positive multipliers of each tree's root weight (``exploration_root_weights``: the
            importance weights of exploration groups); ``None`` = 1 for every tree. Turn nodes keep their
            outcome counts.
        scheme: ``predictor.labels``, one of ``LABEL_SCHEMES`` (module docstring).

    Returns:
        ``(node_ids, labels, weights, is_root)``: the labelled node ids per tree (``labelled_node_ids``), and
        over all of them in tree order (N,) float64 success fractions in [0, 1], (N,) float64 outcome counts (a
        root's times its ``root_weights`` entry) and (N,) bool root flags.

    Raises:
        ValueError: if ``root_weights`` is not one finite positive value per tree, or ``scheme`` is unknown.
    """
    if scheme not in LABEL_SCHEMES:
        raise ValueError(f"predictor.labels={scheme!r} is not a label scheme; valid: {', '.join(LABEL_SCHEMES)}")
    if root_weights is not None:
        root_weights = check_root_weights(root_weights, len(trees))
    node_ids, labels, weights, is_root = [], [], [], []
    for t, tree in enumerate(trees):
        ids = labelled_node_ids(tree)
        label, weight = tree.node_success_labels() if scheme == "subtree" else branch_point_labels(tree)
        roots = np.array([tree.nodes[i].is_root for i in ids], dtype=bool)
        node_ids.append(ids)
        labels.append(label[ids])
        weights.append(weight[ids] * np.where(roots, 1.0 if root_weights is None else root_weights[t], 1.0))
        is_root.append(roots)
    if not trees:
        return [], np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool)
    return node_ids, np.concatenate(labels), np.concatenate(weights), np.concatenate(is_root)
