"""Allocation quality of every arm on the martingale simulator, at the same trajectory budget and seeds.

Each simulated training step is the training loop's allocation step (``trace.allocation.step.allocate_step``,
which ``trace.training.loop.Trainer.step`` calls) with the language model replaced by the simulator
(``trace.allocation.samplers.SimulatorSampler``): the same candidate prompts for every arm
(``trace.training.seeding.candidate_indices``), root scores from the predictor, the arm's root rule, root rollouts,
anchor scores at every candidate anchor, the arm's prefix rule and continuations; then the loop's own
metrics (``trace.metrics.rollout_metrics``). There is no policy update: the simulator's success probabilities do
not move, so steps differ only in their candidates and draws.

Predictors (``--quick`` runs oracle and learned only):
- ``oracle``: the true ``V(H)`` (``make_predictor`` kind ``oracle``);
- ``noisy_0.5``, ``noisy_1.0``: ``sigmoid(logit V + eps)``, ``eps ~ N(0, s^2)`` fixed per prefix
  (kind ``noisy_oracle``, ``noise_std = s``);
- ``history``: the library's per-prompt Beta-Bernoulli posterior of past root-rollout rewards (kind
  ``history``, prior Beta(1, 1)); roots only, every prefix gets its prompt's posterior mean;
- ``learned``: the library's ``HistoryPathPredictor`` (kind ``history_path``), which sees only what a
  predictor beside a real policy could see: past rewards of the prompt and the observation texts along the prefix. Roots: the per-prompt
  Beta-Bernoulli posterior with an empirical-Bayes prior (moment-matched to the warm-start outcomes).
  Prefixes: a logistic regression on the prompt's evidence (its posterior mean, pooling earlier trees and the
  current tree's other root rollouts, never the outcome below the prefix itself) and the path's observations
  (``progress up`` / ``progress down`` counts, the last one, the turn index), refit every step on the
  sliding window of the arm's own trees. It never reads ``true_success_prob``.
Both learned predictors are warm-started, as the pipeline's ``seed_rollouts`` stage does, on 4 bare rollouts
of every prompt of the pool plus random-anchor continuations at ratio 0.5, and refit after every step on the
last ``window_steps`` steps of their own arm's trees. Predictor quality (Brier, ECE, AUC over roots and
prefixes, outcome-weighted as ``SuccessPredictor.evaluate``) is scored, for the ``trace`` arm's predictor
before each refit, on probe trees that no predictor fits on and that are identical across settings: 4 bare
rollouts of each of the step's candidates.

Arms without a predictor (``grpo``, ``dapo``, ``tree_random``, ``treepo`` and the field's allocators
``reinforce_ada``, ``greso``, ``mopps``, ``vip``, whose state lives in the arm and is carried from step to step)
do not depend on it and run once per seed. Reported per arm and predictor, as mean and sample std over seeds of the per-seed mean over steps:
``effective_ratio``, ``effective_token_ratio``, ``mixed_group_ratio``, ``active_prompt_ratio``, the number of
mixed groups (prompt groups and branch-anchor groups), ``anchor_contrast`` (the loop's metric: the sum of
``V(1 - V)`` over allocated roots and anchors), ``prefix_anchor_contrast`` (stage-2 anchors only) and
``contrast_per_continuation`` (``sum K V(1 - V) / sum K`` over stage-2 anchors), generated tokens and
trajectories, and the allocation audit of the loop (``trace.reporting.audit``: ``audit/expected_mixed_groups`` against
``audit/mixed_groups``, ``audit/expected_flips`` against ``audit/flips``; NaN forecasts for arms without
predictions). Ratios against ``grpo`` and against ``oracle`` are formed per seed, then summarised. The
headline's ``allocators_on_one_budget`` sets each field allocator against ``grpo`` (paired difference and ratio)
and against ``trace`` with the oracle and the learned predictor (ratio), as 95 % t-intervals over seeds.

Simplifications: one expansion round (the paper default); the pool is ``pool_prompts`` prompts of the
default difficulty mix (U-shaped ``Beta(0.3, 0.3)``), so candidates recur every ``pool / B`` steps and the
history-based predictors see each prompt again.

Usage: ``python -m benchmarks.allocation_quality [--quick]``.

Stage-1 objectives (``python -m benchmarks.allocation_quality --compare-objectives [--quick] [--seeds S]
[--steps N]``, written as ``allocation_objectives.json``/``.png``): ``trace`` and ``trace_root`` under
``allocation.root_objective`` ``groups`` and ``leaves`` at ``m_min`` 4 and 8 (the rest of the default
budget), with ``grpo`` beside them; per arm the mean over seeds of the per-seed mean effective ratio with a
95 % t-interval over seeds, and the paired difference leaves - groups (same seed = a pair) with its interval.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import deque
from typing import Any, Sequence

import numpy as np

from benchmarks.common import figure_path, mean_std, parse_args, pyplot, write_report
from trace.allocation.arms import ARMS, Arm, get_arm, make_allocator_state
from trace.allocation.prefix import split_expansion_budget
from trace.allocation.prefix_rules import plan_expansion
from trace.allocation.samplers import SimulatorSampler
from trace.allocation.step import allocate_step
from trace.reporting.audit import AUDIT_METRIC_KEYS, audit_metrics
from trace.configuration.config import AllocationConfig, PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.base import Prompt
from trace.envs.simulator import SimulatorEnvironment
from trace.metrics import rollout_metrics
from trace.predictor.calibration import brier_score, expected_calibration_error, roc_auc
from trace.predictor.history_path import HistoryPathPredictor, empirical_bayes_prior
from trace.predictor.labels import labelled_node_ids
from trace.predictor.registry import make_predictor
from trace.training.seeding import candidate_indices, step_rng
from trace.tree import Origin, RolloutTree

NAME = "allocation_quality"
SEED_GROUP_SIZE = 4  # SeedRolloutConfig.group_size default
SEED_EXPANSION_RATIO = 0.5  # SeedRolloutConfig.expansion_ratio default


# ================================================================================================
# Predictor quality on probe trees
# ================================================================================================
def predictor_quality(predictor: Any, trees: Sequence[RolloutTree]) -> dict[str, float]:
    """Brier, ECE and AUC on the labelled nodes of ``trees`` (outcome-weighted, as ``predictor.evaluate``)."""
    keep = [(t, labelled_node_ids(t)) for t in trees]
    keep = [(t, ids) for t, ids in keep if ids]
    if not keep:
        return {}
    pred = np.concatenate(predictor.predict_trees([t for t, _ in keep], [ids for _, ids in keep]))
    labels = np.concatenate([t.node_success_labels()[0][ids] for t, ids in keep])
    weights = np.concatenate([t.node_success_labels()[1][ids] for t, ids in keep])
    is_root = np.concatenate([np.asarray(ids) == 0 for _, ids in keep])
    turn = ~is_root
    return {"brier": brier_score(pred, labels, weights), "ece": expected_calibration_error(pred, labels, weights),
            "auc": roc_auc(pred, labels, weights),
            "root_auc": roc_auc(pred[is_root], labels[is_root], weights[is_root]),
            "prefix_auc": roc_auc(pred[turn], labels[turn], weights[turn]) if turn.any() else float("nan")}


# ================================================================================================
# The simulated training step
# ================================================================================================
def count_mixed_groups(trees: Sequence[RolloutTree]) -> tuple[int, int]:
    """Mixed groups of size >= 2, as ``trace.metrics`` defines them: ``(prompt groups, branch-anchor groups)``.

    A prompt group is every leaf of the trees sharing a ``prompt_uid``; an anchor group is the leaves below a
    non-root node with >= 2 children; a group is mixed when its leaf rewards are not all equal.
    """
    prompt_low: dict[str, float] = {}
    prompt_high: dict[str, float] = {}
    prompt_size: dict[str, int] = {}
    num_anchor = 0
    for tree in trees:
        n = len(tree.nodes)
        low, high = np.full(n, np.inf), np.full(n, -np.inf)
        num_children = np.zeros(n, dtype=np.int64)
        for node in tree.nodes[1:]:
            num_children[node.parent_id] += 1
        for node in tree.nodes[1:]:
            if num_children[node.node_id] == 0:
                low[node.node_id] = high[node.node_id] = 0.0 if node.reward is None else float(node.reward)
        for node in reversed(tree.nodes[1:]):
            low[node.parent_id] = min(low[node.parent_id], low[node.node_id])
            high[node.parent_id] = max(high[node.parent_id], high[node.node_id])
        num_anchor += int(np.sum((num_children[1:] >= 2) & (high[1:] > low[1:])))
        uid = tree.prompt_uid
        prompt_low[uid] = min(prompt_low.get(uid, np.inf), low[0])
        prompt_high[uid] = max(prompt_high.get(uid, -np.inf), high[0])
        prompt_size[uid] = prompt_size.get(uid, 0) + tree.num_trajectories()
    num_prompt = sum(1 for uid in prompt_low if prompt_size[uid] >= 2 and prompt_high[uid] > prompt_low[uid])
    return num_prompt, num_anchor


def contrast_metrics(trees: Sequence[RolloutTree]) -> dict[str, float]:
    """True ``V (1 - V)`` at stage-2 anchors (once each, and per continuation) and per root rollout."""
    anchor_sum = weighted = branches = root_weighted = roots = 0.0
    for tree in trees:
        for node in tree.nodes[1:]:
            if node.num_branches > 0:
                value = float(node.true_success_prob)
                anchor_sum += value * (1.0 - value)
                weighted += node.num_branches * value * (1.0 - value)
                branches += node.num_branches
        rollouts = sum(1 for n in tree.nodes[1:] if n.origin == Origin.ROLLOUT and n.turn_idx == 0)
        p = float(tree.root.true_success_prob)
        root_weighted += rollouts * p * (1.0 - p)
        roots += rollouts
    return {"prefix_anchor_contrast": anchor_sum,
            "contrast_per_continuation": weighted / branches if branches else float("nan"),
            "root_contrast_per_rollout": root_weighted / roots if roots else float("nan")}


def simulated_step(spec: Arm, env: SimulatorEnvironment, pool: Sequence[Prompt], predictor: Any,
                   acfg: AllocationConfig, *, seed: int, step: int, state: Any = None
                   ) -> tuple[list[RolloutTree], dict[str, float]]:
    """One training step of arm ``spec`` with the simulator in place of the policy (no update).

    Root rollouts draw from one stream (``sim-roots``), continuations from ``sim-branches`` and extra root
    rollouts from ``sim-extra-roots``, all of ``(seed, step)``.

    ``state`` is the arm's ``AllocatorState`` (``make_allocator_state``), carried from step to step by the caller.

    Returns:
        ``(trees, metrics)``: every tree sampled this step, and the step's allocation diagnostics,
        ``rollout_metrics`` plus the mixed-group counts and contrast metrics of ``count_mixed_groups`` /
        ``contrast_metrics``.
    """
    idx = candidate_indices(len(pool), acfg.num_candidates, seed, step)
    candidates = [pool[i] for i in idx]
    continuation_salts = {"branch0": "sim-branches", "extra_roots": "sim-extra-roots"}
    sampler = SimulatorSampler(env, predictor, step_rng(seed, step, "sim-roots"),
                               lambda salt: step_rng(seed, step, continuation_salts.get(salt, f"sim-{salt}")),
                               step=step, ablation=spec.name)
    result = allocate_step(spec, candidates, sampler, acfg, lambda salt: step_rng(seed, step, salt), state=state)
    trees = result.sampled_trees
    metrics: dict[str, float] = dict(result.metrics)
    metrics.update(rollout_metrics(trees, num_candidates=len(candidates)))
    num_prompt, num_anchor = count_mixed_groups(trees)
    metrics.update({"mixed_groups": float(num_prompt + num_anchor), "mixed_prompt_groups": float(num_prompt),
                    "mixed_anchor_groups": float(num_anchor)})
    metrics.update(contrast_metrics(trees))
    metrics.update(audit_metrics(result))
    return trees, metrics


def seed_trees(env: SimulatorEnvironment, pool: Sequence[Prompt], seed: int) -> list[RolloutTree]:
    """Warm-start data as the ``seed_rollouts`` stage draws it: bare rollouts plus random-anchor continuations."""
    rng = step_rng(seed, -1, "sim-seed")
    trees = env.sample_root_rollouts(pool, [SEED_GROUP_SIZE] * len(pool), rng, step=-1, ablation="seed")
    budgets = split_expansion_budget(np.full(len(trees), SEED_GROUP_SIZE),
                                     int(round(SEED_GROUP_SIZE * SEED_EXPANSION_RATIO * len(trees))))
    plan = plan_expansion(get_arm("tree_random"), trees, None, budgets, rng)
    env.sample_continuations(trees, plan.counts, rng)
    return trees


def probe_trees(env: SimulatorEnvironment, pool: Sequence[Prompt], acfg: AllocationConfig, *, seed: int, step: int,
                group_size: int = SEED_GROUP_SIZE) -> list[RolloutTree]:
    """``group_size`` bare rollouts of every candidate of ``step``, drawn from ``(seed, step)`` alone.

    The same trees for every predictor setting, never fitted on: the common out-of-sample set on which
    predictors are scored (the trees an arm samples depend on its predictor, so scores on them would not
    compare).
    """
    idx = candidate_indices(len(pool), acfg.num_candidates, seed, step)
    return env.sample_root_rollouts([pool[i] for i in idx], [group_size] * len(idx),
                                    step_rng(seed, step, "sim-probe"), step=step, ablation="probe")


def make_setting_predictor(setting: str, env: SimulatorEnvironment, warm_trees: Sequence[RolloutTree]) -> Any:
    """The predictor of one setting, warm-started where it learns."""
    if setting == "oracle":
        return make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)
    if setting.startswith("noisy_"):
        noise = float(setting.split("_", 1)[1])
        return make_predictor(PredictorConfig(kind=PredictorKind.NOISY_ORACLE, noise_std=noise), env=env)
    if setting == "history":
        predictor = make_predictor(PredictorConfig(kind=PredictorKind.HISTORY))
    elif setting == "learned":
        predictor = HistoryPathPredictor(*empirical_bayes_prior(warm_trees))
    else:
        raise ValueError(f"unknown predictor setting {setting!r}; valid: oracle, noisy_<std>, history, learned")
    predictor.fit(warm_trees)
    return predictor


def run_arm(arm: str, setting: str, env: SimulatorEnvironment, pool: Sequence[Prompt], warm: list[RolloutTree],
            acfg: AllocationConfig, *, seed: int, num_steps: int, window_steps: int, score_predictor: bool
            ) -> tuple[list[dict], list[dict]]:
    """``num_steps`` simulated steps of one arm with one predictor setting; (per-step metrics, predictor scores)."""
    spec = get_arm(arm)
    predictor = make_setting_predictor(setting, env, warm) if spec.uses_predictor else None
    learns = setting in ("history", "learned") and predictor is not None
    window: deque[list[RolloutTree]] = deque(maxlen=window_steps)
    state = make_allocator_state(spec, acfg)
    steps, scores = [], []
    for step in range(num_steps):
        trees, metrics = simulated_step(spec, env, pool, predictor, acfg, seed=seed, step=step, state=state)
        steps.append(metrics)
        if predictor is not None and score_predictor:
            scores.append(predictor_quality(predictor, probe_trees(env, pool, acfg, seed=seed, step=step)))
        if learns:
            window.append(trees)
            predictor.fit([t for step_trees in window for t in step_trees])
    return steps, scores


# ================================================================================================
# Aggregation, figure, entry point
# ================================================================================================
METRIC_KEYS = ("effective_ratio", "effective_token_ratio", "mixed_group_ratio", "active_prompt_ratio", "mixed_groups",
               "mixed_prompt_groups", "mixed_anchor_groups", "anchor_contrast", "prefix_anchor_contrast",
               "contrast_per_continuation", "root_contrast_per_rollout", "tokens/generated", "rollout/trajectories",
               "rollout/prompts", "rollout/branches") + AUDIT_METRIC_KEYS


def per_seed_means(steps: list[dict]) -> dict[str, float]:
    out = {}
    for key in METRIC_KEYS:
        key_in = "allocation/anchor_contrast" if key == "anchor_contrast" else key
        values = [s[key_in] for s in steps if key_in in s and np.isfinite(s[key_in])]
        out[key] = float(np.mean(values)) if values else float("nan")
    return out


def plot(summary: dict, settings_order: Sequence[str], arms: Sequence[str], path) -> None:
    plt = pyplot()
    panels = (("effective_ratio", "effective ratio"), ("effective_token_ratio", "effective token ratio"),
              ("mixed_groups", "mixed groups per step"), ("prefix_anchor_contrast", "sum V(1-V) at stage-2 anchors"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)))
    width = 0.8 / len(settings_order)
    colors = {setting: f"C{i}" for i, setting in enumerate(settings_order)}
    colors["none"] = "0.55"
    for ax, (key, label) in zip(axes, panels):
        for a_idx, arm in enumerate(arms):
            cells = [("none", 0.0)] if not get_arm(arm).uses_predictor else [
                (setting, (s_idx - (len(settings_order) - 1) / 2) * width)
                for s_idx, setting in enumerate(settings_order)]
            for setting, offset in cells:
                stat = summary[arm][setting]["metrics"][key]
                ax.bar(a_idx + offset, stat["mean"], width=width, yerr=stat["std"], capsize=2, color=colors[setting])
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels(arms, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    names = ["none"] + list(settings_order)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    axes[0].legend(handles, ["no predictor"] + list(settings_order), fontsize=8, ncol=len(names), loc="upper left")
    axes[0].set_title("Allocation quality on the simulator at equal trajectories per step (mean +- std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; returns the results (also written to ``--out``)."""
    args = parse_args(__doc__.splitlines()[0], argv)
    started = time.perf_counter()
    acfg = AllocationConfig()  # the default budget: T=128 trajectories, B=32 candidates, n=8, N=1
    window_steps = PredictorConfig().window_steps
    if args.quick:
        seeds, num_steps, pool_prompts = [0, 1], 2, 64
        predictor_settings = ["oracle", "learned"]
    else:
        seeds, num_steps, pool_prompts = [0, 1, 2, 3, 4], 32, 256
        predictor_settings = ["oracle", "noisy_0.5", "noisy_1.0", "history", "learned"]
    sim_cfg = SimulatorConfig(num_prompts=pool_prompts)
    arms = list(ARMS)
    settings = {"allocation": acfg.model_dump(mode="json"), "simulator": sim_cfg.model_dump(mode="json"),
                "seeds": seeds, "steps_per_seed": num_steps, "predictors": predictor_settings,
                "window_steps": window_steps, "warm_start": {"group_size": SEED_GROUP_SIZE,
                                                             "expansion_ratio": SEED_EXPANSION_RATIO,
                                                             "prompts": pool_prompts}}
    per_seed: dict[str, dict[str, list[dict]]] = {}
    scores: dict[str, list[dict]] = {}
    learned_prior = []
    for seed in seeds:
        env = SimulatorEnvironment(sim_cfg, seed=seed)
        pool = env.prompts("train")
        warm = seed_trees(env, pool, seed)
        learned_prior.append(empirical_bayes_prior(warm))
        for arm in arms:
            for setting in (predictor_settings if get_arm(arm).uses_predictor else ["none"]):
                steps, step_scores = run_arm(arm, setting, env, pool, warm, acfg, seed=seed, num_steps=num_steps,
                                             window_steps=window_steps, score_predictor=arm == "trace")
                per_seed.setdefault(arm, {}).setdefault(setting, []).append(per_seed_means(steps))
                if step_scores:
                    scores.setdefault(setting, []).extend(step_scores)

    summary: dict[str, dict] = {}
    for arm, by_setting in per_seed.items():
        for setting, seed_means in by_setting.items():
            summary.setdefault(arm, {})[setting] = {
                "metrics": {k: mean_std([m[k] for m in seed_means]) for k in METRIC_KEYS},
                "per_seed_effective_ratio": [m["effective_ratio"] for m in seed_means]}

    def cell(arm: str, setting: str) -> list[dict]:
        return per_seed[arm][setting if get_arm(arm).uses_predictor else "none"]

    ratios: dict[str, dict] = {}
    for setting in predictor_settings:
        for arm in arms:
            for key in ("effective_ratio", "effective_token_ratio", "mixed_groups"):
                vs_grpo = [a[key] / b[key] for a, b in zip(cell(arm, setting), cell("grpo", setting))]
                ratios.setdefault(setting, {}).setdefault(arm, {})[f"{key}_vs_grpo"] = mean_std(vs_grpo)
                if setting != "oracle" and get_arm(arm).uses_predictor:
                    vs_oracle = [a[key] / b[key] for a, b in zip(cell(arm, setting), cell(arm, "oracle"))]
                    ratios[setting][arm][f"{key}_vs_oracle"] = mean_std(vs_oracle)
    predictor_scores = {s: {k: mean_std([x[k] for x in rows if k in x and np.isfinite(x[k])])
                            for k in ("brier", "ece", "auc", "root_auc", "prefix_auc")} for s, rows in scores.items()}
    trace_oracle = ratios["oracle"]["trace"]["effective_ratio_vs_grpo"]["mean"]
    learned_vs_oracle = ratios.get("learned", {}).get("trace", {}).get("effective_ratio_vs_oracle", {}).get("mean")
    headline = {
        "trace_oracle_effective_ratio": summary["trace"]["oracle"]["metrics"]["effective_ratio"],
        "grpo_effective_ratio": summary["grpo"]["none"]["metrics"]["effective_ratio"],
        "trace_oracle_vs_grpo_effective_ratio": ratios["oracle"]["trace"]["effective_ratio_vs_grpo"],
        "trace_learned_vs_oracle_effective_ratio": ratios.get("learned", {}).get("trace", {}).get(
            "effective_ratio_vs_oracle"),
        "targets": {"trace_oracle_at_least_1.5x_grpo": bool(trace_oracle >= 1.5),
                    "trace_learned_at_least_0.9x_oracle": None if learned_vs_oracle is None
                    else bool(learned_vs_oracle >= 0.9)},
    }
    headline["allocators_on_one_budget"] = allocator_comparison(per_seed, predictor_settings)
    results = {"headline": headline, "summary": summary, "ratios": ratios, "predictor_quality": predictor_scores,
               "learned_prior_alpha_beta": [list(map(float, ab)) for ab in learned_prior]}
    plot(summary, predictor_settings, arms, figure_path(NAME, args.out))
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


