"""Which counts and durations of the docs' prose name no source: the check that prose holding a count of arms,
stages, tests or files, or a duration, says where the number comes from.

``scripts.docs_numbers`` checks the decimals of results; this checks the numbers that go stale when the code
or a re-run changes them: a count (``13 arms``, ``the 39 `train@` stages``, ``26 tests``) and a duration
(``58.6 min``, ``824 s``, ``26-43 s``). Each one in ``README.md`` and ``docs/*.md`` (code blocks included,
generated tables left out: ``scripts.docs_tables`` writes those from the reports) must sit in a paragraph that
carries a source marker, an HTML comment that names where its numbers come from::

    The run took 58.6 min on 2 cores of an AMD EPYC. <!-- source: reports/runs/all-arms-e459056/README.md -->
    The thirteen arms: ... <!-- source: count:arms -->

A paragraph is a run of lines between blank lines (a marker on the line right above a code block covers the
block). Sources, several separated by ``;``:

- a committed report file under ``reports/`` (a run folder's ``README.md``, ``summary.md``, a benchmark JSON),
  or the code or config file that sets the number (a timeout, a default), never another document: the number must be one of its numbers, as written or rounded to the places the prose gives (a duration also
  after converting seconds to minutes or hours, or minutes to hours); ``FILE.json#a.b`` reads the value at that
  key only;
- ``count:arms`` (the registered arms, ``trace.allocation.arms.ARMS``), ``count:ablations`` (``trace_*``: ``trace``
  less a stage), ``count:baselines`` (the others but ``trace``), ``count:params:<key>`` (the length of a list in
  ``params.yaml``, e.g. ``train.ablations``), ``count:stages`` (the stages of ``dvc.yaml``), ``count:tests:<file>`` (the
  tests pytest collects from a test file), ``count:files:<glob>``.

Not checked: ``docs/method.md`` (its numbers are the formulas' test vectors) and ``docs/test_durations.md``,
the record of the test suite's measured runs, written by ``python -m scripts.test_durations`` and stating its
machine (the JUnit reports it reads are not committed); prose elsewhere cites it with
``<!-- source: docs/test_durations.md -->``. A count of one (``one arm``) is not a count that goes stale.

Usage: ``python -m scripts.docs_prose`` prints each unsourced number with its document and line and exits 1 if
any. ``tests/test_docs_prose.py`` runs it.
"""

from __future__ import annotations

import glob
import json
import math
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from scripts.docs_numbers import json_numbers

REPO_ROOT = Path(__file__).resolve().parents[1]
EXEMPT = ("docs/method.md", "docs/test_durations.md")
RECORDS = ("docs/test_durations.md",)  # documents that are a measurement record, allowed as a source
# generated tables: scripts.docs_tables' markers, and the grid benchmark's (benchmarks.grid writes it)
_TABLE = re.compile(r"<!-- (?P<name>table:[A-Za-z0-9_.-]+|grid-benchmark) -->\n.*?<!-- /(?P=name) -->", re.DOTALL)
_MARKER = re.compile(r"<!-- source: (?P<sources>[^>]*?) -->")
_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                     "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
_NUM = r"\d[\d,]*(?:\.\d+)?"
COUNT = re.compile(rf"(?<![\w.@-])(?P<n>\d(?:[\d,]*\d)?|{'|'.join(_WORDS)})\s+(?:[\w`@<>-]+\s+)?"
                   r"(?P<noun>arms?|stages?|tests?|files?|baselines?|ablations?)\b", re.IGNORECASE)
DURATION = re.compile(rf"(?<![\w.,])(?P<lo>{_NUM})(?:\s*(?:-|to)\s*(?P<hi>{_NUM}))?\s*"
                      r"(?P<unit>min|minutes?|s|seconds?|h|hours?)\b(?![-/])")
_UNIT = {"min": "min", "minute": "min", "minutes": "min", "s": "s", "second": "s", "seconds": "s",
         "h": "h", "hour": "h", "hours": "h"}
_TO_SECONDS = {"s": 1.0, "min": 60.0, "h": 3600.0}


class SourceError(ValueError):
    """A source marker names a file that does not exist, a key it does not hold, or an unknown counter."""


# ---- what a source holds ------------------------------------------------------------------------------------
def _text_numbers(text: str) -> list[float]:
    return [float(m.group(0).replace(",", "")) for m in re.finditer(_NUM, text)]


