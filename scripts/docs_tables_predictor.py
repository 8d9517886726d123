"""Docs tables of the predictor's calibration, each against Monte-Carlo truth on the unselected sample:
- ``calibration_table``: ``trace``'s forecasts as the predictor gives them and as ``predictor.recalibrate`` maps them
  (the Platt map, then the isotonic one), from three run reports (index keys ``reliability``, ``recalibrated`` and
  ``isotonic``) with the same seeds and params but those switches;
- ``exploration_table``: ``trace`` without and with exploration groups (``allocation.explore_groups``), from two run
  reports of one CPU (index keys ``exploration-base``, beside ``tree_random``, and ``exploration``);
- ``stages_table``: which stage's choices cost the forecasts their calibration (``STAGE_ARMS``);
- ``power_table``: ``trace``'s predictors audited every 10 steps and again every 2 (``POWER_REPORTS``), against the
  bar.

The decisive score is the pooled ECE: the ECE of the reliability diagram pooled over the audited steps (and seeds),
``trace.predictor.reliability.diagram_ece``; the mean of per-audit ECEs stands beside it. The runs pair by
seed (same seeds, same warmup, same prompts a step), so each difference is a paired t-interval over seeds
(``trace.reporting.statistics.paired_difference``)."""

from __future__ import annotations

from scripts.docs_tables_common import Context, _missing, _num, _pm, _source, _table
from trace.reporting.statistics import mean_interval, paired_difference

__all__ = ["CALIBRATION_REPORTS", "EXPLORATION_PAIRS", "EXPLORATION_REPORTS", "POWER_REPORTS", "STAGE_ARMS",
           "calibration_table", "exploration_table", "power_table", "stages_table"]

ARM = "trace"
AVGK = "eval/accuracy/mean_at_8"
# index key -> what the allocator reads in that report
CALIBRATION_REPORTS = {"reliability": "the predictor's forecasts", "recalibrated": "Platt map (`predictor.recalibrate`)",
                       "isotonic": "isotonic map (`recalibrate_map: isotonic`)"}
# index key -> the run's exploration groups; the first is the reference, and holds tree_random
EXPLORATION_REPORTS = {"exploration-base": "none (`trace` as by default)",
                       "exploration": "2 a step (`allocation.explore_groups: 2`)",
                       "exploration-window4": "2 a step, window of 4 steps (`predictor.window_steps: 4`)",
                       "exploration-epochs3": "2 a step, 3 epochs a fit (`predictor.epochs: 3`)",
                       "exploration-recalibrated": "2 a step, the root map fitted on them "
                                                   "(`predictor.recalibrate_roots: explore`)",
                       "exploration-weighted": "2 a step, weighted for the candidates stage 1 passed over "
                                               "(`predictor.explore_weight: balanced`)",
                       "exploration-weight4": "2 a step, each root weighing 4 (`predictor.explore_weight: 4`)",
                       "labels-branch": "none, labelled at the branch point (`predictor.labels: branch_point`)",
                       "exploration-weighted1": "1 a step, weighted for the candidates stage 1 passed over "
                                                "(`allocation.explore_groups: 1`, `predictor.explore_weight: balanced`)",
                       "window4": "none, window of 4 steps (`predictor.window_steps: 4`)"}
# index key -> a second reference it is also paired with (what it adds to that run alone)
EXPLORATION_PAIRS = {"exploration-recalibrated": "exploration", "exploration-weighted": "exploration",
                     "exploration-weight4": "exploration-weighted", "exploration-weighted1": "exploration-weighted"}
# index key -> the arms of that report the stages table reads, with what their stage 1 and stage 2 do
STAGE_ARMS = {"exploration-base": {"tree_random": ("uniform", "random anchors"),
                                   "trace": ("by forecast", "by forecast")},
              "stages": {"trace_prefix": ("uniform", "by forecast"), "trace_root": ("by forecast", "none")},
              "exploration-weighted": {"trace": ("by forecast, 2 uniform groups weighted for the rest "
                                                 "(`predictor.explore_weight: balanced`)", "by forecast")},
              "exploration-weight4": {"trace": ("by forecast, 2 uniform groups weighing 4 "
                                                "(`predictor.explore_weight: 4`)", "by forecast")},
              "labels-branch": {"trace": ("by forecast, labelled at the branch point "
                                          "(`predictor.labels: branch_point`)", "by forecast")}}
