"""The ``oracle`` and ``noisy_oracle`` backends: true ``V(H)`` of environments that know it (benchmarks).

Invariant: the noisy oracle's error at a prefix is a fixed function of the seed and the prefix's key, never
of the call order.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trace.configuration.config import PredictorConfig, PredictorKind
from trace.envs.base import KnowsTrueSuccessProb, Prompt
from trace.predictor.base import BuildContext, PredictorBase, check_prompt_args, clip_predictions, logit, sigmoid, \
    stable_int
from trace.tree import RolloutTree


class OraclePredictor(PredictorBase):
    """True success probabilities from an environment that knows them (kind ``oracle``; benchmarks).

    Nodes read ``node.true_success_prob``, falling back to ``env.true_success_prob(node.env_state)``;
    prompts read ``env.true_success_prob(env.reset(prompt)[0])``. ``fit`` does nothing.
    """

    kind = PredictorKind.ORACLE

    def __init__(self, cfg: PredictorConfig, env: Any, *, seed: int = 0) -> None:
        """Raises:
            ValueError: if ``env`` is missing or does not implement ``true_success_prob(state)``.
        """
        super().__init__(cfg, seed=seed)
        if env is None or not isinstance(env, KnowsTrueSuccessProb):
            name = "no environment" if env is None else f"environment {type(env).__name__}"
            raise ValueError(f"predictor.kind={self.kind.value} needs an environment that knows true success "
                             f"probabilities (true_success_prob(state), e.g. the simulator); got {name}. "
                             "Use task.name=simulator or another predictor.kind")
        self.env = env

    @classmethod
    def from_context(cls, cfg: PredictorConfig, context: BuildContext) -> "OraclePredictor":
        """``cls(cfg, env, seed=)`` from ``make_predictor``'s arguments.

        Raises:
            ValueError: if ``context.env`` does not know true success probabilities.
        """
        return cls(cfg, context.env, seed=context.seed)

    def _true_values(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        values = []
        for tree, ids in zip(trees, node_ids):
            for i in ids:
                node = tree.nodes[i]
                if node.true_success_prob is not None:
                    values.append(float(node.true_success_prob))
                elif node.env_state is not None:
                    values.append(float(self.env.true_success_prob(node.env_state)))
                else:
                    raise ValueError(f"tree {tree.tree_id}: node {i} has neither true_success_prob nor env_state; "
                                     "the oracle can only score trees rolled out in an environment that knows "
                                     "true success probabilities")
        return np.asarray(values, dtype=np.float64)

    def _true_prompt_values(self, prompts: Sequence[Prompt]) -> np.ndarray:
        return np.array([self.env.true_success_prob(self.env.reset(p)[0]) for p in prompts], dtype=np.float64)

    def _predict_flat(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        return self._true_values(trees, node_ids)

    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str],
                        root_token_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """(B,) float64 true ``V(x_i)`` of the prompts' reset states, clipped to ``[clip, 1 - clip]``.

        Raises:
            ValueError: if ``prompts`` and ``root_texts`` differ in length.
        """
        check_prompt_args(prompts, root_texts)
        return clip_predictions(self._true_prompt_values(prompts), self.cfg.clip)

    def fit(self, trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None) -> dict[str, float]:
        """Nothing to learn (``root_weights`` is ignored); returns ``{}``."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Kind, format version and seed."""
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the seed. Raises ValueError on a different kind or format version."""
        self._check_state(state)



class NoisyOraclePredictor(OraclePredictor):
    """``sigmoid(logit(V) + eps)``, ``eps ~ N(0, noise_std^2)`` (kind ``noisy_oracle``; benchmarks).

    The noise of an item is drawn from a generator seeded by ``(seed, item key)``, so the same prefix always
    gets the same error whatever the call order (a fixed imperfect predictor, not fresh noise per query).
    Keys: ``root/<prompt_uid>`` for prompts and tree roots alike, ``<tree_id>/<node_id>`` for turns.
    """

    kind = PredictorKind.NOISY_ORACLE

    def _noise(self, keys: Sequence[str]) -> np.ndarray:
        return np.array([np.random.default_rng(stable_int(self.seed, "noisy-oracle", k)).normal()
                         for k in keys], dtype=np.float64) * self.cfg.noise_std

    def _noisy(self, values: np.ndarray, keys: Sequence[str]) -> np.ndarray:
        return sigmoid(logit(np.clip(values, 0.0, 1.0)) + self._noise(keys))

    def _predict_flat(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        keys = [f"root/{t.prompt_uid}" if t.nodes[i].is_root else f"{t.tree_id}/{i}"
                for t, ids in zip(trees, node_ids) for i in ids]
        return self._noisy(self._true_values(trees, node_ids), keys)

    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str],
                        root_token_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """(B,) float64 noisy true ``V(x_i)``, clipped to ``[clip, 1 - clip]``.

        Raises:
            ValueError: if ``prompts`` and ``root_texts`` differ in length.
        """
        check_prompt_args(prompts, root_texts)
        keys = [f"root/{p.prompt_uid}" for p in prompts]
        return clip_predictions(self._noisy(self._true_prompt_values(prompts), keys), self.cfg.clip)
