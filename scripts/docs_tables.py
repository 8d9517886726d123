"""Write every results and benchmarks table of ``README.md`` and ``docs/*.md`` from the committed reports.

A generated table sits between two marker comments in a Markdown file::

    <!-- table:long-arms -->
    ...                                   (rewritten by this script; do not edit by hand)
    <!-- /table:long-arms -->

Each name is one table function that reads committed files only (``tables()`` maps the names to them; they live
by concern in ``docs_tables_runs`` (the ablation run reports), ``docs_tables_presets`` (the real-data presets),
``docs_tables_allocators`` (the field's allocators on one budget) and ``docs_tables_benchmarks`` (benchmarks,
studies, data files), sharing ``docs_tables_common``): a run report folder
``reports/runs/<folder>/`` (``metrics.json``; which folder feeds which tables is ``reports/runs/index.yaml``, so a
re-run committed as a new folder is a one-line change there) or a benchmark report ``reports/benchmarks/<name>.json``.
Invariant: after ``python -m scripts.docs_tables`` every table in the docs is what these files say; ``--check``
changes nothing and exits 1 naming each table that differs (``tests/test_docs_tables.py`` runs it), so a re-run
that changes a number changes the docs in the same commit.

It lives in ``scripts/`` (the repository's command-line tools, run as ``python -m scripts.<name>``) because it
reads the repository's documents and reports, which neither the library (``trace/``) nor a measurement
(``benchmarks/``) should know about. Standard library and PyYAML, plus the report's verdict rule
(``trace.reporting.verdicts`` and ``statistics``: numpy, scipy) so a table judges a difference as the report does
(the data-files table imports ``trace.data_paths``, standard library).

Usage:
    python -m scripts.docs_tables            # rewrite the tables in place
    python -m scripts.docs_tables --check    # exit 1 naming each stale table; write nothing
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

from scripts.docs_tables_allocators import allocators_table
from scripts.docs_tables_benchmarks import (allocation_objectives_table, allocation_quality_table,
                                            benchmark_runs_table, benchmarks_table, data_files_table,
                                            learning_study_table, precision_study_table, real_task_step_table,
                                            step_dtype_table, warmup_sweep_table)
from scripts.docs_tables_common import INDEX, RUNS, Context, DocsTableError, read_index
from scripts.docs_tables_presets import PRESET_REPORTS, preset_table, presets_table
from scripts.docs_tables_predictor import calibration_table, exploration_table, power_table, stages_table
from scripts.docs_tables_warmups import warmups_table
from scripts.docs_tables_runs import (ABLATION_REPORTS, LEARNING_BAR, accounting_table, arms_table, audit_table, gain_avgk_table,
                                      gain_table, overview_table, primary_table, regime_table, tokens_to_target_table,
                                      truth_table, vs_grpo_table)

__all__ = ["ABLATION_REPORTS", "LEARNING_BAR", "PRESET_REPORTS", "INDEX", "RUNS", "Context", "DocsTableError",
           "gain_avgk_table", "gain_table", "main", "read_index", "render", "tables", "tokens_to_target_table",
           "update"]

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md")

_MARKER = re.compile(r"<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->\n(?P<body>.*?)<!-- /table:(?P=name) -->", re.DOTALL)
_OPEN = re.compile(r"<!-- table:([A-Za-z0-9_.-]+) -->")
_CLOSE = re.compile(r"<!-- /table:([A-Za-z0-9_.-]+) -->")


def tables() -> dict[str, Callable[[Context], str]]:
    """Every table name a document may hold, and the function that writes it."""
    out: dict[str, Callable[[Context], str]] = {}
    for key in ABLATION_REPORTS:
        out[f"{key}-arms"] = lambda ctx, key=key: arms_table(ctx, key, full=False)
        out[f"{key}-arms-full"] = lambda ctx, key=key: arms_table(ctx, key, full=True)
        out[f"{key}-vs-grpo"] = lambda ctx, key=key: vs_grpo_table(ctx, key, full=False)
        out[f"{key}-vs-grpo-full"] = lambda ctx, key=key: vs_grpo_table(ctx, key, full=True)
        out[f"{key}-vs-trace-full"] = lambda ctx, key=key: vs_grpo_table(ctx, key, full=True, ref="trace")
        out[f"{key}-regime"] = lambda ctx, key=key: regime_table(ctx, key)
        out[f"{key}-audit"] = lambda ctx, key=key: audit_table(ctx, key)
        out[f"{key}-truth"] = lambda ctx, key=key: truth_table(ctx, key)
        out[f"{key}-gain"] = lambda ctx, key=key: gain_table(ctx, key)
        out[f"{key}-tokens-to-target"] = lambda ctx, key=key: tokens_to_target_table(ctx, key)
        out[f"{key}-tokens-to-target-avgk"] = lambda ctx, key=key: tokens_to_target_table(ctx, key, sampled=True)
        out[f"{key}-gain-avgk"] = lambda ctx, key=key: gain_avgk_table(ctx, key)
        out[f"{key}-overview"] = lambda ctx, key=key: overview_table(ctx, key)
        out[f"{key}-primary"] = lambda ctx, key=key: primary_table(ctx, key)
        out[f"{key}-accounting"] = lambda ctx, key=key: accounting_table(ctx, key)
    for key in PRESET_REPORTS:
        out[f"preset-{key}"] = lambda ctx, key=key: preset_table(ctx, key)
    out["allocators-on-one-budget"] = allocators_table
    out["presets"] = presets_table
    out["benchmarks"] = benchmarks_table
    out["benchmark-runs"] = benchmark_runs_table
    out["allocation-quality"] = allocation_quality_table
    out["allocation-objectives"] = allocation_objectives_table
    out["real-task-step"] = real_task_step_table
    out["step-dtype"] = step_dtype_table
    out["warmup-sweep"] = warmup_sweep_table
    out["learning-study"] = learning_study_table
    out["precision-study"] = precision_study_table
    out["data-files"] = data_files_table
    out["predictor-calibration"] = calibration_table
    out["predictor-exploration"] = exploration_table
    out["predictor-stages"] = stages_table
    out["predictor-power"] = power_table
    out["paper-warmups-components"] = warmups_table
    return out


# ---- documents ---------------------------------------------------------------------------------------------
def documents(root: Path) -> list[Path]:
    """``README.md`` and ``docs/*.md`` of the repository, in that order."""
    found: list[Path] = []
    for pattern in DOCS:
        found += sorted(root.glob(pattern))
    return [p for p in found if p.is_file()]


def render(text: str, doc: Path, root: Path, index: dict[str, str | None]) -> tuple[str, list[str]]:
    """The document with every marked table regenerated, and the names of the tables that changed.

    Raises:
        DocsTableError: a marker without its closing marker (or the reverse), or a name no function writes.
    """
    known = tables()
    opened, closed = _OPEN.findall(text), _CLOSE.findall(text)
    if sorted(opened) != sorted(closed):
        raise DocsTableError(f"{doc}: table markers do not pair up: opened {opened}, closed {closed}; every "
                             "<!-- table:NAME --> needs its <!-- /table:NAME --> on a later line")
    ctx = Context(root=root, doc=doc, index=index)
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in known:
            raise DocsTableError(f"{doc}: unknown table {name!r}; scripts/docs_tables.py writes {sorted(known)}")
        body = known[name](ctx).rstrip("\n") + "\n"
        if body != match.group("body"):
            changed.append(name)
        return f"<!-- table:{name} -->\n{body}<!-- /table:{name} -->"

    new = _MARKER.sub(replace, text)
    if len(_MARKER.findall(text)) != len(opened):
        raise DocsTableError(f"{doc}: a table marker is not closed by its own name on a later line")
    return new, changed


def update(root: Path = REPO_ROOT, *, check: bool = False, docs: Sequence[Path] | None = None) -> list[str]:
    """Regenerate (or, with ``check``, only compare) every marked table.

    Args:
        root: the repository root.
        check: write nothing; only report what differs.
        docs: the Markdown files (default: ``documents(root)``).

    Returns:
        ``"<file>: <table>"`` for every table that differed (and, unless ``check``, was rewritten).

    Raises:
        DocsTableError: see ``render`` and ``read_index``.
    """
    index = read_index(root)
    stale: list[str] = []
    for doc in documents(root) if docs is None else docs:
        text = doc.read_text()
        new, changed = render(text, doc, root, index)
        rel = os.path.relpath(doc, root)
        stale += [f"{rel}: {name}" for name in changed]
        if changed and not check:
            doc.write_text(new)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale table")
    args = parser.parse_args(argv)
    try:
        stale = update(REPO_ROOT, check=args.check)
    except DocsTableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for item in stale:
        print(f"{item}: {'differs from the committed reports' if args.check else 'rewritten'}")
    if args.check and stale:
        print("run `python -m scripts.docs_tables` and commit the result with the reports", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
