"""One allocation step of any arm over a sampler: roots, stage-2 expansion, and the step's diagnostics.

``allocate_step`` is the part of a training step that decides and samples the step's trajectories: score
the candidates (arms that read the predictor), the arm's root rule (``plan_root_counts``), the bare root
rollouts, stage 2 in ``rounds`` rounds (score the candidate anchors where the prefix rule needs them,
``plan_expansion``, continuations), and extra root rollouts for continuations no tree could take. The
sampler (``StepSampler``) is the only part that differs between the policy's rollout engine
(``trace.allocation.samplers.PolicySampler``) and the simulator (``SimulatorSampler``).

Invariant: every arm samples exactly ``allocation.trajectory_budget`` trajectories, except ``dapo``, which
samples at most that many. Random streams are named by purpose (``rng_for("expand0")``) and sampler
salts (``"roots"``, ``"dapo<k>"``, ``"ada<r>"``, ``"branch<r>"``, ``"extra_roots"``), so a step's draws depend
only on the caller's seeding, never on another arm's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from trace.allocation.arms import plan_root_counts, root_budget_for
from trace.allocation.dapo import NoMixedGroupError
from trace.allocation.prefix import candidate_anchors, split_expansion_budget
from trace.allocation.prefix_rules import plan_expansion
from trace.allocation.registry import Arm, get_prefix_rule
from trace.tree import RolloutTree

__all__ = ["EXPLORING_ROOT_RULES", "AnchorChoice", "StepSampler", "StepResult", "allocate_step", "exploration_draw",
           "exploration_split", "explores"]

# root rules that pass over candidates by forecast, so their predictor sees few outcomes of the prompts it ranks low
EXPLORING_ROOT_RULES = ("trace", "pcl")


@runtime_checkable
class StepSampler(Protocol):
    """What a step needs from whatever produces trajectories and scores them."""

    def score_prompts(self, prompts: Sequence) -> np.ndarray:
        """(B,) float64 predicted success probability of each candidate prompt."""

    def score_anchors(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One (K_i,) array of predicted success probabilities per tree, for the given node ids."""

    def sample_roots(self, prompts: Sequence, counts: Sequence[int], salt: str) -> list[RolloutTree]:
        """One tree per prompt, in prompt order, with ``counts[i]`` bare rollouts (counts > 0)."""

    def sample_continuations(self, trees: Sequence[RolloutTree], counts: Mapping[tuple[int, int], int],
                             salt: str) -> None:
        """Append ``K`` continuations below each ``(tree_idx, node_id)`` anchor, in place."""


@dataclass(frozen=True)
class AnchorChoice:
    """One anchor stage 2 branched, as the prefix rule saw it when it chose it (read by ``trace.reporting.audit``).

    Attributes:
        tree_idx: the anchor's tree, an index into ``StepResult.trees``.
        node_id: the anchor's node id.
        factual_reward: ``r``, the mean reward of the leaves below the anchor when it was chosen (the one
            trajectory through it; ``candidate_anchors``).
        pred_success_prob: ``v = V_hat(H)`` the prefix rule read; NaN for rules that read no prediction.
        num_continuations: ``K``, the continuations sampled below it in that round.
    """

    tree_idx: int
    node_id: int
    factual_reward: float
    pred_success_prob: float
    num_continuations: int


def _chosen_anchors(trees: Sequence[RolloutTree], counts: Mapping[tuple[int, int], int],
                    anchor_probs: Mapping | None) -> list[AnchorChoice]:
    """One round's anchors with their factual rewards and predictions, before their continuations exist."""
    stats: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out = []
    for (t_idx, node_id), k in sorted(counts.items()):
        num_leaves, reward_sum = stats.setdefault(t_idx, trees[t_idx].subtree_stats())
        v = np.nan if anchor_probs is None else anchor_probs.get((t_idx, node_id), np.nan)
        out.append(AnchorChoice(int(t_idx), int(node_id), float(reward_sum[node_id] / num_leaves[node_id]), float(v),
                                int(k)))
    return out


