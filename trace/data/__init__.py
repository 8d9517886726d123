"""Dataset loaders for the real tasks: files in their published formats -> ``Prompt`` lists.

Modules: ``records`` (reading JSON / JSON-lines rows), one module of row parsers per task family (``qa``, ``math``,
``fc``), and ``splits`` (``load_split``, ``load_prompts``). The environments themselves are built by
``trace.envs.registry.make_environment``.

Invariants kept here:
- ``Prompt.data_source`` is the task name (``TaskName`` value) and ``example_id`` is the file's own id
  (``id``, ``_id``, ``test_id``, ``unique_id``, ``qid``, ``question_id``) when the row has one, else the
  row's 0-based position among the file's records (API-Bank: ``<dialogue file stem>:<call index>``, its
  test-data ids being per dialogue), so
  ``prompt_uid = data_source/example_id`` never collides across sources (a data source has no ``/``).
  Rows of a separate eval file (``files.eval_path``) get ``eval:`` before that id, so they never share a
  ``prompt_uid`` with the train file's rows (both files may number rows from 0, or reuse their own ids);
  train-file ids, and so the hash split, are the file's own. Ids depend only on the files, never on
  the run. Within one loaded split a repeated id is a bad row.
- Nothing crashes mid-run on bad input: every problem is found at load time and either raises ``DataError``
  naming the file, the row (``line N`` for JSON lines, ``item N`` for a JSON array) and the fix, or, with
  ``on_bad_row: skip``, skips the row, logs one warning with the count and records each skip in
  ``LoadResult.bad_rows``. Bad rows: invalid JSON on a line, a line that is not UTF-8, a row that is not an
  object, an empty or missing question, a missing answer (or gold call), an answer no prediction could
  match (a QA answer whose every alias normalises to the empty string, such as ``")"`` or ``"The"``; a math
  answer with no number and nothing left after normalisation), a duplicate id. A JSON array file
  that does not parse (or is not UTF-8) cannot be read row by row and always raises.

Files (``TaskConfig.files``): ``train_path``, ``eval_path``, ``corpus_path`` (QA: the passage corpus for
BM25; API-Bank: the file whose prompts hold the API descriptions), ``answers_path`` (BFCL ``possible_answer``
file or folder); see ``trace.data_paths`` (which imports no environment, so the environments read files through it too) for how they resolve and ``trace.data.splits`` for the splits.
Formats (``files.format``, ``"auto"`` to detect): see the family modules.
"""

from __future__ import annotations

from trace.data_paths import (DATA_DIRS_ENV, DEFAULT_FILES, REPO_ROOT, BadRow, DataError, LoadResult,
                              default_allowed_roots, effective_files, resolve_data_path)
from trace.data.splits import EVAL_FILE_ID_PREFIX, REAL_TASKS, SPLITS, TASK_FORMATS, load_prompts, load_split

__all__ = ["DATA_DIRS_ENV", "DEFAULT_FILES", "REPO_ROOT", "BadRow", "DataError", "LoadResult",
           "default_allowed_roots", "effective_files", "resolve_data_path", "EVAL_FILE_ID_PREFIX", "REAL_TASKS",
           "SPLITS", "TASK_FORMATS", "load_prompts", "load_split"]
