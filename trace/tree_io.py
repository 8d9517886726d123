"""Rollout trees on disk: Parquet, one row per node, explicit schema, atomic writes, validating reads.

Layout: ``<root>/<ablation>/step-<step>.parquet``, one file per ablation and step. Every file holds every
column of ``NODE_SCHEMA``, ``ablation`` and ``step`` included, so a single file describes itself and a whole
folder reads in one call as one table with that schema: ``pd.read_parquet(root)``, ``pq.read_table(root)``,
DuckDB's ``read_parquet('<root>/**/*.parquet')``, polars' ``pl.read_parquet(root)``. Folder names are
deliberately not hive-style ``key=value``: those tools would then add ``ablation`` and ``step`` partition
columns of their own inferred (dictionary-encoded) types and fail to merge them with the file columns.
Folders written in the earlier hive layout (``ablation=<name>/step=<step>/trees.parquet``, same schema
version) are still read by ``read_trees`` / ``read_tree_dataset``.

Every file carries ``trace.schema_version`` in its schema metadata; a reader refuses files of another
version, files missing a column or holding one of another type, truncated files, rewards that are not
finite, and rows that do not form valid trees, naming the file and the problem. Writes go to a temporary
file (``.``-prefixed and ``.tmp``-suffixed, so the tools above never read it) in the same folder and are
renamed into place, so a killed writer never leaves a partial file under the final name.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from trace.errors import UserError
from trace.tree import FinishReason, Node, Origin, RewardError, RolloutTree, check_tree_rewards, checked_reward

SCHEMA_VERSION = 1
_VERSION_KEY = b"trace.schema_version"

NODE_SCHEMA = pa.schema(
    [
        pa.field("tree_id", pa.string(), nullable=False),
        pa.field("prompt_uid", pa.string(), nullable=False),
        pa.field("data_source", pa.string(), nullable=False),
        pa.field("example_id", pa.string(), nullable=False),
        pa.field("ablation", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("node_id", pa.int32(), nullable=False),
        pa.field("parent_id", pa.int32(), nullable=False),
        pa.field("turn_idx", pa.int32(), nullable=False),
        pa.field("origin", pa.string(), nullable=False),
        pa.field("branch_anchor_id", pa.int32(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("action_text", pa.string(), nullable=False),
        pa.field("observation_text", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("reward", pa.float64()),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("pred_success_prob", pa.float64()),
        pa.field("true_success_prob", pa.float64()),
        pa.field("num_branches", pa.int32(), nullable=False),
        pa.field("advantage", pa.float64()),
        pa.field("num_tool_calls", pa.int32(), nullable=False),
    ],
    metadata={_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)

_TREE_FIELDS = ("tree_id", "prompt_uid", "data_source", "example_id", "ablation", "step")


class TreeFileError(UserError, ValueError):
    """A Parquet file of rollout trees is missing, truncated, foreign, of another version, or inconsistent."""


_STEP_FILE = re.compile(r"^step-(-?\d+)\.parquet$")
_LEGACY_ABLATION_DIR, _LEGACY_STEP_DIR = re.compile(r"^ablation=(.*)$"), re.compile(r"^step=(-?\d+)$")
_LEGACY_FILE = "trees.parquet"


def tree_path(root: str | Path, ablation: str, step: int) -> Path:
    """File for one ablation and step: ``root/<ablation>/step-<step, 6 digits>.parquet``.

    Raises:
        ValueError: if ``ablation`` is empty, contains a path separator or ``=``, or starts with ``.`` or
            ``_`` (names the readers would skip or take for a hive partition).
    """
    if not ablation or "/" in ablation or os.sep in ablation or "=" in ablation or ablation[0] in "._":
        raise ValueError(f"ablation {ablation!r} cannot name a tree folder: use a non-empty name without '/', "
                         "'=' or a leading '.' / '_'")
    return Path(root) / ablation / f"step-{int(step):06d}.parquet"


def trees_to_table(trees: Iterable[RolloutTree]) -> pa.Table:
    """One row per node, in tree then ``node_id`` order.

    Raises:
        RewardError: a reward that is not a finite real number (names the tree and node).
    """
    cols: dict[str, list] = {f.name: [] for f in NODE_SCHEMA}
    for tree in trees:
        check_tree_rewards(tree)
        for node in tree.nodes:
            for name in _TREE_FIELDS:
                cols[name].append(getattr(tree, name))
            cols["node_id"].append(node.node_id)
            cols["parent_id"].append(node.parent_id)
            cols["turn_idx"].append(node.turn_idx)
            cols["origin"].append(Origin(node.origin).value)
            cols["branch_anchor_id"].append(node.branch_anchor_id)
            cols["text"].append(node.text)
            cols["action_text"].append(node.action_text)
            cols["observation_text"].append(node.observation_text)
            cols["token_ids"].append(list(node.token_ids))
            cols["logprobs"].append(list(node.logprobs))
            cols["loss_mask"].append(list(node.loss_mask))
            cols["reward"].append(node.reward)
            cols["finish_reason"].append(FinishReason(node.finish_reason).value)
            cols["pred_success_prob"].append(node.pred_success_prob)
            cols["true_success_prob"].append(node.true_success_prob)
            cols["num_branches"].append(node.num_branches)
            cols["advantage"].append(node.advantage)
            cols["num_tool_calls"].append(node.num_tool_calls)
    return pa.table(cols, schema=NODE_SCHEMA)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[str]:
    """Yield a temporary file name in ``path``'s folder; on success it is renamed onto ``path`` (atomic),
    on failure removed, so ``path`` never holds a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and an atomic rename."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_trees(trees: Sequence[RolloutTree], path: str | Path) -> Path:
    """Write trees to one Parquet file atomically (temporary file in the same folder, then rename).

    Returns:
        The final path.
    """
    table = trees_to_table(trees)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return Path(path)


