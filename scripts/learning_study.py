"""What makes RL learn on the default task: candidate settings trained side by side from one warmup policy.

Every candidate is a set of params overrides (``advantages.negative_weight=0.25``, ``update.lr=3e-4``, ...).
For each candidate and training seed, one arm (``--arm``, ``grpo`` by default) trains ``--rl-steps`` steps from
the warmup policy of ``data/models/warmup`` (``dvc repro warmup`` first) with the params' ``rollout``,
``allocation``, ``update`` and the candidate's overrides (``trace.training.loop.Trainer``: the train stage's
code), at the same budget (``allocation.trajectory_budget`` trajectories a step) and seeds for every
candidate. Each run records:

- ``held_out_gain``: greedy accuracy on the first ``evaluate.num_prompts`` held-out questions after training,
  minus the warmup policy's on the same questions (paired by question);
- ``probe_gain``: the gain over the frozen (warmup) policy on the training distribution: the mean success of
  ``--probe-samples`` sampled rollouts on each of the first ``--probe-prompts`` training prompts, on the same
  sampling seeds before and after (``train.probe_prompts``: the in-training probe);
- the per-step train reward (``reward/mean``, under the policy that sampled it) and the probe and held-out
  curves every ``--eval-every`` steps.

Across seeds, each candidate's held-out gain has the paired bootstrap interval of the report
(``trace.reporting.statistics.paired_bootstrap``: questions and seeds resampled), and so has its difference
from the first candidate (the reference), paired by seed and question. "real" only when the interval
excludes 0.

Resumable: each finished (candidate, seed) row is a JSON file in ``--out`` and is skipped when run again; a
killed run continues from its last checkpoint. ``--only`` runs a subset (two processes can share one
``--out``: each writes its own rows); ``--summarize`` only reads the rows and writes the summary.

Usage:
    python -m scripts.learning_study [--seeds 0 1] [--rl-steps 80] [--arm grpo] [--out data/learning_study]
        [--candidate NAME KEY=VALUE ...]... [--only NAME ...] [--summarize]
Writes ``<out>/study.json`` and ``<out>/study.md`` (tables) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from flows.common import write_json

# name -> overrides; the first is the reference every other is compared with
DEFAULT_CANDIDATES: dict[str, dict[str, object]] = {
    "default": {},
    "neg-0.25": {"advantages.negative_weight": 0.25},
    "neg-0": {"advantages.negative_weight": 0.0},
    "neg-0.25-lr-6e-4": {"advantages.negative_weight": 0.25, "update.lr": 6.0e-4},
    "neg-0-lr-6e-4": {"advantages.negative_weight": 0.0, "update.lr": 6.0e-4},
    "dr-grpo": {"advantages.scale": "none"},
    "group-16": {"allocation.group_size": 16},
    "rloo": {"advantages.baseline": "leave_one_out", "advantages.scale": "none"},
    "neg-0-lr-3e-4": {"advantages.negative_weight": 0.0, "update.lr": 3.0e-4},
    "group-4": {"allocation.group_size": 4},
    "temp-0.7": {"rollout.temperature": 0.7},
}


def parse_candidates(items: Sequence[Sequence[str]] | None) -> dict[str, dict[str, object]]:
    """``[["neg", "advantages.negative_weight=0.25"], ...]`` -> ``{"neg": {...}}``; none given: the defaults.

    Raises:
        ConfigError: a candidate without a name, a repeated name, or an override that is not KEY=VALUE.
    """
    from flows.check_params import parse_overrides
    from trace.configuration.config import ConfigError

    if not items:
        return dict(DEFAULT_CANDIDATES)
    out: dict[str, dict[str, object]] = {}
    for item in items:
        name, *overrides = item
        if "=" in name:
            raise ConfigError(f"--candidate {' '.join(item)}: the first word is the candidate's name, e.g. "
                              "--candidate neg advantages.negative_weight=0.25")
        if name in out:
            raise ConfigError(f"--candidate {name} given twice; give each candidate a name of its own")
        out[name] = parse_overrides(list(overrides))
    return out


def bootstrap_row(after: np.ndarray, before: np.ndarray) -> dict[str, float]:
    """Mean of ``after - before`` over (S, Q) cells with the report's paired bootstrap interval."""
    from trace.reporting.statistics import paired_bootstrap

    interval = paired_bootstrap(after, before)
    return {"mean": interval.mean, "low": interval.low, "high": interval.high, "seeds": interval.n,
            "real": bool(interval.low > 0 or interval.high < 0)}


