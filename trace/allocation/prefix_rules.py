"""Stage-2 prefix rules by name, and ``plan_expansion``, which places a step's continuations with one of them.

Prefix rules (``PREFIX_RULES``), each ``fn(AnchorRequest) -> (K,) int64`` for one tree:
- ``none``: no stage 2 (arms that spend the whole budget on roots);
- ``trace``: ``allocate_prefixes`` over the tree's candidate anchors (TRACE stage 2);
- ``random``: each continuation picks a candidate anchor uniformly at random (Tree-GRPO, arXiv 2509.21240);
- ``treepo``: ``treepo_width`` continuations at every anchor, shallowest turn depth first, until the budget
  is spent (TreePO, arXiv 2508.17445, fixed-width segment branching).

Invariant: ``plan.total + plan.unspent`` equals the stage-2 budget. A tree with no candidate anchors (every
trajectory ended after one turn) hands its continuations to the trees of the same step that have anchors,
in proportion to their budgets. If no tree has an anchor, the plan returns the whole stage-2 budget as
``unspent``: the caller spends it on extra root rollouts so the step still samples T trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from trace.allocation.prefix import allocate_prefixes, candidate_anchors, split_expansion_budget
from trace.allocation.registry import AnchorRequest, Arm, get_prefix_rule, register_prefix_rule
from trace.tree import RolloutTree

__all__ = ["ExpansionPlan", "plan_expansion"]

register_prefix_rule("none")(None)


@register_prefix_rule("trace", needs_scores=True)
def trace_prefix_rule(request: AnchorRequest) -> np.ndarray:
    """TRACE stage 2: ``allocate_prefixes`` on the tree's anchors with their predicted success probabilities.

    Raises:
        KeyError: a candidate anchor has no entry in ``request.anchor_probs``.
    """
    t, node_ids, anchor_probs = request.tree_idx, request.node_ids, request.anchor_probs
    try:
        probs = np.array([anchor_probs[(t, int(n))] for n in node_ids], dtype=np.float64)
    except (KeyError, TypeError):
        missing = [int(n) for n in node_ids if anchor_probs is None or (t, int(n)) not in anchor_probs]
        raise KeyError(f"tree {t} ({request.tree.tree_id}): no predicted success probability for candidate "
                       f"anchors {missing[:10]}; score every candidate anchor before planning") from None
    return allocate_prefixes(request.rewards, probs, request.budget, tie_keys=node_ids)


@register_prefix_rule("random")
def random_prefix_rule(request: AnchorRequest) -> np.ndarray:
    """Tree-GRPO: each continuation picks one of the tree's candidate anchors uniformly at random."""
    num_anchors = request.node_ids.size
    return request.rng.multinomial(request.budget, np.full(num_anchors, 1.0 / num_anchors)).astype(np.int64)


