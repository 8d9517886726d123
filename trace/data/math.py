"""Row parsers of the math tasks (gsm8k, math, aime_amc).

=====================  ====================================================================================
``gsm8k``              ``question, answer`` ending ``#### <number>``
``math``               ``problem`` + ``answer`` or a ``\\boxed{}`` in ``solution``: MATH, AIME, AMC
=====================  ====================================================================================

A prompt's ``answer`` is the canonical final answer; a gold with no number and nothing left after
normalisation (``trace.envs.answers.is_empty_math_answer``) is a bad row. GSM8K rows keep their calculator
annotations in ``meta["calculations"]`` (those the calculator confirms) and the number of annotated steps of the
reference solution in ``meta["solution_steps"]`` (every ``<<expr=result>>``; ``task.files.max_solution_steps``).
"""

from __future__ import annotations

from trace.data.records import RowError, RowParser, example_id, question_text
from trace.envs.answers import extract_boxed, is_empty_math_answer, parse_number
from trace.envs.base import Prompt
from trace.envs.math import canonical_answer, gsm8k_calculations, gsm8k_final_answer

FORMATS = ("gsm8k", "math")


def _require_math_answer(answer: str) -> None:
    if is_empty_math_answer(answer):
        raise RowError(f"answer {answer!r} holds no number and nothing is left after normalisation, so no "
                       "prediction could match it; fix the answer or drop the row")


def _parse_gsm8k(record: dict, task: str, row_idx: int) -> Prompt:
    question = question_text(record)
    solution = record.get("answer")
    if not isinstance(solution, (str, int, float)) or isinstance(solution, bool) or not str(solution).strip():
        raise RowError("missing answer (field 'answer')")
    solution = str(solution)
    final = gsm8k_final_answer(solution)
    if final is None:
        if parse_number(solution) is None:
            raise RowError("answer has no final '#### <number>' line")
        final = solution.strip()
    _require_math_answer(final)
    meta = {"calculations": gsm8k_calculations(solution), "solution_steps": solution.count("<<")}
    return Prompt(task, example_id(record, row_idx), question, final, meta)


def _parse_math(record: dict, task: str, row_idx: int) -> Prompt:
    question = question_text(record, "problem")
    answer = record.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        solution = record.get("solution")
        answer = extract_boxed(solution) if isinstance(solution, str) else None
        if not answer:
            raise RowError("missing answer: no 'answer' field and no \\boxed{} in 'solution'")
    meta = {key: record[key] for key in ("level", "type", "subject", "year", "url", "difficulty")
            if isinstance(record.get(key), (str, int, float)) and not isinstance(record.get(key), bool)}
    answer = canonical_answer(answer)
    _require_math_answer(answer)
    return Prompt(task, example_id(record, row_idx), question, answer, meta)


PARSERS: dict[str, RowParser] = {"gsm8k": _parse_gsm8k, "math": _parse_math}


def detect_format(record: dict) -> str | None:
    """The math format of a row from its fields (``None`` when it fits none)."""
    if "problem" in record:
        return "math"
    return "gsm8k" if "question" in record else None