# the prompt-level allocators of the field that read no success predictor (trace.allocation.reinforce_ada, greso,
# mopps, vip), set against grpo and against trace with the oracle and the learned predictor
FIELD_ALLOCATORS = ("reinforce_ada", "greso", "mopps", "vip")


def allocator_comparison(per_seed: dict, predictor_settings: Sequence[str]) -> dict:
    """Per field allocator: its effective ratio, trajectories per step, and per-seed paired comparisons.

    Args:
        per_seed: ``{arm: {setting: [per-seed means]}}`` of ``main`` (setting ``"none"`` for predictor-free arms).
        predictor_settings: the settings run; ``trace`` is compared at ``oracle`` and, when run, ``learned``.

    Returns:
        ``{arm: {"predictor_free", "effective_ratio", "trajectories_per_step", "minus_grpo", "ratio_vs_grpo",
        "ratio_vs_trace_<setting>"}}``: 95 % t-intervals over seeds (``t_interval``) of the per-seed values, of
        the paired per-seed difference and of the paired per-seed ratio (same seed = same candidates).
    """
    out = {}
    for arm in FIELD_ALLOCATORS:
        if arm not in per_seed:
            continue
        mine = per_seed[arm]["none"]
        row = {"predictor_free": not get_arm(arm).uses_predictor,
               "effective_ratio": t_interval([m["effective_ratio"] for m in mine]),
               "trajectories_per_step": t_interval([m["rollout/trajectories"] for m in mine]),
               "minus_grpo": t_interval([a["effective_ratio"] - b["effective_ratio"]
                                         for a, b in zip(mine, per_seed["grpo"]["none"])]),
               "ratio_vs_grpo": t_interval([a["effective_ratio"] / b["effective_ratio"]
                                            for a, b in zip(mine, per_seed["grpo"]["none"])])}
        for setting in ("oracle", "learned"):
            if setting in predictor_settings:
                row[f"ratio_vs_trace_{setting}"] = t_interval([a["effective_ratio"] / b["effective_ratio"]
                                                               for a, b in zip(mine, per_seed["trace"][setting])])
        out[arm] = row
    return out


