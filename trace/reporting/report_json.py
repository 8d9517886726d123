"""``reports/metrics.json``: the report's statistics as strict JSON (``trace.reporting.report.arm_statistics``)."""

from __future__ import annotations

import math

from trace.reporting.report import CONFIDENCE, arm_statistics
from trace.reporting.statistics import Interval


def _json_interval(iv: Interval | None) -> dict | None:
    if iv is None:
        return None

    def clean(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    out = {"mean": clean(iv.mean), "low": clean(iv.low), "high": clean(iv.high), "n": iv.n, "estimator": iv.estimator}
    if iv.seed_interval is not None:  # a bootstrap interval: the seed t-interval it is also checked against
        out["seed_interval"] = _json_interval(iv.seed_interval)
    return out


def metrics_table(results: dict, pass_k: int, confidence: float = CONFIDENCE, warmup: dict | None = None,
                  warmup_questions: dict | None = None) -> dict[str, dict]:
    """``reports/metrics.json``'s ablations: per arm, per seed (``s<seed>``) its ``arm/*`` results and its
    evaluate metrics under ``eval/``, and the statistics of ``arm_statistics`` (intervals as
    ``{"mean", "low", "high", "n", "estimator"}`` (``t`` or ``bootstrap``, the latter with the
    ``seed_interval`` it is checked against), undefined bounds as null; a paired difference with ``real``):
    ``vs_grpo``, ``vs_trace`` (where ``trace`` ran), ``vs_warmup`` (gain over the warmup policy, greedy and avg@k, with ``warmup``), and the tokens to
    ``grpo``'s final in-training greedy accuracy and avg@k."""
    stats = arm_statistics(results, pass_k, confidence, warmup, warmup_questions)["arms"]
    out: dict[str, dict] = {}
    for abl, by_seed in results.items():
        st = stats[abl]
        entry: dict = {f"s{seed}": {**res["summary"], **{f"eval/{k}": v for k, v in res.get("eval", {}).items()}}
                       for seed, res in by_seed.items()}
        entry["mean"] = {c: _json_interval(iv) for c, iv in st["columns"].items()}
        for versus in ("vs_grpo", "vs_trace"):
            if versus in st:
                entry[versus] = {c: {**_json_interval(iv), "real": iv.excludes_zero} for c, iv in st[versus].items()}
        if st.get("vs_warmup"):
            entry["vs_warmup"] = {c: {**_json_interval(iv), "real": iv.excludes_zero} for c, iv in st["vs_warmup"].items()}
        entry["tokens_to_grpo_final"] = _json_interval(st["tokens_to_target"])
        entry["reached_grpo_final"] = st["reached"]
        if st["tokens_to_target_sampled"] is not None or st["reached_sampled"]:
            entry["tokens_to_grpo_final_sampled"] = _json_interval(st["tokens_to_target_sampled"])
        entry["reached_grpo_final_sampled"] = st["reached_sampled"]
        if st["probe_gain"] is not None:
            entry["probe_gain"] = _json_interval(st["probe_gain"])
        if st["audit"]:
            entry["audit"] = {k: _json_interval(iv) for k, iv in st["audit"].items()}
        out[abl] = entry
    return out
