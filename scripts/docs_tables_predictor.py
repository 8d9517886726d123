"""Docs table of the predictor's calibration: ``trace``'s forecasts as the predictor gives them and as
``predictor.recalibrate`` maps them (the Platt map, then the isotonic one), each against Monte-Carlo truth on the
unselected sample, from three run reports (index keys ``reliability``, ``recalibrated`` and ``isotonic``) with the
same seeds and params but those switches.

The decisive score is the pooled ECE: the ECE of the reliability diagram pooled over the audited steps (and seeds),
``trace.predictor.reliability.diagram_ece``; the mean of per-audit ECEs stands beside it. The runs pair by
seed (same seeds, same warmup, same prompts a step), so each difference is a paired t-interval over seeds
(``trace.reporting.statistics.paired_difference``)."""

from __future__ import annotations

from scripts.docs_tables_common import Context, _missing, _num, _pm, _source, _table
from trace.reporting.statistics import paired_difference

__all__ = ["CALIBRATION_REPORTS", "calibration_table"]

ARM = "trace"
# index key -> what the allocator reads in that report
CALIBRATION_REPORTS = {"reliability": "the predictor's forecasts", "recalibrated": "Platt map (`predictor.recalibrate`)",
                       "isotonic": "isotonic map (`recalibrate_map: isotonic`)"}
AVGK = "eval/accuracy/mean_at_8"
PLURAL = {"root": "roots", "prefix": "prefixes"}


def _seeds(values: dict | None) -> dict[int, float]:
    return {int(k[1:]): float(v) for k, v in (values or {}).items() if v is not None}


def _interval(iv) -> str:
    mean = 0.0 if abs(iv.mean) < 5e-4 else iv.mean  # no "-0.000"
    if iv.n < 2:
        return f"{_num(mean, 3, True)} (one seed)"
    return f"{_num(mean, 3, True)} [{_num(iv.low, 3, True)}, {_num(iv.high, 3, True)}]"


def calibration_table(ctx: Context) -> str:
    """Per report and stage: pooled ECE (and per seed), the mean per-audit ECE, AUC, resolution, forecast and realised
    means; then each recalibrated run minus the predictor's own, paired by seed, in pooled ECE, AUC, stage-2 flips
    over random anchors and held-out avg@8."""
    entries = {}
    for key in CALIBRATION_REPORTS:
        folder, metrics = ctx.report(key)
        if metrics is None:
            return _missing(ctx, key)
        entry = metrics["ablations"].get(ARM)
        if entry is None or "pooled_ece" not in entry:
            return (f"The report of `{key}` has no reliability diagrams of `{ARM}` (`predictor.truth.every: 0`, or "
                    "written before they were logged). " + _source(ctx, folder))
        entries[key] = (folder, entry)
    rows = []
    for key, what in CALIBRATION_REPORTS.items():
        entry = entries[key][1]
        for stage in ("root", "prefix"):
            seeds = _seeds(entry["pooled_ece_seeds"].get(stage))
            audit = entry.get("audit", {})
            rows.append([what, stage, _num(entry["pooled_ece"].get(stage)),
                         ", ".join(f"s{s} {_num(v)}" for s, v in sorted(seeds.items())),
                         _pm(audit.get(f"truth/{stage}_ece")), _pm(audit.get(f"truth/{stage}_auc")),
                         _pm(audit.get(f"truth/{stage}_resolution")), _pm(audit.get(f"truth/{stage}_forecast_mean")),
                         _pm(audit.get(f"truth/{stage}_realised_mean"))])
    own = entries["reliability"][1]
    note = ("`trace`'s forecasts on the unselected sample against Monte-Carlo truth, 80 steps, seeds 0-2, audited "
            "every 10 steps. Pooled ECE: the ECE of the reliability diagram pooled over the audits and seeds (per "
            "seed: over that seed's audits); per-audit ECE, AUC, resolution and the means: mean over the audits, "
            "then over seeds ± 95 % t half-width.")
    for key in list(CALIBRATION_REPORTS)[1:]:
        recal = entries[key][1]
        diffs = []
        for stage in ("root", "prefix"):
            diffs.append(f"pooled ECE, {PLURAL[stage]} "
                         + _interval(paired_difference(_seeds(recal["pooled_ece_seeds"].get(stage)),
                                                       _seeds(own["pooled_ece_seeds"].get(stage)))))
            diffs.append(f"AUC, {PLURAL[stage]} " + _interval(paired_difference(
                _seeds(recal.get("audit_seeds", {}).get(f"truth/{stage}_auc")),
                _seeds(own.get("audit_seeds", {}).get(f"truth/{stage}_auc")))))
        diffs.append("held-out avg@8 " + _interval(paired_difference(
            {int(s[1:]): v[AVGK] for s, v in recal.items() if s[1:].isdigit() and AVGK in v},
            {int(s[1:]): v[AVGK] for s, v in own.items() if s[1:].isdigit() and AVGK in v})))
        name = CALIBRATION_REPORTS[key].split(" (")[0]
        note += f" The {name} minus the predictor's own, paired by seed, mean [95 % t-interval]: " + "; ".join(diffs) + "."
        ratio = recal.get("flips_vs_random")
        if ratio:
            note += (f" Its stage-2 flips over `tree_random`'s at the same seed: {_num(ratio['mean'], 2)} "
                     f"[{_num(ratio['low'], 2)}, {_num(ratio['high'], 2)}].")
    sources = " ".join(_source(ctx, folder) for folder, _ in entries.values())
    return _table(["forecasts", "stage", "pooled ECE", "per seed", "per-audit ECE", "AUC", "resolution",
                   "forecast mean", "realised mean"], rows, ["---", "---", "---:", "---"] + ["---:"] * 5
                  ) + "\n\n" + note + " " + sources