# index key -> (its `trace` predictor, its audit); each predictor's run audited sparsely, then again densely
SPARSE, DENSE = "every 10 steps, 32 roots and 64 prefixes", "every 2 steps, 32 roots and 128 prefixes"
BRANCH_POINT = "labelled at the branch point (`predictor.labels: branch_point`)"
POWER_REPORTS = {"exploration-base": ("as by default", SPARSE), "audit-dense": ("as by default", DENSE),
                 "labels-branch": (BRANCH_POINT, SPARSE), "labels-dense": (BRANCH_POINT, DENSE)}
POWER_TWINS = {"audit-dense": "exploration-base",  # dense run -> the sparse run it audits again (the first: reference)
               "labels-dense": "labels-branch"}
ECE_BAR = 0.05  # the debiased ECE a calibrated predictor reads at most, per stage (docs/results.md)
SAME_TRAINING = ("audit/flips", "audit/mixed_groups", AVGK, "eval/accuracy/greedy")  # equal per seed: one training
STAGE_REFERENCE = ("exploration-base", "tree_random")  # (index key, arm) every other row is paired with
STAGE_RESAMPLES = 1000
PLURAL = {"root": "roots", "prefix": "prefixes"}


def _seeds(values: dict | None) -> dict[int, float]:
    return {int(k[1:]): float(v) for k, v in (values or {}).items() if v is not None}


def _interval(iv) -> str:
    mean = 0.0 if abs(iv.mean) < 5e-4 else iv.mean  # no "-0.000"
    if iv.n < 2:
        return f"{_num(mean, 3, True)} (one seed)"
    return f"{_num(mean, 3, True)} [{_num(iv.low, 3, True)}, {_num(iv.high, 3, True)}]"


def _audited_reports(ctx: Context, keys) -> dict[str, tuple[str, dict, dict]] | str:
    """``{index key: (folder, trace's report entry, metrics.json)}`` for each key, or the docs text that says which
    report is missing or has no reliability diagrams of ``trace``."""
    entries = {}
    for key in keys:
        folder, metrics = ctx.report(key)
        if metrics is None:
            return _missing(ctx, key)
        entry = metrics["ablations"].get(ARM)
        if entry is None or "pooled_ece" not in entry:
            return (f"The report of `{key}` has no reliability diagrams of `{ARM}` (`predictor.truth.every: 0`, or "
                    "written before they were logged). " + _source(ctx, folder))
        entries[key] = (folder, entry, metrics)
    return entries


def calibration_table(ctx: Context) -> str:
    """Per report and stage: pooled ECE (and per seed), the mean per-audit ECE, AUC, resolution, forecast and realised
    means; then each recalibrated run minus the predictor's own, paired by seed, in pooled ECE, AUC, stage-2 flips
    over random anchors and held-out avg@8."""
    loaded = _audited_reports(ctx, CALIBRATION_REPORTS)
    if isinstance(loaded, str):
        return loaded
    entries = {key: (folder, entry) for key, (folder, entry, _) in loaded.items()}
    rows = _calibration_rows({CALIBRATION_REPORTS[key]: entry for key, (_, entry) in entries.items()})
    own = entries["reliability"][1]
    note = ("`trace`'s forecasts on the unselected sample against Monte-Carlo truth, 80 steps, seeds 0-2, audited "
            "every 10 steps. Pooled ECE: the ECE of the reliability diagram pooled over the audits and seeds (per "
            "seed: over that seed's audits); per-audit ECE, AUC, resolution and the means: mean over the audits, "
            "then over seeds ± 95 % t half-width.")
    for key in list(CALIBRATION_REPORTS)[1:]:
        recal = entries[key][1]
        diffs = _paired_scores(recal, own)
        name = CALIBRATION_REPORTS[key].split(" (")[0]
        note += f" The {name} minus the predictor's own, paired by seed, mean [95 % t-interval]: " + "; ".join(diffs) + "."
        ratio = recal.get("flips_vs_random")
        if ratio:
            note += (f" Its stage-2 flips over `tree_random`'s at the same seed: {_num(ratio['mean'], 2)} "
                     f"[{_num(ratio['low'], 2)}, {_num(ratio['high'], 2)}].")
    sources = " ".join(_source(ctx, folder) for folder, _ in entries.values())
    return _table(["forecasts", "stage"] + SCORE_HEADER, rows, ["---", "---", "---:", "---"] + ["---:"] * 5
                  ) + "\n\n" + note + " " + sources