def _treepo_counts(depths: np.ndarray, budget: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Width ``w`` per anchor, shallowest depth first (random order within a depth), cycling until spent."""
    counts = np.zeros(depths.size, dtype=np.int64)
    if budget == 0:
        return counts
    perm = rng.permutation(depths.size)
    visit = perm[np.argsort(depths[perm], kind="stable")]  # by depth, random within a depth
    per_pass = width * depths.size
    full_passes, rest = divmod(budget, per_pass)
    counts += full_passes * width
    num_full, partial = divmod(rest, width)
    counts[visit[:num_full]] += width
    if partial:
        counts[visit[num_full]] += partial
    return counts


@register_prefix_rule("treepo")
def treepo_prefix_rule(request: AnchorRequest) -> np.ndarray:
    """TreePO: ``treepo_width`` branches per anchor, shallowest turn depth first, cycling until spent."""
    depths = np.array([request.tree.nodes[int(n)].turn_idx for n in request.node_ids], dtype=np.int64)
    return _treepo_counts(depths, request.budget, request.treepo_width, request.rng)


@dataclass(frozen=True, eq=False)
class ExpansionPlan:
    """Continuations for one step.

    Attributes:
        counts: ``{(tree_idx, node_id): K}`` continuations per anchor (only ``K > 0`` listed).
        budget_per_tree: (num_trees,) int64 continuations each tree actually gets, after trees without
            candidate anchors handed theirs on.
        unspent: continuations that could not be placed because no tree had a candidate anchor; spend
            them as extra root rollouts to keep the step at T trajectories.
    """

    counts: dict
    budget_per_tree: np.ndarray
    unspent: int

    @property
    def total(self) -> int:
        return int(sum(self.counts.values()))


def _redistribute(budgets: np.ndarray, num_anchors: np.ndarray) -> tuple[np.ndarray, int]:
    has = num_anchors > 0
    moved = int(budgets[~has].sum())
    out = np.where(has, budgets, 0).astype(np.int64)
    if moved == 0:
        return out, 0
    if not has.any():
        return out, moved
    weights = np.where(has, budgets, 0)
    if weights.sum() == 0:
        weights = np.where(has, num_anchors, 0)
    return out + split_expansion_budget(weights, moved), 0


def plan_expansion(arm: Arm, trees: Sequence[RolloutTree], anchor_probs: Mapping | None,
                   expansion_budget_per_tree, rng: np.random.Generator, treepo_width: int = 2, *,
                   new_only_from: Mapping[int, Sequence[int]] | None = None) -> ExpansionPlan:
    """Place each tree's stage-2 continuations on its candidate anchors by the arm's prefix rule.

    Args:
        arm: the arm (``trace.allocation.arms.get_arm(name)``).
        trees: the step's rollout trees after stage 1 (one per active prompt).
        anchor_probs: ``{(tree_idx, node_id): V_hat}`` for every candidate anchor (read by rules with
            ``needs_scores`` only; may be None for the others).
        expansion_budget_per_tree: (num_trees,) int continuations per tree (``split_expansion_budget``).
        rng: random generator (``random`` and ``treepo`` rules).
        treepo_width: branches per anchor of the ``treepo`` rule (``allocation.treepo_width``).
        new_only_from: for later rounds, ``{tree_idx: node ids created by the previous round}``.

    Returns:
        ``ExpansionPlan``; ``total + unspent == sum(expansion_budget_per_tree)``.

    Raises:
        ValueError: wrong budget shape, a positive budget for an arm without stage 2, an unknown rule.
        KeyError: ``trace`` rule with a candidate anchor missing from ``anchor_probs``.
    """
    budgets = np.asarray(expansion_budget_per_tree, dtype=np.int64).reshape(-1)
    if budgets.size != len(trees) or np.any(budgets < 0):
        raise ValueError(f"expansion_budget_per_tree must hold {len(trees)} counts >= 0, got {budgets.tolist()}")
    rule = get_prefix_rule(arm.prefix_rule)
    if not rule.expands:
        if budgets.sum() > 0:
            raise ValueError(f"ablation {arm.name!r} has no prefix expansion but got {int(budgets.sum())} "
                             "continuations: spend the whole trajectory_budget on roots")
        return ExpansionPlan(counts={}, budget_per_tree=budgets, unspent=0)
    if treepo_width < 1:
        raise ValueError(f"allocation.treepo_width must be >= 1, got {treepo_width}")

    anchors = [candidate_anchors(tree, None if new_only_from is None else new_only_from.get(t, ()))
               for t, tree in enumerate(trees)]
    budgets, unspent = _redistribute(budgets, np.array([len(a) for a in anchors], dtype=np.int64))
    counts: dict = {}
    for t, (tree, tree_anchors) in enumerate(zip(trees, anchors)):
        budget = int(budgets[t])
        if budget == 0:
            continue
        node_ids = np.array([a[0] for a in tree_anchors], dtype=np.int64)
        rewards = np.array([a[1] for a in tree_anchors], dtype=np.float64)
        per_anchor = rule.fn(AnchorRequest(tree=tree, tree_idx=t, node_ids=node_ids, rewards=rewards, budget=budget,
                                           anchor_probs=anchor_probs, rng=rng, treepo_width=treepo_width))
        for node_id, k in zip(node_ids.tolist(), per_anchor.tolist()):
            if k > 0:
                counts[(t, node_id)] = int(k)
    return ExpansionPlan(counts=counts, budget_per_tree=budgets, unspent=unspent)