@dataclass
class StepResult:
    """What one allocation step sampled.

    Attributes:
        trees: the trees to train on (for ``dapo`` only the kept groups).
        sampled_trees: every tree sampled this step (the same list as ``trees`` unless the root rule filters).
        metrics: allocation diagnostics in logging order: ``allocation/root_gap``, ``allocation/root_objective``,
            ``allocation/root_upper_bound`` (stage-1 solvers), the root rule's own (``dapo/rounds``,
            ``dapo/no_mixed_group``, ``dapo/kept_groups``), ``allocation/extra_root_rollouts``.
        timings: seconds, ``time/predict``, ``time/rollout`` (bare rollouts from the roots, extra root
            rollouts included) and (when continuations were sampled) ``time/expand``.
        is_filtered: the root rule kept only some of the trees it sampled (``dapo``; never ``reinforce_ada``, which
            trains on every tree it samples).
        root_pred_success_prob: (len(sampled_trees),) float64 ``p_i`` stage 1 read for each sampled tree;
            NaN for arms that read no predictor.
        root_counts: (len(sampled_trees),) int64 ``m_i``, each sampled tree's bare root rollouts (stage 1).
        anchors: every anchor stage 2 branched (``AnchorChoice``), round by round.
    """

    trees: list[RolloutTree]
    sampled_trees: list[RolloutTree]
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    is_filtered: bool = False
    root_pred_success_prob: np.ndarray = field(default_factory=lambda: np.zeros(0))
    root_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    anchors: list[AnchorChoice] = field(default_factory=list)


def _expand(arm: Arm, trees: list[RolloutTree], counts: np.ndarray, expansion_budget: int, sampler: StepSampler,
            rng_for: Callable[[str], np.random.Generator], rounds: int, treepo_width: int,
            timings: dict, chosen: list[AnchorChoice]) -> int:
    """Stage 2 over ``rounds`` rounds, appending each round's anchors to ``chosen``; returns continuations that
    could not be placed."""
    if not arm.has_expansion or expansion_budget <= 0 or not trees:
        return expansion_budget
    needs_scores = get_prefix_rule(arm.prefix_rule).needs_scores
    per_round = split_expansion_budget(np.array([1] * rounds), expansion_budget)
    new_from: dict[int, list[int]] | None = None
    unspent = 0
    for rnd in range(rounds):
        budgets = split_expansion_budget(counts, int(per_round[rnd]) + unspent)
        anchor_probs = None
        if needs_scores:
            t0 = time.perf_counter()
            anchor_probs = {}
            ids = [[node_id for node_id, _ in candidate_anchors(tree, None if new_from is None
                                                                 else new_from.get(t_idx, []))]
                   for t_idx, tree in enumerate(trees)]
            for t_idx, (tree, node_ids, preds) in enumerate(zip(trees, ids, sampler.score_anchors(trees, ids))):
                for node_id, v in zip(node_ids, preds):
                    anchor_probs[(t_idx, node_id)] = float(v)
                    tree.nodes[node_id].pred_success_prob = float(v)
            timings["time/predict"] = timings.get("time/predict", 0.0) + time.perf_counter() - t0
        plan = plan_expansion(arm, trees, anchor_probs, budgets, rng_for(f"expand{rnd}"), treepo_width,
                              new_only_from=new_from)
        sizes = [len(t.nodes) for t in trees]
        if plan.counts:
            chosen.extend(_chosen_anchors(trees, plan.counts, anchor_probs))
            t0 = time.perf_counter()
            sampler.sample_continuations(trees, plan.counts, f"branch{rnd}")
            timings["time/expand"] = timings.get("time/expand", 0.0) + time.perf_counter() - t0
        new_from = {i: list(range(sizes[i], len(t.nodes))) for i, t in enumerate(trees)}
        unspent = plan.unspent
    return unspent


def explores(arm: Arm) -> bool:
    """Whether ``allocation.explore_groups`` applies to ``arm``: its root rule is one of ``EXPLORING_ROOT_RULES`` and
    it allocates on the predictor's forecasts."""
    return arm.root_rule in EXPLORING_ROOT_RULES and arm.scores == "predictor"


def exploration_draw(arm: Arm, num_candidates: int, explore_groups: int,
                     rng_for: Callable[[str], np.random.Generator]) -> np.ndarray:
    """The candidates that get exploration groups (``allocation.explore_groups``) this step.

    Drawn uniformly without replacement from the step's stream ``"explore"``, before stage 1 reads any forecast, for
    arms whose root rule is one of ``EXPLORING_ROOT_RULES`` and that allocate on the predictor; none otherwise.

    Returns:
        (k,) int64 sorted candidate indices, ``k = min(explore_groups, num_candidates)`` (0 where the arm does not
        explore).
    """
    if not explore_groups or not explores(arm):
        return np.zeros(0, dtype=np.int64)
    k = min(int(explore_groups), int(num_candidates))
    return np.sort(rng_for("explore").choice(num_candidates, size=k, replace=False)).astype(np.int64)


