"""The allocators of this project for any trainer: per-prompt rollout counts from a registered arm.

``RolloutAllocator`` is the one entry a foreign trainer (TRL, verl, a hand-written loop) calls. Each step it
receives the step's candidate prompts by a stable id (and text), returns how many trajectories each gets
from the arm's root rule (``trace.allocation.arms.plan_root_counts``), and afterwards takes back the rewards
of what was sampled, feeding the rule's ``AllocatorState`` (GRESO, MoPPS, VIP) and, for arms that read
``V_hat`` (``predictor_arms()``: ``knapsack``, ``pcl``, ``trace_root``, ``trace_prefix``, ``trace``), a
per-prompt Beta-Bernoulli success predictor (the ``history`` backend). For arms with stage 2
(``stage2_arms()``: ``tree_random``, ``treepo``, ``trace_prefix``, ``trace``) it plans the continuations over
the trees the caller sampled (``plan_continuations``). Everything it keeps between calls is in
``state_dict()``, strict JSON, so a trainer's checkpoint carries it. ``allocation.explore_groups`` gives that
many uniformly drawn candidates a group of ``group_size`` first, for the arms whose root rule passes over
prompts by forecast (``trace.allocation.step.explores``), as the pipeline's ``allocate_step`` does.

Invariants: a planning rule's counts sum to ``trajectory_budget`` (minus the stage-2 share of arms that
expand); every count is >= 0 and <= ``count_cap`` (``m_max``; ``vip.n_max`` for ``vip``, which sizes groups by
its own rule): a step that would exceed it is refused, not clipped; the same state and candidates give the
same counts (the random rules draw from ``step_rng(seed, step, purpose)``); a refused ``allocate`` or
``observe`` leaves the state as it was. Nothing here imports torch, TRL or verl.

Simplifications: the predictor is the ``history`` backend (no policy features, no encoder); the rules that
sample while they allocate (``dapo``, ``reinforce_ada``) need the caller's samplers (``sample_groups``,
``sample_more``), which a trainer that generates once per step cannot give.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from trace.allocation.arms import ARMS, make_allocator_state, plan_root_counts, root_budget_for
from trace.allocation.objectives import activation_prob
from trace.allocation.prefix import split_expansion_budget
from trace.allocation.prefix_rules import plan_expansion
from trace.allocation.step import exploration_split
from trace.integrations.inputs import SAMPLING_ROOT_RULES, check_outcome, planning_arms, predictor_arms, \
    stage2_arms, whole_budget
from trace.configuration.config import AllocationConfig, PredictorConfig, PredictorKind
from trace.predictor.base import clip_predictions
from trace.predictor.history import HistoryPredictor
from trace.training.seeding import step_rng
from trace.tree import Origin, RolloutTree

__all__ = ["Allocation", "RolloutAllocator", "SAMPLING_ROOT_RULES", "STATE_FORMAT_VERSION", "group_outcome_metrics",
           "planning_arms", "predictor_arms", "stage2_arms"]

STATE_FORMAT_VERSION = 1
STATE_KEYS = ("format_version", "arm", "step", "seed", "rule_state", "predictor")

@dataclass(frozen=True, eq=False)
class Allocation:
    """One step's decision.

    Attributes:
        prompt_ids: (B,) the candidates' stable ids, in the caller's order.
        counts: (B,) int64 trajectories per candidate (0: not sampled this step).
        pred_success_prob: (B,) float64 ``V_hat`` per candidate in ``[clip, 1 - clip]``; NaN for arms that
            read no predictor.
        expansion_budget: continuations left for stage 2 (0 for arms without it).
        info: the rule's solver details (objective, gap, method), JSON-serialisable.
        metrics: the rule's entries for the step's log.
    """

    prompt_ids: tuple[str, ...]
    counts: np.ndarray
    pred_success_prob: np.ndarray
    expansion_budget: int
    info: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    @property
    def forecast_mixed_groups(self) -> float:
        """Expected groups holding a success and a failure, ``sum_i A(p_i, m_i)``; NaN without a predictor.

        References:
            TRACE (arXiv 2606.11119), the stage-1 objective ``A(p, m) = 1 - p^m - (1 - p)^m``.
        """
        if np.isnan(self.pred_success_prob).any():
            return float("nan")
        return float(np.sum(activation_prob(self.pred_success_prob, self.counts)))


def group_outcome_metrics(rewards: Sequence[np.ndarray]) -> dict[str, float]:
    """What one step's groups gave: how many had contrast and how many trajectories were in them.

    Args:
        rewards: one (k_i,) float array of trajectory rewards per sampled prompt (k_i >= 1).

    Returns:
        ``allocation/effective_ratio`` (share of trajectories in a group whose rewards are not all equal, the
        groups with a nonzero GRPO advantage), ``allocation/realised_mixed_groups``,
        ``allocation/trajectories_per_prompt`` (mean k_i over sampled prompts), ``allocation/active_prompts``.

    References:
        Knapsack-RL (arXiv 2509.25849) and TRACE (arXiv 2606.11119): the effective ratio. Flat groups only;
        ``trace.metrics.effective_ratio`` is the tree version.
    """
    groups = [np.asarray(r, dtype=np.float64).reshape(-1) for r in rewards]
    groups = [g for g in groups if g.size]
    total = sum(g.size for g in groups)
    mixed = [g for g in groups if g.size >= 2 and np.ptp(g) > 0]
    return {
        "allocation/effective_ratio": float(sum(g.size for g in mixed) / total) if total else 0.0,
        "allocation/realised_mixed_groups": float(len(mixed)),
        "allocation/trajectories_per_prompt": float(total / len(groups)) if groups else 0.0,
        "allocation/active_prompts": float(len(groups)),
    }


class RolloutAllocator:
    """Per-prompt trajectory counts from a registered arm, with its state kept between steps.

    Args:
        arm: a registered arm name (``trace.allocation.arms.ARMS``: ``grpo``, ``trace``, ``knapsack``,
            ``pcl``, ``greso``, ``mopps``, ``vip``, ...).
        allocation: the allocation settings (``AllocationConfig``: ``m_min``, ``m_max``, ``group_size``,
            ``expansion_ratio``, the per-rule sections); None takes the defaults. Its ``trajectory_budget`` is
            the budget unless ``allocate`` is given one.
        predictor: prior of the ``history`` predictor (``prior_alpha``, ``prior_beta``, ``clip``); None takes
            the defaults; its ``kind`` must be ``history``.
        seed: seed of the rules that draw (``greso``, ``mopps``).

    Raises:
        ValueError: an unknown arm (the message lists the registered ones), or a predictor kind other than
            ``history``.
    """

    def __init__(self, arm: str, allocation: AllocationConfig | None = None,
                 predictor: PredictorConfig | None = None, seed: int = 0) -> None:
        if not isinstance(arm, str) or arm not in ARMS:
            raise ValueError(f"RolloutAllocator(arm={arm!r}): not a registered arm; pass one of {', '.join(ARMS)} "
                             f"(planning arms, which fit a trainer that generates once per step: "
                             f"{', '.join(planning_arms())})")
        self.arm = ARMS[arm]
        self.allocation = allocation if allocation is not None else AllocationConfig()
        predictor = predictor if predictor is not None else PredictorConfig(kind=PredictorKind.HISTORY)
        if predictor.kind != PredictorKind.HISTORY:
            raise ValueError(f"RolloutAllocator keeps a 'history' predictor, got predictor.kind="
                             f"{predictor.kind.value!r}: pass PredictorConfig(kind='history', ...)")
        self.predictor = HistoryPredictor(predictor, seed=seed)
        self.rule_state = make_allocator_state(self.arm, self.allocation)
        self.seed = int(seed)
        self.step = 0
        self.last: Allocation | None = None
        self._pending: Allocation | None = None  # allocated, its rewards not yet observed

    @property
    def count_cap(self) -> tuple[int, str]:
        """The most trajectories the arm gives one prompt and the setting that sets it: ``allocation.m_max``, or
        ``allocation.vip.n_max`` for ``vip`` (which sizes groups by its own rule)."""
        if self.arm.root_rule == "vip":
            return int(self.allocation.vip.n_max), "allocation.vip.n_max"
        return int(self.allocation.m_max), "allocation.m_max"

    def check_budget(self, trajectory_budget: Any, num_candidates: int | None = None) -> int:
        """``trajectory_budget`` as an int, or an error saying what to pass.

        Args:
            trajectory_budget: T, trajectories of the step (an int, or a float with an integral value).
            num_candidates: B, the step's candidate prompts; None skips the capacity check.

        Returns:
            T as an int.

        Raises:
            TypeError: not a number.
            ValueError: not finite, not integral, a root budget (``round(T / (1 + expansion_ratio))`` for arms
                with stage 2, else T) below ``allocation.m_min`` (>= 2: a group of one has no contrast), or a
                root budget above ``B`` times the most trajectories of one prompt (``count_cap``). Each message
                names ``trajectory_budget``, its value and the fix.
        """
        value = trajectory_budget
        budget, acfg = whole_budget(value), self.allocation
        root = root_budget_for(self.arm, budget, acfg.expansion_ratio)
        if root < acfg.m_min:
            stage2 = (f" with expansion_ratio={acfg.expansion_ratio} leaves {root} root trajectories, which is"
                      if root != budget else " is")
            raise ValueError(f"trajectory_budget={value!r}{stage2} below allocation.m_min={acfg.m_min}, the smallest "
                             "group with contrast (a group of one has no baseline): "
                             + (f"pass trajectory_budget >= {acfg.m_min}" if root == budget else
                                f"raise trajectory_budget until its root budget is >= {acfg.m_min}, or lower "
                                "allocation.expansion_ratio"))
        cap, cap_key = self.count_cap
        if num_candidates is not None and root > num_candidates * cap:
            raise ValueError(f"trajectory_budget={value!r} needs {root} root trajectories, more than {num_candidates} "
                             f"candidate prompts can take at {cap_key}={cap} each: pass at least "
                             f"{-(-root // cap)} candidates, lower trajectory_budget to <= {num_candidates * cap}, or "
                             f"raise {cap_key}")
        return budget

    def predict(self, prompt_ids: Sequence[str]) -> np.ndarray:
        """(B,) float64 posterior-mean success probability of each prompt, clipped to ``[clip, 1 - clip]``."""
        alpha, beta = self.predictor.posterior([str(u) for u in prompt_ids])
        return clip_predictions(alpha / (alpha + beta), self.predictor.cfg.clip)

    def allocate(self, prompt_ids: Sequence[str], prompt_texts: Sequence[str] | None = None, *,
                 trajectory_budget: int | None = None,
                 sample_groups: Callable | None = None, sample_more: Callable | None = None) -> Allocation:
        """Trajectories per candidate prompt for this step, by the arm's root rule.

        Args:
            prompt_ids: (B,) stable ids of the candidates (the same prompt gets the same id every step; a
                per-step group uuid will not do: the state is keyed by it).
            prompt_texts: (B,) their texts (``vip`` embeds them); None: empty strings.
            trajectory_budget: T, trajectories of the step (roots + continuations); None:
                ``allocation.trajectory_budget``.
            sample_groups, sample_more: the samplers of the rules that sample while they allocate (``dapo``,
                ``reinforce_ada``; see ``trace.allocation.registry.RootRequest``); None for the planning rules.

        Returns:
            ``Allocation``; ``counts.sum() + expansion_budget == T`` for every planning rule.

        Raises:
            ValueError: an empty, duplicate or misaligned id list; a budget that ``check_budget`` refuses
                (including more root trajectories than the candidates hold at ``count_cap`` each); counts
                above ``count_cap`` (uniform groups of ``group_size`` over too few candidates, the rule state
                left as it was); an infeasible budget of the rule (the message names the setting); or a sampling
                rule without its samplers.
            TypeError: a budget that is not a number.
        """
        ids = [str(u) for u in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty: pass the step's candidate prompts (at least one)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt_ids must be distinct within a step, got {len(ids)} ids with "
                             f"{len(ids) - len(set(ids))} repeats: pass each candidate prompt once")
        texts = [""] * len(ids) if prompt_texts is None else [str(t) for t in prompt_texts]
        if len(texts) != len(ids):
            raise ValueError(f"got {len(ids)} prompt_ids and {len(texts)} prompt_texts: pass one text per id")
        budget = self.check_budget(self.allocation.trajectory_budget if trajectory_budget is None
                                   else trajectory_budget, len(ids))
        acfg = self.allocation
        pred = self.predict(ids) if self.arm.uses_predictor else np.full(len(ids), np.nan)
        step = self.step
        rng_for = lambda purpose: step_rng(self.seed, step, purpose)  # noqa: E731
        explore, rest, reserved = exploration_split(self.arm, len(ids), acfg, rng_for)  # before any forecast is read
        root_budget = root_budget_for(self.arm, budget, acfg.expansion_ratio)
        if explore.size and (explore.size >= len(ids) or reserved >= root_budget):
            raise ValueError(f"allocation.explore_groups={acfg.explore_groups} x group_size={acfg.group_size} leaves "
                             f"the root rule of {self.arm.name!r} no candidate or no trajectory of {len(ids)} "
                             f"candidates and trajectory_budget={budget}: lower explore_groups, or pass more of both")
        saved = None if self.rule_state is None else self.rule_state.state_dict()  # greso records candidates
        plan = plan_root_counts(
            self.arm, pred[rest], trajectory_budget=budget - reserved, expansion_ratio=acfg.expansion_ratio,
            group_size=acfg.group_size, m_min=acfg.m_min, m_max=acfg.m_max, knapsack_m_min=acfg.knapsack_m_min,
            tie_keys=[ids[i] for i in rest], exact_max_cells=acfg.exact_max_cells, max_retries=acfg.dapo_max_retries,
            rng_for=rng_for, sample_groups=sample_groups, root_objective=acfg.root_objective, sample_more=sample_more,
            prompt_uids=[ids[i] for i in rest], prompt_texts=[texts[i] for i in rest], state=self.rule_state,
            config=acfg, root_budget=root_budget - reserved if reserved else None)
        counts = np.zeros(len(ids), dtype=np.int64)
        counts[rest], counts[explore] = np.asarray(plan.counts, dtype=np.int64), acfg.group_size
        metrics = {**plan.metrics, **({"allocation/explore_groups": float(explore.size)} if explore.size else {})}
        cap, cap_key = self.count_cap
        if counts.max(initial=0) > cap:  # uniform groups spread over fewer candidates than R // group_size
            if saved is not None:
                self.rule_state.load_state_dict(saved)
            raise ValueError(f"arm {self.arm.name!r} would give a prompt {int(counts.max())} trajectories, more than "
                             f"{cap_key}={cap} (trajectory_budget={budget}, {len(ids)} candidates, group_size="
                             f"{acfg.group_size}): pass more candidates, lower trajectory_budget, or set "
                             f"group_size <= {cap_key}")
        self.last = Allocation(prompt_ids=tuple(ids), counts=counts, pred_success_prob=pred,
                               expansion_budget=int(plan.expansion_budget), info=dict(plan.info), metrics=metrics)
        self._pending = self.last
        return self.last

    def plan_continuations(self, trees: Sequence[RolloutTree], allocation: Allocation | None = None) -> dict:
        """Stage 2: continuations per anchor over the trees sampled for ``allocation``'s active prompts.

        Args:
            trees: one multi-turn ``RolloutTree`` per active prompt (``counts > 0``), in candidate order,
                after stage 1.
            allocation: the step's ``Allocation``; None: the last one ``allocate`` returned.

        Returns:
            ``{(tree_idx, node_id): continuations}``, summing to the stage-2 budget less what no tree could
            take (a tree whose trajectories all ended in one turn has no anchor).

        Raises:
            ValueError: no allocation yet, or the trees do not match its active prompts.
        """
        allocation = allocation if allocation is not None else self.last
        if allocation is None:
            raise ValueError("plan_continuations needs the step's Allocation: call allocate first")
        active = np.flatnonzero(allocation.counts)
        if [t.prompt_uid for t in trees] != [allocation.prompt_ids[i] for i in active]:
            raise ValueError("trees must be one per active prompt (counts > 0), in candidate order, with "
                             "prompt_uid equal to its prompt id")
        if not self.arm.has_expansion or allocation.expansion_budget == 0 or not len(trees):
            return {}
        per_tree = split_expansion_budget(allocation.counts[active], allocation.expansion_budget,
                                          tie_keys=[t.prompt_uid for t in trees])
        anchor_probs = {(t, node.node_id): float(self.predict([tree.prompt_uid])[0])
                        for t, tree in enumerate(trees) for node in tree.nodes[1:]}
        plan = plan_expansion(self.arm, trees, anchor_probs, per_tree, step_rng(self.seed, self.step, "expand0"),
                              self.allocation.treepo_width)
        return {key: int(k) for key, k in plan.counts.items() if k > 0}

    def observe(self, prompt_ids: Sequence[str], rewards: Sequence[Sequence[float]],
                prompt_texts: Sequence[str] | None = None) -> dict[str, float]:
        """Take one step's outcome back and advance to the next step.

        Args:
            prompt_ids: one stable id per sampled prompt.
            rewards: that prompt's (k,) trajectory rewards in ``[0, 1]`` (the predictor reads them as
                success rates; the rule states as the paper of each rule says), k >= 1. After ``allocate``,
                k is the prompt's count for arms without stage 2 (with stage 2: its leaves, any k >= 1).
            prompt_texts: their texts; None: empty strings.

        Returns:
            ``group_outcome_metrics`` of the step, ``allocation/forecast_mixed_groups`` of the last
            allocation (NaN without a predictor), and the rule state's own metrics.

        Raises:
            ValueError: misaligned lengths, a repeated id, an empty reward group, a reward that is not finite
                or lies outside [0, 1] (naming the prompt id and the value), and, while an allocation awaits
                its rewards, an id it did not sample or (arms without stage 2) a group whose size is not the
                prompt's count. Every check runs before any state changes, so a refused call leaves the
                allocator as it was.
        """
        ids = [str(u) for u in prompt_ids]
        groups = [np.asarray(r, dtype=np.float64).reshape(-1) for r in rewards]
        texts = [""] * len(ids) if prompt_texts is None else [str(t) for t in prompt_texts]
        check_outcome(ids, groups, texts, self._pending, self.arm.has_expansion)
        metrics = group_outcome_metrics(groups)
        metrics["allocation/forecast_mixed_groups"] = (self.last.forecast_mixed_groups if self.last is not None
                                                       else float("nan"))
        if self.rule_state is not None:
            metrics.update(self.rule_state.observe(ids, groups, texts))
        self.predictor.fit([self._flat_tree(uid, g) for uid, g in zip(ids, groups)])
        self.step += 1
        self._pending = None
        return metrics

    def _flat_tree(self, prompt_id: str, rewards: np.ndarray) -> RolloutTree:
        """A one-turn tree of the step's trajectories of one prompt, the form the predictor fits on."""
        tree = RolloutTree(tree_id=f"{self.arm.name}/{self.step}/{prompt_id}", prompt_uid=prompt_id,
                           data_source="external", example_id=prompt_id, step=self.step, ablation=self.arm.name)
        tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
        for reward in rewards:
            tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, reward=float(reward))
        return tree

    def state_dict(self) -> dict[str, Any]:
        """Everything kept between steps, JSON-serialisable: arm, step, seed, rule state, predictor state."""
        return {"format_version": STATE_FORMAT_VERSION, "arm": self.arm.name, "step": self.step, "seed": self.seed,
                "rule_state": None if self.rule_state is None else self.rule_state.state_dict(),
                "predictor": self.predictor.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output.

        Raises:
            ValueError: a state lacking one of ``state_dict()``'s keys (naming them), or of another arm or
                format version (the message names both).
        """
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"allocator state lacks {', '.join(map(repr, missing))} (it has {sorted(state)}): "
                             "pass the whole dict that RolloutAllocator.state_dict() returned")
        if state.get("format_version") != STATE_FORMAT_VERSION:
            raise ValueError(f"allocator state has format_version {state.get('format_version')!r}, this code reads "
                             f"{STATE_FORMAT_VERSION}")
        if state.get("arm") != self.arm.name:
            raise ValueError(f"allocator state is for arm {state.get('arm')!r}, this allocator runs "
                             f"{self.arm.name!r}: build RolloutAllocator({state.get('arm')!r}, ...)")
        self.step, self.seed = int(state["step"]), int(state["seed"])
        if self.rule_state is not None:
            self.rule_state.load_state_dict(state["rule_state"])
        self.predictor.load_state_dict(dict(state["predictor"]))
        self.last = self._pending = None
