"""Docs tables of the ablation pipeline's run reports (``reports/runs/<folder>/metrics.json`` of the report stage):
the arms, their differences against ``grpo``, the warmup they start from, gains over it (greedy and avg@k), tokens
to a target accuracy and the allocation audit.

The verdicts are the report's rule (``trace.reporting.verdicts``, docs/method.md "Statistics over seeds"), applied
again to the intervals the file stores: every difference shows its intervals and which one decided, and its
verdict after Holm's correction within its declared family; the arms are grouped against ``grpo``, not ranked."""

from __future__ import annotations

import re
from typing import Sequence

from scripts.docs_tables_common import ABLATION_REPORTS, Context, _finite, _missing, _num, _pm, _source, _table
from trace.reporting.statistics import interval_from_dict
from trace.reporting.verdicts import DEFAULT_MARGIN, judge

__all__ = ["ABLATION_REPORTS", "LEARNING_BAR", "accounting_table", "arms_table", "audit_table", "gain_avgk_table", "gain_table",
           "overview_table", "primary_table", "regime_table", "tokens_to_target_table", "truth_table", "vs_grpo_table"]
# The learning bar of the accuracy run: grpo's held-out gain over its warmup (docs/results.md)
LEARNING_BAR = 0.10


def _pass_k(ablations: dict) -> int | None:
    for entry in ablations.values():
        for key, value in entry.items():
            if key.startswith("s") and isinstance(value, dict):
                for metric in value:
                    if m := re.fullmatch(r"eval/accuracy/pass_at_(\d+)", metric):
                        return int(m.group(1))
    return None


def _judged(ablations: dict, margin: float = DEFAULT_MARGIN) -> dict:
    """``trace.reporting.verdicts.judge`` of the differences a ``metrics.json`` stores."""
    arms = {arm: {versus: {c: iv for c, d in entry.get(versus, {}).items() if (iv := interval_from_dict(d))}
                  for versus in ("vs_grpo", "vs_trace", "vs_warmup")} for arm, entry in ablations.items()}
    return judge(arms, margin)


def _ranked(ablations: dict) -> list[str]:
    """Arms grouped against ``grpo`` on held-out avg@k after Holm's correction (greedy where a report has no
    avg@k): above, as, below; ``grpo`` first in its group, then by name (no order within a group)."""
    groups = _judged(ablations)["groups"]
    side = {"above": 0, "as": 1, "below": 2}
    return sorted(ablations, key=lambda a: (side[groups[a].split()[0]], a != "grpo", a))


def _diff(iv: dict | None, verdict=None, digits: int = 3) -> str:
    """A paired difference: ``+m b [low, high] t [low, high]* words``: the bootstrap interval (where there is one),
    the t-interval over seeds, the one that decided marked *, and the verdict after correction; one seed:
    ``+m (one seed)``."""
    if not iv or not _finite(iv.get("mean")):
        return "n/a"
    if not (iv.get("n", 1) > 1 and _finite(iv.get("low")) and _finite(iv.get("high"))):
        return f"{_num(iv['mean'], digits, True)} (one seed)"
    boot = iv.get("estimator") == "bootstrap"
    t = iv.get("seed_interval") if boot else iv
    by = verdict.decided_by if verdict is not None else None
    parts = []
    if boot:
        parts.append(f"b [{_num(iv['low'], digits, True)}, {_num(iv['high'], digits, True)}]" + ("*" if by == "bootstrap" else ""))
    if t and _finite(t.get("low")):
        parts.append(f"t [{_num(t['low'], digits, True)}, {_num(t['high'], digits, True)}]" + ("*" if by != "bootstrap" else ""))
    words = verdict.words if verdict is not None else ("real" if iv.get("real") else "within noise")
    return f"{_num(iv['mean'], digits, True)} " + " ".join(parts) + f" {words}"


