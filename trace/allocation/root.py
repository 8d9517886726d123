"""Stage 1 of TRACE: how many bare rollouts each candidate prompt gets (root allocation).

Each step draws ``B`` candidate prompts with predicted success probabilities ``p_i``. We choose integer
rollout counts ``m_i`` with ``sum_i m_i = M`` (the root budget, in trajectories) and ``m_i = 0`` (skip) or
``m_min <= m_i <= m_max``, maximising the expected number of activated groups

    sum_i A(p_i, m_i),   A(p, m) = 1 - p^m - (1 - p)^m  (m >= 1),   A(p, 0) = 0,

the probability that ``m`` rollouts hold at least one success and one failure (``root_objective="groups"``),
or the expected number of root leaves in mixed groups ``sum_i m_i A(p_i, m_i)`` (``"leaves"``; see
``trace.allocation.objectives``).

Two solvers, one contract:
- ``exact``: a dynamic programme over prompts x budget (as Knapsack-RL solves its allocation), vectorised
  over the budget axis; used when ``B * M * (m_max - m_min + 1) <= exact_max_cells``.
- ``lagrangian``: the relaxation that prices one trajectory at ``lambda``. ``A`` is concave in ``m`` on
  ``[m_min, m_max]`` but not from 0 (``A(p, 1) = 0``), so each prompt's Lagrangian response follows the
  upper concave envelope of ``{(0, 0)} U {(m, A(p, m))}``: one block ``0 -> m*`` priced ``A(m*)/m*``,
  then unit steps priced by the increments of ``A``. Sorting these slopes gives the dual minimiser
  ``lambda*`` exactly (what bisection on ``lambda`` approximates); the dual function at ``lambda*`` is the
  reported upper bound. The primal activates the ``k`` prompts ranked first by block price for a few ``k``
  around the relaxation's choice, fills each active set exactly (the inner problem is concave, so greedy by
  increment is optimal) and keeps the best; ``gap = (upper_bound - objective) / upper_bound``.
  ``m A`` is not concave on ``[m_min, m_max]``, so for ``leaves`` each prompt's envelope is the full upper
  concave hull of its points and the primal re-solves the prompts nearest ``lambda*`` by the DP
  (``trace.allocation.table_solvers``); the dual bound holds for any price (weak duality).

Invariants: counts sum to ``M`` exactly and every count is 0 or within ``[m_min, m_max]``. The result is a
function of the multiset of ``(tie_key, p)`` pairs: prompts are solved in tie-key order and the counts
are mapped back, so permuting the inputs together with their tie keys permutes the output.

References:
    TRACE (arXiv 2606.11119), stage 1 root allocation objective.
    Knapsack-RL (arXiv 2509.25849): budget allocation across prompts as a knapsack solved by DP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from trace.allocation.objectives import _as_probs, activation_increment, activation_prob, check_root_objective, \
    objective_table, objective_value
from trace.allocation.table_solvers import dual_value, solve_envelope, solve_exact_dp

__all__ = [
    "RootAllocation",
    "activation_prob",
    "activation_increment",
    "allocate_roots",
    "check_root_budget_feasible",
    "canonical_order",
    "uniform_root_counts",
]


@dataclass(frozen=True, eq=False)
class RootAllocation:
    """Result of ``allocate_roots``.

    Attributes:
        counts: (B,) int64 rollouts per candidate prompt, in input order; 0 means skipped.
        objective: ``sum_i A(p_i, m_i)``, expected number of activated groups (``root_objective`` groups),
            or ``sum_i m_i A(p_i, m_i)``, expected root leaves in mixed groups (leaves).
        upper_bound: a certified upper bound on the optimum (equal to ``objective`` when exact).
        gap: relative optimality gap ``(upper_bound - objective) / upper_bound``; 0 when exact.
        method: ``"exact"`` (DP or a concave greedy that is exact) or ``"lagrangian"``.
        root_objective: the objective solved, ``"groups"`` or ``"leaves"``.
    """

    counts: np.ndarray
    objective: float
    upper_bound: float
    gap: float
    method: str
    root_objective: str = "groups"


# ---- feasibility and ordering ---------------------------------------------------------------------------
def check_root_budget_feasible(num_candidates: int, root_budget: int, m_min: int, m_max: int,
                               allow_skip: bool = True, m_min_key: str = "allocation.m_min") -> None:
    """Raise unless some ``m`` with ``m_i in {0} U [m_min, m_max]`` sums to ``root_budget``.

    ``M > 0`` is reachable exactly when some number of active prompts ``k <= B`` has
    ``k * m_min <= M <= k * m_max``. Without skips (``allow_skip=False``) every prompt is active, so
    ``B * m_min <= M <= B * m_max``.

    Args:
        m_min_key: the params key that set ``m_min``, named in the error (``allocation.knapsack_m_min``
            for the knapsack arm).

    Raises:
        ValueError: naming ``allocation.trajectory_budget``, ``m_min_key``, ``allocation.m_max`` and
            ``allocation.num_candidates``, and what to change.
    """
    if m_min < 1 or m_max < m_min:
        raise ValueError(f"need 1 <= {m_min_key} <= allocation.m_max, got {m_min}, m_max={m_max}")
    if root_budget < 0:
        raise ValueError(f"root budget must be >= 0, got {root_budget} (check allocation.trajectory_budget)")
    if allow_skip:
        if root_budget == 0:
            return
        k_low = max(1, -(-root_budget // m_max))
        k_high = min(num_candidates, root_budget // m_min)
        if k_low <= k_high:
            return
        reason = (f"no number of active prompts k <= {num_candidates} has k*m_min <= {root_budget} <= k*m_max")
    else:
        if num_candidates * m_min <= root_budget <= num_candidates * m_max:
            return
        reason = (f"without skips every one of the {num_candidates} prompts needs m_min..m_max rollouts, "
                  f"so the budget must lie in [{num_candidates * m_min}, {num_candidates * m_max}]")
    raise ValueError(
        f"root budget of {root_budget} trajectories cannot be split with {m_min_key}={m_min}, "
        f"allocation.m_max={m_max} over allocation.num_candidates={num_candidates}: {reason}. Fix: change "
        "allocation.trajectory_budget (or allocation.expansion_ratio, which sets the root share of arms "
        f"with prefix expansion), lower {m_min_key}, raise allocation.m_max, or raise "
        "allocation.num_candidates.")


def canonical_order(num_items: int, tie_keys: Sequence | np.ndarray | None) -> np.ndarray:
    """Positions sorted by tie key (stable), the order in which solvers break ties.

    Args:
        num_items: number of items.
        tie_keys: (num_items,) sortable keys (ints or strings, e.g. prompt uids), or None for index order.

    Returns:
        (num_items,) int64 permutation ``order``: ``order[r]`` is the input position ranked ``r``.

    Raises:
        ValueError: if ``tie_keys`` has the wrong length.
    """
    if tie_keys is None:
        return np.arange(num_items, dtype=np.int64)
    keys = np.asarray(tie_keys)
    if keys.shape != (num_items,):
        raise ValueError(f"tie_keys must have shape ({num_items},), got {keys.shape}")
    return np.argsort(keys, kind="stable").astype(np.int64)


# ---- solvers (all in canonical order) -----------------------------------------------------------------
def _fill_active(p: np.ndarray, active: np.ndarray, root_budget: int, m_min: int, m_max: int,
                 unit_order: np.ndarray | None = None) -> np.ndarray:
    """Exact allocation for a fixed active set: each active prompt gets ``m_min``, the rest by increment.

    ``A`` is concave on ``[m_min, m_max]``, so taking the largest increments first is optimal. Ties break
    by (prompt rank, m) so each prompt's chosen increments form a prefix.
    """
    num_prompts = p.size
    width = m_max - m_min
    counts = np.where(active, m_min, 0).astype(np.int64)
    extra = root_budget - int(counts.sum())
    if extra < 0 or extra > int(active.sum()) * width:
        raise AssertionError("active set cannot spend the budget")  # callers check feasibility first
    if extra == 0:
        return counts
    if unit_order is None:
        unit_order = _unit_order(p, m_min, m_max)
    rows = unit_order // width
    chosen = unit_order[active[rows]][:extra]
    counts += np.bincount(chosen // width, minlength=num_prompts)
    return counts


def _unit_order(p: np.ndarray, m_min: int, m_max: int) -> np.ndarray:
    """Flat ids ``i * width + (m - m_min)`` of the increments ``m -> m + 1``, best first, ties by id."""
    steps = np.arange(m_min, m_max, dtype=np.float64)
    gains = activation_increment(p[:, None], steps[None, :]).ravel()  # (B * width,)
    flat = np.arange(gains.size, dtype=np.int64)
    return flat[np.lexsort((flat, -gains))]


def _solve_lagrangian(p: np.ndarray, root_budget: int, m_min: int, m_max: int
                      ) -> tuple[np.ndarray, float]:
    num_prompts = p.size
    m_values = np.arange(m_min, m_max + 1)
    width = m_values.size
    values = activation_prob(p[:, None], m_values[None, :])  # (B, W)
    # block 0 -> m*: the point of best average gain; the largest such m keeps later slopes below it
    ratio = values / m_values[None, :]
    block_idx = width - 1 - np.argmax(ratio[:, ::-1], axis=1)
    block_size = m_values[block_idx]
    block_price = ratio[np.arange(num_prompts), block_idx]

    # unit steps m -> m+1 for m >= m*; slopes made non-increasing along each prompt's envelope
    steps = m_values[:-1]
    unit_price = activation_increment(p[:, None], steps[None, :]) if width > 1 else np.zeros((num_prompts, 0))
    unit_price = np.minimum(unit_price, block_price[:, None])
    unit_price = np.minimum.accumulate(unit_price, axis=1)
    unit_valid = steps[None, :] >= block_size[:, None]

    # every envelope segment as an item: (price, size, prompt rank, position on the envelope)
    rank = np.arange(num_prompts)
    unit_rows, unit_cols = np.nonzero(unit_valid)
    item_price = np.concatenate([block_price, unit_price[unit_rows, unit_cols]])
    item_size = np.concatenate([block_size, np.ones(unit_rows.size, dtype=np.int64)])
    item_prompt = np.concatenate([rank, unit_rows])
    item_pos = np.concatenate([np.zeros(num_prompts, dtype=np.int64), 1 + unit_cols])
    order = np.lexsort((item_pos, item_prompt, -item_price))
    filled = np.cumsum(item_size[order])
    crossing = int(np.searchsorted(filled, root_budget, side="left"))
    crossing = min(crossing, order.size - 1)
    price_star = float(item_price[order[crossing]])
    upper_bound = dual_value(values, m_values, price_star, root_budget)

    # primal: activate the top-k prompts by block price, for k near the relaxation's active count
    taken = order[filled <= root_budget]
    k_relaxed = int(np.count_nonzero(taken < num_prompts))
    k_low = max(1, -(-root_budget // m_max))
    k_high = min(num_prompts, root_budget // m_min)
    ks = [k for k in range(k_relaxed - 2, k_relaxed + 4) if k_low <= k <= k_high]
    if not ks:
        ks = [min(max(k_relaxed, k_low), k_high)]
    block_rank = np.lexsort((rank, -block_price))
    unit_order = _unit_order(p, m_min, m_max) if width > 1 else np.zeros(0, dtype=np.int64)
    best_counts, best_value = None, -np.inf
    for k in ks:
        active = np.zeros(num_prompts, dtype=bool)
        active[block_rank[:k]] = True
        counts = _fill_active(p, active, root_budget, m_min, m_max, unit_order)
        value = float(activation_prob(p, counts).sum())
        if value > best_value:
            best_counts, best_value = counts, value
    return best_counts, max(upper_bound, best_value)


def allocate_roots(pred_success_prob, root_budget: int, m_min: int, m_max: int, *,
                   exact_max_cells: int = 2_000_000, tie_keys=None, allow_skip: bool = True,
                   root_objective: str = "groups") -> RootAllocation:
    """Choose rollouts per candidate prompt to maximise the expected activated groups (or their leaves).

    Args:
        pred_success_prob: (B,) float predicted success probability ``p_i`` in [0, 1] of each candidate.
        root_budget: ``M``, trajectories to spend on bare root rollouts; the counts sum to it exactly.
        m_min: fewest rollouts of an active prompt (``allocation.m_min``, >= 1; 2 gives any contrast).
        m_max: most rollouts of one prompt (``allocation.m_max``).
        exact_max_cells: solve by DP when ``B * M * (m_max - m_min + 1)`` is at most this, else by the
            Lagrangian relaxation with a certified gap.
        tie_keys: (B,) sortable keys (prompt ids) that order ties; None uses the input order. Between
            otherwise identical prompts, the smaller tie key is served first.
        allow_skip: False forbids ``m_i = 0`` (every prompt gets ``m_min..m_max``, as Knapsack-RL never
            skips); under ``groups`` that problem is concave and solved exactly by greedy increments, under
            ``leaves`` by the DP (or the envelope Lagrangian past ``exact_max_cells``).
        root_objective: ``"groups"`` maximises ``sum_i A(p_i, m_i)`` (the paper's); ``"leaves"`` maximises
            ``sum_i m_i A(p_i, m_i)``, the expected root leaves in mixed groups
            (``allocation.root_objective``; docs/method.md, "Root allocation").

    Returns:
        ``RootAllocation`` with (B,) int64 counts in input order, the objective's value, a certified upper
        bound, the relative gap, the method used and the objective's name.

    Raises:
        ValueError: probabilities outside [0, 1], an unknown ``root_objective``, or no feasible allocation (see
            ``check_root_budget_feasible``; the message names the config keys to change).

    References:
        TRACE (arXiv 2606.11119), stage 1; Knapsack-RL (arXiv 2509.25849) for the exact DP;
        Lagrangian relaxation of a separable knapsack (Everett 1963) for the dual bound.
    """
    check_root_objective(root_objective)
    p = _as_probs(pred_success_prob, "pred_success_prob")
    if p.ndim != 1:
        raise ValueError(f"pred_success_prob must have shape (B,), got {p.shape}")
    if int(root_budget) != root_budget:
        raise ValueError(f"root_budget must be an integer number of trajectories, got {root_budget}")
    root_budget = int(root_budget)
    num_prompts = p.size
    check_root_budget_feasible(num_prompts, root_budget, m_min, m_max, allow_skip)
    order = canonical_order(num_prompts, tie_keys)
    p_sorted = p[order]

    upper_bound = None
    cells = num_prompts * root_budget * (m_max - m_min + 1)
    if root_budget == 0:
        counts_sorted, method = np.zeros(num_prompts, dtype=np.int64), "exact"
    elif root_objective != "groups":  # not concave on [m_min, m_max]: DP, or the envelope Lagrangian
        values = objective_table(p_sorted[:, None], np.arange(m_min, m_max + 1)[None, :], root_objective)
        if cells <= exact_max_cells:
            counts_sorted, method = solve_exact_dp(values, root_budget, m_min, m_max, allow_skip), "exact"
        else:
            counts_sorted, upper_bound = solve_envelope(values, root_budget, m_min, m_max, allow_skip)
            method = "lagrangian"
    elif not allow_skip:
        counts_sorted = _fill_active(p_sorted, np.ones(num_prompts, dtype=bool), root_budget, m_min, m_max)
        method = "exact"
    elif cells <= exact_max_cells:
        values = activation_prob(p_sorted[:, None], np.arange(m_min, m_max + 1)[None, :])  # (B, W)
        counts_sorted, method = solve_exact_dp(values, root_budget, m_min, m_max), "exact"
    else:
        counts_sorted, upper_bound = _solve_lagrangian(p_sorted, root_budget, m_min, m_max)
        method = "lagrangian"

    objective = objective_value(p_sorted, counts_sorted, root_objective)
    if upper_bound is None:
        upper_bound = objective
    gap = (upper_bound - objective) / upper_bound if upper_bound > 0 else 0.0
    counts = np.empty(num_prompts, dtype=np.int64)
    counts[order] = counts_sorted
    return RootAllocation(counts=counts, objective=objective, upper_bound=float(upper_bound),
                          gap=float(max(gap, 0.0)), method=method, root_objective=root_objective)


def uniform_root_counts(num_candidates: int, root_budget: int, group_size: int,
                        order: np.ndarray | None = None) -> np.ndarray:
    """Uniform groups: ``k = min(B, max(1, R // n))`` candidates share ``R`` as evenly as possible.

    Args:
        num_candidates: B.
        root_budget: R trajectories (>= 0).
        group_size: n (>= 1).
        order: (B,) candidate positions in preference order; None takes them in input order.

    Returns:
        (B,) int64 counts; the first ``R mod k`` chosen candidates get one extra rollout.

    Raises:
        ValueError: a positive budget with no candidates, or ``group_size < 1``.
    """
    if group_size < 1:
        raise ValueError(f"allocation.group_size must be >= 1, got {group_size}")
    counts = np.zeros(num_candidates, dtype=np.int64)
    if root_budget == 0:
        return counts
    if num_candidates == 0:
        raise ValueError(f"cannot spend {root_budget} trajectories on 0 candidates: raise allocation.num_candidates")
    order = np.arange(num_candidates) if order is None else np.asarray(order)
    num_active = min(num_candidates, max(1, root_budget // group_size))
    base, extra = divmod(root_budget, num_active)
    counts[order[:num_active]] = base
    counts[order[:extra]] += 1
    return counts
