"""Dataset loaders for the real tasks: files in their published formats -> ``Prompt`` lists, and the
environments that score them.

Invariants kept here:
- ``Prompt.data_source`` is the task name (``TaskName`` value) and ``example_id`` is the file's own id
  (``id``, ``_id``, ``test_id``, ``unique_id``, ``qid``, ``question_id``) when the row has one, else the
  row's 0-based position among the file's records (API-Bank: ``<dialogue file stem>:<call index>``, its
  test-data ids being per dialogue), so
  ``prompt_uid = data_source/example_id`` never collides across sources (a data source has no ``/``).
  Rows of a separate eval file (``files.eval_path``) get ``eval:`` before that id, so they never share a
  ``prompt_uid`` with the train file's rows (both files may number rows from 0, or reuse their own ids);
  train-file ids, and so the hash split below, are the file's own. Ids depend only on the files, never on
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
file or folder). Relative paths are resolved against the repository root; a resolved path must lie under an
allowed root (the repository, ``<repo>/../shared/data``, or a folder listed in ``$TRACE_DATA_DIRS``,
separated by ``os.pathsep``) so that a params file cannot point the pipeline at arbitrary files; pass
``allowed_roots`` to choose others. When ``train_path`` is unset, the task's ``DEFAULT_FILES`` (the offline
copies under ``../shared/data``) are used as a whole; when it is set, only the given paths are used.

Splits: ``"train"`` and ``"eval"``. With ``eval_path`` each split is its own file. Without it, a
deterministic hash of each prompt's ``prompt_uid`` (of ``meta["dialogue"]`` for API-Bank, so one dialogue's
calls stay together) sends an ``eval_fraction`` share to ``"eval"``; the assignment does not depend on row
order or on the other rows. ``max_train`` / ``max_eval`` then keep the first N.

Formats (``files.format``: ``"auto"`` detects from the first readable row's fields; JSON lines or a JSON
array are told apart by the contents, and a ``.jsonl`` suffix always means JSON lines):

=====================  ====================================================================================
``hotpot_hf``          HF ``hotpot_qa``: ``id, question, answer, context{title[], sentences[][]}``
``hotpot_original``    original HotpotQA / 2Wiki: ``_id, question, answer, context[[title, [sentence]]]``
``musique``            ``id, question, answer, answer_aliases, paragraphs[{title, paragraph_text}]``
``qa_pairs``           ``question, answer`` (str or list of aliases): 2Wiki dev, Bamboogle, NQ, MuSiQue dev
``gsm8k``              ``question, answer`` ending ``#### <number>``
``math``               ``problem`` + ``answer`` or a ``\\boxed{}`` in ``solution``: MATH, AIME, AMC
``bfcl``               BFCL v4 single-turn question file (JSON lines) + ``possible_answer`` by id; a folder
                       loads every ``BFCL_*.json`` in it except multi-turn ones
``api_bank_dialogues`` a folder of API-Bank dialogues (``lv1-lv2-samples/level-1-given-desc``): one prompt
                       per API call, the dialogue before it as the request
``api_bank_test``      API-Bank ``test-data/level-1-api.json``: ``instruction, input, expected_output``
=====================  ====================================================================================
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from trace.envs.base import Prompt
from trace.envs.fc import (API_BANK_CATEGORY, FC_TASKS, IRRELEVANCE_CATEGORIES, RELEVANCE_CATEGORIES, CallSyntaxError,
                           api_bank_function, parse_api_bank_descriptions, parse_api_bank_request, parse_calls,
                           render_call)
from trace.envs.math import MATH_TASKS, canonical_answer, gsm8k_calculations, gsm8k_final_answer
from trace.envs.answers import extract_boxed, is_empty_math_answer, parse_number
from trace.envs.qa import QA_TASKS, gold_aliases

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIRS_ENV = "TRACE_DATA_DIRS"
SPLITS = ("train", "eval")
REAL_TASKS = QA_TASKS + MATH_TASKS + FC_TASKS
ID_KEYS = ("id", "_id", "test_id", "unique_id", "qid", "question_id")
EVAL_FILE_ID_PREFIX = "eval:"  # before the ids of a separate eval file's rows
API_BANK_PREAMBLE = "The current year is 2023."  # API-Bank's level-1 prompt states it; gold dates assume it

TASK_FORMATS: dict[str, tuple[str, ...]] = {
    **{task: ("hotpot_hf", "hotpot_original", "musique", "qa_pairs") for task in QA_TASKS},
    **{task: ("gsm8k", "math") for task in MATH_TASKS},
    "bfcl": ("bfcl",),
    "api_bank": ("api_bank_dialogues", "api_bank_test"),
}

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
_FILE_KEYS = ("train_path", "eval_path", "corpus_path", "answers_path")


class DataError(ValueError):
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


class _RowError(Exception):
    """A row that cannot become a prompt; the message is the reason."""


# ---------------------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------------------

def default_allowed_roots(repo_root: str | Path | None = None) -> list[Path]:
    """The repository, ``<repo>/../shared/data`` and every folder in ``$TRACE_DATA_DIRS``."""
    root = Path(repo_root or REPO_ROOT).resolve()
    roots = [root, (root.parent / "shared" / "data").resolve()]
    roots += [Path(p).expanduser().resolve() for p in os.environ.get(DATA_DIRS_ENV, "").split(os.pathsep) if p.strip()]
    return roots


def resolve_data_path(path: str | Path, *, repo_root: str | Path | None = None,
                      allowed_roots: Sequence[str | Path] | None = None) -> Path:
    """Resolve a params path against the repository root and check it lies under an allowed root.

    Args:
        path: relative (to ``repo_root``) or absolute path; symlinks are resolved before the check.
        repo_root: the repository root (default: the folder holding ``trace/``).
        allowed_roots: folders the path may lie under (default: ``default_allowed_roots(repo_root)``).

    Returns:
        The absolute, resolved path (it may not exist; callers check).

    Raises:
        DataError: if the path resolves outside every allowed root.
    """
    root = Path(repo_root or REPO_ROOT).resolve()
    raw = Path(path).expanduser()
    full = (raw if raw.is_absolute() else root / raw).resolve()
    roots = [Path(r).expanduser().resolve() for r in
             (allowed_roots if allowed_roots is not None else default_allowed_roots(root))]
    if not any(full == r or full.is_relative_to(r) for r in roots):
        raise DataError(f"data path {str(path)!r} resolves to {full}, outside the allowed data folders "
                        f"{[str(r) for r in roots]}; move the data under the repository or ../shared/data, or add "
                        f"its folder to ${DATA_DIRS_ENV} ({os.pathsep!r}-separated)")
    return full


def _task_name(task_cfg: Any) -> str:
    return str(getattr(task_cfg.name, "value", task_cfg.name))


def effective_files(task_cfg: Any) -> dict[str, str | None]:
    """The file paths a task reads: the configured ones, or the task's ``DEFAULT_FILES`` when
    ``files.train_path`` is unset (then every path comes from the defaults)."""
    files = task_cfg.files
    if files.train_path is not None:
        return {key: getattr(files, key) for key in _FILE_KEYS}
    defaults = DEFAULT_FILES.get(_task_name(task_cfg), {})
    return {key: defaults.get(key) for key in _FILE_KEYS}


# ---------------------------------------------------------------------------------------------------------
# Reading records
# ---------------------------------------------------------------------------------------------------------

def _line_of_offset(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _iter_records(path: Path) -> Iterator[tuple[str, int, Any]]:
    """Yield ``(row label, row index, record)``; a row that cannot be read yields a ``_RowError`` as record.

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
            yield label, idx, _RowError(f"not valid UTF-8 (byte 0x{raw_line[err.start]:02x} at column {err.start + 1})")
            continue
        try:
            yield label, idx, json.loads(line)
        except json.JSONDecodeError as err:
            yield label, idx, _RowError(f"JSON error at column {err.colno}: {err.msg}")


