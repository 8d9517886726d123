"""Prepared prompt files: the ``prepare`` stage's output, one JSON object per line, written atomically.

Each line is a ``Prompt`` (data_source, example_id, question, answer, meta). Reading validates every
line and names the file and line of the first problem. Invariant: a ``prompt_uid`` occurs once across
every prepared split (``check_unique_prompt_uids``): it keys per-prompt history, tie-breaks and seeds, so a
train and an eval prompt that shared one would share those too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from trace.envs.base import Prompt, prompts_by_uid
from trace.errors import UserError
from trace.tree_io import atomic_write_bytes


class PreparedFileError(UserError, ValueError):
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
        PreparedFileError: missing file, invalid JSON, a missing field or a ``prompt_uid`` already read
            (names file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise PreparedFileError(f"{path}: no such file; run the prepare stage (dvc repro prepare)")
    out = []
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = Prompt(data_source=row["data_source"], example_id=str(row["example_id"]),
                                question=row["question"], answer=row.get("answer"), meta=row.get("meta") or {})
                uid = prompt.prompt_uid
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise PreparedFileError(f"{path}:{line_no}: malformed prompt line ({err!r}); rerun prepare") from None
            if uid in first_line:
                raise PreparedFileError(f"{path}:{line_no}: prompt_uid {uid!r} already on line {first_line[uid]}; "
                                        "prompt ids must be unique: rerun prepare")
            first_line[uid] = line_no
            out.append(prompt)
    return out


def check_unique_prompt_uids(splits: Mapping[str, Sequence[Prompt]]) -> None:
    """Check that no ``prompt_uid`` occurs twice within or across the given splits.

    Args:
        splits: prompts by split name, e.g. ``{"train": [...], "eval": [...]}``.

    Raises:
        PreparedFileError: naming the shared ``prompt_uid``, its two places (split and position) and the fix.
    """
    seen: dict[str, tuple[str, int]] = {}
    for split, prompts in splits.items():
        for idx, prompt in enumerate(prompts):
            uid = prompt.prompt_uid
            if uid in seen:
                other_split, other_idx = seen[uid]
                raise PreparedFileError(
                    f"prompt_uid {uid!r} is shared by {other_split} prompt {other_idx} and {split} prompt {idx}; "
                    "every prompt of a task needs its own id across splits (ids key per-prompt history, "
                    "tie-breaks and seeds): give the data rows distinct ids, or remove the duplicate row")
            seen[uid] = (split, idx)


def rl_prompt_pool(train_prompts: Sequence[Prompt], prompt_pool: int | None) -> list[Prompt]:
    """The prompts RL steps draw their candidates from: the first ``prompt_pool`` prepared training prompts in the
    split's order (``train.prompt_pool``; kgqa's questions are drawn in random order, a data file's rows keep the
    order ``prepare`` gave them), or all of them for None.

    With a pool of P prompts and B candidates a step, every prompt recurs once every P / B steps
    (``trace.training.seeding.candidate_indices`` draws epochs), which the allocators with per-prompt state read.

    Raises:
        ValueError: ``prompt_pool`` exceeds the prepared prompts; the message names the key.
    """
    if prompt_pool is None:
        return list(train_prompts)
    if prompt_pool > len(train_prompts):
        raise ValueError(f"train.prompt_pool={prompt_pool} exceeds the {len(train_prompts)} prepared training prompts: "
                         "lower it, or leave it unset (null) to draw from all of them")
    return list(train_prompts[:prompt_pool])
