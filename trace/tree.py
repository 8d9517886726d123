"""Rollout trees: node records and pure tree operations.

A rollout tree holds every trajectory sampled for one prompt in one training step. The root node is the
prompt (its tokens are the chat/ReAct context the policy starts from); every other node is one turn: the
policy's generated tokens followed by the tool's observation tokens (the last turn of a trajectory has no
observation). A node's children are continuations sampled from its prefix. A leaf ends a trajectory and
carries the verifier's reward.

Invariants kept here:
- ``node_id`` is unique within a tree and equals the node's index in ``RolloutTree.nodes``;
  a parent always comes before its children (``parent_id < node_id``).
- Groups are formed by explicit ids (``prompt_uid``, ``tree_id``, ``node_id``), never by position.
- ``prompt_uid = f"{data_source}/{example_id}"`` so two data sources that share row numbers never collide.
- A node's ``reward`` is ``None`` or a finite ``float`` (``add_node`` refuses anything else). A reward read
  from an environment's step is checked with ``checked_reward(reward, where, reward_range_of(env))``
  against the environment's declared range, so a reward of 5, -1 or ``"1"`` is refused before it can
  reach metrics or advantages. ``reward`` is a plain attribute, so every reader (leaf rewards, labels,
  advantages, metrics, predictor histories, audits) reads it through ``RolloutTree.reward_of``, which checks
  it again: a ``"1"`` or ``True`` set on a node after ``add_node`` raises ``RewardError`` where it is read
  instead of being cast to 1.0.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator

import numpy as np

from trace.errors import UserError

ROOT_PARENT_ID = -1


class RewardError(UserError, ValueError):
    """A reward that is not a finite real number, or lies outside the environment's declared reward range."""


def checked_reward(reward: Any, where: str, reward_range: tuple[float, float] | None = None) -> float:
    """Return ``reward`` as a ``float`` after checking it is a usable verifier reward.

    Args:
        reward: the value to check: an ``int`` / ``float`` / numpy real (``bool``, strings and other types
            are refused, so ``"1"`` is not read as 1.0).
        where: what the reward belongs to, for the message (e.g. ``"tree grpo/3/kgqa/train-00001 node 7"``).
        reward_range: ``(low, high)``, the environment's declared inclusive range
            (``trace.envs.base.reward_range_of``); ``None`` checks type and finiteness only.

    Returns:
        The reward as a Python ``float``.

    Raises:
        RewardError: a non-real value, NaN or infinity, or a value outside ``reward_range``; the message
            names ``where``, the value and the range.
    """
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        raise RewardError(f"{where}: reward {reward!r} ({type(reward).__name__}) is not a number; the verifier "
                          "must return a float")
    value = float(reward)
    if not math.isfinite(value):
        raise RewardError(f"{where}: reward {value!r} is not finite; the verifier must return a finite float")
    if reward_range is not None:
        low, high = reward_range
        if not low <= value <= high:
            raise RewardError(f"{where}: reward {value!r} is outside the environment's reward_range "
                              f"[{low}, {high}]; fix the verifier or declare the range it returns")
    return value


def check_tree_rewards(tree: "RolloutTree", reward_range: tuple[float, float] | None = None) -> None:
    """Check every reward of ``tree`` with ``checked_reward`` (``None`` rewards are allowed).

    Args:
        tree: the tree.
        reward_range: the environment's declared ``(low, high)``; ``None`` checks type and finiteness only.

    Raises:
        RewardError: naming the tree, the node, the value and the range.
    """
    for node in tree.nodes:
        if node.reward is not None:
            checked_reward(node.reward, f"tree {tree.tree_id} node {node.node_id}", reward_range)


class Origin(str, Enum):
    """How a node came to be."""

    PROMPT = "prompt"  # the root
    ROLLOUT = "rollout"  # a turn of a bare root rollout (stage 1)
    BRANCH = "branch"  # a turn of a continuation sampled from an anchor (stage 2)


class FinishReason(str, Enum):
    """Why a trajectory ended at this leaf ("" on non-leaf nodes)."""

    NONE = ""
    TERMINATED = "terminated"  # the episode ended: a final answer (verifier reward), or EOS without one (0.0)
    MAX_TURNS = "max_turns"  # truncated: the turn limit was reached without a final answer
    MAX_TOKENS = "max_tokens"  # truncated: a turn hit the per-turn token limit
    MAX_CONTEXT = "max_context"  # truncated: the context would exceed the model's window

    @property
    def is_truncated(self) -> bool:
        return self in (FinishReason.MAX_TURNS, FinishReason.MAX_TOKENS, FinishReason.MAX_CONTEXT)


def make_prompt_uid(data_source: str, example_id: str) -> str:
    """Return the prompt's identity ``"<data_source>/<example_id>"``.

    Raises:
        ValueError: if either part is empty or ``data_source`` contains ``/``.
    """
    if not data_source or not str(example_id):
        raise ValueError(f"data_source and example_id must be non-empty, got {data_source!r}, {example_id!r}")
    if "/" in data_source:
        raise ValueError(f"data_source {data_source!r} must not contain '/'")
    return f"{data_source}/{example_id}"


