"""``reports/summary.md``: the ablation report in words (``trace.reporting.report``'s statistics).

``render_markdown`` states the regime (where warmup left the policy, grpo's gain over it), ranks the arms by
mean held-out greedy accuracy (ties: effective ratio), and says in words which differences against ``grpo``
are real (the interval excludes 0), which are within noise and which estimator made each interval
(docs/method.md, "Statistics over seeds"). The same results give the same bytes.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from trace.reporting.report import AUDIT_KEYS, BASELINE, CONFIDENCE, PAIRED_COLUMNS, arm_statistics, regime_summary
from trace.reporting.statistics import BOOTSTRAP, BOOTSTRAP_RESAMPLES, Interval


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
        in_se = f" = {gain.mean / regime['se']:+.1f} standard errors of the evaluation" if regime.get("se") else ""
        judged = verdict(gain)
        if gain.estimator == BOOTSTRAP and gain.has_interval:
            judged += f"; paired bootstrap over the held-out questions and {gain.n} seeds"
        elif gain.has_interval:  # a single warmup evaluation's own error is not in a t-interval over seeds
            judged = ("not judged: this t-interval over seeds leaves out the warmup evaluation's own error, "
                      "and there are no per-question results to bootstrap")
        lines.append(f"- {BASELINE}'s gain in held-out greedy accuracy over warmup: "
                     f"{format_interval(gain, 3, True, True)}{in_se} ({judged}).")
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


def _num(value: float, digits: int, sign: bool = False) -> str:
    if not math.isfinite(value):
        return "nan"
    text = f"{value:{'+' if sign else ''},.{digits}f}"
    return text


def _digits(column: str) -> int:
    return 0 if column in ("generated tokens", "trajectories/step") else 2 if column == "s/step" else 3


def format_interval(iv: Interval, digits: int, sign: bool = False, brackets: bool = False) -> str:
    """``mean ± half`` (or ``mean [low, high]`` with ``brackets``); the mean alone without an interval."""
    if not iv.has_interval:
        return _num(iv.mean, digits, sign)
    if brackets:
        return f"{_num(iv.mean, digits, sign)} [{_num(iv.low, digits, sign)}, {_num(iv.high, digits, sign)}]"
    return f"{_num(iv.mean, digits, sign)} ± {_num(iv.half_width, digits)}"


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


def _estimators_line(arms: dict, paired: list[str], confidence: float) -> str:
    """The sentence under "Against grpo": which estimator made the intervals of the table."""
    head = f"Paired differences (arm minus {BASELINE} at the same seed), mean and {confidence:.0%} "
    booted = {c: [a for a in paired if arms[a]["vs_grpo"][c].estimator == BOOTSTRAP] for c in ("eval greedy", "eval mean@k")}
    if not any(booted.values()):
        return head + "t-interval; a difference is real only when its interval excludes 0."
    names = [f"Δ {c}" + ("" if len(arms_) == len(paired) else f" for {', '.join(arms_)}")
             for c, arms_ in booted.items() if arms_]
    return (head + f"interval: {' and '.join(names)} by a paired bootstrap over the held-out questions and seeds "
            f"(percentile interval of {BOOTSTRAP_RESAMPLES:,} resamples, evaluation noise included), the other "
            "columns by a t-interval over seeds. A difference is real only when its interval excludes 0; a "
            "bootstrap interval also needs the t-interval over seeds to exclude 0 (a percentile interval of few "
            "seeds understates their spread).")


def render_markdown(results: dict, warmup: dict, pass_k: int, links: dict[str, str] | None = None,
                    plots: Sequence[str] = (), confidence: float = CONFIDENCE, num_eval: int | None = None,
                    warmup_questions: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """``reports/summary.md``: the arms ranked by mean held-out greedy accuracy, the paired differences
    against ``grpo`` in words, tokens to grpo's final accuracy, the audit means, then the MLflow ``links``.

    Args:
        results: ``collect_results`` output.
        warmup: the warmup stage's metrics (``accuracy/greedy`` is the baseline shown), or ``{}``.
        pass_k: ``evaluate.pass_k``; the sampled columns read ``accuracy/mean_at_<k>`` and ``pass_at_<k>``.
        links: ``mlflow_links`` output, or None to leave the links out.
        plots: the PNG names written (``trace.reporting.report_plots.write_plots``), listed under the table.
        confidence: interval coverage.
        num_eval: held-out questions of an evaluation (``evaluate.num_prompts``), for standard errors.
        warmup_questions: the warmup's per-question results (``attach_question_results``), or None.

    Returns:
        The markdown text; a missing value shows as ``nan``.
    """
    stats = arm_statistics(results, pass_k, confidence, warmup, warmup_questions)
    arms = stats["arms"]
    order = sorted(arms, key=lambda a: tuple(-(x if math.isfinite(x) else -1.0) for x in (
        arms[a]["columns"]["eval greedy"].mean, arms[a]["columns"]["effective ratio"].mean)))
    columns = list(next(iter(arms.values()))["columns"]) if arms else []
    regime = {**regime_summary(results, warmup, num_eval, confidence, warmup_questions, pass_k), "pass_k": pass_k}
    lines = ["# Ablation report", "", *_regime_lines(regime),
             _seeds_line(results, confidence), "",
             "Ranked by mean held-out greedy accuracy after RL (ties: effective ratio). Training columns are "
             "means over steps;", "every arm samples the same number of trajectories per step.", "",
             f"| rank | ablation | eval greedy | eval mean@{pass_k} | eval pass@{pass_k} | effective ratio | "
             "effective token ratio | active prompts | train reward | generated tokens | trajectories/step | "
             "s/step |", "|---:|---|" + "---:|" * len(columns or range(10))]
    for i, abl in enumerate(order, 1):
        cells = [format_interval(arms[abl]["columns"][c], _digits(c)) for c in columns]
        lines.append(f"| {i} | {abl} | " + " | ".join(cells) + " |")
    paired = [a for a in order if "vs_grpo" in arms[a]]
    if paired:
        lines += ["", f"## Against {BASELINE}", "", _estimators_line(arms, paired, confidence), "",
                  "| ablation | " + " | ".join(f"Δ {c.replace('@k', f'@{pass_k}')}" for c, _ in PAIRED_COLUMNS)
                  + " |",
                  "|---|" + "---:|" * len(PAIRED_COLUMNS)]
        for abl in paired:
            d = arms[abl]["vs_grpo"]
            lines.append(f"| {abl} | " + " | ".join(format_interval(d[c], _digits(c), True, True)
                                                    for c, _ in PAIRED_COLUMNS) + " |")
        lines.append("")
        for abl in paired:
            d = arms[abl]["vs_grpo"]
            parts = [f"{words} {format_interval(d[c], _digits(c), True, True)} ({verdict(d[c])})"
                     for c, words in PAIRED_COLUMNS]
            lines.append(f"- {abl} against {BASELINE}: " + "; ".join(parts) + ".")
    gained = [a for a in order if arms[a].get("vs_warmup")]
    if gained:
        lines += ["", "## Gain over warmup", "",
                  f"Held-out accuracy after RL minus the warmup policy's, mean and {confidence:.0%} interval: a paired "
                  "bootstrap over the held-out questions and seeds where per-question results exist (the warmup's "
                  "own evaluation error included), real only when it and the t-interval over seeds both exclude 0. "
                  f"Greedy: one rollout at temperature 0 (Search-R1's exact match); avg@{pass_k}: the mean reward of "
                  f"{pass_k} sampled rollouts per question (DeepScaleR's avg@k, verl's mean@k).", "",
                  f"| ablation | Δ greedy | Δ avg@{pass_k} |", "|---|---:|---:|"]
        for abl in gained:
            g = arms[abl]["vs_warmup"]
            lines.append(f"| {abl} | " + " | ".join(
                f"{format_interval(g[c], 3, True, True)} ({verdict(g[c])})" if c in g else "nan"
                for c in ("eval greedy", "eval mean@k")) + " |")
    for target, suffix, key, what in ((stats["target"], "", "accuracy/eval", "greedy accuracy"),
                                      (stats["target_sampled"], "_sampled", "accuracy/eval_sampled", "avg@k")):
        if target is None:
            continue
        lines += ["", "## Sample efficiency" + ("" if not suffix else ", avg@k"), "",
                  f"Generated tokens to reach {BASELINE}'s final in-training held-out {what} "
                  f"({format_interval(target, 3)}, mean over seeds of its last `{key}`): per seed the "
                  "first crossing of accuracy against cumulative generated tokens, linearly interpolated; mean "
                  "over the seeds that reach it.", "",
                  f"| ablation | tokens to {_num(target.mean, 3)} | seeds reaching |", "|---|---:|---:|"]
        for abl in order:
            hit = arms[abl]["tokens_to_target" + suffix]
            shown = format_interval(hit, 0) if hit is not None else "not reached"
            lines.append(f"| {abl} | {shown} | {arms[abl]['reached' + suffix]}/{len(arms[abl]['seeds'])} |")
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
        keys = AUDIT_KEYS[:4]
        lines += ["", "## Allocation audit", "",
                  "Forecast against realised, per step (mean over steps, then over seeds).", "",
                  "| ablation | expected mixed groups | mixed groups | expected flips | flips |",
                  "|---|---:|---:|---:|---:|"]
        for abl in audited:
            au = arms[abl]["audit"]
            lines.append(f"| {abl} | " + " | ".join(format_interval(au[k], 2) if k in au else "nan" for k in keys)
                         + " |")
    lines += [""]
    if plots:
        lines += ["Plots: " + ", ".join(f"`{name}`" for name in plots) + ".", ""]
    if links:
        report = f", [this report and its plots]({links['report']})" if links.get("report") else ""
        lines += [f"MLflow (`make ui`): [the arms' results]({links['runs']}) (every seed's evaluate run, grouped by "
                  "arm with the mean over seeds: `arm/acc`, `arm/eff_ratio`, ...), "
                  f"[compare the arms]({links['compare']}){report}.", ""]
    return "\n".join(lines)