SCORE_HEADER = ["pooled ECE", "per seed", "per-audit ECE", "AUC", "resolution", "forecast mean", "realised mean"]


def _calibration_rows(entries: dict[str, dict], noise: bool = False) -> list[list[str]]:
    """One row per (label, stage): the scores of ``SCORE_HEADER`` from an arm's report entry (the pooled ECE with its
    bootstrap interval over the audits where the report has one); with ``noise``, after the pooled ECE the debiased
    ECE with its interval and the floor (``trace.predictor.reliability.calibration_noise``)."""
    rows = []
    for what, entry in entries.items():
        for stage in ("root", "prefix"):
            seeds = _seeds(entry["pooled_ece_seeds"].get(stage))
            audit = entry.get("audit", {})
            interval = (entry.get("pooled_ece_interval") or {}).get(stage) or {}
            pooled = _num(entry["pooled_ece"].get(stage)) + (
                f" [{_num(interval['low'])}, {_num(interval['high'])}]" if interval.get("low") is not None else "")
            debiased = (entry.get("debiased_ece_interval") or {}).get(stage) or {}
            cells = [f"{_num(entry['debiased_ece'][stage])} [{_num(debiased.get('low'))}, "
                     f"{_num(debiased.get('high'))}]", _num(entry["ece_floor"][stage])] if noise else []
            rows.append([what, stage, pooled, *cells,
                         ", ".join(f"s{s} {_num(v)}" for s, v in sorted(seeds.items())),
                         _pm(audit.get(f"truth/{stage}_ece")), _pm(audit.get(f"truth/{stage}_auc")),
                         _pm(audit.get(f"truth/{stage}_resolution")), _pm(audit.get(f"truth/{stage}_forecast_mean")),
                         _pm(audit.get(f"truth/{stage}_realised_mean"))])
    return rows


def _per_seed(entry: dict, key: str) -> dict[int, float]:
    """A per-seed value of an arm's report entry: a final result (``s<k>``) or an audit mean (``audit_seeds``)."""
    if key in entry.get("audit_seeds", {}):
        return _seeds(entry["audit_seeds"][key])
    return {int(s[1:]): float(v[key]) for s, v in entry.items() if s[1:].isdigit() and key in v}


def _paired_scores(mine: dict, reference: dict) -> list[str]:
    """``mine`` minus ``reference`` paired by seed: pooled ECE and AUC per stage, held-out avg@8."""
    diffs = []
    for stage in ("root", "prefix"):
        diffs.append(f"pooled ECE, {PLURAL[stage]} " + _interval(paired_difference(
            _seeds(mine["pooled_ece_seeds"].get(stage)), _seeds(reference["pooled_ece_seeds"].get(stage)))))
        diffs.append(f"AUC, {PLURAL[stage]} " + _interval(paired_difference(
            _per_seed(mine, f"truth/{stage}_auc"), _per_seed(reference, f"truth/{stage}_auc"))))
    diffs.append("held-out avg@8 " + _interval(paired_difference(_per_seed(mine, AVGK), _per_seed(reference, AVGK))))
    return diffs


def _ratio(numerator: dict[int, float], denominator: dict[int, float]) -> str:
    """The per-seed ratio's mean and 95 % t-interval over the seeds both hold."""
    seeds = sorted(s for s in numerator if denominator.get(s, 0) > 0)
    iv = mean_interval([numerator[s] / denominator[s] for s in seeds])
    return f"{_num(iv.mean, 2)} [{_num(iv.low, 2)}, {_num(iv.high, 2)}]" if len(seeds) > 1 else _num(iv.mean, 2)


