"""The experiment arms by name, their stage-1 root rules, and ``plan_root_counts``.

An arm is one row of ``ARMS``: a root rule, a prefix rule (``trace.allocation.prefix_rules``), an advantage
estimator and whether it reads the predictor. Every arm spends the same number of sampled trajectories per
step, ``allocation.trajectory_budget`` (T): arms without prefix expansion spend all of T on root rollouts;
arms with expansion spend ``M = round(T / (1 + N))`` on roots and ``T - M`` on continuations, split over
prompts in proportion to their roots. ``dapo`` (``trace.allocation.dapo``) may sample fewer.

Root rules (``ROOT_RULES``), each ``fn(RootRequest) -> RootDecision``:
- ``uniform``: the first ``R // n`` candidates get ``n = group_size`` each (``R`` the root budget), the
  remainder one each to the first of them (GRPO, arXiv 2402.03300).
- ``pcl``: the same counts, given to the candidates with predicted ``p`` nearest 0.5 (Prompt Curriculum
  Learning, arXiv 2510.01135: prompts of intermediate predicted difficulty).
- ``knapsack``: the root objective with no skips, every candidate gets ``m_min..m_max`` (Knapsack-RL, arXiv
  2509.25849 never drops a prompt); when ``R < B * m_min`` it falls back to allowing skips, which keeps the
  highest-value prompts.
- ``trace``: ``allocate_roots`` (TRACE stage 1).
- ``dapo``: sequential sampling until mixed groups are found (``trace.allocation.dapo``).
- ``reinforce_ada``: rounds of samples to each prompt until its group has enough positives and negatives
  (``trace.allocation.reinforce_ada``, arXiv 2510.04996).
- ``greso``: skip prompts whose recent groups all agreed, with self-tuning probabilities
  (``trace.allocation.greso``, arXiv 2506.02177).
- ``mopps``: a Beta posterior of each prompt's success, Thompson-sampled toward 0.5 (``trace.allocation.mopps``,
  arXiv 2507.04632).
- ``vip``: a Gaussian-process forecast over prompt embeddings and variance-minimising counts
  (``trace.allocation.vip``, arXiv 2602.01601).

``greso``, ``mopps`` and ``vip`` keep state across steps (``make_allocator_state``; the training loop saves it
in its checkpoints); none of the four reads the success predictor.

Diagnostic arms (``DIAGNOSTIC_ARMS``) are bounds, not methods: ``trace_oracle`` is ``trace`` allocating on
Monte-Carlo success rates (``Arm.scores = "monte_carlo"``, ``allocation.oracle_samples`` fresh rollouts per
candidate prompt and prefix, outside the budget and never trained on) instead of the predictor's forecasts,
the most a perfect predictor could buy. ``train.ablations`` accepts them; the grid (``ARMS``) leaves them out.

To add an arm: register its root rule here (``@register_root_rule``) if it needs a new one, and add its row
to ``ARMS``; ``train.ablations`` accepts every registered arm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trace.allocation import dapo, greso, mopps, prefix_rules, reinforce_ada, vip  # noqa: F401  (registers rules)
from trace.allocation.registry import ROOT_RULES, Arm, RootDecision, RootRequest, get_prefix_rule, get_root_rule, \
    register_root_rule
from trace.allocation.objectives import check_root_objective
from trace.allocation.root import allocate_roots, canonical_order, check_root_budget_feasible, \
    uniform_root_counts

__all__ = [
    "ARMS",
    "DIAGNOSTIC_ARMS",
    "RootPlan",
    "get_arm",
    "make_allocator_state",
    "register_arm",
    "root_budget_for",
    "stage1_floor",
    "uniform_root_counts",
    "plan_root_counts",
]

# ---- stage-1 root rules --------------------------------------------------------------------------------
@register_root_rule("uniform")
def uniform_root_rule(request: RootRequest) -> RootDecision:
    """GRPO: ``uniform_root_counts`` in candidate order."""
    return RootDecision(uniform_root_counts(request.num_candidates, request.root_budget, request.group_size))


@register_root_rule("pcl")
def pcl_root_rule(request: RootRequest) -> RootDecision:
    """PCL: uniform groups for the candidates whose predicted ``p`` is nearest 0.5 (ties by tie key).

    Raises:
        ValueError: a predicted probability is not finite.
    """
    num_candidates = request.num_candidates
    distance = np.abs(request.pred_success_prob - 0.5)
    if not np.all(np.isfinite(distance)):
        raise ValueError("pcl needs a finite predicted success probability for every candidate")
    rank = np.empty(num_candidates, dtype=np.int64)
    rank[canonical_order(num_candidates, request.tie_keys)] = np.arange(num_candidates)
    return RootDecision(uniform_root_counts(num_candidates, request.root_budget, request.group_size,
                                            np.lexsort((rank, distance))))


def _trace_floor(num_candidates: int, root_budget: int, m_min: int,
                 knapsack_m_min: int | None) -> tuple[int, str, bool]:
    """TRACE may skip prompts and gives an active prompt at least ``m_min``."""
    return int(m_min), "allocation.m_min", True


def _knapsack_floor(num_candidates: int, root_budget: int, m_min: int,
                    knapsack_m_min: int | None) -> tuple[int, str, bool]:
    """Knapsack-RL gives every candidate ``knapsack_m_min`` (None: ``m_min``) and skips only when the budget
    cannot give every candidate that floor."""
    if knapsack_m_min is None:
        floor, key = int(m_min), "allocation.m_min"
    else:
        floor, key = int(knapsack_m_min), "allocation.knapsack_m_min"
    return floor, key, root_budget < num_candidates * floor


def _solve_stage1(request: RootRequest, floor_fn, root_objective: str) -> RootDecision:
    num_candidates, root_budget = request.num_candidates, request.root_budget
    floor, floor_key, allow_skip = floor_fn(num_candidates, root_budget, request.m_min, request.knapsack_m_min)
    # allocate_roots checks this too; here the error names the key that set the floor
    check_root_budget_feasible(num_candidates, root_budget, floor, request.m_max, allow_skip=allow_skip,
                               m_min_key=floor_key)
    result = allocate_roots(request.pred_success_prob, root_budget, floor, request.m_max,
                            exact_max_cells=request.exact_max_cells, tie_keys=request.tie_keys,
                            allow_skip=allow_skip, root_objective=root_objective)
    return RootDecision(result.counts, info=dict(objective=result.objective, upper_bound=result.upper_bound,
                                                 gap=result.gap, method=result.method, allow_skip=allow_skip,
                                                 root_objective=root_objective))


@register_root_rule("trace", floor=_trace_floor)
def trace_root_rule(request: RootRequest) -> RootDecision:
    """TRACE stage 1: ``allocate_roots`` with floor ``m_min``, skipping prompts where that gains most, under
    ``request.root_objective`` (``groups``: expected mixed groups; ``leaves``: expected leaves in them)."""
    return _solve_stage1(request, _trace_floor, request.root_objective)


@register_root_rule("knapsack", floor=_knapsack_floor)
def knapsack_root_rule(request: RootRequest) -> RootDecision:
    """Knapsack-RL: ``allocate_roots`` with every candidate at its floor or above (see ``_knapsack_floor``),
    always on Knapsack-RL's objective, the expected number of mixed groups (``groups``)."""
    return _solve_stage1(request, _knapsack_floor, "groups")


