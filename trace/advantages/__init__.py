"""Advantage estimators over rollout trees, a registry looked up by name.

Every estimator is a pure function ``fn(trees, *, eps, std_floor, clip) -> list[(N_t,) float64]``: for each
tree, indexed by ``node_id``, the advantage that node's tokens carry in the update. A trajectory is one
*leaf row* (root to leaf). A shared prefix is trained once, so a node carries the **sum** of the advantages
that the leaf rows through it give its tokens; a leaf carries its own row's advantage; the root (the
prompt, never trained) carries 0. Training nodes once with these sums equals training every leaf row
separately (expansion ratio 1 in the flat limit).

Grouping is by explicit ids, never by position:
- the *prompt group* of a leaf is every leaf whose tree has the same ``prompt_uid`` (several trees may
  share a prompt, e.g. DAPO rounds or evaluation samples);
- an *anchor group* is the set of leaves below a branch anchor: a non-root node with >= 2 children, keyed
  by (tree, node_id).

Conventions, fixed once here and tested:
- z-scores use the unbiased std (``ddof=1``) plus ``eps``: ``(r - mean) / (std + eps)``;
- a group of size 1 gives 0 (no baseline exists);
- a group whose rewards are all equal, or whose std is below ``std_floor``, gives exactly 0 (constant
  shaped rewards such as 0.2 must not turn into float noise divided by ``eps``);
- ``clip`` (None = off) bounds ``|advantage|`` of each leaf row before rows are summed into nodes (one
  success among 93 rollouts has z = 92 / sqrt(93) = 9.54 unclipped);
- a truncated leaf (``reward is None``) counts with reward 0, as ``RolloutTree.leaf_rewards`` does;
- an *empty* leaf, whose own turn generated nothing (``loss_mask`` all 0: ``Node.num_generated_tokens == 0``),
  is left out as if it had not been sampled, by every estimator: it joins no prompt, anchor, sibling or
  depth group and no whitening, its row's advantage is 0, and its ancestors get nothing from it (a node
  with only empty leaves below carries 0; an anchor with one live child is no branch anchor). Its own
  tokens train nothing, so it must not move its siblings' baseline either: rewards [1, 0, 0] with the
  first leaf empty give the other two 0, not -0.577. The rollout engine never records such a leaf (every
  turn holds at least one sampled token); hand-built or imported trees may.

Estimators:
- ``grpo``: z-score of each leaf reward within its prompt group (GRPO, arXiv 2402.03300).
- ``tree_grpo`` (default): inter term = the ``grpo`` z-score; intra term = the mean, over the branch anchors
  on the leaf's path, of the leaf's z-score within each anchor group (0 with no anchor); advantage = inter
  + intra, the same for every token of the trajectory (Tree-GRPO, arXiv 2509.21240).
- ``treerpo``: node value = mean leaf reward below the node; a node's advantage = the z-score of its
  value within its sibling group (children of one parent; the children of the roots of one prompt form
  one group); a node without siblings inherits its parent's advantage (0 below the root). Every leaf row
  through a node gives its tokens that node's advantage, so the node carries it times its leaf count
  (TreeRPO, arXiv 2506.05183).
- ``treepo``: for each ancestor of a leaf at depth ``d = 0 .. depth - 1`` (depth 0 = the prompt group)
  whose leaf group holds >= 2 leaves, the leaf's reward minus that group's mean; the terms are averaged
  with the group sizes as weights, then whitened over all leaves of the batch (mean 0, unbiased std 1)
  (TreePO, arXiv 2508.17445). Whitening moves leaves of constant groups off 0 by design.
"""

from trace.advantages.batch import LeafAdvantages, TreeBatch, group_zscore
from trace.advantages.estimators import (
    ESTIMATORS,
    assign_advantages,
    compute_advantages,
    get_estimator,
    grpo_advantages,
    tree_grpo_advantages,
    treepo_advantages,
    treerpo_advantages,
)

__all__ = [
    "TreeBatch",
    "LeafAdvantages",
    "group_zscore",
    "grpo_advantages",
    "tree_grpo_advantages",
    "treerpo_advantages",
    "treepo_advantages",
    "ESTIMATORS",
    "get_estimator",
    "compute_advantages",
    "assign_advantages",
]
