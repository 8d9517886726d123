"""What a train run shows of its rollouts in MLflow: the bounded rollout table and the tree pictures."""

from pathlib import Path

import numpy as np
import pytest

from trace.tracking.rollouts import ROLLOUT_COLUMNS, ROLLOUT_TABLE, TREE_IMAGE_KEY, rollout_rows, tree_image
from trace.tree import FinishReason, Origin, RolloutTree


def _tree(uid: str, branched: bool = True) -> RolloutTree:
    """A prompt with m = 2 bare rollouts of two turns (rewards 1 and 0); with ``branched``, one continuation from
    the first rollout's turn 0 (an anchor with K = 1) that ends with reward 0."""
    tree = RolloutTree(tree_id=f"trace/3/{uid}", prompt_uid=uid, data_source="kgqa", example_id=uid[-1], step=3,
                       ablation="trace")
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, text="Who   directed the film?", num_branches=2,
                  pred_success_prob=0.4)
    first = tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, action_text="search[e1]", observation_text="e1: r0 e2",
                          num_branches=1 if branched else 0)
    tree.add_node(first.node_id, turn_idx=1, origin=Origin.ROLLOUT, action_text="finish[e2]", reward=1.0,
                  advantage=0.8, finish_reason=FinishReason.TERMINATED)
    second = tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, action_text="search[e3]", observation_text="e3: r1 e4")
    tree.add_node(second.node_id, turn_idx=1, origin=Origin.ROLLOUT, action_text="finish[e4]", reward=0.0,
                  advantage=-0.8, finish_reason=FinishReason.TERMINATED)
    if branched:
        tree.add_node(first.node_id, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=first.node_id,
                      action_text="finish[e9]", reward=0.0, advantage=-0.4, finish_reason=FinishReason.TERMINATED)
    return tree


def test_a_row_per_leaf_in_prompt_order_with_the_allocation_and_the_branch_point():
    rows = rollout_rows([_tree("kgqa/b", branched=False), _tree("kgqa/a")], step=3, max_rows=10, max_chars=200)
    assert [tuple(r) for r in rows] == [ROLLOUT_COLUMNS] * 5
    assert [(r["prompt_uid"], r["reward"], r["branch_turn"]) for r in rows] == [
        ("kgqa/a", 1.0, -1), ("kgqa/a", 0.0, -1), ("kgqa/a", 0.0, 0), ("kgqa/b", 1.0, -1), ("kgqa/b", 0.0, -1)]
    first = rows[0]
    assert first["prompt"] == "Who directed the film?"  # whitespace folded
    assert first["trajectory"] == "[turn 0] search[e1] => e1: r0 e2 [turn 1] finish[e2]"
    assert (first["step"], first["allocated"], first["pred_success_prob"], first["advantage"]) == (3, 2, 0.4, 0.8)
    assert first["finish_reason"] == "terminated"


def test_the_table_is_bounded_in_rows_and_characters():
    rows = rollout_rows([_tree("kgqa/a"), _tree("kgqa/b")], step=0, max_rows=4, max_chars=12)
    assert len(rows) == 4 and all(len(r["trajectory"]) <= 12 and len(r["prompt"]) <= 12 for r in rows)
    assert rows[0]["trajectory"].endswith("…")
    assert rollout_rows([_tree("kgqa/a")], step=0, max_rows=0, max_chars=5) == []
    with pytest.raises(ValueError, match="max_chars >= 1"):
        rollout_rows([], step=0, max_rows=1, max_chars=0)


def test_the_tree_picture_is_an_rgb_image_with_reward_colours():
    image = tree_image([_tree("kgqa/a"), _tree("kgqa/b")], step=3, max_trees=2, title="trace")
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.shape[1] > image.shape[0]
    pixels = image.reshape(-1, 3).astype(int)
    green = ((pixels[:, 1] > 130) & (pixels[:, 0] < 90) & (pixels[:, 2] < 110)).sum()
    red = ((pixels[:, 0] > 180) & (pixels[:, 1] < 90) & (pixels[:, 2] < 90)).sum()
    assert green > 20 and red > 20  # a success leaf and failure leaves are drawn
    assert tree_image([], step=0, max_trees=1) is None


def test_mlflow_holds_one_table_with_a_step_column_and_the_images_by_step(tmp_path):
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("t", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    for step in (1, 3):
        trees = [_tree("kgqa/a"), _tree("kgqa/b")]
        client.log_table(run_id, pd.DataFrame(rollout_rows(trees, step, max_rows=4, max_chars=50)), ROLLOUT_TABLE)
        client.log_image(run_id, tree_image(trees, step, max_trees=2), key=TREE_IMAGE_KEY, step=step)
    import json

    # the UI renders an artifact as a table when the run's loggedArtifacts tag says so
    assert {"path": ROLLOUT_TABLE, "type": "table"} in json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    table = json.loads(Path(client.download_artifacts(run_id, ROLLOUT_TABLE, str(tmp_path))).read_text())
    assert table["columns"] == list(ROLLOUT_COLUMNS)
    steps = [row[0] for row in table["data"]]
    assert steps == [1, 1, 1, 1, 3, 3, 3, 3]  # one file, appended: 4 rows (the bound) per evaluation step
    images = {a.path for a in client.list_artifacts(run_id, "images")}
    assert len(images) >= 2 and all(TREE_IMAGE_KEY in p for p in images)
