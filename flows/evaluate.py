"""Stage ``evaluate@<ablation>``: held-out accuracy of the trained policy (greedy, pass@k, by hop count)."""

from __future__ import annotations

from prefect import flow

from flows.common import EVAL, build_environment, load_stage_config, load_stage_policy, open_run, read_split, \
    run_dir, section_params, setup_process_env, stage_args, write_json


@flow(name="evaluate", log_prints=False)
def evaluate_flow(params: str, ablation: str) -> dict:
    from trace.config import load_config
    from trace.loop import evaluate_policy

    cfg = load_config(params)
    env = build_environment(cfg)
    evals = read_split("eval")[: cfg.evaluate.num_prompts]
    policy = load_stage_policy(cfg, run_dir(ablation) / "final")
    with open_run(cfg, "evaluate", section_params(cfg, "seed", "evaluate", "rollout"), ablation=ablation) as run:
        metrics, _ = evaluate_policy(policy, env, evals, cfg.rollout, seed=cfg.seed,
                                     max_context_tokens=cfg.policy.max_context_tokens, pass_k=cfg.evaluate.pass_k,
                                     temperature=cfg.evaluate.temperature)
        run.log_metrics(metrics)
        write_json(EVAL / f"{ablation}.json", {"ablation": ablation, **metrics})
    print({k: round(v, 4) for k, v in metrics.items()})
    return metrics


def main(argv=None) -> None:
    setup_process_env()
    args = stage_args(__doc__.splitlines()[0], ablation=True, argv=argv)
    load_stage_config(args)
    evaluate_flow(args.params, args.ablation)


if __name__ == "__main__":
    main()
