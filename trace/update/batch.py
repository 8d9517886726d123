"""Training batches from rollout trees: one right-padded sequence per leaf, pure torch.

``build_training_batch`` keeps one invariant: every generated token of every node is
trained exactly once. Each leaf gives one sequence (root -> leaf token ids, right-padded); a node's
generated tokens carry ``loss_mask`` 1 and the node's advantage only in the first sequence that contains
the node (bookkeeping by ``(tree_id, node_id)``), and are plain context elsewhere. The node's advantage is
the sum of the advantages of the leaf trajectories through it, so for the first PPO pass (ratio 1) the
gradient equals that of flat leaf-row training where every row carries its leaf's advantage; without
branching (each node on one leaf path) the two batches are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from trace.tree import Node, RolloutTree


@dataclass
class TrainingBatch:
    """Right-padded sequences built from rollout trees, one per leaf.

    Attributes:
        input_ids: (B, T) long token ids; positions ``>= lengths[b]`` hold the pad id.
        attention_mask: (B, T) long, 1 on the first ``lengths[b]`` positions, from the lengths (never
            from comparing with the pad id, which may equal EOS).
        position_ids: (B, T) long, ``0 .. lengths[b] - 1`` then 0 on padding.
        loss_mask: (B, T) float32, 1 on generated tokens trained in this row.
        advantages: (B, T) float32, the node's advantage on its ``loss_mask`` tokens, 0 elsewhere.
        old_logprobs: (B, T) float32 sampling-time log-probs (nats), 0 on tokens not generated.
        lengths: (B,) long, real tokens per row.
        row_tokens: (B,) long, generated tokens in each leaf row, whether trained in that row or in an
            earlier one (a shared node counts in every row through it, as flat leaf-row training counts
            it). Their sum is ``num_tokens``, the token-mean normaliser.
        sequence_ids: ``(tree_id, leaf node_id)`` of each row.
        num_truncated: rows cut to ``max_tokens``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    lengths: torch.Tensor
    row_tokens: torch.Tensor
    sequence_ids: list[tuple[str, int]] = field(default_factory=list)
    num_truncated: int = 0

    @property
    def num_tokens(self) -> int:
        """The token-mean normaliser: generated tokens summed over the leaf rows (``row_tokens.sum()``);
        without branching it equals ``num_trained_tokens``."""
        return int(self.row_tokens.sum().item())

    @property
    def num_trained_tokens(self) -> int:
        """Tokens with ``loss_mask`` 1: every generated token of the batch once."""
        return int(self.loss_mask.sum().item())

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: slice) -> "TrainingBatch":
        """Rows ``rows`` of the batch, with trailing all-padding columns dropped."""
        lengths = self.lengths[rows]
        width = int(lengths.max()) if lengths.numel() else 0

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            return tensor[rows, :width]

        loss_mask = cut(self.loss_mask)
        return TrainingBatch(
            input_ids=cut(self.input_ids), attention_mask=cut(self.attention_mask),
            position_ids=cut(self.position_ids), loss_mask=loss_mask, advantages=cut(self.advantages),
            old_logprobs=cut(self.old_logprobs), lengths=lengths, row_tokens=self.row_tokens[rows],
            sequence_ids=self.sequence_ids[rows], num_truncated=0)

    def micro_batches(self, micro_batch_size: int) -> list["TrainingBatch"]:
        """Consecutive slices of ``micro_batch_size`` rows (the last may be shorter), each trimmed.

        Raises:
            ValueError: if ``micro_batch_size < 1``.
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        return [self.select(slice(i, i + micro_batch_size)) for i in range(0, self.num_sequences, micro_batch_size)]

    def to(self, device: torch.device | str) -> "TrainingBatch":
        """The batch with every tensor moved to ``device``."""
        moved = {name: getattr(self, name).to(device) for name in
                 ("input_ids", "attention_mask", "position_ids", "loss_mask", "advantages", "old_logprobs", "lengths")}
        return TrainingBatch(**moved, row_tokens=self.row_tokens, sequence_ids=self.sequence_ids,
                             num_truncated=self.num_truncated)


def empty_micro_batch(pad_token_id: int) -> TrainingBatch:
    """A micro-batch of one 2-token padding row that trains nothing (loss mask 0): lets a rank with fewer
    micro-batches join the same number of backward passes as the others (ZeRO-2/3 reduce in every backward)."""
    pad = torch.full((1, 2), pad_token_id, dtype=torch.long)
    zeros = torch.zeros(1, 2, dtype=torch.float32)
    return TrainingBatch(input_ids=pad, attention_mask=torch.ones_like(pad), position_ids=torch.arange(2).unsqueeze(0),
                         loss_mask=zeros, advantages=zeros, old_logprobs=zeros, lengths=torch.tensor([2]),
                         row_tokens=torch.zeros(1, dtype=torch.long))


def _check_node(tree: RolloutTree, node: Node) -> None:
    n = len(node.token_ids)
    if len(node.logprobs) != n or len(node.loss_mask) != n:
        raise ValueError(
            f"tree {tree.tree_id!r} node {node.node_id}: token_ids has {n} entries, logprobs "
            f"{len(node.logprobs)}, loss_mask {len(node.loss_mask)}; they need one entry per token")
    if any(m not in (0, 1) for m in node.loss_mask):
        raise ValueError(f"tree {tree.tree_id!r} node {node.node_id}: loss_mask must hold only 0/1, got "
                         f"{sorted(set(node.loss_mask))}")
    for idx, logprob in enumerate(node.logprobs):
        if not math.isfinite(logprob):
            kind = "generated" if node.loss_mask[idx] else "context (prompt or observation)"
            raise ValueError(
                f"tree {tree.tree_id!r} node {node.node_id}: logprobs[{idx}] = {logprob} on a {kind} token is "
                "not finite; generated tokens need their sampling log-probability and every other token 0.0 "
                "(fix the rollout's or the stored tree's logprobs)")
    if node.is_root and any(node.loss_mask):
        raise ValueError(f"tree {tree.tree_id!r}: the root (prompt) node has loss_mask 1 on "
                         f"{sum(node.loss_mask)} tokens; prompt tokens are never trained, set them to 0")


def _node_advantage(tree: RolloutTree, node: Node, require_advantages: bool) -> float:
    if node.advantage is None:
        if require_advantages:
            raise ValueError(
                f"tree {tree.tree_id!r} node {node.node_id} has {node.num_generated_tokens} generated tokens "
                "but advantage None; assign advantages (trace.advantages) before the policy update")
        return 0.0
    advantage = float(node.advantage)
    if not math.isfinite(advantage):
        raise ValueError(f"tree {tree.tree_id!r} node {node.node_id}: advantage {advantage} is not finite")
    return advantage


def build_training_batch(
    trees: Sequence[RolloutTree],
    pad_token_id: int,
    max_tokens: int | None = None,
    *,
    require_advantages: bool = True,
) -> TrainingBatch:
    """One right-padded sequence per leaf; each node's generated tokens are trained exactly once.

    Rows follow the order of ``trees`` and, within a tree, ``RolloutTree.leaves()``. A node's generated
    tokens get ``loss_mask`` 1 and advantage ``node.advantage`` in the first row that contains the node
    (tracked by ``(tree_id, node_id)``); in later rows they are context with mask 0. The token-mean
    normaliser ``num_tokens`` counts a shared node's tokens once per leaf row through it, so the loss
    equals flat leaf-row training (every leaf row trained with its own advantage, token-mean over all
    rows) at ratio 1, normaliser included.

    Args:
        trees: rollout trees with distinct ``tree_id``; nodes carry ``token_ids``, ``logprobs``,
            ``loss_mask`` and (when ``require_advantages``) ``advantage`` = the sum of the advantages of
            the leaf trajectories through the node.
        pad_token_id: id written at padding positions (it may equal EOS: masks come from lengths).
        max_tokens: rows longer than this keep their first ``max_tokens`` tokens; ``None`` keeps all.
            A node cut in its training row is cut at the same position in every row (shared prefix).
        require_advantages: if False (SFT), a missing advantage counts as 0 instead of raising.

    Returns:
        ``TrainingBatch``; with no leaves, tensors of shape (0, 0) and ``num_tokens = 0``.

    Raises:
        ValueError: on duplicate ``tree_id``, an empty tree, a node whose token_ids / logprobs / loss_mask
            lengths differ, a non-finite logprob on any token (trained or context), loss_mask 1 on the root,
            a missing or non-finite advantage on a node with generated tokens, a generated token at position
            0 (no context to predict it from), or ``max_tokens < 2``.

    References:
        Shared-prefix training with summed leaf advantages: docs/method.md#shared-prefix-sum; tree
        rollouts as in Tree-GRPO (Ji et al. 2025, arXiv 2509.21240).
    """
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens} must be >= 2 (a prompt token and a generated token) or None")
    seen_tree_ids: set[str] = set()
    trained_nodes: set[tuple[str, int]] = set()
    rows: list[tuple[list[int], list[float], list[int], list[float]]] = []
    row_tokens: list[int] = []
    sequence_ids: list[tuple[str, int]] = []
    num_truncated = 0
    for tree in trees:
        if tree.tree_id in seen_tree_ids:
            raise ValueError(f"tree_id {tree.tree_id!r} appears twice in the batch; tree ids must be unique "
                             "(they key which nodes were already trained)")
        seen_tree_ids.add(tree.tree_id)
        if not tree.nodes:
            raise ValueError(f"tree {tree.tree_id!r} has no nodes (not even a root)")
        for node in tree.nodes:
            _check_node(tree, node)
        for leaf, path in tree.iter_leaf_paths():
            ids: list[int] = []
            logprobs: list[float] = []
            mask: list[int] = []
            generated: list[int] = []
            advantages: list[float] = []
            for node in path:
                key = (tree.tree_id, node.node_id)
                n = len(node.token_ids)
                ids.extend(int(t) for t in node.token_ids)
                logprobs.extend(float(lp) for lp in node.logprobs)
                generated.extend(int(m) for m in node.loss_mask)
                if key not in trained_nodes and node.num_generated_tokens > 0:
                    advantage = _node_advantage(tree, node, require_advantages)
                    mask.extend(int(m) for m in node.loss_mask)
                    advantages.extend(advantage if m else 0.0 for m in node.loss_mask)
                else:
                    mask.extend([0] * n)
                    advantages.extend([0.0] * n)
                trained_nodes.add(key)
            if mask and mask[0]:
                raise ValueError(f"tree {tree.tree_id!r} leaf {leaf.node_id}: the first token of the sequence is "
                                 "generated, so nothing predicts it; the root must hold the prompt tokens")
            if max_tokens is not None and len(ids) > max_tokens:
                num_truncated += 1
                ids, logprobs, mask, advantages = (x[:max_tokens] for x in (ids, logprobs, mask, advantages))
                generated = generated[:max_tokens]
            rows.append((ids, logprobs, mask, advantages))
            row_tokens.append(sum(generated))
            sequence_ids.append((tree.tree_id, leaf.node_id))

    num_seqs = len(rows)
    width = max((len(r[0]) for r in rows), default=0)
    input_ids = torch.full((num_seqs, width), int(pad_token_id), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros(num_seqs, width, dtype=torch.float32)
    advantages_t = torch.zeros(num_seqs, width, dtype=torch.float32)
    old_logprobs = torch.zeros(num_seqs, width, dtype=torch.float32)
    lengths = torch.tensor([len(r[0]) for r in rows], dtype=torch.long)  # (B,)
    for b, (ids, logprobs, mask, advantages) in enumerate(rows):
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        loss_mask[b, :n] = torch.tensor(mask, dtype=torch.float32)
        advantages_t[b, :n] = torch.tensor(advantages, dtype=torch.float32)
        old_logprobs[b, :n] = torch.tensor(logprobs, dtype=torch.float32)
    positions = torch.arange(width, dtype=torch.long).expand(num_seqs, width)
    attention_mask = (positions < lengths.unsqueeze(1)).long()
    return TrainingBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions * attention_mask,
        loss_mask=loss_mask, advantages=advantages_t, old_logprobs=old_logprobs, lengths=lengths,
        row_tokens=torch.tensor(row_tokens, dtype=torch.long), sequence_ids=sequence_ids,
        num_truncated=num_truncated)

