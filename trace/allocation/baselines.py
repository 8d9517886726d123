"""Baselines and ablations by name: who gets root rollouts, where continuations go, which estimator.

Every arm spends the same number of sampled trajectories per step, ``allocation.trajectory_budget`` (T):
- arms without prefix expansion (``grpo``, ``dapo``, ``knapsack``, ``pcl``, ``trace_root``) spend all of T
  on root rollouts;
- arms with expansion (``tree_random``, ``treepo``, ``trace_prefix``, ``trace``) spend ``M = round(T / (1 +
  N))`` on roots and ``T - M`` on continuations, split over prompts in proportion to their roots.

Root rules (``plan_root_counts``):
- ``uniform``: the first ``R // n`` candidates get ``n = group_size`` each (``R`` the root budget), the
  remainder one each to the first of them (GRPO, arXiv 2402.03300).
- ``pcl``: the same counts, given to the candidates with predicted ``p`` nearest 0.5 (Prompt Curriculum
  Learning, arXiv 2510.01135: prompts of intermediate predicted difficulty).
- ``knapsack``: the root objective with no skips, every candidate gets ``m_min..m_max`` (Knapsack-RL, arXiv
  2509.25849 never drops a prompt); when ``R < B * m_min`` it falls back to allowing skips, which keeps the
  highest-value prompts.
- ``trace``: ``allocate_roots`` (TRACE stage 1).
- ``dapo``: sequential, see ``run_dapo`` (DAPO dynamic sampling, arXiv 2503.14476).

Expansion rules (``plan_expansion``):
- ``trace``: ``allocate_prefixes`` over the tree's candidate anchors (TRACE stage 2);
- ``random``: each continuation picks a candidate anchor uniformly at random (Tree-GRPO, arXiv 2509.21240);
- ``treepo``: ``treepo_width`` continuations at every anchor, shallowest turn depth first, until the budget
  is spent (TreePO, arXiv 2508.17445, fixed-width segment branching).

``dapo`` is the one arm that may sample fewer: ``run_dapo`` reports what it left unspent. When no sampled
group is mixed within ``allocation.dapo_max_retries`` it raises ``NoMixedGroupError``, the one outcome a
training step absorbs (the step then trains on nothing); every other error raised while sampling stops the
run.

A tree with no candidate anchors (every trajectory ended after one turn) hands its continuations to the
trees of the same step that have anchors, in proportion to their budgets. If no tree has an anchor, the
plan returns the whole stage-2 budget as ``unspent``: the caller spends it on extra root rollouts so the
step still samples T trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from trace.allocation.prefix import allocate_prefixes, candidate_anchors, split_expansion_budget
from trace.allocation.root import allocate_roots, canonical_order, check_root_budget_feasible
from trace.tree import RolloutTree

__all__ = [
    "AblationSpec",
    "ABLATIONS",
    "get_ablation",
    "RootPlan",
    "ExpansionPlan",
    "DapoResult",
    "NoMixedGroupError",
    "root_budget_for",
    "stage1_floor",
    "uniform_root_counts",
    "plan_root_counts",
    "plan_expansion",
    "run_dapo",
]

ROOT_RULES = ("uniform", "dapo", "knapsack", "pcl", "trace")
PREFIX_RULES = ("none", "random", "treepo", "trace")


@dataclass(frozen=True)
class AblationSpec:
    """One experiment arm.

    Attributes:
        name: the ``trace.config.Ablation`` value.
        root_rule: one of ``ROOT_RULES``: how root rollouts are spread over candidates.
        prefix_rule: one of ``PREFIX_RULES``: how stage-2 continuations are placed (``"none"``: no stage 2).
        estimator: default advantage estimator (``trace.advantages.ESTIMATORS`` name).
        uses_predictor: the arm reads ``V_hat`` (roots or anchors) to allocate.
    """

    name: str
    root_rule: str
    prefix_rule: str
    estimator: str
    uses_predictor: bool

    @property
    def has_expansion(self) -> bool:
        return self.prefix_rule != "none"


ABLATIONS: dict[str, AblationSpec] = {spec.name: spec for spec in (
    AblationSpec("grpo", "uniform", "none", "grpo", False),
    AblationSpec("dapo", "dapo", "none", "grpo", False),
    AblationSpec("knapsack", "knapsack", "none", "grpo", True),
    AblationSpec("pcl", "pcl", "none", "grpo", True),
    AblationSpec("tree_random", "uniform", "random", "tree_grpo", False),
    AblationSpec("treepo", "uniform", "treepo", "treepo", False),
    AblationSpec("trace_root", "trace", "none", "tree_grpo", True),
    AblationSpec("trace_prefix", "uniform", "trace", "tree_grpo", True),
    AblationSpec("trace", "trace", "trace", "tree_grpo", True),
)}


def get_ablation(name) -> AblationSpec:
    """Look up an ablation by name (a string or a ``trace.config.Ablation``).

    Raises:
        ValueError: unknown name; the message lists the valid names.
    """
    key = getattr(name, "value", name)
    try:
        return ABLATIONS[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown ablation {name!r}; valid names: {', '.join(ABLATIONS)} "
                         "(set train.ablations in params.yaml)") from None


# ---- stage 1 -------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RootPlan:
    """Root rollouts for one step.

    Attributes:
        counts: (B,) int64 bare rollouts per candidate (0 = not sampled).
        expansion_budget: continuations left for stage 2 (``T - sum(counts)``).
        info: solver details for logging (objective, upper bound, gap, method), JSON-serialisable.
    """

    counts: np.ndarray
    expansion_budget: int
    info: dict = field(default_factory=dict)


def root_budget_for(spec: AblationSpec, trajectory_budget: int, expansion_ratio: float) -> int:
    """Trajectories an arm spends on root rollouts: T, or ``round(T / (1 + N))`` with prefix expansion.

    Matches ``trace.config.AllocationConfig.root_budget``.
    """
    if not spec.has_expansion:
        return int(trajectory_budget)
    return int(round(trajectory_budget / (1.0 + expansion_ratio)))


def stage1_floor(rule: str, num_candidates: int, root_budget: int, m_min: int,
                 knapsack_m_min: int | None) -> tuple[int, str, bool]:
    """The lower bound, its params key, and whether prompts may be skipped, for a stage-1 root rule.

    ``trace`` may skip and gives an active prompt at least ``m_min``. ``knapsack`` (Knapsack-RL) gives every
    candidate at least ``knapsack_m_min`` (``None``: ``m_min``) and skips only when the budget cannot give
    every candidate that floor.

    Returns:
        ``(floor, key, allow_skip)``, e.g. ``(2, "allocation.knapsack_m_min", False)``.

    Raises:
        ValueError: ``rule`` is neither ``"trace"`` nor ``"knapsack"``.
    """
    if rule == "trace":
        return int(m_min), "allocation.m_min", True
    if rule != "knapsack":
        raise ValueError(f"root rule {rule!r} has no stage-1 floor; only trace and knapsack solve stage 1")
    if knapsack_m_min is None:
        floor, key = int(m_min), "allocation.m_min"
    else:
        floor, key = int(knapsack_m_min), "allocation.knapsack_m_min"
    return floor, key, root_budget < num_candidates * floor


def uniform_root_counts(num_candidates: int, root_budget: int, group_size: int,
                        order: np.ndarray | None = None) -> np.ndarray:
    """Uniform groups: ``k = min(B, max(1, R // n))`` candidates share ``R`` as evenly as possible.

    Args:
        num_candidates: B.
        root_budget: R trajectories (>= 0).
        group_size: n (>= 1).
        order: (B,) candidate positions in preference order; None takes them in input order.

    Returns:
        (B,) int64 counts; the first ``R mod k`` chosen candidates get one extra rollout.

    Raises:
        ValueError: a positive budget with no candidates, or ``group_size < 1``.
    """
    if group_size < 1:
        raise ValueError(f"allocation.group_size must be >= 1, got {group_size}")
    counts = np.zeros(num_candidates, dtype=np.int64)
    if root_budget == 0:
        return counts
    if num_candidates == 0:
        raise ValueError(f"cannot spend {root_budget} trajectories on 0 candidates: raise allocation.num_candidates")
    order = np.arange(num_candidates) if order is None else np.asarray(order)
    num_active = min(num_candidates, max(1, root_budget // group_size))
    base, extra = divmod(root_budget, num_active)
    counts[order[:num_active]] = base
    counts[order[:extra]] += 1
    return counts


def plan_root_counts(spec: AblationSpec, pred_success_prob, *, trajectory_budget: int, expansion_ratio: float,
                     group_size: int, m_min: int, m_max: int, knapsack_m_min: int | None = None,
                     rng: np.random.Generator | None = None, tie_keys=None,
                     exact_max_cells: int = 2_000_000) -> RootPlan:
    """Root rollouts per candidate for one step, by the arm's root rule.

    Args:
        spec: the arm (``get_ablation(name)``).
        pred_success_prob: (B,) float predicted success probability per candidate; its values are read only
            by arms with ``uses_predictor`` (others may pass NaN), its length is B for all.
        trajectory_budget: T, trajectories per step (roots + continuations).
        expansion_ratio: N, continuations per root rollout for arms with stage 2.
        group_size: n of the uniform rules.
        m_min, m_max: bounds on an active prompt's rollouts (``trace``; ``m_max`` also for ``knapsack``).
        knapsack_m_min: the floor ``knapsack`` gives every candidate (``None``: ``m_min``). Knapsack-RL
            never skips a prompt: with ``B * knapsack_m_min <= M`` every candidate gets at least the floor
            and the rest of the budget goes where ``A`` gains most; only a budget too small to give every
            candidate the floor lets it skip, keeping the prompts of highest value.
        rng: accepted for a uniform signature; every current root rule is deterministic given its inputs
            (candidates arrive in random order already).
        tie_keys: (B,) prompt ids ordering ties.
        exact_max_cells: DP size limit passed to ``allocate_roots``.

    Returns:
        ``RootPlan``; ``counts.sum() + expansion_budget == trajectory_budget``.

    Raises:
        ValueError: ``dapo`` (sequential: use ``run_dapo``), an unknown rule, or an infeasible budget.
    """
    del rng  # no root rule draws random numbers; see the docstring
    p = np.asarray(pred_success_prob, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"pred_success_prob must have shape (B,), got {p.shape}")
    num_candidates = p.size
    root_budget = root_budget_for(spec, trajectory_budget, expansion_ratio)
    if not 0 <= root_budget <= trajectory_budget:
        raise ValueError(f"allocation.expansion_ratio={expansion_ratio} gives root budget {root_budget} outside "
                         f"[0, {trajectory_budget}]: use expansion_ratio >= 0")
    info: dict = {"root_budget": root_budget}
    rule = spec.root_rule
    if rule == "uniform":
        counts = uniform_root_counts(num_candidates, root_budget, group_size)
    elif rule == "pcl":
        distance = np.abs(p - 0.5)
        if not np.all(np.isfinite(distance)):
            raise ValueError("pcl needs a finite predicted success probability for every candidate")
        rank = np.empty(num_candidates, dtype=np.int64)
        rank[canonical_order(num_candidates, tie_keys)] = np.arange(num_candidates)
        counts = uniform_root_counts(num_candidates, root_budget, group_size, np.lexsort((rank, distance)))
    elif rule in ("trace", "knapsack"):
        floor, floor_key, allow_skip = stage1_floor(rule, num_candidates, root_budget, m_min, knapsack_m_min)
        # allocate_roots checks this too; here the error names the key that set the floor
        check_root_budget_feasible(num_candidates, root_budget, floor, m_max, allow_skip=allow_skip,
                                   m_min_key=floor_key)
        result = allocate_roots(p, root_budget, floor, m_max, exact_max_cells=exact_max_cells,
                                tie_keys=tie_keys, allow_skip=allow_skip)
        counts = result.counts
        info.update(objective=result.objective, upper_bound=result.upper_bound, gap=result.gap,
                    method=result.method, allow_skip=allow_skip)
    elif rule == "dapo":
        raise ValueError("the dapo arm samples in rounds until it finds mixed groups: call run_dapo, "
                         "not plan_root_counts")
    else:
        raise ValueError(f"unknown root rule {rule!r}; valid: {', '.join(ROOT_RULES)}")
    info["active_prompts"] = int(np.count_nonzero(counts))
    return RootPlan(counts=counts, expansion_budget=int(trajectory_budget - counts.sum()), info=info)


# ---- stage 2 -------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ExpansionPlan:
    """Continuations for one step.

    Attributes:
        counts: ``{(tree_idx, node_id): K}`` continuations per anchor (only ``K > 0`` listed).
        budget_per_tree: (num_trees,) int64 continuations each tree actually gets, after trees without
            candidate anchors handed theirs on.
        unspent: continuations that could not be placed because no tree had a candidate anchor; spend
            them as extra root rollouts to keep the step at T trajectories.
    """

    counts: dict
    budget_per_tree: np.ndarray
    unspent: int

    @property
    def total(self) -> int:
        return int(sum(self.counts.values()))


def _redistribute(budgets: np.ndarray, num_anchors: np.ndarray) -> tuple[np.ndarray, int]:
    has = num_anchors > 0
    moved = int(budgets[~has].sum())
    out = np.where(has, budgets, 0).astype(np.int64)
    if moved == 0:
        return out, 0
    if not has.any():
        return out, moved
    weights = np.where(has, budgets, 0)
    if weights.sum() == 0:
        weights = np.where(has, num_anchors, 0)
    return out + split_expansion_budget(weights, moved), 0


def _treepo_counts(depths: np.ndarray, budget: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Width ``w`` per anchor, shallowest depth first (random order within a depth), cycling until spent."""
    counts = np.zeros(depths.size, dtype=np.int64)
    if budget == 0:
        return counts
    perm = rng.permutation(depths.size)
    visit = perm[np.argsort(depths[perm], kind="stable")]  # by depth, random within a depth
    per_pass = width * depths.size
    full_passes, rest = divmod(budget, per_pass)
    counts += full_passes * width
    num_full, partial = divmod(rest, width)
    counts[visit[:num_full]] += width
    if partial:
        counts[visit[num_full]] += partial
    return counts


def plan_expansion(spec: AblationSpec, trees: Sequence[RolloutTree], anchor_probs: Mapping | None,
                   expansion_budget_per_tree, rng: np.random.Generator, treepo_width: int = 2, *,
                   new_only_from: Mapping[int, Sequence[int]] | None = None) -> ExpansionPlan:
    """Place each tree's stage-2 continuations on its candidate anchors by the arm's prefix rule.

    Args:
        spec: the arm.
        trees: the step's rollout trees after stage 1 (one per active prompt).
        anchor_probs: ``{(tree_idx, node_id): V_hat}`` for every candidate anchor (read by ``trace`` only;
            may be None for other rules).
        expansion_budget_per_tree: (num_trees,) int continuations per tree (``split_expansion_budget``).
        rng: random generator (``random`` and ``treepo`` rules).
        treepo_width: branches per anchor of the ``treepo`` rule (``allocation.treepo_width``).
        new_only_from: for later rounds, ``{tree_idx: node ids created by the previous round}``.

    Returns:
        ``ExpansionPlan``; ``total + unspent == sum(expansion_budget_per_tree)``.

    Raises:
        ValueError: wrong budget shape, a positive budget for an arm without stage 2, an unknown rule.
        KeyError: ``trace`` rule with a candidate anchor missing from ``anchor_probs``.
    """
    budgets = np.asarray(expansion_budget_per_tree, dtype=np.int64).reshape(-1)
    if budgets.size != len(trees) or np.any(budgets < 0):
        raise ValueError(f"expansion_budget_per_tree must hold {len(trees)} counts >= 0, got {budgets.tolist()}")
    if spec.prefix_rule == "none":
        if budgets.sum() > 0:
            raise ValueError(f"ablation {spec.name!r} has no prefix expansion but got {int(budgets.sum())} "
                             "continuations: spend the whole trajectory_budget on roots")
        return ExpansionPlan(counts={}, budget_per_tree=budgets, unspent=0)
    if spec.prefix_rule not in PREFIX_RULES:
        raise ValueError(f"unknown prefix rule {spec.prefix_rule!r}; valid: {', '.join(PREFIX_RULES)}")
    if treepo_width < 1:
        raise ValueError(f"allocation.treepo_width must be >= 1, got {treepo_width}")

    anchors = [candidate_anchors(tree, None if new_only_from is None else new_only_from.get(t, ()))
               for t, tree in enumerate(trees)]
    budgets, unspent = _redistribute(budgets, np.array([len(a) for a in anchors], dtype=np.int64))
    counts: dict = {}
    for t, (tree, tree_anchors) in enumerate(zip(trees, anchors)):
        budget = int(budgets[t])
        if budget == 0:
            continue
        node_ids = np.array([a[0] for a in tree_anchors], dtype=np.int64)
        if spec.prefix_rule == "trace":
            rewards = np.array([a[1] for a in tree_anchors], dtype=np.float64)
            try:
                probs = np.array([anchor_probs[(t, int(n))] for n in node_ids], dtype=np.float64)
            except (KeyError, TypeError):
                missing = [int(n) for n in node_ids if anchor_probs is None or (t, int(n)) not in anchor_probs]
                raise KeyError(f"tree {t} ({tree.tree_id}): no predicted success probability for candidate "
                               f"anchors {missing[:10]}; score every candidate anchor before planning") from None
            per_anchor = allocate_prefixes(rewards, probs, budget, tie_keys=node_ids)
        elif spec.prefix_rule == "random":
            per_anchor = rng.multinomial(budget, np.full(node_ids.size, 1.0 / node_ids.size)).astype(np.int64)
        else:  # treepo
            depths = np.array([tree.nodes[int(n)].turn_idx for n in node_ids], dtype=np.int64)
            per_anchor = _treepo_counts(depths, budget, treepo_width, rng)
        for node_id, k in zip(node_ids.tolist(), per_anchor.tolist()):
            if k > 0:
                counts[(t, node_id)] = int(k)
    return ExpansionPlan(counts=counts, budget_per_tree=budgets, unspent=unspent)


# ---- dapo ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DapoResult:
    """Outcome of DAPO dynamic sampling for one step.

    Attributes:
        kept_candidates: (G,) int64 candidate indices whose groups had mixed rewards, in sampling order.
        kept_rewards: G arrays of leaf rewards, aligned with ``kept_candidates``.
        sampled_candidates: (S,) int64 every candidate sampled, in sampling order.
        num_trajectories: trajectories sampled (``n * S``, never above T).
        num_rounds: sampling rounds run (1 + retries used).
        unspent: ``T - num_trajectories``; the caller may spend it elsewhere to keep the step at T.
    """

    kept_candidates: np.ndarray
    kept_rewards: list
    sampled_candidates: np.ndarray
    num_trajectories: int
    num_rounds: int
    unspent: int


class NoMixedGroupError(RuntimeError):
    """``run_dapo`` sampled no group with mixed rewards within its retries: the step has nothing to learn from.

    Raised only for that outcome, so a caller can absorb it (``trace.loop.Trainer.step`` logs
    ``dapo/no_mixed_group`` and trains on nothing) while every other error raised by the rollouts, such as a
    ``trace.envs.qa.RetrieverError`` or ``torch.OutOfMemoryError``, still stops the run.

    Attributes:
        num_rounds: sampling rounds run (1 + retries used).
        num_trajectories: trajectories sampled, all in all-equal groups.
    """

    def __init__(self, message: str, *, num_rounds: int, num_trajectories: int) -> None:
        super().__init__(message)
        self.num_rounds = num_rounds
        self.num_trajectories = num_trajectories


def run_dapo(rollout_fn: Callable[[np.ndarray, int], Sequence], num_candidates: int, group_size: int,
             trajectory_budget: int, max_retries: int, rng: np.random.Generator, *,
             target_groups: int | None = None) -> DapoResult:
    """DAPO dynamic sampling within a fixed trajectory budget.

    Candidates are visited in a random order (``rng``), each sampled at most once. Round 1 samples groups
    of ``n`` on ``target_groups`` fresh candidates; groups whose rewards are all equal are dropped. Each
    retry refills the dropped slots with fresh candidates, as many as the unused candidates and the budget
    for whole groups allow, until every slot holds a mixed group or ``max_retries`` retries ran. The step
    never samples more than T trajectories.

    With the default ``target_groups = T // n`` round 1 already spends ``n * (T // n)``: at equal budget
    DAPO filters rather than oversamples, and retries run only when ``target_groups < T // n`` leaves
    budget in reserve (what is not needed for refills is reported as ``unspent``).

    Args:
        rollout_fn: ``rollout_fn(candidate_indices (G,) int64, n) -> G arrays of n leaf rewards``.
        num_candidates: B.
        group_size: n (>= 2).
        trajectory_budget: T (>= n).
        max_retries: refill rounds allowed after round 1 (``allocation.dapo_max_retries``).
        rng: random generator ordering the candidates.
        target_groups: groups wanted in the batch; None means ``T // n``.

    Returns:
        ``DapoResult``.

    Raises:
        ValueError: ``group_size < 2``, ``T < n``, ``target_groups`` outside ``[1, T // n]``, or ``rollout_fn``
            returned the wrong shapes.
        NoMixedGroupError: no sampled group had mixed rewards; names ``allocation.dapo_max_retries``.
        Whatever ``rollout_fn`` raises propagates unchanged.

    References:
        DAPO (arXiv 2503.14476), dynamic sampling: over-sample and filter out groups with accuracy 0 or 1.
    """
    if group_size < 2:
        raise ValueError(f"allocation.group_size must be >= 2 for dapo (a group of 1 has no contrast), "
                         f"got {group_size}")
    if trajectory_budget < group_size:
        raise ValueError(f"allocation.trajectory_budget={trajectory_budget} < group_size={group_size}: "
                         "dapo cannot sample one group; raise the budget")
    max_groups = trajectory_budget // group_size
    target_groups = max_groups if target_groups is None else int(target_groups)
    if not 1 <= target_groups <= max_groups:
        raise ValueError(f"target_groups must lie in [1, {max_groups}] (trajectory_budget // group_size), "
                         f"got {target_groups}")
    order = rng.permutation(num_candidates).astype(np.int64)
    cursor = spent = rounds = 0
    kept, kept_rewards = [], []
    want = min(num_candidates, target_groups)
    while want > 0 and rounds <= max_retries:
        num_groups = min(want, (trajectory_budget - spent) // group_size, num_candidates - cursor)
        if num_groups <= 0:
            break
        chosen = order[cursor:cursor + num_groups]
        cursor += num_groups
        groups = list(rollout_fn(chosen, group_size))
        if len(groups) != num_groups:
            raise ValueError(f"rollout_fn returned {len(groups)} groups for {num_groups} candidates")
        spent += num_groups * group_size
        rounds += 1
        for candidate, rewards in zip(chosen.tolist(), groups):
            rewards = np.asarray(rewards, dtype=np.float64)
            if rewards.shape != (group_size,):
                raise ValueError(f"rollout_fn returned {rewards.shape} rewards for candidate {candidate}, "
                                 f"expected ({group_size},)")
            if rewards.max() > rewards.min():
                kept.append(candidate)
                kept_rewards.append(rewards)
        want = target_groups - len(kept)
    if not kept:
        raise NoMixedGroupError(
            f"dapo found no group with mixed rewards after {rounds} round(s): {spent} of {trajectory_budget} "
            f"trajectories over {cursor} of {num_candidates} candidates. Raise allocation.dapo_max_retries "
            "(more refill rounds), allocation.num_candidates or allocation.trajectory_budget, or start from a "
            "policy whose success rate is between 0 and 1 on this task.",
            num_rounds=rounds, num_trajectories=spent)
    return DapoResult(kept_candidates=np.array(kept, dtype=np.int64), kept_rewards=kept_rewards,
                      sampled_candidates=order[:cursor].copy(), num_trajectories=spent, num_rounds=rounds,
                      unspent=trajectory_budget - spent)
