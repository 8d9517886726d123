"""VIP as a root rule: a Gaussian process forecasts each prompt's success; rollouts go where they cut gradient variance.

Batch. VIP reallocates a given batch of prompts: here ``grpo``'s, the first ``R // n`` candidates (16 of the
default 32; at least ``ceil(R / n_max)``, so that the batch can hold the budget), so it spends ``n`` per prompt on
average, as the original (budget = batch x ``rollout.n``).

Forecast. Each prompt is embedded as its question's hashed word uni- and bigrams (``embed_prompts``:
scikit-learn's ``HashingVectorizer``, ``allocation.vip.embedding_dim`` features, unit norm: an offline text
feature in place of the original's ``all-MiniLM-L6-v2`` sentence embedding). A Gaussian process with an RBF
kernel (``length_scale`` 0.27 over Euclidean distances of unit vectors) and jitter (``noise``) is fitted on the
previous step's prompts only, target the logit of each prompt's observed success rate (clipped to
``[p_clip, 1 - p_clip]``), around a prior mean carried over from step to step: a prompt's last forecast where
it has one, else ``prior_logit`` (-5). The forecast ``p_i = sigmoid(mu_i)``, ``mu_i`` the posterior mean.

Allocation (``vip_counts``). Equal forecasts (the first step) split the budget evenly. Otherwise, with
``a_i = p_i (1 - p_i)`` and ``b_i = gamma log p_i`` (``gamma`` 0.0007), the counts minimise

    sum_i a_i / (n_i - 1) + b_i n_i    subject to  sum_i n_i = R,  1 <= n_i <= n_max

(the RLOO gradient-variance form; ``n_max`` 32). The continuous optimum ``n_i = 1 + sqrt(a_i / (b_i + lambda))``,
clipped, with ``lambda`` found by bisection so the sum is ``R`` (the original solves the same problem with
SciPy's SLSQP); then each ``n_i`` is floored, prompts below ``n_drop`` (4) leave the batch (0), and the remaining
rollouts go one at a time where this objective falls most (the original ranks by the surrogate
``a (n + 3) / (n + 4)^2``; a prompt that left may come back at ``n_drop`` when every kept one is at ``n_max``).
Exactly ``R`` per step. As in the public code, ``b_i = gamma log p_i <= 0`` lowers the cost of more rollouts
most for the prompts forecast hardest.

References:
    Nguyen et al., "Adaptive Rollout Allocation for Online Reinforcement Learning with Verifiable Rewards" (VIP,
    arXiv 2602.01601, ICLR 2026), the GP forecast of prompt
    success over embeddings and the variance-minimising allocation with its rounding; public code
    HieuNT91/VIP (``src/vip/allocation/bernoulli_allocation.py``, ``gaussian_process.py`` of its earlier commits;
    the released repository holds a README only).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from trace.allocation.registry import RootDecision, RootRequest, register_root_rule

__all__ = ["VipState", "embed_prompts", "vip_counts", "vip_root_rule"]

def _settings(config):
    from trace.configuration.config_allocators import VipConfig

    return getattr(config, "vip", None) or VipConfig()


def embed_prompts(texts: Sequence[str], dim: int) -> np.ndarray:
    """Each text as unit-norm hashed counts of its word uni- and bigrams (no fitting, no download).

    Args:
        texts: N question texts.
        dim: features (``allocation.vip.embedding_dim``).

    Returns:
        (N, dim) float64, each row of norm 1 (0 for a text without a word).
    """
    from sklearn.feature_extraction.text import HashingVectorizer

    # one-character tokens (digits, variables) count: questions that differ in one digit differ
    vectorizer = HashingVectorizer(n_features=dim, ngram_range=(1, 2), alternate_sign=False, norm="l2",
                                   token_pattern=r"(?u)\b\w+\b")
    return vectorizer.transform(list(texts)).toarray().astype(np.float64)


def _cost(a: np.ndarray, b: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per prompt ``a / (n - 1) + b n`` (``inf`` at ``n = 1`` with ``a > 0``; 0 for a prompt out of the batch)."""
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(n > 1, a / (n - 1), np.where(a > 0, np.inf, 0.0)) + b * n
    return np.where(n > 0, out, 0.0)