def _require_file(path: Path, key: str) -> None:
    if not path.exists():
        raise DataError(f"{path}: not found (task.files.{key}); paths are relative to the repository root, "
                        "e.g. ../shared/data/gsm8k/train_first1000.jsonl")


# ---------------------------------------------------------------------------------------------------------
# Row parsers
# ---------------------------------------------------------------------------------------------------------

def _example_id(record: dict, row_idx: int) -> str:
    for key in ID_KEYS:
        value = record.get(key)
        if value is not None and str(value).strip():
            return str(value).strip()
    return str(row_idx)


def _question(record: dict, key: str = "question") -> str:
    if key not in record:
        raise _RowError(f"missing question (field {key!r})")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise _RowError(f"empty question (field {key!r})")
    return value.strip()


def _qa_golds(record: dict) -> list[str]:
    """The row's scorable gold aliases; aliases that normalise to the empty string are dropped."""
    golds: list[str] = []
    given: list[str] = []
    for key in ("answer", "answers", "golden_answers", "answer_aliases"):
        value = record.get(key)
        given += [str(a) for a in (value if isinstance(value, (list, tuple)) else [value])
                  if a is not None and str(a).strip()]
        for alias in gold_aliases(value):
            if alias not in golds:
                golds.append(alias)
    if not golds and given:
        raise _RowError(f"answer {given!r} is empty after answer normalisation (lowercase, no punctuation, no "
                        "a/an/the), so exact match could not score it; fix the answer or drop the row")
    if not golds:
        raise _RowError("missing answer (field 'answer')")
    return golds


