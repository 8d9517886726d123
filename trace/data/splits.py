"""The split entry points: a task's files -> the prompts of its ``"train"`` or ``"eval"`` split.

With ``files.eval_path`` each split is its own file, and the eval file's rows get ``eval:`` before their id
so they never share a ``prompt_uid`` with the train file's rows. Without it, a deterministic hash of each
prompt's ``prompt_uid`` (of ``meta["dialogue"]`` for API-Bank, so one dialogue's calls stay together) sends
an ``eval_fraction`` share to ``"eval"``; the assignment does not depend on row order or on the other rows.
``max_train`` / ``max_eval`` then keep N: the first N (``files.subset: first``), or with ``subset: spread`` the
N whose hash of the same key (salted apart from the split's) is lowest, kept in file order: a sample that does
not depend on the order of rows or files (a folder read file by file, e.g. BFCL's categories, would otherwise
give the first category only). ``files.max_solution_steps`` (GSM8K) first drops, from both splits, the problems
whose reference solution has more annotated steps. ``files.format: auto`` detects the format from the first readable row's fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any, Sequence

from trace.data.fc import PARSERS as FC_PARSERS, TASK_FORMATS as FC_TASK_FORMATS
from trace.data.fc import detect_format as detect_fc_format, load_api_bank_descriptions, load_api_bank_dialogues, \
    load_bfcl
from trace.data.math import FORMATS as MATH_FORMATS, PARSERS as MATH_PARSERS, detect_format as detect_math_format
from trace.data_paths import DataError, LoadResult, effective_files, require_file, resolve_data_path, task_name
from trace.data.qa import FORMATS as QA_FORMATS, PARSERS as QA_PARSERS, detect_format as detect_qa_format
from trace.data.records import Collector, RowError, RowParser, collect_rows, iter_records
from trace.envs.base import Prompt
from trace.tasks import FUNCTION_CALLING, MATH, QA, TASKS, file_task_names, task_names

logger = logging.getLogger(__name__)

SPLITS = ("train", "eval")
REAL_TASKS = file_task_names()
EVAL_FILE_ID_PREFIX = "eval:"  # before the ids of a separate eval file's rows

_FAMILY_FORMATS = {QA: QA_FORMATS, MATH: MATH_FORMATS}
TASK_FORMATS: dict[str, tuple[str, ...]] = {
    spec.name: FC_TASK_FORMATS[spec.name] if spec.family == FUNCTION_CALLING else _FAMILY_FORMATS[spec.family]
    for spec in TASKS if not spec.is_embedded}
_PARSERS: dict[str, RowParser] = {**QA_PARSERS, **MATH_PARSERS, **FC_PARSERS}
_QA_TASKS, _MATH_TASKS = task_names(QA), task_names(MATH)


def _detect_format(task: str, record: dict) -> str | None:
    if task in _QA_TASKS:
        return detect_qa_format(record)
    if task in _MATH_TASKS:
        return detect_math_format(record)
    return detect_fc_format(task, record)


def _load_records_file(path: Path, task: str, fmt: str, collector: Collector) -> str:
    """Parse every row of one JSON / JSON-lines file into ``collector``; return the format used."""
    rows = list(iter_records(path))
    if not rows:
        raise DataError(f"{path}: the file is empty (no rows); point task.files.train_path / eval_path at a file "
                        "with one JSON object per line or a JSON array of rows")
    if fmt == "auto":
        fmt = next((f for _, _, r in rows if isinstance(r, dict) for f in [_detect_format(task, r)] if f), None) or ""
        if not fmt:
            first = next((r for _, _, r in rows if isinstance(r, dict)), None)
            if first is None:
                label, _, record = rows[0]
                why = str(record) if isinstance(record, RowError) else f"a {type(record).__name__}, not a JSON object"
                raise DataError(f"{path}: none of its {len(rows)} rows is a JSON object (first, {label}: {why}); "
                                "the file must hold one JSON object per line or a JSON array of objects")
            raise DataError(f"{path}: cannot tell the format for task {task!r} (first row fields {sorted(first)[:12]}); "
                            f"set task.files.format to one of {list(TASK_FORMATS[task])}")
    collect_rows(rows, path, task, _PARSERS[fmt], collector)
    return fmt


def _load_source(task: str, path: Path, files: dict[str, Path | None], fmt: str, collector: Collector) -> list[str]:
    """Load one train/eval source (file or folder) into ``collector``; return the formats used."""
    if fmt != "auto" and fmt not in TASK_FORMATS[task]:
        raise DataError(f"task.files.format={fmt!r} is not a format of task {task!r}; use 'auto' or one of "
                        f"{list(TASK_FORMATS[task])}")
    if task == "bfcl":
        return load_bfcl(path, files.get("answers_path"), collector)
    if task == "api_bank" and (path.is_dir() or fmt == "api_bank_dialogues"):
        if not path.is_dir():
            raise DataError(f"{path}: format api_bank_dialogues needs a folder of dialogue files")
        load_api_bank_dialogues(path, load_api_bank_descriptions(files.get("corpus_path")), collector)
        return ["api_bank_dialogues"]
    if path.is_dir():
        raise DataError(f"{path}: is a folder; task {task!r} reads one file (set task.files.train_path to a file)")
    return [_load_records_file(path, task, fmt, collector)]


def _eval_share(key: str) -> float:
    """A stable pseudo-uniform number in [0, 1) from a string (blake2b; identical across processes)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def _split_key(prompt: Prompt) -> str:
    dialogue = prompt.meta.get("dialogue") if isinstance(prompt.meta, dict) else None
    return f"{prompt.data_source}/{dialogue}" if dialogue else prompt.prompt_uid


