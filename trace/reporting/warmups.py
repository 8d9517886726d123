"""Studies over several warmups: each warmup (``warmup.seed``: its own SFT, seed rollouts and predictor warm start)
trains every arm at the same training seeds, so a comparison is paired within a warmup, and the warmups show how
much the starting policy moves it.

A (warmup, training seed) pair is a *unit*. ``pool_units`` renumbers the units of several single-warmup results
as seeds ``0..U-1``, so the report's statistics (``trace.reporting.report.arm_statistics``, paired by unit and
question) read the pooled study; ``warmup_components`` splits the spread of a per-unit difference into the part
between warmups and the part between seeds within a warmup (one-way random-effects analysis of variance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class WarmupComponents:
    """A per-unit quantity's spread, split by warmup (one-way random-effects ANOVA, unbalanced allowed).

    Attributes:
        means: per warmup seed, the mean over its training seeds.
        grand_mean: the mean over every unit.
        ms_between: mean square between warmups, ``sum_w n_w (mean_w - grand)^2 / (W - 1)``.
        ms_within: mean square within warmups, ``sum_w sum_s (d_ws - mean_w)^2 / (N - W)`` (the seed variance).
        var_warmup: the between-warmup variance component ``max(0, (ms_between - ms_within) / n0)``, with
            ``n0 = (N - sum_w n_w^2 / N) / (W - 1)``: the ANOVA estimator of the unbalanced one-way random
            model (Searle, Casella & McCulloch, Variance Components, 1992, ch. 3).
        f: ``ms_between / ms_within``; p: its upper tail on ``(W - 1, N - W)`` degrees of freedom (the test of no
            warmup effect); NaN where ``ms_within`` is 0.
    """

    means: dict[int, float]
    grand_mean: float
    ms_between: float
    ms_within: float
    var_warmup: float
    f: float
    p: float

    @property
    def var_seed(self) -> float:
        """The within-warmup (seed) variance component: ``ms_within``."""
        return self.ms_within

    @property
    def warmup_share(self) -> float:
        """``var_warmup / (var_warmup + var_seed)``: the share of a unit's variance the warmup explains (NaN when
        both are 0)."""
        total = self.var_warmup + self.var_seed
        return self.var_warmup / total if total > 0 else math.nan


def warmup_components(values: Mapping[int, Sequence[float]]) -> WarmupComponents:
    """Split the spread of a per-unit value (e.g. ``trace`` minus ``grpo`` held-out avg@k) by warmup.

    Args:
        values: warmup seed -> that warmup's per-training-seed values (float; >= 2 warmups, >= 1 seed each and
            more units than warmups).

    Returns:
        ``WarmupComponents``.

    Raises:
        ValueError: fewer than 2 warmups, an empty warmup, or no unit beyond one per warmup (no seed variance).
    """
    groups = {w: np.asarray(v, dtype=np.float64) for w, v in values.items()}
    if len(groups) < 2 or any(g.size == 0 for g in groups.values()):
        raise ValueError(f"warmup_components needs >= 2 warmups with >= 1 value each, got sizes "
                         f"{ {w: g.size for w, g in groups.items()} }")
    sizes = np.array([g.size for g in groups.values()], dtype=np.float64)
    total, num = float(sizes.sum()), len(groups)
    if total <= num:
        raise ValueError("warmup_components needs more units than warmups (a warmup with two or more seeds) to "
                         "measure the seed variance")
    means = {w: float(g.mean()) for w, g in groups.items()}
    grand = float(np.concatenate(list(groups.values())).mean())
    ms_between = float(sum(g.size * (means[w] - grand) ** 2 for w, g in groups.items()) / (num - 1))
    ms_within = float(sum(((g - means[w]) ** 2).sum() for w, g in groups.items()) / (total - num))
    n0 = (total - float((sizes ** 2).sum()) / total) / (num - 1)
    var_warmup = max(0.0, (ms_between - ms_within) / n0)
    f = ms_between / ms_within if ms_within > 0 else math.nan
    p = float(stats.f.sf(f, num - 1, total - num)) if ms_within > 0 else math.nan
    return WarmupComponents(means=means, grand_mean=grand, ms_between=ms_between, ms_within=ms_within,
                            var_warmup=var_warmup, f=f, p=p)


def pool_units(per_warmup: Mapping[int, Mapping[str, Mapping[int, dict]]]) -> tuple[dict, list[dict]]:
    """Renumber the (warmup, training seed) units of several single-warmup results as seeds ``0..U-1``.

    Args:
        per_warmup: warmup seed -> that warmup's results (``{arm: {training seed: result}}``, the report's
            ``collect_results`` with per-question results attached). Every warmup must hold the same arms and
            training seeds, so each arm is paired with ``grpo`` within each unit.

    Returns:
        ``(pooled, units)``: ``pooled`` is ``{arm: {unit: result}}`` in the first warmup's arm order;
        ``units[u]`` is ``{"unit": u, "warmup_seed": w, "seed": s}``, warmups in ascending order, then seeds.

    Raises:
        ValueError: no warmup, or two warmups with different arms or seeds (named).
    """
    if not per_warmup:
        raise ValueError("pool_units needs at least one warmup's results")
    warmups = sorted(per_warmup)
    first = per_warmup[warmups[0]]
    layout = {arm: sorted(by_seed) for arm, by_seed in first.items()}
    for w in warmups[1:]:
        other = {arm: sorted(by_seed) for arm, by_seed in per_warmup[w].items()}
        if other != layout:
            raise ValueError(f"warmup {w} has arms and seeds {other}, warmup {warmups[0]} has {layout}: every "
                             "warmup must train the same arms at the same seeds (rerun the missing stages)")
    seeds = sorted({s for by_seed in layout.values() for s in by_seed})
    units = [{"unit": i, "warmup_seed": w, "seed": s}
             for i, (w, s) in enumerate((w, s) for w in warmups for s in seeds)]
    index = {(u["warmup_seed"], u["seed"]): u["unit"] for u in units}
    pooled = {arm: {index[(w, s)]: per_warmup[w][arm][s] for w in warmups for s in layout[arm]} for arm in layout}
    return pooled, units
