"""Forecasts the allocator reads, recalibrated online against the outcomes they forecast (``predictor.recalibrate``).

The predictor ranks prompts and prefixes but need not be calibrated (docs/results.md, "The predictor against the
truth"), and both stages plug its forecast into functions whose maximiser depends on the level, not only the
order: ``A(p, m)`` peaks at ``p = 1/2``, ``V_pref`` at ``v`` far from the factual reward. With
``predictor.recalibrate`` the allocator of a predictor arm reads ``q = F_t(p)`` instead of ``p``, per stage, with

    logit F_t(p) = alpha_t + beta_t logit p,

``trace.predictor.forecast.fit_forecast_model`` (Platt's recalibration of the mean, with the beta-binomial spread)
fitted on the trees of the ``predictor.recalibrate_window`` steps before step ``t``: the predictor's own forecasts
there against their outcomes, with a Gaussian prior of ``SHRINK`` items at the identity (stage 1 samples the
prompts it forecasts near 1/2, a narrow range of forecasts that leaves the slope to chance). Root groups:
``trace.reporting.audit.root_outcomes`` (chosen by the forecast alone). Prefixes: ``candidate_outcomes``, every
prefix stage 2 scored, chosen or not, with its factual rollouts and its continuations where it got them: the
choice read the factual reward, so leaving the unchosen out (as ``anchor_outcomes`` does for the chosen anchors'
own forecasts) would select on the outcome. The trees store what the allocator read, ``q_s = F_s(p_s)``; the fit reads the predictor's
``p_s`` back through the map of the tree's own step, ``logit p_s = (logit q_s - alpha_s) / beta_s``
(``raw_outcomes``). Fitting on ``p`` keeps no feedback between steps: a map fitted on the already-mapped ``q`` and
composed onto the last map would count the older maps' correction again, and with a window of several steps it
oscillates or collapses. ``F_t`` is logged every step as ``recalibration/<stage>_{alpha, beta}``; a resumed run
reads the maps of earlier steps back from its history (``logged_maps``).

With ``predictor.recalibrate_map: isotonic`` the map is monotone instead of logistic (``IsotonicMap``):
the pool-adjacent-violators fit of the window's success rates on ``p`` (scikit-learn's ``IsotonicRegression``,
each item weighted by its outcomes), read at the knots ``p = 0, 0.1, ..., 1`` and linear between them, shrunk to
the identity by ``SHRINK`` items. A logistic map bends the forecasts smoothly; the predictor's truth can have a
step instead (docs/results.md, "The reliability diagrams"), which only a monotone map follows. The prior
keeps the knots strictly increasing, so the map is read back exactly (``IsotonicMap.inverse``). Its knots are
logged as ``recalibration/<stage>_knot<KK>``; the spread ``kappa`` the integrated forecasts read is that of the
beta-binomial fitted on the mapped forecasts (its own mean map close to the identity).

The Monte-Carlo truth audit scores what the allocator reads, so with this on it scores ``q``.

References:
    Platt (1999), "Probabilistic outputs for support vector machines" (the logistic recalibration); Kull, Silva
    Filho and Flach (2017), "Beta calibration" (calibration maps linear in the logits); Zadrozny and Elkan (2002),
    "Transforming classifier scores into accurate multiclass probability estimates", KDD (isotonic recalibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from trace.predictor.forecast import ForecastModel, fit_forecast_model
from trace.reporting.audit import continuation_rewards, root_outcomes
from trace.tree import Origin, RolloutTree

__all__ = ["IsotonicMap", "RecalibratedSampler", "candidate_outcomes", "exploration_trees", "fit_isotonic_map",
           "invert", "logged_maps", "map_metrics", "raw_outcomes", "step_maps"]

STAGES = ("root", "prefix")
SHRINK = 8.0  # the prior's weight in items (fit_forecast_model's shrink): a window of a few groups moves it little
KNOTS = tuple(i / 10 for i in range(11))  # where an IsotonicMap is read; ECE's bins are 0.1 wide
_EPS = 1e-6


@dataclass(frozen=True)
class IsotonicMap:
    """``q = F(p)``, linear between ``values`` at ``KNOTS`` (module docstring); the identity by default.

    Attributes:
        values: (11,) ``F`` at ``KNOTS``, strictly increasing in [0, 1].
        kappa: the beta-binomial spread around ``q`` (``inf``: the point forecast).
        num_items: outcomes it was fitted on (0: not fitted).
    """

    values: tuple[float, ...] = KNOTS
    kappa: float = math.inf
    num_items: int = 0

    def mean(self, pred: Any) -> np.ndarray:
        """(N,) float64 ``F(p)`` of forecasts in [0, 1]."""
        return np.interp(np.asarray(pred, dtype=np.float64), KNOTS, self.values)

    def inverse(self, mapped: Any) -> np.ndarray:
        """(N,) float64 ``p`` with ``F(p) = q``; ``q`` outside ``F``'s range reads as 0 or 1."""
        return np.interp(np.asarray(mapped, dtype=np.float64), self.values, KNOTS)

    def metrics(self, stage: str) -> dict[str, float]:
        """``forecast/<stage>_{kappa, items}`` (``ForecastModel.metrics`` without a logistic map's parameters)."""
        return {f"forecast/{stage}_kappa": self.kappa if math.isfinite(self.kappa) else float("nan"),
                f"forecast/{stage}_items": float(self.num_items)}


