"""The ``allocation`` section: the step's budget, and the settings of the allocators that keep state or sample
in rounds (``allocation.reinforce_ada``, ``allocation.greso``, ``allocation.mopps``, ``allocation.vip``; the arms
of the same names, ``trace.allocation``).

Defaults are each paper's (and its public code's) where they give one; docs/method.md ("Allocators on one
budget") says where a value comes from and what the equal trajectory budget changes. This module imports
pydantic only, so the allocation rules can read their defaults without the whole config tree.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from trace.configuration.config_tasks import Section

__all__ = ["AllocationConfig", "ReinforceAdaConfig", "GresoConfig", "MoppsConfig", "VipConfig", "ORACLE_SAMPLES"]

ORACLE_SAMPLES = 16  # allocation.oracle_samples: K of the Monte-Carlo estimates, as the audit's (predictor.truth)


class ReinforceAdaConfig(Section):
    """Reinforce-Ada (arXiv 2510.04996): rounds of samples to every still-active prompt until it retires."""

    round_repeat: int = Field(8, ge=1, description="samples each active prompt gets per round")
    max_rounds: int = Field(4, ge=1, description="rounds at most per prompt")
    mode: Literal["balanced", "positive_focused"] = Field(
        "balanced", description="retire a prompt at >= n // 2 positives and n - n // 2 negatives, n = keep "
        "(balanced), or at its first positive (positive_focused)")
    positive_threshold: float = Field(0.7, description="a sample is positive when its reward is > this")
    keep: Optional[int] = Field(4, ge=2, description="n of the balanced exit (keep // 2 positives, the rest "
                                "negatives): 4, the original's script (2 + 2); None = allocation.group_size")
    initial_prompts: Optional[int] = Field(
        None, ge=1, description="prompts of round 1; None = trajectory_budget // (2 * round_repeat): round 1 spends "
        "half the budget, the later rounds the rest")


class GresoConfig(Section):
    """GRESO (arXiv 2506.02177): skip prompts whose recent groups all agreed, with a self-tuning probability."""

    p_easy: float = Field(0.5, gt=0, lt=1, description="initial base keep probability of all-correct prompts")
    p_hard: float = Field(0.5, gt=0, lt=1, description="initial base keep probability of all-wrong prompts")
    p_step: float = Field(0.01, ge=0, description="change of p_easy / p_hard per step toward the target")
    p_min: float = Field(0.05, gt=0, lt=1, description="lower clip of p_easy and p_hard")
    p_max: float = Field(0.95, gt=0, lt=1, description="upper clip of p_easy and p_hard")
    keep_floor: float = Field(0.01, ge=0, le=1, description="a prompt is kept with probability at least this")
    easy_mean: float = Field(0.98, ge=0, le=1, description="a group is all-correct when its mean reward is >= this")
    hard_mean: float = Field(0.11, ge=0, le=1, description="a group is all-wrong when its mean reward is <= this")
    target_zero_variance: float = Field(0.25, ge=0, le=1, description="wanted share of zero-variance groups")
    easy_share: float = Field(1 / 3, ge=0, le=1, description="part of that share wanted all-correct (the rest "
                              "all-wrong)")
    adapt_after_first_epoch: bool = Field(
        True, description="move p_easy / p_hard only once the candidates start their second pass over the training "
        "prompts (the original's epoch > 0); false: from the first step")

    @model_validator(mode="after")
    def _check(self) -> "GresoConfig":
        if self.p_min > self.p_max:
            raise ValueError(f"allocation.greso.p_min={self.p_min} > p_max={self.p_max}: set p_min <= p_max")
        return self


class MoppsConfig(Section):
    """MoPPS (arXiv 2507.04632): a Beta posterior of each prompt's success, Thompson-sampled toward 0.5."""

    prior_alpha: float = Field(1.0, gt=0, description="alpha_0 of the Beta prior")
    prior_beta: float = Field(1.0, gt=0, description="beta_0 of the Beta prior")
    decay: float = Field(1.0, ge=0, le=1, description="lambda: alpha <- lambda alpha + (1 - lambda) alpha_0 + s")
    target: float = Field(0.5, gt=0, lt=1, description="success rate the selection aims at: smallest (gamma - t)^2")