# ---- the arms ------------------------------------------------------------------------------------------
ARMS: dict[str, Arm] = {}
DIAGNOSTIC_ARMS: dict[str, Arm] = {}
SCORES = ("predictor", "monte_carlo")


def register_arm(arm: Arm, diagnostic: bool = False) -> Arm:
    """Add a row to ``ARMS`` (or with ``diagnostic`` to ``DIAGNOSTIC_ARMS``).

    Args:
        arm: the row; its root and prefix rules must be registered.
        diagnostic: a bound rather than a method, left out of the grid.

    Returns:
        ``arm``.

    Raises:
        ValueError: the name is taken, a rule it names is not registered (the message lists the valid ones),
            or ``arm.scores`` is not one of ``SCORES``.
    """
    if arm.name in ARMS or arm.name in DIAGNOSTIC_ARMS:
        raise ValueError(f"arm {arm.name!r} is registered already: {ARMS.get(arm.name, DIAGNOSTIC_ARMS.get(arm.name))}")
    get_root_rule(arm.root_rule)
    get_prefix_rule(arm.prefix_rule)
    if arm.scores not in SCORES:
        raise ValueError(f"arm {arm.name!r}: scores={arm.scores!r}; use one of {SCORES}")
    (DIAGNOSTIC_ARMS if diagnostic else ARMS)[arm.name] = arm
    return arm