def _joined(sentences: Any) -> str:
    return "".join(str(s) for s in sentences) if isinstance(sentences, list) else str(sentences)


def _parse_hotpot_hf(record: dict, task: str, row_idx: int) -> Prompt:
    context = record.get("context")
    if not isinstance(context, dict) or not isinstance(context.get("title"), list) \
            or not isinstance(context.get("sentences"), list) or len(context["title"]) != len(context["sentences"]):
        raise _RowError("context must be {'title': [...], 'sentences': [[...], ...]} of equal lengths")
    paragraphs = [[str(t), _joined(s)] for t, s in zip(context["title"], context["sentences"])]
    meta = {"context": paragraphs, **({"type": record["type"]} if isinstance(record.get("type"), str) else {})}
    return Prompt(task, _example_id(record, row_idx), _question(record), _qa_golds(record), meta)


def _parse_hotpot_original(record: dict, task: str, row_idx: int) -> Prompt:
    context = record.get("context")
    if not isinstance(context, list) or not all(isinstance(p, list) and len(p) == 2 for p in context):
        raise _RowError("context must be [[title, [sentence, ...]], ...]")
    paragraphs = [[str(t), _joined(s)] for t, s in context]
    meta = {"context": paragraphs, **({"type": record["type"]} if isinstance(record.get("type"), str) else {})}
    return Prompt(task, _example_id(record, row_idx), _question(record), _qa_golds(record), meta)


def _parse_musique(record: dict, task: str, row_idx: int) -> Prompt:
    paragraphs = record.get("paragraphs")
    if not isinstance(paragraphs, list) or not all(isinstance(p, dict) for p in paragraphs):
        raise _RowError("paragraphs must be a list of {'title', 'paragraph_text'}")
    if record.get("answerable") is False:
        raise _RowError("unanswerable item (MuSiQue-Full contrast question); exact-match rewards need an answer")
    context = [[str(p.get("title", "")), str(p.get("paragraph_text", p.get("text", "")))] for p in paragraphs]
    example_id = _example_id(record, row_idx)
    hops = re.match(r"(\d)hop", example_id)
    meta: dict = {"context": context, **({"hops": int(hops.group(1))} if hops else {})}
    return Prompt(task, example_id, _question(record), _qa_golds(record), meta)


def _parse_qa_pairs(record: dict, task: str, row_idx: int) -> Prompt:
    return Prompt(task, _example_id(record, row_idx), _question(record), _qa_golds(record), {})