def fit_isotonic_map(pred: Any, successes: Any, trials: Any, shrink: float = SHRINK) -> IsotonicMap:
    """The monotone map of the window's outcomes on the forecasts (module docstring).

    Args:
        pred: (N,) float forecasts ``p_i`` in [0, 1].
        successes: (N,) float successes among item ``i``'s outcomes.
        trials: (N,) int ``n_i >= 1`` outcomes; an item's weight in the fit.
        shrink: the identity's weight in items: ``F(x) = (N F_iso(x) + shrink x) / (N + shrink)`` at each knot;
            > 0 keeps ``F`` strictly increasing.

    Returns:
        ``IsotonicMap``; the identity (unfitted) with fewer than ``forecast.MIN_ITEMS`` items or outcomes all
        alike, as ``fit_forecast_model``.

    Raises:
        ValueError: as ``fit_forecast_model``, or ``shrink <= 0``.
    """
    from sklearn.isotonic import IsotonicRegression

    if not shrink > 0:
        raise ValueError(f"shrink={shrink} must be > 0: it keeps the map strictly increasing, so invertible")
    p = np.asarray(pred, dtype=np.float64).reshape(-1)
    s = np.asarray(successes, dtype=np.float64).reshape(-1)
    n = np.asarray(trials, dtype=np.float64).reshape(-1)
    if fit_forecast_model(p, s, n).num_items == 0:  # validates; unfitted: fewer than MIN_ITEMS or all alike
        return IsotonicMap()
    grid = np.array(KNOTS)
    isotonic = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
    fitted = isotonic.fit(p, s / n, sample_weight=n).predict(grid)
    values = (p.size * fitted + shrink * grid) / (p.size + shrink)
    kappa = fit_forecast_model(np.interp(p, grid, values), s, n).kappa  # the beta-binomial's, on the mapped ones
    return IsotonicMap(tuple(float(v) for v in values), kappa, int(p.size))