def _group_column(ablations: dict) -> str:
    return "held-out avg@k" if _judged(ablations)["group_column"] == "eval mean@k" else "held-out greedy"


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
        cols += [("active prompts", "active prompts", 3), ("train reward", "train reward", 3),
                 ("trajectories/step", "trajectories/step", 0)]
    cols += [("generated tokens", "generated tokens", 0), ("s/step", "s/step", 2)]
    groups = _judged(abl)["groups"]
    rows = [[groups[arm].replace("grpo", "`grpo`"), f"`{arm}`"] + [_pm(abl[arm]["mean"].get(c), d) for c, _, d in cols]
            for arm in _ranked(abl)]
    seeds = sorted({s for entry in abl.values() for s in _seeds(entry)}, key=lambda s: int(s[1:]))
    note = (f"Mean over seeds {', '.join(s[1:] for s in seeds)} ± the half-width of the 95 % t-interval; training "
            f"columns are means over steps, generated tokens the run's total. Group: {_group_column(abl)} minus "
            f"`grpo` after Holm's correction (above, as or below `grpo`; no order within a group, so no rank over "
            f"differences within noise). {_source(ctx, folder)}")
    return _table(["group", "arm"] + [label for _, label, _ in cols], rows,
                  ["---", "---"] + ["---:"] * len(cols)) + "\n\n" + note


def vs_grpo_table(ctx: Context, key: str, full: bool, ref: str = "grpo", arms: Sequence[str] | None = None) -> str:
    """Each arm minus ``ref`` (``grpo`` or ``trace``) at the same seed: mean, 95 % interval, real or within noise.

    ``arms`` limits the rows to those arms (in the report's rank order); None keeps every arm.
    """
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    versus = f"vs_{ref}"
    cols = [("effective ratio", "effective ratio", 3)]
    if full:
        cols += [("effective token ratio", "effective token ratio", 3)]
    cols += [("generated tokens", "generated tokens", 0), ("eval greedy", "held-out greedy", 3)]
    if full:
        cols += [("eval mean@k", f"held-out mean@{_pass_k(abl)}", 3)]
    verdicts = _judged(abl)["verdicts"]
    rows = [[f"`{arm}`"] + [_diff(abl[arm][versus].get(c), verdicts.get((arm, versus, c)), d) for c, _, d in cols]
            for arm in _ranked(abl) if versus in abl[arm] and (arms is None or arm in arms)]
    note = f"Arm minus `{ref}` at the same seed ({_verdict_rule(ctx)}). {_source(ctx, folder)}"
    return _table([f"arm minus `{ref}`"] + [label for _, label, _ in cols], rows) + "\n\n" + note


RULE = ("95 % intervals: t over seeds (t), and where the report has per-question results a paired bootstrap over "
        "questions and seeds (b); *real* only when every interval excludes 0, its p-value the larger of theirs (* marks "
        "the interval that decided); verdicts after Holm's correction within the declared family")


def _verdict_rule(ctx: Context) -> str:
    """The rule every verdict of the tables follows (docs/method.md, "Statistics over seeds")."""
    return (f"{RULE}: *real after correction*, *real before correction only* or *within noise*; "
            f"[the rule and the families]({ctx.link('docs/method.md')}#statistics-over-seeds)")