def _require_math_answer(answer: str) -> None:
    if is_empty_math_answer(answer):
        raise _RowError(f"answer {answer!r} holds no number and nothing is left after normalisation, so no "
                        "prediction could match it; fix the answer or drop the row")


def _parse_gsm8k(record: dict, task: str, row_idx: int) -> Prompt:
    question = _question(record)
    solution = record.get("answer")
    if not isinstance(solution, (str, int, float)) or isinstance(solution, bool) or not str(solution).strip():
        raise _RowError("missing answer (field 'answer')")
    solution = str(solution)
    final = gsm8k_final_answer(solution)
    if final is None:
        if parse_number(solution) is None:
            raise _RowError("answer has no final '#### <number>' line")
        final = solution.strip()
    _require_math_answer(final)
    meta = {"calculations": gsm8k_calculations(solution)}
    return Prompt(task, _example_id(record, row_idx), question, final, meta)


def _parse_math(record: dict, task: str, row_idx: int) -> Prompt:
    question = _question(record, "problem")
    answer = record.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        solution = record.get("solution")
        answer = extract_boxed(solution) if isinstance(solution, str) else None
        if not answer:
            raise _RowError("missing answer: no 'answer' field and no \\boxed{} in 'solution'")
    meta = {key: record[key] for key in ("level", "type", "subject", "year", "url", "difficulty")
            if isinstance(record.get(key), (str, int, float)) and not isinstance(record.get(key), bool)}
    answer = canonical_answer(answer)
    _require_math_answer(answer)
    return Prompt(task, _example_id(record, row_idx), question, answer, meta)


def _bfcl_category(example_id: str) -> str:
    match = re.match(r"^(.*?)_\d+(?:-\d+)*$", example_id)
    return match.group(1) if match else example_id


def _bfcl_request(question: Any) -> str:
    if not isinstance(question, list) or not question:
        raise _RowError("missing question (field 'question': a list of turns)")
    if len(question) > 1:
        raise _RowError(f"multi-turn item ({len(question)} turns); only single-turn categories are supported")
    lines = []
    for message in question[0] if isinstance(question[0], list) else [question[0]]:
        if not isinstance(message, dict):
            raise _RowError("each message must be {'role', 'content'}")
        content = str(message.get("content", "")).strip()
        if content:
            lines.append(content if message.get("role") == "user" else f"{str(message.get('role')).title()}: {content}")
    if not lines:
        raise _RowError("empty question")
    return "\n".join(lines)


def _valid_ground_truth(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(e, dict) and len(e) == 1 and isinstance(next(iter(e.values())), dict) for e in value)


def _make_bfcl_parser(answers: dict[str, Any], answers_label: str) -> Callable[[dict, str, int], Prompt]:
    def parse(record: dict, task: str, row_idx: int) -> Prompt:
        example_id = _example_id(record, row_idx)
        category = _bfcl_category(example_id)
        if category.startswith("multi_turn"):
            raise _RowError(f"multi-turn category {category!r} is not supported (it needs BFCL's API simulators)")
        request = _bfcl_request(record.get("question"))
        functions = record.get("function")
        if not isinstance(functions, list) or not functions or not all(isinstance(f, dict) and "name" in f
                                                                       for f in functions):
            raise _RowError("missing functions (field 'function': a list of {'name', 'parameters', ...})")
        if category in IRRELEVANCE_CATEGORIES:
            answer: Any = []
        elif category in RELEVANCE_CATEGORIES:
            answer = None
        else:
            answer = answers.get(example_id)
            if not _valid_ground_truth(answer):
                raise _RowError(f"missing answer: no ground truth for id {example_id!r} in {answers_label}")
        return Prompt(task, example_id, request, answer, {"category": category, "functions": functions})
    return parse


