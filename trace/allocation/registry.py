"""Root rules and prefix rules by name: one interface per kind, registered with a decorator.

A root rule decides stage 1 (how many bare rollouts each candidate prompt gets); a prefix rule decides
stage 2 (how one tree's continuations are spread over its candidate anchors). Each is a function registered
under its name next to its solver (``@register_root_rule("trace")``), and an arm (``trace.allocation.arms``)
names one of each. Looking up an unknown name raises with the registered names; registering a name twice
raises.

This module and the modules that register rules import numpy and ``trace.tree`` only (never
``trace.configuration.config``), so the config can validate arm names against the registry at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from trace.tree import RolloutTree

__all__ = [
    "AllocatorState",
    "Arm",
    "RootRequest",
    "RootDecision",
    "RootRule",
    "AnchorRequest",
    "PrefixRule",
    "ROOT_RULES",
    "PREFIX_RULES",
    "register_root_rule",
    "register_prefix_rule",
    "get_root_rule",
    "get_prefix_rule",
]

# a floor rule: (num_candidates, root_budget, m_min, knapsack_m_min) -> (floor, params key, allow_skip)
FloorFn = Callable[[int, int, int, "int | None"], "tuple[int, str, bool]"]
# sample_groups(candidate_indices (G,) int64, n, salt) -> G trees of n root rollouts each
GroupSampler = Callable[[np.ndarray, int, str], Sequence[RolloutTree]]
# sample_more(trees, counts, salt): counts[i] more bare rollouts from the root of trees[i], appended in place
MoreSampler = Callable[[Sequence[RolloutTree], Sequence[int], str], None]


@runtime_checkable
class AllocatorState(Protocol):
    """What a root rule keeps across steps (a posterior, a skip history, a fitted model), one object per run.

    ``trace.allocation.step.allocate_step`` passes it to the rule as ``RootRequest.state`` and, once the step's
    trees are sampled, calls ``observe`` with them; the training loop saves ``state_dict()`` in every
    checkpoint and loads it on resume, so a resumed run allocates exactly as an uninterrupted one.
    """

    def observe(self, prompt_uids: Sequence[str], rewards: Sequence[np.ndarray],
                prompt_texts: Sequence[str]) -> dict[str, float]:
        """Update on one step's outcome: the leaf rewards of every tree sampled, by prompt; returns metrics."""

    def state_dict(self) -> dict:
        """The state as a JSON-serialisable dict."""

    def load_state_dict(self, state: Mapping) -> None:
        """Restore what ``state_dict`` returned."""


@dataclass(frozen=True)
class Arm:
    """One experiment arm: a row of the arm table.

    Attributes:
        name: the arm's name, as ``train.ablations`` lists it.
        root_rule: a ``ROOT_RULES`` name: how root rollouts are spread over candidates.
        prefix_rule: a ``PREFIX_RULES`` name: how stage-2 continuations are placed (``"none"``: no stage 2).
        estimator: default advantage estimator (``trace.advantages.ESTIMATORS`` name).
        uses_predictor: the arm reads ``V_hat`` (roots or anchors) to allocate.
        scores: what ``V_hat`` is: ``"predictor"`` (the success predictor) or ``"monte_carlo"`` (fresh rollouts
            under the current policy, outside the budget: ``trace.allocation.samplers.MonteCarloScorer``).
    """

    name: str
    root_rule: str
    prefix_rule: str
    estimator: str
    uses_predictor: bool
    scores: str = "predictor"

    @property
    def has_expansion(self) -> bool:
        """Whether the arm runs stage 2 (its prefix rule places continuations)."""
        return get_prefix_rule(self.prefix_rule).expands


# ---- root rules ----------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RootRequest:
    """What every root rule receives for one step.

    Attributes:
        pred_success_prob: (B,) float64 predicted success probability per candidate (NaN for arms without a
            predictor).
        root_budget: M, trajectories for root rollouts.
        trajectory_budget: T, trajectories of the whole step.
        group_size: n of the uniform rules and of dapo's groups.
        m_min, m_max: bounds on an active prompt's rollouts.
        knapsack_m_min: the floor the knapsack rule gives every candidate (``None``: ``m_min``).
        tie_keys: (B,) prompt ids ordering ties, or None.
        exact_max_cells: DP size limit of ``allocate_roots``.
        max_retries: refill rounds of rules that sample in rounds (``allocation.dapo_max_retries``).
        rng_for: ``rng_for(purpose) -> numpy Generator``, the random stream of a named purpose; None when
            the caller supplies none (rules that draw then refuse).
        sample_groups: ``sample_groups(candidate_indices, n, salt) -> trees`` for rules that sample while
            they allocate; None for a pure plan.
        root_objective: the stage-1 objective of the ``trace`` rule, ``"groups"`` or ``"leaves"``
            (``allocation.root_objective``).
        sample_more: ``sample_more(trees, counts, salt)`` appends ``counts[i]`` bare rollouts from the root of
            ``trees[i]`` (rules that sample a prompt again in later rounds); None for a pure plan.
        prompt_uids: (B,) the candidates' prompt ids (``Prompt.prompt_uid``), for rules that keep per-prompt
            state; None when the caller has none.
        prompt_texts: (B,) the candidates' question texts, for rules that embed prompts; None when unknown.
        state: the rule's ``AllocatorState`` for this run (``make_state`` of its registration), or None.
        config: the allocation section (``trace.configuration.config.AllocationConfig``) for the per-rule
            settings (``allocation.<rule>``); None takes each rule's defaults.
    """

    pred_success_prob: np.ndarray
    root_budget: int
    trajectory_budget: int
    group_size: int
    m_min: int
    m_max: int
    knapsack_m_min: int | None
    tie_keys: Sequence | None
    exact_max_cells: int
    max_retries: int
    rng_for: Callable[[str], np.random.Generator] | None = None
    sample_groups: GroupSampler | None = None
    root_objective: str = "groups"
    sample_more: MoreSampler | None = None
    prompt_uids: Sequence[str] | None = None
    prompt_texts: Sequence[str] | None = None
    state: Any = None
    config: Any = None

    @property
    def num_candidates(self) -> int:
        return int(self.pred_success_prob.size)


