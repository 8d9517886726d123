"""DAPO dynamic sampling as a root rule: sample groups in rounds, keep the mixed ones, within the budget.

``dapo`` is the one root rule that samples while it allocates and may sample fewer than T trajectories:
``run_dapo`` reports what it left unspent. When no sampled group is mixed within
``allocation.dapo_max_retries`` it raises ``NoMixedGroupError``, the one outcome a training step absorbs
(the step then trains on nothing); every other error raised while sampling stops the run.

References:
    DAPO (arXiv 2503.14476), dynamic sampling: over-sample and filter out groups with accuracy 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from trace.allocation.registry import RootDecision, RootRequest, register_root_rule

__all__ = ["DapoResult", "NoMixedGroupError", "run_dapo", "dapo_root_rule"]


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

    Raised only for that outcome, so a caller can absorb it (``trace.training.loop.Trainer.step`` logs
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

    @property
    def metrics(self) -> dict[str, float]:
        """The step's log entries for this outcome: rounds run, the flag, and no kept group."""
        return {"dapo/rounds": float(self.num_rounds), "dapo/no_mixed_group": 1.0, "dapo/kept_groups": 0.0}


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


@register_root_rule("dapo")
def dapo_root_rule(request: RootRequest) -> RootDecision:
    """DAPO: ``run_dapo`` over the step's candidates, sampling groups of ``n`` through ``request.sample_groups``.

    Round ``r`` samples with salt ``"dapo<k>"``, ``k`` the number of trees sampled before it; the candidate
    order is drawn from ``request.rng_for("dapo")``.

    Returns:
        ``RootDecision`` with ``counts`` the rollouts per sampled candidate, ``trees`` the groups kept (mixed
        rewards) and ``sampled_trees`` all of them, in sampling order; ``expansion_budget`` 0; metrics
        ``dapo/rounds`` and ``dapo/kept_groups``.

    Raises:
        ValueError: no ``sample_groups`` or ``rng_for`` (a plan without a sampler cannot run dapo), or the
            errors of ``run_dapo``.
        NoMixedGroupError: no sampled group had mixed rewards.
    """
    if request.sample_groups is None or request.rng_for is None:
        raise ValueError("the dapo arm samples in rounds until it finds mixed groups: call run_dapo or "
                         "trace.allocation.step.allocate_step with a sampler, not plan_root_counts")
    sampled: list = []
    sampled_candidates: list[int] = []

    def rollout_fn(cand_idx: np.ndarray, n: int):
        trees = list(request.sample_groups(cand_idx, n, f"dapo{len(sampled)}"))
        sampled.extend(trees)
        sampled_candidates.extend(cand_idx.tolist()[:len(trees)])
        return [t.leaf_rewards() for t in trees]

    result = run_dapo(rollout_fn, request.num_candidates, request.group_size, request.trajectory_budget,
                      request.max_retries, request.rng_for("dapo"))
    kept = set(int(i) for i in result.kept_candidates)
    counts = np.zeros(request.num_candidates, dtype=np.int64)
    counts[result.sampled_candidates] = request.group_size
    return RootDecision(counts=counts, info={"unspent": int(result.unspent)},
                        trees=[t for t, c in zip(sampled, sampled_candidates) if c in kept],
                        sampled_trees=sampled, expansion_budget=0,
                        metrics={"dapo/rounds": float(result.num_rounds), "dapo/kept_groups": float(len(kept))})