def _parse_api_bank_test(record: dict, task: str, row_idx: int) -> Prompt:
    instruction, history, expected = record.get("instruction"), record.get("input"), record.get("expected_output")
    if not isinstance(history, str) or not history.strip():
        raise _RowError("empty question (field 'input')")
    if not isinstance(expected, str) or "API-Request:" not in expected:
        raise _RowError("missing answer: 'expected_output' holds no 'API-Request: [...]'")
    request_text = expected.split("API-Request:", 1)[1].strip()
    try:
        calls = parse_calls(request_text)
    except CallSyntaxError as err:
        fallback = parse_api_bank_request(request_text)  # quotes inside values, as API-Bank writes lists
        if fallback is None:
            raise _RowError(f"expected_output is not a parseable call ({err})") from None
        calls = [fallback]
    if len(calls) != 1:
        raise _RowError(f"expected_output holds {len(calls)} calls, expected 1")
    functions = [api_bank_function(d) for d in parse_api_bank_descriptions(str(instruction or ""))]
    if not functions:
        raise _RowError("instruction lists no 'API descriptions:'")
    year = re.search(r"The current year is \d{4}\.", str(instruction or ""))
    request = history.strip()
    if request.endswith("Generate API Request:"):
        request = request[: -len("Generate API Request:")].rstrip()
    request = f"{year.group(0) if year else API_BANK_PREAMBLE}\n{request}"
    dialogue = str(record.get("file") or "")
    # ids restart in every source dialogue: <dialogue stem>:<id>, as the dialogue loader names its calls
    example_id = (f"{Path(dialogue).stem}:{record['id']}" if dialogue and "id" in record
                  else _example_id(record, row_idx))
    meta = {"category": API_BANK_CATEGORY, "functions": functions, **({"dialogue": dialogue} if dialogue else {})}
    return Prompt(task, example_id, request, [{calls[0].name: calls[0].arguments}], meta)


_PARSERS: dict[str, Callable[[dict, str, int], Prompt]] = {
    "hotpot_hf": _parse_hotpot_hf, "hotpot_original": _parse_hotpot_original, "musique": _parse_musique,
    "qa_pairs": _parse_qa_pairs, "gsm8k": _parse_gsm8k, "math": _parse_math, "api_bank_test": _parse_api_bank_test,
}


def _detect_format(task: str, record: dict) -> str | None:
    if task in QA_TASKS:
        if "paragraphs" in record:
            return "musique"
        if isinstance(record.get("context"), dict):
            return "hotpot_hf"
        if isinstance(record.get("context"), list):
            return "hotpot_original"
        return "qa_pairs" if "question" in record else None
    if task in MATH_TASKS:
        if "problem" in record:
            return "math"
        return "gsm8k" if "question" in record else None
    if task == "bfcl":
        return "bfcl" if "function" in record and "question" in record else None
    if task == "api_bank":
        return "api_bank_test" if "expected_output" in record else None
    return None


# ---------------------------------------------------------------------------------------------------------
# Loading one source
# ---------------------------------------------------------------------------------------------------------

@dataclass
class _Collector:
    """Prompts and bad rows of one load; raises at the first bad row when ``on_bad_row == 'raise'``."""

    on_bad_row: str
    prompts: list[Prompt] = field(default_factory=list)
    bad_rows: list[BadRow] = field(default_factory=list)
    _seen: dict[str, str] = field(default_factory=dict)

    def bad(self, path: Path | str, row: str, reason: str) -> None:
        bad = BadRow(str(path), row, reason)
        if self.on_bad_row == "raise":
            raise DataError(f"{bad}; fix the row, or set task.files.on_bad_row: skip to skip bad rows")
        self.bad_rows.append(bad)

    def add(self, prompt: Prompt, path: Path | str, row: str) -> None:
        where = f"{path} {row}"
        if prompt.prompt_uid in self._seen:
            self.bad(path, row, f"duplicate id {prompt.example_id!r} (first at {self._seen[prompt.prompt_uid]})")
            return
        self._seen[prompt.prompt_uid] = where
        self.prompts.append(prompt)