def exploration_table(ctx: Context) -> str:
    """Per run and stage, ``trace``'s scores of ``SCORE_HEADER`` without exploration groups and with them (and the
    predictor's fit varied); then each later run minus the first, paired by seed (pooled ECE, AUC, avg@8, realised
    mixed groups and flips a step), each run's stage-2 flips over ``tree_random``'s of the first run
    (``tree_random`` does not explore, so one run of it serves all), and its integrated forecasts over what was
    realised."""
    entries = _audited_reports(ctx, EXPLORATION_REPORTS)
    if isinstance(entries, str):
        return entries
    reference_key = next(iter(EXPLORATION_REPORTS))
    reference_folder, reference, reference_metrics = entries[reference_key]
    random_anchors = reference_metrics["ablations"].get("tree_random")
    if random_anchors is None:
        return f"The report of `{reference_key}` has no `tree_random`. " + _source(ctx, reference_folder)
    stale = [key for key, (_, entry, _) in entries.items() if "debiased_ece" not in entry]
    if stale:
        return (f"The reports of {', '.join(f'`{k}`' for k in stale)} have no debiased ECE (written before it): "
                "write them again with `python -m flows.report` in their runs' checkouts.")
    rows = _calibration_rows({EXPLORATION_REPORTS[key]: entry for key, (_, entry, _) in entries.items()}, noise=True)
    seeds = "; ".join(f"{_label(key)} {_seed_range(entry)}" for key, (_, entry, _) in entries.items())
    note = ("`trace`'s forecasts on the unselected sample against Monte-Carlo truth, 80 steps, audited every 10 "
            f"steps, all on one CPU, at seeds {seeds}; columns as in the table above, the pooled ECE with its 95 % "
            "percentile bootstrap interval that resamples the seeds, then each drawn seed's audits (docs/method.md, "
            "\"Ground-truth audit\"). Debiased ECE: the pooled ECE less the noise of each bin's gap over the seeds, "
            "with its interval from the same bootstrap; floor: the pooled ECE that a predictor calibrated in every bin "
            "reads with that noise (`calibration_noise`). Paired differences are over the seeds both runs have.")
    for key, (_, entry, _) in list(entries.items())[1:]:
        diffs = _paired_scores(entry, reference)
        for what, name in (("realised mixed groups a step", "audit/mixed_groups"),
                           ("stage-2 flips a step", "audit/flips")):
            diffs.append(f"{what} " + _interval(paired_difference(_per_seed(entry, name), _per_seed(reference, name))))
        note += (f" {_label(key)} minus {_label(reference_key)}, paired by seed, mean [95 % t-interval]: "
                 + "; ".join(diffs) + ".")
        if key in EXPLORATION_PAIRS:
            base_key = EXPLORATION_PAIRS[key]
            note += (f" {_label(key)} minus {_label(base_key)}, paired by seed: "
                     + "; ".join(_paired_scores(entry, entries[base_key][1])) + ".")
    flips_random = _per_seed(random_anchors, "audit/flips")
    parts = []
    for key, (_, entry, _) in entries.items():
        integrated = ", ".join(f"{name.replace('_', ' ')} " + _ratio(_per_seed(entry, f"audit/integrated_{name}"),
                                                                     _per_seed(entry, f"audit/{name}"))
                               for name in ("mixed_groups", "flips"))
        flips = _ratio(_per_seed(entry, "audit/flips"), flips_random)
        parts.append(f"{_label(key)}: stage-2 flips over `tree_random`'s {flips}; integrated forecast over realised, "
                     + integrated)
    note += " Per seed, mean [95 % t-interval]: " + "; ".join(parts) + "."
    sources = " ".join(_source(ctx, folder) for folder, _, _ in entries.values())
    header = ["exploration groups", "stage", SCORE_HEADER[0], "debiased ECE", "floor"] + SCORE_HEADER[1:]
    return (_table(header, rows, ["---", "---", "---:", "---:", "---:", "---"] + ["---:"] * 5) + "\n\n" + note + " "
            + sources)


def _seed_range(entry: dict) -> str:
    """``0-5`` (or ``0, 2``) for the seeds of an arm's report entry."""
    seeds = sorted(_seeds(entry["pooled_ece_seeds"].get("root")))
    contiguous = len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1))
    return f"{seeds[0]}-{seeds[-1]}" if contiguous else ", ".join(map(str, seeds))


def _label(key: str) -> str:
    """A run's row label without its parenthesis."""
    return EXPLORATION_REPORTS[key].split(" (")[0]


