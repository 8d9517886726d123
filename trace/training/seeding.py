"""Seeds and candidate prompts: every random stream of a run derives from ``(seed, step, purpose)``.

``step_seed`` / ``step_rng`` name a stream by the run's seed, a step (or epoch, or position) and a salt, so a
stream never depends on what ran before it: every arm sees the same candidate prompts at a step, and a run
resumed from a checkpoint draws what an uninterrupted one does. ``candidate_indices`` is the candidate
prompt order of training: epochs of seeded permutations, each drawing every prompt exactly once.
"""

from __future__ import annotations

import zlib

import numpy as np


def step_seed(seed: int, step: int, salt: str = "") -> int:
    """A 31-bit seed for one step (and purpose), stable across processes and Python versions.

    Args:
        seed: the run's ``seed``.
        step: the training step, or any other index the purpose is keyed by (an epoch, a prompt position).
        salt: the purpose; distinct salts give unrelated seeds.

    Returns:
        ``crc32("{seed}/{step}/{salt}") & 0x7FFFFFFF``, in [0, 2**31).
    """
    return zlib.crc32(f"{seed}/{step}/{salt}".encode()) & 0x7FFFFFFF


def step_rng(seed: int, step: int, salt: str = "") -> np.random.Generator:
    """A numpy generator seeded with ``step_seed(seed, step, salt)``: the random stream of one step's purpose.

    Args:
        seed: the run's ``seed``.
        step: the training step (``-1`` for the stages before training, an epoch for prompt order).
        salt: the purpose (``"sft"``, ``"dapo"``, ``"expand0"``, ...); distinct salts give independent streams.

    Returns:
        A fresh ``np.random.Generator``; the same arguments give the same draws in every process.
    """
    return np.random.default_rng(step_seed(seed, step, salt))


def check_candidate_pool(num_prompts: int, num_candidates: int) -> None:
    """Refuse a candidate pool that cannot give a step ``num_candidates`` distinct prompts.

    Args:
        num_prompts: P, training prompts in the pool.
        num_candidates: B, ``allocation.num_candidates``.

    Raises:
        ValueError: ``P < 1``, ``B < 1``, or ``B > P``; the message names the params to change.
    """
    if num_prompts < 1:
        raise ValueError("no training prompts: check the prepare stage's output")
    if num_candidates < 1:
        raise ValueError(f"allocation.num_candidates must be >= 1, got {num_candidates}")
    if num_candidates > num_prompts:
        raise ValueError(
            f"allocation.num_candidates={num_candidates} exceeds the {num_prompts} training prompts, and a step's "
            "candidates must be distinct prompts: lower allocation.num_candidates or train on more prompts "
            "(task.kgqa.num_train, task.simulator.num_prompts, task.files.max_train or a larger data file)")


def _epoch_permutation(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(step_seed(seed, epoch, "epoch")).permutation(num_prompts)


def _boundary_tail(num_prompts: int, num_candidates: int, epoch: int) -> int:
    """Positions of epoch ``epoch - 1`` inside the step that starts epoch ``epoch`` (0: a step starts it)."""
    return (epoch * num_prompts) % num_candidates


def _order_after(order: np.ndarray, permutation: np.ndarray, num_candidates: int, tail: int) -> np.ndarray:
    """The next epoch's drawing order: ``permutation`` with the prompts of the boundary step moved back.

    The boundary step holds the last ``tail`` prompts of ``order``; it takes the first ``B - tail`` prompts of
    ``permutation`` that it does not hold yet, and the prompts it skipped follow right after them.
    """
    if tail == 0:
        return permutation
    held = np.isin(permutation, order[order.size - tail:])
    free = np.flatnonzero(~held)
    cut = int(free[num_candidates - tail - 1]) + 1  # permutation[:cut] holds exactly B - tail free prompts
    head, head_held = permutation[:cut], held[:cut]
    return np.concatenate([head[~head_held], head[head_held], permutation[cut:]])


def _epoch_order(num_prompts: int, num_candidates: int, seed: int, epoch: int) -> np.ndarray:
    """(P,) the drawing order of ``epoch``: its seeded permutation, repaired at the boundary with ``epoch - 1``."""
    tail = _boundary_tail(num_prompts, num_candidates, epoch)
    if tail == 0:
        return _epoch_permutation(num_prompts, seed, epoch)
    # The repair of epoch j moves only its first B positions, so the last prompts of epoch j are those of its
    # plain permutation when a step starts epoch j or when the share of it in its final step,
    # ``_boundary_tail(j + 1)``, lies past position B. Start from the latest such epoch (epoch 0 always is one)
    # and repair forward.
    first = epoch - 1
    while first > 0 and _boundary_tail(num_prompts, num_candidates, first) != 0 \
            and num_candidates + _boundary_tail(num_prompts, num_candidates, first + 1) > num_prompts:
        first -= 1
    order = _epoch_permutation(num_prompts, seed, first)
    for later in range(first + 1, epoch + 1):
        order = _order_after(order, _epoch_permutation(num_prompts, seed, later), num_candidates,
                             _boundary_tail(num_prompts, num_candidates, later))
    return order


def candidate_indices(num_prompts: int, num_candidates: int, seed: int, step: int) -> np.ndarray:
    """(B,) int64 indices of the ``B`` distinct candidate prompts of ``step``.

    Positions ``step * B .. step * B + B - 1`` of a stream of epochs, each epoch a seeded permutation of the
    ``P`` prompts (``step_seed(seed, epoch, "epoch")``). When ``P`` is not a multiple of ``B``, a step can
    straddle an epoch boundary: it holds the last prompts of one epoch and completes itself with the first
    prompts of the next epoch's permutation that it does not hold yet; the prompts it skipped are drawn right
    after, so every epoch still draws every prompt exactly once. When ``P`` is a multiple of ``B`` no step
    straddles and the result is the plain slice of the epoch's permutation.

    The result depends only on ``(num_prompts, num_candidates, seed, step)``, never on the arm or on earlier
    calls, so every arm sees the same prompts at a step and a resumed run draws what an uninterrupted one does.

    Args:
        num_prompts: P, the size of the training pool (>= 1).
        num_candidates: B, ``allocation.num_candidates`` (1 <= B <= P).
        seed: the run's ``seed``.
        step: the training step (>= 0).

    Returns:
        (B,) int64 distinct indices into the pool.

    Raises:
        ValueError: an empty pool, ``B > P`` (``check_candidate_pool``), or a negative step.
    """
    check_candidate_pool(num_prompts, num_candidates)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, offset = divmod(step * num_candidates, num_prompts)
    order = _epoch_order(num_prompts, num_candidates, seed, epoch)
    out = order[offset:offset + num_candidates]
    if out.size < num_candidates:  # the step straddles the boundary into the next epoch
        following = _order_after(order, _epoch_permutation(num_prompts, seed, epoch + 1), num_candidates, out.size)
        out = np.concatenate([out, following[:num_candidates - out.size]])
    return out.astype(np.int64)