@dataclass
class Node:
    """One node of a rollout tree: the root (prompt) or one turn.

    Attributes:
        node_id: index of the node in its tree (root is 0).
        parent_id: ``node_id`` of the parent, ``-1`` for the root.
        turn_idx: 0-based turn position along the trajectory; ``-1`` for the root.
        origin: ``Origin`` of the node.
        branch_anchor_id: for ``BRANCH`` nodes, the anchor node the continuation was sampled from
            (the parent of the continuation's first turn); ``-1`` otherwise.
        text: decoded text of the node (policy action text + observation text).
        token_ids: (T,) int token ids of the node, in context order: generated tokens then observation.
        logprobs: (T,) float log-probabilities (nats) of ``token_ids`` under the sampling policy;
            0.0 on tokens the policy did not generate.
        loss_mask: (T,) int, 1 exactly on tokens the policy generated, 0 on prompt/observation tokens.
        action_text: the policy's generated text of this turn ("" for the root).
        observation_text: the tool's observation appended after the action ("" for root and terminal turn).
        reward: the verifier's reward at a leaf (``None`` elsewhere).
        finish_reason: ``FinishReason`` at a leaf, ``NONE`` elsewhere.
        pred_success_prob: predictor output ``V_hat(H)`` at this prefix, if it was scored.
        true_success_prob: the environment's true ``V(H)`` where it knows it (simulator), else ``None``.
        num_branches: continuations allocated from this node as an anchor (stage 2 ``K``), 0 if none.
        advantage: advantage of the leaf row / node, once computed.
        num_tool_calls: tool calls made in this turn (0 or 1 for ReAct turns).
        env_state: in-memory environment state after this node (not stored on disk).
    """

    node_id: int
    parent_id: int
    turn_idx: int
    origin: Origin
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    action_text: str = ""
    observation_text: str = ""
    branch_anchor_id: int = -1
    reward: float | None = None
    finish_reason: FinishReason = FinishReason.NONE
    pred_success_prob: float | None = None
    true_success_prob: float | None = None
    num_branches: int = 0
    advantage: float | None = None
    num_tool_calls: int = 0
    env_state: Any = field(default=None, repr=False, compare=False)

    @property
    def is_root(self) -> bool:
        return self.parent_id == ROOT_PARENT_ID

    @property
    def num_generated_tokens(self) -> int:
        return int(sum(self.loss_mask))


