"""The report as DVC reads it: per-arm curves for ``dvc plots`` and a per-arm summary for ``dvc exp show``.

``curve_rows`` turns the train runs' metric histories (``trace.reporting.report.collect_results``) into long
tables, one row per (arm, step), each value the mean over the arm's training seeds: ``train`` (every step:
train reward, effective ratio, effective token ratio, cumulative generated tokens) and ``eval`` (the
in-training evaluations: held-out greedy accuracy and, with ``train.eval_samples``, avg@k, against the step
and the cumulative generated tokens). ``write_curves`` writes them as ``reports/curves/{train,eval}.csv``, which
``dvc.yaml``'s top-level ``plots`` draw with the ``by_arm`` template (``.dvc/plots/by_arm.json``: one line per arm,
one dash per experiment in ``dvc plots diff``). ``arm_summary`` is ``reports/arms.json``, a DVC metrics file:
per arm the mean over seeds and the 95 % t-interval of held-out greedy accuracy, avg@k, effective ratio and
generated tokens, and the gains over the warmup, so ``dvc exp show`` has one column set per arm.
Invariant: the same results give the same bytes.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Mapping

from trace.tracking.names import EVAL_ACCURACY, EVAL_SAMPLED_ACCURACY

# column of a curves file -> the train runs' step metric it averages
TRAIN_CURVES = {"train_reward": "reward/mean", "effective_ratio": "effective_ratio",
                "effective_token_ratio": "effective_token_ratio", "tokens": "tokens/cumulative"}
EVAL_CURVES = {"heldout_greedy": EVAL_ACCURACY, "heldout_avgk": EVAL_SAMPLED_ACCURACY, "tokens": "tokens/cumulative"}
# reports/arms.json: name -> the report statistics' column
SUMMARY_COLUMNS = {"heldout_greedy": "eval greedy", "heldout_avgk": "eval mean@k", "effective_ratio": "effective ratio",
                   "generated_tokens": "generated tokens"}


def _mean(values: list[float]) -> float:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def curve_rows(results: Mapping[str, Mapping[int, dict]], columns: Mapping[str, str]) -> list[dict]:
    """One row per (arm, step) a seed's run logged the first column's metric at: the mean over the arm's seeds
    of every column (a seed without the metric at that step is left out of that mean; NaN when none has it).

    Args:
        results: ``collect_results`` output (``{arm: {seed: {"history": {key: [(step, value), ...]}}}}``).
        columns: output column -> step metric (``TRAIN_CURVES``, ``EVAL_CURVES``); the first names the steps.

    Returns:
        ``[{"arm", "step", <column>: float, ...}]`` by arm (``results`` order), then step; empty when no run
        logged the first column's metric.
    """
    first = next(iter(columns.values()))
    rows = []
    for arm, by_seed in results.items():
        per_seed = [{key: dict(res["history"].get(key) or []) for key in columns.values()} for res in by_seed.values()]
        steps = sorted({step for hist in per_seed for step in hist[first]})
        for step in steps:
            row = {"arm": arm, "step": int(step)}
            for column, key in columns.items():
                row[column] = _mean([hist[key].get(step) for hist in per_seed if step in hist[first]])
            rows.append(row)
    return rows


def _csv(rows: list[dict], columns: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["arm", "step", *columns], lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) and math.isfinite(v) else "" if isinstance(v, float)
                             else v) for k, v in row.items()})
    return out.getvalue()


def write_curves(results: Mapping[str, Mapping[int, dict]], folder: str | Path) -> list[Path]:
    """``<folder>/train.csv`` and ``<folder>/eval.csv`` (``curve_rows`` of ``TRAIN_CURVES``, ``EVAL_CURVES``), written
    atomically; an empty table is still written with its header, so ``dvc plots`` always finds the file.

    Returns:
        The two paths.
    """
    from trace.tree_io import atomic_write_bytes

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, columns in (("train.csv", TRAIN_CURVES), ("eval.csv", EVAL_CURVES)):
        path = folder / name
        atomic_write_bytes(path, _csv(curve_rows(results, columns), list(columns)).encode())
        paths.append(path)
    return paths


def arm_summary(arm_stats: Mapping[str, dict]) -> dict:
    """``reports/arms.json``: per arm ``{name: {"mean", "low", "high"}}`` over seeds for ``SUMMARY_COLUMNS``, and
    ``gain_greedy`` / ``gain_avgk`` over the warmup where the report has them; undefined values are left out.

    Args:
        arm_stats: ``trace.reporting.report.arm_statistics(...)["arms"]``.

    Returns:
        ``{arm: {...}}`` of finite floats, rounded to 6 significant digits.
    """
    def interval(iv) -> dict:
        return {k: float(f"{v:.6g}") for k, v in (("mean", iv.mean), ("low", iv.low), ("high", iv.high))
                if math.isfinite(v)}

    out: dict = {}
    for arm, st in arm_stats.items():
        entry = {name: interval(st["columns"][col]) for name, col in SUMMARY_COLUMNS.items() if col in st["columns"]}
        for name, col in (("gain_greedy", "eval greedy"), ("gain_avgk", "eval mean@k")):
            if col in st.get("vs_warmup", {}):
                entry[name] = interval(st["vs_warmup"][col])
        out[arm] = {k: v for k, v in entry.items() if v}
    return out