def overview_table(ctx: Context, key: str) -> str:
    """Per arm, in the report's rank order: held-out avg@k, effective ratio and generated tokens, each with its
    difference against ``grpo`` at the same seed and the verdict (the mean difference, *real* or *within
    noise*; the intervals are in the ``-vs-grpo-full`` table)."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    cols = [("eval mean@k", f"held-out avg@{_pass_k(abl)}", 3), ("eval greedy", "held-out greedy", 3),
            ("effective ratio", "effective ratio", 3), ("generated tokens", "generated tokens", 0)]

    verdicts = _judged(abl)["verdicts"]

    def verdict(arm: str, c: str, digits: int) -> str:
        iv = abl[arm].get("vs_grpo", {}).get(c)
        if not iv or not _finite(iv.get("mean")):
            return ""
        v = verdicts.get((arm, "vs_grpo", c))
        by = "" if v is None or v.words == "no interval" else (" (b)" if v.decided_by == "bootstrap" else " (t)")
        word = (v.words + by) if v is not None and iv.get("n", 1) > 1 else "one seed"
        return f"{_num(iv['mean'], digits, True)} {word}"

    rows = []
    for arm in _ranked(abl):
        row = [f"`{arm}`"]
        for c, _, d in cols:
            row += [_pm(abl[arm]["mean"].get(c), d), verdict(arm, c, d)]
        rows.append(row)
    note = (f"{len(abl)} arms, grouped against `grpo` on {_group_column(abl)} after correction (no rank); mean over seeds "
            f"{', '.join(s[1:] for s in sorted({s for e in abl.values() for s in _seeds(e)}, key=lambda s: int(s[1:])))}"
            f" ± the 95 % t half-width, generated tokens the run's total. \"minus `grpo`\": the arm minus `grpo` at the "
            f"same seed, (t) or (b) the interval that decided ({_verdict_rule(ctx)}; the intervals: the `-vs-grpo-full` "
            f"table). {_source(ctx, folder)}")
    header = ["arm"]
    for _, label, _ in cols:
        header += [label, "minus `grpo`"]
    return _table(header, rows, ["---"] + ["---:"] * (len(header) - 1)) + "\n\n" + note


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
    """Per arm, held-out greedy accuracy after RL minus the warmup's (the learning bar is asked of avg@k only:
    ``gain_avgk_table``).

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
    bar = (" The learning bar is asked of avg@k, in the `-gain-avgk` table, not here." if _pass_k(abl) else "")
    note = (f"Held-out greedy accuracy after RL: mean over seeds ± the 95 % t half-width; minus the warmup's "
            f"{_num(warmup)}: the same interval shifted, which leaves out the warmup evaluation's own error (the "
            f"report's `summary.md` gives `grpo`'s gain with a paired bootstrap over questions that includes it)."
            f"{bar} " + _source(ctx, folder))
    return _table(["arm", "held-out greedy", "minus warmup [95 % t over seeds]", "lower end above warmup"],
                  rows) + "\n\n" + note


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
    verdicts = _judged(abl)["verdicts"]
    rows = []
    for arm in _ranked(abl):
        cols, gains = abl[arm]["mean"], abl[arm].get("vs_warmup", {})
        rows.append([f"`{arm}`", _pm(cols.get("eval mean@k")),
                     _diff(gains.get("eval mean@k"), verdicts.get((arm, "vs_warmup", "eval mean@k"))),
                     _pm(cols.get("eval greedy")),
                     _diff(gains.get("eval greedy"), verdicts.get((arm, "vs_warmup", "eval greedy")))])
    w = metrics["warmup"]
    base_k = w.get(f"accuracy/mean@{k}", w.get(f"accuracy/mean_at_{k}"))
    g = abl.get("grpo", {}).get("vs_warmup", {}).get("eval mean@k") or {}
    v = verdicts.get(("grpo", "vs_warmup", "eval mean@k"))
    met = _finite(g.get("mean")) and g["mean"] >= LEARNING_BAR and v is not None and v.real_corrected
    gg = abl.get("grpo", {}).get("vs_warmup", {}).get("eval greedy") or {}
    vg = verdicts.get(("grpo", "vs_warmup", "eval greedy"))
    note = (f"After RL: mean over seeds ± the 95 % t half-width. Gain: the arm minus the warmup policy (avg@{k} "
            f"{_num(base_k)}, greedy {_num(w.get('accuracy/greedy'))}), mean with the 95 % interval of a paired "
            f"bootstrap over the held-out questions and seeds (b, the evaluations' own noise included) and the "
            f"t-interval over seeds (t); {RULE} (the gains over warmup are one family). avg@{k}: the mean reward of "
            f"{k} sampled rollouts per question (DeepScaleR's avg@k, verl's mean@k); greedy: one rollout at "
            f"temperature 0 (Search-R1's exact match). The learning bar, asked of avg@{k} only (`grpo`'s avg@{k} gain "
            f">= {LEARNING_BAR:.2f}, real after correction), is **{'met' if met else 'not met'}**; beside it, "
            f"`grpo`'s greedy gain is {_num(gg.get('mean'), 3, True)} ({vg.words if vg else 'n/a'}). "
            + _source(ctx, folder))
    return _table(["arm", f"held-out avg@{k}", f"avg@{k} minus warmup", "held-out greedy", "greedy minus warmup"],
                  rows) + "\n\n" + note


