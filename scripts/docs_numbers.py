"""Which result numbers of the docs' prose no committed report holds: the check that prose quotes reports.

A number in the docs comes from a committed report (``reports/runs/*/``, ``reports/benchmarks/*.json``): the
generated tables are rewritten from them by ``scripts.docs_tables``, and a figure the prose quotes outside a
table must be one of them too. ``unsourced_numbers`` lists every decimal with 3 or 4 places (the precision of
a result: 0.538, +0.162, 0.8996) in the prose of ``README.md`` and ``docs/*.md`` (outside generated tables and
code blocks) that is neither in a generated table of the same document nor, rounded to 2-4 places, in a
committed report (a value of its JSON files, or a number of its Markdown). ``docs/method.md`` is left out: its
numbers are the formulas' hand-worked test vectors, which the unit tests check.

Usage: ``python -m scripts.docs_numbers`` prints each unsourced number with its document and exits 1 if any.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable

REPO_ROOT = Path(__file__).resolve().parents[1]
EXEMPT = ("docs/method.md",)  # test vectors of the formulas, checked by the unit tests
_TABLE = re.compile(r"<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->\n.*?<!-- /table:(?P=name) -->", re.DOTALL)
_FENCE = re.compile(r"```.*?```", re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])[+-]?\d+\.\d{3,4}(?!\d)")


def _forms(value: float) -> set[str]:
    return {f"{round(value, d):.{d}f}" for d in (2, 3, 4)} | {f"{round(abs(value), d):.{d}f}" for d in (2, 3, 4)}


def json_numbers(node: Any) -> Iterable[float]:
    """Every number (not bool) in a parsed JSON document, depth first."""
    if isinstance(node, dict):
        for value in node.values():
            yield from json_numbers(value)
    elif isinstance(node, list):
        for value in node:
            yield from json_numbers(value)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield float(node)


def _text_numbers(text: str) -> set[str]:
    return {m.group(0).lstrip("+-") for m in _NUMBER.finditer(text)}


def report_numbers(root: Path) -> set[str]:
    """Every number the committed reports hold, as unsigned text at 2, 3 and 4 places (JSON values) or as
    written (Markdown)."""
    known: set[str] = set()
    for path in sorted((root / "reports").rglob("*.json")):
        for value in json_numbers(json.loads(path.read_text())):
            known |= _forms(value)
    for path in sorted((root / "reports").rglob("*.md")):
        known |= _text_numbers(path.read_text())
    return known


def unsourced_numbers(root: Path = REPO_ROOT) -> list[tuple[str, str]]:
    """``(document, number)`` for each result number of the prose that no committed report or table holds.

    Args:
        root: the repository root.

    Returns:
        The offending numbers in document order (empty when the prose quotes only reports).
    """
    known = report_numbers(root)
    out = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        rel = doc.relative_to(root).as_posix()
        if rel in EXEMPT or not doc.is_file():
            continue
        text = doc.read_text()
        in_tables = _text_numbers(" ".join(m.group(0) for m in _TABLE.finditer(text)))
        prose = _FENCE.sub("", _TABLE.sub("", text))
        out += [(rel, m.group(0)) for m in _NUMBER.finditer(prose)
                if m.group(0).lstrip("+-") not in known | in_tables]
    return out


def main(argv: list[str] | None = None) -> int:
    found = unsourced_numbers()
    for doc, number in found:
        print(f"{doc}: {number} is in no committed report or generated table: quote the table, or commit the "
              "report it comes from")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
