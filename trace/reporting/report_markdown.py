"""``reports/summary.md``: the ablation report in words (``trace.reporting.report``'s statistics).

``render_markdown`` states the regime (where warmup left the policy, grpo's gain over it), groups the arms by
whether their held-out avg@k is distinguishable from ``grpo``'s after correction (no rank over differences within
noise), declares the families of comparisons, and says of every difference the interval(s) that decided it, which
one did, and its verdict after Holm's correction within its family; the primary comparisons also get their margin
verdict and power (``trace.reporting.verdicts``, docs/method.md "Statistics over seeds"). The same results give
the same bytes.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from trace.reporting.report import BASELINE, CONFIDENCE, PAIRED_COLUMNS, arm_statistics, regime_summary
from trace.reporting.report_sections import _num, accounting_lines, allocator_state_section, format_interval, \
    predictor_section  # noqa: F401
from trace.reporting.statistics import BOOTSTRAP, BOOTSTRAP_RESAMPLES, Interval
from trace.reporting.verdicts import ALPHA, DEFAULT_MARGIN, FAMILIES, POWER, Verdict, judge


def _regime_lines(regime: dict) -> list[str]:
    lines = []
    if "warmup" in regime:
        se = f" (standard error {regime['se']:.3f})" if "se" in regime else ""
        train = (f"; on as many training questions {regime['warmup_train']:.3f} (a train accuracy far above the "
                 "held-out one would mean memorised questions)") if "warmup_train" in regime else ""
        lines.append(f"Held-out greedy accuracy after warmup: **{regime['warmup']:.3f}**{se}{train}.")
    if "all_equal_first" in regime:
        lines.append(f"- {BASELINE} groups with all-equal outcomes (no learning signal): "
                     f"{format_interval(regime['all_equal_first'], 3)} at its first step, "
                     f"{format_interval(regime['all_equal'], 3)} over its steps.")
    if "gain" in regime:
        gain = regime["gain"]
        judged = verdict(gain)
        if gain.estimator == BOOTSTRAP and gain.has_interval:
            judged += f"; paired bootstrap over the held-out questions and {gain.n} seeds"
        elif gain.has_interval:  # a single warmup evaluation's own error is not in a t-interval over seeds
            judged = ("not judged: this t-interval over seeds leaves out the warmup evaluation's own error, "
                      "and there are no per-question results to bootstrap")
        lines.append(f"- {BASELINE}'s gain in held-out greedy accuracy over warmup: "
                     f"{format_interval(gain, 3, True, True)} ({judged}).")
    if "warmup_sampled" in regime:
        lines.append(f"- Held-out avg@{regime['pass_k']} after warmup (mean reward of {regime['pass_k']} sampled "
                     f"rollouts per question, DeepScaleR's / verl's mean@k): **{regime['warmup_sampled']:.3f}**.")
    if "gain_sampled" in regime:
        gain = regime["gain_sampled"]
        how = (f"; paired bootstrap over the held-out questions and {gain.n} seeds"
               if gain.estimator == BOOTSTRAP and gain.has_interval else "")
        lines.append(f"- {BASELINE}'s gain in held-out avg@{regime['pass_k']} over warmup: "
                     f"{format_interval(gain, 3, True, True)} ({verdict(gain)}{how}).")
    if regime.get("root_auc"):
        lines.append("- Root AUC of the success predictor (mean over steps): " + ", ".join(
            f"{abl} {format_interval(iv, 3)}" for abl, iv in regime["root_auc"].items()) + ".")
    return lines + [""] if lines else []


def _digits(column: str) -> int:
    return 0 if column in ("generated tokens", "trajectories/step") else 2 if column == "s/step" else 3


def verdict(iv: Interval) -> str:
    """``real``, ``within noise``, ``one seed, no interval`` or ``no value`` for a paired difference."""
    if iv.n == 0:
        return "no value"
    if not iv.has_interval:
        return "one seed, no interval"
    return "real" if iv.excludes_zero else "within noise"


def _seed_list(seeds: Sequence[int]) -> str:
    return f"seed {seeds[0]} only" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"


def _seeds_line(results: dict, confidence: float) -> str:
    """The report's sentence on seeds: the seeds most arms ran, and each arm that ran other seeds by name (a
    union of all arms' seeds would claim runs an arm never had)."""
    by_arm = {arm: tuple(sorted(by_seed)) for arm, by_seed in results.items() if by_seed}
    if not by_arm:
        return "No runs."
    kinds = sorted(set(by_arm.values()), key=lambda s: (-list(by_arm.values()).count(s), -len(s), s))
    common, others = kinds[0], [(arm, s) for arm, s in by_arm.items() if s != kinds[0]]
    if not others and len(common) == 1:
        return (f"Seed {common[0]} only: one seed, no interval (run more with "
                "`dvc exp run -S 'train.seeds=[0,1,2]'`).")
    head = f"Seeds {', '.join(map(str, common))} ({len(common)} runs per arm)" if len(common) > 1 else \
        f"Seed {common[0]} only (1 run per arm)"
    if not others:
        return f"{head}: a value is the mean over seeds ± the half-width of its {confidence:.0%} t-interval."
    return (head + "; " + "; ".join(f"{arm}: {_seed_list(s)}" for arm, s in others) + ": a value is the mean "
            f"over an arm's seeds ± the half-width of its {confidence:.0%} t-interval (an arm of one seed has "
            "no interval).")


