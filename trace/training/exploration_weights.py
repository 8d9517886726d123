"""Importance weights of the exploration groups' roots in the predictor's fit (``predictor.explore_weight``).

Stage 1 samples the candidates it forecasts near 1/2, so the roots the predictor is refitted on are selected on its
own forecast, and it learns little about the candidates it passes over (docs/results.md, "Which stage costs the
forecasts their calibration"). The exploration groups (``allocation.explore_groups``) are drawn uniformly from the
step's candidates before stage 1 reads a forecast. Weighting their roots up makes the root loss of the fit stand
for every candidate of the step instead of the ones stage 1 chose. With ``explore_weight: balanced``, at step t

    w_t = (N - |S_t|) / E_t,

``N`` = ``allocation.num_candidates``, ``S_t`` the step's roots stage 1 sampled and ``E_t`` its exploration
groups: each exploration group stands for every candidate that got no stage-1 rollouts (itself included), so the
roots' weights sum to ``N``. These are the inverse inclusion probabilities of the exploration draw over the
candidates stage 1 leaves (Horvitz and Thompson 1952), the weights of importance-weighted active learning
(Beygelzimer, Dasgupta and Langford 2009) for a learner whose queries are chosen by its own scores. A number
instead of ``balanced`` is the weight itself, at every step. Turn nodes keep their leaf counts.

References:
    Horvitz and Thompson (1952), "A generalization of sampling without replacement from a finite universe",
    JASA 47; Beygelzimer, Dasgupta and Langford (2009), "Importance weighted active learning", ICML.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np

from trace.training.recalibration import exploration_trees
from trace.tree import RolloutTree


def exploration_root_weights(trees: Sequence[RolloutTree], arm: Any, prompts: Sequence[Any], cfg: Any
                             ) -> np.ndarray | None:
    """(T,) float64 multipliers of each tree's root example in the predictor's fit (module docstring).

    Args:
        trees: one arm's window of trees (each ``tree.step`` >= 0), every tree of each step it covers.
        arm: that arm's ``Arm``.
        prompts: the training prompts the loop draws candidates from (``exploration_trees``).
        cfg: the run's ``Config``: ``predictor.explore_weight`` (a number > 0, or ``"balanced"``), ``seed`` and
            ``allocation`` (``num_candidates``, ``explore_groups``).

    Returns:
        1 for a root stage 1 chose, the exploration weight for an exploration group's; ``None`` where every
        multiplier is 1 (``weight`` 1, or the arm draws no exploration groups), which fits as without the key.

    Raises:
        ValueError: ``balanced`` at a step whose roots outnumber ``num_candidates`` (the window is not this
            arm's, or ``acfg`` is not the run's).
    """
    acfg, weight = cfg.allocation, cfg.predictor.explore_weight
    if weight == 1.0 or not acfg.explore_groups:
        return None
    explored = {tree.tree_id for tree in exploration_trees(trees, arm, prompts, acfg, cfg.seed)}
    if not explored:
        return None
    is_explore = [tree.tree_id in explored for tree in trees]
    chosen = Counter(tree.step for tree, e in zip(trees, is_explore) if not e)
    drawn = Counter(tree.step for tree, e in zip(trees, is_explore) if e)
    out = np.ones(len(trees))
    for i, tree in enumerate(trees):
        if is_explore[i]:
            out[i] = float(weight) if weight != "balanced" else _balanced(tree.step, chosen, drawn, acfg)
    return out


def _balanced(step: int, chosen: Counter, drawn: Counter, acfg: Any) -> float:
    """``w_t = (N - |S_t|) / E_t`` at ``step`` (module docstring)."""
    passed_over = acfg.num_candidates - chosen[step]
    if passed_over < drawn[step]:
        raise ValueError(f"step {step} has {chosen[step]} stage-1 roots and {drawn[step]} exploration groups, more "
                         f"than allocation.num_candidates={acfg.num_candidates}: pass one arm's window and the run's "
                         "allocation section")
    return passed_over / drawn[step]