class VipConfig(Section):
    """VIP (arXiv 2602.01601): a Gaussian process predicts each prompt's success; n_i minimise the gradient variance."""

    gamma: float = Field(0.0007, ge=0, description="weight of the cost term b_i = gamma log p_i (RLOO form)")
    n_max: int = Field(32, ge=2, description="most rollouts of one prompt")
    n_drop: int = Field(4, ge=2, description="after flooring, prompts with fewer rollouts than this leave the batch")
    features: Literal["minilm", "hashed"] = Field(
        "minilm", description="question features: all-MiniLM-L6-v2 embeddings (the original's) or hashed word "
        "uni/bigrams (no model)")
    length_scale: float = Field(0.4, gt=0, description="RBF kernel length scale over unit-norm features (the "
                                "original's code: 0.4 in one version, 0.27 in another; benchmarks/vip_kernel.py)")
    noise: float = Field(1e-4, gt=0, description="observation noise (jitter) of the GP, logit units squared")
    prior_logit: float = Field(-5.0, description="prior mean logit of every prompt before any observation")
    embedding_dim: int = Field(256, ge=8, description="features of the hashed word uni/bigram embedding (hashed)")
    rounding: Literal["surrogate", "exact"] = Field(
        "surrogate", description="the rollouts left after flooring: by the surrogate a (n + 3) / (n + 4)^2, then "
        "counts below n_drop to the largest (the original's), or by the exact objective")
    p_clip: float = Field(1e-6, gt=0, lt=0.5,
                          description="observed rates and forecasts are clipped to [this, 1 - this]")

    @model_validator(mode="after")
    def _check(self) -> "VipConfig":
        if self.n_drop > self.n_max:
            raise ValueError(f"allocation.vip.n_drop={self.n_drop} > n_max={self.n_max}: set n_drop <= n_max")
        return self


class AllocationConfig(Section):
    """Rollout budget per step. Equal budget = equal sampled trajectories (leaves) per step."""

    trajectory_budget: int = Field(128, ge=2, description="trajectories sampled per step, roots + continuations")
    num_candidates: int = Field(32, ge=1, description="B: candidate prompts drawn per step")
    group_size: int = Field(8, ge=2, description="n of uniform baselines (grpo, pcl, tree roots)")
    m_min: int = Field(2, ge=2, description="fewest rollouts of an active prompt (m=1 has no contrast)")
    m_max: int = Field(16, ge=2, description="most rollouts of one prompt")
    knapsack_m_min: int = Field(2, ge=2, description="knapsack: the floor every candidate gets (it never skips)")
    expansion_ratio: float = Field(1.0, ge=0, description="N: continuations per root rollout (stage 2)")
    rounds: int = Field(1, ge=1, description="stage 2 rounds (paper: 1)")
    exact_max_cells: int = Field(2_000_000, ge=1, description="use the exact DP when B*M*(m_max-m_min+1) <= this")
    root_objective: Literal["groups", "leaves"] = Field(
        "groups", description="stage 1 of trace/trace_root maximises expected mixed groups sum A(p,m) (groups, "
        "the paper's) or expected root leaves in them sum m A(p,m) (leaves); docs/method.md#root-allocation")
    explore_groups: int = Field(
        0, ge=0, description="trace, trace_root, pcl: groups of group_size bare rollouts given each step to candidates "
        "drawn uniformly before stage 1, inside the budget, so the predictor also learns from prompts stage 1 passes "
        "over; docs/method.md#exploration-groups")
    dapo_max_retries: int = Field(4, ge=0, description="dapo: extra sampling rounds before giving up")
    treepo_width: int = Field(2, ge=1, description="treepo: branches added at each turn depth")
    oracle_samples: int = Field(ORACLE_SAMPLES, ge=1, description="trace_oracle: fresh rollouts per candidate prompt "
                                "and prefix whose mean reward it allocates on (outside the budget, never trained on)")
    reinforce_ada: ReinforceAdaConfig = Field(default_factory=ReinforceAdaConfig,
                                              description="reinforce_ada: rounds per prompt until it retires")
    greso: GresoConfig = Field(default_factory=GresoConfig, description="greso: probabilistic skips of agreed prompts")
    mopps: MoppsConfig = Field(default_factory=MoppsConfig, description="mopps: Beta posterior, Thompson sampling")
    vip: VipConfig = Field(default_factory=VipConfig, description="vip: GP success forecast, variance-optimal n_i")

    @model_validator(mode="after")
    def _check(self) -> "AllocationConfig":
        if self.m_max < self.m_min:
            raise ValueError(f"allocation.m_max={self.m_max} < m_min={self.m_min}: set m_max >= m_min")
        if self.m_max < self.knapsack_m_min:
            raise ValueError(f"allocation.m_max={self.m_max} < knapsack_m_min={self.knapsack_m_min}: "
                             "set m_max >= knapsack_m_min")
        if self.explore_groups >= self.num_candidates:
            raise ValueError(f"allocation.explore_groups={self.explore_groups} leaves no candidate to stage 1 of "
                             f"num_candidates={self.num_candidates}: lower explore_groups")
        if self.root_budget < self.m_min:
            raise ValueError(
                f"allocation.trajectory_budget={self.trajectory_budget} with expansion_ratio="
                f"{self.expansion_ratio} leaves a root budget {self.root_budget} < m_min={self.m_min}: "
                "raise trajectory_budget or lower expansion_ratio")
        return self

    @property
    def root_budget(self) -> int:
        """M for ablations with prefix expansion: ``round(T / (1 + N))``; the rest is stage 2's."""
        return int(round(self.trajectory_budget / (1.0 + self.expansion_ratio)))
