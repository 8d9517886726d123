"""The ``SuccessPredictor`` protocol and the behaviour every backend shares.

Shared: batched tree scoring through one flat call per backend, out-of-sample evaluation on the labelled
nodes, an atomic ``save``, and kind / format checks on ``load_state_dict``. Invariant: every prediction a
backend returns through ``predict_trees`` is float64 in ``[clip, 1 - clip]``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from trace.configuration.config import PredictorConfig, PredictorKind
from trace.envs.base import Prompt
from trace.predictor.calibration import brier_score, expected_calibration_error, log_loss, roc_auc
from trace.predictor.labels import node_examples
from trace.tree import RolloutTree

STATE_FORMAT_VERSION = 1

EncodeFn = Callable[[Sequence[str]], np.ndarray]


# ---- small shared helpers -----------------------------------------------------------------------------
def clip_predictions(pred: np.ndarray, clip: float) -> np.ndarray:
    """(N,) float64 ``pred`` clipped to ``[clip, 1 - clip]``."""
    return np.clip(np.asarray(pred, dtype=np.float64), clip, 1.0 - clip)


def check_node_ids(tree: RolloutTree, node_ids: Sequence[int]) -> list[int]:
    """``node_ids`` as ints.

    Raises:
        ValueError: if a node id does not exist in ``tree``.
    """
    ids = [int(i) for i in node_ids]
    for i in ids:
        if not 0 <= i < len(tree.nodes):
            raise ValueError(f"tree {tree.tree_id}: node_id {i} does not exist (the tree has {len(tree.nodes)} nodes)")
    return ids


def check_prompt_args(prompts: Sequence[Prompt], root_texts: Sequence[str]) -> None:
    """Raises:
        ValueError: if ``prompts`` and ``root_texts`` differ in length.
    """
    if len(prompts) != len(root_texts):
        raise ValueError(f"got {len(prompts)} prompts and {len(root_texts)} root texts; pass one root text "
                         "(env.reset(prompt)[1]) per prompt")


def stable_int(*parts: object) -> int:
    """A 63-bit integer hash of ``parts`` that does not depend on the process (unlike ``hash``)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def logit(p: np.ndarray) -> np.ndarray:
    """``log p - log(1 - p)`` elementwise (``+-inf`` at 1 and 0, without a warning)."""
    with np.errstate(divide="ignore"):
        return np.log(p) - np.log1p(-p)


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` elementwise, overflow-free; ``+-inf`` map to 1 and 0."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


@dataclass(frozen=True)
class BuildContext:
    """What a backend may need beyond its config section (``make_predictor``'s keyword arguments).

    Attributes:
        env: the environment (``oracle`` and ``noisy_oracle``: must know true success probabilities).
        policy: object with ``.model`` (``policy_head``).
        seed: seed of initial weights, minibatch orders and oracle noise.
        encode_fn: ``encoder`` only: texts -> (N, D) float32 embeddings replacing MiniLM.
        encoder_device: ``encoder`` only: torch device of MiniLM (``"cpu"``, ``"cuda"``).
    """

    env: Any = None
    policy: Any = None
    seed: int = 0
    encode_fn: EncodeFn | None = None
    encoder_device: str = "cpu"


# ---- the protocol -------------------------------------------------------------------------------------
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

    def fit(self, trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None) -> dict[str, float]:
        """Refit on a window of trees, each tree's root example weighted by ``root_weights`` ((T,) positive
        multipliers, ``None`` = 1; ``labels.node_examples``); returns ``predictor/*`` diagnostics."""
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


# ---- the shared base class ----------------------------------------------------------------------------
class PredictorBase:
    """Shared parts: batched tree scoring, evaluation, atomic save, kind checks on load.

    A backend sets ``kind``, implements ``_predict_flat`` (the unclipped predictions of the listed nodes of
    all trees, concatenated), ``predict_prompts``, ``fit``, ``state_dict`` and ``load_state_dict``, and
    overrides ``from_context`` when its constructor needs more than ``(cfg, seed=)``.
    """

    kind: PredictorKind

    def __init__(self, cfg: PredictorConfig, *, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = int(seed)

    @classmethod
    def from_context(cls, cfg: PredictorConfig, context: BuildContext) -> "PredictorBase":
        """Build the backend from its config section and ``make_predictor``'s arguments.

        Raises:
            ValueError: if the context lacks something the backend needs.
        """
        return cls(cfg, seed=context.seed)

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
        checked = [check_node_ids(t, ids) for t, ids in zip(trees, node_ids)]
        flat = self._predict_flat(trees, checked)
        out, start = [], 0
        for ids in checked:
            out.append(clip_predictions(flat[start:start + len(ids)], self.cfg.clip))
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
            over all labelled nodes, each node standing for its descendant leaf outcomes
            (``trace.predictor.calibration``); ``predictor/root_brier`` and ``predictor/root_auc`` over the
            roots alone; ``predictor/num_nodes`` (labelled nodes) and ``predictor/num_outcomes`` (their summed
            leaf counts). Metrics are ``nan`` when there is nothing to score (AUC also when all outcomes agree).
        """
        node_ids, labels, weights, is_root = node_examples(trees, scheme=self.cfg.labels)
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
