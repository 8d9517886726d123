"""The ``encoder`` backend: frozen all-MiniLM-L6-v2 sentence embeddings of the prefix text and an MLP head.

A prompt and its tree's root are scored from the same text, so they get the same prediction; embeddings are
cached by text and never part of the state.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from trace.configuration.config import PredictorConfig, PredictorKind
from trace.envs.base import Prompt
from trace.predictor.base import BuildContext, EncodeFn, check_prompt_args, clip_predictions
from trace.predictor.head import HeadPredictorBase
from trace.sentence_encoder import ELISION, MiniLMEncoder
from trace.tree import RolloutTree



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



class EncoderPredictor(HeadPredictorBase):
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

    @classmethod
    def from_context(cls, cfg: PredictorConfig, context: BuildContext) -> "EncoderPredictor":
        """``EncoderPredictor(cfg, seed=, encode_fn=, device=encoder_device)`` from ``make_predictor``'s arguments."""
        return cls(cfg, seed=context.seed, encode_fn=context.encode_fn, device=context.encoder_device)

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
        check_prompt_args(prompts, root_texts)
        texts = [encoder_text(t, t, self.cfg.max_text_chars) for t in root_texts]
        return clip_predictions(self._predict_features(self.embed(texts)), self.cfg.clip)
