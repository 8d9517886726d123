"""Allocation quality of every arm on the martingale simulator, at the same trajectory budget and seeds.

Each simulated training step is the training loop's step (``trace.loop.Trainer.step``) with the language
model replaced by the simulator's tree sampler: the same candidate prompts for every arm
(``trace.loop.candidate_indices``), root scores from the predictor, ``plan_root_counts`` (or ``run_dapo``),
``SimulatorEnvironment.sample_root_rollouts``, ``split_expansion_budget``, anchor scores at every candidate
anchor, ``plan_expansion`` and ``sample_continuations``; then the loop's own metrics
(``trace.metrics.rollout_metrics``). There is no policy update: the simulator's success probabilities do
not move, so steps differ only in their candidates and draws.

Predictors (``--quick`` runs oracle and learned only):
- ``oracle``: the true ``V(H)`` (``make_predictor`` kind ``oracle``);
- ``noisy_0.5``, ``noisy_1.0``: ``sigmoid(logit V + eps)``, ``eps ~ N(0, s^2)`` fixed per prefix
  (kind ``noisy_oracle``, ``noise_std = s``);
- ``history``: the library's per-prompt Beta-Bernoulli posterior of past root-rollout rewards (kind
  ``history``, prior Beta(1, 1)); roots only, every prefix gets its prompt's posterior mean;
- ``learned``: ``HistoryPathPredictor`` below, which sees only what a predictor beside a real policy could
  see: past rewards of the prompt and the observation texts along the prefix. Roots: the per-prompt
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

Arms without a predictor (``grpo``, ``dapo``, ``tree_random``, ``treepo``) do not depend on it and run once
per seed. Reported per arm and predictor, as mean and sample std over seeds of the per-seed mean over steps:
``effective_ratio``, ``effective_token_ratio``, ``mixed_group_ratio``, ``active_prompt_ratio``, the number of
mixed groups (prompt groups and branch-anchor groups), ``anchor_contrast`` (the loop's metric: the sum of
``V(1 - V)`` over allocated roots and anchors), ``prefix_anchor_contrast`` (stage-2 anchors only) and
``contrast_per_continuation`` (``sum K V(1 - V) / sum K`` over stage-2 anchors), generated tokens and
trajectories. Ratios against ``grpo`` and against ``oracle`` are formed per seed, then summarised.

Simplifications: one expansion round (the paper default); the pool is ``pool_prompts`` prompts of the
default difficulty mix (U-shaped ``Beta(0.3, 0.3)``), so candidates recur every ``pool / B`` steps and the
history-based predictors see each prompt again.

Usage: ``python -m benchmarks.allocation_quality [--quick]``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Sequence

import numpy as np

from benchmarks.common import figure_path, mean_std, parse_args, pyplot, write_report
from trace.allocation.baselines import ABLATIONS, AblationSpec, NoMixedGroupError, get_ablation, plan_expansion, \
    plan_root_counts, run_dapo
from trace.allocation.prefix import candidate_anchors, split_expansion_budget
from trace.config import AllocationConfig, PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.base import Prompt
from trace.envs.simulator import OBS_DOWN, OBS_UP, SimulatorEnvironment
from trace.loop import candidate_indices, step_rng
from trace.metrics import rollout_metrics
from trace.predictor import (
    HistoryPredictor,
    brier_score,
    expected_calibration_error,
    labelled_node_ids,
    make_predictor,
    roc_auc,
)
from trace.tree import Origin, RolloutTree

NAME = "allocation_quality"
PREDICTOR_FREE = ("grpo", "dapo", "tree_random", "treepo")
SEED_GROUP_SIZE = 4  # SeedRolloutConfig.group_size default
SEED_EXPANSION_RATIO = 0.5  # SeedRolloutConfig.expansion_ratio default


# ================================================================================================
# A learned predictor for the simulator
# ================================================================================================
def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def empirical_bayes_prior(trees: Sequence[RolloutTree], min_concentration: float = 0.05) -> tuple[float, float]:
    """Beta prior ``(alpha, beta)`` of per-prompt success rates, moment-matched to root-rollout outcomes.

    For prompts each with ``n`` root rollouts and ``s_u`` successes, the beta-binomial model gives
    ``E[s/n] = mu`` and ``Var[s/n] = mu (1 - mu) (1 + (n - 1) rho) / n`` with ``rho = 1 / (alpha + beta + 1)``;
    solving for ``rho`` from the observed mean and variance gives ``alpha + beta = 1 / rho - 1``.

    Args:
        trees: trees whose ``ROLLOUT`` leaves are the outcomes (one tree per prompt; ``n`` may vary, its
            mean is used).
        min_concentration: floor of ``alpha + beta`` (a population more polarised than the data can show).

    Returns:
        ``(alpha, beta)``, both > 0.

    Raises:
        ValueError: fewer than two prompts, or a mean of fewer than two rollouts per prompt.

    References:
        Method-of-moments for the beta-binomial: Skellam (1948), JRSS B 10(2); Kleinman (1973), JASA 68.
    """
    rates, sizes = [], []
    for tree in trees:
        rewards = [0.0 if leaf.reward is None else float(leaf.reward) for leaf in tree.leaves()
                   if leaf.origin == Origin.ROLLOUT]
        if rewards:
            rates.append(float(np.mean(rewards)))
            sizes.append(len(rewards))
    n = float(np.mean(sizes)) if sizes else 0.0
    if len(rates) < 2 or n < 2:
        raise ValueError(f"need >= 2 prompts with >= 2 root rollouts each to fit a prior, got {len(rates)} "
                         f"prompts with {n:.1f} rollouts on average")
    mu = float(np.clip(np.mean(rates), 1e-3, 1 - 1e-3))
    var = float(np.var(rates, ddof=1))
    rho = (n * var / (mu * (1.0 - mu)) - 1.0) / (n - 1.0)
    concentration = max(1.0 / float(np.clip(rho, 1e-3, 0.999)) - 1.0, min_concentration)
    return mu * concentration, (1.0 - mu) * concentration


class HistoryPathPredictor:
    """``V_hat`` from a prompt's past outcomes and a prefix's observation texts (see the module docstring).

    Roots: the posterior mean of ``trace.predictor.HistoryPredictor`` (Beta prior ``(alpha, beta)``), leaving
    out the tree's own rollouts when the tree was already counted. A prefix ``H`` ending at a turn node:
    ``sigmoid(x . w)`` with features ``x = [1, z, z log(1 + n), u - d, last, t]``, where ``z`` is the logit of
    the prompt's posterior mean from ``n`` outcomes (earlier trees plus the tree's root rollouts not below
    ``H``), ``u`` / ``d`` count ``progress up`` / ``progress down`` observations on the path, ``last`` is
    the last one (+1 / -1) and ``t`` the number of turns so far. ``w`` is the L2-regularised weighted
    logistic regression (Newton's method) on the labelled prefixes of the fitted window: label the mean
    descendant-leaf reward, weight the leaf count, as the library's predictors use.

    Args:
        prior_alpha, prior_beta: Beta prior of per-prompt success rates.
        clip: predictions are clipped to ``[clip, 1 - clip]`` (``PredictorConfig.clip``).
        l2: ridge penalty on the non-intercept weights.
    """

    kind = "history_path"
    num_features = 6

    def __init__(self, prior_alpha: float, prior_beta: float, *, clip: float = 0.02, l2: float = 1e-2) -> None:
        cfg = PredictorConfig(kind=PredictorKind.HISTORY, prior_alpha=prior_alpha, prior_beta=prior_beta, clip=clip)
        self.history = HistoryPredictor(cfg)
        self.clip = clip
        self.l2 = l2
        self.weights: np.ndarray | None = None

    # ---- features -------------------------------------------------------------------------------------
    def _tree_features(self, tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
        """Per node of ``tree``: the prompt evidence's posterior mean (N,) and the features (N, F)."""
        num_nodes = len(tree.nodes)
        succ_below = np.zeros(num_nodes)
        fail_below = np.zeros(num_nodes)
        has_child = np.zeros(num_nodes, dtype=bool)
        for node in tree.nodes[1:]:
            has_child[node.parent_id] = True
        for node in tree.nodes[1:]:
            if not has_child[node.node_id] and node.origin == Origin.ROLLOUT:
                reward = 0.0 if node.reward is None else float(node.reward)
                succ_below[node.node_id] = reward
                fail_below[node.node_id] = 1.0 - reward
        for node in reversed(tree.nodes[1:]):
            succ_below[node.parent_id] += succ_below[node.node_id]
            fail_below[node.parent_id] += fail_below[node.node_id]
        alpha, beta = self.history.posterior([tree.prompt_uid])
        counted = tree.tree_id in self.history.counted_tree_ids
        # evidence = earlier trees + this tree's root rollouts, less the rollouts below the node itself
        succ = alpha[0] + (0.0 if counted else succ_below[0]) - succ_below
        fail = beta[0] + (0.0 if counted else fail_below[0]) - fail_below
        mean = succ / (succ + fail)
        num_outcomes = succ + fail - self.history.cfg.prior_alpha - self.history.cfg.prior_beta
        z = _logit(np.clip(mean, 1e-4, 1 - 1e-4))
        ups = np.zeros(num_nodes)
        downs = np.zeros(num_nodes)
        last = np.zeros(num_nodes)
        turns = np.zeros(num_nodes)
        for node in tree.nodes[1:]:
            parent = node.parent_id
            up, down = node.observation_text == OBS_UP, node.observation_text == OBS_DOWN
            ups[node.node_id] = ups[parent] + up
            downs[node.node_id] = downs[parent] + down
            last[node.node_id] = 1.0 if up else (-1.0 if down else 0.0)
            turns[node.node_id] = turns[parent] + 1
        features = np.stack([np.ones(num_nodes), z, z * np.log1p(np.maximum(num_outcomes, 0.0)), ups - downs, last,
                             turns], axis=1)
        return mean, features

    # ---- the SuccessPredictor interface the benchmark uses --------------------------------------------
    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str], root_token_ids=None) -> np.ndarray:
        """(B,) float64 posterior means of the prompts, clipped."""
        return self.history.predict_prompts(prompts, root_texts)

    def predict_trees(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One (K_i,) float64 array of predictions per tree, clipped to ``[clip, 1 - clip]``."""
        out = []
        for tree, ids in zip(trees, node_ids):
            ids = np.asarray(ids, dtype=np.int64)
            mean, features = self._tree_features(tree)
            pred = mean[ids].copy()
            turn = ids > 0
            if self.weights is not None and turn.any():
                pred[turn] = _sigmoid(features[ids[turn]] @ self.weights)
            out.append(np.clip(pred, self.clip, 1.0 - self.clip))
        return out

    def predict_nodes(self, tree: RolloutTree, node_ids: Sequence[int]) -> np.ndarray:
        return self.predict_trees([tree], [node_ids])[0]

    def fit(self, trees: Sequence[RolloutTree], newton_steps: int = 25) -> dict[str, float]:
        """Count the new trees' root outcomes, then refit the prefix regression on every labelled turn node.

        Returns:
            ``predictor/fit_examples`` (turn nodes) and ``predictor/fit_loss`` (weighted log loss, nats).
        """
        self.history.fit(trees)
        rows, labels, weights = [], [], []
        for tree in trees:
            ids = [i for i in labelled_node_ids(tree) if i > 0]
            if not ids:
                continue
            label, weight = tree.node_success_labels()
            rows.append(self._tree_features(tree)[1][ids])
            labels.append(label[ids])
            weights.append(weight[ids])
        if not rows:
            return {"predictor/fit_examples": 0.0}
        x, y, w = np.concatenate(rows), np.concatenate(labels), np.concatenate(weights)
        coef = np.zeros(self.num_features) if self.weights is None else self.weights.copy()
        penalty = np.full(self.num_features, self.l2 * w.sum())
        penalty[0] = 0.0
        for _ in range(newton_steps):
            prob = _sigmoid(x @ coef)
            grad = x.T @ (w * (prob - y)) + penalty * coef
            hess = (x * (w * prob * (1.0 - prob))[:, None]).T @ x + np.diag(penalty + 1e-9)
            step = np.linalg.solve(hess, grad)
            coef -= step
            if np.max(np.abs(step)) < 1e-8:
                break
        self.weights = coef
        prob = np.clip(_sigmoid(x @ coef), 1e-12, 1 - 1e-12)
        loss = -np.sum(w * (y * np.log(prob) + (1 - y) * np.log1p(-prob))) / w.sum()
        return {"predictor/fit_examples": float(y.size), "predictor/fit_loss": float(loss)}


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


def simulated_step(spec: AblationSpec, env: SimulatorEnvironment, pool: Sequence[Prompt], predictor: Any,
                   acfg: AllocationConfig, *, seed: int, step: int) -> tuple[list[RolloutTree], dict[str, float]]:
    """One training step of arm ``spec`` with the simulator in place of the policy (no update).

    Returns:
        ``(trees, metrics)``: every tree sampled this step, and ``rollout_metrics`` plus the mixed-group
        counts and contrast metrics of ``count_mixed_groups`` / ``contrast_metrics``.
    """
    idx = candidate_indices(len(pool), acfg.num_candidates, seed, step)
    candidates = [pool[i] for i in idx]
    tie_keys = [p.prompt_uid for p in candidates]
    roots_rng = step_rng(seed, step, "sim-roots")
    metrics: dict[str, float] = {}
    if spec.uses_predictor:
        pred = np.asarray(predictor.predict_prompts(candidates, [p.question for p in candidates]), dtype=np.float64)
    else:
        pred = np.full(len(candidates), np.nan)
    if spec.root_rule == "dapo":
        sampled: list[RolloutTree] = []

        def rollout_fn(cand_idx: np.ndarray, n: int) -> list[np.ndarray]:
            trees = env.sample_root_rollouts([candidates[i] for i in cand_idx], [n] * len(cand_idx), roots_rng,
                                             step=step, ablation=spec.name)
            sampled.extend(trees)
            return [t.leaf_rewards() for t in trees]

        try:
            result = run_dapo(rollout_fn, len(candidates), acfg.group_size, acfg.trajectory_budget,
                              acfg.dapo_max_retries, step_rng(seed, step, "dapo"))
            metrics["dapo/rounds"] = float(result.num_rounds)
        except NoMixedGroupError as err:
            metrics["dapo/rounds"] = float(err.num_rounds)
            metrics["dapo/no_mixed_group"] = 1.0
        trees = sampled
    else:
        plan = plan_root_counts(spec, pred, trajectory_budget=acfg.trajectory_budget,
                                expansion_ratio=acfg.expansion_ratio, group_size=acfg.group_size,
                                m_min=acfg.m_min, m_max=acfg.m_max, knapsack_m_min=acfg.knapsack_m_min,
                                tie_keys=tie_keys, exact_max_cells=acfg.exact_max_cells)
        active = np.flatnonzero(plan.counts)
        counts = plan.counts[active]
        trees = env.sample_root_rollouts([candidates[i] for i in active], counts, roots_rng, step=step,
                                         ablation=spec.name)
        for tree, i in zip(trees, active):
            if spec.uses_predictor:
                tree.root.pred_success_prob = float(pred[i])
            tree.root.num_branches = int(plan.counts[i])  # as the training loop records roots
        if spec.has_expansion and plan.expansion_budget > 0:
            budgets = split_expansion_budget(counts, plan.expansion_budget)
            anchor_probs = None
            if spec.prefix_rule == "trace":
                ids = [[node_id for node_id, _ in candidate_anchors(tree)] for tree in trees]
                anchor_probs = {}
                for t_idx, (tree, tree_ids, preds) in enumerate(zip(trees, ids, predictor.predict_trees(trees, ids))):
                    for node_id, v in zip(tree_ids, preds):
                        anchor_probs[(t_idx, node_id)] = float(v)
                        tree.nodes[node_id].pred_success_prob = float(v)
            expansion = plan_expansion(spec, trees, anchor_probs, budgets, step_rng(seed, step, "expand0"),
                                       acfg.treepo_width)
            env.sample_continuations(trees, expansion.counts, step_rng(seed, step, "sim-branches"))
            if expansion.unspent > 0:
                # as the loop does when no trajectory has a non-terminal prefix: extra bare rollouts
                extra = split_expansion_budget(counts, expansion.unspent)
                env.sample_continuations(trees, {(i, 0): int(k) for i, k in enumerate(extra) if k > 0},
                                         step_rng(seed, step, "sim-extra-roots"))
                metrics["allocation/extra_root_rollouts"] = float(expansion.unspent)
    metrics.update(rollout_metrics(trees, num_candidates=len(candidates)))
    num_prompt, num_anchor = count_mixed_groups(trees)
    metrics.update({"mixed_groups": float(num_prompt + num_anchor), "mixed_prompt_groups": float(num_prompt),
                    "mixed_anchor_groups": float(num_anchor)})
    metrics.update(contrast_metrics(trees))
    return trees, metrics


def seed_trees(env: SimulatorEnvironment, pool: Sequence[Prompt], seed: int) -> list[RolloutTree]:
    """Warm-start data as the ``seed_rollouts`` stage draws it: bare rollouts plus random-anchor continuations."""
    rng = step_rng(seed, -1, "sim-seed")
    trees = env.sample_root_rollouts(pool, [SEED_GROUP_SIZE] * len(pool), rng, step=-1, ablation="seed")
    budgets = split_expansion_budget(np.full(len(trees), SEED_GROUP_SIZE),
                                     int(round(SEED_GROUP_SIZE * SEED_EXPANSION_RATIO * len(trees))))
    plan = plan_expansion(get_ablation("tree_random"), trees, None, budgets, rng)
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
    spec = get_ablation(arm)
    predictor = make_setting_predictor(setting, env, warm) if spec.uses_predictor else None
    learns = setting in ("history", "learned") and predictor is not None
    window: deque[list[RolloutTree]] = deque(maxlen=window_steps)
    steps, scores = [], []
    for step in range(num_steps):
        trees, metrics = simulated_step(spec, env, pool, predictor, acfg, seed=seed, step=step)
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
               "rollout/prompts", "rollout/branches")


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
            cells = [("none", 0.0)] if arm in PREDICTOR_FREE else [
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
    arms = list(ABLATIONS)
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
            for setting in (["none"] if arm in PREDICTOR_FREE else predictor_settings):
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
        return per_seed[arm]["none" if arm in PREDICTOR_FREE else setting]

    ratios: dict[str, dict] = {}
    for setting in predictor_settings:
        for arm in arms:
            for key in ("effective_ratio", "effective_token_ratio", "mixed_groups"):
                vs_grpo = [a[key] / b[key] for a, b in zip(cell(arm, setting), cell("grpo", setting))]
                ratios.setdefault(setting, {}).setdefault(arm, {})[f"{key}_vs_grpo"] = mean_std(vs_grpo)
                if setting != "oracle" and arm not in PREDICTOR_FREE:
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
    results = {"headline": headline, "summary": summary, "ratios": ratios, "predictor_quality": predictor_scores,
               "learned_prior_alpha_beta": [list(map(float, ab)) for ab in learned_prior]}
    plot(summary, predictor_settings, arms, figure_path(NAME, args.out))
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


if __name__ == "__main__":
    main()
