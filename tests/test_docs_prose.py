"""Every count (of arms, stages, tests, files) and every duration in README.md and docs/*.md names its source
(``scripts.docs_prose``): the check passes on this repository and fails on scratch copies with a hand-typed
wrong count, a duration with no source, a duration its source does not hold, and a document cited as a source."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts.docs_prose import _matches, prose_numbers, unsourced

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def scratch(tmp_path):
    """README.md, docs/, reports/ (no plots), params.yaml and dvc.yaml of this repository under ``tmp_path``."""
    for name in ("README.md", "params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(REPO / "reports", tmp_path / "reports", ignore=shutil.ignore_patterns("*.png"))
    return tmp_path


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_every_count_and_duration_of_the_docs_names_a_source_that_holds_it():
    problems = unsourced(REPO)
    assert not problems, "counts or durations without their source (python -m scripts.docs_prose):\n" + \
        "\n".join(problems)


@pytest.mark.parametrize("old, new, problem", [
    ("ten baselines (13 arms)", "ten baselines (12 arms)", "README.md:8: 12 (a count) is in none of its sources"),
    ("its two ablations\nand ten baselines", "its two ablations\nand eight baselines",
     "README.md:8: 8 (a count) is in none of its sources"),
    ("13 arms x 3 seeds, 58.6 min", "13 arms x 3 seeds, 48.6 min", "48.6 min is in none of its sources"),
])
def test_a_hand_typed_wrong_count_or_duration_fails(scratch, old, new, problem):
    _replace(scratch / "README.md", old, new)
    assert any(problem in p for p in unsourced(scratch)), unsourced(scratch)


def test_a_duration_without_a_source_fails(scratch):
    path = scratch / "docs" / "results.md"
    path.write_text(path.read_text() + "\nThe whole pipeline takes about 42 min on a laptop.\n")
    assert [p for p in unsourced(scratch) if p.startswith("docs/results.md:")] == [
        f"docs/results.md:{len(path.read_text().splitlines())}: 42 min has no source: add <!-- source: FILE --> "
        "naming the committed report that recorded it (or count:...), or drop the number"]


def test_a_document_that_quotes_a_report_is_no_source(scratch):
    path = scratch / "docs" / "results.md"
    path.write_text(path.read_text() + "\n`make run-grid` took 59 min. <!-- source: docs/results.md -->\n")
    assert any("not a document that quotes one" in p for p in unsourced(scratch)), unsourced(scratch)


def test_numbers_in_generated_tables_are_left_to_docs_tables():
    text = "<!-- table:x -->\n| 12 arms | 3 s |\n<!-- /table:x -->\n\nIn 5 min. <!-- source: a.json -->\n"
    assert [(line, kind, number, unit, sources) for line, kind, number, unit, sources in prose_numbers(text)] == [
        (5, "duration", "5", "min", ["a.json"])]


def test_a_number_matches_its_source_as_written_rounded_or_in_another_unit():
    assert _matches("58.6", [3517.0], "min")  # 3,517 s = 58.62 min
    assert _matches("88", [88.2], "min") and not _matches("87", [88.2], "min")
    assert _matches("1,042", [1042.0], "s") and not _matches("15", [824.0], "min")  # 824 s = 13.7 min: 14, not 15
    assert _matches("13", [13.0], None) and not _matches("9", [13.0], None)
