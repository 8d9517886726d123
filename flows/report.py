"""Stage ``report``: the ablation comparison, built from MLflow so the report and the MLflow UI agree.

Writes ``reports/summary.md`` (a table ranking the ablations), ``reports/metrics.json`` and PNG plots:
effective ratio per step, reward per step, generated tokens per step, and eval accuracy against cumulative
generated tokens.
"""

from __future__ import annotations

import json

from prefect import flow

from flows.common import stage_main, DATA, REPORTS, write_json

STEP_KEYS = ("effective_ratio", "effective_token_ratio", "reward/mean", "tokens/generated", "accuracy/eval",
             "tokens/cumulative", "active_prompt_ratio", "predictor/brier")


def collect(cfg) -> dict:
    """Per ablation: the train run's metric histories and summary, and the evaluate run's metrics."""
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
        out[abl] = {"run_id": run.info.run_id, "history": hist,
                    "summary": {k[len("summary/"):]: v for k, v in run.data.metrics.items() if k.startswith("summary/")}}
    for run in finished_runs(cfg.tracking.tracking_uri, cfg.tracking.experiment_name, "evaluate"):
        abl = run.data.tags.get("trace.ablation")
        if abl in out and run.data.tags.get("trace.params_hash") == cfg.params_hash():
            out[abl]["eval"] = dict(run.data.metrics)
    return out


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


def render_markdown(results: dict, warmup: dict, pass_k: int) -> str:
    rows = []
    for abl, res in results.items():
        s, e = res["summary"], res.get("eval", {})
        rows.append((abl, e.get("accuracy/greedy", float("nan")), e.get(f"accuracy/pass_at_{pass_k}", float("nan")),
                     s.get("mean/effective_ratio", float("nan")), s.get("mean/effective_token_ratio", float("nan")),
                     s.get("mean/active_prompt_ratio", float("nan")), s.get("mean/reward/mean", float("nan")),
                     s.get("tokens/cumulative", float("nan")), s.get("mean/rollout/trajectories", float("nan")),
                     s.get("mean/time/step", float("nan"))))
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
    return "\n".join(lines)


@flow(name="report", log_prints=False)
def report_flow(params: str) -> dict:
    from trace.config import load_config

    cfg = load_config(params)
    results = collect(cfg)
    missing = [a.value for a in cfg.train.ablations if a.value not in results]
    if missing:
        raise RuntimeError(f"no finished MLflow train run for ablation(s) {missing} with params hash "
                           f"{cfg.params_hash()}: run `dvc repro` (the train@ stages) first")
    REPORTS.mkdir(parents=True, exist_ok=True)
    warmup_path = DATA / "metrics" / "warmup.json"
    warmup = json.loads(warmup_path.read_text()) if warmup_path.is_file() else {}
    _plot(results, "effective_ratio", "effective ratio", REPORTS / "effective_ratio.png")
    _plot(results, "reward/mean", "mean train reward", REPORTS / "reward.png")
    _plot(results, "tokens/generated", "generated tokens per step", REPORTS / "tokens.png")
    _plot(results, "accuracy/eval", "held-out greedy accuracy", REPORTS / "accuracy_vs_tokens.png",
          x_key="tokens/cumulative")
    (REPORTS / "summary.md").write_text(render_markdown(results, warmup, cfg.evaluate.pass_k))
    table = {abl: {**res["summary"], **{f"eval/{k}": v for k, v in res.get("eval", {}).items()}}
             for abl, res in results.items()}
    write_json(REPORTS / "metrics.json", {"warmup": warmup, "ablations": table})
    print((REPORTS / "summary.md").read_text())
    return table


def main(argv=None) -> None:
    stage_main(report_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