def tokens_to_target_table(ctx: Context, key: str, sampled: bool = False) -> str:
    """Per arm, the generated tokens to a target in-training held-out accuracy (greedy, or avg@k with
    ``sampled``): the report's ``tokens_to_target`` (the warmup plus half of ``grpo``'s gain, censored seeds kept),
    its refusal, or, for a report written before it, why its stored numbers are not shown."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    new_key = "tokens_to_target_sampled" if sampled else "tokens_to_target"
    what = "avg@k" if sampled else "greedy accuracy"
    entries = {arm: e[new_key] for arm, e in abl.items() if isinstance(e.get(new_key), dict)}
    if entries:
        first = next(iter(entries.values()))
        if first.get("refused"):
            return f"Tokens to a target {what}: refused by the report, {first['refused']}. " + _source(ctx, folder)
        rows = []
        for arm in _ranked(abl):
            e = entries.get(arm) or {}
            reached, censored = e.get("reached", {}), e.get("censored", {})
            per_seed = sorted([f"{s}: {_num(v, 0)}" for s, v in reached.items()] +
                              [f"{s}: > {_num(v, 0)} (censored)" for s, v in censored.items()])
            median = _num(e.get("median"), 0) if _finite(e.get("median")) else "not reached by half the seeds"
            rows.append([f"`{arm}`", median, f"{len(reached)}/{len(reached) + len(censored)}", ", ".join(per_seed)])
        note = (f"Generated tokens until the in-training held-out {what} first reaches {_num(first.get('target'))} "
                "(the warmup's plus half of `grpo`'s mean gain, or `report.target_accuracy`): per seed the first "
                "crossing, linearly interpolated; a seed that never reaches it is censored at its last tokens (kept, "
                "counted above every crossing); the median over all seeds. " + _source(ctx, folder))
        return _table(["arm", f"median tokens to {_num(first.get('target'))}", "seeds reaching", "per seed"],
                      rows) + "\n\n" + note
    last = "arm/last_avgk" if sampled else "arm/last_eval_acc"
    # runs trained before the name arm/last_avgk logged the same value as arm/last_eval_avgk
    finals = [abl["grpo"][s].get(last, abl["grpo"][s].get("arm/last_eval_avgk")) for s in _seeds(abl["grpo"])] \
        if "grpo" in abl else []
    finals = [f for f in finals if _finite(f)]
    w = metrics.get("warmup", {})
    k = _pass_k(abl)
    start = w.get(f"accuracy/mean@{k}", w.get(f"accuracy/mean_at_{k}")) if sampled else w.get("accuracy/greedy")
    if finals and _finite(start) and sum(finals) / len(finals) <= start:
        return (f"Tokens to a target {what}: refused. The target this report used, `grpo`'s final in-training {what} "
                f"{_num(sum(finals) / len(finals))}, is at or below the warmup's {_num(start)}, so its numbers measure "
                "the first evaluation interval, not learning. " + _source(ctx, folder))
    return (f"Tokens to a target {what}: not recorded. This report stores the crossings of `grpo`'s own final "
            f"in-training {what}, which `grpo` reaches at about half its seeds by construction, averaged over the "
            "seeds that reach it (seeds that never do dropped); the report stage now writes the crossings of the "
            "warmup's accuracy plus half of `grpo`'s gain with censored seeds kept, which needs the curves this file "
            "does not hold. " + _source(ctx, folder))


def primary_table(ctx: Context, key: str) -> str:
    """The primary comparison: each arm's held-out avg@k minus ``grpo`` with its intervals, its verdict after
    Holm's correction, its margin verdict and its power (``trace.reporting.verdicts.judge``)."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    design = metrics.get("design") or {}
    margin = float(design.get("margin", DEFAULT_MARGIN))
    judged = _judged(abl, margin)
    num_questions = design.get("num_questions")
    rows = []
    for arm in _ranked(abl):
        iv = abl[arm].get("vs_grpo", {}).get("eval mean@k")
        if not iv or not _finite(iv.get("mean")):
            continue
        words, low, high = judged["margins"].get(arm, ("undecided", None, None))
        pw = judged["power"].get(arm)
        if pw is None:
            cells = ["n/a"] * 4
        else:
            seeds = str(pw.seeds_needed) if pw.seeds_needed is not None else "> 1,000"
            if not _finite(pw.questions_factor):
                questions = "not recorded"
            elif num_questions:
                questions = f"{-(-pw.questions_factor * num_questions // 1):,.0f}"
            else:
                questions = f"{pw.questions_factor:.1f} x the held-out set"
            cells = [_num(pw.mdd_seeds), _num(pw.mdd_bootstrap), seeds, questions]
        rows.append([f"`{arm}`", _diff(iv, judged["verdicts"].get((arm, "vs_grpo", "eval mean@k"))),
                     f"{words} [{_num(low, 3, True)}, {_num(high, 3, True)}]", *cells])
    if not rows:
        return "This report has no held-out avg@k: no primary comparison. " + _source(ctx, folder)
    k = _pass_k(abl)
    m = len(judged["margins"])
    note = (f"The primary family: held-out avg@{k}, each arm minus `grpo` ({RULE}). Against delta = {margin:g}: the "
            f"verdict on the hull of both intervals at the family-wise level 1 - 0.05/{m} (*better by >= delta*, "
            "*worse*, *equivalent within ±delta* by two one-sided tests, *not worse (non-inferior)*, *not better by "
            "delta (non-superior)*, *undecided*). Power: the minimum detectable difference (MDD) at 80 % power, "
            "two-sided 5 %, of the t-test over seeds and of the bootstrap (both must reject); the seeds that bring "
            "the seed component's MDD to delta, and the questions that bring the question component's (the "
            "bootstrap's variance beyond the seed interval's) to delta. " + _source(ctx, folder))
    return _table(["arm", f"avg@{k} minus `grpo`", f"against delta = {margin:g}", "MDD seeds", "MDD bootstrap",
                   "seeds for delta", "questions for delta"], rows) + "\n\n" + note