def _count_tests(root: Path, path: Path) -> int:
    """The tests pytest collects from a test file (every parametrized case and fixture param counted)."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(path)], cwd=root, capture_output=True, text=True)
    found = re.search(r"(\d+) tests? collected", out.stdout)  # "-q" prints this, or "<file>: N" per file
    per_file = re.findall(r"^\S+\.py: (\d+)$", out.stdout, re.MULTILINE)
    if not found and not per_file:
        raise SourceError(f"count:tests:{path.relative_to(root)}: pytest collected nothing "
                          f"({out.stdout.strip().splitlines()[-1:] or out.stderr.strip()[-200:]})")
    return int(found.group(1)) if found else sum(map(int, per_file))


def _counter(root: Path, name: str) -> float:
    kind, _, arg = name.partition(":")
    if kind in ("arms", "baselines", "ablations"):
        sys.path.insert(0, str(root))
        try:
            from trace.allocation.arms import ARMS
        finally:
            sys.path.remove(str(root))
        ablations = [a for a in ARMS if a.startswith("trace_")]  # trace_root, trace_prefix: trace less a stage
        return float({"arms": len(ARMS), "ablations": len(ablations),
                      "baselines": len(ARMS) - 1 - len(ablations)}[kind])
    if kind == "params":
        import yaml

        node: Any = yaml.safe_load((root / "params.yaml").read_text())
        for part in arg.split("."):
            if not isinstance(node, dict) or part not in node:
                raise SourceError(f"count:params:{arg}: params.yaml has no key {arg!r}")
            node = node[part]
        if not isinstance(node, list):
            raise SourceError(f"count:params:{arg}: params.yaml's {arg} is not a list")
        return float(len(node))
    if kind == "stages":
        import yaml

        return float(len(yaml.safe_load((root / "dvc.yaml").read_text())["stages"]))
    if kind == "tests":
        path = root / arg
        if not path.is_file():
            raise SourceError(f"count:tests:{arg}: {path} does not exist")
        return float(_count_tests(root, path))
    if kind == "files":
        return float(len([p for p in glob.glob(str(root / arg), recursive=True) if Path(p).is_file()]))
    raise SourceError(f"count:{name}: unknown counter; known: count:arms, count:ablations, count:baselines, "
                      "count:params:<key>, count:stages, count:tests:<file>, count:files:<glob>")


@lru_cache(maxsize=None)
def source_values(root: Path, source: str) -> tuple[float, ...]:
    """The numbers a source marker's entry holds (see the module docstring).

    Args:
        root: the repository root.
        source: one entry of a ``<!-- source: ... -->`` marker.

    Returns:
        The source's numbers.

    Raises:
        SourceError: the file is missing or outside ``reports/`` (and not a record document), the key is
            missing, or the counter is unknown.
    """
    if source.startswith("count:"):
        return (_counter(root, source[len("count:"):]),)
    rel, _, key = source.partition("#")
    path = root / rel
    if (rel == "README.md" or rel.startswith("docs/")) and rel not in RECORDS:
        raise SourceError(f"source {source!r}: a source is a committed report under reports/ (or the code or "
                          f"config file that sets the number, or one of {RECORDS}), not a document that quotes one")
    if not path.is_file():
        raise SourceError(f"source {source!r}: {path} does not exist")
    if path.suffix == ".json":
        node: Any = json.loads(path.read_text())
        for part in key.split(".") if key else []:
            if not isinstance(node, dict) or part not in node:
                raise SourceError(f"source {source!r}: {rel} has no key {key!r} (missing {part!r})")
            node = node[part]
        return tuple(json_numbers(node))
    if key:
        raise SourceError(f"source {source!r}: a key (#...) is read from a JSON file only")
    return tuple(_text_numbers(path.read_text()))


def _places(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def _matches(text: str, values: Iterable[float], unit: str | None) -> bool:
    """Whether the number ``text`` (as the prose writes it) is one of ``values``, rounded to its places; a
    duration also after a unit conversion (the source may hold seconds where the prose gives minutes)."""
    target, places = float(text.replace(",", "")), _places(text)
    scales = [1.0]
    if unit is not None:
        scales += [_TO_SECONDS[u] / _TO_SECONDS[unit] for u in _TO_SECONDS if u != unit]
    for value in values:
        for scale in scales:
            if math.isclose(round(value * scale, places), target, abs_tol=10 ** -(places + 6)):
                return True
    return False


# ---- the check ---------------------------------------------------------------------------------------------
def _paragraphs(text: str) -> Iterable[tuple[int, str]]:
    """``(first line number, text)`` of each run of non-blank lines."""
    start, lines = 1, []
    for i, line in enumerate(text.split("\n"), 1):
        if line.strip():
            if not lines:
                start = i
            lines.append(line)
        elif lines:
            yield start, "\n".join(lines)
            lines = []
    if lines:
        yield start, "\n".join(lines)


def prose_numbers(text: str) -> Iterable[tuple[int, str, str, str | None, list[str]]]:
    """Every count and duration of a document outside its generated tables: ``(line, kind, number, unit,
    the paragraph's sources)``, ``kind`` ``"count"`` or ``"duration"``, one entry per number of a range."""
    blanked = _TABLE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep line numbers
    for start, para in _paragraphs(blanked):
        sources = [s.strip() for m in _MARKER.finditer(para) for s in m.group("sources").split(";") if s.strip()]
        body = _MARKER.sub("", para)
        for m in COUNT.finditer(body):
            n = m.group("n").lower()
            value = str(_WORDS[n]) if n in _WORDS else n
            if value not in ("0", "1"):
                yield start + body[:m.start()].count("\n"), "count", value, None, sources
        for m in DURATION.finditer(body):
            for part in ("lo", "hi"):
                if m.group(part):
                    yield (start + body[:m.start()].count("\n"), "duration", m.group(part),
                           _UNIT[m.group("unit").lower()], sources)


def unsourced(root: Path = REPO_ROOT) -> list[str]:
    """One line per count or duration of the docs' prose that no source of its paragraph holds.

    Args:
        root: the repository root.

    Returns:
        ``"<document>:<line>: <number> ..."`` per problem, in document order (empty when every number has its
        source).
    """
    problems = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        rel = doc.relative_to(root).as_posix()
        if rel in EXEMPT or not doc.is_file():
            continue
        for line, kind, number, unit, sources in prose_numbers(doc.read_text()):
            shown = f"{number} {unit}" if unit else f"{number} (a count)"
            if not sources:
                problems.append(f"{rel}:{line}: {shown} has no source: add <!-- source: FILE --> naming the "
                                "committed report that recorded it (or count:...), or drop the number")
                continue
            try:
                if not any(_matches(number, source_values(root, s), unit) for s in sources):
                    problems.append(f"{rel}:{line}: {shown} is in none of its sources {sources}: quote the "
                                    "number the source holds")
            except SourceError as err:
                problems.append(f"{rel}:{line}: {err}")
    return problems


def main(argv: list[str] | None = None) -> int:
    found = unsourced()
    for problem in found:
        print(problem)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
