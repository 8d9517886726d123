"""``StepSampler`` implementations: the policy's rollout engine, and the martingale simulator.

``PolicySampler`` rolls out the language-model policy (``trace.rollout.rollout_roots`` /
``expand_prefixes``, imported when first sampling so this module stays free of torch); each salt maps to a
``SamplingSpec`` through the caller's ``spec_for``. ``SimulatorSampler`` draws from
``trace.envs.simulator.SimulatorEnvironment`` with numpy generators chosen by the caller. Both score with
any predictor that has ``predict_prompts`` and ``predict_trees`` (``trace.predictor``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from trace.tree import RolloutTree

__all__ = ["PolicySampler", "SimulatorSampler"]


class PolicySampler:
    """Rollouts of the policy through its generation backend, for one step.

    Args:
        policy: ``trace.policy.model.Policy``.
        env: the task environment.
        backend: the generation backend (``trace.sampling.make_backend``).
        predictor: scores prompts and prefixes; None for arms that never read it.
        spec_for: ``spec_for(salt) -> trace.sampling.SamplingSpec`` (the salt's seed).
        step: the training step recorded on the trees.
        ablation: the arm name recorded on the trees.
        max_context_tokens: ``policy.max_context_tokens``.
    """

    def __init__(self, policy: Any, env: Any, backend: Any, predictor: Any, spec_for: Callable[[str], Any], *,
                 step: int, ablation: str, max_context_tokens: int) -> None:
        self.policy = policy
        self.env = env
        self.backend = backend
        self.predictor = predictor
        self.spec_for = spec_for
        self.step = step
        self.ablation = ablation
        self.max_context_tokens = max_context_tokens

    def score_prompts(self, prompts: Sequence) -> np.ndarray:
        """(B,) float64 predictions from the prompts and their first user messages (``env.reset``)."""
        root_texts = [self.env.reset(p)[1] for p in prompts]
        return np.asarray(self.predictor.predict_prompts(prompts, root_texts), dtype=np.float64)

    def score_anchors(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``predictor.predict_trees``: one (K_i,) array per tree."""
        return self.predictor.predict_trees(trees, node_ids)

    def sample_roots(self, prompts: Sequence, counts: Sequence[int], salt: str) -> list[RolloutTree]:
        """``rollout_roots`` with ``spec_for(salt)``: one tree per prompt, in prompt order."""
        from trace.rollout import rollout_roots

        return rollout_roots(self.policy, self.env, prompts, list(map(int, counts)), self.spec_for(salt),
                             step=self.step, ablation=self.ablation, backend=self.backend,
                             max_context_tokens=self.max_context_tokens)

    def sample_continuations(self, trees: Sequence[RolloutTree], counts: Mapping[tuple[int, int], int],
                             salt: str) -> None:
        """``expand_prefixes`` with ``spec_for(salt)``, in place."""
        from trace.rollout import expand_prefixes

        expand_prefixes(self.policy, self.env, trees, counts, self.spec_for(salt), backend=self.backend,
                        max_context_tokens=self.max_context_tokens)


class SimulatorSampler:
    """Rollouts of the martingale simulator, for one step.

    Args:
        env: ``trace.envs.simulator.SimulatorEnvironment``.
        predictor: scores prompts (from their questions) and prefixes; None for arms that never read it.
        roots_rng: the one generator every root sampling of the step draws from, in call order.
        continuation_rng: ``continuation_rng(salt) -> Generator`` for each continuation call.
        step: the step recorded on the trees.
        ablation: the arm name recorded on the trees.
    """

    def __init__(self, env: Any, predictor: Any, roots_rng: np.random.Generator,
                 continuation_rng: Callable[[str], np.random.Generator], *, step: int, ablation: str) -> None:
        self.env = env
        self.predictor = predictor
        self.roots_rng = roots_rng
        self.continuation_rng = continuation_rng
        self.step = step
        self.ablation = ablation

    def score_prompts(self, prompts: Sequence) -> np.ndarray:
        """(B,) float64 predictions from the prompts and their questions."""
        return np.asarray(self.predictor.predict_prompts(prompts, [p.question for p in prompts]), dtype=np.float64)

    def score_anchors(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``predictor.predict_trees``: one (K_i,) array per tree."""
        return self.predictor.predict_trees(trees, node_ids)

    def sample_roots(self, prompts: Sequence, counts: Sequence[int], salt: str) -> list[RolloutTree]:
        """``sample_root_rollouts`` from ``roots_rng`` (the salt does not pick the stream)."""
        return self.env.sample_root_rollouts(prompts, counts, self.roots_rng, step=self.step, ablation=self.ablation)

    def sample_continuations(self, trees: Sequence[RolloutTree], counts: Mapping[tuple[int, int], int],
                             salt: str) -> None:
        """``sample_continuations`` from ``continuation_rng(salt)``, in place."""
        self.env.sample_continuations(trees, counts, self.continuation_rng(salt))