def candidate_outcomes(trees: Sequence[RolloutTree]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pred, successes, trials)`` of every prefix stage 2 scored in its first round, chosen or not: a node of the
    bare root rollouts (``Origin.ROLLOUT``) that carries a forecast, with the rewards of the root rollouts through it
    (its factual trajectories, known for every candidate) and of its own continuations where stage 2 chose it.
    Which candidates got continuations depended only on their forecasts and factual rewards, both in these data,
    so the choice is ignorable in this likelihood. Rewards are clipped to [0, 1]."""
    rows = []
    for tree in trees:
        factual: dict[int, list[float]] = {}
        for leaf in tree.leaves():
            if leaf.origin != Origin.ROLLOUT:
                continue
            node = leaf
            while node.parent_id > 0:
                node = tree.nodes[node.parent_id]
                factual.setdefault(node.node_id, []).append(tree.reward_of(leaf))
        continuations = continuation_rewards(tree)
        for node in tree.nodes[1:]:
            p = node.pred_success_prob
            if node.origin == Origin.ROLLOUT and p is not None and np.isfinite(p) and node.node_id in factual:
                rewards = np.clip(np.concatenate([factual[node.node_id], continuations.get(node.node_id, [])]), 0, 1)
                rows.append((float(p), float(rewards.sum()), int(rewards.size)))
    if not rows:
        return np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)
    p, successes, trials = zip(*rows)
    return np.array(p), np.array(successes), np.array(trials, dtype=np.int64)


def map_metrics(maps: Mapping[str, ForecastModel | IsotonicMap]) -> dict[str, float]:
    """``recalibration/<stage>_{alpha, beta}`` (a Platt map) or ``recalibration/<stage>_knot<KK>`` (an
    ``IsotonicMap``, its values at ``KNOTS``) of ``{"root": F, "prefix": F}``."""
    out = {}
    for stage in STAGES:
        if isinstance(maps[stage], IsotonicMap):
            out.update({f"recalibration/{stage}_knot{k:02d}": v for k, v in enumerate(maps[stage].values)})
        else:
            out.update({f"recalibration/{stage}_{name}": float(getattr(maps[stage], name)) for name in ("alpha", "beta")})
    return out


def _logged_map(entry: Mapping[str, float], stage: str) -> ForecastModel | IsotonicMap:
    if f"recalibration/{stage}_knot00" in entry:
        return IsotonicMap(tuple(float(entry[f"recalibration/{stage}_knot{k:02d}"]) for k in range(len(KNOTS))))
    return ForecastModel(float(entry[f"recalibration/{stage}_alpha"]), float(entry[f"recalibration/{stage}_beta"]))


def logged_maps(history: Sequence[Mapping[str, float]]) -> dict[int, dict[str, ForecastModel | IsotonicMap]]:
    """``{step: {"root": F_s, "prefix": F_s}}`` of every history entry that logged ``map_metrics``."""
    return {int(entry["step"]): {stage: _logged_map(entry, stage) for stage in STAGES} for entry in history
            if "recalibration/root_alpha" in entry or "recalibration/root_knot00" in entry}


def invert(model: ForecastModel | IsotonicMap, mapped: Any) -> np.ndarray:
    """(N,) float64 ``p`` with ``model.mean(p) = mapped``: ``IsotonicMap.inverse``, or for a Platt map
    ``logit p = (logit q - alpha) / beta``; NaN where that map is flat (``beta <= 0``: every ``p`` gave the same
    ``q``)."""
    if isinstance(model, IsotonicMap):
        return model.inverse(mapped)
    q = np.asarray(mapped, dtype=np.float64)
    if model.alpha == 0.0 and model.beta == 1.0:
        return q.copy()
    if model.beta <= 0.0:
        return np.full(q.shape, np.nan)
    qc = np.clip(q, _EPS, 1 - _EPS)
    z = (np.log(qc / (1 - qc)) - model.alpha) / model.beta
    return 1.0 / (1.0 + np.exp(-z))


def raw_outcomes(trees: Sequence[RolloutTree], used: Mapping[int, Mapping[str, ForecastModel | IsotonicMap]]
                 ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per stage, ``(pred, successes, trials)`` of ``trees`` with each forecast read back through the map of its
    tree's step (``used[tree.step]``; the identity for a step without one); items whose map was flat are left out.
    """
    columns: dict[str, list[list[np.ndarray]]] = {stage: [[], [], []] for stage in STAGES}
    for tree in trees:
        maps = used.get(tree.step, {})
        for stage, outcomes in (("root", root_outcomes([tree])), ("prefix", candidate_outcomes([tree]))):
            pred = invert(maps.get(stage, ForecastModel()), outcomes[0])
            keep = np.isfinite(pred)
            for column, values in zip(columns[stage], (pred, outcomes[1], outcomes[2])):
                column.append(np.asarray(values)[keep])
    return {stage: tuple(np.concatenate(c) if c else np.zeros(0) for c in cols) for stage, cols in columns.items()}