@dataclass
class RolloutTree:
    """All trajectories sampled for one prompt in one step.

    Attributes:
        tree_id: unique id, ``f"{ablation}/{step}/{prompt_uid}"`` by convention.
        prompt_uid: ``make_prompt_uid(data_source, example_id)``.
        data_source: dataset / environment name (e.g. ``"kgqa"``, ``"hotpotqa"``).
        example_id: id of the example within its data source.
        step: training step (``-1`` for seed rollouts and evaluation).
        ablation: name of the ablation that sampled the tree.
        nodes: list of ``Node``; ``nodes[0]`` is the root.
    """

    tree_id: str
    prompt_uid: str
    data_source: str
    example_id: str
    step: int = -1
    ablation: str = ""
    nodes: list[Node] = field(default_factory=list)

    # ---- construction -------------------------------------------------------------------------
    def add_node(self, parent_id: int, **fields: Any) -> Node:
        """Append a child of ``parent_id`` and return it (``node_id`` assigned here).

        Raises:
            ValueError: if ``parent_id`` is not an existing node (or ``-1`` for an empty tree).
            RewardError: if ``reward`` is given and is not a finite real number (it is stored as a ``float``).
        """
        node_id = len(self.nodes)
        if parent_id == ROOT_PARENT_ID:
            if self.nodes:
                raise ValueError(f"tree {self.tree_id} already has a root")
        elif not 0 <= parent_id < node_id:
            raise ValueError(f"tree {self.tree_id}: parent_id {parent_id} does not exist (have {node_id} nodes)")
        if fields.get("reward") is not None:
            fields["reward"] = checked_reward(fields["reward"], f"tree {self.tree_id} node {node_id}")
        node = Node(node_id=node_id, parent_id=parent_id, **fields)
        self.nodes.append(node)
        return node

    # ---- structure ----------------------------------------------------------------------------
    @property
    def root(self) -> Node:
        return self.nodes[0]

    def children(self) -> list[list[int]]:
        """Return ``children[node_id]`` = ids of the node's children, in id order."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes[1:]:
            out[node.parent_id].append(node.node_id)
        return out

    def leaves(self) -> list[Node]:
        """Nodes with no children (excluding a root with no rollouts)."""
        has_child = np.zeros(len(self.nodes), dtype=bool)
        for node in self.nodes[1:]:
            has_child[node.parent_id] = True
        return [n for n in self.nodes[1:] if not has_child[n.node_id]]

    def path(self, node_id: int) -> list[Node]:
        """Nodes from the root to ``node_id`` inclusive."""
        out = []
        while node_id != ROOT_PARENT_ID:
            node = self.nodes[node_id]
            out.append(node)
            node_id = node.parent_id
        return out[::-1]

    def depth(self, node_id: int) -> int:
        """Number of turns from the root to the node (root 0)."""
        return len(self.path(node_id)) - 1

    def prefix_token_ids(self, node_id: int) -> list[int]:
        """Token ids of the prefix ``H`` ending at ``node_id`` (root tokens + every turn on the path)."""
        ids: list[int] = []
        for node in self.path(node_id):
            ids.extend(node.token_ids)
        return ids

    def prefix_text(self, node_id: int, sep: str = " ") -> str:
        """Text of the prefix ``H`` ending at ``node_id``: root text (the prompt) then each turn's text."""
        return sep.join(n.text for n in self.path(node_id) if n.text)

    def iter_leaf_paths(self) -> Iterator[tuple[Node, list[Node]]]:
        """Yield ``(leaf, path)`` for each leaf, root first on the path."""
        for leaf in self.leaves():
            yield leaf, self.path(leaf.node_id)

    # ---- rewards ------------------------------------------------------------------------------
    def reward_of(self, node: Node) -> float:
        """The reward of ``node`` as every reader uses it: ``0.0`` for ``None``, else the checked ``float``.

        ``add_node`` checks a reward it is given, but ``node.reward`` can be set afterwards; reading it here
        (never with ``float(node.reward)``) keeps ``"1"`` or ``True`` from counting as 1.0.

        Args:
            node: a node of this tree.

        Returns:
            The reward as a Python ``float`` (``0.0`` when ``node.reward`` is ``None``).

        Raises:
            RewardError: ``node.reward`` is not a finite real number (``bool`` and strings included); the
                message names the tree, the node and the value.
        """
        if node.reward is None:
            return 0.0
        return checked_reward(node.reward, f"tree {self.tree_id} node {node.node_id}")

    def leaf_rewards(self) -> np.ndarray:
        """(L,) float64 rewards of the leaves in ``leaves()`` order; truncated leaves count as given.

        Raises:
            RewardError: a leaf whose reward is not a finite real number (``reward_of``).
        """
        return np.array([self.reward_of(n) for n in self.leaves()], dtype=np.float64)

    def subtree_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Per node: number of descendant leaves and their summed reward.

        Returns:
            (num_leaves, reward_sum): two (N,) float64 arrays indexed by ``node_id``; a leaf counts itself.

        Raises:
            RewardError: a leaf whose reward is not a finite real number (``reward_of``).
        """
        n = len(self.nodes)
        num_leaves = np.zeros(n, dtype=np.float64)
        reward_sum = np.zeros(n, dtype=np.float64)
        has_child = np.zeros(n, dtype=bool)
        for node in self.nodes[1:]:
            has_child[node.parent_id] = True
        for node in self.nodes[1:]:
            if not has_child[node.node_id]:
                num_leaves[node.node_id] = 1.0
                reward_sum[node.node_id] = self.reward_of(node)
        # parents precede children, so one reverse sweep accumulates bottom-up
        for node in reversed(self.nodes[1:]):
            num_leaves[node.parent_id] += num_leaves[node.node_id]
            reward_sum[node.parent_id] += reward_sum[node.node_id]
        return num_leaves, reward_sum

    def node_success_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """Predictor labels: mean descendant-leaf reward of every node, and its weight (leaf count).

        Returns:
            (label, weight): (N,) float64; ``label = reward_sum / num_leaves`` (0 where no leaves).

        Raises:
            RewardError: a leaf whose reward is not a finite real number (``reward_of``).

        References:
            docs/method.md#success-predictor: labels are the mean reward of descendant leaves,
            weighted by their count.
        """
        num_leaves, reward_sum = self.subtree_stats()
        label = np.divide(reward_sum, num_leaves, out=np.zeros_like(reward_sum), where=num_leaves > 0)
        return label, num_leaves

    def num_trajectories(self) -> int:
        """Number of leaves (root rollouts + continuations)."""
        return len(self.leaves())

    def num_generated_tokens(self) -> int:
        return int(sum(n.num_generated_tokens for n in self.nodes))

    def num_tool_calls(self) -> int:
        return int(sum(n.num_tool_calls for n in self.nodes))

    def copy_without_state(self) -> "RolloutTree":
        """A deep copy with ``env_state`` dropped (what is written to disk)."""
        nodes = [dataclasses.replace(n, token_ids=list(n.token_ids), logprobs=list(n.logprobs),
                                     loss_mask=list(n.loss_mask), env_state=None) for n in self.nodes]
        return dataclasses.replace(self, nodes=nodes)