def _check_schema(schema: pa.Schema, path: Path) -> None:
    meta = schema.metadata or {}
    if _VERSION_KEY not in meta:
        raise TreeFileError(f"{path}: not a trace rollout-tree file (no {_VERSION_KEY.decode()} in its metadata)")
    version = meta[_VERSION_KEY].decode()
    if version != str(SCHEMA_VERSION):
        raise TreeFileError(
            f"{path}: schema version {version}, this code reads version {SCHEMA_VERSION}; "
            "regenerate it with this version (dvc repro) or read it with the matching release")
    missing = [f.name for f in NODE_SCHEMA if f.name not in schema.names]
    if missing:
        raise TreeFileError(f"{path}: missing column(s) {missing}; the file is not a complete tree table")
    wrong = [f"{f.name} is {schema.field(f.name).type}, expected {f.type}" for f in NODE_SCHEMA
             if schema.field(f.name).type != f.type]
    if wrong:
        raise TreeFileError(f"{path}: column type(s) differ from the tree schema: {'; '.join(wrong)}; write trees "
                            "with trace.tree_io.write_trees")


def read_trees(path: str | Path) -> list[RolloutTree]:
    """Read and validate a Parquet file written by ``write_trees``, or every file of a tree folder.

    Args:
        path: one file, or a folder of ``tree_path`` files (read as ``read_tree_dataset(path)``).

    Raises:
        TreeFileError: the file is missing, unreadable or truncated, of another schema version, lacks a
            column or holds one of another type, holds a reward that is not finite, or its rows do not form
            valid trees (root first, parents before children). No partial list of trees is ever returned.
    """
    path = Path(path)
    if path.is_dir():
        return read_tree_dataset(path)
    if not path.is_file():
        raise TreeFileError(f"{path}: no such file")
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise TreeFileError(f"{path}: unreadable or truncated Parquet file ({err})") from None
    _check_schema(schema, path)
    try:
        table = pq.read_table(path, columns=[f.name for f in NODE_SCHEMA])
    except Exception as err:
        raise TreeFileError(f"{path}: unreadable or truncated Parquet file ({err})") from None
    return table_to_trees(table, str(path))