def step_maps(used: Mapping[int, Mapping[str, ForecastModel | IsotonicMap]], previous_trees: Sequence[RolloutTree],
              kind: str = "platt", root_trees: Sequence[RolloutTree] | None = None
              ) -> dict[str, ForecastModel | IsotonicMap]:
    """``{"root": F_t, "prefix": F_t}`` for the step after ``previous_trees`` (module docstring).

    Args:
        used: the maps each earlier step's allocator read through (``logged_maps`` and the steps run since).
        previous_trees: the trees of the ``predictor.recalibrate_window`` steps before this one (never this step's).
        kind: ``predictor.recalibrate_map``: ``platt`` (``fit_forecast_model``) or ``isotonic``
            (``fit_isotonic_map``).
        root_trees: the trees the root map is fitted on (``predictor.recalibrate_roots: explore``: the window's
            exploration groups, ``exploration_trees``); ``None`` = ``previous_trees``.

    Returns:
        The map per stage (``shrink=SHRINK``) fitted on the window's forecasts read back to the predictor's; the
        identity for a stage with fewer than ``forecast.MIN_ITEMS`` outcomes.

    Raises:
        ValueError: an unknown ``kind``.
    """
    fits = {"platt": fit_forecast_model, "isotonic": fit_isotonic_map}
    if kind not in fits:
        raise ValueError(f"predictor.recalibrate_map={kind!r} is not one of {sorted(fits)}")
    outcomes = raw_outcomes(previous_trees, used)
    if root_trees is not None:
        outcomes["root"] = raw_outcomes(root_trees, used)["root"]
    return {stage: fits[kind](*outcomes[stage], shrink=SHRINK) for stage in STAGES}


def exploration_trees(trees: Sequence[RolloutTree], arm: Any, prompts: Sequence[Any], acfg: Any, seed: int
                      ) -> list[RolloutTree]:
    """The trees of ``trees`` that were exploration groups (``allocation.explore_groups``): per step, the draw
    ``allocate_step`` made, made again (the step's candidates, ``candidate_indices``, and its stream
    ``"explore"``, both functions of the seed and the step alone).

    Args:
        trees: one arm's trees (each ``tree.step`` >= 0).
        arm: that arm's ``Arm``.
        prompts: the training prompts the loop draws candidates from (``train.prompt_pool``'s where set).
        acfg: the ``allocation`` section (``num_candidates``, ``explore_groups``).
        seed: the run's seed.

    Returns:
        The exploration groups' trees, in the order of ``trees``; none where the arm does not explore.
    """
    from trace.allocation.step import exploration_draw
    from trace.training.seeding import candidate_indices, step_rng

    drawn: dict[int, set[str]] = {}
    for step in sorted({tree.step for tree in trees}):
        idx = candidate_indices(len(prompts), acfg.num_candidates, seed, step)
        rng_for = lambda salt, step=step: step_rng(seed, step, salt)  # noqa: E731
        picked = exploration_draw(arm, len(idx), acfg.explore_groups, rng_for)
        drawn[step] = {prompts[idx[i]].prompt_uid for i in picked}
    return [tree for tree in trees if tree.prompt_uid in drawn[tree.step]]


class RecalibratedSampler:
    """A step sampler whose scores are ``F_t`` of its base's; sampling and every other attribute are the base's.

    Args:
        base: the step's ``PolicySampler``.
        maps: ``{"root": F_t, "prefix": F_t}`` (``step_maps``).
    """

    def __init__(self, base: Any, maps: Mapping[str, ForecastModel | IsotonicMap]) -> None:
        self.base = base
        self.maps = dict(maps)

    def score_prompts(self, prompts: Sequence) -> np.ndarray:
        """(B,) float64 ``F_t(p)`` of the base's root forecasts."""
        return self.maps["root"].mean(self.base.score_prompts(prompts))

    def score_anchors(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One (K_i,) float64 array per tree: ``F_t(v)`` of the base's prefix forecasts."""
        return [self.maps["prefix"].mean(v) for v in self.base.score_anchors(trees, node_ids)]

    def __getattr__(self, name: str) -> Any:
        if name == "base":  # not set yet (copy, unpickling): no recursion through the lookup below
            raise AttributeError(name)
        return getattr(self.base, name)
