"""A train run's rollouts as MLflow shows them: a bounded table of a step's trajectories and pictures of its trees.

At each in-training evaluation step the train stage logs (``flows.train``):

- ``rollout_rows``: up to ``tracking.rollout_rows`` leaves of that step, one row each, into the run's one table
  ``rollouts.json`` (``MlflowClient.log_table``, which appends: one file per run with a ``step`` column, the
  same path in every arm's run, so MLflow's artifact compare view sets arms side by side on the same prompts).
  Rows are taken in ``prompt_uid`` order, all of a prompt's leaves before the next prompt, so arms that sampled
  the same prompts show the same ones (every arm sees the same candidates at a step). Text fields are cut to
  ``tracking.rollout_chars`` characters.
- ``tree_image``: the first ``tracking.tree_images`` trees of the step (``prompt_uid`` order) drawn side by side,
  nodes by turn, leaves coloured by reward, anchors that branched marked; logged with
  ``MlflowClient.log_image(key="rollout_trees", step=step)`` so the chart view shows it over steps and runs.

Columns (``ROLLOUT_COLUMNS``): ``step``, ``prompt_uid``, ``prompt`` (the root's text), ``trajectory`` (the turns
from the root to the leaf, ``[turn t] action => observation``), ``reward``, ``advantage`` (the leaf's, after
the estimator), ``allocated`` (the root's trajectories ``m_i`` from stage 1), ``pred_success_prob`` (the
predictor's forecast at the root, NaN for arms without one), ``branch_turn`` (the turn of the anchor the leaf
branched from, -1 for a bare rollout) and ``finish_reason``.
"""

from __future__ import annotations

import math
from typing import Sequence

from trace.tree import Node, RolloutTree

ROLLOUT_TABLE = "rollouts.json"  # one table per train run
TREE_IMAGE_KEY = "rollout_trees"
ROLLOUT_COLUMNS = ("step", "prompt_uid", "prompt", "trajectory", "reward", "advantage", "allocated",
                   "pred_success_prob", "branch_turn", "finish_reason")


def _cut(text: str, max_chars: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= max_chars else text[: max(0, max_chars - 1)] + "…"


def _number(value: float | None) -> float:
    return float(value) if value is not None and math.isfinite(float(value)) else float("nan")


def _branch_turn(tree: RolloutTree, path: Sequence[Node]) -> int:
    for node in path:
        if node.branch_anchor_id >= 0:
            return int(tree.nodes[node.branch_anchor_id].turn_idx)
    return -1


def rollout_rows(trees: Sequence[RolloutTree], step: int, max_rows: int, max_chars: int) -> list[dict]:
    """A bounded sample of one step's trajectories, one row per leaf (``ROLLOUT_COLUMNS``).

    Args:
        trees: the step's rollout trees (any order).
        step: the training step (the ``step`` column).
        max_rows: rows at most (>= 0).
        max_chars: characters at most per text field (>= 1; longer text ends with "…").

    Returns:
        Up to ``max_rows`` rows: trees in ``prompt_uid`` order (then ``tree_id``), each tree's leaves in node order.

    Raises:
        ValueError: ``max_rows < 0`` or ``max_chars < 1``.
    """
    if max_rows < 0 or max_chars < 1:
        raise ValueError(f"max_rows must be >= 0 and max_chars >= 1, got {max_rows} and {max_chars}")
    rows: list[dict] = []
    for tree in sorted(trees, key=lambda t: (t.prompt_uid, t.tree_id)):
        root = tree.root
        for leaf, path in tree.iter_leaf_paths():
            if len(rows) >= max_rows:
                return rows
            turns = [f"[turn {n.turn_idx}] {n.action_text}" + (f" => {n.observation_text}" if n.observation_text else "")
                     for n in path if not n.is_root]
            rows.append({"step": int(step), "prompt_uid": tree.prompt_uid, "prompt": _cut(root.text, max_chars),
                         "trajectory": _cut(" ".join(turns), max_chars), "reward": _number(leaf.reward),
                         "advantage": _number(leaf.advantage), "allocated": int(root.num_branches),
                         "pred_success_prob": _number(root.pred_success_prob),
                         "branch_turn": _branch_turn(tree, path), "finish_reason": leaf.finish_reason.value})
    return rows


def _layout(tree: RolloutTree) -> dict[int, tuple[float, float]]:
    """(x, y) of every node: leaves spread evenly on x in depth-first order, a parent above the mean of its
    children; y = -(turn index + 1), the root at 0."""
    children = tree.children()
    pos: dict[int, tuple[float, float]] = {}
    next_x = [0.0]

    def place(node_id: int) -> float:
        kids = children[node_id]
        if kids:
            x = sum(place(k) for k in kids) / len(kids)
        else:
            x, next_x[0] = next_x[0], next_x[0] + 1.0
        pos[node_id] = (x, -(tree.nodes[node_id].turn_idx + 1.0))
        return x

    place(0)
    return pos


def tree_image(trees: Sequence[RolloutTree], step: int, max_trees: int, title: str = ""):
    """A picture of the first ``max_trees`` trees of a step (``prompt_uid`` order), side by side.

    Nodes sit by turn (the root on top); edges join a node to its children; a leaf is green with reward 1 (or
    above 0.5), red with 0, grey without a reward; a node that branched (stage 2 anchor, ``num_branches`` > 0)
    is a star. Drawn with matplotlib (Agg).

    Args:
        trees: the step's trees.
        step: the training step (in the title).
        max_trees: trees drawn, at least 1.
        title: prefix of the figure title (e.g. the arm).

    Returns:
        (H, W, 3) uint8 RGB image, or None when there is no tree.

    Raises:
        ValueError: ``max_trees < 1``.
    """
    if max_trees < 1:
        raise ValueError(f"max_trees must be >= 1, got {max_trees}")
    chosen = sorted(trees, key=lambda t: (t.prompt_uid, t.tree_id))[:max_trees]
    if not chosen:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(chosen), figsize=(3.2 * len(chosen), 3.2), squeeze=False)
    for ax, tree in zip(axes[0], chosen):
        pos = _layout(tree)
        for node in tree.nodes[1:]:
            (x0, y0), (x1, y1) = pos[node.parent_id], pos[node.node_id]
            ax.plot([x0, x1], [y0, y1], color="#888888", lw=0.8, zorder=1)
        leaves = {n.node_id for n in tree.leaves()}
        for node in tree.nodes:
            x, y = pos[node.node_id]
            if node.node_id in leaves and node.reward is not None:
                color = "#2e9e44" if node.reward > 0.5 else "#d0342c"
            elif node.node_id in leaves:
                color = "#bbbbbb"
            else:
                color = "#4a6fa5"
            marker = "*" if node.num_branches > 0 and not node.is_root else "o"
            ax.scatter([x], [y], s=90 if marker == "*" else 28, c=color, marker=marker, zorder=2, linewidths=0)
        rewards = tree.leaf_rewards()
        ax.set_title(f"{tree.prompt_uid}\n{len(leaves)} leaves, mean reward {rewards.mean():.2f}", fontsize=7)
        ax.set_xticks([])
        ax.set_ylabel("turn", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_yticks(sorted({y for _, y in pos.values()}))
        ax.set_yticklabels(["root" if y == 0 else str(int(-y - 1)) for y in sorted({y for _, y in pos.values()})])
    fig.suptitle(f"{title} step {step}: leaves green = reward 1, red = 0; star = anchor that branched".strip(),
                 fontsize=8)
    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image