def audit_table(ctx: Context, key: str) -> str:
    """Per arm, the allocation audit: forecast against realised mixed groups and flips per step."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    keys = [("audit/expected_mixed_groups", "expected mixed groups"), ("audit/mixed_groups", "mixed groups"),
            ("audit/expected_flips", "expected flips"), ("audit/flips", "flips")]
    integrated = any("audit/integrated_flips" in abl[arm].get("audit", {}) for arm in abl)
    if integrated:  # reports from before the integrated forecasts have none
        keys[1:1] = [("audit/integrated_mixed_groups", "integrated")]
        keys[4:4] = [("audit/integrated_flips", "integrated")]
    rows = [[f"`{arm}`"] + [_pm(abl[arm].get("audit", {}).get(k), 2) for k, _ in keys] for arm in _ranked(abl)]
    note = ("Per step, mean over steps then over seeds ± 95 % t half-width; n/a: the arm reads no forecast. "
            + ("*Integrated*: the same forecast over the truth's spread around the prediction, fitted on the "
               "previous steps (docs/method.md, \"Forecasts integrated over the truth's spread\"). "
               if integrated else "") + _source(ctx, folder))
    return _table(["arm"] + [label for _, label in keys], rows) + "\n\n" + note


TRUTH_SCORES = ("ece", "brier", "reliability", "resolution", "auc", "forecast_mean", "realised_mean")


def truth_table(ctx: Context, key: str) -> str:
    """Per arm and stage, what the allocator reads against Monte-Carlo truth on the unselected sample
    (``predictor.truth``): ECE, Brier and its parts, AUC, forecast and realised means; then the audit's and the
    oracle's rollouts."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    rows, costs = [], []
    for arm in _ranked(abl):
        audit = abl[arm].get("audit", {})
        for stage in ("root", "prefix"):
            if any(f"truth/{stage}_{n}" in audit for n in TRUTH_SCORES):
                rows.append([f"`{arm}`", stage] + [_pm(audit.get(f"truth/{stage}_{n}"), 3) for n in TRUTH_SCORES])
        if "oracle/rollouts" in audit:
            costs.append(f"`{arm}`'s estimates {_num(interval_from_dict(audit['oracle/rollouts']).mean, 0)} rollouts "
                         "a step")
    if not rows:
        return "This report has no ground-truth audit (`predictor.truth.every: 0`). " + _source(ctx, folder)
    audited = next((interval_from_dict(abl[a]["audit"]["truth/rollouts"]).mean for a in abl
                    if "truth/rollouts" in abl[a].get("audit", {})), float("nan"))
    note = ("Each arm's forecasts (`trace_oracle`: its Monte-Carlo estimates) on an unselected sample of the step's "
            "candidate prompts (root) and visited prefixes (prefix), against the mean reward of fresh continuations, "
            "before the predictor's refit; mean over the audited steps, then over seeds ± 95 % t half-width. Brier = "
            "reliability - resolution + uncertainty (+ a within-bin residual). Rollouts outside the budget, never "
            f"trained on: the audit {_num(audited, 0)} per audited step"
            + ("; " + "; ".join(costs) if costs else "") + ". " + _source(ctx, folder))
    ratios = [f"`{arm}` {_num(iv.mean, 2)} [{_num(iv.low, 2)}, {_num(iv.high, 2)}]" for arm in _ranked(abl)
              if (iv := interval_from_dict(abl[arm].get("flips_vs_random"))) is not None]
    if ratios:
        note += (" Stage 2's flips per step over `tree_random`'s at the same seed (the same continuations a step), "
                 "mean over seeds [95 % t-interval]: " + "; ".join(ratios) + ".")
    return _table(["arm", "stage", "ECE", "Brier", "reliability", "resolution", "AUC", "forecast mean",
                   "realised mean"], rows) + "\n\n" + note


