"""``reports/metrics.json``: the report's statistics as strict JSON (``trace.reporting.report.arm_statistics``)."""

from __future__ import annotations

import math

from trace.predictor.reliability import compact_rows, diagram_ece
from trace.reporting.report import CONFIDENCE, arm_statistics
from trace.reporting.statistics import Interval, TargetCrossings
from trace.reporting.verdicts import ALPHA, DEFAULT_MARGIN, FAMILIES, POWER, judge


def _json_interval(iv: Interval | None) -> dict | None:
    if iv is None:
        return None

    def clean(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    out = {"mean": clean(iv.mean), "low": clean(iv.low), "high": clean(iv.high), "n": iv.n, "estimator": iv.estimator}
    if iv.seed_interval is not None:  # a bootstrap interval: the seed t-interval it is also checked against
        out["seed_interval"] = _json_interval(iv.seed_interval)
    return out


def _clean(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _json_crossings(crossings: TargetCrossings | None, target: dict) -> dict:
    """Tokens to the target of one arm: the target, each seed's crossing or censored tokens, the median; or
    why the target was refused."""
    if crossings is None:
        return {"target": _clean(target["target"]), "refused": target["refusal"]}
    return {"target": _clean(crossings.target), "reached": {f"s{s}": v for s, v in crossings.reached.items()},
            "censored": {f"s{s}": _clean(v) for s, v in crossings.censored.items()}, "median": _clean(crossings.median)}


def design(margin: float, num_questions: int | None, split: str = "eval") -> dict:
    """``reports/metrics.json``'s ``design``: the families, their level, the margin and the power asked, and the
    held-out questions the claims read (``evaluate.num_prompts`` of ``evaluate.split``: ``eval`` is the dev split),
    so a table rebuilt from the file (``scripts.docs_tables_runs``) states the same rule."""
    return {"alpha": ALPHA, "power": POWER, "margin": margin, "num_questions": num_questions, "split": split,
            "families": [{"name": name, "versus": versus, "columns": list(columns)} for name, versus, columns in FAMILIES]}


def metrics_table(results: dict, pass_k: int, confidence: float = CONFIDENCE, warmup: dict | None = None,
                  warmup_questions: dict | None = None, margin: float = DEFAULT_MARGIN,
                  target_accuracy: float | None = None) -> dict[str, dict]:
    """``reports/metrics.json``'s ablations: per arm, per seed (``s<seed>``) its ``arm/*`` results and its
    evaluate metrics under ``eval/``, and the statistics of ``arm_statistics`` (intervals as
    ``{"mean", "low", "high", "n", "estimator"}`` (``t`` or ``bootstrap``, the latter with the
    ``seed_interval`` it is checked against), undefined bounds as null; a paired difference with ``real`` (every
    interval excludes 0), ``p`` and ``decided_by`` (``trace.reporting.verdicts.deciding_p``), ``family``,
    ``p_holm`` and ``real_after_correction``): ``vs_grpo``, ``vs_trace`` (where ``trace`` ran), ``vs_warmup``
    (gain over the warmup policy, greedy and avg@k, with ``warmup``); ``margin`` (the primary comparison's
    verdict against ``margin`` and the interval it read), ``power`` (its minimum detectable differences and the
    seeds and questions that reach the margin), ``group`` (against ``grpo``), and ``tokens_to_target`` /
    ``tokens_to_target_sampled`` (greedy and avg@k curves: per seed the crossing or the censored tokens, or the
    reason the target was refused)."""
    full = arm_statistics(results, pass_k, confidence, warmup, warmup_questions, target_accuracy)
    stats = full["arms"]
    judged = judge(stats, margin)
    out: dict[str, dict] = {}
    for abl, by_seed in results.items():
        st = stats[abl]
        entry: dict = {f"s{seed}": {**res["summary"], **{f"eval/{k}": v for k, v in res.get("eval", {}).items()}}
                       for seed, res in by_seed.items()}
        entry["mean"] = {c: _json_interval(iv) for c, iv in st["columns"].items()}
        for versus in ("vs_grpo", "vs_trace", "vs_warmup"):
            if st.get(versus):
                entry[versus] = {}
                for c, iv in st[versus].items():
                    cell = {**_json_interval(iv), "real": iv.excludes_zero}
                    if (v := judged["verdicts"].get((abl, versus, c))) is not None:
                        cell.update({"p": _clean(v.p), "decided_by": v.decided_by, "family": v.family,
                                     "p_holm": _clean(v.p_adjusted), "real_after_correction": v.real_corrected})
                    entry[versus][c] = cell
        if abl in judged["margins"]:
            words, low, high = judged["margins"][abl]
            entry["margin"] = {"verdict": words, "low": _clean(low), "high": _clean(high), "delta": margin}
        if abl in judged["power"]:
            pw = judged["power"][abl]
            entry["power"] = {"mdd": _clean(pw.mdd), "mdd_seeds": _clean(pw.mdd_seeds),
                              "mdd_bootstrap": _clean(pw.mdd_bootstrap), "question_se": _clean(pw.question_se),
                              "seeds_needed": pw.seeds_needed, "questions_factor": _clean(pw.questions_factor)}
        entry["group"] = judged["groups"][abl]
        entry["tokens_to_target"] = _json_crossings(st["crossings"], full["targets"]["eval greedy"])
        entry["tokens_to_target_sampled"] = _json_crossings(st["crossings_sampled"], full["targets"]["eval mean@k"])
        if st["probe_gain"] is not None:
            entry["probe_gain"] = _json_interval(st["probe_gain"])
        if st["audit"]:
            entry["audit"] = {k: _json_interval(iv) for k, iv in st["audit"].items()}
            entry["audit_seeds"] = {k: {f"s{s}": v for s, v in by.items()} for k, by in st["audit_seeds"].items()}
        if st.get("allocator_state"):
            entry["allocator_state"] = {k: _json_interval(iv) for k, iv in st["allocator_state"].items()}
            entry["allocator_state_seeds"] = {k: {f"s{s}": v for s, v in by.items()}
                                              for k, by in st["allocator_state_seeds"].items()}
        if st.get("flips_vs_random") is not None:
            entry["flips_vs_random"] = _json_interval(st["flips_vs_random"])
        if st.get("reliability"):  # pooled over the audits and seeds
            entry["reliability"] = {stage: [{k: _clean(v) for k, v in row.items()} for row in rows]
                                    for stage, rows in st["reliability"].items()}
            entry["pooled_ece"] = {stage: _clean(diagram_ece(rows)) for stage, rows in st["reliability"].items()}
            entry["pooled_ece_seeds"] = {stage: {f"s{s}": _clean(v) for s, v in by.items()}
                                         for stage, by in st["pooled_ece_seeds"].items()}
            if st.get("pooled_ece_interval"):  # a percentile bootstrap over the audits
                entry["pooled_ece_interval"] = {stage: {"low": _clean(low), "high": _clean(high)}
                                                for stage, (low, high) in st["pooled_ece_interval"].items()}
            if st.get("audit_diagrams"):  # each seed's audits (compact_rows), for comparisons across reports
                entry["audit_diagrams"] = {stage: {f"s{seed}": [compact_rows(rows) for rows in audits]
                                                   for seed, audits in by_seed.items()}
                                           for stage, by_seed in st["audit_diagrams"].items()}
            if st.get("ece_noise"):  # what a calibrated predictor reads here, and the ECE with that noise removed
                entry["ece_floor"] = {stage: _clean(v["floor"]) for stage, v in st["ece_noise"].items()}
                entry["debiased_ece"] = {stage: _clean(v["debiased"]) for stage, v in st["ece_noise"].items()}
                entry["debiased_ece_interval"] = {stage: {"low": _clean(v["debiased_interval"][0]),
                                                          "high": _clean(v["debiased_interval"][1])}
                                                  for stage, v in st["ece_noise"].items()}
        out[abl] = entry
    return out
