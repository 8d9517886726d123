"""The success predictor's params: ``predictor`` of ``params.yaml``, with its ground-truth audit ``predictor.truth``.

Part of the typed configuration (``trace.configuration.config`` re-exports every class); split out so each file
stays one screen of concerns. Every field has a one-line doc. The audit is off by default (``every: 0``): a run
without the key trains, logs and hashes as before (``Config.params_hash`` leaves the section out while it is off).
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, model_validator

from trace.configuration.config_tasks import Section


class PredictorKind(str, Enum):
    """Success-predictor backends (``predictor.kind``; ``trace.predictor.registry``)."""

    ENCODER = "encoder"  # frozen sentence encoder + small head
    HISTORY = "history"  # per-prompt Beta-Bernoulli posterior (roots only)
    POLICY_HEAD = "policy_head"  # small head on the policy's last hidden state
    ORACLE = "oracle"  # true probabilities from environments that know them
    NOISY_ORACLE = "noisy_oracle"  # oracle plus logit noise (benchmarks)
    HISTORY_PATH = "history_path"  # prompt history + simulator observations along the prefix (benchmarks)


LabelScheme = Literal["subtree", "branch_point"]  # predictor.labels (trace.predictor.labels)


class TruthConfig(Section):
    """Monte-Carlo truth for the predictor on an unselected sample (docs/method.md#ground-truth-audit).

    Every ``every`` steps, ``roots`` candidate prompts and ``prefixes`` visited prefixes, drawn uniformly, get
    ``samples`` fresh continuations each; the predictor's forecasts are scored against them (``truth/*``).
    The audit's rollouts never train and are not in the arm's budget (``trace.predictor.ground_truth``).
    """

    every: int = Field(0, ge=0, description="audit at steps with (step + 1) % every == 0; 0 = off")
    roots: int = Field(16, ge=0, description="candidate prompts drawn uniformly per audit")
    prefixes: int = Field(32, ge=0, description="visited non-terminal prefixes drawn uniformly per audit")
    samples: int = Field(16, ge=2, description="fresh continuations per root and prefix (K; std error "
                         "sqrt(p(1-p)/K))")

    @model_validator(mode="after")
    def _something_to_audit(self) -> "TruthConfig":
        if self.every > 0 and self.roots == 0 and self.prefixes == 0:
            raise ValueError(f"predictor.truth.every={self.every} audits, but predictor.truth.roots and "
                             "predictor.truth.prefixes are both 0: set one of them > 0, or every: 0 to turn the "
                             "audit off")
        return self


class PredictorConfig(Section):
    """The success predictor ``V_hat(H)`` and how it is refitted and audited (docs/method.md#success-predictor)."""

    kind: PredictorKind = Field(PredictorKind.ENCODER, description="success-probability predictor")
    window_steps: int = Field(8, ge=1, description="refit on the trees of the last N steps")
    epochs: int = Field(20, ge=1, description="head training epochs per fit")
    lr: float = Field(3e-3, gt=0, description="head learning rate")
    hidden_size: int = Field(64, ge=1, description="head hidden width")
    max_text_chars: int = Field(1000, ge=16, description="prefix text kept for the encoder (tail)")
    prior_alpha: float = Field(1.0, gt=0, description="history predictor Beta prior successes")
    prior_beta: float = Field(1.0, gt=0, description="history predictor Beta prior failures")
    noise_std: float = Field(0.5, ge=0, description="noisy_oracle: std of logit noise")
    clip: float = Field(0.02, ge=0, lt=0.5, description="predictions clipped to [clip, 1 - clip]")
    truth: TruthConfig = Field(TruthConfig(), description="Monte-Carlo truth audit of the forecasts; every: 0 = off")
    recalibrate: bool = Field(False, description="the allocator reads the forecasts recalibrated online against the "
                              "window's outcomes (trace.training.recalibration); false = the predictor's own")
    recalibrate_window: int = Field(8, ge=1, description="predictor.recalibrate: fit the map on the last N steps")
    recalibrate_map: Literal["platt", "isotonic"] = Field(
        "platt", description="predictor.recalibrate: platt (logistic in the logits) or isotonic (monotone, knots "
        "every 0.1); trace.training.recalibration")
    recalibrate_roots: Literal["window", "explore"] = Field(
        "window", description="predictor.recalibrate: fit the root map on every root group of the window (window), or "
        "on its exploration groups alone (explore: drawn uniformly, so not selected on the forecast; needs "
        "allocation.explore_groups > 0)")
    explore_weight: Literal["balanced"] | float = Field(
        1.0, description="weight of an exploration group's root in the predictor's fit, against 1 for a root stage "
        "1 chose: a number > 0, or balanced = (candidates stage 1 passed over) / (exploration groups) per step, "
        "trace.training.exploration_weights; needs allocation.explore_groups > 0 where not 1")
    labels: LabelScheme = Field(
        "subtree", description="what a node's label counts: subtree = every leaf below it; branch_point = the "
        "trajectories sampled at or above it, so a continuation counts for its anchor and the nodes below, not for "
        "the anchor's ancestors (trace.predictor.labels)")

    @model_validator(mode="after")
    def _check_explore_weight(self) -> "PredictorConfig":
        """``explore_weight`` is ``balanced`` or a finite number > 0."""
        w = self.explore_weight
        if w != "balanced" and not (isinstance(w, (int, float)) and 0 < w < float("inf")):
            raise ValueError(f"predictor.explore_weight={w!r} must be a finite number > 0 or 'balanced'")
        return self
