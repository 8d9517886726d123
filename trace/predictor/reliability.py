"""Reliability diagrams of the predictor against Monte-Carlo truth: logged per audit, pooled over a run, drawn.

``trace.predictor.ground_truth.reliability_diagram`` bins one audit's forecasts. Each audit's non-empty bins go
into the step's metrics (``diagram_metrics``: ``truth/<stage>_bin<BB>_{outcomes, forecast, realised}``), so a
train run's MLflow history holds every diagram it measured. ``history_diagram`` pools a run's audits, and
``pool_diagrams`` pools runs (seeds): per bin, the outcome counts add and the mean forecast and realised rate are
outcome-weighted means, so pooling audits is the diagram of their union (exactly, as bins share edges).
``draw_reliability`` draws pooled diagrams: the train flow logs each run's as an MLflow image
(``truth/reliability.png``) and the report draws each arm's over seeds (``reliability.png``).

References:
    Murphy and Winkler (1977), "Reliability of subjective probability forecasts of precipitation and
    temperature", J. R. Stat. Soc. C 26(1).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

__all__ = ["STAGES", "arm_reliability", "audit_diagrams", "calibration_noise", "compact_rows", "debiased_ece_difference",
           "diagram_ece", "diagram_metrics", "draw_reliability", "expand_rows", "history_diagram", "is_diagram_key",
           "pool_diagrams", "pooled_ece_interval"]

STAGES = ("root", "prefix")
FIELDS = {"outcomes": "count", "forecast": "mean_forecast", "realised": "realised_rate"}
_KEY = re.compile(r"^truth/(root|prefix)_bin(\d+)_(outcomes|forecast|realised)$")


def diagram_metrics(stage: str, rows: Sequence[Mapping[str, float]], num_bins: int) -> dict[str, float]:
    """One audit's diagram as step metrics.

    Args:
        stage: ``"root"`` or ``"prefix"``.
        rows: ``reliability_diagram``'s rows (non-empty bins).
        num_bins: the bins it used (fixes each row's index from its lower edge).

    Returns:
        ``{"truth/<stage>_bin<BB>_outcomes": W_b, "..._forecast": pbar_b, "..._realised": obar_b}`` per row,
        ``BB`` the bin index with two digits.

    Raises:
        ValueError: an unknown stage.
    """
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not one of {STAGES}")
    out = {}
    for row in rows:
        b = int(round(row["lower"] * num_bins))
        for name, field in FIELDS.items():
            out[f"truth/{stage}_bin{b:02d}_{name}"] = float(row[field])
    return out


def is_diagram_key(key: str) -> bool:
    """Whether ``key`` is one of ``diagram_metrics``' keys."""
    return _KEY.match(key) is not None


def _rows(cells: Mapping[int, list[float]], num_bins: int) -> list[dict[str, float]]:
    rows = []
    for b in sorted(cells):
        count, forecast_sum, success_sum = cells[b]
        if count <= 0:
            continue
        rate = success_sum / count
        rows.append({"lower": b / num_bins, "upper": (b + 1) / num_bins, "count": count,
                     "mean_forecast": forecast_sum / count, "realised_rate": rate,
                     "std_error": math.sqrt(rate * (1.0 - rate) / count)})
    return rows


def audit_diagrams(history: Mapping[str, Sequence[tuple[int, float]]], stage: str,
                   num_bins: int = 10) -> list[list[dict[str, float]]]:
    """Each audited step's diagram of ``stage`` in a run's metric ``history``, in step order (``history_diagram``
    pools them)."""
    out = []
    for _, bins in sorted(_audit_cells(history, stage).items()):
        cells = {b: [c["outcomes"], c["outcomes"] * c["forecast"], c["outcomes"] * c["realised"]]
                 for b, c in bins.items()}
        if cells:
            out.append(_rows(cells, num_bins))
    return out


def _audit_cells(history: Mapping[str, Sequence[tuple[int, float]]], stage: str) -> dict[int, dict[int, dict]]:
    """``{step: {bin: {"outcomes", "forecast", "realised"}}}`` of the complete, non-empty bins of ``stage``."""
    per_step: dict[int, dict[int, dict[str, float]]] = {}
    for key, points in history.items():
        match = _KEY.match(key)
        if match is None or match.group(1) != stage:
            continue
        for step, value in points:
            per_step.setdefault(int(step), {}).setdefault(int(match.group(2)), {})[match.group(3)] = float(value)
    return {step: {b: c for b, c in bins.items() if len(c) == len(FIELDS) and c["outcomes"] > 0}
            for step, bins in per_step.items()}


def pooled_ece_interval(runs: Sequence[Sequence[Sequence[Mapping[str, float]]]], confidence: float = 0.95,
                        resamples: int = 2000, seed: int = 0, *, debiased: bool = False) -> tuple[float, float]:
    """A percentile bootstrap interval of the pooled ECE (``diagram_ece`` of ``pool_diagrams``), or of the debiased
    ECE (``calibration_noise``), resampling runs and then audits.

    Each resample draws as many runs (seeds) as given, with replacement, and within each drawn run as many of its
    audit diagrams as it has, with replacement; it pools each drawn run's audits and scores the pool of them all
    (or, with ``debiased``, the drawn runs as clusters). Runs are the independent units (a run's audits share one
    policy trajectory); the audits within a run add their own spread. Like the ECE itself, the resampled pooled
    ECE is biased upward by the noise of each bin's realised rate, so its interval sits above the point; the
    debiased ECE removes that bias to first order.

    Args:
        runs: (R,) runs, each its (A_r,) per-audit diagrams (``audit_diagrams``); empty runs are dropped.
        confidence: interval coverage.
        resamples: bootstrap resamples.
        seed: the resampling generator's seed (the interval is deterministic).
        debiased: score ``calibration_noise``'s ``debiased`` instead of the pooled ECE.

    Returns:
        ``(low, high)``; ``(nan, nan)`` with fewer than 2 audits in all (with ``debiased``: fewer than 2 runs).

    References:
        Davison and Hinkley (1997), Bootstrap Methods and their Application, section 3.8 (resampling
        hierarchical data: clusters first, then within them).
    """
    import numpy as np

    runs = [list(r) for r in runs if len(r)]
    if sum(len(r) for r in runs) < 2 or (debiased and len(runs) < 2):
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    scores = np.empty(resamples)
    for k in range(resamples):
        drawn = [runs[i] for i in rng.integers(0, len(runs), size=len(runs))]
        audits = [[run[j] for j in rng.integers(0, len(run), size=len(run))] for run in drawn]
        scores[k] = (calibration_noise([pool_diagrams(a) for a in audits])["debiased"] if debiased
                     else diagram_ece(pool_diagrams(a for run in audits for a in run)))
    tail = (1.0 - confidence) / 2.0
    return float(np.nanquantile(scores, tail)), float(np.nanquantile(scores, 1.0 - tail))


def debiased_ece_difference(runs_a: Mapping[int, Sequence[Sequence[Mapping[str, float]]]],
                            runs_b: Mapping[int, Sequence[Sequence[Mapping[str, float]]]], confidence: float = 0.95,
                            resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Two arms' debiased ECEs (``calibration_noise``) and their difference, paired by seed, with a percentile
    bootstrap interval that draws the seeds once for both arms (then each arm's audits within each drawn seed).

    Args:
        runs_a, runs_b: seed -> that seed's (A,) per-audit diagrams (``audit_diagrams``) of one stage; only the
            seeds both hold are used.
        confidence: interval coverage.
        resamples: bootstrap resamples.
        seed: the resampling generator's seed (deterministic).

    Returns:
        ``{"a", "b", "difference", "low", "high", "seeds"}``: the debiased ECEs over the common seeds, ``a - b`` and
        its interval, the number of common seeds; NaN with fewer than 2 common seeds.

    References:
        Davison and Hinkley (1997), Bootstrap Methods and their Application, section 3.8 (clusters first).
    """
    import numpy as np

    common = sorted(s for s in runs_a if s in runs_b and len(runs_a[s]) and len(runs_b[s]))
    nan = float("nan")
    if len(common) < 2:
        return {"a": nan, "b": nan, "difference": nan, "low": nan, "high": nan, "seeds": len(common)}
    a = calibration_noise([pool_diagrams(runs_a[s]) for s in common])["debiased"]
    b = calibration_noise([pool_diagrams(runs_b[s]) for s in common])["debiased"]
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    for k in range(resamples):
        drawn = [common[i] for i in rng.integers(0, len(common), size=len(common))]
        scores = [calibration_noise([pool_diagrams([runs[s][j] for j in rng.integers(0, len(runs[s]), len(runs[s]))])
                                     for s in drawn])["debiased"] for runs in (runs_a, runs_b)]
        diffs[k] = scores[0] - scores[1]
    tail = (1.0 - confidence) / 2.0
    return {"a": a, "b": b, "difference": a - b, "low": float(np.nanquantile(diffs, tail)),
            "high": float(np.nanquantile(diffs, 1.0 - tail)), "seeds": len(common)}


COMPACT_FIELDS = ("lower", "count", "mean_forecast", "realised_rate")  # a diagram row as a list, for metrics.json


def compact_rows(rows: Sequence[Mapping[str, float]]) -> list[list[float]]:
    """A diagram's rows as ``[lower, count, mean_forecast, realised_rate]`` lists (``expand_rows`` reads them)."""
    return [[float(r[f]) for f in COMPACT_FIELDS] for r in rows]


def expand_rows(compact: Sequence[Sequence[float]]) -> list[dict[str, float]]:
    """``compact_rows``' lists back to rows with the fields ``calibration_noise`` and ``pool_diagrams`` read."""
    return [dict(zip(COMPACT_FIELDS, map(float, row))) for row in compact]


def calibration_noise(runs: Sequence[Sequence[Mapping[str, float]]], num_bins: int = 10) -> dict[str, float]:
    """The pooled ECE beside what noise alone makes of it: the ECE a calibrated predictor reads on the same sample
    (the floor) and the ECE with that noise taken out (debiased), the runs (seeds) as independent clusters.

    With run ``r``'s pooled diagram (``history_diagram``) of bin weights ``W_rb`` and gaps ``g_rb = pbar_rb -
    obar_rb``, the pooled gap of bin ``b`` is ``d_b = sum_r W_rb g_rb / W_b`` (the gap of the pooled diagram,
    exactly). Its variance over runs, clusters of whatever the bin's noise is made of (each item's ``K``
    Monte-Carlo outcomes, its true probability's scatter around the forecast, the policy's drift between audits
    and seeds), is estimated by the cluster-robust sandwich ``V_b = R / (R - 1) sum_r (W_rb / W_b)^2 (g_rb -
    d_b)^2`` over the ``R`` runs. With ``W = sum_b W_b``:

    - ``pooled = sum_b W_b |d_b| / W`` (``diagram_ece`` of the pooled diagram);
    - ``floor = sum_b W_b sqrt(2 V_b / pi) / W``: ``E|d_b|`` when ``d_b ~ N(0, V_b)``, the pooled ECE that a
      predictor calibrated in every bin reads with this noise; it falls as runs are added (about ``1/sqrt(R)``);
    - ``debiased = sum_b W_b sqrt(max(0, d_b^2 - V_b)) / W``: ``E[d_b^2] = delta_b^2 + V_b`` for the true gap
      ``delta_b``, so ``d_b^2 - V_b`` is unbiased for ``delta_b^2`` and its root estimates ``|delta_b|`` with the
      noise removed to first order (0 in a bin whose gap is within its noise).

    Args:
        runs: (R,) diagrams, each a run's pooled rows (``history_diagram``) on the same bins; empty ones are dropped.
        num_bins: their bins.

    Returns:
        ``{"pooled", "floor", "debiased"}`` floats; ``floor`` and ``debiased`` are NaN with fewer than 2 runs
        (``pooled`` NaN without outcomes).

    References:
        Kumar, Liang and Ma (2019), "Verified uncertainty calibration", NeurIPS (the debiased estimator of the
        squared calibration error, per bin); Roelofs et al. (2022), "Mitigating bias in calibration error
        estimation", AISTATS (the binned ECE's upward bias); Cameron and Miller (2015), "A practitioner's guide
        to cluster-robust inference", J. Human Resources 50(2) (the sandwich variance over clusters).
    """
    runs = [list(rows) for rows in runs if sum(r["count"] for r in rows) > 0]
    cells: dict[int, list[tuple[float, float]]] = {}
    for rows in runs:
        for row in rows:
            cells.setdefault(int(round(row["lower"] * num_bins)), []).append(
                (float(row["count"]), float(row["mean_forecast"] - row["realised_rate"])))
    total = sum(w for cell in cells.values() for w, _ in cell)
    if total <= 0:
        return {"pooled": float("nan"), "floor": float("nan"), "debiased": float("nan")}
    pooled = floor = debiased = 0.0
    n = len(runs)
    for cell in cells.values():
        weight = sum(w for w, _ in cell)
        gap = sum(w * g for w, g in cell) / weight
        var = n / (n - 1) * sum((w / weight) ** 2 * (g - gap) ** 2 for w, g in cell) if n > 1 else float("nan")
        pooled += weight * abs(gap)
        floor += weight * math.sqrt(2.0 * var / math.pi)
        debiased += weight * (math.sqrt(max(0.0, gap * gap - var)) if n > 1 else math.nan)
    return {"pooled": pooled / total, "floor": floor / total, "debiased": debiased / total}


def arm_reliability(histories: Mapping[int, Mapping[str, Sequence[tuple[int, float]]]], confidence: float = 0.95,
                    num_bins: int = 10) -> dict:
    """An arm's audits over its seeds, for the report: the pooled diagrams, the pooled ECE per seed and its
    bootstrap interval, and ``calibration_noise`` with the debiased ECE's interval.

    Args:
        histories: seed -> that seed's train-run metric history (``{key: [(step, value), ...]}``).
        confidence: the intervals' coverage.
        num_bins: the audits' bins.

    Returns:
        ``{"reliability": {stage: rows} or None (nothing audited), "pooled_ece_seeds": {stage: {seed: ECE}},
        "pooled_ece_interval": {stage: (low, high)} or None, "ece_noise": {stage: {"floor", "debiased",
        "debiased_interval": (low, high)}} or None, "audit_diagrams": {stage: {seed: its per-audit diagrams}}}``
        (the last for comparisons paired by seed across reports, ``debiased_ece_difference``).
    """
    per_seed = {stage: {seed: history_diagram(h, stage, num_bins) for seed, h in histories.items()}
                for stage in STAGES}
    diagrams = {stage: pool_diagrams(per_seed[stage].values(), num_bins) for stage in STAGES}
    audited = any(diagrams.values())
    out = {"reliability": diagrams if audited else None,
           "pooled_ece_seeds": {stage: {seed: diagram_ece(rows) for seed, rows in per_seed[stage].items()}
                                for stage in STAGES},
           "pooled_ece_interval": None, "ece_noise": None, "audit_diagrams": None}
    if audited:
        by_seed = {stage: {seed: audit_diagrams(h, stage, num_bins) for seed, h in histories.items()}
                   for stage in STAGES}
        audits = {stage: list(by_seed[stage].values()) for stage in STAGES}
        out["audit_diagrams"] = by_seed
        out["pooled_ece_interval"] = {stage: pooled_ece_interval(audits[stage], confidence) for stage in STAGES}
        out["ece_noise"] = {stage: {**{k: v for k, v in calibration_noise(per_seed[stage].values(), num_bins).items()
                                       if k != "pooled"},
                                    "debiased_interval": pooled_ece_interval(audits[stage], confidence, debiased=True)}
                            for stage in STAGES}
    return out


def history_diagram(history: Mapping[str, Sequence[tuple[int, float]]], stage: str,
                    num_bins: int = 10) -> list[dict[str, float]]:
    """A run's diagram of ``stage`` pooled over every audited step of its metric ``history``.

    Args:
        history: ``{metric key: [(step, value), ...]}`` (a train run's MLflow history); keys other than the
            stage's ``diagram_metrics`` keys are ignored.
        stage: ``"root"`` or ``"prefix"``.
        num_bins: the audits' bins (``trace.predictor.calibration.NUM_ECE_BINS``).

    Returns:
        ``reliability_diagram``-shaped rows (``lower``, ``upper``, ``count``, ``mean_forecast``,
        ``realised_rate``, ``std_error``), bins with outcomes only; empty when nothing was audited.
    """
    cells: dict[int, list[float]] = {}
    for _, bins in sorted(_audit_cells(history, stage).items()):
        for b, cell in bins.items():
            acc = cells.setdefault(b, [0.0, 0.0, 0.0])
            acc[0] += cell["outcomes"]
            acc[1] += cell["outcomes"] * cell["forecast"]
            acc[2] += cell["outcomes"] * cell["realised"]
    return _rows(cells, num_bins)


def pool_diagrams(diagrams: Iterable[Sequence[Mapping[str, float]]], num_bins: int = 10) -> list[dict[str, float]]:
    """Pool diagrams on the same bins (e.g. one per seed): outcome counts add, means are outcome-weighted.

    Args:
        diagrams: each a list of rows as ``history_diagram`` returns.
        num_bins: their bins.

    Returns:
        The pooled rows, in bin order.
    """
    cells: dict[int, list[float]] = {}
    for rows in diagrams:
        for row in rows:
            acc = cells.setdefault(int(round(row["lower"] * num_bins)), [0.0, 0.0, 0.0])
            acc[0] += row["count"]
            acc[1] += row["count"] * row["mean_forecast"]
            acc[2] += row["count"] * row["realised_rate"]
    return _rows(cells, num_bins)


def diagram_ece(rows: Sequence[Mapping[str, float]]) -> float:
    """The ECE of a (pooled) diagram: ``sum_b W_b |pbar_b - obar_b| / sum_b W_b``; NaN without outcomes.

    Pooled over audits it is the ECE of their union, binned alike (``expected_calibration_error``). The mean of
    per-audit ECEs is not: with a few dozen items per audit, a bin holds a handful of items whose true success
    probabilities scatter around their forecast (the spread ``kappa`` of ``trace.predictor.forecast``), each
    estimated from ``K`` continuations, and ``|pbar_b - obar_b|`` averages that scatter and that noise: an upward
    bias that a calibrated predictor shows too. The pooled ECE keeps a smaller bias of the same kind, is never
    above the outcome-weighted mean of the per-audit ECEs, and reads the calibration of the forecasts averaged over
    the pooled audits: a miscalibration whose sign changes between audits (or seeds) cancels in it.
    """
    total = sum(r["count"] for r in rows)
    if total <= 0:
        return float("nan")
    return float(sum(r["count"] * abs(r["mean_forecast"] - r["realised_rate"]) for r in rows) / total)


def draw_reliability(diagrams: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]], path: str | Path | None = None,
                     title: str = ""):
    """Reliability diagrams, roots and prefixes side by side: per label (an arm), realised rate against mean
    forecast per bin with its binomial standard error, and the diagonal of a calibrated predictor.

    Args:
        diagrams: ``{label: {"root": rows, "prefix": rows}}`` (pooled rows).
        path: the PNG written; None: the figure is returned open (for ``MlflowClient.log_figure``).
        title: the figure's title.

    Returns:
        The matplotlib figure when ``path`` is None, else None.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4))
    for ax, stage in zip(axes, STAGES):
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="calibrated")
        for label, by_stage in diagrams.items():
            rows = by_stage.get(stage) or []
            if not rows:
                continue
            total = sum(r["count"] for r in rows)
            ax.errorbar([r["mean_forecast"] for r in rows], [r["realised_rate"] for r in rows],
                        yerr=[1.96 * r["std_error"] for r in rows], marker="o", ms=4, capsize=2, lw=1,
                        label=f"{label} ({total:,.0f} outcomes)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("mean forecast in the bin")
        ax.set_ylabel("realised success rate (Monte-Carlo)")
        ax.set_title(("roots" if stage == "root" else "prefixes") + (f": {title}" if title else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
