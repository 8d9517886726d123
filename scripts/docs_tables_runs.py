"""Docs tables of the ablation pipeline's run reports (``reports/runs/<folder>/metrics.json`` of the report stage):
the arms, their differences against ``grpo``, the warmup they start from, gains over it (greedy and avg@k), tokens
to ``grpo``'s final accuracy and the allocation audit."""

from __future__ import annotations

import re
from typing import Sequence

from scripts.docs_tables_common import ABLATION_REPORTS, Context, _diff, _finite, _missing, _num, _pm, _source, _table

__all__ = ["ABLATION_REPORTS", "LEARNING_BAR", "arms_table", "audit_table", "gain_avgk_table", "gain_table",
           "overview_table", "regime_table", "tokens_to_target_table", "vs_grpo_table"]
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
        cols += [("active prompts", "active prompts", 3), ("train reward", "train reward", 3),
                 ("trajectories/step", "trajectories/step", 0)]
    cols += [("generated tokens", "generated tokens", 0), ("s/step", "s/step", 2)]
    rows = [[str(rank), f"`{arm}`"] + [_pm(abl[arm]["mean"].get(c), d) for c, _, d in cols]
            for rank, arm in enumerate(_ranked(abl), 1)]
    seeds = sorted({s for entry in abl.values() for s in _seeds(entry)}, key=lambda s: int(s[1:]))
    note = (f"Mean over seeds {', '.join(s[1:] for s in seeds)} ± the half-width of the 95 % t-interval; training "
            f"columns are means over steps, generated tokens the run's total. {_source(ctx, folder)}")
    return _table(["rank", "arm"] + [label for _, label, _ in cols], rows,
                  ["---:", "---"] + ["---:"] * len(cols)) + "\n\n" + note


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
    rows = [[f"`{arm}`"] + [_diff(abl[arm][versus].get(c), d) for c, _, d in cols]
            for arm in _ranked(abl) if versus in abl[arm] and (arms is None or arm in arms)]
    estimators = {iv.get("estimator") for arm in abl.values() for iv in arm.get(versus, {}).values()}
    note = f"Arm minus `{ref}` at the same seed ({_verdict_rule(estimators, ctx)}). {_source(ctx, folder)}"
    return _table([f"arm minus `{ref}`"] + [label for _, label, _ in cols], rows) + "\n\n" + note


def _verdict_rule(estimators: set, ctx: Context) -> str:
    """How the tables' *real* / *within noise* was decided: the report's rule (docs/method.md, "Statistics over
    seeds"), which for a bootstrap interval also asks the t-interval over seeds to exclude 0."""
    if estimators <= {None, "t"}:
        return "paired by seed, 95 % t-interval; *real* only when the interval excludes 0"
    return ("95 % interval: t over seeds, or a paired bootstrap over questions and seeds where the report says so; "
            "*real* only when the interval excludes 0 and, for a bootstrap interval, the t-interval over seeds "
            "(not shown) excludes 0 too, so a bootstrap interval that excludes 0 can still be within noise: "
            f"[the rule]({ctx.link('docs/method.md')}#statistics-over-seeds)")


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

    def verdict(iv: dict | None, digits: int) -> str:
        if not iv or not _finite(iv.get("mean")):
            return ""
        word = ("real" if iv.get("real") else "within noise") if iv.get("n", 1) > 1 else "one seed"
        return f"{_num(iv['mean'], digits, True)} {word}"

    rows = []
    for arm in _ranked(abl):
        row = [f"`{arm}`"]
        for c, _, d in cols:
            row += [_pm(abl[arm]["mean"].get(c), d), verdict(abl[arm].get("vs_grpo", {}).get(c), d)]
        rows.append(row)
    estimators = {iv.get("estimator") for arm in abl.values() for iv in arm.get("vs_grpo", {}).values()}
    note = (f"{len(abl)} arms, ranked by held-out greedy accuracy (the report's order); mean over seeds "
            f"{', '.join(s[1:] for s in sorted({s for e in abl.values() for s in _seeds(e)}, key=lambda s: int(s[1:])))}"
            f" ± the 95 % t half-width, generated tokens the run's total. \"minus `grpo`\": the arm minus `grpo` at the "
            f"same seed ({_verdict_rule(estimators, ctx)}). {_source(ctx, folder)}")
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
        bar = (f" Asked of greedy accuracy, the learning bar (`grpo`'s gain >= {LEARNING_BAR:.2f} with the "
               f"interval's lower end above the warmup) is **{'met' if met else 'not met'}** (where a report has "
               "avg@k, the bar is asked of avg@k: its `-gain-avgk` table).")
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
    gg = abl.get("grpo", {}).get("vs_warmup", {}).get("eval greedy") or {}
    greedy_met = _finite(gg.get("mean")) and gg["mean"] >= LEARNING_BAR and bool(gg.get("real"))
    note = (f"After RL: mean over seeds ± the 95 % t half-width. Gain: the arm minus the warmup policy (avg@{k} "
            f"{_num(base_k)}, greedy {_num(w.get('accuracy/greedy'))}), mean with the 95 % interval of a paired "
            f"bootstrap over the held-out questions and seeds (the evaluations' own noise included) and the "
            f"t-interval over seeds; *real* only when both exclude 0. avg@{k}: the mean reward of {k} sampled "
            f"rollouts per question (DeepScaleR's avg@k, verl's mean@k); greedy: one rollout at temperature 0 "
            f"(Search-R1's exact match). The learning bar (`grpo`'s avg@{k} gain >= {LEARNING_BAR:.2f}, real) is "
            f"**{'met' if met else 'not met'}**; asked of greedy accuracy, as it was until an earlier run missed it "
            f"there, it is **{'met' if greedy_met else 'not met'}**. " + _source(ctx, folder))
    return _table(["arm", f"held-out avg@{k}", f"avg@{k} minus warmup", "held-out greedy", "greedy minus warmup"],
                  rows) + "\n\n" + note


def tokens_to_target_table(ctx: Context, key: str, sampled: bool = False) -> str:
    """Per arm, the generated tokens to reach ``grpo``'s final in-training held-out accuracy (the curves):
    greedy, or avg@k with ``sampled``."""
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    last, hit_key = ("arm/last_avgk", "tokens_to_grpo_final_sampled") if sampled else \
        ("arm/last_eval_acc", "tokens_to_grpo_final")
    # runs trained before the name arm/last_avgk logged the same value as arm/last_eval_avgk
    finals = [abl["grpo"][s].get(last, abl["grpo"][s].get("arm/last_eval_avgk")) for s in _seeds(abl["grpo"])] \
        if "grpo" in abl else []
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
