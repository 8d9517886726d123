"""Evaluation of a policy on prompts: greedy accuracy, pass@k / mean@k, and the warmup's sampled success.

Every measure here rolls the policy out with ``trace.rollout.rollout_roots`` at ``step=-1`` and reads the
leaves' verifier rewards; the metric keys live in one namespace (``accuracy/*`` by default). Two accuracies:
greedy (temperature 0, one rollout per question: the exact-match convention of Search-R1 and Tree-GRPO) and
avg@k, also called mean@k (the mean reward of k sampled rollouts per question, averaged over the questions:
the sampled pass@1 of DeepScaleR and verl's ``mean@N``, the policy that RL trains). The greedy reward of each
question (``question_rewards``, kept under ``trace.tracking.names.QUESTIONS_KEY`` in the evaluation outputs)
and its sampled success (``sampled_question_rewards``, under ``SAMPLED_QUESTIONS_KEY``) let the report pair two
evaluations question by question. Sampling is seeded per trajectory from ``seed``, so an evaluation repeated
with the same seed draws the same streams, and two policies are compared on the same ones.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from trace.configuration.config import RolloutConfig
from trace.envs.base import Environment, Prompt
from trace.rollout import rollout_roots
from trace.sampling import make_rollout_backend, sampling_spec
from trace.tree import RolloutTree

# ``fn(metrics, step)``: where a stage sends its metrics (MLflow in the flows)
MetricsFn = Callable[[Mapping[str, float], int], None]


def root_texts(env: Environment, prompts: Sequence[Prompt]) -> list[str]:
    """The user message of each prompt's root, ``env.reset(prompt)[1]`` (what prompt-level predictors read).

    Args:
        env: the task environment.
        prompts: P prompts.

    Returns:
        P strings, in the order of ``prompts``.
    """
    return [env.reset(p)[1] for p in prompts]


def evaluate_policy(policy, env: Environment, prompts: Sequence[Prompt], rollout_cfg: RolloutConfig, *,
                    seed: int, max_context_tokens: int, pass_k: int = 0, temperature: float = 1.0,
                    backend=None, prefix: str = "accuracy") -> tuple[dict[str, float], list[RolloutTree]]:
    """Greedy accuracy, and pass@k / mean@k of ``pass_k`` sampled rollouts per prompt (``pass_k=0``: greedy only).

    Args:
        policy: ``trace.policy.model.Policy``.
        env: the task environment.
        prompts: P held-out prompts with distinct ``prompt_uid``.
        rollout_cfg: the ``rollout`` section (top-p, token limits, backend).
        seed: sampling seed of the greedy pass; the sampled pass uses ``seed + 1``.
        max_context_tokens: ``policy.max_context_tokens``.
        pass_k: sampled rollouts per prompt (0: none).
        temperature: temperature of the sampled rollouts.
        backend: a ``GenerationBackend`` to reuse; ``None`` builds the one ``rollout.backend`` names.
        prefix: namespace of the metric keys.

    Returns:
        ``({"<prefix>/greedy", "<prefix>/pass@k", "<prefix>/mean@k", "<prefix>/truncated",
        "<prefix>/greedy_hops<h>" per hop count when prompts carry ``meta["num_hops"]``}, trees)``: the
        P greedy trees, then the P sampled trees when ``pass_k >= 1``.

    Raises:
        ValueError: duplicate prompt uids or a prompt that fills the context (``rollout_roots``).
    """
    backend = make_rollout_backend(policy, rollout_cfg, backend)
    greedy = rollout_roots(policy, env, prompts, [1] * len(prompts), sampling_spec(rollout_cfg, seed, 0.0),
                           step=-1, ablation="eval", backend=backend, max_context_tokens=max_context_tokens)
    rewards = np.array([t.leaf_rewards()[0] for t in greedy])
    truncated = np.array([t.leaves()[0].finish_reason.is_truncated for t in greedy])
    metrics = {f"{prefix}/greedy": float(rewards.mean()), f"{prefix}/truncated": float(truncated.mean())}
    hops = [p.meta.get("num_hops") for p in prompts]
    for h in sorted({h for h in hops if h is not None}):
        sel = np.array([x == h for x in hops])
        metrics[f"{prefix}/greedy_hops{h}"] = float(rewards[sel].mean())
    trees = list(greedy)
    if pass_k >= 1:
        sampled = rollout_roots(policy, env, prompts, [pass_k] * len(prompts),
                                sampling_spec(rollout_cfg, seed + 1, temperature), step=-1, ablation="eval",
                                backend=backend, max_context_tokens=max_context_tokens)
        per_prompt = np.array([t.leaf_rewards() for t in sampled])  # (P, k)
        metrics[f"{prefix}/pass@{pass_k}"] = float((per_prompt.max(axis=1) > 0).mean())
        metrics[f"{prefix}/mean@{pass_k}"] = float(per_prompt.mean())
        trees.extend(sampled)
    return metrics, trees


def question_rewards(greedy_trees: Sequence[RolloutTree]) -> dict[str, float]:
    """Each question's greedy reward, keyed by its ``prompt_uid``: the per-question results whose mean is
    ``accuracy/greedy``.

    Args:
        greedy_trees: the P greedy trees of ``evaluate_policy`` (its first P trees), one leaf each.

    Returns:
        ``{prompt_uid: reward}`` in the order of the trees (1.0 correct, 0.0 wrong for a 0/1 verifier).

    Raises:
        ValueError: a tree without exactly one leaf (not a greedy tree) or two trees of one question.
    """
    out: dict[str, float] = {}
    for tree in greedy_trees:
        rewards = tree.leaf_rewards()
        if rewards.shape != (1,):
            raise ValueError(f"tree {tree.tree_id} has {rewards.size} leaves: pass the greedy trees of "
                             "evaluate_policy (its first P trees, one leaf each)")
        if tree.prompt_uid in out:
            raise ValueError(f"two greedy trees of question {tree.prompt_uid!r}")
        out[tree.prompt_uid] = float(rewards[0])
    return out


def sampled_question_rewards(sampled_trees: Sequence[RolloutTree]) -> dict[str, float]:
    """Each question's sampled success, keyed by its ``prompt_uid``: the mean reward of its k sampled rollouts,
    whose mean over the questions is ``accuracy/mean@k`` (avg@k).

    Args:
        sampled_trees: the P sampled trees of ``evaluate_policy`` (its trees after the first P), k leaves each.

    Returns:
        ``{prompt_uid: mean leaf reward}`` in the order of the trees (values in [0, 1] for 0/1 rewards, in
        steps of 1/k).

    Raises:
        ValueError: a tree without leaves, trees with different numbers of leaves (not one ``pass_k``), or two
            trees of one question.
    """
    out: dict[str, float] = {}
    sizes = set()
    for tree in sampled_trees:
        rewards = tree.leaf_rewards()
        if rewards.size == 0:
            raise ValueError(f"tree {tree.tree_id} has no leaves: pass the sampled trees of evaluate_policy")
        sizes.add(rewards.size)
        if tree.prompt_uid in out:
            raise ValueError(f"two sampled trees of question {tree.prompt_uid!r}")
        out[tree.prompt_uid] = float(rewards.mean())
    if len(sizes) > 1:
        raise ValueError(f"sampled trees with {sorted(sizes)} leaves: every question needs the same k samples "
                         "(the sampled trees of one evaluate_policy call)")
    return out


def success_rates(policy, env: Environment, prompts: Sequence[Prompt], rollout_cfg: RolloutConfig, *, seed: int,
                  samples: int, max_context_tokens: int, backend=None, label: str = "probe") -> dict[str, float]:
    """Each prompt's success rate over ``samples`` sampled rollouts (``rollout.temperature``): mean@k per prompt.

    With a fixed ``seed`` and prompt set, two policies are compared on the same sampling streams, which is
    how the in-training probe measures a policy's gain over the one it started from.

    Args:
        policy: ``trace.policy.model.Policy``.
        env: the task environment.
        prompts: P prompts with distinct ``prompt_uid``.
        rollout_cfg: the ``rollout`` section.
        seed: the sampling seed.
        samples: k >= 1 rollouts per prompt.
        max_context_tokens: ``policy.max_context_tokens``.
        backend: a ``GenerationBackend`` to reuse, or ``None``.
        label: the trees' ablation label (``tree_id`` only; sampling does not read it).

    Returns:
        ``{prompt_uid: mean reward of its k rollouts}`` (values in [0, 1] for 0/1 rewards).

    Raises:
        ValueError: ``samples < 1``, duplicate prompt uids or a prompt that fills the context.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    trees = rollout_roots(policy, env, prompts, [samples] * len(prompts), sampling_spec(rollout_cfg, seed),
                          step=-1, ablation=label, backend=make_rollout_backend(policy, rollout_cfg, backend),
                          max_context_tokens=max_context_tokens)
    return {tree.prompt_uid: float(np.mean(tree.leaf_rewards())) for tree in trees}


def sampled_success(policy, env: Environment, prompts: Sequence[Prompt], rollout_cfg: RolloutConfig, *,
                    seed: int, max_context_tokens: int, backend=None) -> float:
    """Mean reward of one sampled rollout per prompt (the warmup's success measure).

    Args: as ``success_rates``, with one sample per prompt.

    Returns:
        The mean leaf reward over the P rollouts.
    """
    rates = success_rates(policy, env, prompts, rollout_cfg, seed=seed, samples=1,
                          max_context_tokens=max_context_tokens, backend=backend, label="warmup")
    return float(np.mean(list(rates.values())))