def stages_table(ctx: Context) -> str:
    """Which stage's choices cost the forecasts their calibration: per arm of ``STAGE_ARMS`` (stage 1 and stage 2
    by forecast or not), over the seeds every report holds, the debiased ECE of roots and prefixes with its
    bootstrap interval and floor (``trace.predictor.reliability.calibration_noise``), and its difference from
    ``tree_random``'s paired by seed (``debiased_ece_difference``: the seeds drawn once for both)."""
    from trace.predictor.reliability import calibration_noise, debiased_ece_difference, pool_diagrams, \
        pooled_ece_interval

    audits, folders = {}, []
    for key, arms in STAGE_ARMS.items():
        folder, metrics = ctx.report(key)
        if metrics is None:
            return _missing(ctx, key)
        folders.append(folder)
        for arm in arms:
            entry = metrics["ablations"].get(arm) or {}
            if "audit_diagrams" not in entry:
                return (f"The report of `{key}` has no per-audit diagrams of `{arm}` (written before they were kept): "
                        "write it again with `python -m flows.report` in its runs' checkout. " + _source(ctx, folder))
            audits[key, arm] = _audit_diagrams(entry)
    seeds = sorted(set.intersection(*(set(a["root"]) for a in audits.values())))
    reference = STAGE_REFERENCE[1]
    rows = []
    for key, arms in STAGE_ARMS.items():
        for arm, (stage1, stage2) in arms.items():
            cells = [f"`{arm}`", stage1, stage2]
            for stage in ("root", "prefix"):
                runs = [audits[key, arm][stage][s] for s in seeds]
                noise = calibration_noise([pool_diagrams(r) for r in runs])
                low, high = pooled_ece_interval(runs, resamples=STAGE_RESAMPLES, debiased=True)
                cells.append(f"{_num(noise['debiased'])} [{_num(low)}, {_num(high)}] ({_num(noise['floor'])})")
                if (key, arm) == STAGE_REFERENCE:
                    cells.append("reference")
                    continue
                diff = debiased_ece_difference({s: audits[key, arm][stage][s] for s in seeds},
                                               {s: audits[STAGE_REFERENCE][stage][s] for s in seeds},
                                               resamples=STAGE_RESAMPLES)
                cells.append(f"{_num(diff['difference'], 3, True)} [{_num(diff['low'], 3, True)}, "
                             f"{_num(diff['high'], 3, True)}]")
            rows.append(cells)
    note = (f"Each arm's forecasts on the unselected sample against Monte-Carlo truth, 80 steps, audited every 10 "
            f"steps, seeds {seeds[0]}-{seeds[-1]} (those both reports hold), one CPU: the debiased ECE [95 % bootstrap "
            "interval, "
            "seeds then audits resampled] (floor: what a predictor calibrated in every bin reads on the same audits), "
            f"and its difference from `{reference}`'s, paired by seed: the seeds drawn once for both arms, each "
            f"arm's audits within them ({STAGE_RESAMPLES:,} resamples; no correction over the {2 * (len(rows) - 1)} "
            "differences). "
            "Stage 1: how the roots are chosen; stage 2: how the continuations' anchors are. ")
    header = ["arm", "stage 1", "stage 2", "roots: debiased ECE (floor)", f"minus `{reference}`",
              "prefixes: debiased ECE (floor)", f"minus `{reference}`"]
    return (_table(header, rows, ["---", "---", "---", "---:", "---:", "---:", "---:"]) + "\n\n" + note
            + " ".join(_source(ctx, f) for f in folders))


def _bar_verdict(point: float, low: float, high: float) -> str:
    """Where a debiased ECE and its interval stand against ``ECE_BAR``."""
    if high <= ECE_BAR:
        return f"below {ECE_BAR:g}: met"
    if low > ECE_BAR:
        return f"above {ECE_BAR:g}: missed"
    where = "at or below" if point <= ECE_BAR else "above"
    return f"{where} {ECE_BAR:g} at the point; above {_num(high)} excluded"


