"""Where a kgqa policy fails: held-out greedy accuracy by ambiguous relations, and its choice at each turn.

For each policy folder given (``data/models/warmup``, ``data/runs/<arm>/s<seed>/final``), on the first
``evaluate.num_prompts`` held-out questions of ``params.yaml``'s task:

- greedy accuracy by the number of ambiguous relations in the question (``task.kgqa.ambiguous_relations``);
- teacher-forced on the right path (the solver without confusion), the probability the policy gives the right
  entity at each turn after a search: at an ambiguous hop (where a look-alike line of another entity sits on
  the same relation) and at a plain one. RL that learns the task's decision raises the first.

Usage:  python -m scripts.kgqa_decisions data/models/warmup data/runs/grpo/s0/final [--params params.yaml]
"""

from __future__ import annotations

import argparse
import math
from typing import Sequence

import numpy as np


def decision_probabilities(policy, env, prompts: Sequence) -> dict[str, np.ndarray]:
    """Teacher-forced probability of the right entity at each hop of each question's right path.

    Args:
        policy: ``trace.policy.model.Policy``.
        env: a ``KGQAEnvironment`` (its ``cfg.ambiguous_relations`` splits the hops).
        prompts: its kgqa prompts.

    Returns:
        ``{"ambiguous": (A,) float64, "plain": (B,) float64}``: per hop, the probability (0..1) of the entity
        the right line names, in the action that follows that hop's search (``search [ X ]`` or
        ``finish [ X ]``), over every hop of every prompt.
    """
    from trace.envs.kgqa import KGQAEnvironment
    from trace.rollout import trajectory_from_actions

    clean = KGQAEnvironment(env.cfg.model_copy(update={"demo_confusion": 0.0}), seed=env.seed,
                            max_turns=env.max_turns)
    out: dict[str, list[float]] = {"ambiguous": [], "plain": []}
    for prompt in prompts:
        tree = trajectory_from_actions(policy, env, prompt, clean.solve(prompt), compute_logprobs=True)
        actions = [node for node in tree.nodes if node.turn_idx >= 0]
        for hop, rel in enumerate(prompt.meta["relations"]):
            entity_logprob = actions[hop + 1].logprobs[2]  # the action's words: tool [ entity ] ...
            kind = "ambiguous" if env.is_ambiguous(rel) else "plain"
            out[kind].append(math.exp(entity_logprob))
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="+", help="saved policy folders")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)

    from flows.common import build_environment
    from trace.training.evaluation import evaluate_policy
    from trace.configuration.params_file import load_config
    from trace.policy.model import load_policy

    cfg = load_config(args.params)
    env = build_environment(cfg)
    prompts = env.prompts("eval")[: cfg.evaluate.num_prompts]
    num_ambiguous = np.array([sum(map(env.is_ambiguous, p.meta["relations"])) for p in prompts])
    for path in args.policies:
        policy = load_policy(path)
        _, trees = evaluate_policy(policy, env, prompts, cfg.rollout, seed=cfg.seed,
                                   max_context_tokens=cfg.policy.max_context_tokens)
        greedy = np.array([max(leaf.reward or 0.0 for leaf in tree.leaves()) for tree in trees])
        by = ", ".join(f"{k} ambiguous: {greedy[num_ambiguous == k].mean():.3f} ({int(np.sum(num_ambiguous == k))})"
                       for k in sorted(set(num_ambiguous.tolist())))
        probs = decision_probabilities(policy, env, prompts)
        turns = "; ".join(f"{kind} turns {v.mean():.3f} (share > 0.5: {np.mean(v > 0.5):.3f}, {len(v)} turns)"
                          for kind, v in probs.items() if len(v))
        print(f"{path}: greedy {greedy.mean():.3f}; by relations {by}\n  P(right entity): {turns}")


if __name__ == "__main__":
    main()
