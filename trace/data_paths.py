"""Where a task's data files are, and the errors and records of loading them.

Relative paths are resolved against the main repository (``trace.configuration.process_env.main_repository``: ``$DVC_ROOT``
under DVC, so a queued experiment's temporary copy reads the same files); a resolved path must lie under an
allowed root (that repository, ``<repo>/../shared/data``, or a folder listed in ``$TRACE_DATA_DIRS``, separated by
``os.pathsep``) so that a params file cannot point the pipeline at arbitrary files. When
``task.files.train_path`` is unset, the task's ``DEFAULT_FILES`` (the offline copies under
``../shared/data``) are used as a whole; when it is set, only the given paths are used.

This module imports no environment, so environments (``trace.envs.qa`` reads its corpus through it) and the
loaders of ``trace.data`` both import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from trace.errors import UserError
from trace.configuration.process_env import main_repository

if TYPE_CHECKING:
    from trace.envs.base import Prompt

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIRS_ENV = "TRACE_DATA_DIRS"

_SHARED = "../shared/data"
DEFAULT_FILES: dict[str, dict[str, str]] = {
    "hotpotqa": {"train_path": f"{_SHARED}/hotpotqa/rpt_hf_distractor_validation/dev.jsonl"},
    "musique": {"train_path": f"{_SHARED}/musique/hipporag_original_format/musique_train.json"},
    "2wikimultihopqa": {"train_path": f"{_SHARED}/2wikimultihopqa/dev_qa_only/dev.json",
                        "corpus_path": f"{_SHARED}/2wikimultihopqa/hipporag2_corpus/2wikimultihopqa_corpus.json"},
    "bamboogle": {"train_path": f"{_SHARED}/bamboogle/bamboogle_test_questions_and_answers.json"},
    "nq": {"train_path": f"{_SHARED}/nq/nq_test_questions_and_answers.json"},
    "gsm8k": {"train_path": f"{_SHARED}/gsm8k/train_first1000.jsonl"},
    "aime_amc": {"train_path": f"{_SHARED}/aime_amc/train_aime.json", "eval_path": f"{_SHARED}/aime_amc/aime.json"},
    "bfcl": {"train_path": f"{_SHARED}/bfcl", "answers_path": f"{_SHARED}/bfcl/possible_answer"},
    "api_bank": {"train_path": f"{_SHARED}/api_bank/lv1-lv2-samples/level-1-given-desc",
                 "corpus_path": f"{_SHARED}/api_bank/test-data/level-1-api.json"},
}
FILE_KEYS = ("train_path", "eval_path", "corpus_path", "answers_path")


class DataError(UserError, ValueError):
    """A data file is missing, outside the allowed roots, unreadable, or holds a bad row (with on_bad_row=raise)."""


@dataclass(frozen=True)
class BadRow:
    """One skipped row: the file, the row (``line N`` / ``item N``) and why."""

    path: str
    row: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path} {self.row}: {self.reason}"


@dataclass(frozen=True)
class LoadResult:
    """Prompts of one split and what was skipped on the way.

    Attributes:
        prompts: the split's prompts, in file order.
        bad_rows: every skipped row (empty with ``on_bad_row: raise``, which raises instead).
        paths: the files read.
        formats: the format of each file read.
    """

    prompts: list[Prompt]
    bad_rows: tuple[BadRow, ...] = ()
    paths: tuple[str, ...] = ()
    formats: tuple[str, ...] = ()

    @property
    def num_skipped(self) -> int:
        return len(self.bad_rows)


def default_allowed_roots(repo_root: str | Path | None = None) -> list[Path]:
    """The repository (default ``main_repository()``), ``<repo>/../shared/data`` and every folder in
    ``$TRACE_DATA_DIRS``."""
    root = Path(repo_root or main_repository()).resolve()
    roots = [root, (root.parent / "shared" / "data").resolve()]
    roots += [Path(p).expanduser().resolve() for p in os.environ.get(DATA_DIRS_ENV, "").split(os.pathsep) if p.strip()]
    return roots


def resolve_data_path(path: str | Path, *, repo_root: str | Path | None = None,
                      allowed_roots: Sequence[str | Path] | None = None) -> Path:
    """Resolve a params path against the repository root and check it lies under an allowed root.

    Args:
        path: relative (to ``repo_root``) or absolute path; symlinks are resolved before the check.
        repo_root: the repository root (default: ``main_repository()``, the folder holding ``trace/`` outside DVC).
        allowed_roots: folders the path may lie under (default: ``default_allowed_roots(repo_root)``).

    Returns:
        The absolute, resolved path (it may not exist; callers check).

    Raises:
        DataError: if the path resolves outside every allowed root.
    """
    root = Path(repo_root or main_repository()).resolve()
    raw = Path(path).expanduser()
    full = (raw if raw.is_absolute() else root / raw).resolve()
    roots = [Path(r).expanduser().resolve() for r in
             (allowed_roots if allowed_roots is not None else default_allowed_roots(root))]
    if not any(full == r or full.is_relative_to(r) for r in roots):
        raise DataError(f"data path {str(path)!r} resolves to {full}, outside the allowed data folders "
                        f"{[str(r) for r in roots]}; move the data under the repository or ../shared/data, or add "
                        f"its folder to ${DATA_DIRS_ENV} ({os.pathsep!r}-separated)")
    return full


def task_name(task_cfg: Any) -> str:
    """The task name of a ``TaskConfig`` section as a plain string (``task_cfg.name`` is a ``TaskName``)."""
    return str(getattr(task_cfg.name, "value", task_cfg.name))


def effective_files(task_cfg: Any) -> dict[str, str | None]:
    """The file paths a task reads: the configured ones, or the task's ``DEFAULT_FILES`` when
    ``files.train_path`` is unset (then every path comes from the defaults)."""
    files = task_cfg.files
    if files.train_path is not None:
        return {key: getattr(files, key) for key in FILE_KEYS}
    defaults = DEFAULT_FILES.get(task_name(task_cfg), {})
    return {key: defaults.get(key) for key in FILE_KEYS}


def require_file(path: Path, key: str) -> None:
    """Check that the path given as ``task.files.<key>`` exists.

    Raises:
        DataError: if it does not (names the key and an example path).
    """
    if not path.exists():
        raise DataError(f"{path}: not found (task.files.{key}); paths are relative to the repository root, "
                        "e.g. ../shared/data/gsm8k/train_first1000.jsonl")
