"""Stage ``seed_rollouts``: rollouts of the warmed-up policy, the predictor's warm-start data."""

from __future__ import annotations

from prefect import flow

from flows.common import stage_main, METRICS, SEED_TREES, WARMUP_MODEL, build_environment, load_stage_policy, \
    open_run, read_split, stage_params, write_json


@flow(name="seed_rollouts", log_prints=False)
def seed_rollouts_flow(params: str) -> dict:
    from trace.configuration.params_file import load_config
    from trace.metrics import rollout_metrics
    from trace.training.seed_rollouts import choose_seed_prompts, collect_seed_rollouts
    from trace.tree_io import write_trees

    cfg = load_config(params)
    env = build_environment(cfg)
    train = read_split("train")
    policy = load_stage_policy(cfg, WARMUP_MODEL)
    prompts = choose_seed_prompts(train, cfg.seed_rollouts.num_prompts, cfg.warmup_seed)
    with open_run(cfg, "seed_rollouts", stage_params(cfg, "seed_rollouts")) as run:
        trees = collect_seed_rollouts(policy, env, prompts, cfg)
        write_trees([t.copy_without_state() for t in trees], SEED_TREES / "trees.parquet")
        metrics = {f"seed/{k}": v for k, v in rollout_metrics(trees).items()}
        run.log_metrics(metrics)
        write_json(METRICS / "seed_rollouts.json", metrics)
    print({k: round(v, 4) for k, v in metrics.items()})
    return metrics


def main(argv=None) -> None:
    stage_main(seed_rollouts_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
