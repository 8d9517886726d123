"""Stage ``report``: the ablation comparison over arms and training seeds, built from MLflow so the report and
the MLflow UI agree.

Writes ``reports/summary.md`` (a table ranking the ablations by the mean over seeds with 95 % t-intervals,
the paired differences against ``grpo`` called real or within noise (held-out greedy accuracy, and grpo's
gain over warmup, by a paired bootstrap over the held-out questions and seeds from the per-question results
in ``data/eval/``, ``trace.reporting.report_questions``), the generated tokens to reach
``grpo``'s final accuracy, the allocation audit when logged, and links to the MLflow UI: the arms' results
in the runs table, a view the stage stores on the experiment that lists every seed's evaluate run grouped by
arm, and the compare view of the runs),
``reports/metrics.json`` and PNG plots with bands over seeds: effective ratio, reward and generated tokens
per step, held-out accuracy against cumulative generated tokens and against cumulative trajectories, and
``audit.png`` when the train runs logged the audit (``trace.reporting.report``, ``trace.reporting.report_plots``). The numbers
per seed are the train runs' ``arm/*`` metrics (``trace.tracking.SUMMARY_METRIC_NAMES``) and the evaluate
runs' held-out accuracies, the same values the MLflow compare view of the ``evaluate-*`` runs shows.
"""

from __future__ import annotations

import json

from prefect import flow

from flows.common import stage_main, METRICS, REPORTS, eval_path, open_run, run_config, stage_params, write_json
from flows.warmup import WARMUP_EVAL


def collect(cfg) -> dict:
    """``trace.reporting.report.collect_results`` for the config's arms, training seeds and tracking section: each
    seed's runs by the hashes of its run config (``run_config``)."""
    from trace.reporting.report import collect_results

    hashes = {}
    for seed in cfg.train.run_seeds(cfg.seed):
        run_cfg = run_config(cfg, seed)
        hashes[seed] = (run_cfg.resume_hash(), run_cfg.params_hash())
    return collect_results(cfg.tracking.tracking_uri, cfg.tracking.experiment_name,
                           list(cfg.train.ablations), hashes)


@flow(name="report", log_prints=False)
def report_flow(params: str) -> dict:
    from mlflow.tracking import MlflowClient

    from trace.configuration.params_file import load_config
    from trace.reporting.report import arm_statistics, evaluate_run_ids, first_runs, mlflow_links
    from trace.reporting.report_dvc import arm_summary, write_curves
    from trace.reporting.report_json import design, metrics_table
    from trace.reporting.report_markdown import render_markdown
    from trace.reporting.report_questions import attach_question_results
    from trace.reporting.report_plots import write_plots
    from trace.tracking.experiment import resolve_tracking_uri, run_artifacts_url, share_arms_view, ui_url

    cfg = load_config(params)
    results = collect(cfg)
    seeds = cfg.train.run_seeds(cfg.seed)
    missing = [f"{a}-{s}" for a in cfg.train.ablations for s in seeds if s not in results.get(a, {})]
    if missing:
        raise RuntimeError(f"no finished MLflow train run for (ablation-seed) {missing} with the params of "
                           f"{params}: run `dvc repro` (the train@ stages) first")
    REPORTS.mkdir(parents=True, exist_ok=True)
    warmup_path = METRICS / "warmup.json"
    warmup = json.loads(warmup_path.read_text()) if warmup_path.is_file() else {}
    results, warmup_questions = attach_question_results(results, eval_path, WARMUP_EVAL, warmup, cfg.evaluate.pass_k)
    plots = write_plots(results, REPORTS, cfg.evaluate.pass_k)
    client = MlflowClient(resolve_tracking_uri(cfg.tracking.tracking_uri))
    first, eval_ids = first_runs(results), evaluate_run_ids(results)
    # the arms' results: every seed's evaluate run, grouped by arm (the report's table is their mean)
    view_key = share_arms_view(client, next(iter(first.values()))["experiment_id"], eval_ids,
                               cfg.evaluate.pass_k) if first and eval_ids else None
    links = mlflow_links(results, ui_url(cfg.tracking.tracking_uri), view_key)
    curves = write_curves(results, REPORTS / "curves")  # dvc.yaml's plots
    stats = arm_statistics(results, cfg.evaluate.pass_k, warmup=warmup, warmup_questions=warmup_questions,
                           target_accuracy=cfg.report.target_accuracy)
    write_json(REPORTS / "arms.json", arm_summary(stats["arms"]))  # dvc.yaml's metrics: dvc exp show
    with open_run(cfg, "report", stage_params(cfg, "report")) as run:
        if links:
            links["report"] = run_artifacts_url(ui_url(cfg.tracking.tracking_uri), run.experiment_id, run.run_id)
        (REPORTS / "summary.md").write_text(render_markdown(results, warmup, cfg.evaluate.pass_k, links,
                                                            [p.name for p in plots],
                                                            num_eval=cfg.evaluate.num_prompts,
                                                            warmup_questions=warmup_questions,
                                                            margin=cfg.report.margin,
                                                            target_accuracy=cfg.report.target_accuracy))
        table = metrics_table(results, cfg.evaluate.pass_k, warmup=warmup, warmup_questions=warmup_questions,
                              margin=cfg.report.margin, target_accuracy=cfg.report.target_accuracy)
        write_json(REPORTS / "metrics.json", {"warmup": warmup, "ablations": table,
                                              "design": design(cfg.report.margin, cfg.evaluate.num_prompts,
                                                              cfg.evaluate.split)})
        # the report in the MLflow UI: summary.md renders as Markdown in the run's artifacts tab
        for path in (REPORTS / "summary.md", REPORTS / "metrics.json", REPORTS / "arms.json", *plots, *curves):
            run.log_artifact(path)
    print((REPORTS / "summary.md").read_text())
    return table


def main(argv=None) -> None:
    stage_main(report_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
