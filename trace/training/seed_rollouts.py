"""Seed rollouts: the warmed-up policy's trees on a sample of training prompts, the predictor's warm start.

Which prompts (``choose_seed_prompts``) and every rollout of them derive from the warmup's seed
(``cfg.warmup_seed``: ``warmup.seed``, else ``seed``) at step ``-1`` (salts ``seed_prompts``, ``seed``,
``seed_rollouts``, ``seed_branches``), so the stage's trees are a function of the params and the warmup policy alone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from trace.allocation.arms import get_arm
from trace.allocation.prefix import split_expansion_budget
from trace.allocation.prefix_rules import plan_expansion
from trace.configuration.config import Config
from trace.envs.base import Prompt
from trace.rollout import expand_prefixes, rollout_roots
from trace.sampling import make_rollout_backend, sampling_spec
from trace.training.seeding import step_rng, step_seed
from trace.tree import RolloutTree


def choose_seed_prompts(prompts: Sequence[Prompt], num_prompts: int, seed: int) -> list[Prompt]:
    """The training prompts the seed rollouts sample: ``num_prompts`` of them, drawn without replacement.

    Args:
        prompts: the training pool (P prompts).
        num_prompts: ``seed_rollouts.num_prompts``; all P when it exceeds the pool.
        seed: the warmup's seed (``cfg.warmup_seed``); the draw uses ``step_rng(seed, -1, "seed_prompts")``.

    Returns:
        ``min(num_prompts, P)`` distinct prompts in pool order.
    """
    rng = step_rng(seed, -1, "seed_prompts")
    pick = rng.choice(len(prompts), size=min(num_prompts, len(prompts)), replace=False)
    return [prompts[i] for i in sorted(pick)]


def collect_seed_rollouts(policy, env, prompts: Sequence[Prompt], cfg: Config, *, progress: bool = True) -> list[RolloutTree]:
    """Bare rollouts of the initial policy plus random-anchor continuations: the predictor's warm-start data.

    ``seed_rollouts.group_size`` rollouts per prompt, then ``round(m * expansion_ratio)`` continuations per
    prompt on uniformly random visited prefixes, so the predictor sees labelled prefixes as well as roots.

    Args:
        policy: ``trace.policy.model.Policy`` after warmup.
        env: the task environment.
        prompts: the prompts to roll out (``choose_seed_prompts``), distinct ``prompt_uid``.
        cfg: the whole config (``seed_rollouts``, ``rollout``, ``policy.max_context_tokens``, ``warmup_seed``).
        progress: show a tqdm bar of the bare rollouts.

    Returns:
        One ``RolloutTree`` per prompt, in the order of ``prompts``, at ``step=-1`` with ablation ``"seed"``;
        the trees keep their environment states.
    """
    scfg = cfg.seed_rollouts
    rng = step_rng(cfg.warmup_seed, -1, "seed_rollouts")
    backend = make_rollout_backend(policy, cfg.rollout)
    trees = rollout_roots(policy, env, prompts, [scfg.group_size] * len(prompts),
                          sampling_spec(cfg.rollout, step_seed(cfg.warmup_seed, -1, "seed")), step=-1,
                          ablation="seed", backend=backend, max_context_tokens=cfg.policy.max_context_tokens,
                          progress=progress)
    budgets = split_expansion_budget(np.full(len(trees), scfg.group_size),
                                     int(round(scfg.group_size * scfg.expansion_ratio * len(trees))))
    plan = plan_expansion(get_arm("tree_random"), trees, None, budgets, rng)
    if plan.counts:
        expand_prefixes(policy, env, trees, plan.counts,
                        sampling_spec(cfg.rollout, step_seed(cfg.warmup_seed, -1, "seed_branches")),
                        backend=backend, max_context_tokens=cfg.policy.max_context_tokens)
    return trees