def _machine_line(results: dict) -> str:
    """Which precision and CPU the train runs ran in (their ``trace.precision`` and ``trace.cpu`` tags), with
    how many runs each where they differ; empty where no run has the tags."""
    seen: dict[tuple[str, str], int] = {}
    for by_seed in results.values():
        for res in by_seed.values():
            machine = res.get("machine") or {}
            if machine:
                key = (machine.get("precision", "unrecorded precision"), machine.get("cpu", "an unrecorded CPU"))
                seen[key] = seen.get(key, 0) + 1
    if not seen:
        return ""
    if len(seen) == 1:
        (precision, cpu), = seen
        return f"Train runs in **{precision}** on {cpu} (`trace.precision`, `trace.cpu` tags)."
    return "Train runs on mixed machines: " + "; ".join(
        f"{n} in {precision} on {cpu}" for (precision, cpu), n in sorted(seen.items())) + "."


def _rule_lines(arms: dict, judged: dict, margin: float, confidence: float) -> list[str]:
    """The declared families and the rule every verdict of the report follows."""
    sizes = {}
    for verdict in judged["verdicts"].values():
        sizes[verdict.family] = verdict.family_size
    families = "; ".join(f"{name} ({sizes.get(name, 0)})" for name, _, _ in FAMILIES)
    return [f"Paired differences (arm minus the other at the same seed), mean and {confidence:.0%} intervals: a "
            f"t-interval over seeds, and where per-question results exist also a paired bootstrap over the held-out "
            f"questions and seeds (percentile interval of {BOOTSTRAP_RESAMPLES:,} resamples). A difference is real "
            "only when every one of its intervals excludes 0; its p-value is the larger of theirs, and the interval "
            "that gave it is named (\"decided by\"). Families, each corrected by Holm's step-down at "
            f"{ALPHA:.0%} (number of comparisons): {families}. *Real after correction*: Holm's adjusted p below "
            f"{ALPHA:.2f}; *real before correction only*: every interval excludes 0 but not after correction.",
            "",
            f"Primary comparisons against the margin delta = {margin:g} (`report.margin`), read on the hull of "
            f"their intervals at the family-wise level 1 - {ALPHA:g}/m: *better by >= delta* (lower end >= delta), "
            "*worse* (upper end < 0), *equivalent within ±delta* (inside (-delta, +delta): two one-sided tests), "
            "*not worse (non-inferior)* (lower end > -delta), *not better by delta (non-superior)* (upper end < "
            "delta), else *undecided*."]


def _decided(iv: Interval, verdict: Verdict | None, digits: int) -> str:
    """A difference with every interval that decided it, the one that did, and its verdict."""
    if iv.n == 0:
        return "no value"
    if not iv.has_interval:
        return f"{_num(iv.mean, digits, True)} (one seed, no interval)"
    shown = [f"t over seeds [{_num(iv.low, digits, True)}, {_num(iv.high, digits, True)}]"]
    if iv.estimator == BOOTSTRAP:
        t = iv.seed_interval
        shown = [f"bootstrap [{_num(iv.low, digits, True)}, {_num(iv.high, digits, True)}]"]
        if t is not None and t.has_interval:
            shown.append(f"t over seeds [{_num(t.low, digits, True)}, {_num(t.high, digits, True)}]")
    text = f"{_num(iv.mean, digits, True)}, " + ", ".join(shown)
    if verdict is None or not math.isfinite(verdict.p):
        return text + f" ({verdict_words(iv)})"
    by = "the bootstrap" if verdict.decided_by == BOOTSTRAP else "t over seeds"
    return (text + f"; decided by {by}, p {verdict.p:.3f}, Holm {verdict.p_adjusted:.3f} of "
            f"{verdict.family_size} ({verdict.words})")


