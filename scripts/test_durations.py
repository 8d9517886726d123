"""Where the test suite's time goes: a JUnit XML report of pytest (``--junitxml``) as Markdown tables.

Per test file: tests, seconds (setup, call and teardown of its tests, module fixtures included in the first test
that uses them) and share of the suite; then the slowest tests. Given a second report (``--before``), the file
table sets the two side by side.

Usage:
    python -m pytest tests --junitxml=after.xml
    python -m scripts.test_durations after.xml [--before before.xml] [--top 20] [--out docs/test_durations.md]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Sequence

__all__ = ["read_junit", "by_file", "markdown"]


def read_junit(path: str | Path) -> list[tuple[str, str, float, str]]:
    """Every test case of a pytest JUnit XML report: ``(file, test name, seconds, outcome)``.

    The outcome is ``passed``, ``failed``, ``error`` or ``skipped``. The file is the case's ``classname`` turned
    back into a path (``tests.test_x`` -> ``tests/test_x.py``).

    Raises:
        ValueError: the file is not a JUnit XML report (names the file).
    """
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as err:
        raise ValueError(f"{path}: not a readable JUnit XML report ({err}); write one with pytest --junitxml") from err
    out = []
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is the module, or module.Class for a test in a class
        parts = [p for p in module if not p[:1].isupper()]
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        out.append(("/".join(parts) + ".py", case.get("name", ""), float(case.get("time", 0.0)), outcome))
    if not out:
        raise ValueError(f"{path}: no test cases; write the report with pytest --junitxml")
    return out


def by_file(cases: Sequence[tuple[str, str, float, str]]) -> dict[str, tuple[int, float]]:
    """``{file: (tests, seconds)}``, slowest file first."""
    acc: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for file, _, seconds, _ in cases:
        acc[file][0] += 1
        acc[file][1] += seconds
    return dict(sorted(((f, (n, s)) for f, (n, s) in acc.items()), key=lambda item: -item[1][1]))


def markdown(after: Sequence, before: Sequence | None = None, top: int = 20) -> str:
    """The per-file table (side by side with ``before`` when given) and the ``top`` slowest tests of ``after``."""
    files_after = by_file(after)
    total_after = sum(s for _, s in files_after.values())
    lines = []
    if before is None:
        lines += ["| file | tests | seconds | share |", "|---|---:|---:|---:|"]
        lines += [f"| `{f}` | {n} | {s:,.0f} | {100 * s / total_after:.1f} % |" for f, (n, s) in files_after.items()]
        lines.append(f"| all | {len(after)} | {total_after:,.0f} | 100 % |")
    else:
        files_before = by_file(before)
        total_before = sum(s for _, s in files_before.values())
        names = list(files_after) + [f for f in files_before if f not in files_after]
        lines += ["| file | tests before | seconds before | tests after | seconds after | after - before |",
                  "|---|---:|---:|---:|---:|---:|"]
        for f in names:
            nb, sb = files_before.get(f, (0, 0.0))
            na, sa = files_after.get(f, (0, 0.0))
            lines.append(f"| `{f}` | {nb} | {sb:,.0f} | {na} | {sa:,.0f} | {sa - sb:+,.0f} |")
        lines.append(f"| all | {len(before)} | {total_before:,.0f} | {len(after)} | {total_after:,.0f} | "
                     f"{total_after - total_before:+,.0f} |")
    lines += ["", f"The {top} slowest tests:", "", "| test | seconds | outcome |", "|---|---:|---|"]
    for file, name, seconds, outcome in sorted(after, key=lambda c: -c[2])[:top]:
        lines.append(f"| `{file}::{name}` | {seconds:,.1f} | {outcome} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("after", help="pytest --junitxml report")
    parser.add_argument("--before", help="an earlier report of the same suite, for the side-by-side table")
    parser.add_argument("--top", type=int, default=20, help="slowest tests listed")
    parser.add_argument("--out", help="write the Markdown here instead of printing it")
    args = parser.parse_args(argv)
    try:
        text = markdown(read_junit(args.after), read_junit(args.before) if args.before else None, args.top)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
