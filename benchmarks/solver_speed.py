"""Solver speed and optimality of TRACE's two allocators, on one core.

Stage 1 (``trace.allocation.root.allocate_roots``): ``B`` candidate prompts with success probabilities
drawn from the simulator's default difficulty mix ``Beta(0.3, 0.3)``, root budgets ``M`` trajectories, for
``B in {64, 512, 4096}`` and ``M in {512, 8192, 65536}``. Each feasible pair is solved three ways:
- ``auto``: what the training loop runs (exact DP when ``B * M * (m_max - m_min + 1) <= 2e6``, else the
  Lagrangian relaxation);
- ``lagrangian``: the relaxation forced, with its certified gap ``(dual bound - objective) / dual bound``;
- ``exact``: the DP forced, where its table fits the cell limit; then the Lagrangian's true gap against
  the exact optimum is reported beside its certified gap.
A pair is infeasible when no number of active prompts ``k <= B`` has ``k m_min <= M <= k m_max``; those
are listed with the reason. The grid runs with the default bounds ``m_min = 2, m_max = 16`` and with
``m_max = 64``, since with ``m_max = 16`` the pair ``B = 4096, M = 65536`` has one feasible point (every
prompt at 16) and says nothing about the solver.

Small cases are checked against brute force (every vector in ``{0, m_min..m_max}^B``): the DP must match
the optimum, the Lagrangian's dual bound must lie above it. The check runs for both stage-1 objectives
(``allocation.root_objective``: ``root_brute_force`` for ``groups``, ``root_brute_force_leaves`` for
``leaves`` on its own random stream, so the ``groups`` results are those of a run without it).

Stage 2 (``trace.allocation.prefix.allocate_prefixes``): ``A in {10^3, 10^4, 10^5}`` anchors with
``v ~ U(0, 1)`` and factual rewards ``r ~ Bernoulli(v)``, budgets ``A / 4`` and ``A`` continuations; the
reference is the heap-greedy of marginal gains (the slow obvious exact solver for a concave objective).

Times are medians of repeated calls in a process pinned to one CPU (``sched_setaffinity``).

Usage: ``python -m benchmarks.solver_speed [--quick]``.
"""

from __future__ import annotations

import heapq
import itertools
import os
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from benchmarks.common import figure_path, parse_args, pyplot, timed, write_report
from trace.allocation.prefix import allocate_prefixes, prefix_marginal_gain, prefix_value
from trace.allocation.objectives import objective_table
from trace.allocation.root import allocate_roots

NAME = "solver_speed"
DIFFICULTY = (0.3, 0.3)  # SimulatorConfig default difficulty_alpha, difficulty_beta
LOOP_EXACT_MAX_CELLS = 2_000_000  # AllocationConfig.exact_max_cells default


@contextmanager
def one_cpu() -> Iterator[int | None]:
    """Pin this process to one CPU while the block runs (no-op where the OS has no affinity call)."""
    if not hasattr(os, "sched_getaffinity"):
        yield None
        return
    previous = os.sched_getaffinity(0)
    cpu = max(previous)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, previous)


