"""Stage ``fit_predictor``: warm-start the success-probability predictor on the seed rollouts.

Before the final fit on every seed tree, it is fitted on 80 % of the prompts and scored on the other 20 %
(Brier, ECE, AUC, log loss): its honest out-of-sample quality at the start of training
(``trace.predictor.fitting.fit_with_holdout``).
"""

from __future__ import annotations

from prefect import flow

from flows.common import stage_main, METRICS, PREDICTOR, SEED_TREES, WARMUP_MODEL, build_environment, load_stage_policy, open_run, stage_params, write_json


@flow(name="fit_predictor", log_prints=False)
def fit_predictor_flow(params: str) -> dict:
    from trace.configuration.params_file import load_config
    from trace.predictor.fitting import fit_with_holdout
    from trace.tree_io import read_trees

    cfg = load_config(params)
    env = build_environment(cfg)
    policy = load_stage_policy(cfg, WARMUP_MODEL)
    trees = read_trees(SEED_TREES / "trees.parquet")
    with open_run(cfg, "fit_predictor", stage_params(cfg, "fit_predictor")) as run:
        predictor, metrics = fit_with_holdout(cfg.predictor, trees, env=env, policy=policy, seed=cfg.warmup_seed)
        predictor.save(PREDICTOR / "predictor.pt")
        run.log_metrics(metrics)
        write_json(METRICS / "fit_predictor.json", metrics)
    print({k: round(v, 4) for k, v in metrics.items()})
    return metrics


def main(argv=None) -> None:
    stage_main(fit_predictor_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
