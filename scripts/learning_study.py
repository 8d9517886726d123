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

With ``--eval-samples K``, each run (and the warmup) is also scored by avg@K on the same questions: the mean
reward of K sampled rollouts per question at ``evaluate.temperature`` (``held_out_avgk``), the report's
primary metric.

Across seeds, each candidate's held-out gain has the paired bootstrap interval of the report
(``trace.reporting.statistics.paired_bootstrap``: questions and seeds resampled) and the t-interval over
seeds, and so has its difference from the first candidate (the reference), paired by seed and question. By
the report's rule (``trace.reporting.verdicts``) a difference is "real" only when both intervals exclude 0,
and the one with the larger p decides; its margin verdict (``margin_verdict`` against ``--margin``, default
``report.margin``) reads the hull of both intervals: equivalent within ±delta, not better by delta, ...

Resumable: each finished (candidate, seed) row is a JSON file in ``--out`` and is skipped when run again; a
killed run continues from its last checkpoint. ``--only`` runs a subset (two processes can share one
``--out``: each writes its own rows); ``--summarize`` only reads the rows and writes the summary.

Usage:
    python -m scripts.learning_study [--seeds 0 1] [--rl-steps 80] [--arm grpo] [--out data/learning_study]
        [--eval-samples 8] [--margin 0.02] [--candidate NAME KEY=VALUE ...]... [--only NAME ...] [--summarize]
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


def bootstrap_row(after: np.ndarray, before: np.ndarray, margin: float | None = None) -> dict[str, float]:
    """Mean of ``after - before`` over (S, Q) cells with the report's paired bootstrap interval, the t-interval
    over seeds, the estimator that decides (``deciding_p``), and with ``margin`` the margin verdict.

    Args:
        after: (S, Q) float scores per seed and question.
        before: (S, Q), or (Q,) one evaluation (the warmup).
        margin: delta > 0 of ``margin_verdict`` (None: no margin verdict).

    Returns:
        ``{"mean", "low", "high", "seed_low", "seed_high", "seeds", "real", "deciding", "p", "margin",
        "margin_verdict"}``: ``low``/``high`` the bootstrap bounds, ``seed_*`` the t-interval's, ``real`` when
        both exclude 0, ``margin_verdict`` read on the hull of both at 95 % (None without a margin).
    """
    from trace.reporting.statistics import paired_bootstrap
    from trace.reporting.verdicts import deciding_bounds, deciding_p, margin_verdict

    interval = paired_bootstrap(after, before)
    seed = interval.seed_interval
    p, deciding = deciding_p(interval)
    verdict = None
    if margin is not None:
        verdict = margin_verdict(*deciding_bounds(interval, interval.confidence), margin)
    return {"mean": interval.mean, "low": interval.low, "high": interval.high, "seed_low": seed.low,
            "seed_high": seed.high, "seeds": interval.n, "real": bool(interval.excludes_zero), "deciding": deciding,
            "p": p, "margin": margin, "margin_verdict": verdict}


