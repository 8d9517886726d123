"""The pure parts of the verl recipe: per-prompt ``__rollout_n__`` from a ``RolloutAllocator``, rewards by ``uid``.

verl 0.9.1's V1 trainer (``verl/trainer/ppo/v1/trainer_base.py``) gives each prompt row a fresh ``uid`` in
``_fetch_one_gen_batch`` and returns the step's prompts from ``_next_train_batch(num_prompts)``; its agent
loop (``verl/trainer/ppo/v1/agent_loop_tq.py``, ``AgentLoopWorkerTQ._run_prompt``) samples
``prompt.pop("__rollout_n__", rollout.n)`` trajectories per prompt, and the advantage estimators group rows by
``uid`` (``compute_grpo_outcome_advantage(..., index=uid)``). A ``_next_train_batch`` override therefore needs
only: the counts for the batch's prompts (``plan_rollout_n``), the rows with a zero count dropped, the counts
written as the non-tensor column ``__rollout_n__``; and after the step, the rewards grouped by ``uid`` back to
the allocator (``rewards_by_prompt``). docs/integrations.md shows the override. Nothing here imports verl.

Invariants: ``sum(rollout_n) == trajectory_budget`` for a planning rule; every kept count is >= 1; a group is
found by its ``uid``, never by its position in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from trace.integrations.allocator import Allocation, RolloutAllocator

__all__ = ["RolloutNPlan", "plan_rollout_n", "rewards_by_prompt"]


@dataclass(frozen=True)
class RolloutNPlan:
    """What the ``_next_train_batch`` override writes into verl's batch.

    Attributes:
        keep_rows: (K,) int64 rows of the batch to keep (count > 0), in batch order.
        rollout_n: (K,) int64 ``__rollout_n__`` of the kept rows, each >= 1.
        uid_to_prompt_id: ``{uid: stable prompt id}`` of the kept rows, for ``rewards_by_prompt``.
        allocation: the allocator's full decision (metrics, forecast).
    """

    keep_rows: np.ndarray
    rollout_n: np.ndarray
    uid_to_prompt_id: dict
    allocation: Allocation


def plan_rollout_n(allocator: RolloutAllocator, uids: Sequence[str], prompt_ids: Sequence[str],
                   prompt_texts: Sequence[str] | None, trajectory_budget: int) -> RolloutNPlan:
    """Per-prompt ``__rollout_n__`` of one verl batch from the allocator.

    Args:
        allocator: the arm's ``RolloutAllocator``.
        uids: (B,) verl's per-step group ids of the batch's prompt rows (``batch["uid"]``).
        prompt_ids: (B,) stable ids of the same prompts (e.g. ``extra_info["index"]`` with the data source);
            the allocator's state is keyed by them, since ``uid`` is a fresh uuid every step.
        prompt_texts: (B,) the prompts' texts, or None.
        trajectory_budget: trajectories of the step, e.g. ``train_batch_size * rollout.n`` to keep verl's
            mini-batch arithmetic (which multiplies by ``rollout.n``) on the same number of rows.

    Returns:
        ``RolloutNPlan``.

    Raises:
        ValueError: misaligned or repeated ``uids``, or what ``RolloutAllocator.allocate`` raises.
    """
    uids = [str(u) for u in uids]
    if len(uids) != len(prompt_ids) or len(set(uids)) != len(uids):
        raise ValueError(f"got {len(uids)} uids ({len(set(uids))} distinct) for {len(prompt_ids)} prompt ids: pass "
                         "one distinct uid per prompt row of the batch")
    allocation = allocator.allocate(prompt_ids, prompt_texts, trajectory_budget=trajectory_budget)
    if allocation.expansion_budget:
        raise ValueError(f"arm {allocator.arm.name!r} leaves {allocation.expansion_budget} continuations for stage 2, "
                         "which __rollout_n__ cannot express: use AllocationConfig(expansion_ratio=0)")
    keep = np.flatnonzero(allocation.counts).astype(np.int64)
    return RolloutNPlan(keep_rows=keep, rollout_n=allocation.counts[keep].astype(np.int64),
                        uid_to_prompt_id={uids[i]: str(prompt_ids[i]) for i in keep}, allocation=allocation)


def rewards_by_prompt(row_uids: Sequence[str], row_rewards: Sequence[float],
                      uid_to_prompt_id: dict) -> tuple[list[str], list[np.ndarray]]:
    """The step's trajectory rewards grouped by ``uid``, as ``RolloutAllocator.observe`` takes them.

    Args:
        row_uids: (N,) the ``uid`` of each trajectory row (``non_tensor_batch["uid"]``), in any order.
        row_rewards: (N,) each row's scalar reward (e.g. ``token_level_scores.sum(-1)``).
        uid_to_prompt_id: ``RolloutNPlan.uid_to_prompt_id`` of the step.

    Returns:
        ``(prompt_ids, rewards)``: one stable id and one (k,) float64 array per group, in first-seen order.

    Raises:
        ValueError: misaligned lengths, or a ``uid`` the plan did not issue.
    """
    if len(row_uids) != len(row_rewards):
        raise ValueError(f"got {len(row_uids)} uids and {len(row_rewards)} rewards: pass one reward per row")
    groups: dict[str, list[float]] = {}
    for uid, reward in zip(row_uids, row_rewards):
        uid = str(uid)
        if uid not in uid_to_prompt_id:
            raise ValueError(f"uid {uid!r} is not in this step's plan: pass the uid_to_prompt_id of the step that "
                             "sampled these rows")
        groups.setdefault(uid, []).append(float(reward))
    return ([uid_to_prompt_id[u] for u in groups], [np.asarray(r, dtype=np.float64) for r in groups.values()])
