"""Stage ``evaluate@<ablation>``: held-out accuracy of the trained policy (greedy, pass@k, by hop count)."""

from __future__ import annotations

from prefect import flow

from flows.common import stage_main, EVAL, build_environment, load_stage_policy, open_run, read_split, \
    run_dir, section_params, write_json


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
    stage_main(evaluate_flow, __doc__.splitlines()[0], ablation=True, argv=argv)


if __name__ == "__main__":
    main()
