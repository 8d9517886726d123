"""What every docs table module shares: the report index, the ``Context`` a table function reads, and the
number formats (``scripts.docs_tables`` writes the tables)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

RUNS = Path("reports") / "runs"
BENCHMARKS = Path("reports") / "benchmarks"
INDEX = RUNS / "index.yaml"
# index.yaml keys: the reports (reports/metrics.json of the report stage) of `make run`, `make run-paper`, the
# earlier 75-step run, every arm (the 160-step study with prompts recurring), the predictor run, `make run-tokens`
# (equal tokens), `trace`'s reliability diagrams with the predictor's forecasts and with the Platt and isotonic
# maps, and without and with exploration groups (and two predictor fits, the root map fitted on them, their roots
# weighted in the fit), stage 1 or stage 2 alone by forecast (trace_root, trace_prefix; read beside
# exploration-base), `trace` audited every 2 steps (audit-dense, labels-dense), `make run-paper` over
# warmups (the pooled study of scripts.warmup_study, in that format) and each warmup's own report in it (its w0/, w1/);
# and the real-data
# presets (that format too, or the earlier per-stage one: warmup_stage, <arm>.eval, <arm>.train_summary)
ABLATION_REPORTS = ("default", "paper", "long", "all-arms", "predictor", "tokens", "reliability", "recalibrated",
                    "isotonic", "paper-warmups", "paper-w0", "paper-w1", "exploration-base", "exploration",
                    "exploration-window4", "exploration-epochs3", "exploration-recalibrated", "exploration-weighted",
                    "exploration-weight4", "labels-branch", "exploration-weighted1",
                    "window4", "stages", "audit-dense", "labels-dense")
PRESET_REPORTS = ("hotpotqa", "gsm8k", "bfcl")


class DocsTableError(ValueError):
    """A marker without its closing marker, a table name no function makes, or an index.yaml entry that
    names no committed report."""


@dataclass(frozen=True)
class Context:
    """What a table function may read: the repository and the document the table is written into.

    Attributes:
        root: the repository root.
        doc: the Markdown file the table goes into (links are relative to its folder).
        index: ``reports/runs/index.yaml``: index key -> report folder name or None.
    """

    root: Path
    doc: Path
    index: dict[str, str | None]

    def link(self, path: Path | str) -> str:
        """A Markdown link target to ``path`` (relative to the repository root) from this document."""
        target = self.root / path
        return Path(os.path.relpath(target, self.doc.parent)).as_posix() + ("/" if target.is_dir() else "")

    def report(self, key: str) -> tuple[str | None, dict | None]:
        """The report folder that ``index.yaml`` names for ``key`` and its ``metrics.json`` (None, None when
        the key is null: no committed report yet)."""
        folder = self.index.get(key)
        if folder is None:
            return None, None
        return folder, json.loads((self.root / RUNS / folder / "metrics.json").read_text())

    def benchmark(self, name: str) -> dict:
        return json.loads((self.root / BENCHMARKS / f"{name}.json").read_text())


def read_index(root: Path) -> dict[str, str | None]:
    """``reports/runs/index.yaml``: which committed report folder each run key reads.

    Raises:
        DocsTableError: an unknown key, or a folder that does not hold a ``metrics.json``.
    """
    path = root / INDEX
    data = yaml.safe_load(path.read_text()) or {}
    known = ABLATION_REPORTS + PRESET_REPORTS
    index: dict[str, str | None] = {}
    for key, folder in data.items():
        if key not in known:
            raise DocsTableError(f"{path}: unknown key {key!r}; the tables read {list(known)}")
        if folder is not None and not (root / RUNS / str(folder) / "metrics.json").is_file():
            raise DocsTableError(f"{path}: {key}: {RUNS / str(folder) / 'metrics.json'} does not exist; commit the "
                                 "report folder or set the key to null")
        index[key] = None if folder is None else str(folder)
    return index


# ---- number formats ---------------------------------------------------------------------------------------
def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _num(x: Any, digits: int = 3, sign: bool = False) -> str:
    if not _finite(x):
        return "n/a"
    if digits == 0:
        return f"{x:+,.0f}" if sign else f"{x:,.0f}"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _pm(iv: dict | None, digits: int = 3) -> str:
    """``mean ± half-width`` of a t-interval over seeds, the mean alone for one seed."""
    if not iv or not _finite(iv.get("mean")):
        return "n/a"
    if iv.get("n", 1) > 1 and _finite(iv.get("low")) and _finite(iv.get("high")):
        return f"{_num(iv['mean'], digits)} ± {_num((iv['high'] - iv['low']) / 2, digits)}"
    return _num(iv["mean"], digits)


def _diff(iv: dict | None, digits: int = 3) -> str:
    """A paired difference: ``+m [low, high] real`` or ``within noise``; one seed: ``+m (one seed)``."""
    if not iv or not _finite(iv.get("mean")):
        return "n/a"
    if iv.get("n", 1) > 1 and _finite(iv.get("low")) and _finite(iv.get("high")):
        verdict = "real" if iv.get("real") else "within noise"
        return (f"{_num(iv['mean'], digits, True)} [{_num(iv['low'], digits, True)}, "
                f"{_num(iv['high'], digits, True)}] {verdict}")
    return f"{_num(iv['mean'], digits, True)} (one seed)"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None) -> str:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _source(ctx: Context, folder: str, what: str = "metrics.json") -> str:
    return f"From [`reports/runs/{folder}/{what}`]({ctx.link(RUNS / folder / what)})."


def _missing(ctx: Context, key: str) -> str:
    return (f"No committed report yet (`reports/runs/index.yaml`: `{key}: null`). Commit what the run writes to "
            f"`reports/` as `reports/runs/<name>-<commit>/` and name that folder there; "
            f"`python -m scripts.docs_tables` then writes this table.")
