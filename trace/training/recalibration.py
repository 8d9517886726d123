"""Forecasts the allocator reads, recalibrated online against the outcomes they forecast (``predictor.recalibrate``).

The predictor ranks prompts and prefixes but need not be calibrated (docs/results.md, "The predictor against the
truth"), and both stages plug its forecast into functions whose maximiser depends on the level, not only the
order: ``A(p, m)`` peaks at ``p = 1/2``, ``V_pref`` at ``v`` far from the factual reward. With
``predictor.recalibrate`` the allocator of a predictor arm reads ``q = F_t(p)`` instead of ``p``, per stage, with

    logit F_t(p) = alpha_t + beta_t logit p,    F_t = G_t o F_{t-1},    F_{-1} = identity,

where ``G_t`` is ``trace.predictor.forecast.fit_forecast_model`` (Platt's recalibration of the mean, with the
beta-binomial spread) fitted on the window's trees before step ``t`` (``predictor.window_steps``): the forecasts
those trees hold, which are what the allocator read (``q``), against their outcomes (root groups:
``trace.reporting.audit.root_outcomes``; anchors with their factual reward: ``anchor_outcomes``). ``G_t`` is the
correction the recent forecasts still need; once they are calibrated it is the identity and ``F_t`` stays. The
composition of two such maps is one (``compose``), so ``F_t`` is two numbers per stage, logged every step as
``recalibration/<stage>_{alpha, beta}``; a resumed run reads ``F_{t-1}`` back from its history.

The Monte-Carlo truth audit scores what the allocator reads, so with this on it scores ``q``.

References:
    Platt (1999), "Probabilistic outputs for support vector machines" (the logistic recalibration); Kull, Silva
    Filho and Flach (2017), "Beta calibration" (calibration maps linear in the logits).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from trace.predictor.forecast import ForecastModel, fit_forecast_model
from trace.reporting.audit import anchor_outcomes, root_outcomes
from trace.tree import RolloutTree

__all__ = ["RecalibratedSampler", "compose", "last_maps", "map_metrics", "step_maps"]

STAGES = ("root", "prefix")


def compose(outer: ForecastModel, inner: ForecastModel) -> ForecastModel:
    """``outer o inner``: ``logit q = a_o + b_o (a_i + b_i logit p)``, the spread and item count of ``outer``."""
    return ForecastModel(outer.alpha + outer.beta * inner.alpha, outer.beta * inner.beta, outer.kappa,
                         outer.num_items)


def map_metrics(maps: Mapping[str, ForecastModel]) -> dict[str, float]:
    """``recalibration/<stage>_{alpha, beta}`` of ``{"root": F, "prefix": F}``."""
    return {f"recalibration/{stage}_{name}": float(getattr(maps[stage], name)) for stage in STAGES
            for name in ("alpha", "beta")}


def last_maps(history: Sequence[Mapping[str, float]]) -> dict[str, ForecastModel]:
    """``F_{t-1}`` per stage: the last history entry that logged ``map_metrics``; the identity when none did."""
    for entry in reversed(history):
        if "recalibration/root_alpha" in entry:
            return {stage: ForecastModel(float(entry[f"recalibration/{stage}_alpha"]),
                                         float(entry[f"recalibration/{stage}_beta"])) for stage in STAGES}
    return {stage: ForecastModel() for stage in STAGES}


def step_maps(history: Sequence[Mapping[str, float]], previous_trees: Sequence[RolloutTree]
              ) -> tuple[dict[str, ForecastModel], dict[str, ForecastModel]]:
    """``(F_t, G_t)`` per stage for the step after ``history`` (module docstring).

    Args:
        history: the run's per-step metrics so far (``Trainer.history``).
        previous_trees: the window's trees before this step (never this step's).

    Returns:
        ``({"root": F_t, "prefix": F_t}, {"root": G_t, "prefix": G_t})``; ``G_t`` is the identity for a stage with
        fewer than ``forecast.MIN_ITEMS`` outcomes, and ``F_t`` then keeps ``F_{t-1}``.
    """
    prior = last_maps(history)
    corrections = {"root": fit_forecast_model(*root_outcomes(previous_trees)),
                   "prefix": fit_forecast_model(*anchor_outcomes(previous_trees))}
    return {stage: compose(corrections[stage], prior[stage]) for stage in STAGES}, corrections


class RecalibratedSampler:
    """A step sampler whose scores are ``F_t`` of its base's; sampling and every other attribute are the base's.

    Args:
        base: the step's ``PolicySampler``.
        maps: ``{"root": F_t, "prefix": F_t}`` (``step_maps``).
    """

    def __init__(self, base: Any, maps: Mapping[str, ForecastModel]) -> None:
        self.base = base
        self.maps = dict(maps)

    def score_prompts(self, prompts: Sequence) -> np.ndarray:
        """(B,) float64 ``F_t(p)`` of the base's root forecasts."""
        return self.maps["root"].mean(self.base.score_prompts(prompts))

    def score_anchors(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One (K_i,) float64 array per tree: ``F_t(v)`` of the base's prefix forecasts."""
        return [self.maps["prefix"].mean(v) for v in self.base.score_anchors(trees, node_ids)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)