def _compact(iv: Interval, verdict_: Verdict | None, digits: int) -> str:
    """A table cell: the mean, the bootstrap interval (where there is one) and the t-interval over seeds, the
    one that decided marked with *, and the verdict after correction."""
    if not iv.has_interval:
        return format_interval(iv, digits, True, True)
    t = iv.seed_interval if iv.estimator == BOOTSTRAP else iv
    by = verdict_.decided_by if verdict_ is not None else None
    parts = []
    if iv.estimator == BOOTSTRAP:
        parts.append(f"b [{_num(iv.low, digits, True)}, {_num(iv.high, digits, True)}]" + ("*" if by == BOOTSTRAP else ""))
    if t is not None and t.has_interval:
        parts.append(f"t [{_num(t.low, digits, True)}, {_num(t.high, digits, True)}]" + ("*" if by != BOOTSTRAP else ""))
    words = verdict_.words if verdict_ is not None else verdict(iv)
    return f"{_num(iv.mean, digits, True)} " + " ".join(parts) + f" {words}"


def verdict_words(iv: Interval) -> str:
    """``verdict`` of a difference that belongs to no family."""
    return verdict(iv)


def _primary_lines(arms: dict, judged: dict, order: Sequence[str], margin: float, pass_k: int,
                   num_eval: int | None) -> list[str]:
    """The primary family: each arm's margin verdict and its power."""
    rows = [a for a in order if a in judged["margins"] or a in judged["power"]]
    if not rows:
        return []
    lines = ["", f"## Primary comparison: held-out avg@{pass_k} minus {BASELINE}", "",
             f"The verdict against delta = {margin:g}, on the interval at the family-wise level, and the power: the "
             f"minimum detectable difference (MDD) at {POWER:.0%} power, two-sided {ALPHA:.0%}, of the t-test over "
             "seeds and of the bootstrap (both must reject), the seeds that bring the seed component's MDD to delta "
             "(questions unchanged) and the questions that bring the question component's (the bootstrap's variance "
             "beyond the seed interval's) to delta.", "",
             "| arm | difference | verdict (delta) | interval read | MDD | MDD seeds | MDD bootstrap | seeds for delta "
             "| questions for delta |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for abl in rows:
        iv = arms[abl]["vs_grpo"]["eval mean@k"]
        words, low, high = judged["margins"].get(abl, ("undecided", float("nan"), float("nan")))
        pw = judged["power"].get(abl)
        if pw is None:
            power_cells = ["nan"] * 5
        else:
            seeds = str(pw.seeds_needed) if pw.seeds_needed is not None else "more than 1000"
            if not math.isfinite(pw.questions_factor):
                questions = "not recorded"
            elif num_eval:
                questions = f"{math.ceil(pw.questions_factor * num_eval):,}"
            else:
                questions = f"x{pw.questions_factor:.2f}"
            power_cells = [_num(pw.mdd, 3), _num(pw.mdd_seeds, 3), _num(pw.mdd_bootstrap, 3), seeds, questions]
        lines.append(f"| {abl} | {_num(iv.mean, 3, True)} | {words} | [{_num(low, 3, True)}, {_num(high, 3, True)}] | "
                     + " | ".join(power_cells) + " |")
    return lines


def render_markdown(results: dict, warmup: dict, pass_k: int, links: dict[str, str] | None = None,
                    plots: Sequence[str] = (), confidence: float = CONFIDENCE, num_eval: int | None = None,
                    warmup_questions: Mapping[str, Mapping[str, float]] | None = None,
                    margin: float = DEFAULT_MARGIN, target_accuracy: float | None = None) -> str:
    """``reports/summary.md``: the arms grouped against ``grpo``, the rule and families, the primary comparison
    (margin verdicts, power), the paired differences against ``grpo`` with the intervals that decided them,
    gains over warmup, tokens to a target accuracy (censored seeds stated), the audit means, then the MLflow
    ``links``.

    Args:
        results: ``collect_results`` output.
        warmup: the warmup stage's metrics (``accuracy/greedy`` is the baseline shown), or ``{}``.
        pass_k: ``evaluate.pass_k``; the sampled columns read ``accuracy/mean_at_<k>`` and ``pass_at_<k>``.
        links: ``mlflow_links`` output, or None to leave the links out.
        plots: the PNG names written (``trace.reporting.report_plots.write_plots``), listed under the table.
        confidence: interval coverage.
        num_eval: held-out questions of an evaluation (``evaluate.num_prompts``), for standard errors.
        warmup_questions: the warmup's per-question results (``attach_question_results``), or None.
        margin: delta of the margin verdicts (``report.margin``).
        target_accuracy: ``report.target_accuracy``, or None.

    Returns:
        The markdown text; a missing value shows as ``nan``.
    """
    stats = arm_statistics(results, pass_k, confidence, warmup, warmup_questions, target_accuracy)
    arms = stats["arms"]
    judged = judge(arms, margin)
    rank = {"above": 0, "as": 1, "below": 2}
    order = sorted(arms, key=lambda a: (rank[judged["groups"][a].split()[0]], a != BASELINE, a))
    columns = list(next(iter(arms.values()))["columns"]) if arms else []
    regime = {**regime_summary(results, warmup, num_eval, confidence, warmup_questions, pass_k), "pass_k": pass_k}
    lines = ["# Ablation report", "", *_regime_lines(regime),
             _seeds_line(results, confidence), *[line for line in (_machine_line(results),) if line], "",
             f"Grouped by held-out {'avg@' + str(pass_k) if judged['group_column'] == 'eval mean@k' else 'greedy accuracy'}"
             f" against {BASELINE} after Holm's correction (above, as, below {BASELINE}; no order within a group). "
             "Training columns are means over steps;", "every arm samples the same number of trajectories per step.",
             *accounting_lines(results), "",
             f"| group | ablation | eval greedy | eval mean@{pass_k} | eval pass@{pass_k} | effective ratio | "
             "effective token ratio | active prompts | train reward | generated tokens | trajectories/step | "
             "s/step |", "|---:|---|" + "---:|" * len(columns or range(10))]
    for abl in order:
        cells = [format_interval(arms[abl]["columns"][c], _digits(c)) for c in columns]
        lines.append(f"| {judged['groups'][abl]} | {abl} | " + " | ".join(cells) + " |")
    paired = [a for a in order if "vs_grpo" in arms[a]]
    if paired:
        lines += ["", "## The rule", "", *_rule_lines(arms, judged, margin, confidence)]
        lines += _primary_lines(arms, judged, paired, margin, pass_k, num_eval)
        lines += ["", f"## Against {BASELINE}", "",
                  "| ablation | " + " | ".join(f"Δ {c.replace('@k', f'@{pass_k}')}" for c, _ in PAIRED_COLUMNS)
                  + " |",
                  "|---|" + "---:|" * len(PAIRED_COLUMNS)]
        for abl in paired:
            d = arms[abl]["vs_grpo"]
            lines.append(f"| {abl} | " + " | ".join(_compact(d[c], judged["verdicts"].get((abl, "vs_grpo", c)), _digits(c))
                                                    for c, _ in PAIRED_COLUMNS) + " |")
        lines.append("")
        for abl in paired:
            d = arms[abl]["vs_grpo"]
            parts = [f"{words} {_decided(d[c], judged['verdicts'].get((abl, 'vs_grpo', c)), _digits(c))}"
                     for c, words in PAIRED_COLUMNS]
            lines.append(f"- {abl} against {BASELINE}: " + "; ".join(parts) + ".")
    gained = [a for a in order if arms[a].get("vs_warmup")]
    if gained:
        lines += ["", "## Gain over warmup", "",
                  f"Held-out accuracy after RL minus the warmup policy's, mean and {confidence:.0%} intervals: a paired "
                  "bootstrap over the held-out questions and seeds where per-question results exist (the warmup's "
                  "own evaluation error included) and the t-interval over seeds, with the one that decided and the "
                  "verdict after Holm's correction within the family of gains. "
                  f"Greedy: one rollout at temperature 0 (Search-R1's exact match); avg@{pass_k}: the mean reward of "
                  f"{pass_k} sampled rollouts per question (DeepScaleR's avg@k, verl's mean@k).", "",
                  f"| ablation | Δ greedy | Δ avg@{pass_k} |", "|---|---:|---:|"]
        for abl in gained:
            g = arms[abl]["vs_warmup"]
            lines.append(f"| {abl} | " + " | ".join(
                _decided(g[c], judged["verdicts"].get((abl, "vs_warmup", c)), 3) if c in g else "nan"
                for c in ("eval greedy", "eval mean@k")) + " |")
    for column, suffix, key, what in (("eval greedy", "", "accuracy/eval", "greedy accuracy"),
                                      ("eval mean@k", "_sampled", "accuracy/eval_sampled", f"avg@{pass_k}")):
        target = stats["targets"][column]
        if not math.isfinite(target["warmup"]) and target_accuracy is None and BASELINE not in arms:
            continue
        how = (f"`report.target_accuracy` {target['target']:.3f}" if target_accuracy is not None else
               f"the warmup's {_num(target['warmup'], 3)} plus half of {BASELINE}'s mean gain in final in-training "
               f"{what}")
        lines += ["", "## Sample efficiency" + ("" if not suffix else f", avg@{pass_k}"), ""]
        if target["refusal"] is not None:
            lines.append(f"Tokens to a target {what} ({how}): not reported, {target['refusal']}.")
            continue
        lines += [f"Generated tokens until the in-training held-out {what} (`{key}`) first reaches "
                  f"{target['target']:.3f} ({how}): per seed the first crossing of accuracy against cumulative "
                  "generated tokens, linearly interpolated; a seed that never reaches it is censored at its last "
                  "tokens (kept, counted above every crossing); the median over all seeds (none while half or more "
                  "are censored).", "",
                  f"| ablation | median tokens to {target['target']:.3f} | seeds reaching | per seed |",
                  "|---|---:|---:|---|"]
        for abl in order:
            hits = arms[abl]["crossings" + suffix]
            per_seed = [f"s{s}: {_num(v, 0)}" for s, v in hits.reached.items()] + \
                [f"s{s}: > {_num(v, 0)} (censored)" for s, v in hits.censored.items()]
            median = _num(hits.median, 0) if math.isfinite(hits.median) else "not reached by half the seeds"
            lines.append(f"| {abl} | {median} | {len(hits.reached)}/{hits.num_seeds} | {', '.join(sorted(per_seed))} |")
    probed = [a for a in order if arms[a]["probe_gain"] is not None]
    if probed:
        lines += ["", "## Probe", "",
                  "Sampled success on the fixed probe of training prompts (`train.probe_prompts` x "
                  "`train.probe_samples`, the same sampling seeds at every evaluation) at the last evaluation, minus "
                  f"the starting policy's (`probe/gain`): mean over seeds and {confidence:.0%} t-interval.", "",
                  "| ablation | probe gain | verdict |", "|---|---:|---|"]
        for abl in probed:
            g = arms[abl]["probe_gain"]
            lines.append(f"| {abl} | {format_interval(g, 3, True, True)} | {verdict(g)} |")
    audited = [a for a in order if arms[a]["audit"]]
    if audited:
        keys = ("audit/expected_mixed_groups", "audit/integrated_mixed_groups", "audit/mixed_groups",
                "audit/expected_flips", "audit/integrated_flips", "audit/flips")
        lines += ["", "## Allocation audit", "",
                  "Forecast against realised, per step (mean over steps, then over seeds). *Point*: the allocator's "
                  "forecast, the prediction plugged into A(p, m) and V_pref; *integrated*: the same over the truth's "
                  "spread around the prediction, fitted on the previous steps (docs/method.md, \"Forecasts integrated over the truth's spread\").",
                  "", "| ablation | mixed groups: point | integrated | realised | flips: point | integrated | realised |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for abl in audited:
            au = arms[abl]["audit"]
            lines.append(f"| {abl} | " + " | ".join(format_interval(au[k], 2) if k in au else "nan" for k in keys)
                         + " |")
        lines += predictor_section(arms, audited)
    lines += allocator_state_section(arms, order)
    lines += [""]
    if plots:
        lines += ["Plots: " + ", ".join(f"`{name}`" for name in plots) + ".", ""]
    if links:
        report = f", [this report and its plots]({links['report']})" if links.get("report") else ""
        lines += [f"MLflow (`make ui`): [the arms' results]({links['runs']}) (every seed's evaluate run, grouped by "
                  "arm with the mean over seeds: `arm/acc`, `arm/eff_ratio`, ...), "
                  f"[compare the arms]({links['compare']}){report}.", ""]
    return "\n".join(lines)