# ================================================================================================
# Stage-1 objectives compared
# ================================================================================================
OBJECTIVE_ARMS = ("trace", "trace_root")


def t_interval(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Mean and two-sided t-interval over seeds: ``mean +- t_{(1+level)/2, n-1} s / sqrt(n)``.

    Returns:
        ``{"mean", "low", "high", "half_width", "n"}``; with one value the half width is NaN (no interval).
    """
    from scipy.stats import t as student_t

    stat = mean_std(values)
    n = stat["n"]
    half = (float(student_t.ppf(0.5 + level / 2, n - 1)) * stat["std"] / math.sqrt(n)) if n > 1 else float("nan")
    return {"mean": stat["mean"], "low": stat["mean"] - half, "high": stat["mean"] + half, "half_width": half, "n": n}


def objective_comparison(seeds: Sequence[int], num_steps: int, pool_prompts: int, m_mins: Sequence[int],
                         predictor_settings: Sequence[str], window_steps: int) -> dict:
    """Effective ratio of ``trace`` and ``trace_root`` under both stage-1 objectives, per ``m_min`` and predictor.

    Every cell runs ``run_arm`` on the same seeds, pools, warm starts and candidates; only
    ``allocation.m_min`` and ``allocation.root_objective`` change. ``grpo`` (which reads neither) is the
    reference.

    Returns:
        ``{"m_min=<k>": {setting: {arm: {objective: {"effective_ratio": t_interval, ...}}, "grpo": ...}}}``
        plus, per arm, ``"leaves_minus_groups"``: the paired per-seed difference of effective ratios.
    """
    sim_cfg = SimulatorConfig(num_prompts=pool_prompts)
    keys = ("effective_ratio", "effective_token_ratio", "active_prompt_ratio", "mixed_groups")
    cells: dict[tuple, list[dict]] = {}
    for seed in seeds:
        env = SimulatorEnvironment(sim_cfg, seed=seed)
        pool = env.prompts("train")
        warm = seed_trees(env, pool, seed)
        grpo_steps, _ = run_arm("grpo", "none", env, pool, warm, AllocationConfig(), seed=seed, num_steps=num_steps,
                                window_steps=window_steps, score_predictor=False)
        cells.setdefault(("grpo",), []).append(per_seed_means(grpo_steps))
        for m_min in m_mins:
            for objective in ("groups", "leaves"):
                acfg = AllocationConfig(m_min=m_min, root_objective=objective)
                for setting in predictor_settings:
                    for arm in OBJECTIVE_ARMS:
                        steps, _ = run_arm(arm, setting, env, pool, warm, acfg, seed=seed, num_steps=num_steps,
                                           window_steps=window_steps, score_predictor=False)
                        cells.setdefault((m_min, setting, arm, objective), []).append(per_seed_means(steps))
    grpo = {k: t_interval([m[k] for m in cells[("grpo",)]]) for k in keys}
    out: dict[str, dict] = {"grpo": grpo}
    for m_min in m_mins:
        for setting in predictor_settings:
            row = out.setdefault(f"m_min={m_min}", {}).setdefault(setting, {})
            for arm in OBJECTIVE_ARMS:
                by_objective = {obj: cells[(m_min, setting, arm, obj)] for obj in ("groups", "leaves")}
                row[arm] = {obj: {k: t_interval([m[k] for m in seed_means]) for k in keys}
                            for obj, seed_means in by_objective.items()}
                row[arm]["leaves_minus_groups"] = t_interval(
                    [b["effective_ratio"] - a["effective_ratio"]
                     for a, b in zip(by_objective["groups"], by_objective["leaves"])])
    return out


def plot_objectives(results: dict, m_mins: Sequence[int], settings_order: Sequence[str], path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(m_mins), figsize=(6 * len(m_mins), 3.6), squeeze=False)
    for ax, m_min in zip(axes[0], m_mins):
        labels, x = [], 0
        for setting in settings_order:
            for arm in OBJECTIVE_ARMS:
                for offset, (objective, color) in enumerate((("groups", "C0"), ("leaves", "C1"))):
                    stat = results[f"m_min={m_min}"][setting][arm][objective]["effective_ratio"]
                    err = 0.0 if not math.isfinite(stat["half_width"]) else stat["half_width"]
                    ax.bar(x + 0.4 * offset, stat["mean"], width=0.4, yerr=err, capsize=2, color=color,
                           label=objective if x == 0 else None)
                labels.append(f"{arm}\n{setting}")
                x += 1
        ax.axhline(results["grpo"]["effective_ratio"]["mean"], color="grey", linestyle=":", label="grpo")
        ax.set_xticks([i + 0.2 for i in range(x)])
        ax.set_xticklabels(labels, fontsize=7)
        ax.set(title=f"m_min = {m_min}", ylabel="effective ratio (mean, 95% t-interval over seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_objectives(argv: Sequence[str] | None = None) -> dict:
    """``--compare-objectives``: the stage-1 objective comparison; returns the results (also written)."""
    from benchmarks.common import REPORT_DIR

    parser = argparse.ArgumentParser(description="Stage-1 objectives groups vs leaves on the simulator")
    parser.add_argument("--quick", action="store_true", help="2 seeds, 2 steps, 64 prompts, oracle only")
    parser.add_argument("--out", default=str(REPORT_DIR), help="folder for the JSON and PNG")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..S-1 (default 5; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per seed (default 8; quick 2)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    name = "allocation_objectives"
    seeds = list(range(args.seeds or (2 if args.quick else 5)))
    num_steps = args.steps or (2 if args.quick else 8)
    pool_prompts = 64 if args.quick else 256
    predictor_settings = ["oracle"] if args.quick else ["oracle", "learned"]
    m_mins = (4, 8)
    window_steps = PredictorConfig().window_steps
    results = objective_comparison(seeds, num_steps, pool_prompts, m_mins, predictor_settings, window_steps)
    results["headline"] = {"targets": {}, "effective_ratio_leaves_minus_groups": {
        f"{arm}/{setting}/m_min={m}": results[f"m_min={m}"][setting][arm]["leaves_minus_groups"]
        for m in m_mins for setting in predictor_settings for arm in OBJECTIVE_ARMS}}
    settings = {"allocation": AllocationConfig().model_dump(mode="json"), "m_min": list(m_mins), "seeds": seeds,
                "steps_per_seed": num_steps, "pool_prompts": pool_prompts, "predictors": predictor_settings}
    plot_objectives(results, m_mins, predictor_settings, figure_path(name, args.out))
    write_report(name, args.out, settings, results, quick=args.quick, started=started)
    return results


if __name__ == "__main__":
    if "--compare-objectives" in sys.argv[1:]:
        compare_objectives([a for a in sys.argv[1:] if a != "--compare-objectives"])
    else:
        main()