for _row in (
    Arm("grpo", "uniform", "none", "grpo", uses_predictor=False),  # uniform n per prompt, flat groups
    Arm("dapo", "dapo", "none", "grpo", uses_predictor=False),  # oversample, drop all-equal groups
    Arm("knapsack", "knapsack", "none", "grpo", uses_predictor=True),  # root allocation only, never skips
    Arm("pcl", "pcl", "none", "grpo", uses_predictor=True),  # prompts with predicted p nearest 0.5
    Arm("tree_random", "uniform", "random", "tree_grpo", uses_predictor=False),  # random anchors (Tree-GRPO)
    Arm("treepo", "uniform", "treepo", "treepo", uses_predictor=False),  # fixed width per depth (TreePO)
    Arm("trace_root", "trace", "none", "tree_grpo", uses_predictor=True),  # TRACE stage 1 only
    Arm("trace_prefix", "uniform", "trace", "tree_grpo", uses_predictor=True),  # uniform roots + TRACE stage 2
    Arm("trace", "trace", "trace", "tree_grpo", uses_predictor=True),  # both stages
    Arm("reinforce_ada", "reinforce_ada", "none", "grpo", uses_predictor=False),  # rounds until a prompt has contrast
    Arm("greso", "greso", "none", "grpo", uses_predictor=False),  # skip prompts whose recent groups agreed
    Arm("mopps", "mopps", "none", "grpo", uses_predictor=False),  # Beta posterior per prompt, Thompson toward 0.5
    Arm("vip", "vip", "none", "grpo", uses_predictor=False),  # GP forecast, variance-minimising counts
):
    register_arm(_row)
# both stages on Monte-Carlo success rates instead of the predictor: what a perfect predictor buys (an upper bound)
register_arm(Arm("trace_oracle", "trace", "trace", "tree_grpo", uses_predictor=True, scores="monte_carlo"),
             diagnostic=True)


def get_arm(name: str) -> Arm:
    """Look up an arm by name.

    Raises:
        ValueError: unknown name; the message lists the registered arms.
    """
    try:
        return ARMS[name] if name in ARMS else DIAGNOSTIC_ARMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown ablation {name!r}; valid names: {', '.join([*ARMS, *DIAGNOSTIC_ARMS])} "
                         "(set train.ablations in params.yaml)") from None


def make_allocator_state(arm: Arm, allocation_config=None):
    """A fresh ``AllocatorState`` for ``arm``'s root rule, or None when the rule keeps no state across steps.

    Args:
        arm: the arm.
        allocation_config: the allocation section (``AllocationConfig``); None takes the rule's defaults.
    """
    make_state = get_root_rule(arm.root_rule).make_state
    return None if make_state is None else make_state(allocation_config)


def root_budget_for(arm: Arm, trajectory_budget: int, expansion_ratio: float) -> int:
    """Trajectories an arm spends on root rollouts: T, or ``round(T / (1 + N))`` with prefix expansion.

    Matches ``trace.configuration.config.AllocationConfig.root_budget``.
    """
    if not arm.has_expansion:
        return int(trajectory_budget)
    return int(round(trajectory_budget / (1.0 + expansion_ratio)))


def stage1_floor(rule: str, num_candidates: int, root_budget: int, m_min: int,
                 knapsack_m_min: int | None) -> tuple[int, str, bool]:
    """The lower bound, its params key, and whether prompts may be skipped, for a stage-1 root rule.

    Returns:
        ``(floor, key, allow_skip)``, e.g. ``(2, "allocation.knapsack_m_min", False)``.

    Raises:
        ValueError: ``rule`` is not registered or does not solve stage 1 (has no floor).
    """
    floor_fn = get_root_rule(rule).floor
    if floor_fn is None:
        solvers = [name for name, registered in ROOT_RULES.items() if registered.floor is not None]
        raise ValueError(f"root rule {rule!r} has no stage-1 floor; only {' and '.join(solvers)} solve stage 1")
    return floor_fn(num_candidates, root_budget, m_min, knapsack_m_min)


# ---- planning ------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RootPlan:
    """Root rollouts for one step.

    Attributes:
        counts: (B,) int64 bare rollouts per candidate (0 = not sampled).
        expansion_budget: continuations left for stage 2 (``T - sum(counts)``; 0 for rules that sample
            themselves).
        info: solver details for logging (objective, upper bound, gap, method), JSON-serialisable.
        trees: the trees a rule that samples itself kept for training; None when ``counts`` are to be sampled.
        sampled_trees: every tree such a rule sampled, in sampling order (None otherwise).
        metrics: the rule's entries for the step's log, in logging order.
    """

    counts: np.ndarray
    expansion_budget: int
    info: dict = field(default_factory=dict)
    trees: list | None = None
    sampled_trees: list | None = None
    metrics: dict = field(default_factory=dict)