def root_feasibility(num_candidates: int, root_budget: int, m_min: int, m_max: int) -> str | None:
    """None when some ``k <= B`` active prompts can spend ``M`` exactly, else the reason in words."""
    k_low = max(1, -(-root_budget // m_max))
    k_high = min(num_candidates, root_budget // m_min)
    if k_low <= k_high:
        return None
    return (f"M={root_budget} > B*m_max={num_candidates * m_max}" if root_budget > num_candidates * m_max
            else f"no k <= {num_candidates} with {m_min}k <= {root_budget} <= {m_max}k")


def brute_force_roots(p: np.ndarray, root_budget: int, m_min: int, m_max: int,
                      root_objective: str = "groups") -> float | None:
    """Optimum of ``sum_i A(p_i, m_i)`` (``groups``) or ``sum_i m_i A(p_i, m_i)`` (``leaves``) over every
    ``m in {0, m_min..m_max}^B`` summing to ``M`` (None if none)."""
    choices = np.array([0] + list(range(m_min, m_max + 1)))
    grid = np.array(list(itertools.product(choices, repeat=p.size)))  # (C^B, B)
    grid = grid[grid.sum(axis=1) == root_budget]
    if grid.size == 0:
        return None
    return float(objective_table(p[None, :], grid, root_objective).sum(axis=1).max())


def heap_prefix_objective(rewards: np.ndarray, probs: np.ndarray, budget: int) -> float:
    """Exact stage-2 optimum by popping the largest marginal gain ``budget`` times (a heap; slow, obvious)."""
    heap = [(-float(prefix_marginal_gain(r, v, 1)), i, 1) for i, (r, v) in enumerate(zip(rewards, probs))]
    heapq.heapify(heap)
    counts = np.zeros(rewards.size, dtype=np.int64)
    for _ in range(budget):
        _, i, k = heapq.heappop(heap)
        counts[i] = k
        heapq.heappush(heap, (-float(prefix_marginal_gain(rewards[i], probs[i], k + 1)), i, k + 1))
    return float(prefix_value(rewards, probs, counts).sum())


def root_grid(rng: np.random.Generator, sizes: Sequence[int], budgets: Sequence[int], m_min: int, m_max: int,
              repeats: int, exact_limit: int) -> list[dict]:
    rows = []
    for num_candidates in sizes:
        p = rng.beta(*DIFFICULTY, size=num_candidates)
        for root_budget in budgets:
            row: dict = {"B": num_candidates, "M": root_budget, "m_min": m_min, "m_max": m_max,
                         "cells": num_candidates * root_budget * (m_max - m_min + 1)}
            reason = root_feasibility(num_candidates, root_budget, m_min, m_max)
            if reason:
                rows.append({**row, "feasible": False, "reason": reason})
                continue
            row["feasible"] = True
            t_auto, _, auto = timed(lambda: allocate_roots(p, root_budget, m_min, m_max,
                                                           exact_max_cells=LOOP_EXACT_MAX_CELLS), repeats)
            t_lag, _, lag = timed(lambda: allocate_roots(p, root_budget, m_min, m_max, exact_max_cells=0), repeats)
            row.update(auto_seconds=t_auto, auto_method=auto.method, auto_gap=auto.gap,
                       lagrangian_seconds=t_lag, lagrangian_objective=lag.objective,
                       lagrangian_upper_bound=lag.upper_bound, lagrangian_certified_gap=lag.gap)
            if row["cells"] <= exact_limit:
                dp_repeats = repeats if row["cells"] <= 5 * LOOP_EXACT_MAX_CELLS else 1
                t_dp, _, exact = timed(lambda: allocate_roots(p, root_budget, m_min, m_max,
                                                              exact_max_cells=row["cells"]), dp_repeats,
                                       warmup=1 if dp_repeats > 1 else 0)
                true_gap = (exact.objective - lag.objective) / exact.objective if exact.objective > 0 else 0.0
                row.update(exact_seconds=t_dp, exact_objective=exact.objective,
                           lagrangian_true_gap=max(true_gap, 0.0),
                           bound_holds=bool(lag.upper_bound >= exact.objective * (1 - 1e-12)))
            else:
                row["exact"] = f"skipped: {row['cells']:.2e} cells > limit {exact_limit:.1e}"
            rows.append(row)
    return rows


def brute_force_check(rng: np.random.Generator, num_cases: int, root_objective: str = "groups") -> dict:
    """DP and Lagrangian against brute force on random small problems (B=5, m in {0, 2..6}), for one objective."""
    m_min, m_max, size = 2, 6, 5
    dp_gaps, lag_gaps, certified, bound_violations, checked = [], [], [], 0, 0
    while checked < num_cases:
        p = rng.beta(*DIFFICULTY, size=size)
        budget = int(rng.integers(2, size * m_max + 1))
        best = brute_force_roots(p, budget, m_min, m_max, root_objective)
        if best is None:
            continue
        checked += 1
        dp = allocate_roots(p, budget, m_min, m_max, exact_max_cells=10**9, root_objective=root_objective)
        lag = allocate_roots(p, budget, m_min, m_max, exact_max_cells=0, root_objective=root_objective)
        scale = max(best, 1e-12)
        dp_gaps.append((best - dp.objective) / scale)
        lag_gaps.append((best - lag.objective) / scale)
        certified.append(lag.gap)
        bound_violations += int(lag.upper_bound < best - 1e-9)
    return {"root_objective": root_objective, "cases": checked, "B": size, "m_min": m_min, "m_max": m_max,
            "lagrangian_max_certified_gap": float(max(certified)),
            "dp_max_gap": float(max(dp_gaps)), "lagrangian_max_true_gap": float(max(lag_gaps)),
            "lagrangian_mean_true_gap": float(np.mean(lag_gaps)), "dual_bound_violations": bound_violations}


def prefix_grid(rng: np.random.Generator, sizes: Sequence[int], repeats: int) -> list[dict]:
    rows = []
    for num_anchors in sizes:
        probs = rng.random(num_anchors)
        rewards = (rng.random(num_anchors) < probs).astype(np.float64)
        keys = np.arange(num_anchors)
        for budget in (num_anchors // 4, num_anchors):
            seconds, _, counts = timed(lambda: allocate_prefixes(rewards, probs, budget, tie_keys=keys), repeats)
            objective = float(prefix_value(rewards, probs, counts).sum())
            t0 = time.perf_counter()
            reference = heap_prefix_objective(rewards, probs, budget)
            heap_seconds = time.perf_counter() - t0
            rows.append({"anchors": num_anchors, "budget": budget, "seconds": seconds, "objective": objective,
                         "heap_objective": reference, "heap_seconds": heap_seconds,
                         "gap": max((reference - objective) / reference, 0.0) if reference > 0 else 0.0,
                         "budget_met": int(counts.sum()) == budget})
    return rows


def plot(roots: list[dict], prefixes: list[dict], path) -> None:
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for m_max, marker in ((16, "o"), (64, "s")):
        for num_candidates, color in zip((64, 512, 4096), ("C0", "C1", "C2")):
            pts = [r for r in roots if r["feasible"] and r["m_max"] == m_max and r["B"] == num_candidates]
            if pts:
                ax.plot([r["M"] for r in pts], [r["lagrangian_seconds"] for r in pts], marker=marker, color=color,
                        linestyle="-" if m_max == 16 else "--", label=f"B={num_candidates}, m_max={m_max}")
    ax.axhline(0.5, color="grey", linestyle=":", label="target 0.5 s")
    ax.set(xscale="log", yscale="log", xlabel="root budget M (trajectories)", ylabel="seconds (median, 1 core)",
           title="Stage 1: Lagrangian solver")
    ax.legend(fontsize=7)
    ax = axes[1]
    for budget_share, style, color in ((0.25, "o--", "C0"), (1.0, "s-", "C1")):
        pts = [r for r in prefixes if r["budget"] == int(r["anchors"] * budget_share)]
        ax.plot([r["anchors"] for r in pts], [r["seconds"] for r in pts], style, color=color,
                label=f"allocate_prefixes, budget = {budget_share:g} A")
        ax.plot([r["anchors"] for r in pts], [r["heap_seconds"] for r in pts], style, color=color, alpha=0.35,
                label=f"heap reference, budget = {budget_share:g} A")
    ax.axhline(0.2, color="grey", linestyle=":", label="target 0.2 s at 1e5")
    ax.set(xscale="log", yscale="log", xlabel="anchors A", ylabel="seconds (median, 1 core)",
           title="Stage 2: greedy by marginal gain")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; returns the report (also written to ``--out``)."""
    args = parse_args(__doc__.splitlines()[0], argv)
    started = time.perf_counter()
    if args.quick:
        settings = {"B": [64, 512], "M": [512, 8192], "m_max": [16], "repeats": 1, "exact_cell_limit": 2e7,
                    "prefix_anchors": [1000, 3000], "brute_force_cases": 5}
    else:
        settings = {"B": [64, 512, 4096], "M": [512, 8192, 65536], "m_max": [16, 64], "repeats": 7,
                    "exact_cell_limit": 6e8, "prefix_anchors": [1000, 10000, 100000], "brute_force_cases": 100}
    settings.update(m_min=2, difficulty_beta=list(DIFFICULTY), loop_exact_max_cells=LOOP_EXACT_MAX_CELLS)
    rng = np.random.default_rng(0)
    with one_cpu() as cpu:
        roots = []
        for m_max in settings["m_max"]:
            roots += root_grid(rng, settings["B"], settings["M"], settings["m_min"], m_max, settings["repeats"],
                               int(settings["exact_cell_limit"]))
        brute = brute_force_check(rng, settings["brute_force_cases"])
        prefixes = prefix_grid(rng, settings["prefix_anchors"], settings["repeats"])
    settings["pinned_cpu"] = cpu

    big = next((r for r in roots if r["feasible"] and r["B"] == 4096 and r["M"] == 65536 and r["m_max"] == 64),
               None)
    big16 = next((r for r in roots if r["feasible"] and r["B"] == 4096 and r["M"] == 65536 and r["m_max"] == 16),
                 None)
    largest_prefix = max(prefixes, key=lambda r: (r["anchors"], r["budget"]))
    headline = {
        "root_B4096_M65536_m_max64_seconds": big and big["lagrangian_seconds"],
        "root_B4096_M65536_m_max64_certified_gap": big and big["lagrangian_certified_gap"],
        "root_B4096_M65536_m_max16_seconds": big16 and big16["auto_seconds"],
        "root_max_certified_gap": max(r["lagrangian_certified_gap"] for r in roots if r["feasible"]),
        "root_max_true_gap_vs_dp": max((r["lagrangian_true_gap"] for r in roots if "lagrangian_true_gap" in r),
                                       default=None),
        "prefix_largest_anchors": largest_prefix["anchors"], "prefix_largest_budget": largest_prefix["budget"],
        "prefix_largest_seconds": largest_prefix["seconds"],
        "prefix_max_gap_vs_heap": max(r["gap"] for r in prefixes),
        "infeasible_root_pairs": [f"B={r['B']}, M={r['M']}, m_max={r['m_max']}: {r['reason']}"
                                  for r in roots if not r["feasible"]],
        # None: the setting was not run (--quick)
        "targets": {"root_4096_65536_under_0.5s_gap_under_0.1pct": None if big is None else bool(
                        big["lagrangian_seconds"] < 0.5 and big["lagrangian_certified_gap"] < 1e-3),
                    "prefix_1e5_under_0.2s": None if largest_prefix["anchors"] < 100_000 else bool(
                        max(r["seconds"] for r in prefixes if r["anchors"] == largest_prefix["anchors"]) < 0.2)},
    }
    results = {"headline": headline, "root": roots, "root_brute_force": brute, "prefix": prefixes,
               "root_brute_force_leaves": brute_force_check(np.random.default_rng(1), settings["brute_force_cases"],
                                                            root_objective="leaves")}
    plot(roots, prefixes, figure_path(NAME, args.out))
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


if __name__ == "__main__":
    main()
