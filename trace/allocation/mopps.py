"""MoPPS as a root rule: a Beta posterior of each prompt's success, Thompson-sampled toward a success rate of 0.5.

Each prompt ``i`` carries ``Beta(alpha_i, beta_i)``, prior ``Beta(alpha_0, beta_0)`` = ``Beta(1, 1)``. After a step
in which it received ``k`` rollouts with ``s`` successes (the sum of its leaf rewards in [0, 1]):

    alpha_i <- lambda alpha_i + (1 - lambda) alpha_0 + s,    beta_i <- lambda beta_i + (1 - lambda) beta_0 + (k - s)

(``lambda`` = ``allocation.mopps.decay``; 1 keeps every observation, smaller forgets toward the prior). At a
step, each candidate draws ``gamma_i ~ Beta(alpha_i, beta_i)`` (stream ``rng_for("mopps")``) and the
``R // n`` candidates with the smallest ``(gamma_i - 0.5)^2`` get ``n`` rollouts each, as ``grpo`` spreads
``R`` (``uniform_root_counts``): exactly the step's budget. The original draws ``ts_ratio x B`` candidates
for ``B`` groups; here the candidates are ``allocation.num_candidates`` and the groups ``T // n``, so the
ratio is ``num_candidates / (T // n)`` (2 by default).

References:
    Qu et al., "Can Prompt Difficulty be Online Predicted for Accelerating RL Finetuning of Reasoning
    Models?" (MoPPS, arXiv 2507.04632), Sec. 3 (the posterior update with decay, Thompson sampling, the
    selection by distance to a target success rate); public code thu-rllab/MoPPS.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from trace.allocation.registry import RootDecision, RootRequest, register_root_rule
from trace.allocation.root import uniform_root_counts

__all__ = ["MoppsState", "mopps_root_rule"]


def _settings(config):
    from trace.configuration.config_allocators import MoppsConfig

    return getattr(config, "mopps", None) or MoppsConfig()


class MoppsState:
    """The Beta posteriors of every prompt seen, by prompt id (``AllocatorState``).

    Args:
        config: the allocation section (its ``mopps`` settings) or None for the defaults.
    """

    def __init__(self, config=None) -> None:
        self.settings = _settings(config)
        self.alpha: dict[str, float] = {}
        self.beta: dict[str, float] = {}

    def posterior(self, prompt_uids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(B,) float64 ``alpha`` and ``beta`` of each prompt; the prior for prompts never observed."""
        s = self.settings
        return (np.array([self.alpha.get(u, s.prior_alpha) for u in prompt_uids], dtype=np.float64),
                np.array([self.beta.get(u, s.prior_beta) for u in prompt_uids], dtype=np.float64))

    def observe(self, prompt_uids: Sequence[str], rewards: Sequence[np.ndarray],
                prompt_texts: Sequence[str] = ()) -> dict[str, float]:
        """The decayed Beta update of every prompt sampled this step (``s`` = sum of its leaf rewards).

        Raises:
            ValueError: a reward outside [0, 1] (the posterior counts successes).
        """
        s = self.settings
        lam = s.decay
        for uid, r in zip(prompt_uids, rewards):
            r = np.asarray(r, dtype=np.float64)
            if r.size and (r.min() < 0 or r.max() > 1):
                raise ValueError(f"mopps counts successes: prompt {uid!r} has rewards outside [0, 1] "
                                 f"({r.min()}..{r.max()}); use a task whose reward lies in [0, 1]")
            a, b = self.alpha.get(uid, s.prior_alpha), self.beta.get(uid, s.prior_beta)
            succ = float(r.sum())
            self.alpha[uid] = lam * a + (1 - lam) * s.prior_alpha + succ
            self.beta[uid] = lam * b + (1 - lam) * s.prior_beta + (r.size - succ)
        return {"mopps/known_prompts": float(len(self.alpha))}

    def state_dict(self) -> dict:
        return {"alpha": dict(self.alpha), "beta": dict(self.beta)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()``'s output; a dict without its keys raises ``KeyError``."""
        self.alpha = {str(k): float(v) for k, v in state["alpha"].items()}
        self.beta = {str(k): float(v) for k, v in state["beta"].items()}


@register_root_rule("mopps", make_state=MoppsState)
def mopps_root_rule(request: RootRequest) -> RootDecision:
    """MoPPS: ``n`` rollouts to each of the ``R // n`` candidates whose Thompson draw lies nearest the target.

    Returns:
        ``RootDecision`` with ``counts`` (B,) int64 summing to ``R``; metrics ``mopps/selected_posterior_mean``
        (mean of ``alpha / (alpha + beta)`` over the chosen prompts) and ``mopps/selected_seen`` (share of them
        observed before).

    Raises:
        ValueError: no ``state``, ``prompt_uids`` or ``rng_for`` (the rule samples from per-prompt posteriors).
    """
    if request.state is None or request.prompt_uids is None or request.rng_for is None:
        raise ValueError("the mopps arm samples from per-prompt posteriors: call trace.allocation.step.allocate_step "
                         "with state=make_allocator_state(arm) and the candidates' prompt ids")
    state: MoppsState = request.state
    alpha, beta = state.posterior(request.prompt_uids)
    gamma = request.rng_for("mopps").beta(alpha, beta)
    order = np.lexsort((np.arange(request.num_candidates), (gamma - state.settings.target) ** 2))
    counts = uniform_root_counts(request.num_candidates, request.root_budget, request.group_size, order)
    chosen = np.flatnonzero(counts)
    seen = np.array([u in state.alpha for u in request.prompt_uids])
    return RootDecision(counts, info={"method": "thompson"},
                        metrics={"mopps/selected_posterior_mean": float(np.mean(alpha[chosen] / (alpha[chosen] +
                                                                                                beta[chosen]))),
                                 "mopps/selected_seen": float(seen[chosen].mean())})