def _load_records_file(path: Path, task: str, fmt: str, collector: _Collector,
                       parser: Callable[[dict, str, int], Prompt] | None = None) -> str:
    """Parse every row of one JSON / JSON-lines file into ``collector``; return the format used."""
    rows = list(_iter_records(path))
    if fmt == "auto":
        fmt = next((f for _, _, r in rows if isinstance(r, dict) for f in [_detect_format(task, r)] if f), None) or ""
        if not fmt:
            first = next((r for _, _, r in rows if isinstance(r, dict)), None)
            fields = sorted(first)[:12] if isinstance(first, dict) else None
            raise DataError(f"{path}: cannot tell the format for task {task!r} (first row fields {fields}); set "
                            f"task.files.format to one of {list(TASK_FORMATS[task])}")
    parse = parser or _PARSERS[fmt]
    for label, row_idx, record in rows:
        if isinstance(record, _RowError):
            collector.bad(path, label, str(record))
            continue
        if not isinstance(record, dict):
            collector.bad(path, label, f"a row must be a JSON object, got {type(record).__name__}")
            continue
        try:
            prompt = parse(record, task, row_idx)
        except _RowError as err:
            collector.bad(path, label, str(err))
            continue
        collector.add(prompt, path, label)
    return fmt


def _load_bfcl_answers(path: Path, collector: _Collector) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    if not path.is_file():
        return answers
    for label, _, record in _iter_records(path):
        if isinstance(record, _RowError):
            collector.bad(path, label, str(record))
        elif isinstance(record, dict) and "id" in record:
            answers[str(record["id"])] = record.get("ground_truth")
        else:
            collector.bad(path, label, "an answer row needs 'id' and 'ground_truth'")
    return answers


def _load_bfcl(path: Path, answers_path: Path | None, collector: _Collector) -> list[str]:
    """BFCL: one question file, or every single-turn ``BFCL_*.json`` of a folder, with answers by id."""
    if path.is_dir():
        files = sorted(p for p in path.glob("BFCL_*.json") if "multi_turn" not in p.name)
        skipped = sorted(p.name for p in path.glob("BFCL_*.json") if "multi_turn" in p.name)
        if skipped:
            logger.info("BFCL: not loading multi-turn files %s (they need BFCL's API simulators)", skipped)
        if not files:
            raise DataError(f"{path}: no BFCL_*.json question files in this folder")
    else:
        files = [path]
    for question_file in files:
        if answers_path is None:
            answer_file = question_file.parent / "possible_answer" / question_file.name
        elif answers_path.is_dir():
            answer_file = answers_path / question_file.name
        else:
            answer_file = answers_path
        if not answer_file.is_file() and "relevance" not in question_file.name:
            raise DataError(f"{answer_file}: no possible_answer file for {question_file.name}; set "
                            "task.files.answers_path to BFCL's possible_answer folder or file")
        answers = _load_bfcl_answers(answer_file, collector)
        _load_records_file(question_file, "bfcl", "bfcl", collector, _make_bfcl_parser(answers, str(answer_file)))
    return ["bfcl"] * len(files)


def _load_api_bank_descriptions(path: Path | None) -> dict[str, dict]:
    """API descriptions by name from an API-Bank test-data file (its instructions) or JSON lines of descriptions."""
    if path is None:
        return {}
    _require_file(path, "corpus_path")
    descriptions: dict[str, dict] = {}
    for label, _, record in _iter_records(path):
        if not isinstance(record, dict):
            continue
        found = parse_api_bank_descriptions(str(record["instruction"])) if "instruction" in record else (
            [record] if "name" in record and "input_parameters" in record else [])
        for description in found:
            descriptions.setdefault(description["name"], description)
    if not descriptions:
        raise DataError(f"{path}: holds no API-Bank API descriptions (prompts with 'API descriptions:' or JSON lines "
                        "of {'name', 'input_parameters'}); set task.files.corpus_path to API-Bank test-data/"
                        "level-1-api.json")
    return descriptions


def _render_api_output(output: Any) -> str:
    return output if isinstance(output, str) else repr(output)


