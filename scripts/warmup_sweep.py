"""Which warmup RL learns from: grpo's gain from SFT checkpoints of one warmup, and what each measures first.

One warmup SFT (``trace.training.warmup.run_warmup``, the params' seed, batches and measurements; the band is
switched off so it runs to the last requested step) saves the policy at each requested step. Each checkpoint
is then measured, on the prompts the pipeline uses (``data/prepared``: run ``dvc repro prepare`` first):

- ``sampled_success``: the warmup's own measure (one sampled rollout on each of the first
  ``warmup.eval_prompts`` training prompts), the number the band ``[target_low, target_high]`` reads;
- ``held_out``: greedy accuracy on the first ``evaluate.num_prompts`` held-out questions;
- ``p_right_ambiguous`` / ``p_right_plain`` (kgqa only): the mean probability of the right entity at
  ambiguous and plain turns, teacher-forced on the right path (``scripts.kgqa_decisions``);

and ``grpo`` trains ``--rl-steps`` steps from it at training seed ``--seed`` (``trace.training.loop.Trainer``,
the params' ``rollout``, ``allocation``, ``update``), after which held-out greedy is measured again on the
same questions. ``gain`` is the difference, and ``gain_se`` its paired standard error over the questions
(the evaluation's sampling error only: one seed says nothing of the spread between training runs).

Resumable: checkpoints and finished rows are kept in ``--out`` and skipped when run again; a killed RL run
continues from its last checkpoint. ``--out`` belongs to one config: ``<out>/config.json`` records the params'
hash, and a run with other params into the same folder is refused. The prepared prompts must be those of
the params (checked against what the task gives for them).

Usage:
    python -m scripts.warmup_sweep --steps 700 900 1000 1100 1300 [--rl-steps 50] [--seed 0]
        [--params params.yaml] [--out data/warmup_sweep]
Writes ``<out>/sweep.json`` and prints its table (markdown).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path
from typing import Sequence

import numpy as np

from flows.common import write_json


def paired_gain(after: dict[str, float], before: dict[str, float]) -> tuple[float, float]:
    """Mean per-question difference ``after - before`` and its standard error.

    Args:
        after, before: ``{prompt_uid: reward}`` of the same questions (``question_rewards``).

    Returns:
        ``(mean, standard error)``: the mean of the Q differences and their standard deviation (ddof 1)
        over ``sqrt(Q)``.

    Raises:
        ValueError: the two evaluations are of different questions, or of fewer than 2.
    """
    if set(after) != set(before) or len(after) < 2:
        raise ValueError(f"paired gain needs the same >= 2 questions on both sides ({len(after)} vs {len(before)})")
    diff = np.array([after[uid] - before[uid] for uid in before], dtype=np.float64)
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(len(diff)))


def markdown_table(rows: Sequence[dict]) -> str:
    """The sweep as a markdown table, one row per checkpoint (in SFT step order)."""
    head = ("| SFT step | sampled success | held-out greedy | P(right), ambiguous turns | P(right), plain turns "
            "| `grpo` held-out after | gain (paired SE) |\n|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in sorted(rows, key=lambda r: r["sft_step"]):
        amb = f"{r['p_right_ambiguous']:.3f}" if r.get("p_right_ambiguous") is not None else "-"
        plain = f"{r['p_right_plain']:.3f}" if r.get("p_right_plain") is not None else "-"
        lines.append(f"| {r['sft_step']:,} | {r['sampled_success']:.3f} | {r['held_out']:.3f} | {amb} | {plain} "
                     f"| {r['held_out_after']:.3f} | {r['gain']:+.3f} ({r['gain_se']:.3f}) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", required=True,
                        help="SFT steps to keep, multiples of warmup.eval_every")
    parser.add_argument("--rl-steps", type=int, default=50, help="grpo steps from each checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="training seed of the grpo runs")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="data/warmup_sweep")
    args = parser.parse_args(argv)

    from flows.common import build_environment, read_split, run_config, setup_process_env
    from trace.configuration.params_file import load_config
    from trace.configuration.config import ConfigError

    setup_process_env()
    cfg = load_config(args.params)
    every = cfg.warmup.eval_every
    bad = [s for s in args.steps if s <= 0 or s % every]
    if bad:
        near = sorted({every * max(1, round(s / every)) for s in args.steps})
        raise ConfigError(f"--steps {bad}: each step must be a positive multiple of warmup.eval_every={every} "
                          f"(the warmup measures and can keep weights only there), e.g. --steps "
                          f"{' '.join(map(str, near))}")
    if args.rl_steps < 1:
        raise ConfigError(f"--rl-steps {args.rl_steps}: grpo needs at least 1 step from each checkpoint (e.g. 50)")
    steps = sorted(set(args.steps))
    out = Path(args.out)
    env = build_environment(cfg)
    train, evals = read_split("train"), read_split("eval")
    check_prepared(cfg, env, {"train": train, "eval": evals}, args.params)
    claim_folder(out, cfg.params_hash(), args.params)
    held_out = evals[: cfg.evaluate.num_prompts]
    history = _checkpoints(cfg, env, train, steps, out)
    rows = []
    for step in steps:
        done = out / f"row-{step}-grpo-s{args.seed}-{args.rl_steps}.json"
        if not done.exists():
            row = _measure(run_config(cfg, args.seed), env, train, evals, held_out, out, step, args.rl_steps)
            row["sampled_success"] = history[step]
            write_json(done, row)
        rows.append(json.loads(done.read_text()))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    write_json(out / "sweep.json", {"commit": commit, "params": args.params, "seed": args.seed, "rl_steps": args.rl_steps,
                                      "held_out_questions": len(held_out),
                                      "warmup_success_history": [[s, v] for s, v in sorted(history.items())],
                                      "rows": rows})
    print(markdown_table(rows))
    return rows


def check_prepared(cfg, env, prepared: dict, params: str) -> None:
    """Refuse prepared prompts that are not the ones the task gives for these params.

    Args:
        cfg: the config; env: its environment.
        prepared: ``{"train": [...], "eval": [...]}`` as read from ``data/prepared``.
        params: the params file's name, for the message.

    Raises:
        DataError: a split differs in size or in a prompt's uid or answer; the message says how to prepare.
    """
    from flows.prepare import task_prompts
    from trace.data_paths import DataError

    for split, prompts in prepared.items():
        expected = task_prompts(cfg, env, split)
        same = len(expected) == len(prompts) and all(
            (a.prompt_uid, a.answer) == (b.prompt_uid, b.answer) for a, b in zip(expected, prompts))
        if not same:
            raise DataError(f"data/prepared/{split}.jsonl holds other prompts than {params} gives "
                            f"({len(prompts)} prepared, {len(expected)} from the params): it was prepared with other "
                            f"params. Run the sweep with the params it was prepared with, or prepare these: copy "
                            f"{params} to params.yaml and run dvc repro prepare")


def claim_folder(out: Path, params_hash: str, params: str) -> None:
    """Make ``out`` this config's folder, or refuse one that holds another config's checkpoints and rows.

    Raises:
        ConfigError: ``out`` is a file, or its ``config.json`` names another params hash.
    """
    from trace.configuration.config import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder (it holds the checkpoints and rows)")
    record = out / "config.json"
    if record.exists():
        earlier = json.loads(record.read_text())
        if earlier.get("params_hash") != params_hash:
            raise ConfigError(f"--out {out} holds a sweep of other params ({earlier.get('params')}, hash "
                              f"{earlier.get('params_hash')}); its checkpoints and rows are not this config's. "
                              f"Give another --out, or delete {out} to start over with {params}")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(record, {"params": params, "params_hash": params_hash})


def _checkpoints(cfg, env, train, steps: list[int], out: Path) -> dict[int, float]:
    """Run the warmup once to the last step, saving the policy at each of ``steps``; returns the sampled
    success at every measurement (from ``<out>/warmup.json`` when every checkpoint is there already)."""
    from trace.policy.build import build_policy
    from trace.policy.model import save_policy
    from trace.training.warmup import run_warmup

    record = out / "warmup.json"
    if record.exists() and all((out / f"step-{s}").is_dir() for s in steps):
        return {int(s): v for s, v in json.loads(record.read_text())["history"]}
    wcfg = cfg.warmup.model_copy(update={"max_steps": steps[-1], "target_low": 1.0, "target_high": 1.0})
    policy = build_policy(cfg.policy, env, cfg.seed, cfg.task.name.value)

    def keep(step: int, success: float) -> None:
        if step in steps:
            save_policy(policy, out / f"step-{step}")
            print(f"SFT step {step}: sampled success {success:.3f}, saved", flush=True)

    result = run_warmup(policy, env, train, cfg.model_copy(update={"warmup": wcfg}), on_measure=keep)
    write_json(record, {"history": result.history})
    return dict(result.history)


def _measure(cfg, env, train, evals, held_out, out: Path, step: int, rl_steps: int) -> dict:
    """One checkpoint: held-out greedy and decision probabilities, then grpo for ``rl_steps`` and held-out again."""
    from flows.common import load_stage_policy
    from trace.predictor import make_predictor
    from trace.training.evaluation import evaluate_policy, question_rewards
    from trace.training.loop import Trainer

    def greedy(policy) -> dict[str, float]:
        _, trees = evaluate_policy(policy, env, held_out, cfg.rollout, seed=cfg.seed,
                                   max_context_tokens=cfg.policy.max_context_tokens)
        return question_rewards(trees[: len(held_out)])

    policy = load_stage_policy(cfg, out / f"step-{step}")
    before = greedy(policy)
    row: dict = {"sft_step": step, "held_out": float(np.mean(list(before.values()))),
                 "p_right_ambiguous": None, "p_right_plain": None}
    if cfg.task.name.value == "kgqa":
        from scripts.kgqa_decisions import decision_probabilities

        probs = decision_probabilities(policy, env, held_out)
        row["p_right_ambiguous"] = float(probs["ambiguous"].mean()) if len(probs["ambiguous"]) else None
        row["p_right_plain"] = float(probs["plain"].mean()) if len(probs["plain"]) else None
    rl = cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "num_steps": rl_steps, "eval_every": rl_steps, "checkpoint_every": min(10, rl_steps)})})
    predictor = make_predictor(rl.predictor, env=env, policy=policy, seed=rl.seed)  # grpo allocates without it
    trainer = Trainer(rl, "grpo", policy=policy, env=env, train_prompts=train, eval_prompts=evals,
                      predictor=predictor, run_dir=out / f"rl-{step}-grpo-s{rl.seed}")
    trainer.resume()
    trainer.run()
    history = trainer.history  # every step's metrics, restored on resume
    policy.model.load_state_dict(trainer.updater.policy_state_dict())  # as the train stage saves its policy
    after = greedy(policy)
    gain, se = paired_gain(after, before)
    row.update({"held_out_after": float(np.mean(list(after.values()))), "gain": gain, "gain_se": se,
                "rl_steps": rl_steps, "seed": rl.seed,
                "train_reward_last10": float(np.mean([h.get("reward/mean", float("nan")) for h in history[-10:]]))
                if history else None})
    print(f"SFT step {step}: held-out {row['held_out']:.3f} -> {row['held_out_after']:.3f} "
          f"(gain {gain:+.3f}, SE {se:.3f})", flush=True)
    return row


if __name__ == "__main__":
    from trace.errors import user_errors

    with user_errors():
        main()
