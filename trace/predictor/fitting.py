"""Warm-start fitting on the seed rollouts, with an out-of-sample score on held-out prompts first.

Before the final fit on every tree, a probe predictor is fitted on the trees of about 80 % of the prompts
and scored on the others (Brier, ECE, AUC, log loss): its honest out-of-sample quality at the start of
training. Invariant: the split depends only on the prompt ids (a crc32 hash), so every tree of a prompt
falls on one side and reruns split alike.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

from trace.configuration.config import PredictorConfig
from trace.predictor.base import SuccessPredictor
from trace.predictor.registry import make_predictor
from trace.tree import RolloutTree

NUM_HOLDOUT_FOLDS = 5  # one fold of the prompts (about 20 %) is held out


def holdout_split(trees: Sequence[RolloutTree], num_folds: int = NUM_HOLDOUT_FOLDS
                  ) -> tuple[list[RolloutTree], list[RolloutTree]]:
    """Split trees by prompt into a fitting part and a held-out part.

    Args:
        trees: rollout trees.
        num_folds: the held-out part is the prompts with ``crc32(prompt_uid) % num_folds == 0`` (>= 2).

    Returns:
        ``(fit_trees, held_trees)``, each in the order of ``trees``.

    Raises:
        ValueError: if ``num_folds < 2``.
    """
    if num_folds < 2:
        raise ValueError(f"num_folds={num_folds} must be >= 2: one fold is held out, the others are fitted")
    held = [t for t in trees if zlib.crc32(t.prompt_uid.encode()) % num_folds == 0]
    fit = [t for t in trees if zlib.crc32(t.prompt_uid.encode()) % num_folds != 0]
    return fit, held


def fit_with_holdout(cfg: PredictorConfig, trees: Sequence[RolloutTree], *, env: Any = None, policy: Any = None,
                     seed: int = 0) -> tuple[SuccessPredictor, dict[str, float]]:
    """Score a probe fitted on the fitting part on the held-out part, then fit a fresh predictor on all trees.

    Args:
        cfg: predictor section of the config.
        trees: the seed rollout trees.
        env, policy, seed: as ``make_predictor``.

    Returns:
        ``(predictor, metrics)``: the predictor fitted on every tree, and its metrics: the probe's
        ``predictor/*_heldout`` evaluation (absent when either part is empty), then the numeric diagnostics
        of the final fit.

    Raises:
        ValueError: as ``make_predictor``.
    """
    fit, held = holdout_split(trees)
    metrics: dict[str, float] = {}
    if held and fit:
        probe = make_predictor(cfg, env=env, policy=policy, seed=seed)
        probe.fit(fit)
        metrics.update({f"{k}_heldout": v for k, v in probe.evaluate(held).items()})
    predictor = make_predictor(cfg, env=env, policy=policy, seed=seed)
    metrics.update({k: v for k, v in predictor.fit(trees).items() if isinstance(v, (int, float))})
    return predictor, metrics