def exploration_split(arm: Arm, num_candidates: int, acfg, rng_for: Callable[[str], np.random.Generator]
                      ) -> tuple[np.ndarray, np.ndarray, int]:
    """``(explore, rest, reserved)``: the step's exploration groups (``exploration_draw``), the other candidates the
    root rule allocates over (sorted indices), and the root rollouts the groups take (``explore_groups`` x
    ``group_size``; 0 where the arm does not explore)."""
    explore = exploration_draw(arm, num_candidates, getattr(acfg, "explore_groups", 0), rng_for)
    rest = np.setdiff1d(np.arange(num_candidates), explore) if explore.size else np.arange(num_candidates)
    return explore, rest, int(explore.size) * acfg.group_size


def allocate_step(arm: Arm, candidates: Sequence, sampler: StepSampler, acfg,
                  rng_for: Callable[[str], np.random.Generator], state=None) -> StepResult:
    """Allocate and sample one step's trajectories for ``arm`` over ``candidates``.

    Args:
        arm: the arm (``trace.allocation.arms.get_arm``).
        candidates: the step's B candidate prompts (``trace.envs.base.Prompt``), in drawing order.
        sampler: rollouts and predictor scores (``StepSampler``).
        acfg: the allocation section (``trace.configuration.config.AllocationConfig``): ``trajectory_budget``,
            ``expansion_ratio``, ``group_size``, ``m_min``, ``m_max``, ``knapsack_m_min``, ``exact_max_cells``,
            ``dapo_max_retries``, ``rounds``, ``treepo_width``, ``explore_groups``: that many candidates
            (``exploration_draw``) get ``group_size`` bare rollouts each out of the root budget, and the root rule
            allocates the rest of it over the other candidates.
        rng_for: ``rng_for(purpose) -> numpy Generator`` of the step (purposes ``"dapo"``, ``"greso"``, ``"mopps"``,
            ``"explore"``, ``"expand<r>"``).
        state: the arm's ``AllocatorState`` (``trace.allocation.arms.make_allocator_state``) for rules that keep
            one across steps; the rule reads it, and once the step is sampled ``state.observe`` receives the
            leaf rewards of every sampled tree (its metrics join the step's). None for stateless rules.

    Returns:
        ``StepResult``. Roots carry ``num_branches`` (their allocated rollouts) and, for arms that read the
        predictor, ``pred_success_prob``; scored anchors carry ``pred_success_prob``.

    Raises:
        ValueError: an infeasible budget or a malformed plan (see ``plan_root_counts``, ``plan_expansion``).
        Whatever the sampler raises propagates, except ``NoMixedGroupError``: the step then trains on nothing
        and logs ``dapo/no_mixed_group``.
    """
    metrics: dict[str, float] = {}
    timings: dict[str, float] = {}
    tie_keys = [p.prompt_uid for p in candidates]

    t0 = time.perf_counter()
    pred = (np.asarray(sampler.score_prompts(candidates), dtype=np.float64) if arm.uses_predictor
            else np.full(len(candidates), np.nan))
    timings["time/predict"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rule_sampled: list[RolloutTree] = []

    explore, rest, reserved = exploration_split(arm, len(candidates), acfg, rng_for)  # reserved: their root rollouts
    rest_keys = [tie_keys[i] for i in rest]

    def sample_groups(cand_idx: np.ndarray, n: int, salt: str) -> list[RolloutTree]:
        # the rule indexes the candidates it was given: those outside the exploration groups
        trees = sampler.sample_roots([candidates[rest[i]] for i in cand_idx], [n] * len(cand_idx), salt)
        rule_sampled.extend(trees)
        return trees

    def sample_more(trees: Sequence[RolloutTree], counts: Sequence[int], salt: str) -> None:
        sampler.sample_continuations(trees, {(i, 0): int(k) for i, k in enumerate(counts) if k > 0}, salt)

    try:
        plan = plan_root_counts(arm, pred[rest], trajectory_budget=acfg.trajectory_budget - reserved,
                                expansion_ratio=acfg.expansion_ratio, group_size=acfg.group_size,
                                m_min=acfg.m_min, m_max=acfg.m_max, knapsack_m_min=acfg.knapsack_m_min,
                                tie_keys=rest_keys, exact_max_cells=acfg.exact_max_cells,
                                max_retries=acfg.dapo_max_retries, rng_for=rng_for, sample_groups=sample_groups,
                                root_objective=acfg.root_objective, sample_more=sample_more, prompt_uids=rest_keys,
                                prompt_texts=[candidates[i].question for i in rest], state=state, config=acfg,
                                root_budget=(root_budget_for(arm, acfg.trajectory_budget, acfg.expansion_ratio)
                                             - reserved) if reserved else None)
    except NoMixedGroupError as err:
        # every sampled group agreed within the retry bound: nothing to learn from this step. Any other error
        # of the rollouts (retriever, backend, out of memory) is not an outcome and stops the run.
        metrics.update(err.metrics)
        timings["time/rollout"] = time.perf_counter() - t0
        return StepResult(trees=[], sampled_trees=rule_sampled, metrics=metrics, timings=timings, is_filtered=True,
                          root_pred_success_prob=np.full(len(rule_sampled), np.nan),
                          root_counts=np.array([t.num_trajectories() for t in rule_sampled], dtype=np.int64))
    for key in ("gap", "objective", "upper_bound"):
        if key in plan.info:
            metrics[f"allocation/root_{key}"] = float(plan.info[key])
    metrics.update(plan.metrics)
    if plan.trees is not None and explore.size:  # its trees would leave the exploration groups unsampled
        raise ValueError(f"{arm.name}: root rule {arm.root_rule!r} samples its own groups and cannot take "
                         "allocation.explore_groups; remove it from EXPLORING_ROOT_RULES or set explore_groups: 0")
    if plan.trees is not None:  # the root rule sampled its own groups
        trees, sampled_trees = list(plan.trees), list(plan.sampled_trees)
        counts = np.array([t.num_trajectories() for t in trees], dtype=np.int64)
        root_pred = np.full(len(sampled_trees), np.nan)
        root_counts = np.array([t.num_trajectories() for t in sampled_trees], dtype=np.int64)
    else:
        counts = np.zeros(len(candidates), dtype=np.int64)
        counts[rest] = plan.counts
        counts[explore] = acfg.group_size
        if explore.size:
            metrics["allocation/explore_groups"] = float(explore.size)
        active = np.flatnonzero(counts)
        trees = sampler.sample_roots([candidates[i] for i in active], counts[active], "roots")
        for tree, i in zip(trees, active):
            if arm.uses_predictor:
                tree.root.pred_success_prob = float(pred[i])
            tree.root.num_branches = int(counts[i])
        counts = counts[active]
        sampled_trees = trees
        root_pred, root_counts = pred[active], counts.copy()
    timings["time/rollout"] = time.perf_counter() - t0

    chosen: list[AnchorChoice] = []
    unspent = _expand(arm, trees, counts, plan.expansion_budget, sampler, rng_for, acfg.rounds, acfg.treepo_width,
                      timings, chosen)
    if unspent > 0 and trees:
        # no trajectory had a non-terminal prefix (every rollout ended in one turn): keep the step at T
        # trajectories with extra bare rollouts from the roots, spread like the root allocation
        extra = split_expansion_budget(counts, unspent)
        t0 = time.perf_counter()
        sampler.sample_continuations(trees, {(i, 0): int(k) for i, k in enumerate(extra) if k > 0}, "extra_roots")
        timings["time/rollout"] += time.perf_counter() - t0  # bare rollouts from the roots, as stage 1's
        metrics["allocation/extra_root_rollouts"] = float(unspent)
    if state is not None:
        texts = {p.prompt_uid: p.question for p in candidates}
        metrics.update(state.observe([t.prompt_uid for t in sampled_trees], [t.leaf_rewards() for t in sampled_trees],
                                     [texts.get(t.prompt_uid, "") for t in sampled_trees]))
    return StepResult(trees=trees, sampled_trees=sampled_trees, metrics=metrics, timings=timings,
                      is_filtered=plan.trees is not None and len(plan.trees) < len(plan.sampled_trees),
                      root_pred_success_prob=root_pred, root_counts=root_counts,
                      anchors=chosen)