def plan_root_counts(arm: Arm, pred_success_prob, *, trajectory_budget: int, expansion_ratio: float,
                     group_size: int, m_min: int, m_max: int, knapsack_m_min: int | None = None,
                     tie_keys=None, exact_max_cells: int = 2_000_000, max_retries: int = 4,
                     rng_for=None, sample_groups=None, root_objective: str = "groups", sample_more=None,
                     prompt_uids=None, prompt_texts=None, state=None, config=None,
                     root_budget: int | None = None) -> RootPlan:
    """Root rollouts per candidate for one step, by the arm's root rule.

    Args:
        arm: the arm (``get_arm(name)``).
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
        tie_keys: (B,) prompt ids ordering ties.
        exact_max_cells: DP size limit passed to ``allocate_roots``.
        max_retries: refill rounds of ``dapo`` (``allocation.dapo_max_retries``).
        rng_for: ``rng_for(purpose) -> Generator`` for rules that draw (``dapo``: ``"dapo"``); the planning
            rules are deterministic given their inputs (candidates arrive in random order already); ``greso`` and
            ``mopps`` draw from ``"greso"`` / ``"mopps"``.
        sample_groups: ``sample_groups(candidate_indices, n, salt) -> trees`` for rules that sample (``dapo``).
        root_objective: the ``trace`` rule's stage-1 objective (``allocation.root_objective``): ``"groups"``
            (the paper's ``sum_i A(p_i, m_i)``) or ``"leaves"`` (``sum_i m_i A(p_i, m_i)``); the other rules
            ignore it.
        sample_more: ``sample_more(trees, counts, salt)`` for rules that sample a prompt again in rounds
            (``reinforce_ada``).
        prompt_uids, prompt_texts: (B,) the candidates' ids and question texts, for rules with per-prompt
            state (``greso``, ``mopps``, ``vip``).
        state: the arm's ``AllocatorState`` (``make_allocator_state``), for the rules that keep one.
        config: the allocation section, read for the per-rule settings (``allocation.greso`` ...).
        root_budget: the root rollouts the rule may spend; None: ``root_budget_for(arm, trajectory_budget,
            expansion_ratio)``. ``allocate_step`` passes what is left after its exploration groups.

    Returns:
        ``RootPlan``; ``counts.sum() + expansion_budget == trajectory_budget`` for the planning rules.

    Raises:
        ValueError: ``dapo`` without a sampler, an unknown rule or ``root_objective``, or an infeasible budget.
        NoMixedGroupError: ``dapo`` sampled no mixed group.
    """
    p = np.asarray(pred_success_prob, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"pred_success_prob must have shape (B,), got {p.shape}")
    if root_budget is None:
        root_budget = root_budget_for(arm, trajectory_budget, expansion_ratio)
    if not 0 <= root_budget <= trajectory_budget:
        raise ValueError(f"allocation.expansion_ratio={expansion_ratio} gives root budget {root_budget} outside "
                         f"[0, {trajectory_budget}]: use expansion_ratio >= 0")
    check_root_objective(root_objective)
    rule = get_root_rule(arm.root_rule)
    decision = rule.fn(RootRequest(pred_success_prob=p, root_budget=root_budget, trajectory_budget=trajectory_budget,
                                   group_size=group_size, m_min=m_min, m_max=m_max, knapsack_m_min=knapsack_m_min,
                                   tie_keys=tie_keys, exact_max_cells=exact_max_cells, max_retries=max_retries,
                                   rng_for=rng_for, sample_groups=sample_groups, root_objective=root_objective,
                                   sample_more=sample_more, prompt_uids=prompt_uids, prompt_texts=prompt_texts,
                                   state=state, config=config))
    counts = decision.counts
    info: dict = {"root_budget": root_budget, **decision.info, "active_prompts": int(np.count_nonzero(counts))}
    expansion_budget = (int(trajectory_budget - counts.sum()) if decision.expansion_budget is None
                        else int(decision.expansion_budget))
    return RootPlan(counts=counts, expansion_budget=expansion_budget, info=info, trees=decision.trees,
                    sampled_trees=decision.sampled_trees, metrics=dict(decision.metrics))
