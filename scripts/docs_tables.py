"""Write every results and benchmarks table of ``README.md`` and ``docs/*.md`` from the committed reports.

A generated table sits between two marker comments in a Markdown file::

    <!-- table:long-arms -->
    ...                                   (rewritten by this script; do not edit by hand)
    <!-- /table:long-arms -->

Each name is one function below that reads committed files only: a run report folder
``reports/runs/<folder>/`` (``metrics.json``; which folder feeds which tables is ``reports/runs/index.yaml``, so a
re-run committed as a new folder is a one-line change there) or a benchmark report ``reports/benchmarks/<name>.json``.
Invariant: after ``python -m scripts.docs_tables`` every table in the docs is what these files say; ``--check``
changes nothing and exits 1 naming each table that differs (``tests/test_docs_tables.py`` runs it), so a re-run
that changes a number changes the docs in the same commit.

It lives in ``scripts/`` (the repository's command-line tools, run as ``python -m scripts.<name>``) because it
reads the repository's documents and reports, which neither the library (``trace/``) nor a measurement
(``benchmarks/``) should know about. Standard library and PyYAML only (the data-files table imports
``trace.data_paths``, standard library too).

Usage:
    python -m scripts.docs_tables            # rewrite the tables in place
    python -m scripts.docs_tables --check    # exit 1 naming each stale table; write nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNS = Path("reports") / "runs"
BENCHMARKS = Path("reports") / "benchmarks"
INDEX = RUNS / "index.yaml"
DOCS = ("README.md", "docs/*.md")

# index.yaml keys: the reports of `make run`, `make run-paper` and the earlier 75-step run (reports/metrics.json of
# the report stage), and the real-data presets (that format too, or the earlier per-stage one: warmup_stage,
# <arm>.eval, <arm>.train_summary)
ABLATION_REPORTS = ("default", "paper", "long")
# The learning bar of the accuracy run: grpo's held-out greedy gain over its warmup (docs/results.md)
LEARNING_BAR = 0.10
PRESET_REPORTS = ("hotpotqa", "gsm8k", "bfcl")
PRESET_ARMS = ("grpo", "trace")

_MARKER = re.compile(r"<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->\n(?P<body>.*?)<!-- /table:(?P=name) -->", re.DOTALL)
_OPEN = re.compile(r"<!-- table:([A-Za-z0-9_.-]+) -->")
_CLOSE = re.compile(r"<!-- /table:([A-Za-z0-9_.-]+) -->")


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


# ---- run reports of the ablation pipeline (reports/metrics.json of the report stage) -----------------------
def _pass_k(ablations: dict) -> int | None:
    for entry in ablations.values():
        for key, value in entry.items():
            if key.startswith("s") and isinstance(value, dict):
                for metric in value:
                    if m := re.fullmatch(r"eval/accuracy/pass_at_(\d+)", metric):
                        return int(m.group(1))
    return None


def _ranked(ablations: dict) -> list[str]:
    """Arms by mean held-out greedy accuracy, then effective ratio (the report's own order)."""
    def key(arm: str) -> tuple[float, float]:
        cols = ablations[arm]["mean"]
        acc, eff = [(cols.get(c) or {}).get("mean") for c in ("eval greedy", "effective ratio")]
        return (-(acc if _finite(acc) else -1.0), -(eff if _finite(eff) else -1.0))
    return sorted(ablations, key=key)


def _seeds(entry: dict) -> list[str]:
    return sorted(k for k in entry if re.fullmatch(r"s\d+", k))


def arms_table(ctx: Context, key: str, full: bool) -> str:
    """Per arm, the means over seeds with their 95 % t half-width, ranked as the report ranks them."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    k = _pass_k(abl)
    cols = [("eval greedy", "held-out greedy", 3)]
    if full:
        cols += [("eval mean@k", f"held-out mean@{k}", 3), ("eval pass@k", f"held-out pass@{k}", 3)]
    cols += [("effective ratio", "effective ratio", 3), ("effective token ratio", "effective token ratio", 3)]
    if full:
        cols += [("active prompts", "active prompts", 3), ("train reward", "train reward", 3)]
    cols += [("generated tokens", "generated tokens", 0), ("s/step", "s/step", 2)]
    rows = [[str(rank), f"`{arm}`"] + [_pm(abl[arm]["mean"].get(c), d) for c, _, d in cols]
            for rank, arm in enumerate(_ranked(abl), 1)]
    seeds = sorted({s for entry in abl.values() for s in _seeds(entry)}, key=lambda s: int(s[1:]))
    note = (f"Mean over seeds {', '.join(s[1:] for s in seeds)} ± the half-width of the 95 % t-interval; training "
            f"columns are means over steps, generated tokens the run's total. {_source(ctx, folder)}")
    return _table(["rank", "arm"] + [label for _, label, _ in cols], rows,
                  ["---:", "---"] + ["---:"] * len(cols)) + "\n\n" + note


def vs_grpo_table(ctx: Context, key: str, full: bool) -> str:
    """Each arm minus ``grpo`` at the same seed: mean, 95 % interval, real or within noise."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    cols = [("effective ratio", "effective ratio", 3)]
    if full:
        cols += [("effective token ratio", "effective token ratio", 3)]
    cols += [("generated tokens", "generated tokens", 0), ("eval greedy", "held-out greedy", 3)]
    if full:
        cols += [("eval mean@k", f"held-out mean@{_pass_k(abl)}", 3)]
    rows = [[f"`{arm}`"] + [_diff(abl[arm]["vs_grpo"].get(c), d) for c, _, d in cols]
            for arm in _ranked(abl) if "vs_grpo" in abl[arm]]
    estimators = {iv.get("estimator") for arm in abl.values() for iv in arm.get("vs_grpo", {}).values()}
    how = ("paired by seed, 95 % t-interval" if estimators <= {None, "t"}
           else "95 % interval: t over seeds, or a paired bootstrap over questions and seeds where the report says so")
    note = f"Arm minus `grpo` at the same seed ({how}); *real* only when the interval excludes 0. {_source(ctx, folder)}"
    return _table(["arm minus `grpo`"] + [label for _, label, _ in cols], rows) + "\n\n" + note


def regime_table(ctx: Context, key: str) -> str:
    """The warmup policy RL starts from: the SFT step kept, its sampled success, its held-out accuracy."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    w = metrics["warmup"]
    header = ["SFT step kept", "sampled success (training prompts)", "held-out greedy"]
    row = [_num(w.get("warmup/chosen_step"), 0), _num(w.get("warmup/chosen_success")), _num(w.get("accuracy/greedy"))]
    hops = sorted((int(m.group(1)), k) for k in w if (m := re.fullmatch(r"accuracy/greedy_hops(\d+)", k)))
    for n, name in hops:
        header.append(f"held-out, {n} hop{'s' if n > 1 else ''}")
        row.append(_num(w[name]))
    header.append("training questions, greedy")
    row.append(_num(w.get("accuracy_train/greedy")))
    return _table(header, [row], ["---:"] * len(header)) + "\n\n" + _source(ctx, folder)


def gain_table(ctx: Context, key: str) -> str:
    """Per arm, held-out greedy accuracy after RL minus the warmup's, with the verdict on the learning bar.

    The warmup's accuracy is one number shared by every seed, so the t-interval of the gain over seeds is the
    arm's accuracy interval shifted by it; it leaves out the warmup evaluation's own error (the report's
    ``summary.md`` gives the paired bootstrap over questions that includes it).
    """
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl, warmup = metrics["ablations"], metrics["warmup"].get("accuracy/greedy")
    rows = []
    for arm in _ranked(abl):
        iv = abl[arm]["mean"].get("eval greedy") or {}
        if not (_finite(warmup) and _finite(iv.get("mean"))):
            rows.append([f"`{arm}`", _pm(iv), "n/a", "n/a"])
            continue
        low, high = (iv[k] - warmup if _finite(iv.get(k)) else None for k in ("low", "high"))
        bound = lambda x: _num(x, 4 if abs(x) < 5e-4 else 3, True)  # a bound next to 0 shows its side
        shown = _num(iv["mean"] - warmup, 3, True) + (f" [{bound(low)}, {bound(high)}]"
                                                        if low is not None and high is not None else " (one seed)")
        rows.append([f"`{arm}`", _pm(iv), shown, "n/a" if low is None else ("yes" if low > 0 else "no")])
    bar = ""
    if "grpo" in abl and _finite(warmup):
        g = abl["grpo"]["mean"].get("eval greedy") or {}
        met = _finite(g.get("low")) and g["mean"] - warmup >= LEARNING_BAR and g["low"] > warmup
        bar = (f" The learning bar (`grpo`'s gain >= {LEARNING_BAR:.2f} with the interval's lower end above the "
               f"warmup) is **{'met' if met else 'not met'}**.")
    note = (f"Held-out greedy accuracy after RL: mean over seeds ± the 95 % t half-width; minus the warmup's "
            f"{_num(warmup)}: the same interval shifted, which leaves out the warmup evaluation's own error (the "
            f"report's `summary.md` gives `grpo`'s gain with a paired bootstrap over questions that includes it)."
            f"{bar} " + _source(ctx, folder))
    return _table(["arm", "held-out greedy", "minus warmup [95 % t over seeds]", "lower end above warmup"],
                  rows) + "\n\n" + note


def _gain(iv: dict | None) -> str:
    """A gain over the warmup: ``+m [bootstrap low, high]; t [low, high] real`` (a bootstrap interval with its
    seed t-interval), or ``_diff``'s form for a t-interval alone."""
    if not iv or iv.get("estimator") != "bootstrap" or not iv.get("seed_interval"):
        return _diff(iv)
    t = iv["seed_interval"]
    if not (_finite(iv.get("low")) and _finite(t.get("low"))):
        return f"{_num(iv['mean'], 3, True)} (one seed)"
    return (f"{_num(iv['mean'], 3, True)} [{_num(iv['low'], 3, True)}, {_num(iv['high'], 3, True)}]; "
            f"t [{_num(t['low'], 3, True)}, {_num(t['high'], 3, True)}] {'real' if iv.get('real') else 'within noise'}")


def gain_avgk_table(ctx: Context, key: str) -> str:
    """Per arm, held-out greedy accuracy and avg@k after RL and their gains over the warmup policy (the report's
    ``vs_warmup``: a paired bootstrap over questions and seeds, real only when it and the t-interval over seeds
    exclude 0), with the verdict on the learning bar, asked of avg@k."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl, k = metrics["ablations"], _pass_k(metrics["ablations"])
    if not any(e.get("vs_warmup") for e in abl.values()):
        return ("This report has no gains over the warmup per question (written before `vs_warmup`). "
                + _source(ctx, folder))
    rows = []
    for arm in _ranked(abl):
        cols, gains = abl[arm]["mean"], abl[arm].get("vs_warmup", {})
        rows.append([f"`{arm}`", _pm(cols.get("eval mean@k")), _gain(gains.get("eval mean@k")),
                     _pm(cols.get("eval greedy")), _gain(gains.get("eval greedy"))])
    w = metrics["warmup"]
    base_k = w.get(f"accuracy/mean@{k}", w.get(f"accuracy/mean_at_{k}"))
    g = abl.get("grpo", {}).get("vs_warmup", {}).get("eval mean@k") or {}
    met = _finite(g.get("mean")) and g["mean"] >= LEARNING_BAR and bool(g.get("real"))
    note = (f"After RL: mean over seeds ± the 95 % t half-width. Gain: the arm minus the warmup policy (avg@{k} "
            f"{_num(base_k)}, greedy {_num(w.get('accuracy/greedy'))}), mean with the 95 % interval of a paired "
            f"bootstrap over the held-out questions and seeds (the evaluations' own noise included) and the "
            f"t-interval over seeds; *real* only when both exclude 0. avg@{k}: the mean reward of {k} sampled "
            f"rollouts per question (DeepScaleR's avg@k, verl's mean@k); greedy: one rollout at temperature 0 "
            f"(Search-R1's exact match). The learning bar (`grpo`'s avg@{k} gain >= {LEARNING_BAR:.2f}, real) is "
            f"**{'met' if met else 'not met'}**. " + _source(ctx, folder))
    return _table(["arm", f"held-out avg@{k}", f"avg@{k} minus warmup", "held-out greedy", "greedy minus warmup"],
                  rows) + "\n\n" + note


def tokens_to_target_table(ctx: Context, key: str, sampled: bool = False) -> str:
    """Per arm, the generated tokens to reach ``grpo``'s final in-training held-out accuracy (the curves):
    greedy, or avg@k with ``sampled``."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    last, hit_key = ("arm/last_eval_avgk", "tokens_to_grpo_final_sampled") if sampled else \
        ("arm/last_eval_acc", "tokens_to_grpo_final")
    finals = [abl["grpo"][s].get(last) for s in _seeds(abl["grpo"])] if "grpo" in abl else []
    finals = [f for f in finals if _finite(f)]
    if not finals:
        return "No `grpo` in-training evaluation in this report: no target accuracy. " + _source(ctx, folder)
    rows = []
    for arm in _ranked(abl):
        hit, seeds = abl[arm].get(hit_key), len(_seeds(abl[arm]))
        reached = int(hit.get("n", 0)) if hit else 0
        if not hit or not _finite(hit.get("mean")):
            shown = "not reached"
        elif reached == seeds and reached > 1 and _finite(hit.get("low")):
            shown = f"{_num(hit['mean'], 0)} [{_num(hit['low'], 0)}, {_num(hit['high'], 0)}]"
        else:
            shown = f"{_num(hit['mean'], 0)} (mean of the seeds that reach it)"
        rows.append([f"`{arm}`", shown, f"{reached}/{seeds}"])
    target = sum(finals) / len(finals)
    what = "avg@k" if sampled else "accuracy"
    note = (f"Generated tokens until the in-training held-out {what} first reaches {_num(target)}, `grpo`'s final "
            f"one (mean over its seeds): per seed the first crossing of accuracy against cumulative generated "
            f"tokens, linearly interpolated; the 95 % t-interval when every seed reaches it. " + _source(ctx, folder))
    return _table(["arm", f"tokens to {_num(target)}", "seeds reaching"], rows) + "\n\n" + note


def audit_table(ctx: Context, key: str) -> str:
    """Per arm, the allocation audit: forecast against realised mixed groups and flips per step."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    keys = [("audit/expected_mixed_groups", "expected mixed groups"), ("audit/mixed_groups", "mixed groups"),
            ("audit/expected_flips", "expected flips"), ("audit/flips", "flips")]
    rows = [[f"`{arm}`"] + [_pm(abl[arm].get("audit", {}).get(k), 2) for k, _ in keys] for arm in _ranked(abl)]
    note = ("Per step, mean over steps then over seeds ± 95 % t half-width; n/a: the arm reads no forecast. "
            + _source(ctx, folder))
    return _table(["arm"] + [label for _, label in keys], rows) + "\n\n" + note


# ---- the real-data presets ---------------------------------------------------------------------------------
def _preset_summary(metrics: dict) -> dict:
    """The numbers a preset table shows, from either report format.

    Returns:
        ``{"warmup": {...}, "grpo": {...}, "trace": {...}}``: per column ``greedy``, ``sampled``,
        ``train_greedy``, ``truncated``; per arm also ``reward``, ``eff_ratio``, ``tok_step``, ``sec_step``,
        ``steps``, ``seeds``; for the warmup ``step``, ``success``, ``demos``.
    """
    def mean(values: list) -> float | None:
        vals = [v for v in values if _finite(v)]
        return sum(vals) / len(vals) if vals else None

    if "ablations" in metrics:  # the report stage's format (make run with the preset as params.yaml)
        w = metrics["warmup"]
        sampled = next((v for k, v in w.items() if k.startswith("accuracy/mean@")), None)
        out = {"warmup": {"greedy": w.get("accuracy/greedy"), "sampled": sampled,
                          "train_greedy": w.get("accuracy_train/greedy"), "truncated": w.get("accuracy/truncated"),
                          "step": w.get("warmup/chosen_step"), "success": w.get("warmup/chosen_success"),
                          "demos": w.get("warmup/demonstrations")}}
        for arm in PRESET_ARMS:
            entry = metrics["ablations"].get(arm)
            if entry is None:
                continue
            seeds = [entry[s] for s in _seeds(entry)]
            cols = entry["mean"]
            out[arm] = {"greedy": (cols.get("eval greedy") or {}).get("mean"),
                        "sampled": (cols.get("eval mean@k") or {}).get("mean"),
                        "train_greedy": mean([s.get("eval/accuracy_train/greedy") for s in seeds]),
                        "truncated": mean([s.get("eval/accuracy/truncated") for s in seeds]),
                        "reward": (cols.get("train reward") or {}).get("mean"),
                        "eff_ratio": (cols.get("effective ratio") or {}).get("mean"),
                        "tok_step": mean([s.get("arm/tok_step") for s in seeds]),
                        "sec_step": (cols.get("s/step") or {}).get("mean"),
                        "steps": mean([s.get("arm/steps") for s in seeds]), "seeds": len(seeds)}
        return out
    # the per-stage format of the first preset runs: the warmup evaluated again on the arms' held-out
    # questions (warmup_eval_<n>) when the stage's own evaluation used fewer
    again = sorted(k for k in metrics if k.startswith("warmup_eval_"))
    w, stage = metrics[again[-1]] if again else metrics["warmup_stage"], metrics["warmup_stage"]
    out = {"warmup": {"greedy": w.get("accuracy/greedy"), "sampled": w.get("accuracy/mean@1"),
                      "train_greedy": w.get("accuracy_train/greedy"), "truncated": w.get("accuracy/truncated"),
                      "step": stage.get("warmup/chosen_step"), "success": stage.get("warmup/chosen_success"),
                      "demos": stage.get("warmup/demonstrations")}}
    for arm in PRESET_ARMS:
        if arm not in metrics:
            continue
        ev, tr = metrics[arm]["eval"], metrics[arm]["train_summary"]
        out[arm] = {"greedy": ev.get("accuracy/greedy"), "sampled": ev.get("accuracy/mean@1"),
                    "train_greedy": ev.get("accuracy_train/greedy"), "truncated": ev.get("accuracy/truncated"),
                    "reward": tr.get("mean/reward/mean"), "eff_ratio": tr.get("mean/effective_ratio"),
                    "tok_step": tr.get("mean/tokens/generated"), "sec_step": tr.get("mean/time/step"),
                    "steps": tr.get("train/steps"), "seeds": 1}
    return out


def _held_out_count(ctx: Context, folder: str, metrics: dict) -> int | None:
    """Held-out questions behind a preset report's greedy accuracies: ``warmup_eval_<n>`` of the metrics, else
    the "held-out greedy (<n>)" row of its ``summary.md``; None when neither says."""
    for key in metrics:
        if m := re.fullmatch(r"warmup_eval_(\d+)", key):
            return int(m.group(1))
    summary = ctx.root / RUNS / folder / "summary.md"
    found = re.search(r"held-out greedy \((\d+)\)", summary.read_text()) if summary.is_file() else None
    return int(found.group(1)) if found else None


def _with_se(acc: Any, n: int | None) -> str:
    """``0.143 ± 0.066``: an accuracy with its binomial standard error ``sqrt(p (1 - p) / n)``."""
    if not _finite(acc) or not n:
        return _num(acc)
    return f"{_num(acc)} ± {math.sqrt(acc * (1 - acc) / n):.3f}"


def presets_table(ctx: Context) -> str:
    """One row per real-data preset: held-out greedy accuracy after warmup and after RL, effective ratio and
    generated tokens per step of ``grpo`` and ``trace``."""
    rows = []
    for key in PRESET_REPORTS:
        folder, metrics = ctx.report(key)
        if metrics is None:
            rows.append([f"`params/{key}.yaml`", "no committed report"] + [""] * 6)
            continue
        s = _preset_summary(metrics)
        g, t = s.get("grpo", {}), s.get("trace", {})
        n = _held_out_count(ctx, folder, metrics)
        rows.append([f"`params/{key}.yaml`", f"[`{folder}`]({ctx.link(RUNS / folder)})",
                     f"{_num(g.get('steps'), 0)} x {_num(g.get('seeds'), 0)}", _num(n, 0),
                     " / ".join(_with_se(x, n) for x in (s['warmup']['greedy'], g.get('greedy'), t.get('greedy'))),
                     f"{_num(g.get('eff_ratio'))} / {_num(t.get('eff_ratio'))}",
                     f"{_num(g.get('tok_step'), 0)} / {_num(t.get('tok_step'), 0)}",
                     f"{_num(g.get('sec_step'), 1)} / {_num(t.get('sec_step'), 1)}"])
    return _table(["preset", "report", "RL steps x seeds", "held-out questions",
                   "held-out greedy ± SE: warmup / `grpo` / `trace`", "effective ratio `grpo` / `trace`",
                   "generated tokens per step", "s/step"], rows,
                  ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"]) + (
        "\n\nOne seed per arm: no interval, so no difference here is called real; ± is the binomial standard error "
        "of one evaluation, sqrt(p (1 - p) / n). s/step includes the in-training evaluations and depends on how the "
        "run was placed (each report's `summary.md` says).")


def preset_table(ctx: Context, key: str) -> str:
    """One preset in detail: the warmup policy against ``grpo`` and ``trace`` after RL."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    s = _preset_summary(metrics)
    w, g, t = s["warmup"], s.get("grpo", {}), s.get("trace", {})
    rows = [["held-out greedy", _num(w["greedy"]), _num(g.get("greedy")), _num(t.get("greedy"))],
            ["held-out sampled (T = 1.0)", _num(w["sampled"]), _num(g.get("sampled")), _num(t.get("sampled"))],
            ["held-out episodes out of turns (greedy)", _num(w["truncated"]), _num(g.get("truncated")),
             _num(t.get("truncated"))],
            ["training questions, greedy", _num(w["train_greedy"]), _num(g.get("train_greedy")),
             _num(t.get("train_greedy"))],
            ["train reward (mean over steps)", "", _num(g.get("reward")), _num(t.get("reward"))],
            ["effective ratio (mean over steps)", "", _num(g.get("eff_ratio")), _num(t.get("eff_ratio"))],
            ["generated tokens per step", "", _num(g.get("tok_step"), 0), _num(t.get("tok_step"), 0)],
            ["s/step (in-training evaluations included)", "", _num(g.get("sec_step"), 1), _num(t.get("sec_step"), 1)]]
    header = ["", f"warmup (SFT step {_num(w['step'], 0)}, sampled success {_num(w['success'])}, "
                  f"{_num(w['demos'], 0)} demonstrations)",
              f"`grpo`, {_num(g.get('steps'), 0)} steps", f"`trace`, {_num(t.get('steps'), 0)} steps"]
    seeds = g.get("seeds") or 1
    note = ("One seed: no interval. " if seeds == 1 else f"Means over {seeds} seeds. ") + _source(ctx, folder)
    return _table(header, rows) + "\n\n" + note


# ---- benchmarks ------------------------------------------------------------------------------------------
def _near(value: Any, target: float, digits: int = 3) -> str:
    """``value`` at ``digits`` decimals, or at more (up to 6) when that rounding would land on ``target`` from
    the other side: 0.8996 against 0.9 reads 0.8996, not 0.900."""
    if not _finite(value):
        return _num(value, digits)
    while digits < 6 and round(value, digits) == target and value != target:
        digits += 1
    return _num(value, digits)


def _met(flag: Any) -> str:
    return "met" if flag is True else "missed" if flag is False else ""


def benchmarks_table(ctx: Context) -> str:
    """The benchmarks' headline numbers against their targets (``reports/benchmarks/<name>.json``)."""
    rows = []
    alloc = ctx.benchmark("allocation_quality")["results"]["headline"]
    ratio, learned = alloc["trace_oracle_vs_grpo_effective_ratio"], alloc["trace_learned_vs_oracle_effective_ratio"]
    rows.append(["`trace` (oracle predictor) / `grpo`, effective ratio on the simulator",
                 f"{_num(ratio['mean'], 2)} (sd {_num(ratio['std'], 2)}, {ratio['n']} seeds)", ">= 1.5",
                 _met(alloc["targets"]["trace_oracle_at_least_1.5x_grpo"])])
    rows.append(["`trace` (learned predictor) / `trace` (oracle)",
                 f"{_near(learned['mean'], 0.9)} (sd {_num(learned['std'])})", ">= 0.9",
                 _met(alloc["targets"]["trace_learned_at_least_0.9x_oracle"])])
    solver = ctx.benchmark("solver_speed")["results"]["headline"]
    rows.append(["root allocation, B = 4,096 prompts, M = 65,536, m_max = 64: seconds; certified gap",
                 f"{_num(solver['root_B4096_M65536_m_max64_seconds'], 2)} s; "
                 f"{solver['root_B4096_M65536_m_max64_certified_gap']:.1e}", "< 0.5 s; < 0.1 %",
                 _met(solver["targets"]["root_4096_65536_under_0.5s_gap_under_0.1pct"])])
    rows.append([f"prefix allocation, {solver['prefix_largest_anchors']:,} anchors: seconds",
                 f"{_num(solver['prefix_largest_seconds'], 4)} s", "< 0.2 s",
                 _met(solver["targets"]["prefix_1e5_under_0.2s"])])
    engine = ctx.benchmark("rollout_engine")["results"]["headline"]
    speed = engine["engine_vs_generate"]
    rows.append(["our engine / `model.generate`, tokens per second (" + ", ".join(speed) + ")",
                 " / ".join(_num(v, 2) for v in speed.values()), ">= 1",
                 _met(engine["targets"]["engine_at_least_as_fast_as_generate"])])
    reuse = engine["reuse_vs_new_tokens_alone"]
    rows.append(["k continuations from a shared prefix / their new tokens alone (" + ", ".join(reuse) + ")",
                 " / ".join(_num(v, 2) for v in reuse.values()), "<= 1.25",
                 _met(engine["targets"]["shared_prefix_at_most_1.25x_new_tokens"])])
    orch = ctx.benchmark("orchestration")["results"]["headline"]
    rows.append([f"Prefect + MLflow + Parquet share of a default step ({_num(orch['step_seconds'], 2)} s)",
                 f"{_num(100 * orch['orchestration_share_of_step'], 2)} %", "< 5 %",
                 _met(orch["targets"]["orchestration_under_5pct"])])
    rows.append(["no-op `dvc repro`: seconds", f"{_num(orch['noop_dvc_repro_seconds'], 2)} s", "< 5 s",
                 _met(orch["targets"]["noop_dvc_repro_under_5s"])])
    lora = ctx.benchmark("lora_update")["results"]["headline"]
    rows.append(["LoRA / full fine-tuning, SmolLM2-135M RL step: AdamW state; step time",
                 f"{_num(lora['lora_vs_full_optimizer_memory'])}; {_num(lora['lora_vs_full_step_time'], 2)}",
                 "< 0.1; measured", _met(lora["targets"]["lora_optimizer_state_below_a_tenth_of_full"])])
    step = ctx.benchmark("real_task_step")["results"]["headline"]
    rows.append(["HotpotQA preset step (`trace`, SmolLM2-135M): seconds, full / LoRA in float32, full / LoRA in bf16; "
                 "share outside the model",
                 f"{_num(step['full_step_seconds'], 1)} / {_num(step['lora_step_seconds'], 1)}, "
                 f"{_num(step['full_bf16_step_seconds'], 1)} / {_num(step['lora_bf16_step_seconds'], 1)}; "
                 f"{_num(100 * step['outside_the_model_share'], 1)} %", "measured; < 10 %",
                 _met(step["targets"]["outside_the_model_under_10pct"])])
    dtype = ctx.benchmark("step_dtype")["results"]["headline"]
    rows.append([f"default step, float32 / bf16 seconds (this CPU's native bf16 instructions: {dtype['cpu_bf16']})",
                 f"{_num(dtype['step_seconds_float32'], 2)} s / {_num(dtype['step_seconds_bfloat16'], 2)} s = "
                 f"{_num(dtype['float32_over_bfloat16_step'], 2)}", ">= 1.5",
                 _met(dtype["targets"]["bfloat16_step_at_least_1.5x_faster"])])
    return _table(["measure", "result", "target", ""], rows, ["---", "---:", "---", "---"])


BENCHMARK_NAMES = ("allocation_quality", "allocation_objectives", "solver_speed", "rollout_engine", "orchestration",
                   "lora_update", "real_task_step", "step_dtype")


def benchmark_runs_table(ctx: Context) -> str:
    """Where each benchmark report was measured: commit, threads, cores, machine load, wall time."""
    rows = []
    for name in BENCHMARK_NAMES:
        report = ctx.benchmark(name)
        machine, settings = report.get("machine", {}), report.get("settings", {})
        threads = settings.get("torch_threads", settings.get("threads"))
        rows.append([f"[`{name}`]({ctx.link(BENCHMARKS / f'{name}.json')})", f"`{report.get('git_commit', '')[:7]}`",
                     "no torch" if threads is None else str(threads), machine.get("omp_num_threads") or "unset",
                     str(machine.get("cpu_count", "")), _num(machine.get("load_average_1m"), 2),
                     _num(report.get("duration_s"), 0)])
    return _table(["report", "commit", "torch threads", "OMP_NUM_THREADS", "CPU cores", "load (1 min) at start",
                   "seconds"], rows, ["---", "---", "---:", "---:", "---:", "---:", "---:"])


_PREDICTORS = ("oracle", "noisy_0.5", "noisy_1.0", "history", "learned")


def allocation_quality_table(ctx: Context) -> str:
    """Effective ratio of every arm on the simulator, per predictor (mean and sd over seeds)."""
    summary = ctx.benchmark("allocation_quality")["results"]["summary"]
    rows = []
    for arm, by_pred in summary.items():
        cells = []
        for pred in ("none",) + _PREDICTORS:
            stat = by_pred.get(pred, {}).get("metrics", {}).get("effective_ratio")
            cells.append("" if stat is None else f"{_num(stat['mean'])} ({_num(stat['std'])})")
        rows.append([f"`{arm}`"] + cells)
    return _table(["arm", "no predictor"] + list(_PREDICTORS), rows)


def allocation_objectives_table(ctx: Context) -> str:
    """Effective ratio of ``allocation.root_objective: leaves`` minus ``groups``, paired over seeds."""
    diffs = ctx.benchmark("allocation_objectives")["results"]["headline"]["effective_ratio_leaves_minus_groups"]
    rows = []
    for name, iv in diffs.items():
        arm, pred, m_min = name.split("/")
        rows.append([f"`{arm}`", pred, m_min.split("=")[1], _diff({**iv, "real": iv["low"] > 0 or iv["high"] < 0})])
    return _table(["arm", "predictor", "m_min", "leaves minus groups, effective ratio (95 % t-interval)"], rows,
                  ["---", "---", "---:", "---:"])


WARMUP_SWEEP = RUNS / "warmup-sweep-e9ec8a3" / "sweep.json"  # scripts.warmup_sweep at that commit


def warmup_sweep_table(ctx: Context) -> str:
    """``scripts.warmup_sweep``: per SFT checkpoint what it measures before RL, and ``grpo``'s gain from it."""
    from scripts.warmup_sweep import markdown_table

    sweep = json.loads((ctx.root / WARMUP_SWEEP).read_text())
    return (markdown_table(sweep["rows"]) + "\n\n"
            f"`grpo` for {sweep['rl_steps']} steps at training seed {sweep['seed']} from each checkpoint of one "
            f"warmup ({sweep['params']}); held-out columns on the same {sweep['held_out_questions']} questions; gain in held-out greedy "
            f"with its paired standard error over the questions. Measured at `{sweep['commit']}`. From "
            f"[`{WARMUP_SWEEP.as_posix()}`]({ctx.link(WARMUP_SWEEP)}).")


LEARNING_STUDY = RUNS / "learning-study-e794799" / "study.json"  # scripts.learning_study, library code of e794799


def learning_study_table(ctx: Context) -> str:
    """``scripts.learning_study``: per candidate setting, the held-out gain over the warmup, its difference from
    the reference candidate (paired bootstrap over seeds and questions) and the probe's gain over the frozen policy."""
    from scripts.learning_study import markdown

    study = json.loads((ctx.root / LEARNING_STUDY).read_text())
    reference = study["order"][0]
    return (markdown(study["summary"], reference, study["order"]) + "\n\n"
            f"`{study['arm']}` for {study['rl_steps']} steps at training seeds {', '.join(map(str, study['seeds']))} "
            f"from one warmup policy (held-out greedy {study['warmup_held_out']:.3f} on the same "
            f"{study['held_out_questions']} questions), {study['params']} with each candidate's overrides. Intervals: "
            f"95 % paired bootstrap over questions and seeds; *real* only when it excludes 0. Probe: mean success of "
            f"{study['probe_samples']} sampled rollouts on each of the first {study['probe_prompts']} training prompts, "
            f"after minus before, same seeds. On {study['machine']['cpu']} ({study['machine']['cores']} cores); the "
            f"summary written at `{study['commit'][:7]}`, the runs' commit and times in the folder's README.md. From [`{LEARNING_STUDY.as_posix()}`]({ctx.link(LEARNING_STUDY)}).")


def step_dtype_table(ctx: Context) -> str:
    """The default step in float32 and bf16 (medians of its timers), the products under it, a stage's start-up."""
    res = ctx.benchmark("step_dtype")["results"]
    summary = res["default_step"]["summary"]
    parts = (("step", "time/step"), ("rollouts", "time/rollout"), ("expansion", "time/expand"),
             ("update", "time/update"), ("predictor", "time/predict"))
    rows = [[label] + [f"{_num(summary[d].get(key), 2)} s" for d in ("float32", "bfloat16")]
            + [_num(summary["float32_over_bfloat16"].get(key), 2)] for label, key in parts]
    rate = lambda m, d: _num(m[f"{d}_gflops"], 1)  # noqa: E731
    rows += [[f"matmul {' x '.join(f'{v:,}' for v in m['shape'])}: GFLOP/s", rate(m, "float32"), rate(m, "bfloat16"),
              _num(m["ratio"], 3)] for m in res["matmul"]]  # bf16 / float32 GFLOP/s = float32 / bf16 seconds
    flags = ", ".join(f"`{k}` {'yes' if v else 'no'}" for k, v in res["cpu_bf16_flags"].items())
    startup = res["startup_seconds"]
    imports = "; ".join(f"{k.removeprefix('import ')} {_num(v, 1)} s" for k, v in startup.items()
                        if k.startswith("import ") and k != "import python")
    return (_table(["default step (median of steps 1..)", "float32", "bf16", "float32 / bf16 seconds"], rows) + "\n\n"
            f"CPU flags: {flags}. Stage start-up, each in a fresh interpreter (median): {imports}; an MLflow run "
            f"opened, logged and closed on an existing SQLite store {_num(startup['mlflow run on an existing SQLite store'], 1)} s "
            f"(on a new one {_num(startup['mlflow run on a new SQLite store'], 1)} s).")


def real_task_step_table(ctx: Context) -> str:
    """One HotpotQA preset step per trainer: step, rollout and update seconds (medians), generated tokens."""
    res = ctx.benchmark("real_task_step")["results"]
    labels = {"full": "full fine-tuning, float32", "lora": "LoRA, float32", "full_bf16": "full fine-tuning, bf16",
              "lora_bf16": "LoRA, bf16"}
    rows = []
    for key, label in labels.items():
        sec = res[key]["seconds_median"]
        tokens = res[key].get("generated_tokens") or []
        rows.append([label, _num(sec["time/step"], 1), _num(sec["time/rollout"], 1), _num(sec["time/update"], 1),
                     " / ".join(_num(t, 0) for t in tokens)])
    table = _table(["trainer", "step s", "rollouts s", "update s", "generated tokens (each repeat)"], rows)
    prof = res["profile_full_step"]
    parts = "; ".join(f"{name} {_num(100 * share, 1)} %" for name, share in prof["share"].items())
    return table + f"\n\nOne profiled full float32 step ({_num(prof['step_seconds'], 1)} s): {parts}."


# ---- the data files of the real tasks (code, not a report: generated so it cannot drift) ------------------
def data_files_table(ctx: Context) -> str:
    """``trace.data_paths.DEFAULT_FILES``: the files each real task reads when ``task.files.train_path`` is unset."""
    from trace.data_paths import DEFAULT_FILES, FILE_KEYS

    rows = [[f"`{task}`"] + [f"`{files[k]}`" if k in files else "" for k in FILE_KEYS]
            for task, files in DEFAULT_FILES.items()]
    return _table(["`task.name`"] + [f"`{k}`" for k in FILE_KEYS], rows, ["---"] * (len(FILE_KEYS) + 1))


def tables() -> dict[str, Callable[[Context], str]]:
    """Every table name a document may hold, and the function that writes it."""
    out: dict[str, Callable[[Context], str]] = {}
    for key in ABLATION_REPORTS:
        out[f"{key}-arms"] = lambda ctx, key=key: arms_table(ctx, key, full=False)
        out[f"{key}-arms-full"] = lambda ctx, key=key: arms_table(ctx, key, full=True)
        out[f"{key}-vs-grpo"] = lambda ctx, key=key: vs_grpo_table(ctx, key, full=False)
        out[f"{key}-vs-grpo-full"] = lambda ctx, key=key: vs_grpo_table(ctx, key, full=True)
        out[f"{key}-regime"] = lambda ctx, key=key: regime_table(ctx, key)
        out[f"{key}-audit"] = lambda ctx, key=key: audit_table(ctx, key)
        out[f"{key}-gain"] = lambda ctx, key=key: gain_table(ctx, key)
        out[f"{key}-tokens-to-target"] = lambda ctx, key=key: tokens_to_target_table(ctx, key)
        out[f"{key}-tokens-to-target-avgk"] = lambda ctx, key=key: tokens_to_target_table(ctx, key, sampled=True)
        out[f"{key}-gain-avgk"] = lambda ctx, key=key: gain_avgk_table(ctx, key)
    for key in PRESET_REPORTS:
        out[f"preset-{key}"] = lambda ctx, key=key: preset_table(ctx, key)
    out["presets"] = presets_table
    out["benchmarks"] = benchmarks_table
    out["benchmark-runs"] = benchmark_runs_table
    out["allocation-quality"] = allocation_quality_table
    out["allocation-objectives"] = allocation_objectives_table
    out["real-task-step"] = real_task_step_table
    out["step-dtype"] = step_dtype_table
    out["warmup-sweep"] = warmup_sweep_table
    out["learning-study"] = learning_study_table
    out["data-files"] = data_files_table
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
