"""The ``history_path`` backend: a prompt's past outcomes plus the observation texts along a prefix.

Made for the martingale simulator (``trace.envs.simulator``), whose observations say ``progress up`` or
``progress down``: it sees only what a predictor beside a real policy could see (past rewards of the prompt,
the observation texts of the prefix) and never reads ``true_success_prob``. Roots get the per-prompt
Beta-Bernoulli posterior mean (``HistoryPredictor``, here with an empirical-Bayes prior); turn prefixes get a
logistic regression on the prompt's evidence and the path's observations. Invariant: the evidence of a
prefix never includes the outcomes below the prefix itself.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trace.configuration.config import PredictorConfig, PredictorKind
from trace.envs.base import Prompt
from trace.envs.simulator import OBS_DOWN, OBS_UP
from trace.predictor.base import BuildContext, PredictorBase, logit, sigmoid
from trace.predictor.history import HistoryPredictor
from trace.predictor.labels import labelled_node_ids
from trace.tree import Origin, RolloutTree


def empirical_bayes_prior(trees: Sequence[RolloutTree], min_concentration: float = 0.05) -> tuple[float, float]:
    """Beta prior ``(alpha, beta)`` of per-prompt success rates, moment-matched to root-rollout outcomes.

    For prompts each with ``n`` root rollouts and ``s_u`` successes, the beta-binomial model gives
    ``E[s/n] = mu`` and ``Var[s/n] = mu (1 - mu) (1 + (n - 1) rho) / n`` with ``rho = 1 / (alpha + beta + 1)``;
    solving for ``rho`` from the observed mean and variance gives ``alpha + beta = 1 / rho - 1``.

    Args:
        trees: trees whose ``ROLLOUT`` leaves are the outcomes (one tree per prompt; ``n`` may vary, its
            mean is used).
        min_concentration: floor of ``alpha + beta`` (a population more polarised than the data can show).

    Returns:
        ``(alpha, beta)``, both > 0.

    Raises:
        ValueError: fewer than two prompts, or a mean of fewer than two rollouts per prompt.

    References:
        Method-of-moments for the beta-binomial: Skellam (1948), JRSS B 10(2); Kleinman (1973), JASA 68.
    """
    rates, sizes = [], []
    for tree in trees:
        rewards = [tree.reward_of(leaf) for leaf in tree.leaves()
                   if leaf.origin == Origin.ROLLOUT]
        if rewards:
            rates.append(float(np.mean(rewards)))
            sizes.append(len(rewards))
    n = float(np.mean(sizes)) if sizes else 0.0
    if len(rates) < 2 or n < 2:
        raise ValueError(f"need >= 2 prompts with >= 2 root rollouts each to fit a prior, got {len(rates)} "
                         f"prompts with {n:.1f} rollouts on average")
    mu = float(np.clip(np.mean(rates), 1e-3, 1 - 1e-3))
    var = float(np.var(rates, ddof=1))
    rho = (n * var / (mu * (1.0 - mu)) - 1.0) / (n - 1.0)
    concentration = max(1.0 / float(np.clip(rho, 1e-3, 0.999)) - 1.0, min_concentration)
    return mu * concentration, (1.0 - mu) * concentration


class HistoryPathPredictor(PredictorBase):
    """``V_hat`` from a prompt's past outcomes and a prefix's observation texts (kind ``history_path``).

    Roots: the posterior mean of ``HistoryPredictor`` (Beta prior ``(alpha, beta)``), leaving out the tree's
    own rollouts when the tree was already counted. A prefix ``H`` ending at a turn node: ``sigmoid(x . w)``
    with features ``x = [1, z, z log(1 + n), u - d, last, t]``, where ``z`` is the logit of the prompt's
    posterior mean from ``n`` outcomes (earlier trees plus the tree's root rollouts not below ``H``), ``u`` /
    ``d`` count ``progress up`` / ``progress down`` observations on the path, ``last`` is the last one
    (+1 / -1) and ``t`` the number of turns so far. ``w`` is the L2-regularised weighted logistic regression
    (Newton's method) on the labelled prefixes of the fitted window: label the mean descendant-leaf reward,
    weight the leaf count, as the other predictors use.

    Args:
        prior_alpha, prior_beta: Beta prior of per-prompt success rates (> 0; e.g. ``empirical_bayes_prior``).
        clip: predictions are clipped to ``[clip, 1 - clip]`` (``PredictorConfig.clip``).
        l2: ridge penalty on the non-intercept weights.
        seed: kept in the state like every backend's (nothing here is random).

    References:
        The Beta-Bernoulli conjugate update, Gelman et al., Bayesian Data Analysis, section 2.4; Newton's
        method for logistic regression, Hastie, Tibshirani, Friedman, The Elements of Statistical Learning,
        section 4.4.1.
    """

    kind = PredictorKind.HISTORY_PATH
    num_features = 6

    def __init__(self, prior_alpha: float, prior_beta: float, *, clip: float = 0.02, l2: float = 1e-2,
                 seed: int = 0) -> None:
        cfg = PredictorConfig(kind=PredictorKind.HISTORY_PATH, prior_alpha=prior_alpha, prior_beta=prior_beta,
                              clip=clip)
        super().__init__(cfg, seed=seed)
        history_cfg = PredictorConfig(kind=PredictorKind.HISTORY, prior_alpha=prior_alpha, prior_beta=prior_beta,
                                      clip=clip)
        self.history = HistoryPredictor(history_cfg)
        self.clip = clip
        self.l2 = l2
        self.weights: np.ndarray | None = None

    @classmethod
    def from_context(cls, cfg: PredictorConfig, context: BuildContext) -> "HistoryPathPredictor":
        """``HistoryPathPredictor(cfg.prior_alpha, cfg.prior_beta, clip=cfg.clip, seed=)``."""
        return cls(cfg.prior_alpha, cfg.prior_beta, clip=cfg.clip, seed=context.seed)

    # ---- features -------------------------------------------------------------------------------------
    def _tree_features(self, tree: RolloutTree) -> tuple[np.ndarray, np.ndarray]:
        """Per node of ``tree``: the prompt evidence's posterior mean (N,) and the features (N, F)."""
        num_nodes = len(tree.nodes)
        succ_below = np.zeros(num_nodes)
        fail_below = np.zeros(num_nodes)
        has_child = np.zeros(num_nodes, dtype=bool)
        for node in tree.nodes[1:]:
            has_child[node.parent_id] = True
        for node in tree.nodes[1:]:
            if not has_child[node.node_id] and node.origin == Origin.ROLLOUT:
                reward = tree.reward_of(node)
                succ_below[node.node_id] = reward
                fail_below[node.node_id] = 1.0 - reward
        for node in reversed(tree.nodes[1:]):
            succ_below[node.parent_id] += succ_below[node.node_id]
            fail_below[node.parent_id] += fail_below[node.node_id]
        alpha, beta = self.history.posterior([tree.prompt_uid])
        counted = tree.tree_id in self.history.counted_tree_ids
        # evidence = earlier trees + this tree's root rollouts, less the rollouts below the node itself
        succ = alpha[0] + (0.0 if counted else succ_below[0]) - succ_below
        fail = beta[0] + (0.0 if counted else fail_below[0]) - fail_below
        mean = succ / (succ + fail)
        num_outcomes = succ + fail - self.history.cfg.prior_alpha - self.history.cfg.prior_beta
        z = logit(np.clip(mean, 1e-4, 1 - 1e-4))
        ups = np.zeros(num_nodes)
        downs = np.zeros(num_nodes)
        last = np.zeros(num_nodes)
        turns = np.zeros(num_nodes)
        for node in tree.nodes[1:]:
            parent = node.parent_id
            up, down = node.observation_text == OBS_UP, node.observation_text == OBS_DOWN
            ups[node.node_id] = ups[parent] + up
            downs[node.node_id] = downs[parent] + down
            last[node.node_id] = 1.0 if up else (-1.0 if down else 0.0)
            turns[node.node_id] = turns[parent] + 1
        features = np.stack([np.ones(num_nodes), z, z * np.log1p(np.maximum(num_outcomes, 0.0)), ups - downs, last,
                             turns], axis=1)
        return mean, features

    # ---- the SuccessPredictor interface ---------------------------------------------------------------
    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str],
                        root_token_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """(B,) float64 posterior means of the prompts, clipped to ``[clip, 1 - clip]``.

        Raises:
            ValueError: if ``prompts`` and ``root_texts`` differ in length.
        """
        return self.history.predict_prompts(prompts, root_texts)

    def _predict_flat(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        out = [np.zeros(0, dtype=np.float64)]
        for tree, ids in zip(trees, node_ids):
            ids = np.asarray(ids, dtype=np.int64)
            mean, features = self._tree_features(tree)
            pred = mean[ids].copy()
            turn = ids > 0
            if self.weights is not None and turn.any():
                pred[turn] = sigmoid(features[ids[turn]] @ self.weights)
            out.append(pred)
        return np.concatenate(out)

    def fit(self, trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None,
            newton_steps: int = 25) -> dict[str, float]:
        """Count the new trees' root outcomes, then refit the prefix regression on every labelled turn node.

        Args:
            trees: the sliding window of recent trees.
            root_weights: (T,) multipliers of each tree's root outcomes in the history counts
                (``HistoryPredictor.fit``); the turn regression is unweighted by them.
            newton_steps: most Newton iterations (stops early once no weight moves by 1e-8).

        Returns:
            ``predictor/fit_examples`` (turn nodes) and ``predictor/fit_loss`` (weighted log loss, nats).
        """
        self.history.fit(trees, root_weights)
        rows, labels, weights = [], [], []
        for tree in trees:
            ids = [i for i in labelled_node_ids(tree) if i > 0]
            if not ids:
                continue
            label, weight = tree.node_success_labels()
            rows.append(self._tree_features(tree)[1][ids])
            labels.append(label[ids])
            weights.append(weight[ids])
        if not rows:
            return {"predictor/fit_examples": 0.0}
        x, y, w = np.concatenate(rows), np.concatenate(labels), np.concatenate(weights)
        coef = np.zeros(self.num_features) if self.weights is None else self.weights.copy()
        penalty = np.full(self.num_features, self.l2 * w.sum())
        penalty[0] = 0.0
        for _ in range(newton_steps):
            prob = sigmoid(x @ coef)
            grad = x.T @ (w * (prob - y)) + penalty * coef
            hess = (x * (w * prob * (1.0 - prob))[:, None]).T @ x + np.diag(penalty + 1e-9)
            step = np.linalg.solve(hess, grad)
            coef -= step
            if np.max(np.abs(step)) < 1e-8:
                break
        self.weights = coef
        prob = np.clip(sigmoid(x @ coef), 1e-12, 1 - 1e-12)
        loss = -np.sum(w * (y * np.log(prob) + (1 - y) * np.log1p(-prob))) / w.sum()
        return {"predictor/fit_examples": float(y.size), "predictor/fit_loss": float(loss)}

    def state_dict(self) -> dict[str, Any]:
        """Kind, format version, seed, prior, ridge penalty, the history counts and the regression weights."""
        return {**self._base_state(), "prior_alpha": self.cfg.prior_alpha, "prior_beta": self.cfg.prior_beta,
                "l2": self.l2, "history": self.history.state_dict(),
                "weights": None if self.weights is None else [float(v) for v in self.weights]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``.

        Raises:
            ValueError: on a different kind or format version, or a prior other than this predictor's.
        """
        self._check_state(state)
        prior = (float(state["prior_alpha"]), float(state["prior_beta"]))
        if prior != (self.cfg.prior_alpha, self.cfg.prior_beta):
            raise ValueError(f"predictor state has prior (alpha, beta) = {prior}, this predictor has "
                             f"({self.cfg.prior_alpha}, {self.cfg.prior_beta}); set predictor.prior_alpha and "
                             "predictor.prior_beta to the state's values")
        self.l2 = float(state["l2"])
        self.history.load_state_dict(state["history"])
        self.weights = None if state["weights"] is None else np.asarray(state["weights"], dtype=np.float64)
