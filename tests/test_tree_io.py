import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.test_tree import small_tree
from trace.tree_io import NODE_SCHEMA, TreeFileError, read_tree_dataset, read_trees, tree_path, write_trees


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