@dataclass(frozen=True, eq=False)
class RootDecision:
    """What a root rule returns.

    Attributes:
        counts: (B,) int64 root rollouts per candidate (0 = not sampled).
        info: solver details for logging (objective, upper bound, gap, method), JSON-serialisable.
        trees: for rules that sample themselves, the trees kept for training; None when the caller samples
            ``counts``.
        sampled_trees: for rules that sample themselves, every tree they sampled, in sampling order.
        expansion_budget: continuations left for stage 2; None means ``T - counts.sum()``.
        metrics: ``{"namespace/name": float}`` the rule reports for the step's log, in logging order.
    """

    counts: np.ndarray
    info: dict = field(default_factory=dict)
    trees: list | None = None
    sampled_trees: list | None = None
    expansion_budget: int | None = None
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RootRule:
    """A registered root rule.

    Attributes:
        name: its registered name.
        fn: ``fn(request: RootRequest) -> RootDecision``.
        floor: for rules that solve stage 1, ``floor(num_candidates, root_budget, m_min, knapsack_m_min) ->
            (floor, params key, allow_skip)``, checked at config load; None for the others.
        make_state: for rules that keep state across steps, ``make_state(allocation_config) ->
            AllocatorState`` (a fresh state at step 0); None for stateless rules.
    """

    name: str
    fn: Callable[[RootRequest], RootDecision]
    floor: FloorFn | None = None
    make_state: Callable[[Any], AllocatorState] | None = None


ROOT_RULES: dict[str, RootRule] = {}


def register_root_rule(name: str, *, floor: FloorFn | None = None,
                       make_state: Callable[[Any], AllocatorState] | None = None):
    """Decorator registering ``fn(request: RootRequest) -> RootDecision`` as the root rule ``name``.

    Args:
        name: the rule's name (what ``Arm.root_rule`` refers to).
        floor: the stage-1 floor of rules that solve stage 1 (see ``RootRule.floor``).
        make_state: the state factory of rules that keep state across steps (see ``RootRule.make_state``).

    Returns:
        The decorator; it returns the function unchanged.

    Raises:
        ValueError: ``name`` is registered already.
    """
    def decorate(fn: Callable[[RootRequest], RootDecision]) -> Callable[[RootRequest], RootDecision]:
        if name in ROOT_RULES:
            raise ValueError(f"root rule {name!r} is registered already ({ROOT_RULES[name].fn.__qualname__})")
        ROOT_RULES[name] = RootRule(name, fn, floor, make_state)
        return fn
    return decorate


def get_root_rule(name: str) -> RootRule:
    """The registered root rule ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered root rules.
    """
    try:
        return ROOT_RULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown root rule {name!r}; valid: {', '.join(ROOT_RULES)}") from None


# ---- prefix rules --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class AnchorRequest:
    """What every prefix rule receives for one tree with a positive stage-2 budget.

    Attributes:
        tree: the rollout tree.
        tree_idx: its position in the step's trees.
        node_ids: (K,) int64 its candidate anchors (``candidate_anchors``), in tree order.
        rewards: (K,) float64 observed mean leaf reward below each anchor.
        budget: continuations for this tree (> 0).
        anchor_probs: ``{(tree_idx, node_id): V_hat}`` of the step, or None when no anchor was scored.
        rng: random generator of the step's expansion round.
        treepo_width: branches per anchor of fixed-width rules (``allocation.treepo_width``).
    """

    tree: RolloutTree
    tree_idx: int
    node_ids: np.ndarray
    rewards: np.ndarray
    budget: int
    anchor_probs: Mapping | None
    rng: np.random.Generator
    treepo_width: int


@dataclass(frozen=True)
class PrefixRule:
    """A registered prefix rule.

    Attributes:
        name: its registered name.
        fn: ``fn(request: AnchorRequest) -> (K,) int64`` continuations per anchor, summing to the budget;
            None for the rule that places nothing.
        needs_scores: the step scores every candidate anchor with the predictor before planning.
    """

    name: str
    fn: Callable[[AnchorRequest], np.ndarray] | None
    needs_scores: bool = False

    @property
    def expands(self) -> bool:
        """Whether arms with this rule run stage 2."""
        return self.fn is not None


PREFIX_RULES: dict[str, PrefixRule] = {}


def register_prefix_rule(name: str, *, needs_scores: bool = False):
    """Decorator registering ``fn(request: AnchorRequest) -> (K,) int64`` as the prefix rule ``name``.

    Decorating ``None`` (``register_prefix_rule("none")(None)``) registers the rule without stage 2.

    Args:
        name: the rule's name (what ``Arm.prefix_rule`` refers to).
        needs_scores: the rule reads ``anchor_probs`` (the step scores the anchors first).

    Returns:
        The decorator; it returns the function unchanged.

    Raises:
        ValueError: ``name`` is registered already.
    """
    def decorate(fn):
        if name in PREFIX_RULES:
            raise ValueError(f"prefix rule {name!r} is registered already")
        PREFIX_RULES[name] = PrefixRule(name, fn, needs_scores)
        return fn
    return decorate


def get_prefix_rule(name: str) -> PrefixRule:
    """The registered prefix rule ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered prefix rules.
    """
    try:
        return PREFIX_RULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown prefix rule {name!r}; valid: {', '.join(PREFIX_RULES)}") from None