def summarize(rows: Sequence[dict], candidates: Sequence[str], warmup_rewards: dict[str, float]) -> dict:
    """Per candidate: the held-out gain over the warmup and the difference from the reference candidate, each
    with its paired bootstrap interval over seeds and questions; the probe gain's mean and seed range.

    Args:
        rows: finished runs (``candidate``, ``seed``, ``held_out`` {uid: reward}, ``probe_gain``, ...).
        candidates: names in order; the first is the reference.
        warmup_rewards: {uid: reward} of the warmup policy on the held-out questions.

    Returns:
        ``{name: {"seeds", "held_out_gain", "vs_reference", "probe_gain_mean", "probe_gains", ...}}``; a
        candidate without rows is left out, ``vs_reference`` is None for the reference and where the seeds
        differ.
    """
    uids = sorted(warmup_rewards)
    base = np.array([warmup_rewards[u] for u in uids])
    by_name: dict[str, dict[int, dict]] = {}
    for row in rows:
        by_name.setdefault(row["candidate"], {})[int(row["seed"])] = row

    def matrix(runs: dict[int, dict], seeds: list[int]) -> np.ndarray:
        return np.array([[runs[s]["held_out"][u] for u in uids] for s in seeds])

    out: dict[str, dict] = {}
    reference = by_name.get(candidates[0], {})
    for name in candidates:
        runs = by_name.get(name)
        if not runs:
            continue
        seeds = sorted(runs)
        after = matrix(runs, seeds)
        entry = {"seeds": seeds, "overrides": runs[seeds[0]]["overrides"],
                 "held_out_after": float(after.mean()), "held_out_gain": bootstrap_row(after, base),
                 "probe_gains": [runs[s]["probe_gain"] for s in seeds],
                 "probe_gain_mean": float(np.mean([runs[s]["probe_gain"] for s in seeds])),
                 "train_reward_last10": float(np.mean([runs[s]["train_reward_last10"] for s in seeds])),
                 "vs_reference": None}
        if name != candidates[0] and seeds == sorted(set(seeds) & set(reference)):
            entry["vs_reference"] = bootstrap_row(after, matrix(reference, seeds))
        out[name] = entry
    return out


