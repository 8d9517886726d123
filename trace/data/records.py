"""Reading the rows of a data file (JSON lines or a JSON array) and collecting them as prompts.

A row that cannot be read (invalid JSON on a line, a line that is not UTF-8) is yielded as a ``RowError``
so the loader can skip it with a recorded ``BadRow``; a JSON array that does not parse cannot be read row by
row and raises ``DataError``. ``Collector`` keeps the prompts of one load, turns a repeated ``prompt_uid``
into a bad row, and raises at the first bad row when ``on_bad_row == "raise"``.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from trace.data_paths import BadRow, DataError
from trace.envs.base import Prompt

ID_KEYS = ("id", "_id", "test_id", "unique_id", "qid", "question_id")

RowParser = Callable[[dict, str, int], Prompt]  # (record, task name, row index) -> prompt; raises RowError


class RowError(Exception):
    """A row that cannot become a prompt; the message is the reason."""


def _line_of_offset(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def iter_records(path: Path) -> Iterator[tuple[str, int, Any]]:
    """Yield ``(row label, row index, record)``; a row that cannot be read yields a ``RowError`` as record.

    Args:
        path: a JSON lines file or a JSON array file (told apart by the contents; a ``.jsonl`` or ``.ndjson``
            suffix always means JSON lines).

    Returns:
        An iterator of ``("line N" | "item N", 0-based index among the records, record)``.

    Raises:
        DataError: a JSON array (or a single multi-line object) that is not UTF-8 or does not parse.
    """
    data = path.read_bytes()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    head = data.lstrip()[:1]
    is_jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    if not is_jsonl and head in (b"[", b"{"):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            if head == b"[":
                raise DataError(f"{path}: not valid UTF-8 at line {_line_of_offset(data, err.start)} (byte "
                                f"0x{data[err.start]:02x}); a JSON array cannot be read row by row: re-encode the "
                                "file as UTF-8") from None
            text = None
        if head == b"[":
            try:
                document = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: JSON error at line {err.lineno} column {err.colno}: {err.msg}; the file "
                                "is one JSON array and cannot be read past the error: fix it") from None
            for idx, record in enumerate(document):
                yield f"item {idx}", idx, record
            return
        if text is not None and len(text.strip().splitlines()) > 1:
            try:
                document = json.loads(text)
            except json.JSONDecodeError:
                document = None
            if isinstance(document, dict):
                raise DataError(f"{path}: holds one JSON object over several lines; expected JSON lines (one "
                                "object per line) or a JSON array of rows")
    row_idx = 0
    for line_no, raw_line in enumerate(data.split(b"\n"), start=1):
        if not raw_line.strip():
            continue
        idx, row_idx = row_idx, row_idx + 1
        label = f"line {line_no}"
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as err:
            yield label, idx, RowError(f"not valid UTF-8 (byte 0x{raw_line[err.start]:02x} at column {err.start + 1})")
            continue
        try:
            yield label, idx, json.loads(line)
        except json.JSONDecodeError as err:
            yield label, idx, RowError(f"JSON error at column {err.colno}: {err.msg}")


def example_id(record: dict, row_idx: int) -> str:
    """The row's own id (the first non-empty of ``ID_KEYS``), else its 0-based position among the records."""
    for key in ID_KEYS:
        value = record.get(key)
        if value is not None and str(value).strip():
            return str(value).strip()
    return str(row_idx)


def question_text(record: dict, key: str = "question") -> str:
    """The row's question, stripped.

    Raises:
        RowError: the field is missing, not a string, or empty.
    """
    if key not in record:
        raise RowError(f"missing question (field {key!r})")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"empty question (field {key!r})")
    return value.strip()


@dataclass
class Collector:
    """Prompts and bad rows of one load; raises at the first bad row when ``on_bad_row == 'raise'``."""

    on_bad_row: str
    prompts: list[Prompt] = field(default_factory=list)
    bad_rows: list[BadRow] = field(default_factory=list)
    _seen: dict[str, str] = field(default_factory=dict)

    def bad(self, path: Path | str, row: str, reason: str) -> None:
        """Record a bad row.

        Raises:
            DataError: with ``on_bad_row == "raise"`` (names the file, the row and the fix).
        """
        bad = BadRow(str(path), row, reason)
        if self.on_bad_row == "raise":
            raise DataError(f"{bad}; fix the row, or set task.files.on_bad_row: skip to skip bad rows")
        self.bad_rows.append(bad)

    def add(self, prompt: Prompt, path: Path | str, row: str) -> None:
        """Keep a prompt, or record it as a bad row when its ``prompt_uid`` was already kept."""
        where = f"{path} {row}"
        if prompt.prompt_uid in self._seen:
            self.bad(path, row, f"duplicate id {prompt.example_id!r} (first at {self._seen[prompt.prompt_uid]})")
            return
        self._seen[prompt.prompt_uid] = where
        self.prompts.append(prompt)


def collect_rows(rows: list[tuple[str, int, Any]], path: Path, task: str, parse: RowParser,
                 collector: Collector) -> None:
    """Parse every row of one file (as ``iter_records`` yields them) into ``collector``, in file order.

    Args:
        rows: ``(label, row index, record)`` triples of the file at ``path``.
        path: the file, for bad-row records.
        task: the task name (the prompts' ``data_source``).
        parse: the format's row parser.
        collector: receives the prompts and bad rows.

    Raises:
        DataError: at the first bad row when ``collector.on_bad_row == "raise"``.
    """
    for label, row_idx, record in rows:
        if isinstance(record, RowError):
            collector.bad(path, label, str(record))
            continue
        if not isinstance(record, dict):
            collector.bad(path, label, f"a row must be a JSON object, got {type(record).__name__}")
            continue
        try:
            prompt = parse(record, task, row_idx)
        except RowError as err:
            collector.bad(path, label, str(err))
            continue
        collector.add(prompt, path, label)
