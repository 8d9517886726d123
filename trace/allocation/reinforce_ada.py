"""Reinforce-Ada as a root rule: sample in rounds, and stop sampling a prompt once its group has enough contrast.

Round 1 gives ``round_repeat`` (8) rollouts to each of the first ``G`` candidates (``allocation.reinforce_ada.
initial_prompts``; default ``T // (2 round_repeat)``, so round 1 spends half the budget). Each later round gives
``round_repeat`` more to every prompt still active, in candidate order, appended to the same tree (one group per
prompt: the advantage's mean and standard deviation run over every rollout drawn for it, the original's
``global_stat_est``). A prompt retires when

- ``balanced`` (default): it has at least ``n // 2`` positive and ``n - n // 2`` negative rollouts (positive
  means reward > ``positive_threshold``). ``n`` is ``allocation.reinforce_ada.keep``, the original's kept
  rollouts per prompt: 4 as in its script (``rollout.n`` = 4), so a prompt retires at 2 and 2 (at p = 0.5,
  after one round of 8 with probability 0.93); ``keep: null`` takes ``allocation.group_size`` (8: 4 and 4,
  0.27 after one round);
- ``positive_focused``: it has one positive rollout;

or after ``max_rounds`` rounds. The original lets each step draw 8-32 rollouts per prompt; here the rounds stop
when the step's trajectory budget ``T`` is spent (a last round may give fewer than ``round_repeat``), and when
every prompt has retired with budget left, the next candidates enter with ``round_repeat`` each, so every step
draws exactly ``T``. The original then trains on ``n`` kept rollouts per prompt (balanced where it can); here
every drawn rollout is trained on, as every other arm trains on what it draws: the budget counts drawn
trajectories, and the kept ones are all of them. The advantage is the shared ``advantages`` section's (the
original's script turns the std division off: ``advantages.scale=none``), so arms differ only in allocation.
Rollouts of later rounds are bare rollouts from the root (``Origin.ROLLOUT``), as round 1's.

References:
    Xiong et al., "Reinforce-Ada: An Adaptive Sampling Framework for Reinforce-Style LLM Training"
    (arXiv 2510.04996), Alg. 1 (multi-round sampling with exit on enough positives and negatives);
    public code RLHFlow/Reinforce-Ada (``_generate_multi_round_adaptive_downsampling``).
"""

from __future__ import annotations

import numpy as np

from trace.allocation.registry import RootDecision, RootRequest, register_root_rule
from trace.tree import Origin

__all__ = ["is_retired", "reinforce_ada_root_rule"]


def _settings(config):
    from trace.configuration.config_allocators import ReinforceAdaConfig

    return getattr(config, "reinforce_ada", None) or ReinforceAdaConfig()


def is_retired(rewards: np.ndarray, group_size: int, mode: str, positive_threshold: float) -> bool:
    """Whether a prompt with these leaf rewards stops being sampled.

    Args:
        rewards: (k,) float64 every rollout's reward drawn for the prompt so far.
        group_size: n; ``balanced`` wants ``n // 2`` positives and ``n - n // 2`` negatives.
        mode: ``"balanced"`` or ``"positive_focused"``.
        positive_threshold: a rollout is positive when its reward is > this.

    Returns:
        True when the prompt has enough contrast (or, ``positive_focused``, a positive) to stop sampling it.

    Raises:
        ValueError: an unknown mode.
    """
    positives = int(np.count_nonzero(np.asarray(rewards) > positive_threshold))
    negatives = int(np.size(rewards)) - positives
    if mode == "balanced":
        return positives >= group_size // 2 and negatives >= group_size - group_size // 2
    if mode == "positive_focused":
        return positives >= 1
    raise ValueError(f"allocation.reinforce_ada.mode must be balanced or positive_focused, got {mode!r}")