def markdown(summary: dict, reference: str, order: Sequence[str] | None = None) -> str:
    """The study as a markdown table, one row per candidate (in ``order``, default the summary's)."""
    def interval(d: dict | None) -> str:
        if d is None:
            return "-"
        if not np.isfinite(d["low"]):
            return f"{d['mean']:+.3f} (1 seed)"
        verdict = "real" if d["real"] else "within noise"
        return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] {verdict}"

    lines = [f"| candidate | overrides | seeds | held-out after | held-out gain over warmup | minus `{reference}` "
             "| probe gain over frozen (per seed) | train reward, last 10 steps |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for name in order or list(summary):
        e = summary[name]
        overrides = ", ".join(f"`{k}={v}`" for k, v in e["overrides"].items()) or "(params.yaml)"
        probe = f"{e['probe_gain_mean']:+.3f} ({', '.join(f'{g:+.3f}' for g in e['probe_gains'])})"
        lines.append(f"| `{name}` | {overrides} | {', '.join(map(str, e['seeds']))} | {e['held_out_after']:.3f} "
                     f"| {interval(e['held_out_gain'])} | {interval(e['vs_reference'])} | {probe} "
                     f"| {e['train_reward_last10']:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds of every candidate")
    parser.add_argument("--rl-steps", type=int, default=80, help="RL steps of every run")
    parser.add_argument("--arm", default="grpo", help="the arm every candidate trains (trace.allocation.arms)")
    parser.add_argument("--eval-every", type=int, default=20, help="probe and held-out curve every N steps")
    parser.add_argument("--probe-prompts", type=int, default=256, help="training prompts of the probe set")
    parser.add_argument("--probe-samples", type=int, default=4, help="sampled rollouts per probe prompt")
    parser.add_argument("--candidate", nargs="+", action="append", metavar="NAME KEY=VALUE",
                        help="a candidate: its name, then its overrides (repeat; none: the built-in list)")
    parser.add_argument("--only", nargs="+", help="run only these candidates (others' rows are still summarized)")
    parser.add_argument("--summarize", action="store_true", help="write the summary of the finished rows only")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--warmup", default="data/models/warmup", help="the policy every run starts from")
    parser.add_argument("--out", default="data/learning_study")
    args = parser.parse_args(argv)

    from flows.common import build_environment, read_split, setup_process_env
    from trace.configuration.config import ConfigError
    from trace.configuration.params_file import load_config
    from scripts.warmup_sweep import check_prepared, claim_folder

    setup_process_env()
    candidates = parse_candidates(args.candidate)
    unknown = sorted(set(args.only or []) - set(candidates))
    if unknown:
        raise ConfigError(f"--only {unknown}: no such candidate; the candidates are {list(candidates)}")
    if args.rl_steps < 1 or args.eval_every < 1 or args.probe_prompts < 1 or args.probe_samples < 1:
        raise ConfigError("--rl-steps, --eval-every, --probe-prompts and --probe-samples must be >= 1")
    cfg = load_config(args.params)
    for name, overrides in candidates.items():  # every candidate's params are valid before anything runs
        load_config(args.params, overrides)
    env = build_environment(cfg)
    train, evals = read_split("train"), read_split("eval")
    check_prepared(cfg, env, {"train": train, "eval": evals}, args.params)
    out = Path(args.out)
    claim_folder(out, cfg.params_hash(), args.params)
    held_out = evals[: cfg.evaluate.num_prompts]
    warmup_rewards = _warmup_held_out(cfg, env, held_out, Path(args.warmup), out)
    rows = []
    for name, overrides in candidates.items():
        for seed in args.seeds:
            done = out / f"row-{name}-s{seed}-{args.arm}-{args.rl_steps}.json"
            if not done.exists() and not args.summarize and (not args.only or name in args.only):
                row = _run(args, load_config(args.params, overrides), env, train, evals, held_out, out, name,
                           overrides, seed)
                write_json(done, row)
            if done.exists():
                rows.append(json.loads(done.read_text()))
    summary = summarize(rows, list(candidates), warmup_rewards)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    write_json(out / "study.json", {
        "commit": commit, "params": args.params, "arm": args.arm, "rl_steps": args.rl_steps, "seeds": args.seeds,
        "probe_prompts": args.probe_prompts, "probe_samples": args.probe_samples, "eval_every": args.eval_every,
        "held_out_questions": len(held_out), "warmup_held_out": float(np.mean(list(warmup_rewards.values()))),
        "machine": {"cpu": _cpu_name(), "cores": _cores()}, "candidates": candidates, "summary": summary,
        "order": list(summary),  # the JSON's keys are sorted: the table's row order, the reference first
        "runs": [{k: v for k, v in r.items() if k != "held_out"} for r in rows]})
    table = markdown(summary, next(iter(candidates)))
    (out / "study.md").write_text(table + "\n")
    print(table)
    return summary


def _cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512 and native bf16 (results differ between CPU kinds)."""
    name, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(simd) if simd else 'no AVX-512'})"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def _warmup_held_out(cfg, env, held_out, warmup: Path, out: Path) -> dict[str, float]:
    """{uid: greedy reward} of the warmup policy on the held-out questions (kept in ``<out>/warmup_held_out.json``)."""
    from flows.common import load_stage_policy
    from trace.training.evaluation import evaluate_policy, question_rewards

    record = out / "warmup_held_out.json"
    if record.exists():
        return json.loads(record.read_text())
    if not warmup.is_dir():
        from trace.data_paths import DataError

        raise DataError(f"{warmup}: no warmup policy; run `dvc repro warmup` first (or give --warmup FOLDER)")
    policy = load_stage_policy(cfg, warmup)
    _, trees = evaluate_policy(policy, env, held_out, cfg.rollout, seed=cfg.seed,
                               max_context_tokens=cfg.policy.max_context_tokens)
    rewards = question_rewards(trees[: len(held_out)])
    write_json(record, rewards)
    return rewards


def _run(args, cfg, env, train, evals, held_out, out: Path, name: str, overrides: dict, seed: int) -> dict:
    """One candidate at one seed: ``--rl-steps`` steps of ``--arm`` from the warmup, then held-out greedy."""
    from flows.common import load_stage_policy, run_config
    from trace.predictor import make_predictor
    from trace.training.evaluation import evaluate_policy, question_rewards
    from trace.training.loop import Trainer

    cfg = run_config(cfg, seed)
    rl = cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "num_steps": args.rl_steps, "eval_every": args.eval_every, "checkpoint_every": args.eval_every,
        "eval_prompts": len(held_out), "probe_prompts": args.probe_prompts, "probe_samples": args.probe_samples})})
    policy = load_stage_policy(rl, Path(args.warmup))
    predictor = make_predictor(rl.predictor, env=env, policy=policy, seed=rl.seed)
    trainer = Trainer(rl, args.arm, policy=policy, env=env, train_prompts=train, eval_prompts=held_out,
                      predictor=predictor, run_dir=out / f"rl-{name}-s{seed}-{args.arm}", progress=False)
    trainer.resume()
    start = time.time()
    trainer.run(on_step=lambda step, m: print(f"{name} s{seed} step {step}: reward {m.get('reward/mean', 0):.3f}"
                                              + (f", held-out {m['accuracy/eval']:.3f}, probe gain "
                                                 f"{m.get('probe/gain', float('nan')):+.3f}"
                                                 if "accuracy/eval" in m else ""), flush=True))
    history = trainer.history
    policy.model.load_state_dict(trainer.updater.policy_state_dict())
    _, trees = evaluate_policy(policy, env, held_out, rl.rollout, seed=rl.seed,
                               max_context_tokens=rl.policy.max_context_tokens)
    after = question_rewards(trees[: len(held_out)])
    curve = [{"step": h["step"], **{k: h[k] for k in ("accuracy/eval", "probe/success", "probe/gain") if k in h}}
             for h in history if "accuracy/eval" in h]
    return {"candidate": name, "overrides": overrides, "seed": seed, "arm": args.arm, "rl_steps": args.rl_steps,
            "held_out": after, "held_out_after": float(np.mean(list(after.values()))),
            "probe_gain": float(curve[-1]["probe/gain"]), "curve": curve,
            "train_reward": [float(h.get("reward/mean", float("nan"))) for h in history],
            "train_reward_last10": float(np.mean([h.get("reward/mean", float("nan")) for h in history[-10:]])),
            "seconds_this_process": time.time() - start}


if __name__ == "__main__":
    from trace.errors import user_errors

    with user_errors():
        main()