def summarize(rows: Sequence[dict], candidates: Sequence[str], warmup_rewards: dict[str, float],
              warmup_avgk: dict[str, float] | None = None, margin: float | None = None) -> dict:
    """Per candidate: the held-out gain over the warmup and the difference from the reference candidate, each
    with its paired bootstrap interval over seeds and questions (``bootstrap_row``); the probe gain's mean and
    seed range.

    Args:
        rows: finished runs (``candidate``, ``seed``, ``held_out`` {uid: greedy reward}, optional
            ``held_out_avgk`` {uid: mean reward of K samples}, ``probe_gain``, ...).
        candidates: names in order; the first is the reference.
        warmup_rewards: {uid: greedy reward} of the warmup policy on the held-out questions.
        warmup_avgk: {uid: avg@K} of the warmup policy; None when the study has no sampled evaluation.
        margin: delta of the margin verdicts (None: none).

    Returns:
        ``{name: {"seeds", "held_out_gain", "vs_reference", "probe_gain_mean", "probe_gains", ...}}``, and with
        ``warmup_avgk`` also ``"avgk_after"``, ``"avgk_gain"`` and ``"avgk_vs_reference"``; a candidate without
        rows is left out, the ``vs_reference`` entries are None for the reference and where the seeds differ.
    """
    uids = sorted(warmup_rewards)
    by_name: dict[str, dict[int, dict]] = {}
    for row in rows:
        by_name.setdefault(row["candidate"], {})[int(row["seed"])] = row

    def matrix(runs: dict[int, dict], seeds: list[int], key: str) -> np.ndarray:
        return np.array([[runs[s][key][u] for u in uids] for s in seeds])

    metrics = [("held_out", "held_out", warmup_rewards)]
    if warmup_avgk is not None:
        metrics.append(("avgk", "held_out_avgk", warmup_avgk))
    out: dict[str, dict] = {}
    reference = by_name.get(candidates[0], {})
    for name in candidates:
        runs = by_name.get(name)
        if not runs:
            continue
        seeds = sorted(runs)
        entry = {"seeds": seeds, "overrides": runs[seeds[0]]["overrides"],
                 "probe_gains": [runs[s]["probe_gain"] for s in seeds],
                 "probe_gain_mean": float(np.mean([runs[s]["probe_gain"] for s in seeds])),
                 "train_reward_last10": float(np.mean([runs[s]["train_reward_last10"] for s in seeds]))}
        paired = name != candidates[0] and seeds == sorted(set(seeds) & set(reference))
        for prefix, key, warmup in metrics:
            after = matrix(runs, seeds, key)
            base = np.array([warmup[u] for u in uids])
            entry[f"{prefix}_after"] = float(after.mean())
            entry[f"{prefix}_gain" if prefix == "avgk" else "held_out_gain"] = bootstrap_row(after, base)
            entry["vs_reference" if prefix == "held_out" else f"{prefix}_vs_reference"] = (
                bootstrap_row(after, matrix(reference, seeds, key), margin) if paired else None)
        out[name] = entry
    return out


def _interval_text(d: dict | None) -> str:
    """``+0.012 [bootstrap] [seeds t] verdict``, the deciding interval starred."""
    if d is None:
        return "-"
    if not np.isfinite(d["low"]):
        return f"{d['mean']:+.3f} (1 seed)"
    verdict = "real" if d["real"] else "within noise"
    boot = f"[{d['low']:+.3f}, {d['high']:+.3f}]"
    if "seed_low" not in d:  # a row written before the seed interval was kept
        return f"{d['mean']:+.3f} {boot} {verdict}"
    mark = {"bootstrap": ("*", ""), "t": ("", "*")}.get(d.get("deciding"), ("", ""))
    text = (f"{d['mean']:+.3f} {boot}{mark[0]} seeds [{d['seed_low']:+.3f}, {d['seed_high']:+.3f}]{mark[1]} "
            f"{verdict}")
    return text + (f"; {d['margin_verdict']}" if d.get("margin_verdict") else "")


