"""The ablation report, read from MLflow so the report and the MLflow UI agree.

``collect_results`` reads, per arm, the newest finished train run (its per-step metric histories and its
run-level ``arm/*`` results, named by ``trace.tracking.names.SUMMARY_METRIC_NAMES``) and evaluate run (its
held-out metrics). ``render_markdown`` ranks the arms by held-out greedy accuracy (ties: effective ratio);
``write_plots`` draws the per-step curves and accuracy against cumulative generated tokens; ``mlflow_links``
points at the same runs in the MLflow UI. The same MLflow data gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from trace.tracking.experiment import compare_url, experiment_url, resolve_tracking_uri
from trace.tracking.names import GREEDY_ACCURACY, SUMMARY_METRIC_NAMES, metric_key, pass_at_k_name
from trace.tracking.runs import finished_runs

# per-step metrics of a train run read for the plots
STEP_KEYS = ("effective_ratio", "effective_token_ratio", "reward/mean", "tokens/generated", "accuracy/eval",
             "tokens/cumulative", "active_prompt_ratio", "predictor/brier")
# summary.md columns after the two held-out accuracies: the training-summary keys whose run-level metric
# (``SUMMARY_METRIC_NAMES``) each shows
TABLE_SUMMARY_KEYS = ("mean/effective_ratio", "mean/effective_token_ratio", "mean/active_prompt_ratio",
                      "mean/reward/mean", "tokens/cumulative", "mean/rollout/trajectories", "mean/time/step")
# plot file -> (step metric, y label, x metric or None for the training step)
PLOTS: dict[str, tuple[str, str, str | None]] = {
    "effective_ratio.png": ("effective_ratio", "effective ratio", None),
    "reward.png": ("reward/mean", "mean train reward", None),
    "tokens.png": ("tokens/generated", "generated tokens per step", None),
    "accuracy_vs_tokens.png": ("accuracy/eval", "held-out greedy accuracy", "tokens/cumulative"),
}


def collect_results(tracking_uri: str | None, experiment_name: str, ablations: Sequence[str],
                    train_params_hash: str, eval_params_hash: str) -> dict:
    """Per arm: the train run's metric histories and run-level results (``arm/*``), and the evaluate run's
    metrics, with both run ids and the experiment id.

    Args:
        tracking_uri: MLflow URI or None (``trace.tracking.experiment.resolve_tracking_uri``).
        experiment_name: the MLflow experiment.
        ablations: the arms to report (``train.ablations`` values); other arms' runs are ignored.
        train_params_hash: ``trace.run_key`` params hash of the train runs (the config's resume hash).
        eval_params_hash: params hash of the evaluate runs (the config's params hash).

    Returns:
        ``{ablation: {"run_id", "experiment_id", "history": {key: [(step, value), ...]}, "summary": {arm/*},
        "eval": {...}, "eval_run_id"}}`` in the order the train runs are found; ``eval`` and
        ``eval_run_id`` only where an evaluate run exists.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    wanted = list(ablations)
    out: dict = {}
    for run in finished_runs(tracking_uri, experiment_name, "train"):
        abl = run.data.tags.get("trace.ablation")
        if abl not in wanted or run.data.tags.get("trace.params_hash") != train_params_hash:
            continue
        hist = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in STEP_KEYS}
        out[abl] = {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "history": hist,
                    "summary": {k: v for k, v in run.data.metrics.items() if k.startswith("arm/")}}
    for run in finished_runs(tracking_uri, experiment_name, "evaluate"):
        abl = run.data.tags.get("trace.ablation")
        if abl in out and run.data.tags.get("trace.params_hash") == eval_params_hash:
            out[abl]["eval"] = {k: v for k, v in run.data.metrics.items() if not k.startswith("arm/")}
            out[abl]["eval_run_id"] = run.info.run_id
    return out


def mlflow_links(results: dict, base_url: str, view_key: str | None = None) -> dict[str, str]:
    """Links into the MLflow UI: the experiment's runs table (in the shared view ``view_key``, e.g. the arms'
    results of ``trace.tracking.experiment.share_arms_view``) and the compare view of the arms' evaluate
    runs (of their train runs where an arm has no evaluate run).

    Args:
        results: ``collect_results`` output.
        base_url: the MLflow UI (``trace.tracking.experiment.ui_url``).
        view_key: a shared runs-table view of the experiment, or None.

    Returns:
        ``{"runs": url, "compare": url}``; empty without results.
    """
    if not results:
        return {}
    experiment_id = next(iter(results.values()))["experiment_id"]
    run_ids = [res.get("eval_run_id") or res["run_id"] for res in results.values()]
    return {"runs": experiment_url(base_url, experiment_id, view_key),
            "compare": compare_url(base_url, experiment_id, run_ids)}


def plot_history(results: dict, key: str, ylabel: str, path: str | Path, x_key: str | None = None) -> None:
    """One PNG of step metric ``key`` per arm: against the training step, or against step metric ``x_key``
    (points at the steps that logged both).

    Args:
        results: ``collect_results`` output.
        key: the plotted step metric (one of ``STEP_KEYS``).
        ylabel: the y-axis label.
        path: the PNG written (110 dpi).
        x_key: the x-axis step metric, or None for the training step.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for abl, res in results.items():
        ys = res["history"].get(key) or []
        if not ys:
            continue
        if x_key:
            xs_by_step = dict(res["history"].get(x_key) or [])
            pts = [(xs_by_step[s], v) for s, v in ys if s in xs_by_step]
            if not pts:
                continue
            ax.plot(*zip(*pts), marker="o", ms=3, label=abl)
        else:
            ax.plot(*zip(*ys), label=abl, lw=1.2)
    ax.set_xlabel("cumulative generated tokens" if x_key else "training step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: dict, folder: str | Path) -> list[Path]:
    """Every plot of ``PLOTS`` into ``folder`` (which must exist), in the table's order.

    Returns:
        The PNG paths written.
    """
    paths = []
    for name, (key, ylabel, x_key) in PLOTS.items():
        path = Path(folder) / name
        plot_history(results, key, ylabel, path, x_key=x_key)
        paths.append(path)
    return paths


def render_markdown(results: dict, warmup: dict, pass_k: int, links: dict[str, str] | None = None) -> str:
    """``reports/summary.md``: the arms ranked by held-out greedy accuracy, then the MLflow ``links``.

    Args:
        results: ``collect_results`` output.
        warmup: the warmup stage's metrics (``accuracy/greedy`` is the baseline shown), or ``{}``.
        pass_k: ``evaluate.pass_k``; the pass@k column reads the evaluate run's ``accuracy/pass_at_<k>``.
        links: ``mlflow_links`` output, or None to leave the links out.

    Returns:
        The markdown text; a missing value shows as ``nan``.
    """
    nan = float("nan")
    pass_key = metric_key(pass_at_k_name(pass_k))
    summary_names = [SUMMARY_METRIC_NAMES[k] for k in TABLE_SUMMARY_KEYS]
    rows = []
    for abl, res in results.items():
        s, e = res["summary"], res.get("eval", {})
        rows.append((abl, e.get(GREEDY_ACCURACY, nan), e.get(pass_key, nan), *(s.get(n, nan) for n in summary_names)))
    rows.sort(key=lambda r: (-(r[1] if r[1] == r[1] else -1), -(r[3] if r[3] == r[3] else -1)))
    base = warmup.get(GREEDY_ACCURACY)
    lines = ["# Ablation report", "",
             f"Held-out greedy accuracy after warmup: **{base:.3f}**" if base is not None else "",
             "", "Ranked by held-out greedy accuracy after RL (ties: effective ratio). Means are over training steps;",
             "every arm samples the same number of trajectories per step.", "",
             f"| rank | ablation | eval greedy | eval pass@{pass_k} | effective ratio | effective token ratio | "
             "active prompts | train reward | generated tokens | trajectories/step | s/step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} | "
                     f"{r[7]:,.0f} | {r[8]:.0f} | {r[9]:.2f} |")
    lines += ["", "Plots: " + ", ".join(f"`{name}`" for name in PLOTS) + ".", ""]
    if links:
        lines += [f"MLflow (`make ui`): [the arms' results]({links['runs']}) (`arm/acc`, `arm/eff_ratio`, ...), "
                  f"[compare the arms]({links['compare']}).", ""]
    return "\n".join(lines)


def metrics_table(results: dict) -> dict[str, dict[str, float]]:
    """``reports/metrics.json``'s ablations: per arm its ``arm/*`` results and its evaluate metrics under
    ``eval/``."""
    return {abl: {**res["summary"], **{f"eval/{k}": v for k, v in res.get("eval", {}).items()}}
            for abl, res in results.items()}