@register_root_rule("reinforce_ada")
def reinforce_ada_root_rule(request: RootRequest) -> RootDecision:
    """Reinforce-Ada within the step's budget: rounds of ``round_repeat`` to the active prompts (module doc).

    Round ``r`` samples with salt ``"ada<r>"``: new prompts through ``request.sample_groups``, more rollouts of a
    prompt through ``request.sample_more``.

    Returns:
        ``RootDecision`` with ``trees`` = ``sampled_trees`` (one per prompt sampled, in sampling order),
        ``counts`` (B,) int64 the rollouts of each candidate (summing to ``R``), ``expansion_budget`` 0; metrics
        ``reinforce_ada/rounds``, ``reinforce_ada/prompts`` and ``reinforce_ada/retired`` (prompts that met the
        exit rule).

    Raises:
        ValueError: no ``sample_groups``, ``sample_more`` or candidates to spend the budget on.
    """
    if request.sample_groups is None or request.sample_more is None:
        raise ValueError("the reinforce_ada arm samples in rounds: call trace.allocation.step.allocate_step with a "
                         "sampler, not plan_root_counts")
    s = _settings(request.config)
    budget, repeat = request.root_budget, s.round_repeat
    n = s.keep if s.keep is not None else request.group_size
    num_candidates = request.num_candidates
    if budget > 0 and num_candidates == 0:
        raise ValueError(f"cannot spend {budget} trajectories on 0 candidates: raise allocation.num_candidates")
    initial = s.initial_prompts if s.initial_prompts is not None else max(1, budget // (2 * repeat))
    trees: list = []
    tree_of: list[int] = []  # candidate index of each tree
    rounds_of: list[int] = []  # rounds each tree's prompt received
    retired: list[bool] = []
    cursor = spent = rnd = 0

    def open_prompts(count: int, size: int) -> None:
        nonlocal cursor, spent
        idx = np.arange(cursor, cursor + count, dtype=np.int64)
        new = list(request.sample_groups(idx, size, f"ada{rnd}"))
        cursor += count
        spent += count * size
        for i, tree in zip(idx.tolist(), new):
            trees.append(tree)
            tree_of.append(i)
            rounds_of.append(1)
            retired.append(is_retired(tree.leaf_rewards(), n, s.mode, s.positive_threshold))

    while spent < budget:
        left = budget - spent
        active = [j for j in range(len(trees)) if not retired[j] and rounds_of[j] < s.max_rounds]
        if rnd == 0 or not active:
            count = min(num_candidates - cursor, max(1, left // repeat) if rnd else min(initial, left // repeat or 1))
            if count <= 0:
                break
            open_prompts(count, min(repeat, left))
        else:
            more = [0] * len(trees)
            for j in active:
                more[j] = min(repeat, budget - spent - sum(more))
            request.sample_more(trees, more, f"ada{rnd}")
            spent += sum(more)
            for j in active:
                if more[j]:
                    rounds_of[j] += 1
                    retired[j] = is_retired(trees[j].leaf_rewards(), n, s.mode, s.positive_threshold)
        rnd += 1
    if spent < budget and trees:
        # every candidate was opened and every prompt retired or ran its rounds: the rest one by one, in order
        left = budget - spent
        extra = [left // len(trees) + (1 if j < left % len(trees) else 0) for j in range(len(trees))]
        request.sample_more(trees, extra, f"ada{rnd}")
        rnd += 1
    counts = np.zeros(num_candidates, dtype=np.int64)
    for i, tree in zip(tree_of, trees):
        for node in tree.nodes:  # later rounds' rollouts start at the root: bare rollouts, as round 1's
            if node.origin == Origin.BRANCH:
                node.origin, node.branch_anchor_id = Origin.ROLLOUT, -1
        tree.root.num_branches = counts[i] = tree.num_trajectories()
    return RootDecision(counts=counts, info={"method": "rounds"}, trees=list(trees), sampled_trees=list(trees),
                        expansion_budget=0,
                        metrics={"reinforce_ada/rounds": float(rnd), "reinforce_ada/prompts": float(len(trees)),
                                 "reinforce_ada/retired": float(sum(retired))})