def _load_api_bank_dialogues(folder: Path, descriptions: dict[str, dict], collector: _Collector) -> None:
    """One prompt per API call of every dialogue file (JSON lines of User / AI / API turns)."""
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise DataError(f"{folder}: no *.jsonl dialogue files (expected API-Bank lv1-lv2-samples/level-1-given-desc)")
    for path in files:
        turns = []
        broken = None
        for label, _, record in _iter_records(path):
            if isinstance(record, _RowError):
                broken = (label, str(record))
            elif not isinstance(record, dict) or record.get("role") not in ("User", "AI", "API"):
                broken = (label, "a turn needs role User, AI or API")
            elif record["role"] == "API" and (not isinstance(record.get("api_name"), str)
                                              or not isinstance(record.get("param_dict"), dict)):
                broken = (label, "missing answer: an API turn needs 'api_name' and 'param_dict'")
            else:
                turns.append(record)
            if broken:
                break
        if broken:  # later calls would see a gap in their history: skip the whole dialogue
            collector.bad(path, broken[0], f"{broken[1]} (dialogue skipped)")
            continue
        called = [t["api_name"] for t in turns if t["role"] == "API"]
        named = path.stem.split("-level-")[0].split("-")
        names = list(dict.fromkeys(called + [n for n in named if n in descriptions]))
        functions = []
        for name in names:
            if name in descriptions:
                functions.append(api_bank_function(descriptions[name]))
            else:  # no description: list the arguments seen in this dialogue
                seen = list(dict.fromkeys(k for t in turns if t.get("api_name") == name for k in t["param_dict"]))
                functions.append(api_bank_function({"name": name, "description": "",
                                                    "input_parameters": {k: {"type": "str"} for k in seen}}))
        history: list[str] = []
        call_idx = 0
        for turn_no, turn in enumerate(turns):
            if turn["role"] != "API":
                history.append(f"{turn['role']}: {str(turn.get('text', '')).strip()}")
                continue
            call_text = render_call(turn["api_name"], turn["param_dict"])
            if not history:
                collector.bad(path, f"turn {turn_no}", "empty question: an API call before any dialogue")
            else:
                request = API_BANK_PREAMBLE + "\n" + "\n".join(history)
                meta = {"category": API_BANK_CATEGORY, "functions": functions, "dialogue": path.name}
                prompt = Prompt("api_bank", f"{path.stem}:{call_idx}", request,
                                [{turn["api_name"]: dict(turn["param_dict"])}], meta)
                collector.add(prompt, path, f"turn {turn_no}")
            result = turn.get("result") if isinstance(turn.get("result"), dict) else {}
            history.append(f"API-Request: [{call_text}]->{_render_api_output(result.get('output'))}")
            call_idx += 1


def _load_source(task: str, path: Path, files: dict[str, Path | None], fmt: str, collector: _Collector) -> list[str]:
    """Load one train/eval source (file or folder) into ``collector``; return the formats used."""
    if fmt != "auto" and fmt not in TASK_FORMATS[task]:
        raise DataError(f"task.files.format={fmt!r} is not a format of task {task!r}; use 'auto' or one of "
                        f"{list(TASK_FORMATS[task])}")
    if task == "bfcl":
        return _load_bfcl(path, files.get("answers_path"), collector)
    if task == "api_bank" and (path.is_dir() or fmt == "api_bank_dialogues"):
        if not path.is_dir():
            raise DataError(f"{path}: format api_bank_dialogues needs a folder of dialogue files")
        _load_api_bank_dialogues(path, _load_api_bank_descriptions(files.get("corpus_path")), collector)
        return ["api_bank_dialogues"]
    if path.is_dir():
        raise DataError(f"{path}: is a folder; task {task!r} reads one file (set task.files.train_path to a file)")
    return [_load_records_file(path, task, fmt, collector)]


# ---------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------

