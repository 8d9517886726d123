"""Docs tables of the real-data presets (``params/<task>.yaml``): either report format, the report stage's or the
per-stage one of the first preset runs."""

from __future__ import annotations

import math
import re
from typing import Any

from scripts.docs_tables_common import PRESET_REPORTS, RUNS, Context, _finite, _missing, _num, _source, _table
from scripts.docs_tables_runs import _seeds

PRESET_ARMS = ("grpo", "trace")


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