def accounting_table(ctx: Context, key: str) -> str:
    """Per arm, what the run held equal and what it did not: RL steps taken and generated tokens, each seed's and
    their mean, from the train runs' results (``arm/steps``, ``arm/tokens``); with ``train.token_budget`` the
    tokens are equal within a step and the steps are not."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    rows = []
    for arm in _ranked(abl):
        seeds = _seeds(abl[arm])
        steps = [abl[arm][s].get("arm/steps") for s in seeds]
        tokens = [abl[arm][s].get("arm/tokens") for s in seeds]
        if not all(_finite(v) for v in steps + tokens) or not seeds:
            continue
        rows.append([f"`{arm}`", _num(sum(steps) / len(steps), 1), ", ".join(f"{s} {_num(v, 0)}" for s, v in
                                                                           zip(seeds, steps)),
                     _num(sum(tokens) / len(tokens), 0), ", ".join(f"{s} {_num(v, 0)}" for s, v in zip(seeds, tokens))])
    if not rows:
        return "This report holds no per-seed steps and tokens (`arm/steps`, `arm/tokens`). " + _source(ctx, folder)
    note = ("RL steps each run took and the tokens it generated (shared prefixes once; prompt and observation tokens "
            "are outside the count), mean over seeds and each seed's. " + _source(ctx, folder))
    return _table(["arm", "steps", "per seed", "generated tokens", "per seed"], rows,
                  ["---", "---:", "---", "---:", "---"]) + "\n\n" + note
