"""Word-level tokenizer for the tiny default policy.

The synthetic tasks speak in whitespace-separated words (``search [ e17 ] Observation:``), so the tiny policy
uses one token per word: a ``tokenizers`` ``WordLevel`` model behind a ``WhitespaceSplit`` pre-tokenizer,
wrapped in a ``PreTrainedTokenizerFast`` so it saves, loads and decodes like any Hugging Face tokenizer.

Invariants kept here:
- ids 0..3 are the special tokens ``[PAD]``, ``[BOS]``, ``[EOS]``, ``[UNK]``; vocabulary words follow in the
  order given (first occurrence wins), so the same vocabulary always gives the same ids.
- Encoding adds no special tokens by itself (no post-processor): ``trace.policy.format`` places ``[BOS]`` and
  ``[EOS]`` explicitly, so per-turn token ids concatenate to the ids of the whole conversation.
- ``padding_side="left"`` is passed to the constructor (with tokenizers 0.23 / transformers 5.24, setting it afterwards is not saved by ``save_pretrained``).
"""

from __future__ import annotations

from typing import Sequence

PAD_TOKEN = "[PAD]"
BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
UNK_TOKEN = "[UNK]"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def build_word_tokenizer(vocabulary: Sequence[str]):
    """Build a word-level tokenizer over ``vocabulary``.

    Args:
        vocabulary: the task's words (e.g. ``env.vocabulary()``), each non-empty and free of whitespace.
            Duplicates are ignored (first occurrence keeps its id). Words equal to a special token are
            ignored too.

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with ``pad/bos/eos/unk`` set, ``padding_side="left"``,
        ``clean_up_tokenization_spaces=False`` (decode joins words with single spaces, nothing else), and
        ``len(tokenizer) == 4 + number of distinct words``. Unknown words encode to ``[UNK]`` (id 3).

    Raises:
        ValueError: if ``vocabulary`` is empty, or a word is empty or contains whitespace (it could never be
            produced by the ``WhitespaceSplit`` pre-tokenizer); the message names the word and its index.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(vocabulary) == 0:
        raise ValueError("vocabulary is empty: pass the task's words (e.g. env.vocabulary())")
    vocab: dict[str, int] = {tok: idx for idx, tok in enumerate(SPECIAL_TOKENS)}
    for idx, word in enumerate(vocabulary):
        if not isinstance(word, str) or not word or any(ch.isspace() for ch in word):
            raise ValueError(
                f"vocabulary[{idx}] = {word!r} is not a single whitespace-free word; "
                "split it into words or remove the whitespace")
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
