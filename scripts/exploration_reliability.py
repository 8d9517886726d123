"""Reliability of stage 1's forecasts on the exploration groups of a finished run, from its trees.

The exploration groups (``allocation.explore_groups``) are candidates drawn uniformly before any forecast is read,
each given ``group_size`` bare rollouts inside the budget: at every step, an unselected sample of the candidates
with its outcomes, the distribution the ground-truth audit samples (docs/method.md, "Ground-truth audit"), at no
extra rollout. This reads a run's trees (``data/runs/<arm>/s<seed>/trees``), picks each step's exploration groups
as the loop does (``trace.training.recalibration.exploration_trees``: the draw made again from the seed and the
step), and pools the diagram of their root forecasts against their bare rollouts' success rate over steps and
seeds (``trace.predictor.reliability``); the groups stage 1 chose are pooled apart (chosen on the forecast, so
their diagram spans a narrow range). The forecast is the one stored in the tree: what the allocator read (with
``predictor.recalibrate``, the mapped forecast, which the audit scores too).

Usage, in a clone that ran the pipeline with exploration groups::

    python -m scripts.exploration_reliability --arm trace --out exploration_reliability.json

It reads ``params.yaml`` with the ``-S`` overrides of ``dvc exp run`` given as ``--set key=value`` (YAML values;
the run's own ``params.yaml`` after ``dvc exp run`` already holds them), and the run seeds ``train.seeds``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import yaml

__all__ = ["exploration_reliability", "main"]


def _diagram(trees) -> list[dict[str, float]]:
    from trace.predictor.ground_truth import reliability_diagram
    from trace.training.recalibration import raw_outcomes

    pred, successes, trials = raw_outcomes(trees, {})["root"]  # as stored: what the allocator read
    return reliability_diagram(pred, successes / trials, trials) if len(pred) else []


def exploration_reliability(cfg, arm_name: str, runs_root: Path, prompts: Sequence) -> dict:
    """The pooled reliability of the arm's root forecasts on its exploration groups and on its chosen groups.

    Args:
        cfg: the run's ``Config`` (``allocation``, ``train.seeds``, ``seed``).
        arm_name: the arm (it must explore: ``trace.allocation.step.explores``).
        runs_root: ``data/runs`` of the clone.
        prompts: the prompts its steps drew candidates from (``rl_prompt_pool`` of the prepared train split).

    Returns:
        ``{"explore" | "chosen": {"diagram": pooled rows, "ece": pooled ECE, "interval": [low, high] (95 %,
        seeds then steps resampled, ``pooled_ece_interval``), "floor", "debiased", "debiased_interval"
        (``calibration_noise``, the seeds as clusters), "seeds": {"s<k>": that seed's pooled ECE},
        "groups": root groups}}`` and ``"steps"``: steps read per seed.

    Raises:
        ValueError: the arm does not explore, or ``allocation.explore_groups`` is 0.
        FileNotFoundError: a seed without trees.
    """
    from trace.allocation.arms import get_arm
    from trace.allocation.step import explores
    from trace.predictor.reliability import calibration_noise, diagram_ece, pool_diagrams, pooled_ece_interval
    from trace.training.recalibration import exploration_trees
    from trace.tree_io import read_trees

    arm = get_arm(arm_name)
    if not explores(arm) or not cfg.allocation.explore_groups:
        raise ValueError(f"{arm_name} draws no exploration groups with allocation.explore_groups="
                         f"{cfg.allocation.explore_groups}: pass an arm of EXPLORING_ROOT_RULES and the run's params")
    per_seed = {"explore": {}, "chosen": {}}
    steps = {}
    for seed in cfg.train.run_seeds(cfg.seed):
        files = sorted((runs_root / arm_name / f"s{seed}" / "trees" / arm_name).glob("step-*.parquet"))
        if not files:
            raise FileNotFoundError(f"no trees of {arm_name} at seed {seed} under {runs_root}: run the pipeline first")
        steps[f"s{seed}"] = len(files)
        for name in per_seed:
            per_seed[name][seed] = []
        for path in files:
            trees = read_trees(path)
            drawn = exploration_trees(trees, arm, prompts, cfg.allocation, seed)
            picked = {t.tree_id for t in drawn}
            per_seed["explore"][seed].append(_diagram(drawn))
            per_seed["chosen"][seed].append(_diagram([t for t in trees if t.tree_id not in picked]))
    out: dict = {"steps": steps}
    for name, runs in per_seed.items():
        pooled = pool_diagrams(d for run in runs.values() for d in run)
        low, high = pooled_ece_interval(list(runs.values()))
        noise = calibration_noise([pool_diagrams(run) for run in runs.values()])
        out[name] = {"diagram": pooled, "ece": diagram_ece(pooled), "interval": [low, high],
                     "floor": noise["floor"], "debiased": noise["debiased"],
                     "debiased_interval": list(pooled_ece_interval(list(runs.values()), debiased=True)),
                     "seeds": {f"s{s}": diagram_ece(pool_diagrams(run)) for s, run in runs.items()},
                     "groups": int(sum(sum(r["count"] for r in d) for run in runs.values() for d in run)
                                   / cfg.allocation.group_size) if name == "explore" else None}
    return out


def main(argv: list[str] | None = None) -> None:
    from trace.configuration.params_file import load_config
    from trace.prepared import read_prompts, rl_prompt_pool

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", default="trace")
    parser.add_argument("--root", default=".", help="the clone that ran the pipeline (params.yaml, data/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    root = Path(args.root)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: write KEY=VALUE")
        overrides[key.lstrip("+")] = yaml.safe_load(value)
    cfg = load_config(root / "params.yaml", overrides=overrides)
    prompts = rl_prompt_pool(read_prompts(root / "data" / "prepared" / "train.jsonl"), cfg.train.prompt_pool)
    result = exploration_reliability(cfg, args.arm, root / "data" / "runs", prompts)
    for name in ("explore", "chosen"):
        r = result[name]
        low, high = r["interval"]
        d_low, d_high = r["debiased_interval"]
        print(f"{name}: pooled ECE {r['ece']:.3f} [{low:.3f}, {high:.3f}], debiased {r['debiased']:.3f} "
              f"[{d_low:.3f}, {d_high:.3f}], floor {r['floor']:.3f}"
              + (f" over {r['groups']} groups" if r["groups"] else "") + "; per seed "
              + ", ".join(f"{s} {v:.3f}" for s, v in r["seeds"].items()))
        for row in r["diagram"]:
            print(f"  {row['mean_forecast']:.2f} -> {row['realised_rate']:.2f} ({int(row['count']):,})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, allow_nan=True) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