def table_to_trees(table: pa.Table, source: str = "<table>") -> list[RolloutTree]:
    """Rebuild trees from node rows.

    Raises:
        TreeFileError: rows of a tree are out of order or reference a missing parent, or a reward is not
            finite (names the row, tree and node).
    """
    rows = table.to_pylist()
    trees: list[RolloutTree] = []
    current: RolloutTree | None = None
    for row_idx, row in enumerate(rows):
        if current is None or row["tree_id"] != current.tree_id:
            if row["node_id"] != 0 or row["parent_id"] != -1:
                raise TreeFileError(f"{source}: row {row_idx} starts tree {row['tree_id']!r} without a root node")
            current = RolloutTree(**{k: row[k] for k in _TREE_FIELDS})
            trees.append(current)
        if row["node_id"] != len(current.nodes):
            raise TreeFileError(
                f"{source}: row {row_idx} of tree {current.tree_id!r} has node_id {row['node_id']}, "
                f"expected {len(current.nodes)} (rows must be in node order)")
        if row["node_id"] > 0 and not 0 <= row["parent_id"] < row["node_id"]:
            raise TreeFileError(f"{source}: row {row_idx}: parent_id {row['parent_id']} is not an earlier node")
        if row["reward"] is not None:
            try:
                checked_reward(row["reward"], f"{source}: row {row_idx} (tree {current.tree_id!r} node "
                                              f"{row['node_id']})")
            except RewardError as err:
                raise TreeFileError(str(err)) from None
        current.nodes.append(
            Node(
                node_id=row["node_id"],
                parent_id=row["parent_id"],
                turn_idx=row["turn_idx"],
                origin=Origin(row["origin"]),
                branch_anchor_id=row["branch_anchor_id"],
                text=row["text"],
                action_text=row["action_text"],
                observation_text=row["observation_text"],
                token_ids=list(row["token_ids"]),
                logprobs=list(row["logprobs"]),
                loss_mask=list(row["loss_mask"]),
                reward=row["reward"],
                finish_reason=FinishReason(row["finish_reason"]),
                pred_success_prob=row["pred_success_prob"],
                true_success_prob=row["true_success_prob"],
                num_branches=row["num_branches"],
                advantage=row["advantage"],
                num_tool_calls=row["num_tool_calls"],
            ))
    return trees


def tree_files(root: str | Path, ablation: str | None = None) -> list[tuple[str, int, Path]]:
    """The tree files under ``root`` (``tree_path`` layout, and the earlier hive layout), sorted.

    Args:
        root: a tree folder.
        ablation: only this ablation's files (default: every ablation).

    Returns:
        ``(ablation, step, path)`` in (ablation, step) order.

    Raises:
        TreeFileError: if one (ablation, step) has a file in both layouts (names both).
    """
    root = Path(root)
    found: dict[tuple[str, int], Path] = {}

    def add(name: str, step: int, path: Path) -> None:
        if ablation is not None and name != ablation:
            return
        if (name, step) in found:
            raise TreeFileError(f"{root}: ablation {name!r} step {step} is stored twice, in {found[(name, step)]} "
                                f"and {path}; remove one of them")
        found[(name, step)] = path

    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            legacy = _LEGACY_ABLATION_DIR.match(folder.name)
            if legacy:
                for step_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
                    step = _LEGACY_STEP_DIR.match(step_dir.name)
                    if step and (step_dir / _LEGACY_FILE).is_file():
                        add(legacy.group(1), int(step.group(1)), step_dir / _LEGACY_FILE)
                continue
            for path in sorted(folder.iterdir()):
                step = _STEP_FILE.match(path.name)
                if step and path.is_file():
                    add(folder.name, int(step.group(1)), path)
    return [(name, step, found[(name, step)]) for name, step in sorted(found)]


def read_tree_dataset(root: str | Path, ablation: str | None = None) -> list[RolloutTree]:
    """Read every tree file under ``root`` (optionally one ablation), in (ablation, step) order.

    Each file is validated as by ``read_trees``; the earlier hive layout is read too (``tree_files``).

    Raises:
        TreeFileError: any file ``read_trees`` refuses, or an (ablation, step) stored in both layouts.
    """
    out: list[RolloutTree] = []
    for _, _, path in tree_files(root, ablation):
        out.extend(read_trees(path))
    return out
