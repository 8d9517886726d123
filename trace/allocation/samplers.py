"""``StepSampler`` implementations: the policy's rollout engine, and the martingale simulator.

``PolicySampler`` rolls out the language-model policy (``trace.rollout.rollout_roots`` /
``expand_prefixes``, imported when first sampling so this module stays free of torch); each salt maps to a
``SamplingSpec`` through the caller's ``spec_for``. ``SimulatorSampler`` draws from
``trace.envs.simulator.SimulatorEnvironment`` with numpy generators chosen by the caller. Both score with
any predictor that has ``predict_prompts`` and ``predict_trees`` (``trace.predictor``).
``MonteCarloScorer`` wraps either and scores by Monte-Carlo estimates instead of a predictor (the oracle arm).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from trace.tree import RolloutTree

__all__ = ["MonteCarloScorer", "PolicySampler", "SimulatorSampler"]


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


class MonteCarloScorer:
    """A sampler whose scores are Monte-Carlo success rates under the current policy, not a predictor's.

    ``score_prompts`` and ``score_anchors`` return the mean reward of ``samples`` fresh continuations of each
    prompt or prefix (``trace.predictor.ground_truth.monte_carlo_truth``), on salts of their own
    (``"<salt>_roots<c>"``, ``"<salt>_prefixes<c>"``, ``c`` the call's number within the step); roots are sampled
    into new trees and prefixes continued on copies, so nothing the estimates sample joins the step's trees,
    its budget or its training. Sampling is ``base``'s. What the estimates cost is counted in ``rollouts`` and
    ``tokens`` (``metrics()``). It is the allocation a perfect predictor would make, up to the estimates'
    binomial error ``sqrt(p (1 - p) / samples)``: the ``trace_oracle`` arm's upper bound on what predicted
    success buys.

    Args:
        base: the step's sampler (``PolicySampler``, ``SimulatorSampler``).
        samples: ``K >= 1`` continuations per prompt and prefix (``allocation.oracle_samples``).
        salt: the salts' stem (``"oracle"``; another stem draws other continuations on the same step).

    Raises:
        ValueError: ``samples < 1``.
    """

    def __init__(self, base: Any, samples: int, salt: str = "oracle") -> None:
        if samples < 1:
            raise ValueError(f"allocation.oracle_samples={samples} must be >= 1 continuation per prompt and prefix")
        self.base = base
        self.samples = int(samples)
        self.rollouts = 0
        self.tokens = 0
        self.calls = 0
        self.salt = salt

    def _estimate(self, prompts: Sequence, prefixes: Sequence[tuple[RolloutTree, int]]):
        from trace.predictor.ground_truth import monte_carlo_truth

        self.calls += 1
        truth = monte_carlo_truth(self.base, prompts, prefixes, self.samples,
                                  root_salt=f"{self.salt}_roots{self.calls}",
                                  prefix_salt=f"{self.salt}_prefixes{self.calls}")
        self.rollouts += truth.num_rollouts
        self.tokens += truth.num_tokens
        return truth

    def score_prompts(self, prompts: Sequence) -> np.ndarray:
        """(B,) float64 mean reward of ``samples`` fresh rollouts of each prompt."""
        if not prompts:
            return np.zeros(0)
        return self._estimate(list(prompts), []).roots.estimate.copy()

    def score_anchors(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One (K_i,) float64 array per tree: the mean reward of ``samples`` continuations of each node.

        Raises:
            ValueError: ``node_ids`` does not hold one list per tree.
        """
        if len(node_ids) != len(trees):
            raise ValueError(f"{len(trees)} trees but {len(node_ids)} lists of node ids: pass one list per tree")
        pairs = [(tree, int(n)) for tree, ids in zip(trees, node_ids) for n in ids]
        flat = self._estimate([], pairs).prefixes.estimate if pairs else np.zeros(0)
        bounds = np.cumsum([0] + [len(ids) for ids in node_ids])
        return [flat[bounds[i]:bounds[i + 1]].copy() for i in range(len(node_ids))]

    def sample_roots(self, prompts: Sequence, counts: Sequence[int], salt: str) -> list[RolloutTree]:
        """``base.sample_roots``."""
        return self.base.sample_roots(prompts, counts, salt)

    def sample_continuations(self, trees: Sequence[RolloutTree], counts: Mapping[tuple[int, int], int],
                             salt: str) -> None:
        """``base.sample_continuations``."""
        self.base.sample_continuations(trees, counts, salt)

    def metrics(self) -> dict[str, float]:
        """``oracle/rollouts`` and ``oracle/tokens``: what the estimates sampled so far (never in the budget)."""
        return {"oracle/rollouts": float(self.rollouts), "oracle/tokens": float(self.tokens)}
