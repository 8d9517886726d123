"""Stage ``evaluate@<ablation>-<seed>``: held-out accuracy of the trained policy (greedy, pass@k, by hop count).

Also the greedy accuracy on as many training questions (``accuracy_train/*``): far above the held-out one
means the policy memorised questions instead of learning the task.

One run per arm and training seed (``--seed``, default the global seed), sampling with that seed
(``run_config``). ``data/eval/<ablation>/s<seed>.json`` holds the held-out metrics and each held-out
question's greedy reward and sampled success (mean reward of its ``evaluate.pass_k`` sampled rollouts) by
``prompt_uid`` (``greedy_by_question``, ``sampled_by_question``: the report pairs the arms and the warmup
question by question, for greedy accuracy and for avg@k). Besides it the stage writes the DVC metrics file
``metrics/ablations/<ablation>/s<seed>.json``:
the held-out accuracies and the training summary (means over steps of effective ratio, reward, ...; wall
times left out, they differ between identical runs), which ``dvc exp show`` and ``dvc metrics diff``
compare across experiments.
"""

from __future__ import annotations

from prefect import flow

import json

from flows.common import stage_main, METRICS, build_environment, eval_path, load_stage_policy, open_run, \
    read_split, run_config, run_dir, stage_params, write_json


def arm_metrics(eval_metrics: dict, train_summary: dict) -> dict:
    """The arm's DVC metrics: held-out accuracies and the training summary, without wall times."""
    merged = {**{k: v for k, v in train_summary.items() if k not in ("ablation", "seed")}, **eval_metrics}
    return {k: v for k, v in sorted(merged.items()) if "time/" not in k}


@flow(name="evaluate", log_prints=False)
def evaluate_flow(params: str, ablation: str, seed: int | None = None) -> dict:
    from trace.configuration.params_file import load_config
    from trace.training.evaluation import evaluate_policy, question_rewards, sampled_question_rewards
    from trace.tracking import arm_result_metrics
    from trace.tracking.names import QUESTIONS_KEY, SAMPLED_QUESTIONS_KEY, TRAIN_ACCURACY_PREFIX

    base = load_config(params)
    env = build_environment(base)  # the task as prepared: built from the global seed
    cfg = run_config(base, base.seed if seed is None else seed)
    out_dir = run_dir(ablation, cfg.seed)
    evals = read_split(cfg.evaluate.split)[: cfg.evaluate.num_prompts]
    policy = load_stage_policy(cfg, out_dir / "final")
    with open_run(cfg, "evaluate", stage_params(cfg, "evaluate"), ablation=ablation) as run:
        metrics, trees = evaluate_policy(policy, env, evals, cfg.rollout, seed=cfg.seed,
                                         max_context_tokens=cfg.policy.max_context_tokens,
                                         pass_k=cfg.evaluate.pass_k, temperature=cfg.evaluate.temperature)
        by_question = question_rewards(trees[: len(evals)])  # the greedy trees come first, then the sampled
        sampled_by_question = sampled_question_rewards(trees[len(evals):])
        train_metrics, _ = evaluate_policy(policy, env, read_split("train")[: cfg.evaluate.num_prompts], cfg.rollout,
                                           seed=cfg.seed, max_context_tokens=cfg.policy.max_context_tokens,
                                           prefix=TRAIN_ACCURACY_PREFIX)  # memorisation: train vs held-out
        metrics.update(train_metrics)
        summary = json.loads((out_dir / "summary.json").read_text())
        # the arm's results (arm/*) first: MLflow's compare view starts with a run's first metric
        run.log_metrics({**arm_result_metrics(metrics, summary, cfg.evaluate.pass_k), **metrics})
        write_json(eval_path(ablation, cfg.seed), {"ablation": ablation, "seed": cfg.seed, **metrics,
                                                   QUESTIONS_KEY: by_question,
                                                   SAMPLED_QUESTIONS_KEY: sampled_by_question})
        write_json(METRICS / "ablations" / ablation / f"s{cfg.seed}.json", arm_metrics(metrics, summary))
    print({k: round(v, 4) for k, v in metrics.items()})
    return metrics


def main(argv=None) -> None:
    stage_main(evaluate_flow, __doc__.splitlines()[0], ablation=True, argv=argv)


if __name__ == "__main__":
    main()
