"""Stage-1 solvers that need no concavity: the exact DP and the envelope Lagrangian on any value table.

A value table ``values`` (B, W) float64 holds ``f_i(m)`` for ``m = m_min .. m_max`` (column ``m - m_min``),
with ``f_i(0) = 0`` for a skipped prompt. Both solvers return counts with ``sum_i m_i = M`` and every
``m_i`` 0 (when skips are allowed) or in ``[m_min, m_max]``, and work in the order of the rows (callers sort
the rows into tie-key order first); ties go to skipping, then to the smaller ``m``.

References:
    Knapsack-RL (arXiv 2509.25849): budget allocation across prompts as a knapsack solved by DP.
    Everett (1963), generalized Lagrange multipliers: the dual bound of a separable problem, for any price.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["dual_value", "envelope_segments", "solve_envelope", "solve_exact_dp", "splittable"]


def solve_exact_dp(values: np.ndarray, root_budget: int, m_min: int, m_max: int,
                    allow_skip: bool = True) -> np.ndarray:
    """Exact optimum of ``sum_i f_i(m_i)`` by dynamic programming over prompts x budget (no concavity needed).

    ``F_i(b) = max(F_{i-1}(b), max_m F_{i-1}(b - m) + f_i(m))``, ``F_0(0) = 0``; the skip term is left out
    when ``allow_skip`` is False.

    Args:
        values: (B, W) float64 ``f_i(m)`` for ``m = m_min .. m_max``.
        root_budget: ``M``, the trajectories to spend exactly.
        m_min, m_max: bounds of an active prompt's count (``W = m_max - m_min + 1``).
        allow_skip: whether ``m_i = 0`` is allowed.

    Returns:
        (B,) int64 counts of an optimum; ties go to skipping, then to the smaller ``m``.

    Raises:
        AssertionError: no split of ``M`` exists (callers check feasibility first).

    References:
        Knapsack-RL (arXiv 2509.25849); docs/method.md, "Root solver".
    """
    num_prompts = values.shape[0]
    m_values = np.arange(m_min, m_max + 1)
    width = m_values.size
    span = root_budget + 1
    best = np.full(span, -np.inf)
    best[0] = 0.0
    # choice[i, b] = 0 (skip) or 1 + j (prompt i takes m_values[j]) in the optimum of prompts 0..i at budget b
    choice = np.zeros((num_prompts, span), dtype=np.int16 if width < 32000 else np.int32)
    window_rows = m_max - m_values  # row r of the windows is best[b - (m_max - r)]
    candidates = np.empty((width + 1, span))
    pad = np.full(m_max + span, -np.inf)
    for i in range(num_prompts):
        pad[m_max:] = best
        candidates[0] = best if allow_skip else -np.inf
        candidates[1:] = sliding_window_view(pad, span)[window_rows] + values[i, :, None]
        choice[i] = np.argmax(candidates, axis=0)  # first maximum: skip, then smaller m, wins ties
        best = candidates.max(axis=0)
    counts = np.zeros(num_prompts, dtype=np.int64)
    budget_left = root_budget
    for i in range(num_prompts - 1, -1, -1):
        c = int(choice[i, budget_left])
        if c:
            counts[i] = m_values[c - 1]
            budget_left -= counts[i]
    if budget_left != 0 or not np.isfinite(best[root_budget]):
        raise AssertionError("DP backtrack did not spend the budget")  # feasibility was checked
    return counts


def dual_value(values: np.ndarray, m_values: np.ndarray, price: float, root_budget: int,
                allow_skip: bool = True) -> float:
    """The Lagrangian dual ``g(lambda) = lambda M + sum_i max(0, max_m f_i(m) - lambda m)``.

    By weak duality ``g(lambda)`` bounds the optimum from above for every price ``lambda``, whatever the
    shape of ``f_i``; the 0 (the skip) is left out when ``allow_skip`` is False.

    Args:
        values: (B, W) float64 ``f_i(m)`` for ``m in m_values``.
        m_values: (W,) int the counts of the columns.
        price: ``lambda``, value per trajectory.
        root_budget: ``M``.
        allow_skip: whether ``m_i = 0`` is allowed.

    Returns:
        ``g(lambda)`` as a float.

    References:
        Everett (1963); docs/method.md, "Root solver".
    """
    reduced = values - price * m_values[None, :]
    best = reduced.max(axis=1)
    return float(price * root_budget + (np.maximum(best, 0.0) if allow_skip else best).sum())


def splittable(num_prompts: int, budget: int, m_min: int, m_max: int, allow_skip: bool) -> bool:
    """Whether ``budget`` splits over ``num_prompts`` prompts with counts in ``{0} U [m_min, m_max]`` (or
    ``[m_min, m_max]`` alone without skips)."""
    if not allow_skip:
        return num_prompts * m_min <= budget <= num_prompts * m_max
    return budget == 0 or max(1, -(-budget // m_max)) <= min(num_prompts, budget // m_min)


def envelope_segments(points: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Segments of each row's upper concave hull over ``(xs, points[i])``, from ``xs[0]`` (gift wrapping).

    From the current vertex the next one is the farthest point of steepest slope, so collinear points merge
    and the slopes along a row strictly fall (up to rounding, which is clamped).

    Args:
        points: (B, P) float64 values at ``xs``.
        xs: (P,) increasing int positions (counts).

    Returns:
        ``(prompt, position, start, end, slope)`` arrays, one entry per segment; along a prompt the slopes
        do not increase and the segments chain ``xs[0] -> ... -> xs[-1]``.
    """
    num_prompts, num_points = points.shape
    rows, cols = np.arange(num_prompts), np.arange(num_points)
    current = np.zeros(num_prompts, dtype=np.int64)
    previous = np.full(num_prompts, np.inf)
    out: list[tuple[np.ndarray, ...]] = []
    for position in range(num_points - 1):
        live = rows[current < num_points - 1]
        if live.size == 0:
            break
        at = current[live]
        with np.errstate(divide="ignore", invalid="ignore"):
            slope = (points[live] - points[live, at][:, None]) / (xs[None, :] - xs[at][:, None])
        slope = np.where(cols[None, :] > at[:, None], slope, -np.inf)
        nxt = num_points - 1 - np.argmax(slope[:, ::-1], axis=1)  # the farthest point of the steepest slope
        price = np.minimum(slope[np.arange(live.size), nxt], previous[live])  # rounding must not raise it
        out.append((live, np.full(live.size, position), xs[at], xs[nxt], price))
        previous[live] = price
        current[live] = nxt
    if not out:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty, np.zeros(0)
    return tuple(np.concatenate(parts) for parts in zip(*out))


