"""Ground truth for the predictor's forecasts: Monte-Carlo success rates of an unselected sample.

``PredictorBase.evaluate`` scores the predictor on the nodes the arm chose to sample, a selected (biased)
set. This module scores it on roots and prefixes drawn uniformly (``unselected_sample``: the step's candidate
prompts, the visited non-terminal prefixes of its trees), each against a Monte-Carlo estimate of its true
success probability under the current policy (``monte_carlo_truth``: ``K`` fresh continuations), per stage
(``score_forecasts``: ECE, Brier with its Murphy decomposition, AUC, reliability diagram).

Invariant: nothing here adds to the trees the arm trains on or draws from the arm's random streams. Roots
are sampled into new trees; prefixes are continued on copies of their trees; the sampler calls carry their
own salts (``"truth_roots"``, ``"truth_prefixes"``), so their seeds differ from every salt of
``trace.allocation.step``. The audit's rollouts are its own cost (``truth/rollouts``, ``truth/tokens``),
never part of the arm's budget.

Scores use the expanded-outcome convention of ``trace.predictor.calibration``: a forecast ``p`` with label
``y`` (a success fraction) and weight ``w`` (a number of outcomes) stands for ``w y`` successes and
``w (1 - y)`` failures, all forecast ``p``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from trace.predictor.calibration import NUM_ECE_BINS, _check_metric_inputs, brier_score, \
    expected_calibration_error, roc_auc
from trace.predictor.reliability import diagram_metrics
from trace.tree import RolloutTree

__all__ = ["MonteCarloTruth", "TruthSample", "brier_decomposition", "reliability_diagram", "monte_carlo_truth",
           "unselected_sample", "score_forecasts", "audit_forecasts"]

ROOT_SALT = "truth_roots"
PREFIX_SALT = "truth_prefixes"


def _bins(p: np.ndarray, num_bins: int) -> np.ndarray:
    """Bin index of each forecast, as ``expected_calibration_error`` bins them (the last bin includes 1.0)."""
    if num_bins < 1:
        raise ValueError(f"num_bins={num_bins} must be >= 1")
    return np.minimum((p * num_bins).astype(np.int64), num_bins - 1)


def brier_decomposition(pred: Any, outcome_rate: Any, weight: Any = None,
                        num_bins: int = NUM_ECE_BINS) -> dict[str, float]:
    """Murphy's partition of the Brier score over equal-width forecast bins, with its within-bin residual.

    With ``W = sum_i w_i``, bin ``b`` (``floor(num_bins p)``, the last bin closed) of weight ``W_b``, mean
    forecast ``pbar_b = sum_{i in b} w_i p_i / W_b``, realised rate ``obar_b = sum_{i in b} w_i y_i / W_b`` and
    overall rate ``obar = sum_i w_i y_i / W``:

    - ``reliability = sum_b W_b (pbar_b - obar_b)^2 / W`` (lower is better);
    - ``resolution = sum_b W_b (obar_b - obar)^2 / W`` (higher is better);
    - ``uncertainty = obar (1 - obar)`` (the Brier score of always forecasting ``obar``);
    - ``residual = sum_b sum_{i in b} w_i (p_i - pbar_b)(p_i + pbar_b - 2 y_i) / W``, the within-bin variance
      and covariance terms; it is 0 when every forecast of a bin equals the bin's mean forecast.

    Then ``brier == reliability - resolution + uncertainty + residual`` (exact up to rounding): expand
    ``(p_i - o)^2 = ((p_i - pbar_b) + (pbar_b - o))^2`` over each bin's expanded outcomes ``o`` and use the law
    of total variance, ``uncertainty = sum_b W_b obar_b (1 - obar_b) / W + resolution``.

    Args:
        pred: (N,) float forecasts in [0, 1].
        outcome_rate: (N,) float realised success fractions in [0, 1].
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.
        num_bins: number of equal-width bins (>= 1).

    Returns:
        ``{"brier", "reliability", "resolution", "uncertainty", "residual"}``, floats; ``brier`` equals
        ``trace.predictor.calibration.brier_score``.

    Raises:
        ValueError: as ``trace.predictor.calibration.brier_score``, or ``num_bins < 1``.

    References:
        Murphy (1973), "A new vector partition of the probability score", J. Appl. Meteor. 12:595-600 (the
        exact identity for forecasts that take ``num_bins`` values); Stephenson, Coelho, Jolliffe (2008), "Two
        extra components in the Brier score decomposition", Weather and Forecasting 23:752-757 (the within-bin
        terms when forecasts are binned).
    """
    p, y, w = _check_metric_inputs(pred, outcome_rate, weight)
    b = _bins(p, num_bins)
    total = w.sum()
    w_b = np.bincount(b, weights=w, minlength=num_bins)
    filled = w_b > 0
    pbar = np.divide(np.bincount(b, weights=w * p, minlength=num_bins), w_b, out=np.zeros(num_bins), where=filled)
    obar_b = np.divide(np.bincount(b, weights=w * y, minlength=num_bins), w_b, out=np.zeros(num_bins), where=filled)
    obar = float(np.sum(w * y) / total)
    return {
        "brier": brier_score(p, y, w),
        "reliability": float(np.sum(w_b * (pbar - obar_b) ** 2) / total),
        "resolution": float(np.sum(w_b * (obar_b - obar) ** 2) / total),
        "uncertainty": obar * (1.0 - obar),
        "residual": float(np.sum(w * (p - pbar[b]) * (p + pbar[b] - 2.0 * y)) / total),
    }


def reliability_diagram(pred: Any, outcome_rate: Any, weight: Any = None,
                        num_bins: int = NUM_ECE_BINS) -> list[dict[str, float]]:
    """The reliability diagram: per non-empty forecast bin, the mean forecast against the realised rate.

    Args:
        pred: (N,) float forecasts in [0, 1].
        outcome_rate: (N,) float realised success fractions in [0, 1].
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.
        num_bins: number of equal-width bins (>= 1), binned as ``brier_decomposition``.

    Returns:
        One row per bin with positive weight, in bin order: ``lower``, ``upper`` (bin edges), ``count`` (its
        weight ``W_b``, outcomes), ``mean_forecast`` (``pbar_b``), ``realised_rate`` (``obar_b``) and
        ``std_error = sqrt(obar_b (1 - obar_b) / W_b)``, the binomial standard error of the realised rate.

    Raises:
        ValueError: as ``brier_decomposition``.

    References:
        Murphy and Winkler (1977), "Reliability of subjective probability forecasts of precipitation and
        temperature", J. R. Stat. Soc. C 26(1) (the diagram).
    """
    p, y, w = _check_metric_inputs(pred, outcome_rate, weight)
    b = _bins(p, num_bins)
    rows = []
    for k in range(num_bins):
        in_bin = b == k
        count = float(w[in_bin].sum())
        if count <= 0.0:
            continue
        rate = float(np.sum(w[in_bin] * y[in_bin]) / count)
        rows.append({"lower": k / num_bins, "upper": (k + 1) / num_bins, "count": count,
                     "mean_forecast": float(np.sum(w[in_bin] * p[in_bin]) / count), "realised_rate": rate,
                     "std_error": float(np.sqrt(rate * (1.0 - rate) / count))})
    return rows


@dataclass(frozen=True)
class MonteCarloTruth:
    """Monte-Carlo success estimates of N roots or prefixes.

    Attributes:
        estimate: (N,) float64 mean reward of the ``K`` fresh continuations, in [0, 1].
        num_samples: (N,) int64 ``K``, continuations sampled.
        successes: (N,) float64 summed reward of the continuations (a count when rewards are 0/1).
        std_error: (N,) float64 binomial standard error ``sqrt(estimate (1 - estimate) / K)``.
    """

    estimate: np.ndarray
    num_samples: np.ndarray
    successes: np.ndarray
    std_error: np.ndarray

    @classmethod
    def from_rewards(cls, rewards: Sequence[np.ndarray]) -> "MonteCarloTruth":
        """From one (K_i,) float reward array per item (each ``K_i >= 1``)."""
        k = np.array([len(r) for r in rewards], dtype=np.int64)
        successes = np.array([float(np.sum(r)) for r in rewards], dtype=np.float64)
        estimate = successes / np.maximum(k, 1)
        return cls(estimate, k, successes, np.sqrt(estimate * (1.0 - estimate) / np.maximum(k, 1)))


@dataclass(frozen=True)
class TruthSample:
    """``monte_carlo_truth``'s answer: the roots' and the prefixes' estimates, and what they cost.

    Attributes:
        roots: ``MonteCarloTruth`` of the prompts, in their order.
        prefixes: ``MonteCarloTruth`` of the prefixes, in their order.
        num_rollouts: trajectories the audit sampled (roots and prefixes).
        num_tokens: tokens the policy generated for them.
    """

    roots: MonteCarloTruth
    prefixes: MonteCarloTruth
    num_rollouts: int
    num_tokens: int


def _copy_with_state(tree: RolloutTree) -> RolloutTree:
    """A copy whose node list and nodes are new (``expand_prefixes`` appends nodes and bumps the anchor's
    ``num_branches``), sharing token lists and ``env_state`` (continuations read them, never write them)."""
    return dataclasses.replace(tree, nodes=[dataclasses.replace(n) for n in tree.nodes])


def monte_carlo_truth(sampler: Any, prompts: Sequence, prefixes: Sequence[tuple[RolloutTree, int]],
                      samples: int = 16, *, root_salt: str = ROOT_SALT, prefix_salt: str = PREFIX_SALT) -> TruthSample:
    """Estimate the true success probability of roots and prefixes by ``samples`` fresh continuations each.

    Roots are sampled into new trees (``sampler.sample_roots(prompts, [K] * R, root_salt)``); each prefix is
    continued on its own copy of its tree (``sampler.sample_continuations(copies, {(j, node_id): K},
    prefix_salt)``), so the given trees are left as they were.

    Args:
        sampler: a ``trace.allocation.step.StepSampler`` (``PolicySampler`` in training), whose salts seed the
            audit apart from the arm's rollouts.
        prompts: R prompts (``trace.envs.base.Prompt``), distinct.
        prefixes: P ``(tree, node_id)`` pairs: non-terminal nodes holding an ``env_state`` (trees sampled in
            this process).
        samples: ``K >= 1`` continuations per root and per prefix.
        root_salt, prefix_salt: the sampler salts (default the audit's, ``"truth_roots"``, ``"truth_prefixes"``;
            ``trace.allocation.samplers.MonteCarloScorer`` passes its own).

    Returns:
        ``TruthSample``; its standard errors are ``sqrt(p (1 - p) / K)``.

    Raises:
        ValueError: ``samples < 1``, or what the sampler raises (a leaf or a terminal node as a prefix).
    """
    if samples < 1:
        raise ValueError(f"samples={samples} must be >= 1 continuation per root and prefix")
    root_rewards: list[np.ndarray] = []
    num_tokens = 0
    if prompts:
        for tree in sampler.sample_roots(list(prompts), [samples] * len(prompts), root_salt):
            root_rewards.append(tree.leaf_rewards())
            num_tokens += tree.num_generated_tokens()
    prefix_rewards: list[np.ndarray] = []
    if prefixes:
        copies = [_copy_with_state(tree) for tree, _ in prefixes]
        sizes = [len(c.nodes) for c in copies]
        sampler.sample_continuations(copies, {(j, int(node_id)): samples for j, (_, node_id) in enumerate(prefixes)},
                                     prefix_salt)
        for copy, size in zip(copies, sizes):
            new_leaves = [n for n in copy.leaves() if n.node_id >= size]
            prefix_rewards.append(np.array([copy.reward_of(n) for n in new_leaves], dtype=np.float64))
            num_tokens += sum(n.num_generated_tokens for n in copy.nodes[size:])
    num_rollouts = sum(len(r) for r in root_rewards) + sum(len(r) for r in prefix_rewards)
    return TruthSample(MonteCarloTruth.from_rewards(root_rewards), MonteCarloTruth.from_rewards(prefix_rewards),
                       num_rollouts, int(num_tokens))


def visited_prefixes(trees: Sequence[RolloutTree]) -> list[tuple[int, int]]:
    """``(tree_idx, node_id)`` of every visited non-terminal prefix: a non-root node with a child and an
    ``env_state`` that is not done (the nodes ``trace.allocation.prefix.candidate_anchors`` lists, whatever any
    allocator chose)."""
    out = []
    for t_idx, tree in enumerate(trees):
        has_child = np.zeros(len(tree.nodes), dtype=bool)
        for node in tree.nodes[1:]:
            has_child[node.parent_id] = True
        out += [(t_idx, n.node_id) for n in tree.nodes[1:] if has_child[n.node_id] and n.env_state is not None
                and not getattr(n.env_state, "done", False)]
    return out


def unselected_sample(candidates: Sequence, trees: Sequence[RolloutTree], num_roots: int, num_prefixes: int,
                      rng: np.random.Generator) -> tuple[list, list[tuple[RolloutTree, int]]]:
    """Draw roots and prefixes uniformly, without replacement, independently of any allocator's choice.

    Args:
        candidates: the step's B candidate prompts.
        trees: the step's sampled trees (``StepResult.sampled_trees``).
        num_roots: roots to draw (``min(num_roots, B)``), >= 0.
        num_prefixes: prefixes to draw among ``visited_prefixes(trees)`` (all of them when fewer), >= 0.
        rng: the caller's generator (``step_rng(seed, step, "truth")`` in training): the roots are drawn first,
            then the prefixes.

    Returns:
        ``(prompts, prefixes)``: the drawn prompts in candidate order, and ``(tree, node_id)`` pairs in
        ``(tree_idx, node_id)`` order.

    Raises:
        ValueError: a negative size.
    """
    if num_roots < 0 or num_prefixes < 0:
        raise ValueError(f"num_roots={num_roots} and num_prefixes={num_prefixes} must be >= 0")
    root_idx = np.sort(rng.choice(len(candidates), size=min(num_roots, len(candidates)), replace=False))
    visited = visited_prefixes(trees)
    pick = np.sort(rng.choice(len(visited), size=min(num_prefixes, len(visited)), replace=False))
    return [candidates[i] for i in root_idx], [(trees[visited[j][0]], visited[j][1]) for j in pick]


def _stage_scores(stage: str, pred: np.ndarray, truth: MonteCarloTruth, num_bins: int) -> tuple[dict, list]:
    names = ("ece", "brier", "reliability", "resolution", "uncertainty", "auc", "forecast_mean", "realised_mean")
    if pred.size == 0 or truth.num_samples.sum() <= 0:
        return {f"truth/{stage}_{n}": float("nan") for n in names}, []
    y, w = truth.estimate, truth.num_samples.astype(np.float64)
    parts = brier_decomposition(pred, y, w, num_bins)
    scores = {"ece": expected_calibration_error(pred, y, w, num_bins), "brier": parts["brier"],
              "reliability": parts["reliability"], "resolution": parts["resolution"],
              "uncertainty": parts["uncertainty"], "auc": roc_auc(pred, y, w),
              "forecast_mean": float(np.sum(w * pred) / w.sum()), "realised_mean": float(np.sum(w * y) / w.sum())}
    return {f"truth/{stage}_{n}": scores[n] for n in names}, reliability_diagram(pred, y, w, num_bins)


def score_forecasts(root_pred: Any, truth: TruthSample, prefix_pred: Any,
                    num_bins: int = NUM_ECE_BINS) -> tuple[dict[str, float], dict[str, list[dict[str, float]]]]:
    """Score root and prefix forecasts, apart, against their Monte-Carlo truth.

    Each forecast counts as its ``K`` continuations' outcomes (label = the estimate, weight = ``K``).

    Args:
        root_pred: (R,) float forecasts of ``truth.roots`` in [0, 1].
        truth: ``monte_carlo_truth``'s answer.
        prefix_pred: (P,) float forecasts of ``truth.prefixes`` in [0, 1].
        num_bins: forecast bins of ECE, the decomposition and the diagram.

    Returns:
        ``(metrics, diagrams)``: ``truth/{root,prefix}_{ece, brier, reliability, resolution, uncertainty, auc,
        forecast_mean, realised_mean}`` (NaN for a stage with nothing to score; AUC also when every outcome
        agrees), the diagrams' bins (``trace.predictor.reliability.diagram_metrics``), ``truth/num_roots``,
        ``truth/num_prefixes``, ``truth/rollouts`` and ``truth/tokens`` (the audit's cost); ``diagrams = {"root": rows, "prefix": rows}`` (``reliability_diagram``).

    Raises:
        ValueError: a forecast array whose length differs from its truth, or a value outside [0, 1].
    """
    metrics: dict[str, float] = {}
    diagrams: dict[str, list[dict[str, float]]] = {}
    for stage, pred, stage_truth in (("root", root_pred, truth.roots), ("prefix", prefix_pred, truth.prefixes)):
        pred = np.asarray(pred, dtype=np.float64).reshape(-1)
        if pred.shape != stage_truth.estimate.shape:
            raise ValueError(f"{stage}: {pred.size} forecasts for {stage_truth.estimate.size} estimates; pass one "
                             "forecast per sampled item")
        stage_metrics, diagrams[stage] = _stage_scores(stage, pred, stage_truth, num_bins)
        metrics.update(stage_metrics)
        metrics.update(diagram_metrics(stage, diagrams[stage], num_bins))
    metrics.update({"truth/num_roots": float(truth.roots.estimate.size),
                    "truth/num_prefixes": float(truth.prefixes.estimate.size),
                    "truth/rollouts": float(truth.num_rollouts), "truth/tokens": float(truth.num_tokens)})
    return metrics, diagrams


def audit_forecasts(sampler: Any, candidates: Sequence, trees: Sequence[RolloutTree], *, num_roots: int,
                    num_prefixes: int, samples: int,
                    rng: np.random.Generator) -> tuple[dict[str, float], dict[str, list[dict[str, float]]]]:
    """One audit: ``unselected_sample``, the sampler's forecasts of it (``score_prompts`` for roots,
    ``score_anchors`` for prefixes: what the arm's allocator reads), ``monte_carlo_truth`` and
    ``score_forecasts``. Call it before the predictor is refitted on ``trees`` (out of sample).

    Args:
        sampler: a ``StepSampler`` over the step's policy and predictor.
        candidates: the step's candidate prompts.
        trees: the step's sampled trees (left unchanged).
        num_roots, num_prefixes, samples: ``predictor.truth.roots``, ``.prefixes``, ``.samples``.
        rng: the generator of the draw.

    Returns:
        ``score_forecasts``'s ``(metrics, diagrams)``.

    Raises:
        ValueError: as ``unselected_sample`` and ``monte_carlo_truth``.
    """
    prompts, prefixes = unselected_sample(candidates, trees, num_roots, num_prefixes, rng)
    root_pred = sampler.score_prompts(prompts) if prompts else np.zeros(0)
    prefix_pred = (np.concatenate(sampler.score_anchors([t for t, _ in prefixes], [[n] for _, n in prefixes]))
                   if prefixes else np.zeros(0))
    truth = monte_carlo_truth(sampler, prompts, prefixes, samples)
    return score_forecasts(root_pred, truth, prefix_pred)
