"""The report's PNGs: per-arm curves over training seeds, the mean with its 95 % t-interval, at measured points only.

Per-step metrics are plotted against the training step (a line through every logged step, with its band);
held-out accuracy, measured at the in-training evaluations only, against cumulative generated tokens and
against cumulative trajectories as one marker per evaluation (the seeds' mean x and y, their t-intervals as
error bars) joined by straight lines: nothing is interpolated onto steps that were not measured
(``measured_points``). With one seed a point has no interval. ``reliability.png`` (the predictor's reliability
diagrams against Monte-Carlo truth, pooled over audits and seeds) is drawn only when some run audited them. ``audit.png``
(forecast against realised mixed groups and flips per arm) is drawn only when some train run logged the
allocation audit's keys, and the avg@k curves (``avgk_vs_steps.png``, ``avgk_vs_tokens.png``) only when some run
logged ``accuracy/eval_sampled``; each is removed otherwise so that no stale plot is left beside the report.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trace.predictor.reliability import STAGES, draw_reliability, history_diagram, pool_diagrams
from trace.reporting.report import AUDIT_KEYS, CONFIDENCE, arm_statistics
from trace.reporting.statistics import Interval, mean_interval
from trace.tracking.names import EVAL_SAMPLED_ACCURACY

# plot file -> (step metric, y label, x metric or None for the training step)
PLOTS: dict[str, tuple[str, str, str | None]] = {
    "effective_ratio.png": ("effective_ratio", "effective ratio", None),
    "reward.png": ("reward/mean", "mean train reward", None),
    "tokens.png": ("tokens/generated", "generated tokens per step", None),
    "accuracy_vs_tokens.png": ("accuracy/eval", "held-out greedy accuracy", "tokens/cumulative"),
    "accuracy_vs_trajectories.png": ("accuracy/eval", "held-out greedy accuracy", "rollout/cumulative_trajectories"),
}
# with train.eval_samples: held-out avg@k in training, against the step and the generated tokens (drawn only
# when some run logged it)
SAMPLED_PLOTS: dict[str, tuple[str, str, str | None]] = {
    "avgk_vs_steps.png": (EVAL_SAMPLED_ACCURACY, "held-out avg@k (sampled)", None),
    "avgk_vs_tokens.png": (EVAL_SAMPLED_ACCURACY, "held-out avg@k (sampled)", "tokens/cumulative"),
}
# with train.eval_every_tokens: the evaluations at the same generated-token marks for every arm and seed
TOKEN_MARK = "eval/token_mark"
MARK_PLOTS: dict[str, tuple[str, str, str | None]] = {
    "accuracy_vs_token_marks.png": ("accuracy/eval", "held-out greedy accuracy", TOKEN_MARK),
    "avgk_vs_token_marks.png": (EVAL_SAMPLED_ACCURACY, "held-out avg@k (sampled)", TOKEN_MARK),
}
AUDIT_PLOT = "audit.png"
RELIABILITY_PLOT = "reliability.png"  # predictor.truth: each arm's diagrams pooled over its audits and seeds
# with train.probe_prompts: the probe's gain over the starting policy, a curve free of the per-step prompt draw
PROBE_PLOT = ("probe_gain.png", "probe/gain", "probe success minus the starting policy's")
X_LABELS = {None: "training step", "tokens/cumulative": "cumulative generated tokens",
            TOKEN_MARK: "generated tokens (the evaluation's mark, train.eval_every_tokens)",
            "rollout/cumulative_trajectories": "cumulative trajectories"}


def measured_points(by_seed: dict, key: str, x_key: str | None,
                    confidence: float = CONFIDENCE) -> list[tuple[int, Interval, Interval]]:
    """One arm's measured points of ``key``: per logged step, the seeds' x and y as mean and t-interval.

    No point is interpolated: a step is a point when at least one seed logged ``key`` there (and ``x_key``,
    unless the x axis is the step itself), and its mean and interval are over the seeds that did. Against
    ``eval/token_mark`` a point is a mark instead of a step (seeds reach a mark at different steps).

    Args:
        by_seed: ``{seed: run}`` of one arm (``trace.reporting.report.collect_results``).
        key: the y step metric.
        x_key: the x step metric (``tokens/cumulative``, ...), or None for the training step.
        confidence: the intervals' coverage in (0, 1).

    Returns:
        ``(step, x, y)`` per measured step (mark) in order; ``x`` and ``y`` are ``Interval``s over the seeds
        (no bounds with one seed; ``x`` of the step axis is the step itself, of the mark axis the mark).
    """
    by_step: dict[int, list[tuple[float, float]]] = {}
    for res in by_seed.values():
        history = res["history"]
        xs_by_step = None if x_key is None else dict(history.get(x_key) or [])
        for step, value in history.get(key) or []:
            if xs_by_step is None:
                by_step.setdefault(int(step), []).append((float(step), float(value)))
            elif step in xs_by_step:
                point = int(xs_by_step[step]) if x_key == TOKEN_MARK else int(step)
                by_step.setdefault(point, []).append((float(xs_by_step[step]), float(value)))
    return [(step, mean_interval([x for x, _ in pts], confidence), mean_interval([y for _, y in pts], confidence))
            for step, pts in sorted(by_step.items())]


def plot_band(results: dict, key: str, ylabel: str, path: str | Path, x_key: str | None = None) -> None:
    """One PNG of ``key`` per arm: the mean over seeds at each measured step and its t-interval.

    Only measured points are drawn (``measured_points``): against the training step a line through every
    logged step with its band; against a step metric ``x_key`` (tokens, trajectories; logged at the
    evaluations only) a marker at each evaluation, the seeds' mean x and y with their intervals as error bars,
    joined by a straight line.

    Args:
        results: ``trace.reporting.report.collect_results`` output (``{arm: {seed: run}}``).
        key: the plotted step metric (one of ``trace.reporting.report.STEP_KEYS``).
        ylabel: the y-axis label.
        path: the PNG written (110 dpi).
        x_key: the x-axis step metric, or None for the training step.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for abl, by_seed in results.items():
        points = measured_points(by_seed, key, x_key)
        if not points:
            continue
        xs = np.array([x.mean for _, x, _ in points])
        ys, low, high = (np.array([getattr(y, f) for _, _, y in points]) for f in ("mean", "low", "high"))
        if x_key is None:
            (line,) = ax.plot(xs, ys, lw=1.2, label=abl)
            if np.isfinite(low).any():
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.18, lw=0)
            continue
        yerr = np.nan_to_num(np.array([[y.mean - y.low, y.high - y.mean] for _, _, y in points]).T)
        xerr = np.nan_to_num(np.array([[x.mean - x.low, x.high - x.mean] for _, x, _ in points]).T)
        ax.errorbar(xs, ys, yerr=yerr, xerr=xerr, marker="o", ms=4, lw=1.2, capsize=2, elinewidth=0.8, label=abl)
    ax.set_xlabel(X_LABELS.get(x_key, x_key))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_audit(results: dict, path: str | Path, pass_k: int = 1) -> bool:
    """``audit.png``: per arm, forecast against realised mixed groups and flips per step (mean over steps,
    then over seeds, with the seeds' t-interval as error bars).

    Args:
        results: ``trace.reporting.report.collect_results`` output.
        path: the PNG written.
        pass_k: ``evaluate.pass_k`` (passed through to ``arm_statistics``).

    Returns:
        True when drawn; False (nothing written) when no train run logged the audit keys.
    """
    arms = {a: st["audit"] for a, st in arm_statistics(results, pass_k)["arms"].items() if st["audit"]}
    if not arms:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    names = list(arms)
    xs = np.arange(len(names))
    for ax, (forecast, realised, title) in zip(axes, ((AUDIT_KEYS[0], AUDIT_KEYS[1], "mixed groups per step"),
                                                      (AUDIT_KEYS[2], AUDIT_KEYS[3], "flips per step"))):
        for offset, key, label in ((-0.2, forecast, "forecast"), (0.2, realised, "realised")):
            ivs = [arms[a].get(key) for a in names]
            means = [iv.mean if iv else np.nan for iv in ivs]
            errs = [iv.half_width if iv and iv.has_interval else 0.0 for iv in ivs]
            ax.bar(xs + offset, means, width=0.4, yerr=errs, capsize=2, label=label)
        ax.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(results: dict, folder: str | Path, pass_k: int = 1) -> list[Path]:
    """Every plot of ``PLOTS`` into ``folder`` (which must exist), in the table's order, then ``SAMPLED_PLOTS``
    when a run logged ``accuracy/eval_sampled``, ``MARK_PLOTS`` when a run logged ``eval/token_mark``, ``probe_gain.png`` when a run logged ``probe/gain`` and ``audit.png`` when the audit keys exist (an older file of either is
    removed when they do not), and ``reliability.png`` when a run logged the truth audit's diagrams
    (``trace.predictor.reliability``; removed otherwise).

    Returns:
        The PNG paths written.
    """
    paths = []
    for name, (key, ylabel, x_key) in PLOTS.items():
        path = Path(folder) / name
        plot_band(results, key, ylabel, path, x_key=x_key)
        paths.append(path)
    has_sampled = any(res["history"].get(EVAL_SAMPLED_ACCURACY) for by_seed in results.values()
                      for res in by_seed.values())
    for name, (key, ylabel, x_key) in SAMPLED_PLOTS.items():
        path = Path(folder) / name
        if has_sampled:
            plot_band(results, key, ylabel, path, x_key=x_key)
            paths.append(path)
        else:
            path.unlink(missing_ok=True)
    has_marks = any(res["history"].get(TOKEN_MARK) for by_seed in results.values() for res in by_seed.values())
    for name, (key, ylabel, x_key) in MARK_PLOTS.items():
        path = Path(folder) / name
        if has_marks and (key != EVAL_SAMPLED_ACCURACY or has_sampled):
            plot_band(results, key, ylabel, path, x_key=x_key)
            paths.append(path)
        else:
            path.unlink(missing_ok=True)
    probe = Path(folder) / PROBE_PLOT[0]
    if any(res["history"].get(PROBE_PLOT[1]) for by_seed in results.values() for res in by_seed.values()):
        plot_band(results, PROBE_PLOT[1], PROBE_PLOT[2], probe)
        paths.append(probe)
    else:
        probe.unlink(missing_ok=True)
    audit = Path(folder) / AUDIT_PLOT
    if plot_audit(results, audit, pass_k):
        paths.append(audit)
    else:
        audit.unlink(missing_ok=True)
    reliability = Path(folder) / RELIABILITY_PLOT
    diagrams = {abl: {stage: pool_diagrams(history_diagram(res["history"], stage) for res in by_seed.values())
                      for stage in STAGES} for abl, by_seed in results.items()}
    diagrams = {abl: d for abl, d in diagrams.items() if any(d.values())}
    if diagrams:
        draw_reliability(diagrams, reliability, title="pooled over audits and seeds")
        paths.append(reliability)
    else:
        reliability.unlink(missing_ok=True)
    return paths