def solve_envelope(values: np.ndarray, root_budget: int, m_min: int, m_max: int, allow_skip: bool,
                   neighbourhood: int = 8) -> tuple[np.ndarray, float]:
    """Lagrangian relaxation with a certified bound for any value table.

    The segments of every prompt's upper concave hull over ``{(0, 0)} U {(m, f_i(m))}`` (without the skip:
    from ``m_min``), sorted by slope, reach ``M`` at the dual minimiser ``lambda*``; ``g(lambda*)`` is the
    bound. The primal keeps the relaxation's whole segments (hull vertices, spending at most ``M``) and
    re-solves exactly, by ``solve_exact_dp`` with the rest of the budget, the prompts owning the
    ``neighbourhood`` segments on either side of the crossing one, doubling that window until those prompts
    can split their budget (at worst all prompts: the full DP).

    Args:
        values: (B, W) float64 ``f_i(m)`` for ``m = m_min .. m_max``.
        root_budget: ``M`` (> 0, splittable over the B prompts).
        m_min, m_max: bounds of an active prompt's count.
        allow_skip: whether ``m_i = 0`` is allowed.
        neighbourhood: half-width of the first window of segments re-solved by the DP.

    Returns:
        ``((B,) int64 counts, upper bound)``; the bound is at least the counts' objective.

    References:
        Everett (1963); docs/method.md, "Root solver".
    """
    num_prompts = values.shape[0]
    m_values = np.arange(m_min, m_max + 1)
    xs = np.concatenate([[0], m_values]) if allow_skip else m_values
    points = np.concatenate([np.zeros((num_prompts, 1)), values], axis=1) if allow_skip else values
    prompt, position, start, end, price = envelope_segments(points, xs)
    order = np.lexsort((position, prompt, -price))
    filled = num_prompts * int(xs[0]) + np.cumsum(end[order] - start[order])
    crossing = min(int(np.searchsorted(filled, root_budget, side="left")), max(order.size - 1, 0))
    price_star = float(price[order[crossing]]) if order.size else 0.0
    upper_bound = dual_value(values, m_values, price_star, root_budget, allow_skip)

    counts = np.full(num_prompts, int(xs[0]), dtype=np.int64)
    taken = order[filled <= root_budget]
    np.maximum.at(counts, prompt[taken], end[taken].astype(np.int64))
    residual = root_budget - int(counts.sum())
    width = max(1, neighbourhood)
    while True:
        window = order[max(0, crossing - width): crossing + width + 1]
        free = np.unique(prompt[window]) if width < order.size else np.arange(num_prompts)
        budget = int(counts[free].sum()) + residual
        if free.size and splittable(free.size, budget, m_min, m_max, allow_skip):
            counts[free] = solve_exact_dp(values[free], budget, m_min, m_max, allow_skip)
            break
        if free.size == num_prompts:
            raise AssertionError("envelope primal found no split")  # feasibility was checked
        width *= 2
    value = float(values[np.arange(num_prompts), np.maximum(counts - m_min, 0)][counts > 0].sum())
    return counts, max(upper_bound, value)