def _eval_share(key: str) -> float:
    """A stable pseudo-uniform number in [0, 1) from a string (blake2b; identical across processes)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def _split_key(prompt: Prompt) -> str:
    dialogue = prompt.meta.get("dialogue") if isinstance(prompt.meta, dict) else None
    return f"{prompt.data_source}/{dialogue}" if dialogue else prompt.prompt_uid


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
            an unreadable JSON array, no eval data (no ``eval_path`` and ``eval_fraction == 0``), or any bad
            row when ``files.on_bad_row == "raise"``.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    task = _task_name(task_cfg)
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
    _require_file(source, source_key)
    collector = _Collector(cfg_files.on_bad_row)
    formats = _load_source(task, source, resolved, cfg_files.format, collector)
    prompts = collector.prompts
    if source_key == "eval_path":
        prompts = [dataclasses.replace(p, example_id=f"{EVAL_FILE_ID_PREFIX}{p.example_id}") for p in prompts]
    if resolved["eval_path"] is None and cfg_files.eval_fraction > 0:
        in_eval = [_eval_share(_split_key(p)) < cfg_files.eval_fraction for p in prompts]
        prompts = [p for p, e in zip(prompts, in_eval) if e == (split == "eval")]
    limit = cfg_files.max_train if split == "train" else cfg_files.max_eval
    if limit is not None:
        prompts = prompts[:limit]
    if collector.bad_rows:
        logger.warning("%s: skipped %d bad rows of %s (first: %s)", task, len(collector.bad_rows), source,
                       collector.bad_rows[0])
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


def make_task_environment(task_cfg: Any, prompts_or_split: Sequence[Prompt] | str | None = None, seed: int = 0, *,
                          repo_root: str | Path | None = None,
                          allowed_roots: Sequence[str | Path] | None = None) -> Any:
    """Build the environment of a real task.

    QA tasks get a ``QAEnvironment`` whose retriever is, in order of precedence: the HTTP retriever at
    ``task.retriever_url``; BM25 over ``files.corpus_path`` (or the task's default corpus); BM25 over each
    question's own context paragraphs. Math tasks get a ``MathEnvironment``, ``bfcl`` / ``api_bank`` a
    ``FunctionCallingEnvironment``. All use ``task.max_turns``; QA uses ``task.retrieval_top_k``.

    Args:
        task_cfg: the ``TaskConfig`` section.
        prompts_or_split: the prompts the environment will serve, a split name to load them, or ``None``.
            Given prompts are checked (data source; QA prompts need context paragraphs when no corpus or
            server is set).
        seed: accepted for the registry's uniform signature; these environments are deterministic and draw
            no random numbers.
        repo_root: root for relative paths (default: this repository).
        allowed_roots: folders data paths may lie under (default: ``default_allowed_roots``).

    Returns:
        An object implementing ``trace.envs.base.Environment``.

    Raises:
        DataError: an unsupported task, prompts of another source, or QA prompts without any retrieval source.
    """
    from trace.envs import fc as fc_env, math as math_env, qa as qa_env

    task = _task_name(task_cfg)
    if task not in REAL_TASKS:
        raise DataError(f"task {task!r} is not a real-data task; real-data tasks are {list(REAL_TASKS)} "
                        "(kgqa and simulator are built by trace.envs.registry)")
    if isinstance(prompts_or_split, str):
        prompts: list[Prompt] = load_prompts(task_cfg, prompts_or_split, repo_root=repo_root,
                                             allowed_roots=allowed_roots)
    else:
        prompts = list(prompts_or_split or [])
    for prompt in prompts:
        if prompt.data_source != task:
            raise DataError(f"prompt {prompt.prompt_uid!r} belongs to {prompt.data_source!r}, not task {task!r}")
    module = qa_env if task in QA_TASKS else math_env if task in MATH_TASKS else fc_env
    env = module.from_task_config(task_cfg, seed, root=repo_root, allowed_roots=allowed_roots)
    if isinstance(getattr(env, "retriever", None), qa_env.ContextBM25Retriever):
        missing = [p.prompt_uid for p in prompts if not qa_env.ContextBM25Retriever.has_context(p)]
        if missing:
            raise DataError(f"task {task!r}: {len(missing)} prompts (first {missing[0]!r}) have no context paragraphs "
                            "and no corpus or retrieval server is set; set task.files.corpus_path (e.g. "
                            f"{DEFAULT_FILES['2wikimultihopqa']['corpus_path']}) or task.retriever_url")
    return env
