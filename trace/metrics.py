"""Rollout metrics: pure functions from a step's rollout trees to ``{"name": float}``.

The contrast metrics keep the names of docs/method.md#metrics, unnamespaced, so every ablation logs the same
keys: ``effective_ratio``, ``effective_token_ratio``, ``active_prompt_ratio``, ``mixed_group_ratio``. The
rest are namespaced (``reward/mean``, ``turns/mean``, ``tokens/generated``, ``tools/calls``,
``rollout/trajectories``, ``rollout/prompts``, ``rollout/branches``, ``allocation/anchor_contrast``).

Definitions (groups by explicit ids, as in ``trace.advantages``):
- a *group* is the leaves of one prompt (all trees sharing a ``prompt_uid``) or the leaves below one branch
  anchor (a non-root node with >= 2 children); it is *mixed* when its leaf rewards are not all equal;
- a leaf is *effective* when it lies in at least one mixed group of size >= 2. An anchor group sits inside
  its prompt group, so in practice this is "the prompt's leaves are mixed"; both are checked as defined;
- an empty leaf (its own turn generated nothing) is in no group and never effective, but it counts among
  the sampled leaves (``trace.advantages``, module docstring);
- a generated token is *effective* when its node lies on the path of an effective leaf. Tokens are counted
  once per node, since a shared prefix is decoded once: the ratio is the share of decode compute that
  carries gradient signal.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trace.advantages.batch import TreeBatch
from trace.tree import RolloutTree

__all__ = [
    "effective_leaves",
    "effective_ratio",
    "effective_token_ratio",
    "active_prompt_ratio",
    "mixed_group_ratio",
    "anchor_contrast",
    "rollout_metrics",
    "ROLLOUT_METRIC_KEYS",
]

ROLLOUT_METRIC_KEYS = (
    "effective_ratio", "effective_token_ratio", "active_prompt_ratio", "mixed_group_ratio",
    "reward/mean", "turns/mean", "tokens/generated", "tokens/prompt", "tokens/observation", "tools/calls",
    "rollout/trajectories", "rollout/prompts", "rollout/branches", "allocation/anchor_contrast",
)


def _group_mixed(values: np.ndarray, group: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group: (is_mixed, size)."""
    high = np.full(num_groups, -np.inf)
    low = np.full(num_groups, np.inf)
    np.maximum.at(high, group, values)
    np.minimum.at(low, group, values)
    size = np.bincount(group, minlength=num_groups)
    return (size >= 2) & (high > low), size


def _prompt_mixed(batch: TreeBatch) -> tuple[np.ndarray, np.ndarray]:
    kept = batch.kept_leaves  # an empty leaf is in no group, as in trace.advantages
    return _group_mixed(batch.leaf_reward[kept], batch.leaf_prompt[kept], batch.num_prompts)