def vip_counts(pred_success_prob: np.ndarray, budget: int, *, gamma: float, n_max: int, n_drop: int,
               p_clip: float = 1e-6) -> np.ndarray:
    """VIP's rollouts per prompt: the continuous optimum, floored, small ones dropped, then greedy by gain.

    Args:
        pred_success_prob: (B,) float64 forecast ``p_i`` (clipped to ``[p_clip, 1 - p_clip]``).
        budget: R trajectories (>= 0).
        gamma: weight of ``b_i = gamma log p_i`` (>= 0).
        n_max: most rollouts of one prompt (>= 2).
        n_drop: floored counts below this become 0 (>= 2).
        p_clip: the forecast's clip.

    Returns:
        (B,) int64 counts summing to ``budget``, each 0 or in ``[min(n_drop, budget), n_max]``, with two
        exceptions: equal forecasts split the budget evenly (counts may then lie below ``n_drop``), and when
        every kept prompt is at ``n_max`` and none can give up rollouts to make room, the last prompt brought
        back holds what is left.

    Raises:
        ValueError: ``B * n_max < budget`` (the budget does not fit), ``n_drop > n_max``, or a forecast that is not
            finite.

    References:
        VIP (arXiv 2602.01601): ``min sum_i a_i / (n_i - 1) + b_i n_i``, ``a_i = p_i (1 - p_i)``,
        ``b_i = gamma log p_i``, and its rounding.
    """
    p = np.asarray(pred_success_prob, dtype=np.float64)
    if not np.all(np.isfinite(p)):
        raise ValueError("vip needs a finite forecast for every candidate")
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

    def continuous(lam: float) -> np.ndarray:
        return np.clip(1 + np.sqrt(a / np.maximum(b + lam, 1e-300)), 1, n_max)

    lo, hi = -float(b.min()), 1.0
    while continuous(hi).sum() > budget and hi < 1e12:  # more candidates than rollouts: all near 1
        hi *= 2
    for _ in range(200):  # sum_i n_i(lambda) falls as lambda grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if continuous(mid).sum() > budget else (lo, mid)
    counts = np.floor(continuous(hi)).astype(np.int64)
    floor_drop = min(n_drop, budget)
    counts[counts < floor_drop] = 0
    while counts.sum() > budget:  # more candidates than rollouts: the smallest kept prompt leaves (then least a)
        kept = np.flatnonzero(counts)
        counts[kept[np.lexsort((a[kept], counts[kept]))[0]]] = 0
    left = budget - int(counts.sum())
    while left > 0:
        raise_gain = np.where((counts >= 1) & (counts < n_max), _cost(a, b, counts) - _cost(a, b, counts + 1), -np.inf)
        if np.isfinite(raise_gain).any():
            counts[int(np.argmax(raise_gain))] += 1
            left -= 1
            continue
        # every kept prompt is at n_max: bring back the out-of-batch prompt whose entry costs least per rollout,
        # at floor_drop, making room by lowering kept prompts (never below floor_drop) where that costs least
        out = np.flatnonzero(counts == 0)
        j = out[int(np.argmin(_cost(a[out], b[out], np.full(out.size, floor_drop)) / floor_drop))]
        while left < floor_drop:
            lower_loss = np.where(counts > floor_drop, _cost(a, b, counts - 1) - _cost(a, b, counts), np.inf)
            if not np.isfinite(lower_loss).any():
                break
            counts[int(np.argmin(lower_loss))] -= 1
            left += 1
        counts[j] = min(floor_drop, left)  # below floor_drop only when no kept prompt could make room
        left -= counts[j]
    return counts


class VipState:
    """The previous step's observations and the carried-over prior means (``AllocatorState``).

    Args:
        config: the allocation section (its ``vip`` settings) or None for the defaults.
    """

    def __init__(self, config=None) -> None:
        self.settings = _settings(config)
        self.prior_logit: dict[str, float] = {}  # prompt id -> its last forecast (logit)
        self.last: list[tuple[str, str, float]] = []  # (prompt id, question, observed logit) of the last step

    def forecast(self, prompt_uids: Sequence[str], prompt_texts: Sequence[str]) -> np.ndarray:
        """(B,) float64 forecast logit of each candidate: the GP's posterior mean (the prior where nothing is
        observed yet), recorded as the prompt's prior for later steps."""
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, WhiteKernel

        s = self.settings
        observed = np.array([y for _, _, y in self.last], dtype=np.float64)
        default = float(s.prior_logit)
        prior = np.array([self.prior_logit.get(u, default) for u in prompt_uids], dtype=np.float64)
        if observed.size:
            x_obs = embed_prompts([t for _, t, _ in self.last], s.embedding_dim)
            m_obs = np.array([self.prior_logit.get(u, default) for u, _, _ in self.last], dtype=np.float64)
            gp = GaussianProcessRegressor(RBF(s.length_scale, "fixed") + WhiteKernel(s.noise, "fixed"),
                                          optimizer=None, normalize_y=False)
            gp.fit(x_obs, observed - m_obs)
            mu = prior + gp.predict(embed_prompts(prompt_texts, s.embedding_dim))
        else:
            mu = prior
        for uid, m in zip(prompt_uids, mu):
            self.prior_logit[uid] = float(m)
        return mu

    def observe(self, prompt_uids: Sequence[str], rewards: Sequence[np.ndarray],
                prompt_texts: Sequence[str]) -> dict[str, float]:
        """Keep this step's per-prompt success rates (as clipped logits) for the next forecast; returns
        ``vip/forecast_brier``, the squared error of the forecasts against these rates."""
        clip = self.settings.p_clip
        self.last = []
        errors = []
        for uid, r, text in zip(prompt_uids, rewards, prompt_texts):
            rate = min(max(float(np.mean(r)) if np.size(r) else 0.5, clip), 1 - clip)
            self.last.append((uid, text, float(np.log(rate / (1 - rate)))))
            if uid in self.prior_logit:
                errors.append((1 / (1 + np.exp(-self.prior_logit[uid])) - float(np.mean(r))) ** 2)
        return {"vip/forecast_brier": float(np.mean(errors)) if errors else float("nan")}

    def state_dict(self) -> dict:
        return {"prior_logit": dict(self.prior_logit), "last": [list(row) for row in self.last]}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()``'s output; a dict without its keys raises ``KeyError``."""
        self.prior_logit = {str(k): float(v) for k, v in state["prior_logit"].items()}
        self.last = [(str(u), str(t), float(y)) for u, t, y in state["last"]]


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
                                p_clip=s.p_clip)
    return RootDecision(counts, info={"method": "vip"},
                        metrics={"vip/mean_forecast": float(p.mean()),
                                 "vip/active_prompts": float(np.count_nonzero(counts))})
