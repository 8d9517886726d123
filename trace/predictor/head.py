"""The small MLP head shared by the ``encoder`` and ``policy_head`` backends, and its training.

The head maps a per-prefix feature vector to a logit of success and is trained with weighted binary
cross-entropy on the labelled nodes (label: mean descendant-leaf reward, weight: leaf count). Invariant:
training and prediction are deterministic functions of the seed, the number of earlier fits and the
features; torch is imported only inside the functions that run it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from trace.configuration.config import PredictorConfig
from trace.predictor.base import PredictorBase, stable_int
from trace.predictor.labels import node_examples
from trace.tree import RolloutTree

if TYPE_CHECKING:  # torch is imported where the head runs, never at module import
    import torch

HEAD_BATCH_SIZE = 256  # examples per head training step


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


class HeadPredictorBase(PredictorBase):
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

    def fit(self, trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None) -> dict[str, float]:
        """Train the head on the labelled nodes of ``trees`` for ``cfg.epochs`` epochs at ``cfg.lr``.

        The head keeps its weights from the previous fit (warm start); the optimiser and the minibatch order
        are fresh, seeded by ``(seed, number of earlier fits)``.

        Args:
            trees: the sliding window of recent trees.
            root_weights: (T,) multipliers of each tree's root example weight (``node_examples``); ``None`` = 1.

        Returns:
            ``predictor/fit_loss`` (weighted cross-entropy after training, nats; ``nan`` with no examples),
            ``predictor/fit_examples``, ``predictor/fit_outcomes``, ``predictor/feature_seconds``,
            ``predictor/fit_seconds``.
        """
        node_ids, labels, weights, _ = node_examples(trees, root_weights, self.cfg.labels)
        out = {"predictor/fit_examples": float(labels.size), "predictor/fit_outcomes": float(weights.sum())}
        if labels.size == 0:
            return {**out, "predictor/fit_loss": float("nan"), "predictor/feature_seconds": 0.0,
                    "predictor/fit_seconds": 0.0}
        t0 = time.perf_counter()
        features = self._features(trees, node_ids)
        t1 = time.perf_counter()
        head = self._ensure_head(features.shape[1])
        loss = _train_head(head, features, labels, weights, epochs=self.cfg.epochs, lr=self.cfg.lr,
                           seed=stable_int(self.seed, "fit", self.num_fits))
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
