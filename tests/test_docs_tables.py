"""The results and benchmarks tables of README.md and docs/ are what the committed reports say
(``scripts/docs_tables.py``): a number edited by hand, or a report re-run without the docs, fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scripts import docs_tables
from scripts.docs_tables import DocsTableError, read_index, render, update

REPO = Path(__file__).resolve().parents[1]


def test_every_docs_table_matches_the_committed_reports():
    stale = update(REPO, check=True)
    assert not stale, ("tables differ from the committed reports (run `python -m scripts.docs_tables` and commit "
                       f"the result): {stale}")


def test_the_readme_and_docs_hold_the_results_tables():
    """The front door shows the learning run, the presets and the benchmarks; docs/ the rest."""
    readme = (REPO / "README.md").read_text()
    for name in ("default-arms", "default-vs-grpo", "long-arms", "presets", "benchmarks"):
        assert f"<!-- table:{name} -->" in readme, name
    results = (REPO / "docs" / "results.md").read_text()
    for name in ("default-arms-full", "default-vs-grpo-full", "long-regime", "long-arms-full", "long-vs-grpo-full",
                 "long-audit", "preset-hotpotqa",
                 "preset-gsm8k", "preset-bfcl"):
        assert f"<!-- table:{name} -->" in results, name
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    for name in ("benchmarks", "benchmark-runs", "allocation-quality", "allocation-objectives", "real-task-step"):
        assert f"<!-- table:{name} -->" in benchmarks, name


def test_index_names_committed_report_folders():
    index = read_index(REPO)
    assert set(index) == set(docs_tables.ABLATION_REPORTS + docs_tables.PRESET_REPORTS)
    for key, folder in index.items():
        if folder is not None:
            assert (REPO / "reports" / "runs" / folder / "metrics.json").is_file(), key


@pytest.fixture
def repo_copy(tmp_path):
    """The reports, the index and one Markdown file with tables, in a scratch repository."""
    shutil.copytree(REPO / "reports", tmp_path / "reports")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("# page\n\n<!-- table:long-vs-grpo -->\n<!-- /table:long-vs-grpo -->\n\ntext after\n"
                   "<!-- table:default-arms -->\nold\n<!-- /table:default-arms -->\n")
    return tmp_path, doc


def test_a_number_changed_by_hand_names_its_table(repo_copy):
    root, doc = repo_copy
    update(root)
    assert update(root, check=True) == []
    text = doc.read_text()
    assert "+0.179 [+0.117, +0.241] real" in text  # trace minus grpo, effective ratio, long-62d82c7
    doc.write_text(text.replace("+0.179 [+0.117, +0.241]", "+0.189 [+0.117, +0.241]"))
    assert update(root, check=True) == ["docs/page.md: long-vs-grpo"]
    assert "+0.189" in doc.read_text()  # --check writes nothing
    update(root)
    assert "+0.179 [+0.117, +0.241] real" in doc.read_text() and doc.read_text().endswith("default-arms -->\n")
    assert "text after" in doc.read_text()


def test_a_changed_report_makes_its_tables_stale(repo_copy):
    root, doc = repo_copy
    update(root)
    path = root / "reports" / "runs" / "long-62d82c7" / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics["ablations"]["trace"]["vs_grpo"]["effective ratio"]["mean"] = 0.2
    path.write_text(json.dumps(metrics))
    assert update(root, check=True) == ["docs/page.md: long-vs-grpo"]


def test_switching_the_default_report_is_one_line_of_the_index(repo_copy):
    root, doc = repo_copy
    index = root / "reports" / "runs" / "index.yaml"
    lines = index.read_text().splitlines(keepends=True)
    default = next(i for i, line in enumerate(lines) if line.startswith("default:"))
    lines[default] = "default: null\n"
    index.write_text("".join(lines))
    update(root)
    assert "No committed report yet" in doc.read_text()
    lines[default] = "default: long-62d82c7\n"
    index.write_text("".join(lines))
    assert update(root) == ["docs/page.md: default-arms"]
    assert "| 1 | `grpo` | 0.598 ± 0.050 |" in doc.read_text()


def test_an_unknown_table_name_is_an_error_listing_the_known_ones(tmp_path):
    doc = tmp_path / "page.md"
    with pytest.raises(DocsTableError, match="unknown table 'long-armz'.*long-arms"):
        render("<!-- table:long-armz -->\n<!-- /table:long-armz -->\n", doc, REPO, read_index(REPO))


def test_an_unclosed_marker_is_an_error(tmp_path):
    doc = tmp_path / "page.md"
    with pytest.raises(DocsTableError, match="do not pair up"):
        render("<!-- table:long-arms -->\nno end\n", doc, REPO, read_index(REPO))


def test_an_index_entry_without_a_committed_report_is_an_error(repo_copy):
    root, _ = repo_copy
    index = root / "reports" / "runs" / "index.yaml"
    index.write_text(index.read_text().replace("long: long-62d82c7", "long: long-0000000"))
    with pytest.raises(DocsTableError, match="long-0000000/metrics.json does not exist"):
        read_index(root)


def test_the_check_command_exits_1_naming_the_stale_table(repo_copy, monkeypatch, capsys):
    root, doc = repo_copy
    update(root)
    doc.write_text(doc.read_text().replace("+0.179", "+0.180"))
    monkeypatch.setattr(docs_tables, "REPO_ROOT", root)
    assert docs_tables.main(["--check"]) == 1
    assert "docs/page.md: long-vs-grpo: differs from the committed reports" in capsys.readouterr().out