def _keep_solution_steps(prompts: list[Prompt], max_steps: int, source: Path) -> list[Prompt]:
    """The prompts whose reference solution has at most ``max_steps`` annotated steps (``meta["solution_steps"]``)."""
    missing = next((p for p in prompts if "solution_steps" not in p.meta), None)
    if missing is not None:
        raise DataError(f"task.files.max_solution_steps is set, but row {missing.example_id!r} of {source} has no "
                        "annotated solution steps (a GSM8K answer with <<expr=result>> steps); unset it for this "
                        "task or file")
    kept = [p for p in prompts if p.meta["solution_steps"] <= max_steps]
    logger.info("%s: kept %d of %d problems with at most %d solution steps", source, len(kept), len(prompts),
                max_steps)
    return kept


def _no_prompt_message(task: str, split: str, source: Path, num_read: int, bad_rows: Sequence, cfg_files: Any) -> str:
    """Why a split came out empty: rows read, bad rows skipped (with the first reasons), and the filters."""
    parts = [f"{num_read} rows parsed"]
    if bad_rows:
        firsts = "; ".join(str(b) for b in list(bad_rows)[:3])
        parts.append(f"{len(bad_rows)} bad rows skipped (first: {firsts})")
    if num_read and cfg_files.max_solution_steps is not None:
        parts.append(f"task.files.max_solution_steps={cfg_files.max_solution_steps} may have dropped the rest")
    if num_read and cfg_files.eval_path is None and cfg_files.eval_fraction > 0:
        parts.append(f"task.files.eval_fraction={cfg_files.eval_fraction} sends a share of the rows to eval; "
                     "a file this small may leave a split empty")
    return (f"task {task!r}: the {split} split of {source} has no usable prompt: " + ", ".join(parts)
            + "; fix the file's rows or point task.files at another file")


