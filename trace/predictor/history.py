"""The ``history`` backend: per-prompt Beta-Bernoulli posterior of past root-rollout rewards (roots only).

Invariant: a tree is counted once however often it is refitted (identified by ``tree_id``), so the
posterior depends only on the set of trees fitted so far.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trace.configuration.config import PredictorConfig, PredictorKind
from trace.envs.base import Prompt
from trace.predictor.base import PredictorBase, check_prompt_args, clip_predictions
from trace.predictor.labels import check_root_weights
from trace.tree import Origin, RolloutTree


class HistoryPredictor(PredictorBase):
    """Per-prompt Beta-Bernoulli posterior of past root-rollout rewards (kind ``history``; roots only).

    Prompt u has posterior ``Beta(prior_alpha + S_u, prior_beta + F_u)`` with ``S_u = sum r`` and
    ``F_u = sum (1 - r)`` over the leaves of its bare root rollouts (``Origin.ROLLOUT`` leaves) in every tree
    fitted so far; continuations (``Origin.BRANCH``) are left out because they start from chosen anchors,
    not from the prompt. The prediction is the posterior mean ``(alpha + S) / (alpha + beta + S + F)``;
    a prompt never seen gets the prior mean. Every prefix of a tree gets its prompt's posterior mean:
    the history predictor has no view of turns. A tree is counted once however often it is refitted (the
    training loop refits on a sliding window), identified by ``tree_id``.

    References:
        Knapsack-RL, arXiv 2509.25849 (success rates from past rollouts); GRESO, arXiv 2506.02177 (prompt
        history); the Beta-Bernoulli conjugate update, Gelman et al., Bayesian Data Analysis, section 2.4.
    """

    kind = PredictorKind.HISTORY

    def __init__(self, cfg: PredictorConfig, *, seed: int = 0) -> None:
        super().__init__(cfg, seed=seed)
        self.successes: dict[str, float] = {}
        self.failures: dict[str, float] = {}
        self.counted_tree_ids: set[str] = set()

    def posterior(self, prompt_uids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta): two (B,) float64 arrays of each prompt's Beta posterior parameters."""
        s = np.array([self.successes.get(u, 0.0) for u in prompt_uids], dtype=np.float64)
        f = np.array([self.failures.get(u, 0.0) for u in prompt_uids], dtype=np.float64)
        return self.cfg.prior_alpha + s, self.cfg.prior_beta + f

    def _posterior_mean(self, prompt_uids: Sequence[str]) -> np.ndarray:
        alpha, beta = self.posterior(prompt_uids)
        return alpha / (alpha + beta)

    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str],
                        root_token_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """(B,) float64 posterior means of the prompts (by ``prompt_uid``), clipped to ``[clip, 1 - clip]``.

        Raises:
            ValueError: if ``prompts`` and ``root_texts`` differ in length.
        """
        check_prompt_args(prompts, root_texts)
        return clip_predictions(self._posterior_mean([p.prompt_uid for p in prompts]), self.cfg.clip)

    def _predict_flat(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        return self._posterior_mean([t.prompt_uid for t, ids in zip(trees, node_ids) for _ in ids])

    def fit(self, trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None) -> dict[str, float]:
        """Add the root-rollout rewards of trees not counted before to their prompts' counts.

        Args:
            trees: the sliding window of recent trees.
            root_weights: (T,) positive multipliers: each of tree t's outcomes counts ``root_weights[t]`` times;
                ``None`` = 1.

        Returns:
            ``predictor/fit_new_trees``, ``predictor/fit_new_outcomes`` (leaves added now),
            ``predictor/num_prompts_seen``.
        """
        new_trees, new_outcomes = 0, 0
        weights = np.ones(len(trees)) if root_weights is None else check_root_weights(root_weights, len(trees))
        for tree, weight in zip(trees, weights.tolist()):  # python floats: the state loads with weights_only
            if tree.tree_id in self.counted_tree_ids:
                continue
            self.counted_tree_ids.add(tree.tree_id)
            new_trees += 1
            for leaf in tree.leaves():
                if leaf.origin != Origin.ROLLOUT:
                    continue
                reward = tree.reward_of(leaf)
                uid = tree.prompt_uid
                self.successes[uid] = self.successes.get(uid, 0.0) + weight * reward
                self.failures[uid] = self.failures.get(uid, 0.0) + weight * (1.0 - reward)
                new_outcomes += 1
        return {"predictor/fit_new_trees": float(new_trees), "predictor/fit_new_outcomes": float(new_outcomes),
                "predictor/num_prompts_seen": float(len(self.successes))}

    def state_dict(self) -> dict[str, Any]:
        """Kind, version, seed, per-prompt success / failure sums (prior excluded) and the counted tree ids."""
        return {**self._base_state(), "successes": dict(self.successes), "failures": dict(self.failures),
                "counted_tree_ids": sorted(self.counted_tree_ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``.

        Raises:
            ValueError: on a different kind or format version.
        """
        self._check_state(state)
        self.successes = {str(k): float(v) for k, v in state["successes"].items()}
        self.failures = {str(k): float(v) for k, v in state["failures"].items()}
        self.counted_tree_ids = set(state["counted_tree_ids"])
