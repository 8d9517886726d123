"""Stage ``train@<ablation>``: RL steps of one arm, resumable; chunks of steps run as Prefect tasks.

A Prefect task costs ~0.15 s on a local server against ~1-2 s for a default step, so each task runs
``train.steps_per_task`` steps; the share of a step spent outside model compute is measured by the
orchestration benchmark. A killed run restarted with the same command resumes from its last checkpoint.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.common import stage_main, PREDICTOR, WARMUP_MODEL, build_environment, load_stage_policy, open_run, read_split, run_dir, section_params, write_json

TRAIN_SECTIONS = ("seed", "task", "policy", "rollout", "predictor", "allocation", "advantages", "update", "train")


@task(name="train-steps", cache_policy=NONE)
def train_steps(trainer, until_step: int) -> int:
    trainer.run(until_step=until_step)
    return trainer.next_step


@flow(name="train", log_prints=False)
def train_flow(params: str, ablation: str) -> dict:
    from trace.config import load_config
    from trace.loop import Trainer
    from trace.policy.model import save_policy
    from trace.predictor import load_predictor

    cfg = load_config(params)
    env = build_environment(cfg)
    train, evals = read_split("train"), read_split("eval")
    policy = load_stage_policy(cfg, WARMUP_MODEL)
    predictor = load_predictor(PREDICTOR / "predictor.pt", cfg.predictor, env=env, policy=policy, seed=cfg.seed)
    out_dir = run_dir(ablation)
    with open_run(cfg, "train", section_params(cfg, *TRAIN_SECTIONS), ablation=ablation, resume=True) as run:
        trainer = Trainer(cfg, ablation, policy=policy, env=env, train_prompts=train, eval_prompts=evals,
                          predictor=predictor, run_dir=out_dir, log_metrics=lambda m, s: run.log_metrics(m, s))
        start = trainer.resume()
        if start:
            print(f"resuming {ablation} at step {start}")
        step = start
        while step < cfg.train.num_steps:
            step = train_steps(trainer, min(step + cfg.train.steps_per_task, cfg.train.num_steps))
        policy.model.load_state_dict(trainer.updater.policy_state_dict())
        save_policy(policy, out_dir / "final")
        summary = trainer.summary()
        run.log_metrics({f"summary/{k}": v for k, v in summary.items()})
        write_json(out_dir / "summary.json", {"ablation": ablation, **summary})
    print({k: round(v, 4) for k, v in summary.items()})
    return summary


def main(argv=None) -> None:
    stage_main(train_flow, __doc__.splitlines()[0], ablation=True, argv=argv)


if __name__ == "__main__":
    main()
