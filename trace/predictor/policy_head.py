"""The ``policy_head`` backend: an MLP head on the policy's own last hidden state at the end of the prefix.

One forward pass per covering trajectory gives the end-of-prefix state of every prefix along it (a causal
model's state at position t depends only on tokens ``0..t``). A node's feature is taken once, under the
policy of the step that first scores it, and reused while its tree stays in the fitted window.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import numpy as np

from trace.configuration.config import PredictorConfig, PredictorKind
from trace.envs.base import Prompt
from trace.predictor.base import BuildContext, check_prompt_args, clip_predictions
from trace.predictor.head import HeadPredictorBase
from trace.tree import RolloutTree


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
    forward = getattr(model, "get_base_model", lambda: model)().forward  # a LoRA policy passes it through
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}
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


class PolicyHeadPredictor(HeadPredictorBase):
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

    @classmethod
    def from_context(cls, cfg: PredictorConfig, context: BuildContext) -> "PolicyHeadPredictor":
        """``PolicyHeadPredictor(cfg, policy, seed=)`` from ``make_predictor``'s arguments.

        Raises:
            ValueError: if ``context.policy`` has no ``.model``.
        """
        return cls(cfg, context.policy, seed=context.seed)

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

    def fit(self, trees: Sequence[RolloutTree], root_weights: Sequence[float] | None = None) -> dict[str, float]:
        """``HeadPredictorBase.fit``, then drop the cached features of trees outside ``trees`` (the window)."""
        out = super().fit(trees, root_weights)
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
        check_prompt_args(prompts, root_texts)
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
        return clip_predictions(self._predict_features(np.concatenate(hidden).astype(np.float32)), self.cfg.clip)
