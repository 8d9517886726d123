"""Prepared prompt files: the ``prepare`` stage's output, one JSON object per line, written atomically.

Each line is a ``Prompt`` (data_source, example_id, question, answer, meta). Reading validates every
line and names the file and line of the first problem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from trace.envs.base import Prompt, prompts_by_uid
from trace.tree_io import atomic_write_bytes


class PreparedFileError(ValueError):
    """A prepared prompt file is missing or malformed."""


def save_prompts(prompts: Sequence[Prompt], path: str | Path) -> Path:
    """Write prompts as JSON lines (atomic).

    Raises:
        ValueError: on duplicate ``prompt_uid``.
    """
    prompts_by_uid(prompts)
    lines = [json.dumps({"data_source": p.data_source, "example_id": p.example_id, "question": p.question,
                         "answer": p.answer, "meta": p.meta}, ensure_ascii=False, sort_keys=True)
             for p in prompts]
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8") if lines else b"")
    return Path(path)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a file written by ``save_prompts``.

    Raises:
        PreparedFileError: missing file, invalid JSON or missing field (names file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise PreparedFileError(f"{path}: no such file; run the prepare stage (dvc repro prepare)")
    out = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(Prompt(data_source=row["data_source"], example_id=str(row["example_id"]),
                                  question=row["question"], answer=row.get("answer"), meta=row.get("meta") or {}))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise PreparedFileError(f"{path}:{line_no}: malformed prompt line ({err!r}); rerun prepare") from None
    return out
