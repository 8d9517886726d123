"""TRL's ``GRPOTrainer`` with per-prompt trajectory counts from a ``RolloutAllocator`` (the ``trl`` extra).

TRL draws ``generation_batch_size / num_generations`` prompts per generation and repeats each
``num_generations`` (W) times; its group baseline is ``nanmean(rewards.view(-1, W))``. This subclass keeps
that fixed width and makes part of each group padding: the allocator decides ``counts[i] <= W`` for each
candidate prompt i within the step's ``trajectory_budget``, the policy generates only the ``sum(counts)``
real rows, and each group's other ``W - counts[i]`` rows are pads. A pad row carries a one-token completion
(EOS), a NaN reward (TRL leaves NaN rows out of the group mean and std since v1.6 and sets their advantage to
0) and a zero loss mask (passed as TRL's ``tool_mask``), so it adds nothing to the loss or its token count.
After scoring, the real rewards go back to the allocator (``RolloutAllocator.observe``), and its metrics
join TRL's log under ``allocation/``.

Invariants: each step generates exactly ``trajectory_budget`` real completions when the rule is a planning
rule; a candidate's real rows are the first ``counts[i]`` of its group; with every count equal to W the
batch, the loss and the RNG draws are those of plain ``GRPOTrainer``.

Hooks of trl 1.16.0 this relies on (``trl/trainer/grpo_trainer.py``): ``_generate_and_score_completions``
(the step's inputs), ``_generate`` (returns the ``tool_mask``), ``_generate_single_turn`` (the generation
call), ``_calculate_rewards`` (the reward matrix), ``_save_checkpoint`` and
``_load_optimizer_and_scheduler`` (where TRL keeps its own extra state).

Not supported (refused at construction): several processes (every rank must receive the same allocation:
docs/integrations.md), vLLM generation (its server asks for ``num_generations`` samples per unique prompt),
``rollout_func``, tools and environments, ``normalize_then_sum`` aggregation, and rules that sample while
they allocate (``dapo``, ``reinforce_ada``), arms with stage 2 at ``expansion_ratio > 0`` (a single-turn
completion has no prefix to branch from), and an arm whose counts can exceed ``num_generations``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

try:
    from trl import GRPOTrainer
except ImportError as err:  # the optional extra is missing
    raise ImportError("trace.integrations.trl_grpo needs TRL: pip install trl==1.16.0 datasets==5.2.0 (the pins "
                      "of requirements.txt; the repository itself is not pip-installable: docs/integrations.md)"
                      ) from err
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trace.allocation.arms import root_budget_for
from trace.integrations.allocator import SAMPLING_ROOT_RULES, RolloutAllocator, planning_arms

__all__ = ["ALLOCATOR_STATE_FILE", "TraceGRPOTrainer", "prompt_id_of"]

ALLOCATOR_STATE_FILE = "trace_allocator_state.json"


def prompt_id_of(example: dict, column: str) -> str:
    """A stable id of a dataset row: its ``column`` value, else a digest of its prompt.

    Args:
        example: one TRL input row (``{"prompt": ..., ...}``).
        column: the dataset column holding the id.

    Returns:
        The id as a string (``sha1:<12 hex>`` of the prompt's JSON when the column is absent).
    """
    if column in example and example[column] is not None:
        return str(example[column])
    text = json.dumps(example["prompt"], sort_keys=True, default=str)
    return "sha1:" + hashlib.sha1(text.encode()).hexdigest()[:12]


class TraceGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose groups get the allocator's per-prompt counts, padded to ``num_generations``.

    Args:
        *args, **kwargs: what ``GRPOTrainer`` takes.
        allocator: the ``RolloutAllocator`` of the arm to run; its state is saved in each checkpoint
            (``ALLOCATOR_STATE_FILE``) and restored on resume.
        trajectory_budget: real completions per generation batch (the step's T); None:
            ``allocator.allocation.trajectory_budget``. At most ``generation_batch_size``.
        prompt_id_column: the dataset column with a stable prompt id (else the prompt's digest is used).

    Raises:
        ValueError: at build, each from the settings alone: a sampling rule (``dapo``, ``reinforce_ada``); a
            budget that ``RolloutAllocator.check_budget`` refuses for ``generation_batch_size /
            num_generations`` candidates or that exceeds ``generation_batch_size``; an arm with stage 2 whose
            ``expansion_ratio`` leaves continuations; an arm whose counts can exceed ``num_generations``
            (``count_cap``, i.e. ``allocation.m_max`` or ``allocation.vip.n_max``, above it, unless the root
            budget is smaller).
        NotImplementedError: several processes, vLLM, ``rollout_func``, tools or environments.
    """

    def __init__(self, *args: Any, allocator: RolloutAllocator, trajectory_budget: int | None = None,
                 prompt_id_column: str = "prompt_id", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allocator = allocator
        self.prompt_id_column = prompt_id_column
        width = self.num_generations
        num_candidates = self.args.generation_batch_size // width
        self.trajectory_budget = self._check_supported(
            allocator.allocation.trajectory_budget if trajectory_budget is None else trajectory_budget,
            num_candidates * width)
        self._real_rows: list[bool] | None = None  # per row of the generation batch being built
        self._real_rewards: list[torch.Tensor] | None = None

    def _check_supported(self, trajectory_budget: Any, num_rows: int) -> int:
        """The step's budget as an int, after refusing what the settings alone show this adapter cannot run."""
        if self.accelerator.num_processes > 1:
            raise NotImplementedError("TraceGRPOTrainer runs in one process: with several, every rank must receive "
                                      "the same allocation (docs/integrations.md, Several processes)")
        if self.use_vllm or self.rollout_func is not None or self.tools or self.environment_factories is not None:
            raise NotImplementedError("TraceGRPOTrainer generates with transformers, without rollout_func, tools "
                                      "or environments (docs/integrations.md, What is not supported)")
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise NotImplementedError("TraceGRPOTrainer needs multi_objective_aggregation='sum_then_normalize' "
                                      "(the group baseline over real rows)")
        allocator, width = self.allocator, self.num_generations
        arm, acfg = allocator.arm, allocator.allocation
        if arm.root_rule in SAMPLING_ROOT_RULES:
            raise ValueError(f"arm {arm.name!r} samples while it allocates, which one generation per step cannot "
                             f"serve: pick a planning arm ({', '.join(planning_arms())}; with stage 2 only at "
                             "expansion_ratio=0)")
        budget = allocator.check_budget(trajectory_budget)
        if budget > num_rows:
            raise ValueError(f"trajectory_budget={budget} exceeds the generation batch's {num_rows} rows "
                             "(num_generations rows for each candidate prompt): raise generation_batch_size or "
                             "lower the budget")
        root = root_budget_for(arm, budget, acfg.expansion_ratio)
        if root < budget:
            raise ValueError(f"arm {arm.name!r} with expansion_ratio={acfg.expansion_ratio} leaves {budget - root} "
                             f"of trajectory_budget={budget} to stage 2, which single-turn TRL generation cannot "
                             "place (no prefix to branch from): set AllocationConfig(expansion_ratio=0)")
        cap, cap_key = allocator.count_cap
        if min(cap, root) > width:
            raise ValueError(f"arm {arm.name!r} may give one prompt up to {min(cap, root)} trajectories "
                             f"({cap_key}={cap}, trajectory_budget={budget}), more than num_generations={width}: "
                             f"set {cap_key} <= num_generations (and group_size too)")
        allocator.check_budget(budget, num_rows // width)  # the candidates hold the budget at count_cap each
        return budget

    # ---- allocation and generation ----------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.model.training:  # evaluation keeps TRL's fixed groups
            return super()._generate_and_score_completions(inputs)
        width = self.num_generations
        candidates = inputs[::width]
        for i, example in enumerate(candidates):
            if any(row["prompt"] != example["prompt"] for row in inputs[i * width:(i + 1) * width]):
                raise ValueError(f"generation batch rows {i * width}..{(i + 1) * width - 1} are not one prompt "
                                 "repeated num_generations times (TRL's RepeatSampler order)")
        ids = [prompt_id_of(x, self.prompt_id_column) for x in candidates]
        texts = [x["prompt"] if isinstance(x["prompt"], str) else json.dumps(x["prompt"], default=str)
                 for x in candidates]
        allocation = self.allocator.allocate(ids, texts, trajectory_budget=self.trajectory_budget)
        counts = allocation.counts
        # refused at build already (_check_supported); these guard an allocator changed since
        if allocation.expansion_budget:
            raise ValueError(f"arm {self.allocator.arm.name!r} leaves {allocation.expansion_budget} continuations "
                             "for stage 2, which single-turn TRL generation cannot place: set "
                             "AllocationConfig(expansion_ratio=0)")
        if counts.max(initial=0) > width:
            raise ValueError(f"the allocator gave a prompt {int(counts.max())} trajectories, more than "
                             f"num_generations={width}: set allocation.m_max (and group_size) <= num_generations")
        self._real_rows = [j < int(c) for c in counts for j in range(width)]
        try:
            output = super()._generate_and_score_completions(inputs)
            rewards = self._real_rewards
        finally:
            self._real_rows, self._real_rewards = None, None
        active = [i for i, c in enumerate(counts) if c > 0]
        metrics = self.allocator.observe([ids[i] for i in active], [rewards[i].tolist() for i in active],
                                         [texts[i] for i in active])
        metrics.update(allocation.metrics)
        metrics["allocation/trajectories"] = float(counts.sum())
        for key, value in metrics.items():
            self._metrics["train"][key].append(float(value))
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        real = self._real_rows
        if real is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        if multimodal_fields:
            raise NotImplementedError("TraceGRPOTrainer pads text prompts only (multimodal fields were given)")
        rows = [i for i, is_real in enumerate(real) if is_real]
        completions, logprobs = super()._generate_single_turn(
            [prompt_ids[i] for i in rows], None if images is None else [images[i] for i in rows],
            multimodal_fields, num_generations, has_tool_images)
        pad = [self.eos_token_ids[0]]
        full_ids: list[list[int]] = [pad] * len(real)
        full_logprobs = None if logprobs is None else [[0.0]] * len(real)
        for k, i in enumerate(rows):
            full_ids[i] = completions[k]
            if full_logprobs is not None:
                full_logprobs[i] = logprobs[k]
        return full_ids, full_logprobs

    def _generate(self, prompts: list):
        out = list(super()._generate(prompts))
        if self._real_rows is not None:
            # a pad row's one token is masked out of the loss and of num_items_in_batch
            out[2] = [[int(is_real)] * len(ids) for is_real, ids in zip(self._real_rows, out[1], strict=True)]
        return tuple(out)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        real = self._real_rows
        if real is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rows = [i for i, is_real in enumerate(real) if is_real]
        scored = super()._calculate_rewards([inputs[i] for i in rows], [prompts[i] for i in rows],
                                            [completions[i] for i in rows], [completion_ids_list[i] for i in rows])
        rewards = torch.full((len(real), scored.size(1)), float("nan"), dtype=scored.dtype, device=scored.device)
        rewards[rows] = scored
        weighted = (scored * self.reward_weights.to(scored.device).unsqueeze(0)).nansum(dim=1).cpu()
        width, start, self._real_rewards = self.num_generations, 0, []
        for i in range(len(real) // width):
            count = sum(real[i * width:(i + 1) * width])
            self._real_rewards.append(weighted[start:start + count])
            start += count
        return rewards

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, ALLOCATOR_STATE_FILE), "w", encoding="utf-8") as fh:
                json.dump(self.allocator.state_dict(), fh)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ALLOCATOR_STATE_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by TraceGRPOTrainer, so the "
                                    "allocator's state cannot be restored; resume from a TraceGRPOTrainer checkpoint")
        with open(path, encoding="utf-8") as fh:
            self.allocator.load_state_dict(json.load(fh))
