"""The input checks of ``RolloutAllocator`` and the arm sets it names, derived from the arm registry.

Every check here runs before the allocator changes any state, so a refused call leaves it as it was.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from trace.allocation.arms import ARMS

__all__ = ["SAMPLING_ROOT_RULES", "check_outcome", "planning_arms", "predictor_arms", "stage2_arms",
           "whole_budget"]

# root rules that sample while they allocate (they take the caller's samplers, ``RootRequest.sample_groups`` /
# ``sample_more``); every other registered root rule plans counts from what it knows before sampling
SAMPLING_ROOT_RULES = ("dapo", "reinforce_ada")


def planning_arms() -> tuple[str, ...]:
    """The registered arms whose root rule plans counts before sampling (all but ``SAMPLING_ROOT_RULES``'s)."""
    return tuple(name for name, arm in ARMS.items() if arm.root_rule not in SAMPLING_ROOT_RULES)


def predictor_arms() -> tuple[str, ...]:
    """The registered arms that read ``V_hat`` (``Arm.uses_predictor``)."""
    return tuple(name for name, arm in ARMS.items() if arm.uses_predictor)


def stage2_arms() -> tuple[str, ...]:
    """The registered arms whose prefix rule plans stage-2 continuations (``Arm.has_expansion``)."""
    return tuple(name for name, arm in ARMS.items() if arm.has_expansion)


def whole_budget(value: Any) -> int:
    """``trajectory_budget`` as an int: an int, or a finite float with an integral value (``32.0``).

    Raises:
        TypeError: not a number (naming ``trajectory_budget`` and the value).
        ValueError: not finite or not integral (``31.7`` is refused, not truncated).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"trajectory_budget={value!r} is not a number: pass an int (trajectories per step)")
    if not math.isfinite(value) or float(value) != int(value):
        raise ValueError(f"trajectory_budget={value!r} is not a whole number of trajectories: pass an int")
    return int(value)


def check_outcome(ids: list[str], groups: list[np.ndarray], texts: list[str], pending: Any,
                  has_expansion: bool) -> None:
    """Raise unless ``RolloutAllocator.observe``'s inputs are aligned, in [0, 1] and what was sampled.

    Args:
        ids: (K,) the sampled prompts' ids.
        groups: (K,) each one's (k,) float64 rewards.
        texts: (K,) their texts.
        pending: the ``Allocation`` awaiting its rewards, or None (no id or size check then).
        has_expansion: the arm runs stage 2 (a prompt's rewards are its leaves, not its count).

    Raises:
        ValueError: misaligned lengths, a repeated id, an empty group, a reward not finite or outside [0, 1]
            (naming the prompt and the value), an id ``pending`` did not sample, or (no stage 2) a group whose
            size is not the prompt's count.
    """
    if not len(ids) == len(groups) == len(texts):
        raise ValueError(f"got {len(ids)} prompt_ids, {len(groups)} reward groups and {len(texts)} texts: "
                         "pass one of each per sampled prompt")
    if len(set(ids)) != len(ids):
        raise ValueError(f"prompt_ids repeat within a step ({len(ids) - len(set(ids))} repeats): pass each "
                         "sampled prompt once, with all of its rewards")
    for uid, group in zip(ids, groups):
        if not group.size:
            raise ValueError(f"prompt {uid!r} has no rewards: pass only the prompts that were sampled")
        bad = group[~(np.isfinite(group) & (group >= 0) & (group <= 1))]
        if bad.size:
            raise ValueError(f"prompt {uid!r} has reward {float(bad[0])!r}, not a finite value in [0, 1]: the "
                             "predictor and the rule states read rewards as success rates; map the task's "
                             "reward into [0, 1] before observe")
    if pending is None:
        return
    count = {uid: int(c) for uid, c in zip(pending.prompt_ids, pending.counts)}
    for uid, group in zip(ids, groups):
        if count.get(uid, 0) == 0:
            raise ValueError(f"prompt {uid!r} was not sampled by the last allocate (its count is "
                             f"{count.get(uid, 'absent')}): pass the rewards of the prompts with counts > 0")
        if not has_expansion and group.size != count[uid]:
            raise ValueError(f"prompt {uid!r} has {group.size} rewards, the last allocate gave it "
                             f"{count[uid]} trajectories: pass one reward per sampled trajectory")

