"""The ablation report over arms and training seeds, read from MLflow so the report and the MLflow UI agree.

``collect_results`` reads, per arm and seed, the newest finished train run (its per-step metric histories and
run-level ``arm/*`` results, named by ``trace.tracking.names.SUMMARY_METRIC_NAMES``) and evaluate run (its
held-out metrics); ``trace.reporting.report_questions`` adds each evaluation's per-question results. ``arm_statistics``
gives per arm the mean over seeds and its 95 % t-interval of every table column, the paired differences
against ``grpo`` (same seed = a pair; held-out greedy accuracy by a paired bootstrap over questions and seeds
where per-question results exist) and the generated tokens each arm needs to reach ``grpo``'s final
in-training accuracy (``trace.reporting.statistics``, docs/method.md "Statistics over seeds"), and
``regime_summary`` where warmup left the policy. ``trace.reporting.report_markdown`` writes them as
``reports/summary.md``, ``trace.reporting.report_json`` as ``reports/metrics.json`` and ``trace.reporting.report_plots`` draws
the curves with their bands. The same MLflow data and evaluation outputs give the same bytes.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from trace.predictor.reliability import arm_reliability, is_diagram_key
from trace.reporting.report_questions import bootstrap_against, bootstrap_gain
from trace.reporting.statistics import Interval, crossing_target, mean_interval, paired_difference, target_refusal, \
    tokens_to_target_censored
from trace.tracking.names import EVAL_ACCURACY, EVAL_SAMPLED_ACCURACY, GREEDY_ACCURACY, SUMMARY_METRIC_NAMES, \
    TRAIN_ACCURACY_PREFIX, metric_key, pass_at_k_name, sampled_accuracy_name
from trace.tracking.runs import finished_runs

BASELINE = "grpo"  # the arm every other arm is paired against
METHOD = "trace"  # the arm every other arm is also paired against (vs_trace), when it ran
CONFIDENCE = 0.95
# the allocation audit's per-step keys (logged by train runs that audit their forecasts)
RANDOM_ANCHORS = "tree_random"  # the stage-2 baseline: continuations from uniformly drawn anchors
AUDIT_KEYS = ("audit/expected_mixed_groups", "audit/mixed_groups", "audit/expected_flips", "audit/flips",
              "audit/groups", "audit/anchors", "audit/integrated_mixed_groups", "audit/integrated_flips")
# the predictor against Monte-Carlo truth (predictor.truth) and what the truth and the oracle arm's estimates cost
TRUTH_SCORES = ("ece", "brier", "reliability", "resolution", "auc", "forecast_mean", "realised_mean")
TRUTH_KEYS = tuple(f"truth/{stage}_{name}" for stage in ("root", "prefix") for name in TRUTH_SCORES) + (
    "truth/rollouts", "oracle/rollouts", "oracle/tokens")
# what the allocators that keep state across steps did, and the exploration groups (their rules' per-step metrics)
ALLOCATOR_KEYS = ("greso/skipped", "greso/refilled", "greso/p_easy", "greso/p_hard", "mopps/known_prompts",
                  "mopps/selected_seen", "mopps/selected_posterior_mean", "vip/forecast_brier", "vip/mean_forecast",
                  "vip/active_prompts", "allocation/explore_groups")
# per-step metrics of a train run read for the plots
STEP_KEYS = ("effective_ratio", "effective_token_ratio", "reward/mean", "tokens/generated", EVAL_ACCURACY, EVAL_SAMPLED_ACCURACY,
             "probe/gain",
             "tokens/cumulative", "rollout/cumulative_trajectories", "active_prompt_ratio", "predictor/brier",
             "mixed_group_ratio", "predictor/root_auc", "eval/token_mark", "tokens/budget", "tokens/prompt",
             "tokens/observation",
             *AUDIT_KEYS, *TRUTH_KEYS, *ALLOCATOR_KEYS)
# summary.md columns after the held-out accuracies: the training-summary keys whose run-level metric
# (``SUMMARY_METRIC_NAMES``) each shows
TABLE_SUMMARY_KEYS = ("mean/effective_ratio", "mean/effective_token_ratio", "mean/active_prompt_ratio",
                      "mean/reward/mean", "tokens/cumulative", "mean/rollout/trajectories", "mean/time/step")
# held-out accuracy columns, their measure (trace.reporting.report_questions.MEASURES) and in-training curve key
ACCURACY_COLUMNS = {"eval greedy": ("greedy", EVAL_ACCURACY), "eval mean@k": ("sampled", EVAL_SAMPLED_ACCURACY)}
# the columns whose differences against grpo the report states: (column, words)
PAIRED_COLUMNS = (("eval greedy", "held-out greedy accuracy"), ("eval mean@k", "held-out sampled accuracy"),
                  ("effective ratio", "effective ratio"), ("effective token ratio", "effective token ratio"),
                  ("generated tokens", "generated tokens"))


def collect_results(tracking_uri: str | None, experiment_name: str, ablations: Sequence[str],
                    hashes: Mapping[int, tuple[str, str]]) -> dict:
    """Per arm and seed: the train run's metric histories and run-level results (``arm/*``), and the
    evaluate run's metrics, with both run ids and the experiment id.

    A run belongs to seed ``s`` when its ``trace.params_hash`` tag is that seed's hash (a run config's hash
    holds its seed, ``flows.common.run_config``).

    Args:
        tracking_uri: MLflow URI or None (``trace.tracking.experiment.resolve_tracking_uri``).
        experiment_name: the MLflow experiment.
        ablations: the arms to report (``train.ablations``); other arms' runs are ignored.
        hashes: seed -> (resume hash of its train runs, params hash of its evaluate runs).

    Returns:
        ``{ablation: {seed: {"run_id", "experiment_id", "history": {key: [(step, value), ...]},
        "summary": {arm/*}, "machine": {"precision", "cpu"} (the run's tags where set), "eval": {...},
        "eval_run_id"}}}``, arms in ``ablations`` order, seeds sorted;
        an arm without any train run is absent, ``eval`` and ``eval_run_id`` only where an evaluate run
        exists.
    """
    from mlflow.tracking import MlflowClient

    from trace.tracking.experiment import resolve_tracking_uri

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    train_seed = {h[0]: seed for seed, h in hashes.items()}
    eval_seed = {h[1]: seed for seed, h in hashes.items()}
    key_tags = ("trace.ablation", "trace.params_hash")
    found: dict = {}
    for run in finished_runs(tracking_uri, experiment_name, "train", key_tags):
        abl, seed = run.data.tags.get("trace.ablation"), train_seed.get(run.data.tags.get("trace.params_hash"))
        if abl not in ablations or seed is None:
            continue
        keys = STEP_KEYS + tuple(k for k in run.data.metrics if is_diagram_key(k))  # the audits' diagrams
        hist = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) for k in keys}
        found.setdefault(abl, {})[seed] = {
            "run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "history": hist,
            "summary": {k: v for k, v in run.data.metrics.items() if k.startswith("arm/")},
            "machine": {k: run.data.tags[t] for k, t in (("precision", "trace.precision"), ("cpu", "trace.cpu"))
                        if t in run.data.tags}}
    for run in finished_runs(tracking_uri, experiment_name, "evaluate", key_tags):
        abl, seed = run.data.tags.get("trace.ablation"), eval_seed.get(run.data.tags.get("trace.params_hash"))
        if seed is not None and seed in found.get(abl, {}):
            found[abl][seed]["eval"] = {k: v for k, v in run.data.metrics.items() if not k.startswith("arm/")}
            found[abl][seed]["eval_run_id"] = run.info.run_id
    return {abl: dict(sorted(found[abl].items())) for abl in ablations if abl in found}


def seeds_of(results: dict) -> list[int]:
    """Every seed any arm of ``results`` has, sorted."""
    return sorted({seed for by_seed in results.values() for seed in by_seed})


def first_runs(results: dict) -> dict:
    """Per arm its lowest seed's run (``{ablation: run result}``), e.g. for the MLflow links."""
    return {abl: next(iter(by_seed.values())) for abl, by_seed in results.items() if by_seed}


def evaluate_run_ids(results: dict) -> list[str]:
    """The evaluate runs of every arm and seed of ``results``, in arm then seed order (the runs the report's
    held-out columns average: ``trace.tracking.experiment.share_arms_view`` shows them)."""
    return [res["eval_run_id"] for by_seed in results.values() for res in by_seed.values() if "eval_run_id" in res]


def mlflow_links(results: dict, base_url: str, view_key: str | None = None) -> dict[str, str]:
    """Links into the MLflow UI: the experiment's runs table (in the shared view ``view_key``, e.g. the arms'
    results of ``trace.tracking.experiment.share_arms_view``: every seed's evaluate run, grouped by arm) and
    the compare view of the evaluate runs of every arm and seed (of the train runs where an evaluate run is
    missing).

    Args:
        results: ``collect_results`` output.
        base_url: the MLflow UI (``trace.tracking.experiment.ui_url``).
        view_key: a shared runs-table view of the experiment, or None.

    Returns:
        ``{"runs": url, "compare": url}``; empty without results.
    """
    from trace.tracking.experiment import compare_url, experiment_url

    runs = [res for by_seed in results.values() for res in by_seed.values()]
    if not runs:
        return {}
    experiment_id = runs[0]["experiment_id"]
    run_ids = [res.get("eval_run_id") or res["run_id"] for res in runs]
    return {"runs": experiment_url(base_url, experiment_id, view_key),
            "compare": compare_url(base_url, experiment_id, run_ids)}


def column_values(res: dict, pass_k: int) -> dict[str, float]:
    """One run's value of every table column (NaN where the run lacks it)."""
    nan = float("nan")
    e, s = res.get("eval", {}), res["summary"]
    values = {"eval greedy": e.get(GREEDY_ACCURACY, nan),
              "eval mean@k": e.get(metric_key(f"accuracy/mean@{int(pass_k)}"), nan),
              "eval pass@k": e.get(metric_key(pass_at_k_name(pass_k)), nan)}
    names = ("effective ratio", "effective token ratio", "active prompts", "train reward", "generated tokens",
             "trajectories/step", "s/step")
    values.update({name: s.get(SUMMARY_METRIC_NAMES[key], nan) for name, key in zip(names, TABLE_SUMMARY_KEYS)})
    return values


def final_accuracy(res: dict, key: str = EVAL_ACCURACY) -> float:
    """The run's last in-training held-out accuracy (``key``: ``accuracy/eval`` greedy or
    ``accuracy/eval_sampled`` avg@k), NaN without one."""
    points = res["history"].get(key) or []
    return float(points[-1][1]) if points else float("nan")


def accuracy_curve(res: dict, x_key: str, key: str = EVAL_ACCURACY) -> tuple[list[float], list[float]]:
    """``(xs, accuracies)`` of a run: ``key`` (greedy or avg@k in-training accuracy) at the steps that also
    logged ``x_key``."""
    xs_by_step = dict(res["history"].get(x_key) or [])
    pts = [(xs_by_step[s], v) for s, v in res["history"].get(key) or [] if s in xs_by_step]
    return [p[0] for p in pts], [p[1] for p in pts]


def _warmup_gain(by_seed: Mapping[int, dict], warmup: Mapping[str, float], warmup_questions, column: str,
                 pass_k: int, confidence: float):
    """One arm's held-out accuracy minus the warmup's: a paired bootstrap over questions and seeds where
    per-question results exist (its ``seed_interval`` the t-interval over seeds), else the t-interval over
    seeds of the differences (which leaves out the warmup evaluation's own error). None without the warmup's
    accuracy."""
    measure = ACCURACY_COLUMNS[column][0]
    name = GREEDY_ACCURACY if measure == "greedy" else sampled_accuracy_name(pass_k)
    base = warmup.get(name, warmup.get(metric_key(name)))
    if base is None:
        return None
    boot = bootstrap_gain(by_seed, warmup_questions, confidence, measure)
    if boot is not None:
        return boot
    values = [column_values(res, pass_k)[column] - base for res in by_seed.values() if "eval" in res]
    return mean_interval(values, confidence) if values else None


def _warmup_accuracy(warmup: Mapping[str, float] | None, column: str, pass_k: int) -> float:
    """The warmup's held-out accuracy of a ``ACCURACY_COLUMNS`` column, NaN without it."""
    name = GREEDY_ACCURACY if ACCURACY_COLUMNS[column][0] == "greedy" else sampled_accuracy_name(pass_k)
    value = (warmup or {}).get(name, (warmup or {}).get(metric_key(name)))
    return float(value) if value is not None else float("nan")


def crossing_targets(results: dict, pass_k: int, warmup: Mapping[str, float] | None,
                     target_accuracy: float | None = None) -> dict:
    """Per accuracy column (``eval greedy``, ``eval mean@k``) the tokens-to-target accuracy and why it is
    refused, if it is.

    Args:
        results: ``collect_results`` output.
        pass_k: ``evaluate.pass_k``.
        warmup: the warmup stage's metrics (its held-out accuracy is where the curves start), or None.
        target_accuracy: ``report.target_accuracy`` (both columns), or None: the warmup's plus half of
            ``grpo``'s mean final gain (``trace.reporting.statistics.crossing_target``).

    Returns:
        ``{column: {"target": float (NaN without one), "warmup": float, "refusal": str or None}}``
        (``trace.reporting.statistics.target_refusal``; a report without ``grpo`` is refused).
    """
    out = {}
    for column, (_, curve_key) in ACCURACY_COLUMNS.items():
        start = _warmup_accuracy(warmup, column, pass_k)
        finals = [final_accuracy(r, curve_key) for r in results.get(BASELINE, {}).values()]
        target = crossing_target(start, finals, target_accuracy)
        if not math.isfinite(start) and target_accuracy is None:
            target = float("nan")
        # an arm that never evaluated has no curve (its seeds are censored), not a short one
        counts = [n for by_seed in results.values() for res in by_seed.values()
                  if (n := len(res["history"].get(curve_key) or []))]
        refusal = target_refusal(target, start, counts)
        if target_accuracy is None and BASELINE not in results:
            refusal = f"no {BASELINE} arm: no baseline gain to halve, and report.target_accuracy is not set"
        elif target_accuracy is None and not math.isfinite(start):
            refusal = "no warmup accuracy to start from, and report.target_accuracy is not set"
        out[column] = {"target": target, "warmup": start, "refusal": refusal}
    return out


def arm_statistics(results: dict, pass_k: int, confidence: float = CONFIDENCE,
                   warmup: Mapping[str, float] | None = None,
                   warmup_questions: Mapping[str, Mapping[str, float]] | None = None,
                   target_accuracy: float | None = None) -> dict:
    """Per arm: means and intervals over seeds, paired differences against ``grpo`` and gains over the warmup
    (greedy and avg@k), tokens to a target accuracy (on each in-training curve, censored seeds kept), and the
    audit means.

    Args:
        results: ``collect_results`` output, with ``"questions"`` / ``"sampled_questions"`` per seed where its
            evaluation kept per-question results (``trace.reporting.report_questions.attach_question_results``).
        pass_k: ``evaluate.pass_k`` (names the sampled-accuracy columns: ``eval mean@k`` is avg@k).
        confidence: interval coverage.
        warmup: the warmup stage's metrics (``accuracy/greedy``, ``accuracy/mean_at_<k>``), or None: no gains.
        warmup_questions: the warmup's per-question results (``attach_question_results``), or None.
        target_accuracy: ``report.target_accuracy``, or None (``crossing_targets``).

    Returns:
        ``{"targets": crossing_targets output, "arms": {ablation: {"seeds": [..], "columns": {column: Interval}, "vs_grpo":
        {column: Interval} (absent for grpo and without grpo; its ``eval greedy`` and ``eval mean@k`` a paired
        bootstrap over questions and seeds where every paired seed has per-question results, else like the
        other columns a paired t-interval over seeds), "vs_trace": the same against ``trace`` (absent for trace
        and without it), "vs_warmup": {"eval greedy", "eval mean@k": Interval}
        (the columns the warmup has; bootstrap as above), "crossings" / "crossings_sampled":
        ``TargetCrossings`` of the greedy / avg@k curves (None where the target is refused), "probe_gain": Interval
        over seeds of the last ``probe/gain`` (``train.probe_prompts``) or None, "audit": {key:
        Interval of per-step means} (``AUDIT_KEYS`` and ``TRUTH_KEYS``, only keys some seed logged), "audit_seeds":
        {key: {seed: per-step mean}}, "allocator_state" / "allocator_state_seeds": the same for ``ALLOCATOR_KEYS``
        (what greso, mopps and vip did a step, the exploration groups), "flips_vs_random": ``flips_ratio`` (None for ``tree_random``),
        "reliability": {"root", "prefix": rows} pooled over the audits and seeds
        (``trace.predictor.reliability``) or None, "pooled_ece_seeds": {stage: {seed: ECE of the seed's pooled
        diagram}}, "pooled_ece_interval": {stage: (low, high) of ``pooled_ece_interval``, seeds then their audits
        resampled} or None, "ece_noise": {stage: {"floor", "debiased", "debiased_interval"}} or None
        (``trace.predictor.reliability.arm_reliability``)}}}``.

    References:
        docs/method.md, "Statistics over seeds".
    """
    per_seed = {abl: {seed: column_values(res, pass_k) for seed, res in by_seed.items()}
                for abl, by_seed in results.items()}
    targets = crossing_targets(results, pass_k, warmup, target_accuracy)
    arms: dict = {}
    for abl, by_seed in per_seed.items():
        columns = {c: mean_interval([v[c] for v in by_seed.values()], confidence)
                   for c in next(iter(by_seed.values()))}
        entry = {"seeds": list(by_seed), "columns": columns}
        for ref in (BASELINE, METHOD):
            if ref in per_seed and abl != ref:
                entry[f"vs_{ref}"] = {c: paired_difference({s: v[c] for s, v in by_seed.items()},
                                                           {s: v[c] for s, v in per_seed[ref].items()}, confidence)
                                      for c, _ in PAIRED_COLUMNS}
                for column, (measure, _) in ACCURACY_COLUMNS.items():
                    boot = bootstrap_against(results[abl], results[ref], confidence, measure)
                    if boot is not None:  # evaluation noise of both arms included
                        entry[f"vs_{ref}"][column] = boot
        if warmup:
            gains = {c: _warmup_gain(results[abl], warmup, warmup_questions, c, pass_k, confidence)
                     for c in ACCURACY_COLUMNS}
            entry["vs_warmup"] = {c: iv for c, iv in gains.items() if iv is not None and iv.n}
        for column, suffix in (("eval greedy", ""), ("eval mean@k", "_sampled")):
            crossings = None
            if targets[column]["refusal"] is None:
                curves = {seed: accuracy_curve(res, "tokens/cumulative", ACCURACY_COLUMNS[column][1])
                          for seed, res in results[abl].items()}
                crossings = tokens_to_target_censored(curves, targets[column]["target"])
            entry["crossings" + suffix] = crossings
        probe = [final_accuracy(res, "probe/gain") for res in results[abl].values()]
        entry["probe_gain"] = mean_interval(probe, confidence) if any(math.isfinite(p) for p in probe) else None
        for name, keys in (("audit", AUDIT_KEYS + TRUTH_KEYS), ("allocator_state", ALLOCATOR_KEYS)):
            means, means_seeds = {}, {}
            for key in keys:  # the steps that logged the key (the audited ones for truth/*)
                by_seed = {seed: sum(v for _, v in pts) / len(pts) for seed, res in results[abl].items()
                           if (pts := res["history"].get(key))}
                if by_seed:
                    means[key], means_seeds[key] = mean_interval(list(by_seed.values()), confidence), by_seed
            entry[name], entry[f"{name}_seeds"] = means, means_seeds
        entry.update(arm_reliability({seed: res["history"] for seed, res in results[abl].items()}, confidence))
        arms[abl] = entry
    for abl, entry in arms.items():  # stage 2 against random anchors at the same budget, paired by seed
        entry["flips_vs_random"] = flips_ratio(entry, arms.get(RANDOM_ANCHORS), confidence) if abl != RANDOM_ANCHORS \
            else None
    return {"targets": targets, "arms": arms}


def flips_ratio(entry: dict, random_anchors: dict | None, confidence: float = CONFIDENCE) -> Interval | None:
    """An arm's stage-2 flips per step over ``tree_random``'s, per seed (both spend the same continuations a
    step, ``T - round(T / (1 + N))``, so it is the ratio of flips per continuation), and its t-interval over the
    seeds both ran; None without stage 2, without ``tree_random`` or without a common seed."""
    mine = entry["audit_seeds"].get("audit/flips", {})
    theirs = (random_anchors or {}).get("audit_seeds", {}).get("audit/flips", {})
    anchors = entry["audit_seeds"].get("audit/anchors", {})
    seeds = [s for s in mine if s in theirs and theirs[s] > 0 and anchors.get(s, 0) > 0]
    return mean_interval([mine[s] / theirs[s] for s in sorted(seeds)], confidence) if seeds else None


def regime_summary(results: dict, warmup: dict, num_eval: int | None, confidence: float = CONFIDENCE,
                   warmup_questions: Mapping[str, Mapping[str, float]] | None = None,
                   pass_k: int | None = None) -> dict:
    """The regime the arms were compared in: where warmup left the policy and how much ``grpo`` wasted and
    gained.

    Args:
        results: ``collect_results`` output.
        warmup: the warmup stage's metrics (``accuracy/greedy``, ``accuracy_train/greedy``), or ``{}``.
        num_eval: held-out questions behind ``accuracy/greedy`` (``evaluate.num_prompts``), or None.
        confidence: interval coverage.
        warmup_questions: the warmup's per-question results (``attach_question_results``), or None.
        pass_k: ``evaluate.pass_k``: also the avg@k regime (``warmup_sampled``, ``gain_sampled``); None: greedy only.

    Returns:
        Any of: ``warmup`` (held-out greedy accuracy), ``se`` (its binomial standard error
        ``sqrt(p (1 - p) / n)``), ``warmup_train`` (greedy accuracy on as many training questions),
        ``all_equal_first`` / ``all_equal`` (Interval over seeds of grpo's share of all-success or all-fail
        groups at its first step / averaged over its steps), ``gain`` (grpo's held-out greedy accuracy minus
        ``warmup``: a paired bootstrap over questions and seeds when grpo and warmup have per-question
        results, else the t-interval over seeds, which leaves out the warmup evaluation's own error),
        ``warmup_sampled`` and ``gain_sampled`` (the same for avg@k, with ``pass_k``), ``root_auc`` ({ablation: Interval over seeds of the per-step mean ``predictor/root_auc``}).
    """
    out: dict = {}
    base = warmup.get(GREEDY_ACCURACY)
    if base is not None:
        out["warmup"] = base
        if num_eval:
            out["se"] = math.sqrt(base * (1.0 - base) / num_eval)
    if (train := warmup.get(f"{TRAIN_ACCURACY_PREFIX}/greedy")) is not None:
        out["warmup_train"] = train
    grpo = results.get(BASELINE, {})
    mixed = [pts for res in grpo.values() if (pts := res["history"].get("mixed_group_ratio"))]
    if mixed:
        out["all_equal_first"] = mean_interval([1.0 - pts[0][1] for pts in mixed], confidence)
        out["all_equal"] = mean_interval([1.0 - sum(v for _, v in pts) / len(pts) for pts in mixed], confidence)
    gains = [res["eval"][GREEDY_ACCURACY] - base for res in grpo.values()
             if base is not None and GREEDY_ACCURACY in res.get("eval", {})]
    if gains:
        out["gain"] = bootstrap_gain(grpo, warmup_questions, confidence) or mean_interval(gains, confidence)
    if pass_k:
        name = sampled_accuracy_name(pass_k)
        base_sampled = warmup.get(name, warmup.get(metric_key(name)))
        if base_sampled is not None:
            out["warmup_sampled"] = base_sampled
            gain = _warmup_gain(grpo, warmup, warmup_questions, "eval mean@k", pass_k, confidence) if grpo else None
            if gain is not None and gain.n:
                out["gain_sampled"] = gain
    aucs = {abl: [sum(v for _, v in pts) / len(pts) for res in by_seed.values()
                  if (pts := res["history"].get("predictor/root_auc"))] for abl, by_seed in results.items()}
    out["root_auc"] = {abl: mean_interval(v, confidence) for abl, v in aucs.items() if v}
    return out
