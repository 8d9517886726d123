"""Stage ``warmup``: build the policy and fine-tune it on solver demonstrations into a mixed-success band.

The tiny default policy is a Qwen3 model built from ``policy`` params with a word-level tokenizer over the
task's vocabulary; a pretrained policy (``policy.kind: pretrained``) is loaded as is and SFT is skipped
unless the task has a solver. The kept weights and the held-out accuracy after warmup are the baseline
every ablation's evaluation is compared with: ``metrics/warmup.json`` (DVC metrics) and
``data/eval/warmup.json`` (the held-out metrics and each question's greedy reward and sampled success by
``prompt_uid``, which the report pairs with the arms' evaluations question by question).
"""

from __future__ import annotations

from prefect import flow

from flows.common import stage_main, EVAL, METRICS, WARMUP_MODEL, build_environment, open_run, read_split, \
    stage_params, write_json

WARMUP_EVAL = EVAL / "warmup.json"  # the warmup policy's held-out evaluation with per-question results


@flow(name="warmup", log_prints=False)
def warmup_flow(params: str) -> dict:
    from trace.configuration.params_file import load_config
    from trace.envs.base import Demonstrates
    from trace.training.evaluation import evaluate_policy, question_rewards, sampled_question_rewards
    from trace.policy.build import build_policy
    from trace.policy.model import save_policy
    from trace.training.warmup import run_warmup
    from trace.tracking.names import QUESTIONS_KEY, SAMPLED_QUESTIONS_KEY, TRAIN_ACCURACY_PREFIX

    cfg = load_config(params)
    env = build_environment(cfg)
    train, evals = read_split("train"), read_split(cfg.evaluate.split)
    policy = build_policy(cfg.policy, env, cfg.warmup_seed, cfg.task.name.value)
    with open_run(cfg, "warmup", stage_params(cfg, "warmup")) as run:
        summary: dict = {"warmup/num_parameters": policy.num_parameters}
        if cfg.warmup.enabled and isinstance(env, Demonstrates):
            result = run_warmup(policy, env, train, cfg, log_metrics=lambda m, s: run.log_metrics(m, s))
            summary.update({"warmup/chosen_step": result.chosen_step, "warmup/chosen_success": result.chosen_success,
                            "warmup/demonstrations": result.num_demonstrations})
            if hasattr(env, "demonstration_stats"):  # grounded QA demonstrations: how often retrieval found support
                summary.update({f"warmup/{k}": v for k, v in env.demonstration_stats(train).items()})
            run.set_tags({"warmup.reason": result.reason})
            print(f"warmup kept step {result.chosen_step} (train success {result.chosen_success:.3f}): {result.reason}")
        held_out = evals[: cfg.evaluate.num_prompts]
        metrics, trees = evaluate_policy(policy, env, held_out, cfg.rollout, seed=cfg.seed,
                                         max_context_tokens=cfg.policy.max_context_tokens,
                                         pass_k=cfg.evaluate.pass_k, temperature=cfg.evaluate.temperature)
        summary.update(metrics)
        by_question = question_rewards(trees[: len(held_out)])  # the greedy trees come first, then the sampled
        sampled_by_question = sampled_question_rewards(trees[len(held_out):])
        train_metrics, _ = evaluate_policy(policy, env, train[: cfg.evaluate.num_prompts], cfg.rollout, seed=cfg.seed,
                                           max_context_tokens=cfg.policy.max_context_tokens,
                                           prefix=TRAIN_ACCURACY_PREFIX)  # memorisation: train vs held-out
        summary.update(train_metrics)
        run.log_metrics(summary)
        save_policy(policy, WARMUP_MODEL)
        write_json(METRICS / "warmup.json", summary)
        write_json(WARMUP_EVAL, {**metrics, QUESTIONS_KEY: by_question, SAMPLED_QUESTIONS_KEY: sampled_by_question})
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    return summary


def main(argv=None) -> None:
    stage_main(warmup_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
