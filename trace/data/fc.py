"""Loaders of the function-calling tasks: BFCL v4 single-turn files and API-Bank level-1 data.

=====================  ====================================================================================
``bfcl``               BFCL v4 single-turn question file (JSON lines) + ``possible_answer`` by id; a folder
                       loads every ``BFCL_*.json`` in it except multi-turn ones
``api_bank_dialogues`` a folder of API-Bank dialogues (``lv1-lv2-samples/level-1-given-desc``): one prompt
                       per API call, the dialogue before it as the request
``api_bank_test``      API-Bank ``test-data/level-1-api.json``: ``instruction, input, expected_output``
=====================  ====================================================================================

Prompts carry ``meta["functions"]`` (BFCL-style descriptions) and ``meta["category"]``; API-Bank ids are
``<dialogue file stem>:<call index>`` (its test-data ids restart in every dialogue), and
``meta["dialogue"]`` keeps one dialogue's calls in the same split.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from trace.data_paths import DataError, require_file
from trace.data.records import Collector, RowError, RowParser, collect_rows, example_id, iter_records
from trace.envs.api_bank import (API_BANK_CATEGORY, api_bank_function, parse_api_bank_descriptions,
                                 parse_api_bank_request)
from trace.envs.base import Prompt
from trace.envs.bfcl import IRRELEVANCE_CATEGORIES, RELEVANCE_CATEGORIES
from trace.envs.calls import CallSyntaxError, parse_calls, render_call

logger = logging.getLogger(__name__)

API_BANK_PREAMBLE = "The current year is 2023."  # API-Bank's level-1 prompt states it; gold dates assume it
TASK_FORMATS: dict[str, tuple[str, ...]] = {"bfcl": ("bfcl",), "api_bank": ("api_bank_dialogues", "api_bank_test")}


def _bfcl_category(row_id: str) -> str:
    match = re.match(r"^(.*?)_\d+(?:-\d+)*$", row_id)
    return match.group(1) if match else row_id


def _bfcl_request(question: Any) -> str:
    if not isinstance(question, list) or not question:
        raise RowError("missing question (field 'question': a list of turns)")
    if len(question) > 1:
        raise RowError(f"multi-turn item ({len(question)} turns); only single-turn categories are supported")
    lines = []
    for message in question[0] if isinstance(question[0], list) else [question[0]]:
        if not isinstance(message, dict):
            raise RowError("each message must be {'role', 'content'}")
        content = str(message.get("content", "")).strip()
        if content:
            lines.append(content if message.get("role") == "user" else f"{str(message.get('role')).title()}: {content}")
    if not lines:
        raise RowError("empty question")
    return "\n".join(lines)


def _valid_ground_truth(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(e, dict) and len(e) == 1 and isinstance(next(iter(e.values())), dict) for e in value)


def _make_bfcl_parser(answers: dict[str, Any], answers_label: str) -> RowParser:
    def parse(record: dict, task: str, row_idx: int) -> Prompt:
        row_id = example_id(record, row_idx)
        category = _bfcl_category(row_id)
        if category.startswith("multi_turn"):
            raise RowError(f"multi-turn category {category!r} is not supported (it needs BFCL's API simulators)")
        request = _bfcl_request(record.get("question"))
        functions = record.get("function")
        if not isinstance(functions, list) or not functions or not all(isinstance(f, dict) and "name" in f
                                                                       for f in functions):
            raise RowError("missing functions (field 'function': a list of {'name', 'parameters', ...})")
        if category in IRRELEVANCE_CATEGORIES:
            answer: Any = []
        elif category in RELEVANCE_CATEGORIES:
            answer = None
        else:
            answer = answers.get(row_id)
            if not _valid_ground_truth(answer):
                raise RowError(f"missing answer: no ground truth for id {row_id!r} in {answers_label}")
        return Prompt(task, row_id, request, answer, {"category": category, "functions": functions})
    return parse


def _parse_api_bank_test(record: dict, task: str, row_idx: int) -> Prompt:
    instruction, history, expected = record.get("instruction"), record.get("input"), record.get("expected_output")
    if not isinstance(history, str) or not history.strip():
        raise RowError("empty question (field 'input')")
    if not isinstance(expected, str) or "API-Request:" not in expected:
        raise RowError("missing answer: 'expected_output' holds no 'API-Request: [...]'")
    request_text = expected.split("API-Request:", 1)[1].strip()
    try:
        calls = parse_calls(request_text)
    except CallSyntaxError as err:
        fallback = parse_api_bank_request(request_text)  # quotes inside values, as API-Bank writes lists
        if fallback is None:
            raise RowError(f"expected_output is not a parseable call ({err})") from None
        calls = [fallback]
    if len(calls) != 1:
        raise RowError(f"expected_output holds {len(calls)} calls, expected 1")
    functions = [api_bank_function(d) for d in parse_api_bank_descriptions(str(instruction or ""))]
    if not functions:
        raise RowError("instruction lists no 'API descriptions:'")
    year = re.search(r"The current year is \d{4}\.", str(instruction or ""))
    request = history.strip()
    if request.endswith("Generate API Request:"):
        request = request[: -len("Generate API Request:")].rstrip()
    request = f"{year.group(0) if year else API_BANK_PREAMBLE}\n{request}"
    dialogue = str(record.get("file") or "")
    # ids restart in every source dialogue: <dialogue stem>:<id>, as the dialogue loader names its calls
    row_id = (f"{Path(dialogue).stem}:{record['id']}" if dialogue and "id" in record
              else example_id(record, row_idx))
    meta = {"category": API_BANK_CATEGORY, "functions": functions, **({"dialogue": dialogue} if dialogue else {})}
    return Prompt(task, row_id, request, [{calls[0].name: calls[0].arguments}], meta)


PARSERS: dict[str, RowParser] = {"api_bank_test": _parse_api_bank_test}


def detect_format(task: str, record: dict) -> str | None:
    """The format of a ``bfcl`` / ``api_bank`` row from its fields (``None`` when it fits none)."""
    if task == "bfcl":
        return "bfcl" if "function" in record and "question" in record else None
    if task == "api_bank":
        return "api_bank_test" if "expected_output" in record else None
    return None


def _load_bfcl_answers(path: Path, collector: Collector) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    if not path.is_file():
        return answers
    for label, _, record in iter_records(path):
        if isinstance(record, RowError):
            collector.bad(path, label, str(record))
        elif isinstance(record, dict) and "id" in record:
            answers[str(record["id"])] = record.get("ground_truth")
        else:
            collector.bad(path, label, "an answer row needs 'id' and 'ground_truth'")
    return answers


def load_bfcl(path: Path, answers_path: Path | None, collector: Collector) -> list[str]:
    """BFCL: one question file, or every single-turn ``BFCL_*.json`` of a folder, with answers by id.

    Args:
        path: a question file or a folder of them.
        answers_path: the ``possible_answer`` file or folder (default: ``possible_answer/`` beside each file).
        collector: receives the prompts and bad rows.

    Returns:
        The format of each file read (``"bfcl"`` each).

    Raises:
        DataError: a folder without question files, a missing answer file (relevance files need none), an
            unreadable file, or a bad row with ``on_bad_row: raise``.
    """
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
        collect_rows(list(iter_records(question_file)), question_file, "bfcl",
                     _make_bfcl_parser(answers, str(answer_file)), collector)
    return ["bfcl"] * len(files)


def load_api_bank_descriptions(path: Path | None) -> dict[str, dict]:
    """API descriptions by name from an API-Bank test-data file (its instructions) or JSON lines of descriptions.

    Returns:
        ``{name: description}`` (first description of each name); ``{}`` when ``path`` is ``None``.

    Raises:
        DataError: a missing file, or one that holds no API descriptions.
    """
    if path is None:
        return {}
    require_file(path, "corpus_path")
    descriptions: dict[str, dict] = {}
    for label, _, record in iter_records(path):
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


def load_api_bank_dialogues(folder: Path, descriptions: dict[str, dict], collector: Collector) -> None:
    """One prompt per API call of every dialogue file (JSON lines of User / AI / API turns).

    A dialogue with a broken turn is skipped whole (later calls would see a gap in their history).

    Raises:
        DataError: a folder without ``*.jsonl`` files, or a bad row with ``on_bad_row: raise``.
    """
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise DataError(f"{folder}: no *.jsonl dialogue files (expected API-Bank lv1-lv2-samples/level-1-given-desc)")
    for path in files:
        turns = []
        broken = None
        for label, _, record in iter_records(path):
            if isinstance(record, RowError):
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
