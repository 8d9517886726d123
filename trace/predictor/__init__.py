"""Success-probability predictors ``V_hat(H)``: fit on rollout trees, score prompts and turn prefixes.

One shared model scores roots (prompts, ``H_0 = x``) and turn prefixes (``H_t``) alike, from the prompt
text and the turns so far (TRACE, arXiv 2606.11119, section "shared generalizable predictor";
docs/method.md#success-predictor). Stage 1 reads ``V_hat(x_i)`` to allocate root rollouts and stage 2 reads
``V_hat(H_ijt)`` to allocate continuations.

Labels. Every labelled node of a collected tree carries the mean reward of its descendant leaves, weighted
by their count (``RolloutTree.node_success_labels``), or with ``predictor.labels: branch_point`` of the
trajectories sampled at or above it (``labels.branch_point_labels``). Nodes used for fitting and scoring
(``labelled_node_ids``): the root and every non-leaf turn with at least one descendant leaf. Leaves are
left out: a leaf's label is its own verified reward and no allocator ever scores a finished trajectory.

Metrics. A node with label ``y`` and weight ``w`` stands for its ``w`` descendant leaf outcomes at one
prediction ``p``: ``w * y`` successes and ``w * (1 - y)`` failures (fractional when rewards are). Brier score,
log loss, ECE and AUC are all computed on those expanded outcomes, so a root with 8 rollouts counts 8 times
and a one-leaf prefix once. The expanded Brier score equals ``(p - y)^2 + y (1 - y)`` per node: the label
Brier plus the irreducible spread of the node's own outcomes.

Backends (``make_predictor`` picks one by ``PredictorConfig.kind``):
- ``EncoderPredictor`` (``encoder``): frozen all-MiniLM-L6-v2 sentence embeddings of the prefix text and a
  small MLP head trained with weighted binary cross-entropy. Embeddings are cached by text.
- ``HistoryPredictor`` (``history``): per-prompt Beta-Bernoulli posterior of past root-rollout rewards
  (Knapsack-RL, arXiv 2509.25849; GRESO, arXiv 2506.02177); roots only, every prefix of a prompt gets the
  prompt's posterior mean.
- ``PolicyHeadPredictor`` (``policy_head``): the same MLP head on the policy's own last hidden state at the
  end of the prefix.
- ``OraclePredictor`` (``oracle``) and ``NoisyOraclePredictor`` (``noisy_oracle``): the true ``V(H)`` of
  environments that know it (the simulator), optionally with logit noise, for benchmarks.
- ``HistoryPathPredictor`` (``history_path``): for the simulator, the prompt's Beta-Bernoulli posterior at
  roots and a logistic regression on the prompt's evidence and the path's observations at turn prefixes,
  without reading true probabilities (benchmarks).

Modules: ``base`` (protocol, shared base class), ``labels`` (labelled nodes), ``calibration`` (scores),
``head`` (the MLP head), one module per backend, ``registry`` (``make_predictor`` / ``load_predictor``) and
``fitting`` (the warm-start fit with a held-out score).

Invariants: every prediction is float64 in ``[clip, 1 - clip]``; predictions are a deterministic function of
the seed, the trees fitted so far (in order) and the inputs; ``state_dict`` / ``load_state_dict`` restore a
predictor to give identical predictions.

Simplifications: the encoder and the policy head restart their optimiser at every fit but keep the head's
weights (warm start on the sliding window); the history predictor never forgets old evidence; a
policy-head feature is taken once per node, under the policy of the step that first scores it (as a rollout
would see it), and reused by later refits while its tree stays in the sliding window.
"""

from trace.predictor.base import STATE_FORMAT_VERSION, BuildContext, EncodeFn, PredictorBase, SuccessPredictor
from trace.predictor.calibration import (
    LOG_LOSS_EPS,
    NUM_ECE_BINS,
    brier_score,
    expected_calibration_error,
    log_loss,
    roc_auc,
)
from trace.predictor.encoder import ELISION, EncoderPredictor, MiniLMEncoder, encoder_text
from trace.predictor.fitting import fit_with_holdout, holdout_split
from trace.predictor.head import HEAD_BATCH_SIZE, HeadPredictorBase
from trace.predictor.history import HistoryPredictor
from trace.predictor.history_path import HistoryPathPredictor, empirical_bayes_prior
from trace.predictor.labels import labelled_node_ids, node_examples
from trace.predictor.oracle import NoisyOraclePredictor, OraclePredictor
from trace.predictor.policy_head import PolicyHeadPredictor, last_hidden_states
from trace.predictor.registry import PREDICTORS, load_predictor, make_predictor, register_predictor, registered_kinds

__all__ = [
    "STATE_FORMAT_VERSION", "BuildContext", "EncodeFn", "PredictorBase", "SuccessPredictor",
    "LOG_LOSS_EPS", "NUM_ECE_BINS", "brier_score", "expected_calibration_error", "log_loss", "roc_auc",
    "ELISION", "EncoderPredictor", "MiniLMEncoder", "encoder_text",
    "fit_with_holdout", "holdout_split",
    "HEAD_BATCH_SIZE", "HeadPredictorBase",
    "HistoryPredictor",
    "HistoryPathPredictor", "empirical_bayes_prior",
    "labelled_node_ids", "node_examples",
    "NoisyOraclePredictor", "OraclePredictor",
    "PolicyHeadPredictor", "last_hidden_states",
    "PREDICTORS", "load_predictor", "make_predictor", "register_predictor", "registered_kinds",
]
