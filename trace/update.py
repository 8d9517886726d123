"""Policy update: rollout trees -> one training batch -> DeepSpeed optimizer steps.

Batch construction (``build_training_batch``) keeps one invariant: every generated token of every node is
trained exactly once. Each leaf gives one sequence (root -> leaf token ids, right-padded); a node's
generated tokens carry ``loss_mask`` 1 and the node's advantage only in the first sequence that contains
the node (bookkeeping by ``(tree_id, node_id)``), and are plain context elsewhere. The node's advantage is
the sum of the advantages of the leaf trajectories through it, so for the first PPO pass (ratio 1) the
gradient equals that of flat leaf-row training where every row carries its leaf's advantage; without
branching (each node on one leaf path) the two batches are identical.

The update (``PolicyUpdater``) runs under DeepSpeed on CPU or GPU with ZeRO stage 0-3. The number of
sequences per step varies with the rollout budget and tree shapes, so gradient accumulation is owned by
this module: DeepSpeed is configured with ``gradient_accumulation_steps = 1`` and
``managed_gradient_accumulation = false``, every micro-batch's loss is divided by the whole batch's token
count, gradients accumulate over all micro-batches, and one ``engine.step()`` per PPO epoch applies them.
That step therefore equals one step on the token-mean loss of the whole batch.

Simplifications: the learning rate is constant (no scheduler); the old log-probs are the rollout's
sampling log-probs (no recomputation pass); the KL reference, when ``kl_coef > 0``, is a frozen copy of
the policy given at construction, held unpartitioned on every rank.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from trace.config import UpdateConfig
from trace.losses import clipped_surrogate_loss, kl_penalty_loss, sft_loss, token_logprobs
from trace.policy.backends import mark_weights_updated, weights_version
from trace.tree import Node, RolloutTree

REFERENCE_POLICY_FILE = "reference_policy.pt"  # frozen KL reference, saved beside DeepSpeed's checkpoint
_CLIENT_STATE_KEY = "trace_policy_updater"


# ---------------------------------------------------------------------------------------------------------
# Training batch
# ---------------------------------------------------------------------------------------------------------
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
        Shared-prefix training with summed leaf advantages: DESIGN.md, "Tree-aware advantages and the
        update"; tree rollouts as in Tree-GRPO (Ji et al. 2025, arXiv 2509.21240).
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


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed set-up
# ---------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_distributed_env() -> dict[str, str]:
    """Fill in the single-process distributed environment DeepSpeed expects, where a launcher did not.

    Sets ``RANK=0``, ``LOCAL_RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR=127.0.0.1`` and a free
    ``MASTER_PORT`` (found by binding port 0) when unset, and ``DS_ACCELERATOR=cpu`` when unset and CUDA is
    not available. Without them ``deepspeed.initialize`` looks for MPI and fails on ``mpi4py``. Call before
    DeepSpeed is first imported (its accelerator is chosen at import). Variables already set (e.g. by the
    ``deepspeed`` launcher) are left alone.

    Returns:
        The variables this call set, name -> value.
    """
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    if "MASTER_PORT" not in os.environ:
        defaults["MASTER_PORT"] = str(_free_port())
    if not torch.cuda.is_available():
        defaults["DS_ACCELERATOR"] = "cpu"
    newly_set = {}
    for name, value in defaults.items():
        if name not in os.environ:
            os.environ[name] = value
            newly_set[name] = value
    return newly_set


def deepspeed_config(update_cfg: UpdateConfig, micro_batch_size: int | None = None,
                     world_size: int | None = None) -> dict[str, Any]:
    """DeepSpeed config dict for ``PolicyUpdater``.

    ``gradient_accumulation_steps`` is 1 and ``managed_gradient_accumulation`` false: the caller runs any
    number of micro-batches per step and ``engine.step()`` is the accumulation boundary, so a variable
    number of sequences per step is consistent with ``train_batch_size = micro_batch_size * world_size``.

    Args:
        update_cfg: the ``update`` section (ZeRO stage, bf16, optimizer offload, gradient clipping).
        micro_batch_size: sequences per forward/backward; ``None`` = ``update_cfg.micro_batch_size``.
        world_size: data-parallel ranks; ``None`` = ``$WORLD_SIZE`` (default 1).

    Returns:
        A JSON-serialisable dict for ``deepspeed.initialize(config=...)``.

    Raises:
        ValueError: if ``offload_optimizer`` is set with ZeRO stage 0 (offload needs stage >= 1).
    """
    micro_batch_size = update_cfg.micro_batch_size if micro_batch_size is None else int(micro_batch_size)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
    zero: dict[str, Any] = {"stage": update_cfg.zero_stage}
    if update_cfg.offload_optimizer:
        if update_cfg.zero_stage == 0:
            raise ValueError("update.offload_optimizer=true needs update.zero_stage >= 1 (ZeRO offload); "
                             "raise zero_stage or turn offload off")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": update_cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": update_cfg.bf16},
        # torch.optim.AdamW is passed in: no DeepSpeed Adam JIT build, also under ZeRO offload
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


# ---------------------------------------------------------------------------------------------------------
# The updater
# ---------------------------------------------------------------------------------------------------------
# (micro-batch, flat token-mean normaliser, trained-token count) -> (loss, metrics); both counts are global
LossFn = Callable[[TrainingBatch, int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class PolicyUpdater:
    """DeepSpeed engine around a Hugging Face causal LM, with the RL and SFT update steps.

    Args:
        model: a ``transformers`` causal LM (e.g. ``Qwen3ForCausalLM``); it becomes ``self.module``.
        update_cfg: the ``update`` section: lr, weight decay, clip range, KL coefficient, PPO epochs,
            micro-batch size, gradient clipping, ZeRO stage, bf16, offload, gradient checkpointing.
        seed: seeds torch's RNG before the engine is built (the RNG state is saved in checkpoints).
        pad_token_id: padding id; ``None`` = ``model.config.pad_token_id`` or 0.
        max_tokens: longest training sequence (``build_training_batch``); ``None`` = no limit.
        ref_model: frozen KL reference when ``kl_coef > 0``; ``None`` = a copy of ``model`` as given.

    Every rank must call ``rl_step`` / ``sft_step`` / ``save_checkpoint`` / ``load_checkpoint`` together.
    After a step the module is left in eval mode, ready for generation.

    After every optimizer step and every ``load_checkpoint`` the updater announces the new weights
    (``trace.policy.backends.mark_weights_updated`` on ``self.module``, the policy module it was given), so
    every generation backend serving that module drops or refreshes its cache before the next generation.
    DeepSpeed's ZeRO-1/2/3 and bf16 steps write the weights through ``.data`` without touching the tensors'
    version counters, so a backend could not tell from the tensors.
    """

    def __init__(self, model: torch.nn.Module, update_cfg: UpdateConfig, *, seed: int = 0,
                 pad_token_id: int | None = None, max_tokens: int | None = None,
                 ref_model: torch.nn.Module | None = None) -> None:
        init_distributed_env()
        import deepspeed  # heavy: imported only when an updater is built

        self.cfg = update_cfg
        self.max_tokens = max_tokens
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        torch.manual_seed(seed)
        if update_cfg.gradient_checkpointing:
            # transformers >= 5.24 renames gradient checkpointing to activation checkpointing
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref_model: torch.nn.Module | None = None
        if update_cfg.kl_coef > 0:
            # copied before deepspeed.initialize, which may partition (ZeRO-3) or cast the policy in place
            self.ref_model = copy.deepcopy(ref_model if ref_model is not None else model)
            self.ref_model.requires_grad_(False).eval()
        optimizer = torch.optim.AdamW(model.parameters(), lr=update_cfg.lr, weight_decay=update_cfg.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(update_cfg))
        if self.ref_model is not None:
            dtype = torch.bfloat16 if update_cfg.bf16 else None
            self.ref_model.to(device=self.engine.device, dtype=dtype)
        self.engine.eval()

    # ---- accessors ----------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The underlying Hugging Face model (for generation between updates).

        Under ZeRO-3 its parameters are partitioned; its forward gathers them, and
        ``policy_state_dict()`` gives full tensors.
        """
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def weights_version(self) -> int:
        """Announced weight updates of the policy module (``trace.policy.backends.weights_version``): moves
        after every optimizer step and checkpoint load."""
        return weights_version(self.engine.module)

    @property
    def num_optimizer_steps(self) -> int:
        """Optimizer steps taken so far (restored by ``load_checkpoint``)."""
        return int(self.engine.global_steps)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered under ZeRO-3) CPU copy of the policy weights, e.g. to refresh a vLLM engine."""
        module = self.engine.module
        if self.engine.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    # ---- forward helpers ----------------------------------------------------------------------------
    @staticmethod
    def _logits(model: Callable[..., Any], batch: TrainingBatch) -> torch.Tensor:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        return out.logits  # (B, T, V)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainingBatch, temperature: float = 1.0) -> torch.Tensor:
        """Current policy log-probs of every token of ``batch`` (eval mode, no gradient).

        Args:
            batch: a ``TrainingBatch``.
            temperature: > 0, the sampling temperature the log-probs should match.

        Returns:
            (B, T) float32 on CPU, aligned with ``batch.input_ids`` (column 0 and padding are 0).
        """
        self.engine.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        start = 0
        for micro in batch.micro_batches(self.cfg.micro_batch_size):
            micro = micro.to(self.device)
            logprobs = token_logprobs(self._logits(self.engine, micro), micro.input_ids, temperature)
            # select, not multiply: a non-finite value at a padding position would survive ``* 0``
            logprobs = torch.where(micro.attention_mask.bool(), logprobs, 0.0)
            out[start:start + micro.num_sequences, :logprobs.shape[1]] = logprobs.cpu()
            start += micro.num_sequences
        return out

    # ---- losses -------------------------------------------------------------------------------------
    def _rl_loss(self, micro: TrainingBatch, num_tokens: int, num_trained_tokens: int, temperature: float
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logprobs = token_logprobs(self._logits(self.engine, micro), micro.input_ids, temperature)  # (B, T)
        loss, metrics = clipped_surrogate_loss(
            logprobs, micro.old_logprobs, micro.advantages, micro.loss_mask,
            clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high, num_tokens=num_tokens)
        # the surrogate is normalised like flat leaf-row training; its diagnostics are means over the
        # tokens actually trained (each generated token once)
        for name in ("losses/clip_frac", "losses/approx_kl"):
            metrics[name] = metrics[name] * (num_tokens / max(num_trained_tokens, 1))
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logprobs = token_logprobs(self._logits(self.ref_model, micro), micro.input_ids, temperature)
            # the KL is a mean over the generated tokens, each once (a shared prefix is one sample)
            kl_loss, kl_metrics = kl_penalty_loss(logprobs, ref_logprobs, micro.loss_mask,
                                                  kl_coef=self.cfg.kl_coef, num_tokens=num_trained_tokens)
            loss = loss + kl_loss
            metrics.update(kl_metrics)
        return loss, metrics

    def _sft_loss(self, micro: TrainingBatch, num_tokens: int, num_trained_tokens: int
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del num_trained_tokens  # demonstrations do not branch: both counts are equal
        loss = sft_loss(self._logits(self.engine, micro), micro.input_ids, micro.loss_mask, num_tokens)
        return loss, {"losses/sft": loss.detach()}

    # ---- the step -----------------------------------------------------------------------------------
    def _all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        if _world_size() > 1:
            values = values.to(self.device)
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM)
        return values.cpu()

    def _aligned_micro_batches(self, batch: TrainingBatch) -> list[TrainingBatch]:
        """Micro-batches, padded with empty ones so every rank runs the same number of backward passes
        (ZeRO-2/3 reduce gradients in every backward, a collective all ranks must join)."""
        micro = batch.micro_batches(self.cfg.micro_batch_size)
        if _world_size() == 1:
            return micro
        count = torch.tensor([len(micro)], dtype=torch.long).to(self.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        while len(micro) < int(count.item()):
            pad = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
            zeros = torch.zeros(1, 2, dtype=torch.float32)
            micro.append(TrainingBatch(
                input_ids=pad, attention_mask=torch.ones_like(pad), position_ids=torch.arange(2).unsqueeze(0),
                loss_mask=zeros, advantages=zeros, old_logprobs=zeros, lengths=torch.tensor([2]),
                row_tokens=torch.zeros(1, dtype=torch.long)))
        return micro

    def _optimizer_step(self) -> float:
        """``engine.step()``, then announce the new weights; returns the global gradient norm before clipping."""
        pre_clip_norm = None
        if self.engine.zero_optimization_stage() == 0 and not self.engine.bfloat16_enabled():
            # plain fp32 stage 0 clips with torch and does not report the norm; with several ranks this is
            # the rank-local norm (gradients are averaged inside step())
            grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
            pre_clip_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])
                                                           )) if grads else 0.0
        self.engine.step()
        mark_weights_updated(self.engine.module)
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = pre_clip_norm
        return float(norm) if norm is not None else float("nan")

    def _train(self, batch: TrainingBatch, loss_fn: LossFn, num_epochs: int) -> dict[str, float]:
        """``num_epochs`` optimizer steps, each over every micro-batch of ``batch`` (token-mean loss)."""
        start = time.perf_counter()
        world_size = _world_size()
        num_tokens, num_trained_tokens = (int(v) for v in self._all_reduce_sum(
            torch.tensor([float(batch.num_tokens), float(batch.num_trained_tokens)])).tolist())
        out: dict[str, float] = {"update/num_tokens": float(num_tokens),
                                 "update/num_trained_tokens": float(num_trained_tokens),
                                 "update/num_sequences": float(batch.num_sequences),
                                 "update/num_truncated": float(batch.num_truncated),
                                 "update/skipped": 1.0 if num_tokens == 0 else 0.0}
        if num_tokens == 0:
            out["update/seconds"] = time.perf_counter() - start
            return out
        micro_batches = self._aligned_micro_batches(batch)
        epoch_sums: dict[str, float] = {}
        self.engine.train()
        for _ in range(num_epochs):
            sums: dict[str, torch.Tensor] = {}
            for micro in micro_batches:
                loss, metrics = loss_fn(micro.to(self.device), num_tokens, num_trained_tokens)
                # DeepSpeed averages gradients over ranks; each rank's loss is already divided by the global
                # token count, so scaling by world_size makes the averaged gradient the global token mean
                self.engine.backward(loss * world_size)
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value.float()
            names = sorted(sums)
            totals = self._all_reduce_sum(torch.stack([sums[n] for n in names])) if names else torch.zeros(0)
            grad_norm = self._optimizer_step()
            for name, value in zip(names, totals.tolist()):
                epoch_sums[name] = epoch_sums.get(name, 0.0) + value
            epoch_sums["losses/grad_norm"] = epoch_sums.get("losses/grad_norm", 0.0) + grad_norm
        self.engine.eval()
        out.update({name: value / num_epochs for name, value in epoch_sums.items()})
        out["update/num_micro_batches"] = float(len(micro_batches))
        out["update/seconds"] = time.perf_counter() - start
        return out

    def rl_step(self, trees: Sequence[RolloutTree], temperature: float = 1.0) -> dict[str, float]:
        """One RL update on a step's rollout trees: ``ppo_epochs`` optimizer steps on the clipped surrogate.

        Each epoch runs every micro-batch (``micro_batch_size`` sequences), each divided by the whole
        batch's token count, and takes ONE optimizer step: the token-mean loss over the whole batch. The
        count is that of flat leaf-row training (a shared prefix counted once per leaf row through it), so
        branching changes which tokens carry signal, not the step size. With ``kl_coef > 0`` the k3 KL to
        the frozen reference is added, as a mean over the generated tokens (each once).

        Args:
            trees: trees with ``node.advantage`` set (see ``build_training_batch``).
            temperature: the rollout's sampling temperature (> 0); log-probs are taken under it.

        Returns:
            Metrics averaged over epochs: ``losses/policy``, ``losses/clip_frac``, ``losses/approx_kl``,
            ``losses/grad_norm`` (before clipping), ``losses/kl`` (when ``kl_coef > 0``),
            ``update/num_tokens`` (the flat normaliser), ``update/num_trained_tokens`` (each generated token
            once), ``update/num_sequences``, ``update/num_micro_batches``,
            ``update/num_truncated``, ``update/skipped`` (1 when no token was trainable: no step taken),
            ``update/seconds``. Losses and ``update/num_tokens`` are global over ranks; ``num_sequences`` and
            ``num_micro_batches`` are this rank's, and at ZeRO stage 0 in fp32 so is ``grad_norm``.

        Raises:
            ValueError: from ``build_training_batch`` (missing advantages, malformed nodes, ...).

        References:
            PPO, Schulman et al. 2017, arXiv 1707.06347; token-mean aggregation and clip-higher, DAPO,
            arXiv 2503.14476; KL k3 as in GRPO, arXiv 2402.03300.
        """
        batch = build_training_batch(trees, self.pad_token_id, self.max_tokens)
        return self._train(batch, functools.partial(self._rl_loss, temperature=temperature), self.cfg.ppo_epochs)

    def sft_step(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on the trees' ``loss_mask`` tokens, one optimizer step.

        Args:
            trees: demonstration trees (advantages are ignored); every generated token is imitated once.

        Returns:
            ``losses/sft`` (nats per token, before the step), ``losses/grad_norm`` and the ``update/*``
            counters of ``rl_step``.
        """
        batch = build_training_batch(trees, self.pad_token_id, self.max_tokens, require_advantages=False)
        return self._train(batch, self._sft_loss, 1)

    # ---- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None) -> None:
        """Save weights, optimizer state, step counters and the RNG state with DeepSpeed.

        Args:
            save_dir: folder (created); DeepSpeed writes ``<save_dir>/<tag>/`` and a ``latest`` file.
            tag: sub-folder name; ``None`` = DeepSpeed's ``global_step<N>``.
        """
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        client_state = {_CLIENT_STATE_KEY: {"rng": rng, "pad_token_id": self.pad_token_id},
                        # lets deepspeed.checkpoint.ds_to_universal convert the checkpoint (no model parallelism)
                        "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}
        self.engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state)
        if self.ref_model is not None and int(os.environ.get("RANK", "0")) == 0:
            torch.save(self.ref_model.state_dict(), save_dir / REFERENCE_POLICY_FILE)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, *, universal: bool = False) -> str:
        """Restore a ``save_checkpoint`` folder: weights, optimizer state, counters, RNG (and KL reference).

        The next ``rl_step`` then gives the same result as it would have in the saving process (same
        ZeRO stage and device). A ZeRO-1/2/3 checkpoint holds one optimizer shard per rank, so it loads only
        into the same number of ranks; to resume on a different number, convert it first
        (``convert_to_universal_checkpoint``) and load the converted tag with ``universal=True``.

        Args:
            load_dir: the folder given to ``save_checkpoint``.
            tag: the tag to load; ``None`` = the one named in ``<load_dir>/latest`` (``latest_universal``
                when ``universal``).
            universal: ``tag`` is a DeepSpeed universal checkpoint (loads into any number of ranks).

        Returns:
            The path DeepSpeed loaded.

        Raises:
            FileNotFoundError: if ``load_dir`` holds no DeepSpeed checkpoint (no ``latest`` file / tag folder).
        """
        load_dir = Path(load_dir)
        if not load_dir.is_dir():
            raise FileNotFoundError(f"checkpoint folder {load_dir} does not exist; pass a folder written by "
                                    "PolicyUpdater.save_checkpoint")
        was_universal = self.engine._config.load_universal_checkpoint
        self.engine._config.load_universal_checkpoint = bool(universal)
        try:
            path, client_state = self.engine.load_checkpoint(
                str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            self.engine._config.load_universal_checkpoint = was_universal
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {load_dir} (tag {tag!r}; need a 'latest' file or "
                                    "the tag's folder); pass a folder written by PolicyUpdater.save_checkpoint")
        state = (client_state or {}).get(_CLIENT_STATE_KEY, {})
        rng = state.get("rng", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        ref_path = load_dir / REFERENCE_POLICY_FILE
        if self.ref_model is not None and ref_path.is_file():
            self.ref_model.load_state_dict(torch.load(ref_path, map_location=self.device, weights_only=True))
        self.engine.eval()
        mark_weights_updated(self.engine.module)
        return str(path)


def convert_to_universal_checkpoint(checkpoint_dir: str | Path, tag: str, universal_tag: str | None = None) -> str:
    """Convert the ZeRO checkpoint ``<checkpoint_dir>/<tag>`` into a DeepSpeed universal checkpoint.

    Runs ``python -m deepspeed.checkpoint.ds_to_universal`` (one process, CPU only): every parameter's fp32
    weights and Adam moments are gathered from the per-rank shards into one file per parameter, which any
    number of ranks and any ZeRO stage can load (``PolicyUpdater.load_checkpoint(..., universal=True)``).
    It also writes ``<checkpoint_dir>/latest_universal``.

    Args:
        checkpoint_dir: the folder given to ``PolicyUpdater.save_checkpoint``.
        tag: the checkpoint to convert (a ZeRO stage 1-3 checkpoint written by ``save_checkpoint``).
        universal_tag: name of the converted tag; ``None`` = ``f"{tag}_universal"``.

    Returns:
        The universal tag.

    Raises:
        FileNotFoundError: ``<checkpoint_dir>/<tag>`` does not exist.
        RuntimeError: the converter failed (its output is included), e.g. on a ZeRO stage 0 checkpoint,
            which holds the whole optimizer state and loads into any number of ranks as it is.
    """
    import subprocess
    import sys

    checkpoint_dir = Path(checkpoint_dir)
    universal_tag = universal_tag or f"{tag}_universal"
    if not (checkpoint_dir / tag).is_dir():
        raise FileNotFoundError(f"no checkpoint {checkpoint_dir / tag}; pass the folder and tag given to "
                                "save_checkpoint")
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", str(checkpoint_dir / tag),
                           "--output_folder", str(checkpoint_dir / universal_tag)],
                          check=False, capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": os.environ.get(
                              "DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")})
    if proc.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed on {checkpoint_dir / tag} (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return universal_tag