def markdown(summary: dict, reference: str, order: Sequence[str] | None = None) -> str:
    """The study as a markdown table, one row per candidate (in ``order``, default the summary's); with avg@K,
    its columns follow the greedy ones."""
    names = order or list(summary)
    has_avgk = any("avgk_gain" in summary[n] for n in names)
    head = ["candidate", "overrides", "seeds", "held-out greedy after", "greedy gain over warmup",
            f"greedy minus `{reference}`"]
    if has_avgk:
        head += ["avg@k after", "avg@k gain over warmup", f"avg@k minus `{reference}`"]
    head += ["probe gain over frozen (per seed)", "train reward, last 10 steps"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    for name in names:
        e = summary[name]
        overrides = ", ".join(f"`{k}={v}`" for k, v in e["overrides"].items()) or "(params.yaml)"
        probe = f"{e['probe_gain_mean']:+.3f} ({', '.join(f'{g:+.3f}' for g in e['probe_gains'])})"
        cells = [f"`{name}`", overrides, ", ".join(map(str, e["seeds"])), f"{e['held_out_after']:.3f}",
                 _interval_text(e["held_out_gain"]), _interval_text(e["vs_reference"])]
        if has_avgk:
            cells += ([f"{e['avgk_after']:.3f}", _interval_text(e["avgk_gain"]),
                       _interval_text(e["avgk_vs_reference"])] if "avgk_gain" in e else ["-", "-", "-"])
        lines.append("| " + " | ".join(cells + [probe, f"{e['train_reward_last10']:.3f}"]) + " |")
    if not any("seed_low" in (summary[n]["held_out_gain"] or {}) for n in names):
        return "\n".join(lines)  # a summary written before the seed interval was kept: the bootstrap alone
    legend = ("Intervals: the paired bootstrap over seeds and questions, then the t-interval over seeds; `*` marks "
              "the one that decides (the larger p). A difference is real only when both exclude 0. Margin verdicts "
              "read the hull of both intervals against delta.")
    return "\n".join(lines) + "\n\n" + legend


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds of every candidate")
    parser.add_argument("--rl-steps", type=int, default=80, help="RL steps of every run")
    parser.add_argument("--arm", default="grpo", help="the arm every candidate trains (trace.allocation.arms)")
    parser.add_argument("--eval-every", type=int, default=20, help="probe and held-out curve every N steps")
    parser.add_argument("--probe-prompts", type=int, default=256, help="training prompts of the probe set")
    parser.add_argument("--probe-samples", type=int, default=4, help="sampled rollouts per probe prompt")
    parser.add_argument("--eval-samples", type=int, default=0,
                        help="K > 0: also avg@K of K sampled rollouts per held-out question (the report's primary "
                             "metric), for the warmup and every run")
    parser.add_argument("--margin", type=float, default=None,
                        help="delta of the margin verdicts against the reference (default: report.margin)")
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
    if args.eval_samples < 0:
        raise ConfigError(f"--eval-samples {args.eval_samples} must be >= 0 (0: greedy only)")
    if args.margin is not None and not args.margin > 0:
        raise ConfigError(f"--margin {args.margin} must be > 0 (the default is report.margin)")
    cfg = load_config(args.params)
    margin = cfg.report.margin if args.margin is None else args.margin
    for name, overrides in candidates.items():  # every candidate's params are valid before anything runs
        load_config(args.params, overrides)
    env = build_environment(cfg)
    train, evals = read_split("train"), read_split("eval")
    check_prepared(cfg, env, {"train": train, "eval": evals}, args.params)
    out = Path(args.out)
    claim_folder(out, cfg.params_hash(), args.params)
    held_out = evals[: cfg.evaluate.num_prompts]
    warmup_rewards, warmup_avgk = _warmup_held_out(cfg, env, held_out, Path(args.warmup), out, args.eval_samples)
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
    summary = summarize(rows, list(candidates), warmup_rewards, warmup_avgk, margin)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    write_json(out / "study.json", {
        "commit": commit, "params": args.params, "arm": args.arm, "rl_steps": args.rl_steps, "seeds": args.seeds,
        "probe_prompts": args.probe_prompts, "probe_samples": args.probe_samples, "eval_every": args.eval_every,
        "held_out_questions": len(held_out), "warmup_held_out": float(np.mean(list(warmup_rewards.values()))),
        "eval_samples": args.eval_samples, "margin": margin,
        "warmup_avgk": None if warmup_avgk is None else float(np.mean(list(warmup_avgk.values()))),
        "machine_precision": _precision(cfg),  # what auto resolves to here; each run's own: runs[].precision
        "machine": {"cpu": _cpu_name(), "cores": _cores()}, "candidates": candidates, "summary": summary,
        "order": list(summary),  # the JSON's keys are sorted: the table's row order, the reference first
        "runs": [{k: v for k, v in r.items() if k not in ("held_out", "held_out_avgk")} for r in rows]})
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


def _precision(cfg) -> dict:
    """The precision a config trains in (``policy.dtype``, ``update.bf16``, resolved from ``auto`` on this
    machine by ``trace.precision``) and what the machine computes natively (``machine_tags``)."""
    from trace.precision import machine_tags

    return {"policy.dtype": str(cfg.policy.dtype), "update.bf16": bool(cfg.update.bf16), **machine_tags()}


def _warmup_held_out(cfg, env, held_out, warmup: Path, out: Path,
                     eval_samples: int = 0) -> tuple[dict[str, float], dict[str, float] | None]:
    """The warmup policy's {uid: greedy reward} on the held-out questions, and with ``eval_samples`` K > 0 its
    {uid: avg@K} (kept in ``<out>/warmup_held_out.json`` and ``<out>/warmup_held_out_avg<K>.json``)."""
    from flows.common import load_stage_policy

    record, sampled = out / "warmup_held_out.json", out / f"warmup_held_out_avg{eval_samples}.json"
    if record.exists() and (eval_samples == 0 or sampled.exists()):
        return json.loads(record.read_text()), json.loads(sampled.read_text()) if eval_samples else None
    if not warmup.is_dir():
        from trace.data_paths import DataError

        raise DataError(f"{warmup}: no warmup policy; run `dvc repro warmup` first (or give --warmup FOLDER)")
    policy = load_stage_policy(cfg, warmup)
    rewards, avgk = _held_out_scores(policy, cfg, env, held_out, eval_samples)
    write_json(record, rewards)
    if eval_samples:
        write_json(sampled, avgk)
    return rewards, avgk


def _held_out_scores(policy, cfg, env, held_out, eval_samples: int) -> tuple[dict[str, float], dict | None]:
    """{uid: greedy reward} and (K > 0) {uid: avg@K} of ``policy``, on the seeds of ``cfg.seed``."""
    from trace.training.evaluation import evaluate_policy, question_rewards, sampled_question_rewards

    _, trees = evaluate_policy(policy, env, held_out, cfg.rollout, seed=cfg.seed,
                               max_context_tokens=cfg.policy.max_context_tokens, pass_k=eval_samples,
                               temperature=cfg.evaluate.temperature)
    greedy = question_rewards(trees[: len(held_out)])
    return greedy, sampled_question_rewards(trees[len(held_out):]) if eval_samples else None


def _run(args, cfg, env, train, evals, held_out, out: Path, name: str, overrides: dict, seed: int) -> dict:
    """One candidate at one seed: ``--rl-steps`` steps of ``--arm`` from the warmup, then held-out greedy."""
    from flows.common import load_stage_policy, run_config
    from trace.predictor import make_predictor
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
    after, avgk = _held_out_scores(policy, rl, env, held_out, args.eval_samples)
    curve = [{"step": h["step"], **{k: h[k] for k in ("accuracy/eval", "probe/success", "probe/gain") if k in h}}
             for h in history if "accuracy/eval" in h]
    return {"candidate": name, "overrides": overrides, "seed": seed, "arm": args.arm, "rl_steps": args.rl_steps,
            "held_out": after, "held_out_after": float(np.mean(list(after.values()))),
            "precision": _precision(rl),
            **({"held_out_avgk": avgk, "avgk_after": float(np.mean(list(avgk.values())))} if avgk else {}),
            "probe_gain": float(curve[-1]["probe/gain"]), "curve": curve,
            "train_reward": [float(h.get("reward/mean", float("nan"))) for h in history],
            "train_reward_last10": float(np.mean([h.get("reward/mean", float("nan")) for h in history[-10:]])),
            "seconds_this_process": time.time() - start}


if __name__ == "__main__":
    from trace.errors import user_errors

    with user_errors():
        main()
