"""The predictor registry: one backend class per ``PredictorKind``, built and loaded by kind.

Invariant: ``make_predictor`` builds exactly the class registered for ``cfg.kind``; an unknown or
unregistered kind raises with the list of registered kinds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace.configuration.config import PredictorConfig, PredictorKind
from trace.predictor.base import BuildContext, EncodeFn, PredictorBase, SuccessPredictor
from trace.predictor.encoder import EncoderPredictor
from trace.predictor.history import HistoryPredictor
from trace.predictor.history_path import HistoryPathPredictor
from trace.predictor.oracle import NoisyOraclePredictor, OraclePredictor
from trace.predictor.policy_head import PolicyHeadPredictor

PREDICTORS: dict[PredictorKind, type[PredictorBase]] = {}


def register_predictor(kind: PredictorKind, cls: type[PredictorBase]) -> type[PredictorBase]:
    """Register ``cls`` as the backend of ``kind`` (``make_predictor`` calls ``cls.from_context``).

    Args:
        kind: the ``predictor.kind`` value it implements.
        cls: a ``PredictorBase`` subclass whose ``kind`` is ``kind``.

    Returns:
        ``cls``.

    Raises:
        ValueError: if ``cls.kind`` differs from ``kind`` or ``kind`` already has a different backend.
    """
    kind = PredictorKind(kind)
    if getattr(cls, "kind", None) != kind:
        raise ValueError(f"{cls.__name__}.kind is {getattr(cls, 'kind', None)!r}, not {kind.value!r}; set the class's "
                         "kind to the kind it is registered under")
    if PREDICTORS.get(kind, cls) is not cls:
        raise ValueError(f"predictor.kind {kind.value!r} is already implemented by {PREDICTORS[kind].__name__}")
    PREDICTORS[kind] = cls
    return cls


for _cls in (EncoderPredictor, HistoryPredictor, PolicyHeadPredictor, OraclePredictor, NoisyOraclePredictor,
             HistoryPathPredictor):
    register_predictor(_cls.kind, _cls)


def registered_kinds() -> list[str]:
    """The ``predictor.kind`` values that have a backend, in registration order."""
    return [k.value for k in PREDICTORS]


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
    try:
        kind = PredictorKind(cfg.kind)
    except ValueError:
        raise ValueError(f"unknown predictor.kind {cfg.kind!r}; valid kinds: {registered_kinds()}") from None
    if kind not in PREDICTORS:
        raise ValueError(f"predictor.kind {kind.value!r} has no implementation; valid kinds: {registered_kinds()}")
    context = BuildContext(env=env, policy=policy, seed=seed, encode_fn=encode_fn, encoder_device=encoder_device)
    return PREDICTORS[kind].from_context(cfg, context)


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
