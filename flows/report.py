"""Stage ``report``: the ablation comparison, built from MLflow so the report and the MLflow UI agree.

Writes ``reports/summary.md`` (a table ranking the ablations, and links to the MLflow UI: the arms' results
in the runs table, a view the stage stores on the experiment, and the compare view of the arms),
``reports/metrics.json`` and PNG plots: effective ratio per step, reward per step, generated tokens per
step, and eval accuracy against cumulative generated tokens (``trace.report``). The table's numbers are
the train runs' ``arm/*`` metrics (``trace.tracking.SUMMARY_METRIC_NAMES``) and the evaluate runs' held-out
accuracies, the same values the MLflow compare view of the ``evaluate-*`` runs shows.
"""

from __future__ import annotations

import json

from prefect import flow

from flows.common import stage_main, METRICS, REPORTS, write_json


def collect(cfg) -> dict:
    """``trace.report.collect_results`` for the config's arms, tracking section and params hashes."""
    from trace.report import collect_results

    return collect_results(cfg.tracking.tracking_uri, cfg.tracking.experiment_name,
                           list(cfg.train.ablations), cfg.resume_hash(), cfg.params_hash())


@flow(name="report", log_prints=False)
def report_flow(params: str) -> dict:
    from mlflow.tracking import MlflowClient

    from trace.params_file import load_config
    from trace.report import metrics_table, mlflow_links, render_markdown, write_plots
    from trace.tracking.experiment import resolve_tracking_uri, share_arms_view, ui_url

    cfg = load_config(params)
    results = collect(cfg)
    missing = [a for a in cfg.train.ablations if a not in results]
    if missing:
        raise RuntimeError(f"no finished MLflow train run for ablation(s) {missing} with params hash "
                           f"{cfg.params_hash()}: run `dvc repro` (the train@ stages) first")
    REPORTS.mkdir(parents=True, exist_ok=True)
    warmup_path = METRICS / "warmup.json"
    warmup = json.loads(warmup_path.read_text()) if warmup_path.is_file() else {}
    write_plots(results, REPORTS)
    client = MlflowClient(resolve_tracking_uri(cfg.tracking.tracking_uri))
    view_key = share_arms_view(client, next(iter(results.values()))["experiment_id"], cfg.params_hash(),
                               cfg.evaluate.pass_k) if results else None
    links = mlflow_links(results, ui_url(cfg.tracking.tracking_uri), view_key)
    (REPORTS / "summary.md").write_text(render_markdown(results, warmup, cfg.evaluate.pass_k, links))
    table = metrics_table(results)
    write_json(REPORTS / "metrics.json", {"warmup": warmup, "ablations": table})
    print((REPORTS / "summary.md").read_text())
    return table


def main(argv=None) -> None:
    stage_main(report_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
