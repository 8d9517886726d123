"""Stage ``fit_predictor``: warm-start the success-probability predictor on the seed rollouts.

Before the final fit on every seed tree, it is fitted on 80 % of the prompts and scored on the other 20 %
(Brier, ECE, AUC, log loss): its honest out-of-sample quality at the start of training.
"""

from __future__ import annotations

from prefect import flow

from flows.common import stage_main, METRICS, PREDICTOR, SEED_TREES, WARMUP_MODEL, build_environment, load_stage_policy, open_run, stage_params, write_json


def make_stage_predictor(cfg, env, policy):
    from trace.predictor import make_predictor

    return make_predictor(cfg.predictor, env=env, policy=policy, seed=cfg.seed)


@flow(name="fit_predictor", log_prints=False)
def fit_predictor_flow(params: str) -> dict:
    import zlib

    from trace.config import load_config
    from trace.tree_io import read_trees

    cfg = load_config(params)
    env = build_environment(cfg)
    policy = load_stage_policy(cfg, WARMUP_MODEL)
    trees = read_trees(SEED_TREES / "trees.parquet")
    held = [t for t in trees if zlib.crc32(t.prompt_uid.encode()) % 5 == 0]
    fit = [t for t in trees if zlib.crc32(t.prompt_uid.encode()) % 5 != 0]
    with open_run(cfg, "fit_predictor", stage_params(cfg, "fit_predictor")) as run:
        metrics: dict = {}
        if held and fit:
            probe = make_stage_predictor(cfg, env, policy)
            probe.fit(fit)
            metrics.update({f"{k}_heldout": v for k, v in probe.evaluate(held).items()})
        predictor = make_stage_predictor(cfg, env, policy)
        metrics.update({k: v for k, v in predictor.fit(trees).items() if isinstance(v, (int, float))})
        predictor.save(PREDICTOR / "predictor.pt")
        run.log_metrics(metrics)
        write_json(METRICS / "fit_predictor.json", metrics)
    print({k: round(v, 4) for k, v in metrics.items()})
    return metrics


def main(argv=None) -> None:
    stage_main(fit_predictor_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
