"""Stage 2 of TRACE: how many continuations each visited prefix (anchor) of an active prompt gets.

After prompt ``i`` finishes its bare rollouts, every visited non-terminal prefix ``H_ijt`` (``1 <= t <= T_j -
1``) is a candidate anchor with the factual reward ``r_ij`` of the trajectory it lies on and a predicted
success probability ``v = V_hat(H_ijt)``. A local budget of ``round(m_i * N)`` continuations is spread over
the prompt's anchors to maximise

    sum V_pref(r, v, K),   V_pref(r, v, k) = 1 - [ r v^k + (1 - r) (1 - v)^k ],

the probability that at least one of ``k`` continuations ends with the outcome opposite to the factual one.
``V_pref`` is concave in ``k`` (its increments ``r (1 - v) v^(k-1) + (1 - r) v (1 - v)^(k-1)`` never grow),
so taking the best marginal gains first is exact.

Invariants: allocations sum to the budget exactly; ties break by (tie key, k), so the result depends only
on the multiset of ``(tie_key, r, v)`` triples.

References:
    TRACE (arXiv 2606.11119), stage 2 prefix expansion objective.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from trace.allocation.root import canonical_order
from trace.tree import RolloutTree

__all__ = [
    "prefix_value",
    "prefix_marginal_gain",
    "allocate_prefixes",
    "candidate_anchors",
    "split_expansion_budget",
]


def _as_unit_interval(values, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(arr) & (arr >= 0.0) & (arr <= 1.0)
    if not np.all(ok):
        raise ValueError(f"{name} must lie in [0, 1]; got {arr[~ok][:5].tolist()}")
    return arr


def prefix_value(factual_reward, pred_success_prob, num_continuations):
    """Probability that ``k`` continuations from an anchor create an opposite-outcome sibling.

    Args:
        factual_reward: float or array ``r`` in [0, 1], the reward of the trajectory through the anchor
            (a mean of leaves where several; 1 = success).
        pred_success_prob: float or array ``v = V_hat(H)`` in [0, 1] at the anchor.
        num_continuations: int or int array ``k >= 0``.

    Returns:
        float64 array (or scalar) ``1 - [r v^k + (1 - r)(1 - v)^k]``, exactly 0 at ``k = 0``.

    Raises:
        ValueError: inputs outside their ranges.

    References:
        TRACE (arXiv 2606.11119), stage 2: ``V_pref(k)``.
    """
    r = _as_unit_interval(factual_reward, "factual_reward")
    v = _as_unit_interval(pred_success_prob, "pred_success_prob")
    k = np.asarray(num_continuations, dtype=np.float64)
    if np.any(k < 0) or np.any(k != np.round(k)):
        raise ValueError(f"num_continuations must be integers >= 0, got {np.ravel(k)[:5].tolist()}")
    r, v, k = np.broadcast_arrays(r, v, k)
    value = 1.0 - (r * np.power(v, k) + (1.0 - r) * np.power(1.0 - v, k))
    value = np.where(k > 0, np.clip(value, 0.0, 1.0), 0.0)
    return value[()] if value.ndim == 0 else value


def prefix_marginal_gain(factual_reward, pred_success_prob, k):
    """Gain of the ``k``-th continuation: ``V_pref(k) - V_pref(k - 1)`` in closed form (``k >= 1``).

    Returns:
        float64 ``r (1 - v) v^(k-1) + (1 - r) v (1 - v)^(k-1)``, non-increasing in ``k``.
    """
    r = np.asarray(factual_reward, dtype=np.float64)
    v = np.asarray(pred_success_prob, dtype=np.float64)
    km1 = np.asarray(k, dtype=np.float64) - 1.0
    return r * (1.0 - v) * np.power(v, km1) + (1.0 - r) * v * np.power(1.0 - v, km1)


def allocate_prefixes(factual_rewards, pred_success_prob, budget: int, tie_keys=None) -> np.ndarray:
    """Spread ``budget`` continuations over anchors by the greatest marginal gain of ``V_pref``.

    Equivalent to popping a heap of marginal gains ``budget`` times (exact for concave ``V_pref``), done
    without a Python loop: each anchor lists its first ``L`` gains, the ``budget`` best listed gains are
    chosen by a partition plus an ordered tie-break, and anchors whose next unlisted gain could still be
    chosen list twice as many; this repeats until no such anchor is left.

    Args:
        factual_rewards: (A,) float factual reward ``r`` of the trajectory through each anchor, in [0, 1].
        pred_success_prob: (A,) float predicted success probability ``v`` at each anchor, in [0, 1].
        budget: continuations to allocate (>= 0); the counts sum to it exactly.
        tie_keys: (A,) sortable keys (node ids) ordering equal gains; None uses the input order.

    Returns:
        (A,) int64 continuations per anchor.

    Raises:
        ValueError: shapes differ, values outside [0, 1], a negative budget, or ``budget > 0`` with no
            anchors (the caller should move the budget elsewhere).

    References:
        TRACE (arXiv 2606.11119), stage 2: greedy by marginal gain is exact since ``V_pref`` is concave.
    """
    r = _as_unit_interval(factual_rewards, "factual_rewards")
    v = _as_unit_interval(pred_success_prob, "pred_success_prob")
    if r.ndim != 1 or r.shape != v.shape:
        raise ValueError(f"factual_rewards and pred_success_prob must both have shape (A,), got {r.shape}, {v.shape}")
    if int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget}")
    budget = int(budget)
    num_anchors = r.size
    if budget == 0:
        return np.zeros(num_anchors, dtype=np.int64)
    if num_anchors == 0:
        raise ValueError(f"cannot place {budget} continuations: no candidate anchors (every trajectory ended "
                         "after one turn); move this budget to other prompts or to extra root rollouts")
    rank = np.empty(num_anchors, dtype=np.int64)
    rank[canonical_order(num_anchors, tie_keys)] = np.arange(num_anchors)

    caps = np.full(num_anchors, min(budget, max(2, 2 * -(-budget // num_anchors))), dtype=np.int64)
    while True:
        starts = np.cumsum(caps) - caps
        anchor = np.repeat(np.arange(num_anchors), caps)  # (I,) listed items
        k = np.arange(anchor.size, dtype=np.int64) - np.repeat(starts, caps) + 1
        gain = prefix_marginal_gain(r[anchor], v[anchor], k)
        if anchor.size <= budget:
            counts = caps.copy()
            threshold = -np.inf
        else:
            threshold = -np.partition(-gain, budget - 1)[budget - 1]  # the budget-th largest gain
            above = gain > threshold
            need = budget - int(above.sum())
            tied = np.flatnonzero(gain == threshold)
            tied = tied[np.lexsort((k[tied], rank[anchor[tied]]))][:need]
            above[tied] = True
            counts = np.bincount(anchor[above], minlength=num_anchors).astype(np.int64)
        # an anchor whose whole list was chosen may deserve more: its next gain can reach the threshold
        full = (counts == caps) & (caps < budget)
        if full.any():
            nxt = prefix_marginal_gain(r[full], v[full], caps[full] + 1)
            grow = np.flatnonzero(full)[nxt >= threshold]
            if grow.size:
                caps[grow] = np.minimum(2 * caps[grow], budget)
                continue
        return counts


def candidate_anchors(tree: RolloutTree, new_only_from: Iterable[int] | None = None) -> list[tuple[int, float]]:
    """Candidate anchors of a tree: every visited non-terminal prefix, with its factual reward.

    A candidate is a non-root node with at least one child (``H_ijt`` for ``1 <= t <= T_j - 1``). Its
    factual reward is the mean reward of its descendant leaves (the one trajectory through it after
    stage 1; a mean where earlier rounds branched below it). Truncated leaves count with reward 0.

    Args:
        tree: a rollout tree.
        new_only_from: for ``expansion.rounds > 1``, the node ids created by the previous round; only those
            nodes are candidates. None (round 1) considers every node.

    Returns:
        ``[(node_id, factual_reward), ...]`` in node-id order.
    """
    num_nodes = len(tree.nodes)
    num_leaves, reward_sum = tree.subtree_stats()
    has_child = np.zeros(num_nodes, dtype=bool)
    for node in tree.nodes[1:]:
        has_child[node.parent_id] = True
    allowed = None if new_only_from is None else {int(i) for i in new_only_from}
    out = []
    for node_id in range(1, num_nodes):
        if has_child[node_id] and (allowed is None or node_id in allowed):
            out.append((node_id, float(reward_sum[node_id] / num_leaves[node_id])))
    return out


def split_expansion_budget(root_counts, total: int, tie_keys: Sequence | np.ndarray | None = None) -> np.ndarray:
    """Split the stage-2 budget over prompts in proportion to their root rollouts (largest remainder).

    Prompt ``i`` gets ``floor(total * m_i / sum(m))`` plus one of the leftover units if its remainder is
    among the largest (ties by tie key, then position). Integer arithmetic, so when every
    ``total * m_i / sum(m)`` is whole (e.g. ``total = N * sum(m)`` with integral ``N * m_i``) the share is
    exactly ``round(m_i * N)``; the shares always sum to ``total``.

    Args:
        root_counts: (B,) int rollouts ``m_i`` per prompt (>= 0).
        total: stage-2 continuations to split (>= 0).
        tie_keys: (B,) sortable keys ordering equal remainders; None uses the input order.

    Returns:
        (B,) int64 continuations per prompt; 0 where ``m_i = 0``.

    Raises:
        ValueError: negative counts or total, or ``total > 0`` while every ``m_i`` is 0.

    References:
        TRACE (arXiv 2606.11119), stage 2: local budget ``round(m_i * N)``; Hamilton's largest-remainder
        apportionment keeps the sum exact.
    """
    m = np.asarray(root_counts, dtype=np.int64)
    if m.ndim != 1 or np.any(m < 0):
        raise ValueError(f"root_counts must be a (B,) array of counts >= 0, got {m}")
    if int(total) != total or total < 0:
        raise ValueError(f"total must be an integer >= 0, got {total}")
    total = int(total)
    weight = int(m.sum())
    if total == 0:
        return np.zeros(m.size, dtype=np.int64)
    if weight == 0:
        raise ValueError(f"cannot split {total} continuations: no prompt has root rollouts")
    share, remainder = np.divmod(total * m, weight)
    left = total - int(share.sum())
    if left:
        rank = np.empty(m.size, dtype=np.int64)
        rank[canonical_order(m.size, tie_keys)] = np.arange(m.size)
        share[np.lexsort((rank, -remainder))[:left]] += 1
    return share.astype(np.int64)
