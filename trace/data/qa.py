"""Row parsers of the multi-hop QA tasks (hotpotqa, musique, 2wikimultihopqa, bamboogle, nq).

=====================  ====================================================================================
``hotpot_hf``          HF ``hotpot_qa``: ``id, question, answer, context{title[], sentences[][]}``
``hotpot_original``    original HotpotQA / 2Wiki: ``_id, question, answer, context[[title, [sentence]]]``
``musique``            ``id, question, answer, answer_aliases, paragraphs[{title, paragraph_text}]``
``qa_pairs``           ``question, answer`` (str or list of aliases): 2Wiki dev, Bamboogle, NQ, MuSiQue dev
=====================  ====================================================================================

Every prompt's ``answer`` is the list of its scorable gold aliases (``trace.envs.qa.gold_aliases``); a row
whose every alias normalises to the empty string is a bad row. Context paragraphs go to
``meta["context"]`` as ``[[title, text], ...]``, and the titles of the supporting paragraphs, where the row
names them, to ``meta["support"]`` in hop order (HotpotQA/2Wiki ``supporting_facts``; MuSiQue's
``is_supporting`` paragraphs, ordered by ``question_decomposition``): the grounded demonstrations search them
(``trace.envs.qa.grounded_demo``).
"""

from __future__ import annotations

import re
from typing import Any

from trace.data.records import RowError, RowParser, example_id, question_text
from trace.envs.base import Prompt
from trace.envs.qa import gold_aliases

FORMATS = ("hotpot_hf", "hotpot_original", "musique", "qa_pairs")


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
        raise RowError(f"answer {given!r} is empty after answer normalisation (lowercase, no punctuation, no "
                       "a/an/the), so exact match could not score it; fix the answer or drop the row")
    if not golds:
        raise RowError("missing answer (field 'answer')")
    return golds


def _joined(sentences: Any) -> str:
    return "".join(str(s) for s in sentences) if isinstance(sentences, list) else str(sentences)


def _support_titles(facts: Any) -> list[str]:
    """Titles named by ``supporting_facts`` (``{"title": [...], ...}`` or ``[[title, sent_idx], ...]``), each once."""
    if isinstance(facts, dict):
        titles = facts.get("title") or []
    elif isinstance(facts, list):
        titles = [f[0] for f in facts if isinstance(f, (list, tuple)) and f]
    else:
        titles = []
    return list(dict.fromkeys(str(t) for t in titles if isinstance(t, str) and t.strip()))


def _musique_support(paragraphs: list[dict], record: dict) -> list[str]:
    by_idx = {p.get("idx", i): p for i, p in enumerate(paragraphs)}
    ordered = [by_idx.get(step.get("paragraph_support_idx")) for step in record.get("question_decomposition") or []
               if isinstance(step, dict)]
    ordered += [p for p in paragraphs if p.get("is_supporting")]
    return list(dict.fromkeys(str(p.get("title", "")) for p in ordered if p and p.get("is_supporting")
                              and str(p.get("title", "")).strip()))


def _parse_hotpot_hf(record: dict, task: str, row_idx: int) -> Prompt:
    context = record.get("context")
    if not isinstance(context, dict) or not isinstance(context.get("title"), list) \
            or not isinstance(context.get("sentences"), list) or len(context["title"]) != len(context["sentences"]):
        raise RowError("context must be {'title': [...], 'sentences': [[...], ...]} of equal lengths")
    paragraphs = [[str(t), _joined(s)] for t, s in zip(context["title"], context["sentences"])]
    meta = {"context": paragraphs, "support": _support_titles(record.get("supporting_facts")),
            **({"type": record["type"]} if isinstance(record.get("type"), str) else {})}
    return Prompt(task, example_id(record, row_idx), question_text(record), _qa_golds(record), meta)


def _parse_hotpot_original(record: dict, task: str, row_idx: int) -> Prompt:
    context = record.get("context")
    if not isinstance(context, list) or not all(isinstance(p, list) and len(p) == 2 for p in context):
        raise RowError("context must be [[title, [sentence, ...]], ...]")
    paragraphs = [[str(t), _joined(s)] for t, s in context]
    meta = {"context": paragraphs, "support": _support_titles(record.get("supporting_facts")),
            **({"type": record["type"]} if isinstance(record.get("type"), str) else {})}
    return Prompt(task, example_id(record, row_idx), question_text(record), _qa_golds(record), meta)


def _parse_musique(record: dict, task: str, row_idx: int) -> Prompt:
    paragraphs = record.get("paragraphs")
    if not isinstance(paragraphs, list) or not all(isinstance(p, dict) for p in paragraphs):
        raise RowError("paragraphs must be a list of {'title', 'paragraph_text'}")
    if record.get("answerable") is False:
        raise RowError("unanswerable item (MuSiQue-Full contrast question); exact-match rewards need an answer")
    context = [[str(p.get("title", "")), str(p.get("paragraph_text", p.get("text", "")))] for p in paragraphs]
    row_id = example_id(record, row_idx)
    hops = re.match(r"(\d)hop", row_id)
    meta: dict = {"context": context, "support": _musique_support(paragraphs, record),
                  **({"hops": int(hops.group(1))} if hops else {})}
    return Prompt(task, row_id, question_text(record), _qa_golds(record), meta)


def _parse_qa_pairs(record: dict, task: str, row_idx: int) -> Prompt:
    return Prompt(task, example_id(record, row_idx), question_text(record), _qa_golds(record), {})


PARSERS: dict[str, RowParser] = {
    "hotpot_hf": _parse_hotpot_hf, "hotpot_original": _parse_hotpot_original, "musique": _parse_musique,
    "qa_pairs": _parse_qa_pairs,
}


def detect_format(record: dict) -> str | None:
    """The QA format of a row from its fields (``None`` when it fits none)."""
    if "paragraphs" in record:
        return "musique"
    if isinstance(record.get("context"), dict):
        return "hotpot_hf"
    if isinstance(record.get("context"), list):
        return "hotpot_original"
    return "qa_pairs" if "question" in record else None