def power_table(ctx: Context) -> str:
    """``trace``'s predictors against the calibration bar, each audited sparsely and again densely
    (``POWER_REPORTS``): per report and stage, the audits a seed, the outcomes pooled, the debiased ECE with its
    bootstrap interval and floor, AUC and resolution, and where the ECE stands against ``ECE_BAR``. The note says
    whether each dense run trained as the sparse run it audits again (``POWER_TWINS``, ``SAME_TRAINING``: the
    audit's rollouts never train, so it must), and gives each later dense run minus the first, paired by seed
    (``debiased_ece_difference``)."""
    from trace.predictor.reliability import debiased_ece_difference

    entries = _audited_reports(ctx, POWER_REPORTS)
    if isinstance(entries, str):
        return entries
    rows = []
    for key, (_, entry, _) in entries.items():
        for stage in ("root", "prefix"):
            counts = {len(a) for a in entry["audit_diagrams"][stage].values()}
            outcomes = sum(r["count"] for r in entry["reliability"][stage])
            point, iv = entry["debiased_ece"][stage], entry["debiased_ece_interval"][stage]
            audit = entry["audit"]
            rows.append([*POWER_REPORTS[key], stage, "-".join(map(str, sorted(counts))), _num(outcomes, 0),
                         f"{_num(point)} [{_num(iv['low'])}, {_num(iv['high'])}]", _num(entry["ece_floor"][stage]),
                         _pm(audit.get(f"truth/{stage}_auc")), _pm(audit.get(f"truth/{stage}_resolution")),
                         _bar_verdict(point, iv["low"], iv["high"])])
    twins, alike = [], True
    for dense_key, sparse_key in POWER_TWINS.items():
        dense, sparse = entries[dense_key][1], entries[sparse_key][1]
        seeds = sorted(set(_per_seed(sparse, AVGK)) & set(_per_seed(dense, AVGK)))
        differ = [name for name in SAME_TRAINING
                  if any(_per_seed(sparse, name).get(s) != _per_seed(dense, name).get(s) for s in seeds)]
        alike = alike and not differ
        twins.append(f"`{dense_key}` and `{sparse_key}` " + (
            "trained alike (" + ", ".join(f"`{n}`" for n in SAME_TRAINING) + " equal at every seed)" if not differ
            else "trained differently (" + ", ".join(f"`{n}`" for n in differ) + " differ)"))
    diagrams = {key: _audit_diagrams(entries[key][1]) for key in POWER_TWINS}
    first, *later = POWER_TWINS
    paired = []
    for key in later:
        for stage in PLURAL:
            diff = debiased_ece_difference(diagrams[key][stage], diagrams[first][stage])
            paired.append(f"{PLURAL[stage]} {_num(diff['difference'], 3, True)} [{_num(diff['low'], 3, True)}, "
                          f"{_num(diff['high'], 3, True)}]")
        paired[-2] = f"`{key}` minus `{first}`, paired by seed: " + paired[-2]
    costs: dict[str, list[float]] = {}  # audit -> each of its reports' mean rollouts an audited step
    for key, (_, entry, _) in entries.items():
        per_seed = _per_seed(entry, "truth/rollouts")
        costs.setdefault(POWER_REPORTS[key][1], []).append(mean_interval(list(per_seed.values())).mean)
    note = (f"`trace`, 80 steps, seeds {_seed_range(entries[first][1])}, one CPU, its forecasts on the unselected "
            "sample against Monte-Carlo truth (16 continuations an item): the debiased ECE [95 % bootstrap interval, "
            "seeds then audits resampled] (floor: what a predictor calibrated in every bin reads on the same audits), "
            "AUC and resolution as mean over the audits, then over seeds ± 95 % t half-width. Each dense run against "
            "the sparse one it audits again: " + "; ".join(twins)
            + (": the audit's rollouts change nothing the arm trains on, so each pair of rows scores one predictor "
               "at every seed." if alike else ": a pair that trained differently does not score one predictor, and "
               "its audits cannot be compared as one run's.")
            + (" Debiased ECE, " + "; ".join(paired) + " (2,000 resamples, the seeds drawn once for both)."
               if paired else "")
            + " Audit rollouts an audited step, outside the budget: "
            + "; ".join(f"{what}: {_num(mean_interval(n).mean, 0)}" for what, n in costs.items())
            + " (mean over its runs). ")
    return (_table(["predictor", "audit", "stage", "audits a seed", "outcomes", "debiased ECE", "floor", "AUC",
                    "resolution", f"against {ECE_BAR:g}"], rows,
                   ["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---"])
            + "\n\n" + note + " ".join(_source(ctx, folder) for folder, _, _ in entries.values()))


def _audit_diagrams(entry: dict) -> dict[str, dict[int, list]]:
    """An arm's report entry's per-audit diagrams, ``{stage: {seed: [rows of each audit]}}`` (``audit_diagrams``),
    the rows expanded from their compact form (``trace.predictor.reliability.expand_rows``)."""
    from trace.predictor.reliability import expand_rows

    return {stage: {int(s[1:]): [expand_rows(rows) for rows in runs] for s, runs in by_seed.items()}
            for stage, by_seed in entry["audit_diagrams"].items()}
