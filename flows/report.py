"""Stage ``report``: the ablation comparison, built from MLflow so the report and the MLflow UI agree.

Writes ``reports/summary.md`` (a table ranking the ablations, and links to the MLflow UI: the arms' results
in the runs table, a view the stage stores on the experiment, and the compare view of the arms), ``reports/metrics.json`` and PNG plots: effective ratio per step, reward per step,
generated tokens per step, and eval accuracy against cumulative generated tokens. The table's numbers are
the train runs' ``arm/*`` metrics (``trace.tracking.SUMMARY_METRIC_NAMES``) and the evaluate runs' held-out
accuracies, the same values the MLflow compare view of the ``evaluate-*`` runs shows.
"""

from __future__ import annotations

import json

from prefect import flow

from flows.common import stage_main, METRICS, REPORTS, write_json

STEP_KEYS = ("effective_ratio", "effective_token_ratio", "reward/mean", "tokens/generated", "accuracy/eval",
             "tokens/cumulative", "active_prompt_ratio", "predictor/brier")


def collect(cfg) -> dict:
    """Per ablation: the train run's metric histories and run-level results (``arm/*``), and the evaluate
    run's metrics, with both run ids and the experiment id."""
    from mlflow.tracking import MlflowClient

    from trace.tracking import finished_runs, resolve_tracking_uri

    client = MlflowClient(resolve_tracking_uri(cfg.tracking.tracking_uri))
    wanted = [a.value for a in cfg.train.ablations]
    out: dict = {}
    for run in finished_runs(cfg.tracking.tracking_uri, cfg.tracking.experiment_name, "train"):
        abl = run.data.tags.get("trace.ablation")
        if abl not in wanted or run.data.tags.get("trace.params_hash") != cfg.resume_hash():
            continue
        hist = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in STEP_KEYS}
        out[abl] = {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "history": hist,
                    "summary": {k: v for k, v in run.data.metrics.items() if k.startswith("arm/")}}
    for run in finished_runs(cfg.tracking.tracking_uri, cfg.tracking.experiment_name, "evaluate"):
        abl = run.data.tags.get("trace.ablation")
        if abl in out and run.data.tags.get("trace.params_hash") == cfg.params_hash():
            out[abl]["eval"] = {k: v for k, v in run.data.metrics.items() if not k.startswith("arm/")}
            out[abl]["eval_run_id"] = run.info.run_id
    return out


def mlflow_links(results: dict, base_url: str, view_key: str | None = None) -> dict[str, str]:
    """Links into the MLflow UI: the experiment's runs table (in the shared view ``view_key``, e.g. the arms'
    results of ``trace.tracking.share_arms_view``) and the compare view of the arms' evaluate runs (of their
    train runs where an arm has no evaluate run)."""
    from trace.tracking import compare_url, experiment_url

    if not results:
        return {}
    experiment_id = next(iter(results.values()))["experiment_id"]
    run_ids = [res.get("eval_run_id") or res["run_id"] for res in results.values()]
    return {"runs": experiment_url(base_url, experiment_id, view_key),
            "compare": compare_url(base_url, experiment_id, run_ids)}


def _plot(results: dict, key: str, ylabel: str, path, x_key: str | None = None) -> None:
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


def render_markdown(results: dict, warmup: dict, pass_k: int, links: dict[str, str] | None = None) -> str:
    """``reports/summary.md``: the arms ranked by held-out greedy accuracy, then the MLflow ``links``."""
    nan = float("nan")
    rows = []
    for abl, res in results.items():
        s, e = res["summary"], res.get("eval", {})
        rows.append((abl, e.get("accuracy/greedy", nan), e.get(f"accuracy/pass_at_{pass_k}", nan),
                     s.get("arm/eff_ratio", nan), s.get("arm/eff_tok_ratio", nan), s.get("arm/active_prompts", nan),
                     s.get("arm/reward", nan), s.get("arm/tokens", nan), s.get("arm/traj_step", nan),
                     s.get("arm/sec_step", nan)))
    rows.sort(key=lambda r: (-(r[1] if r[1] == r[1] else -1), -(r[3] if r[3] == r[3] else -1)))
    base = warmup.get("accuracy/greedy")
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
    lines += ["", "Plots: `effective_ratio.png`, `reward.png`, `tokens.png`, `accuracy_vs_tokens.png`.", ""]
    if links:
        lines += [f"MLflow (`make ui`): [the arms' results]({links['runs']}) (`arm/acc`, `arm/eff_ratio`, ...), "
                  f"[compare the arms]({links['compare']}).", ""]
    return "\n".join(lines)


@flow(name="report", log_prints=False)
def report_flow(params: str) -> dict:
    from mlflow.tracking import MlflowClient

    from trace.config import load_config
    from trace.tracking import resolve_tracking_uri, share_arms_view, ui_url

    cfg = load_config(params)
    results = collect(cfg)
    missing = [a.value for a in cfg.train.ablations if a.value not in results]
    if missing:
        raise RuntimeError(f"no finished MLflow train run for ablation(s) {missing} with params hash "
                           f"{cfg.params_hash()}: run `dvc repro` (the train@ stages) first")
    REPORTS.mkdir(parents=True, exist_ok=True)
    warmup_path = METRICS / "warmup.json"
    warmup = json.loads(warmup_path.read_text()) if warmup_path.is_file() else {}
    _plot(results, "effective_ratio", "effective ratio", REPORTS / "effective_ratio.png")
    _plot(results, "reward/mean", "mean train reward", REPORTS / "reward.png")
    _plot(results, "tokens/generated", "generated tokens per step", REPORTS / "tokens.png")
    _plot(results, "accuracy/eval", "held-out greedy accuracy", REPORTS / "accuracy_vs_tokens.png",
          x_key="tokens/cumulative")
    client = MlflowClient(resolve_tracking_uri(cfg.tracking.tracking_uri))
    view_key = share_arms_view(client, next(iter(results.values()))["experiment_id"], cfg.params_hash(),
                               cfg.evaluate.pass_k) if results else None
    links = mlflow_links(results, ui_url(cfg.tracking.tracking_uri), view_key)
    (REPORTS / "summary.md").write_text(render_markdown(results, warmup, cfg.evaluate.pass_k, links))
    table = {abl: {**res["summary"], **{f"eval/{k}": v for k, v in res.get("eval", {}).items()}}
             for abl, res in results.items()}
    write_json(REPORTS / "metrics.json", {"warmup": warmup, "ablations": table})
    print((REPORTS / "summary.md").read_text())
    return table


def main(argv=None) -> None:
    stage_main(report_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
