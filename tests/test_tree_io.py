import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.test_tree import small_tree
from trace.tree import RewardError
from trace.tree_io import (NODE_SCHEMA, TreeFileError, read_tree_dataset, read_trees, tree_files, tree_path,
                           write_trees)


def test_parquet_round_trip_is_exact(tmp_path):
    trees = [small_tree(), small_tree()]
    trees[1].tree_id = "x/0/kgqa/2"
    trees[0].nodes[1].logprobs = [-0.5, -1.25, 0.0]
    trees[0].nodes[2].advantage = 1.5
    trees[0].nodes[1].pred_success_prob = 0.25
    path = write_trees(trees, tree_path(tmp_path, "trace", 3))
    back = read_trees(path)
    assert [t.copy_without_state() for t in trees] == back
    assert read_tree_dataset(tmp_path, "trace") == back


def test_write_leaves_no_temporary_files(tmp_path):
    path = write_trees([small_tree()], tmp_path / "t.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_truncated_file_fails_naming_the_file(tmp_path):
    path = write_trees([small_tree()], tmp_path / "t.parquet")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TreeFileError, match="t.parquet"):
        read_trees(path)


def test_foreign_parquet_and_wrong_version_are_refused(tmp_path):
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"a": [1]}), foreign)
    with pytest.raises(TreeFileError, match="not a trace rollout-tree file"):
        read_trees(foreign)
    old = tmp_path / "old.parquet"
    schema = NODE_SCHEMA.with_metadata({b"trace.schema_version": b"0"})
    pq.write_table(pa.Table.from_pylist([], schema=schema), old)
    with pytest.raises(TreeFileError, match="schema version 0"):
        read_trees(old)


def test_missing_column_is_named(tmp_path):
    path = write_trees([small_tree()], tmp_path / "t.parquet")
    table = pq.read_table(path).drop_columns(["loss_mask"])
    pq.write_table(table, path)
    with pytest.raises(TreeFileError, match="loss_mask"):
        read_trees(path)


def test_rows_out_of_order_are_refused(tmp_path):
    path = write_trees([small_tree()], tmp_path / "t.parquet")
    table = pq.read_table(path)
    pq.write_table(table.take([0, 2, 1, 3, 4]), path)
    with pytest.raises(TreeFileError, match="node order"):
        read_trees(path)


def _write_run(root, ablations=("grpo", "trace"), steps=(0, 1)):
    """One file per (ablation, step), each with the small tree stamped with its ablation and step."""
    written = []
    for ablation in ablations:
        for step in steps:
            tree = small_tree()
            tree.ablation, tree.step, tree.tree_id = ablation, step, f"{ablation}/{step}/kgqa/1"
            write_trees([tree], tree_path(root, ablation, step))
            written.append(tree)
    return written


def test_a_tree_folder_reads_in_one_call_with_pandas_and_pyarrow(tmp_path):
    import pandas as pd

    written = _write_run(tmp_path)
    frame = pd.read_parquet(tmp_path)  # raised "Unable to merge: Field ablation has incompatible types" before
    assert len(frame) == 4 * len(small_tree().nodes)
    sizes = frame.groupby(["ablation", "step"]).size().to_dict()
    assert sizes == {(a, s): 5 for a in ("grpo", "trace") for s in (0, 1)}
    assert sorted(frame.loc[frame.node_id == 2, "reward"]) == [1.0] * 4
    table = pq.read_table(tmp_path)
    assert table.schema.field("ablation").type == pa.string() and table.schema.field("step").type == pa.int32()
    assert table.num_rows == len(frame)
    assert read_trees(tmp_path) == read_tree_dataset(tmp_path) == written  # our reader: folder and single file
    assert read_trees(tree_path(tmp_path, "trace", 1)) == [written[3]]


def test_a_tree_folder_reads_in_one_call_with_duckdb(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    _write_run(tmp_path)
    rows = duckdb.sql(f"SELECT ablation, step, count(*) FROM read_parquet('{tmp_path}/**/*.parquet') "
                      "GROUP BY ALL ORDER BY ALL").fetchall()
    assert rows == [("grpo", 0, 5), ("grpo", 1, 5), ("trace", 0, 5), ("trace", 1, 5)]


def test_a_tree_folder_reads_in_one_call_with_polars(tmp_path):
    pl = pytest.importorskip("polars")
    _write_run(tmp_path)
    frame = pl.read_parquet(tmp_path)
    assert frame.height == 20 and sorted(frame["ablation"].unique().to_list()) == ["grpo", "trace"]


def test_folders_in_the_earlier_hive_layout_are_still_read(tmp_path):
    legacy = small_tree()
    legacy.ablation, legacy.step = "grpo", 0
    write_trees([legacy], tmp_path / "ablation=grpo" / "step=000000" / "trees.parquet")
    current = small_tree()
    current.ablation, current.step = "grpo", 1
    write_trees([current], tree_path(tmp_path, "grpo", 1))
    assert read_tree_dataset(tmp_path) == read_trees(tmp_path) == [legacy, current]
    assert [(a, s) for a, s, _ in tree_files(tmp_path, "grpo")] == [("grpo", 0), ("grpo", 1)]
    write_trees([legacy], tree_path(tmp_path, "grpo", 0))
    with pytest.raises(TreeFileError, match="ablation 'grpo' step 0 is stored twice"):
        read_tree_dataset(tmp_path)


def test_tree_path_refuses_names_that_cannot_be_a_folder(tmp_path):
    for bad in ("", "a/b", "a=b", ".hidden", "_meta"):
        with pytest.raises(ValueError, match="cannot name a tree folder"):
            tree_path(tmp_path, bad, 0)


def test_a_reward_that_is_not_finite_is_refused_when_written_and_when_read(tmp_path):
    tree = small_tree()
    tree.nodes[3].reward = float("nan")
    with pytest.raises(RewardError, match="tree x/0/kgqa/1 node 3"):
        write_trees([tree], tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()
    path = write_trees([small_tree()], tmp_path / "t.parquet")
    table = pq.read_table(path)
    rewards = table.column("reward").to_pylist()
    rewards[3] = float("inf")
    pq.write_table(table.set_column(table.schema.get_field_index("reward"), NODE_SCHEMA.field("reward"),
                                    pa.array(rewards, pa.float64())), path)
    with pytest.raises(TreeFileError, match=r"t.parquet: row 3 \(tree 'x/0/kgqa/1' node 3\): reward inf is not finite"):
        read_trees(path)


def test_a_column_of_another_type_is_refused_naming_it(tmp_path):
    path = write_trees([small_tree()], tmp_path / "t.parquet")
    table = pq.read_table(path)
    as_text = pa.array([None if r is None else str(r) for r in table.column("reward").to_pylist()], pa.string())
    pq.write_table(table.set_column(table.schema.get_field_index("reward"), pa.field("reward", pa.string()), as_text)
                   .replace_schema_metadata(NODE_SCHEMA.metadata), path)
    with pytest.raises(TreeFileError, match="reward is string, expected double"):
        read_trees(path)