def load_split(task_cfg: Any, split: str, *, repo_root: str | Path | None = None,
               allowed_roots: Sequence[str | Path] | None = None) -> LoadResult:
    """Load one split of a real task, with the record of skipped rows.

    Args:
        task_cfg: the ``TaskConfig`` section (``name`` and ``files`` are read).
        split: ``"train"`` or ``"eval"``.
        repo_root: root that relative paths are resolved against (default: this repository).
        allowed_roots: folders data paths may lie under (default: ``default_allowed_roots``).

    Returns:
        ``LoadResult`` (prompts in file order, bad rows, paths and formats read). Prompts read from
        ``files.eval_path`` have ``example_id = "eval:<the row's id>"``.

    Raises:
        ValueError: on an unknown split.
        DataError: an unsupported task, a missing or disallowed path, a format that does not fit the task,
            an unreadable JSON array, an empty file, no eval data (no ``eval_path`` and ``eval_fraction == 0``),
            a split with no usable prompt (every row bad or filtered out), any bad row when
            ``files.on_bad_row == "raise"``, or ``files.max_solution_steps`` on rows without annotated
            solution steps (not GSM8K).
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    task = task_name(task_cfg)
    if task not in REAL_TASKS:
        raise DataError(f"task {task!r} has no data files: its environment generates its prompts "
                        f"(trace.envs.{task}); real-data tasks are {list(REAL_TASKS)}")
    cfg_files = task_cfg.files
    paths = effective_files(task_cfg)
    resolved = {key: (resolve_data_path(value, repo_root=repo_root, allowed_roots=allowed_roots) if value else None)
                for key, value in paths.items()}
    if resolved["train_path"] is None:
        raise DataError(f"task {task!r} has no offline default data; set task.files.train_path")
    if split == "eval" and resolved["eval_path"] is None and cfg_files.eval_fraction == 0:
        raise DataError(f"task {task!r} has no eval data: set task.files.eval_path or task.files.eval_fraction > 0")
    source_key = "eval_path" if split == "eval" and resolved["eval_path"] is not None else "train_path"
    source = resolved[source_key]
    require_file(source, source_key)
    collector = Collector(cfg_files.on_bad_row)
    formats = _load_source(task, source, resolved, cfg_files.format, collector)
    prompts = collector.prompts
    num_read = len(prompts)
    if source_key == "eval_path":
        prompts = [dataclasses.replace(p, example_id=f"{EVAL_FILE_ID_PREFIX}{p.example_id}") for p in prompts]
    if cfg_files.max_solution_steps is not None:
        prompts = _keep_solution_steps(prompts, cfg_files.max_solution_steps, source)
    if resolved["eval_path"] is None and cfg_files.eval_fraction > 0:
        in_eval = [_eval_share(_split_key(p)) < cfg_files.eval_fraction for p in prompts]
        prompts = [p for p, e in zip(prompts, in_eval) if e == (split == "eval")]
    limit = cfg_files.max_train if split == "train" else cfg_files.max_eval
    if limit is not None and cfg_files.subset == "spread":
        kept = set(sorted(range(len(prompts)), key=lambda i: _eval_share(f"subset/{_split_key(prompts[i])}"))[:limit])
        prompts = [p for i, p in enumerate(prompts) if i in kept]
    elif limit is not None:
        prompts = prompts[:limit]
    if collector.bad_rows:
        logger.warning("%s: skipped %d bad rows of %s (first: %s)", task, len(collector.bad_rows), source,
                       collector.bad_rows[0])
    if not prompts:
        raise DataError(_no_prompt_message(task, split, source, num_read, collector.bad_rows, cfg_files))
    return LoadResult(prompts=prompts, bad_rows=tuple(collector.bad_rows), paths=(str(source),),
                      formats=tuple(formats))


def load_prompts(task_cfg: Any, split: str, *, repo_root: str | Path | None = None,
                 allowed_roots: Sequence[str | Path] | None = None) -> list[Prompt]:
    """The prompts of one split of a real task (see ``load_split`` for arguments, errors and skipped rows).

    Returns:
        Prompts with ``data_source`` = the task name; bad rows are skipped with a logged count (or raise
        ``DataError`` with ``files.on_bad_row: raise``).
    """
    return load_split(task_cfg, split, repo_root=repo_root, allowed_roots=allowed_roots).prompts
