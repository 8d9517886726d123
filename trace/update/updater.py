"""Policy update: rollout trees -> one training batch -> DeepSpeed optimizer steps.

The update (``PolicyUpdater``) runs under DeepSpeed on CPU or GPU with ZeRO stage 0-3. The number of
sequences per step varies with the rollout budget and tree shapes, so gradient accumulation is owned by
this module: DeepSpeed is configured with ``gradient_accumulation_steps = 1`` and
``managed_gradient_accumulation = false``, every micro-batch's loss is divided by the whole batch's token
count, gradients accumulate over all micro-batches, and one ``engine.step()`` per PPO epoch applies them.
That step therefore equals one step on the token-mean loss of the whole batch.

Only parameters with ``requires_grad`` are optimised: with LoRA (``trace.policy.lora.apply_lora``, before
the updater is built) that is the adapters, the base weights frozen.

Simplifications: the learning rate is constant (no scheduler); the old log-probs are the rollout's
sampling log-probs (no recomputation pass); the KL reference, when ``kl_coef > 0``, is a frozen copy of
the policy given at construction, held unpartitioned on every rank, or, for a LoRA policy, the same
module with its adapters switched off (no copy).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from trace.configuration.config import UpdateConfig
from trace.losses import clipped_surrogate_loss, kl_penalty_loss, sft_loss, token_logprobs
from trace.policy.lora import is_lora_model, merged_state_dict
from trace.policy.weights import mark_weights_updated, weights_version
from trace.tree import RolloutTree
from trace.update.batch import TrainingBatch, build_training_batch, empty_micro_batch
from trace.update.deepspeed_setup import _world_size, deepspeed_config, enable_gradient_checkpointing, \
    init_distributed_env, init_process_group

REFERENCE_POLICY_FILE = "reference_policy.pt"  # frozen KL reference, saved beside DeepSpeed's checkpoint
_CLIENT_STATE_KEY = "trace_policy_updater"

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
        ref_model: frozen KL reference when ``kl_coef > 0``; ``None`` = a copy of ``model`` as given, or for a
            LoRA model (``peft.PeftModel``) the model with its adapters off (``reference_is_base``).

    Every rank must call ``rl_step`` / ``sft_step`` / ``save_checkpoint`` / ``load_checkpoint`` together.
    After a step the module is left in eval mode, ready for generation.

    After every optimizer step and every ``load_checkpoint`` the updater announces the new weights
    (``trace.policy.weights.mark_weights_updated`` on ``self.module``, the policy module it was given), so
    every generation backend serving that module drops or refreshes its cache before the next generation.
    DeepSpeed's ZeRO-1/2/3 and bf16 steps write the weights through ``.data`` without touching the tensors'
    version counters, so a backend could not tell from the tensors.
    """

    def __init__(self, model: torch.nn.Module, update_cfg: UpdateConfig, *, seed: int = 0,
                 pad_token_id: int | None = None, max_tokens: int | None = None,
                 ref_model: torch.nn.Module | None = None) -> None:
        init_distributed_env()
        import deepspeed  # heavy: imported only when an updater is built
        init_process_group()  # one process: a group over a private file, no port to race for

        self.cfg = update_cfg
        self.max_tokens = max_tokens
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        torch.manual_seed(seed)
        if update_cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.ref_model: torch.nn.Module | None = None
        # a LoRA policy's reference is its base: the same module with the adapters off, no second copy
        self.reference_is_base = update_cfg.kl_coef > 0 and ref_model is None and is_lora_model(model)
        if update_cfg.kl_coef > 0 and not self.reference_is_base:
            # copied before deepspeed.initialize, which may partition (ZeRO-3) or cast the policy in place
            self.ref_model = copy.deepcopy(ref_model if ref_model is not None else model)
            self.ref_model.requires_grad_(False).eval()
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        optimizer = torch.optim.AdamW(trainable, lr=update_cfg.lr, weight_decay=update_cfg.weight_decay)
        ds_config = deepspeed_config(update_cfg)
        # DeepSpeed's plain fp32 stage 0 clips without reporting the norm (its other modes report the norm of
        # the averaged gradient): clip in the optimizer's step pre-hook instead, which runs after DeepSpeed has
        # averaged the gradients over ranks, so the norm measured there is the applied gradient's
        self._clips_in_optimizer_hook = update_cfg.zero_stage == 0 and not update_cfg.bf16
        self._applied_grad_norm: float | None = None
        if self._clips_in_optimizer_hook:
            ds_config["gradient_clipping"] = 0.0
            optimizer.register_step_pre_hook(self._clip_applied_gradient)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
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
        """Announced weight updates of the policy module (``trace.policy.weights.weights_version``): moves
        after every optimizer step and checkpoint load."""
        return weights_version(self.engine.module)

    @property
    def num_optimizer_steps(self) -> int:
        """Optimizer steps taken so far (restored by ``load_checkpoint``)."""
        return int(self.engine.global_steps)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered under ZeRO-3) CPU copy of the module's state dict (with LoRA: base and adapter
        tensors in peft's naming), e.g. to load into the policy before ``save_policy``. A collective under ZeRO-3."""
        return self._gathered(lambda module: module.state_dict())

    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU copy of the weights the policy computes with, in its base model's Hugging Face naming
        (LoRA adapters merged in, ``trace.policy.lora.merged_state_dict``): what a vLLM engine loads. A
        collective under ZeRO-3."""
        return self._gathered(merged_state_dict)

    def _gathered(self, state_fn: Callable[[torch.nn.Module], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        module = self.engine.module
        if self.engine.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in state_fn(module).items()}
        return {k: v.detach().cpu().clone() for k, v in state_fn(module).items()}

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
        if self.ref_model is not None or self.reference_is_base:
            reference = self.ref_model if self.ref_model is not None else self.engine.module
            adapters_off = self.engine.module.disable_adapter() if self.reference_is_base else contextlib.nullcontext()
            with torch.no_grad(), adapters_off:
                ref_logprobs = token_logprobs(self._logits(reference, micro), micro.input_ids, temperature)
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
        micro += [empty_micro_batch(self.pad_token_id) for _ in range(int(count.item()) - len(micro))]
        return micro

    def _clip_applied_gradient(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook of the optimizer at fp32 ZeRO stage 0: clip the gradient about to be applied (already
        averaged over ranks by ``engine.step()``) to ``max_grad_norm`` and keep its norm before clipping."""
        del args, kwargs
        grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._applied_grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, self.cfg.max_grad_norm))

    def _optimizer_step(self) -> float:
        """``engine.step()``, then announce the new weights.

        Returns:
            The 2-norm of the gradient the optimizer applied, before clipping: the gradient averaged over ranks
            (the global token-mean loss's), the same on every rank; NaN when DeepSpeed reported none.
        """
        self._applied_grad_norm = None
        self.engine.step()
        mark_weights_updated(self.engine.module)
        norm = self._applied_grad_norm if self._clips_in_optimizer_hook else self.engine.get_global_grad_norm()
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
            ``update/seconds``. Losses, ``grad_norm`` (the norm of the gradient averaged over ranks, the one
            applied) and ``update/num_tokens`` are global over ranks; ``num_sequences`` and
            ``num_micro_batches`` are this rank's.

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
