"""Data-parallel rollouts across ranks: whole trees per rank, balanced by expected tokens, then gathered.

Under a launcher (``torchrun``, ``deepspeed``) every rank runs the same training step. Everything that
decides the step (candidate prompts, predictor scores, the stage-1 root allocation, the stage-2 plan) is
computed on every rank from the same inputs, so every rank agrees without a message. Only the sampling is
split: ``DataParallelSampler`` gives each tree of a step to one rank (its *owner*) when the tree's roots are
sampled, the owner samples the tree's bare rollouts and every continuation of it (so a tree's branches hit
the prefix cache of the engine that holds its trajectories), and after every sampling call the owners'
trees are gathered (``torch.distributed.all_gather_object``) so every rank holds every tree again. Stage 2
is local to a tree; its one cross-tree step (the expansion budget of trees without anchors handed to trees
that have them, ``trace.allocation.prefix.split_expansion_budget``) reads the gathered trees, so every rank
computes the same. Each rank then trains on the trees it owns (``owned``); DeepSpeed averages gradients and
``trace.update.PolicyUpdater`` normalises by the global token count, so a step on several ranks equals the
step on one (within float summation order).

A trajectory's tokens are drawn with its own seed (``trace.sampling.trajectory_seed``: sampling seed, tree
id, the trajectory's key in its tree, turn), so which rank sampled a tree does not change it.

Balance: the owner of each new tree is chosen greedily, longest first (LPT scheduling; Graham 1969, at most
4/3 of the optimal makespan), by its expected generated tokens: ``m_i`` rollouts times the mean generated
tokens per trajectory of its prompt in the trees seen so far (the mean over all prompts for a new prompt).
verl and Knapsack-RL balance per-rank work with Karmarkar-Karp partitioning; LPT is within a few percent of it
on these sizes and keeps the rule short. The achieved split is logged each step (``parallel/*``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from trace.tree import RolloutTree

__all__ = ["DataParallelSampler", "all_gather_objects", "barrier", "broadcast_object", "is_main_process", "rank",
           "split_longest_first", "world_size"]


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Ranks of the initialised process group; 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if _initialized() else 1


def rank() -> int:
    """This process's rank: the process group's, else ``$RANK`` (set by the launcher before the group exists),
    else 0."""
    import torch.distributed as dist

    return dist.get_rank() if _initialized() else int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """Rank 0: the one writer of Parquet, MLflow, predictor state and the run summary."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op at world size 1)."""
    import torch.distributed as dist

    if world_size() > 1:
        dist.barrier()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` at world size 1."""
    import torch.distributed as dist

    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``obj`` is ignored elsewhere); ``obj`` itself at world size 1."""
    import torch.distributed as dist

    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


_process_rank, _process_world_size = rank, world_size


def split_longest_first(costs: Sequence[float], num_parts: int, loads: Sequence[float] | None = None) -> np.ndarray:
    """Assign items to ``num_parts`` bins, largest cost first, each to the bin with the least load so far (LPT).

    Ties (equal costs, equal loads) break by item index and bin index, so every rank computes the same split.

    Args:
        costs: (N,) non-negative costs (expected generated tokens).
        num_parts: bins (ranks), >= 1.
        loads: (num_parts,) starting loads (work already placed this step); default zeros.

    Returns:
        (N,) int64 bin of each item.

    Raises:
        ValueError: ``num_parts < 1``, a negative or non-finite cost, or ``loads`` of the wrong length.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if costs.size and (not np.all(np.isfinite(costs)) or costs.min() < 0):
        raise ValueError(f"costs must be finite and >= 0, got {costs.tolist()}")
    load = np.zeros(num_parts) if loads is None else np.array(loads, dtype=np.float64)
    if load.shape != (num_parts,):
        raise ValueError(f"loads must have {num_parts} entries, got {load.shape}")
    owner = np.zeros(costs.size, dtype=np.int64)
    for i in np.lexsort((np.arange(costs.size), -costs)):
        owner[i] = int(np.argmin(load))  # first bin among equals
        load[owner[i]] += costs[i]
    return owner


class DataParallelSampler:
    """A ``trace.allocation.step.StepSampler`` that samples only this rank's trees and gathers the rest.

    Args:
        inner: the rank-local sampler (``trace.allocation.samplers.PolicySampler``).
        tokens_per_trajectory: ``{prompt_uid: generated tokens per trajectory}`` seen so far (the same on every
            rank; ``observe`` updates it in place); a prompt not in it costs the mean of its values (1.0 when
            empty).
        rank, world_size: this rank and the number of ranks (default: the process group's).

    Attributes:
        owner: ``{tree_id: rank}`` of every tree sampled this step.
    """

    def __init__(self, inner: Any, tokens_per_trajectory: Mapping[str, float] | None = None, *,
                 rank: int | None = None, world_size: int | None = None) -> None:
        self.inner = inner
        self.rank = _process_rank() if rank is None else int(rank)
        self.world_size = _process_world_size() if world_size is None else int(world_size)
        self.tokens_per_trajectory = {} if tokens_per_trajectory is None else tokens_per_trajectory
        self.owner: dict[str, int] = {}
        self.load = np.zeros(self.world_size)  # expected tokens placed on each rank this step

    # ---- scores: every rank, the same ---------------------------------------------------------------
    def score_prompts(self, prompts: Sequence) -> np.ndarray:
        return self.inner.score_prompts(prompts)

    def score_anchors(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self.inner.score_anchors(trees, node_ids)

    # ---- sampling: this rank's share ----------------------------------------------------------------
    def _cost(self, prompt_uid: str) -> float:
        known = self.tokens_per_trajectory
        default = float(np.mean(list(known.values()))) if known else 1.0
        return float(known.get(prompt_uid, default))

    def sample_roots(self, prompts: Sequence, counts: Sequence[int], salt: str) -> list[RolloutTree]:
        """The trees of ``prompts`` in prompt order: this rank's sampled here, the others' gathered."""
        if self.world_size == 1:  # nothing to split or gather
            trees = self.inner.sample_roots(prompts, counts, salt)
            self.owner.update((t.tree_id, 0) for t in trees)
            return trees
        costs = [int(c) * self._cost(p.prompt_uid) for p, c in zip(prompts, counts)]
        owners = split_longest_first(costs, self.world_size, self.load)
        for o, c in zip(owners, costs):
            self.load[o] += c
        mine = [i for i, o in enumerate(owners) if o == self.rank]
        local = self.inner.sample_roots([prompts[i] for i in mine], [counts[i] for i in mine], salt) if mine else []
        by_index = dict(zip(mine, local))
        gathered = all_gather_objects([(i, t.copy_without_state()) for i, t in by_index.items()])
        out: list[RolloutTree | None] = [None] * len(prompts)
        for part in gathered:
            for i, tree in part:
                out[i] = by_index.get(i, tree)
        for i, tree in enumerate(out):
            self.owner[tree.tree_id] = int(owners[i])
        return out

    def sample_continuations(self, trees: Sequence[RolloutTree], counts: Mapping[tuple[int, int], int],
                             salt: str) -> None:
        """Continuations of this rank's trees sampled here; every other tree replaced by its owner's copy."""
        if self.world_size == 1:
            self.inner.sample_continuations(trees, counts, salt)
            return
        mine = {key: k for key, k in counts.items() if self.owner[trees[key[0]].tree_id] == self.rank}
        if mine:
            self.inner.sample_continuations(trees, mine, salt)
        changed = sorted({t_idx for t_idx, _ in mine})
        gathered = all_gather_objects([(i, trees[i].copy_without_state()) for i in changed])
        for part in gathered:
            for i, tree in part:
                if self.owner[trees[i].tree_id] != self.rank:
                    trees[i].nodes = tree.nodes

    def observe(self, trees: Sequence[RolloutTree]) -> None:
        """Record each tree's generated tokens per trajectory under its prompt (the next step's costs)."""
        for t in trees:
            if t.num_trajectories():
                self.tokens_per_trajectory[t.prompt_uid] = t.num_generated_tokens() / t.num_trajectories()

    def owned(self, trees: Sequence[RolloutTree]) -> list[RolloutTree]:
        """The trees of ``trees`` this rank sampled (the ones it trains on)."""
        return [t for t in trees if self.owner.get(t.tree_id, 0) == self.rank]

    def split(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """``parallel/*`` metrics of the split: each rank's share of trajectories and generated tokens, and the
        largest share over its fair ``1 / world_size`` (1.0 = perfect balance)."""
        traj = np.zeros(self.world_size)
        tokens = np.zeros(self.world_size)
        for t in trees:
            r = self.owner.get(t.tree_id, 0)
            traj[r] += t.num_trajectories()
            tokens[r] += t.num_generated_tokens()
        out = {"parallel/world_size": float(self.world_size)}
        for name, values in (("trajectories", traj), ("tokens", tokens)):
            share = values / max(values.sum(), 1.0)
            out[f"parallel/{name}_max_share_over_fair"] = float(share.max() * self.world_size)
            for r, s in enumerate(share):
                out[f"parallel/{name}_share_rank{r}"] = float(s)
        return out
