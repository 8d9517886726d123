"""Warmup SFT: supervised fine-tuning on solver demonstrations until sampled success reaches a band.

The band ``[warmup.target_low, warmup.target_high]`` of mixed success is where the prompts' groups hold both
outcomes, so the RL arms start with a learning signal. The SFT batch of step ``s`` is drawn with
``step_rng(seed, s, "sft")`` and each measurement with ``step_seed(seed, s, "warm")``, where ``seed`` is
``cfg.warmup_seed`` (``warmup.seed``, else the global ``seed``), so a warmup is a function of the params alone, and
another ``warmup.seed`` gives a second warmup of the same task. DeepSpeed and torch load only when warmup runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Sequence

from trace.configuration.config import Config
from trace.envs.base import Prompt
from trace.training.evaluation import MetricsFn, sampled_success
from trace.rollout import trajectory_from_actions
from trace.training.seeding import step_rng, step_seed
from trace.tree import RolloutTree


@dataclass
class WarmupResult:
    """Outcome of the warmup SFT: success measured at each evaluation, and the step kept.

    Attributes:
        history: ``(sft_step, sampled_success)`` of each measurement, in order.
        chosen_step: the SFT step whose weights were kept (0: warmup did not run).
        chosen_success: the sampled success measured at ``chosen_step``.
        reason: why that step was kept (or why warmup did not run).
        num_demonstrations: training prompts with a demonstration (the SFT data).
    """

    history: list[tuple[int, float]] = field(default_factory=list)
    chosen_step: int = 0
    chosen_success: float = 0.0
    reason: str = ""
    num_demonstrations: int = 0


def demonstration_trees(policy, env, prompts: Sequence[Prompt], demo_noise: float, seed: int) -> list[RolloutTree]:
    """Teacher-forced solver demonstrations, one trajectory per prompt that has one.

    Args:
        policy: ``trace.policy.model.Policy``.
        env: an environment with a solver (``env.solve``). A solver that takes ``demo_noise`` and ``seed``
            (kgqa) gets them; an empty list of actions means the prompt has no demonstration (a grounded QA
            solver whose retrieved passages never support the answer), and the prompt is skipped.
        prompts: P prompts.
        demo_noise: the solver's noise, passed to ``env.solve``.
        seed: the warmup's seed (``cfg.warmup_seed``); prompt ``i`` is solved with ``step_seed(seed, i, "demo")``.

    Returns:
        Up to P ``RolloutTree``, one ``ROLLOUT`` trajectory each (``trajectory_from_actions``), in prompt order.

    Raises:
        ValueError: a solver whose actions do not end the episode (``trajectory_from_actions``).
    """
    takes_noise = "demo_noise" in inspect.signature(env.solve).parameters
    trees = []
    for i, prompt in enumerate(prompts):
        kwargs = {"demo_noise": demo_noise, "seed": step_seed(seed, i, "demo")} if takes_noise else {}
        actions = env.solve(prompt, **kwargs)
        if actions:
            trees.append(trajectory_from_actions(policy, env, prompt, actions))
    return trees


def trainable_snapshot(model) -> dict:
    """Copies of the parameters the SFT trains: every weight, or only a LoRA policy's adapters.

    Returns:
        ``{parameter name: tensor}`` for each parameter with ``requires_grad`` (``named_parameters`` names; a
        tied weight once). Frozen weights and buffers never change during the warmup and are not copied, so
        a LoRA snapshot of SmolLM2-135M is its 4.9 M adapter values, not the 135 M weights.
    """
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def restore_snapshot(model, snapshot: dict) -> None:
    """Write a ``trainable_snapshot`` back into ``model`` in place.

    Raises:
        KeyError: a name of ``snapshot`` is not a parameter of ``model`` (a snapshot of another model).
    """
    import torch

    params = dict(model.named_parameters())
    unknown = sorted(set(snapshot) - set(params))
    if unknown:
        raise KeyError(f"snapshot holds {len(unknown)} names that are not parameters of the model, e.g. {unknown[:3]}")
    with torch.no_grad():
        for name, value in snapshot.items():
            params[name].copy_(value)


def run_warmup(policy, env, train_prompts: Sequence[Prompt], cfg: Config, *,
               log_metrics: MetricsFn | None = None, progress: bool = True,
               on_measure: Callable[[int, float], None] | None = None) -> WarmupResult:
    """Supervised fine-tuning on solver demonstrations, stopped in a band of mixed success.

    Every ``warmup.eval_every`` steps the sampled success on ``warmup.eval_prompts`` training prompts is
    measured and the trained parameters are snapshotted (``trainable_snapshot``). Training stops at the first
    measurement >= ``target_low``. The kept weights are the first snapshot within ``[target_low, target_high]``;
    if success jumped over the band, the snapshot closest to the band's middle; if ``max_steps`` ran out below
    the band, the last one.
    ``policy.model`` holds the kept weights on return.

    Args:
        policy: ``trace.policy.model.Policy``; trained in place.
        env: an environment with a solver.
        train_prompts: the training prompts; demonstrations of all, success measured on the first
            ``warmup.eval_prompts``.
        cfg: the whole config (``warmup``, ``update``, ``rollout``, ``policy.max_context_tokens``, ``warmup_seed``:
            ``warmup.seed``, else ``seed``).
        log_metrics: ``fn(metrics, step)`` for ``warmup/sft_loss`` and ``warmup/success``.
        progress: show a tqdm bar.
        on_measure: ``fn(sft_step, sampled_success)`` after each measurement, while ``policy.model`` holds that
            step's weights (``scripts.warmup_sweep`` saves checkpoints there).

    Returns:
        A ``WarmupResult``; ``reason == "warmup disabled"`` and nothing trained when ``warmup.enabled`` is
        false or ``warmup.max_steps == 0``.

    Raises:
        ValueError: no training prompt has a demonstration.
    """
    from tqdm import tqdm

    from trace.policy.lora import apply_lora
    from trace.policy.weights import mark_weights_updated
    from trace.update import PolicyUpdater

    wcfg = cfg.warmup
    result = WarmupResult()
    if not wcfg.enabled or wcfg.max_steps == 0:
        result.reason = "warmup disabled"
        return result
    apply_lora(policy, cfg.update.lora, cfg.warmup_seed)  # update.lora: SFT of adapters (saved merged)
    demos = demonstration_trees(policy, env, train_prompts, wcfg.demo_noise, cfg.warmup_seed)
    if not demos:
        raise ValueError(f"warmup: none of the {len(train_prompts)} training prompts has a demonstration (the "
                         "solver found no evidence for any answer); check the retriever and task.files, or set "
                         "warmup.enabled: false")
    result.num_demonstrations = len(demos)
    updater = PolicyUpdater(policy.model, cfg.update.model_copy(update={"lr": wcfg.lr, "ppo_epochs": 1, "kl_coef": 0.0,
                                                                "gradient_checkpointing": False}),
                            seed=cfg.warmup_seed, pad_token_id=policy.tokenizer.pad_token_id,
                            max_tokens=cfg.policy.max_context_tokens)
    eval_prompts = list(train_prompts[: wcfg.eval_prompts])
    snapshots: list[tuple[int, float, dict]] = []
    middle = 0.5 * (wcfg.target_low + wcfg.target_high)

    def measure(step: int) -> float:
        success = sampled_success(policy, env, eval_prompts, cfg.rollout, seed=step_seed(cfg.warmup_seed, step, "warm"),
                                  max_context_tokens=cfg.policy.max_context_tokens)
        result.history.append((step, success))
        snapshots.append((step, success, trainable_snapshot(policy.model)))
        if log_metrics:
            log_metrics({"warmup/success": success}, step)
        if on_measure:
            on_measure(step, success)
        return success

    bar = tqdm(total=wcfg.max_steps, desc="warmup SFT", disable=not progress, leave=False)
    step = 0
    while step < wcfg.max_steps:
        rng = step_rng(cfg.warmup_seed, step, "sft")
        batch = [demos[i] for i in rng.choice(len(demos), size=min(wcfg.batch_size, len(demos)), replace=False)]
        metrics = updater.sft_step(batch)
        step += 1
        bar.update(1)
        if log_metrics and step % 10 == 0:
            log_metrics({"warmup/sft_loss": metrics.get("losses/sft", float("nan"))}, step)
        if step % wcfg.eval_every == 0:
            success = measure(step)
            bar.set_postfix(success=f"{success:.2f}")
            if success >= wcfg.target_low:
                break
    bar.close()
    if not snapshots or snapshots[-1][0] != step:
        measure(step)
    in_band = [s for s in snapshots if wcfg.target_low <= s[1] <= wcfg.target_high]
    if in_band:
        chosen, result.reason = in_band[0], "first measurement inside the band"
    elif snapshots[-1][1] > wcfg.target_high:
        chosen = min(snapshots, key=lambda s: (abs(s[1] - middle), s[0]))
        result.reason = "success jumped over the band: kept the measurement closest to its middle"
    else:
        chosen, result.reason = snapshots[-1], "max_steps reached below the band: kept the last weights"
    restore_snapshot(policy.model, chosen[2])
    mark_weights_updated(policy.model)  # backends serving the policy (the shared vLLM engine) must refresh
    result.chosen_step, result.chosen_success = chosen[0], chosen[1]
    return result