def _anchor_mixed(batch: TreeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(pair_leaf, anchor group of each pair, is_mixed per anchor, size per anchor) over branch anchors."""
    on_anchor = batch.is_branch_anchor()[batch.pair_node]
    pair_leaf = batch.pair_leaf[on_anchor]
    anchors, group = np.unique(batch.pair_node[on_anchor], return_inverse=True)
    mixed, size = _group_mixed(batch.leaf_reward[pair_leaf], group, anchors.size)
    return pair_leaf, group, mixed, size


def effective_leaves(trees: Sequence[RolloutTree]) -> list[np.ndarray]:
    """Which leaves lie in at least one mixed group.

    Returns:
        per tree, the (L_t,) bool flags of ``tree.leaves()`` (node-id order).
    """
    batch = TreeBatch.from_trees(trees)
    flags = _effective_flags(batch)
    leaf_tree = np.searchsorted(batch.offsets, batch.leaf, side="right") - 1
    return [flags[leaf_tree == t] for t in range(batch.num_trees)]


def _effective_flags(batch: TreeBatch) -> np.ndarray:
    prompt_mixed, _ = _prompt_mixed(batch)
    flags = prompt_mixed[batch.leaf_prompt] & ~batch.leaf_is_empty
    pair_leaf, group, anchor_mixed, _ = _anchor_mixed(batch)
    flags[pair_leaf[anchor_mixed[group]]] = True
    return flags


def effective_ratio(trees: Sequence[RolloutTree]) -> float:
    """Fraction of sampled leaves that lie in at least one mixed group (0 with no leaves).

    Example: three prompts with leaf rewards [1,1,1,1], [1,0,0,0], [0,0] give 4 / 10 = 0.4.

    References:
        TRACE (arXiv 2606.11119) and Knapsack-RL (arXiv 2509.25849): the effective ratio of samples with a
        non-zero group-relative advantage.
    """
    return _effective_ratio(TreeBatch.from_trees(trees))


def _effective_ratio(batch: TreeBatch) -> float:
    return float(_effective_flags(batch).mean()) if batch.leaf.size else 0.0


def _generated_tokens(trees: Sequence[RolloutTree]) -> np.ndarray:
    """(G,) float64 generated tokens of every node, in global-id order."""
    return np.array([node.num_generated_tokens for tree in trees for node in tree.nodes], dtype=np.float64)


def effective_token_ratio(trees: Sequence[RolloutTree]) -> float:
    """Share of generated tokens (each node counted once) on the path of an effective leaf (0 with none)."""
    return _effective_token_ratio(TreeBatch.from_trees(trees), _generated_tokens(trees))


def _effective_token_ratio(batch: TreeBatch, tokens: np.ndarray) -> float:
    total = tokens.sum()
    if total == 0:
        return 0.0
    flags = _effective_flags(batch)
    on_path = np.zeros(batch.parent.size, dtype=bool)
    on_path[batch.leaf[flags]] = True
    on_path[batch.pair_node[flags[batch.pair_leaf]]] = True
    return float(tokens[on_path].sum() / total)


def active_prompt_ratio(trees: Sequence[RolloutTree], num_candidates: int | None = None) -> float:
    """Fraction of prompts whose leaves are mixed (the group "activated").

    Args:
        trees: the step's trees.
        num_candidates: candidates drawn this step (skipped prompts count as inactive); None divides by the
            number of distinct prompts among ``trees``.

    Raises:
        ValueError: ``num_candidates`` smaller than the number of distinct prompts.
    """
    return _active_prompt_ratio(TreeBatch.from_trees(trees), num_candidates)


def _active_prompt_ratio(batch: TreeBatch, num_candidates: int | None) -> float:
    mixed, _ = _prompt_mixed(batch)
    denominator = batch.num_prompts if num_candidates is None else int(num_candidates)
    if denominator < batch.num_prompts:
        raise ValueError(f"num_candidates={num_candidates} < {batch.num_prompts} distinct prompts in the trees")
    return float(mixed.sum() / denominator) if denominator else 0.0


def mixed_group_ratio(trees: Sequence[RolloutTree]) -> float:
    """Fraction of groups of size >= 2 (prompt groups and branch-anchor groups) that are mixed (0 if none)."""
    return _mixed_group_ratio(TreeBatch.from_trees(trees))


def _mixed_group_ratio(batch: TreeBatch) -> float:
    prompt_mixed, prompt_size = _prompt_mixed(batch)
    _, _, anchor_mixed, anchor_size = _anchor_mixed(batch)
    num_groups = int((prompt_size >= 2).sum() + (anchor_size >= 2).sum())
    if num_groups == 0:
        return 0.0
    return float((prompt_mixed.sum() + anchor_mixed.sum()) / num_groups)


def anchor_contrast(trees: Sequence[RolloutTree]) -> float:
    """Sum of ``V (1 - V)`` over allocated anchors (nodes with ``num_branches > 0``).

    ``V`` is the node's ``true_success_prob`` where the environment knows it (simulator), else its
    ``pred_success_prob``; anchors with neither are left out.

    References:
        TRACE (arXiv 2606.11119), Proposition 2: ``V(H)(1 - V(H))`` is the expected contrast left below ``H``.
    """
    total = 0.0
    for tree in trees:
        for node in tree.nodes:
            if node.num_branches <= 0:
                continue
            value = node.true_success_prob if node.true_success_prob is not None else node.pred_success_prob
            if value is not None:
                total += float(value) * (1.0 - float(value))
    return total


def rollout_metrics(trees: Sequence[RolloutTree], num_candidates: int | None = None) -> dict[str, float]:
    """Every rollout metric of one step, keyed as in ``ROLLOUT_METRIC_KEYS``.

    Args:
        trees: the step's rollout trees.
        num_candidates: candidates drawn this step, for ``active_prompt_ratio`` (None: prompts in ``trees``).

    Returns:
        ``{"effective_ratio", "effective_token_ratio", "active_prompt_ratio", "mixed_group_ratio",
        "reward/mean" (mean leaf reward), "turns/mean" (mean turns per trajectory), "tokens/generated"
        (policy tokens decoded, shared prefixes once; what ``train.token_budget`` counts), "tokens/prompt" (the
        prompts' tokens, once per tree), "tokens/observation" (tool and environment tokens in the turns, each
        node once), "tools/calls", "rollout/trajectories" (leaves),
        "rollout/prompts" (distinct prompts), "rollout/branches" (continuations sampled from anchors),
        "allocation/anchor_contrast"}``, all floats.

    Raises:
        RewardError: a reward that is not a finite real number (``"1"``, ``True``, NaN), naming the tree, the
            node and the value (``RolloutTree.reward_of``).
    """
    batch = TreeBatch.from_trees(trees)
    tokens = _generated_tokens(trees)
    num_leaves = batch.leaf.size
    leaf_depth = np.array([tree.depth(leaf.node_id) for tree in trees for leaf in tree.leaves()], dtype=np.float64)
    return {
        "effective_ratio": _effective_ratio(batch),
        "effective_token_ratio": _effective_token_ratio(batch, tokens),
        "active_prompt_ratio": _active_prompt_ratio(batch, num_candidates),
        "mixed_group_ratio": _mixed_group_ratio(batch),
        "reward/mean": float(batch.leaf_reward.mean()) if num_leaves else 0.0,
        "turns/mean": float(leaf_depth.mean()) if num_leaves else 0.0,
        "tokens/generated": float(tokens.sum()),
        "tokens/prompt": float(sum(len(tree.nodes[0].token_ids) for tree in trees if tree.nodes)),
        "tokens/observation": float(sum(len(n.token_ids) - n.num_generated_tokens for tree in trees
                                        for n in tree.nodes[1:])),
        "tools/calls": float(sum(tree.num_tool_calls() for tree in trees)),
        "rollout/trajectories": float(num_leaves),
        "rollout/prompts": float(batch.num_prompts),
        "rollout/branches": float(sum(node.num_branches for tree in trees for node in tree.nodes)),
        "allocation/anchor_contrast": anchor_contrast(trees),
    }
