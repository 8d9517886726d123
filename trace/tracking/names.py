"""Metric and run names in MLflow: the one table of run-level result names, and how keys are written.

Run-level results are ``arm/*`` metrics (``SUMMARY_METRIC_NAMES``, ``arm_result_metrics``) whose first
``UI_COLUMN_CHARS`` characters differ, so truncated column headers still tell them apart. An evaluate run
logs the headline numbers (``HEADLINE_METRICS``: held-out accuracy, mean effective ratio) first: MLflow's
compare view plots a run's first metric by default.

A metric key with a character MLflow refuses is rewritten by ``metric_key`` (``accuracy/pass@4`` is logged
as ``accuracy/pass_at_4``). A run is named ``<stage>[-<ablation>]-s<seed>-<experiment>`` (``run_name``).
"""

from __future__ import annotations

import os
import re
from typing import Mapping

# Characters of a metric name that MLflow 3.17's runs table shows in a metric column: 100 px wide, of which
# 88 px hold the 12 px semibold header text; "summary/mean" fills them (measured in Chromium).
UI_COLUMN_CHARS = 12

# Trainer.summary() key -> MLflow name of the run-level metric.
SUMMARY_METRIC_NAMES: dict[str, str] = {
    "mean/effective_ratio": "arm/eff_ratio",
    "mean/effective_token_ratio": "arm/eff_tok_ratio",
    "mean/active_prompt_ratio": "arm/active_prompts",
    "mean/mixed_group_ratio": "arm/mixed_groups",
    "mean/reward/mean": "arm/reward",
    "mean/tokens/generated": "arm/tok_step",
    "mean/rollout/trajectories": "arm/traj_step",
    "mean/tools/calls": "arm/tools_step",
    "mean/time/step": "arm/sec_step",
    "mean/predictor/brier": "arm/brier",
    "mean/predictor/auc": "arm/auc",
    "last/accuracy_eval": "arm/last_eval_acc",
    "last/accuracy_eval_sampled": "arm/last_avgk",
    "tokens/cumulative": "arm/tokens",
    "train/steps": "arm/steps",
}
HELDOUT_ACCURACY = "arm/acc"  # evaluate stage: held-out greedy accuracy of the trained policy
TRAIN_ACCURACY_PREFIX = "accuracy_train"  # greedy accuracy on training questions (memorisation check)
GREEDY_ACCURACY = "accuracy/greedy"  # trace.training.evaluation metric whose value HELDOUT_ACCURACY carries
# key of an evaluation output's per-question greedy rewards ({prompt_uid: reward}, mean = GREEDY_ACCURACY)
QUESTIONS_KEY = "greedy_by_question"
# key of an evaluation output's per-question sampled success ({prompt_uid: mean reward of its k sampled rollouts},
# mean = the evaluation's ``accuracy/mean@k``, avg@k)
SAMPLED_QUESTIONS_KEY = "sampled_by_question"
# in-training held-out evaluation (Trainer): greedy accuracy, and avg@k over train.eval_samples sampled rollouts
EVAL_ACCURACY = "accuracy/eval"
EVAL_SAMPLED_ACCURACY = "accuracy/eval_sampled"
HEADLINE_METRICS = (HELDOUT_ACCURACY, "arm/eff_ratio")
SEED_TAG = "trace.seed"  # a run's seed (a train or evaluate run: the training seed of its arm)


def heldout_pass_name(pass_k: int) -> str:
    """MLflow name of the held-out pass@k of the trained policy, e.g. ``arm/pass_4`` (short enough to show
    whole: ``arm/pass_at_4`` and ``arm/pass_at_16`` would both read ``arm/pass_at_``)."""
    return f"arm/pass_{int(pass_k)}"


def pass_at_k_name(pass_k: int) -> str:
    """The evaluation's pass@k metric as evaluated, ``accuracy/pass@<k>`` (logged as ``metric_key`` of it,
    ``accuracy/pass_at_<k>``)."""
    return f"accuracy/pass@{int(pass_k)}"


def sampled_accuracy_name(pass_k: int) -> str:
    """The evaluation's avg@k (mean@k: the mean reward of k sampled rollouts per question, averaged over the
    questions) as evaluated, ``accuracy/mean@<k>`` (logged as ``accuracy/mean_at_<k>``)."""
    return f"accuracy/mean@{int(pass_k)}"


def summary_metrics(summary: Mapping[str, float]) -> dict[str, float]:
    """The training summary under its ``arm/*`` names, mean effective ratio first.

    Args:
        summary: ``Trainer.summary()`` (``mean/effective_ratio``, ``tokens/cumulative``, ...); values that are
            not numbers are left out. A key the table ``SUMMARY_METRIC_NAMES`` lacks keeps its name below
            ``arm/`` with ``/`` replaced by ``_``.

    Returns:
        ``{"arm/eff_ratio": ..., "arm/eff_tok_ratio": ..., ...}`` in the table's order.
    """
    numeric = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    ordered = [k for k in SUMMARY_METRIC_NAMES if k in numeric] + [k for k in numeric if k not in SUMMARY_METRIC_NAMES]
    return {SUMMARY_METRIC_NAMES.get(k) or "arm/" + k.replace("/", "_"): float(numeric[k]) for k in ordered}


def arm_result_metrics(eval_metrics: Mapping[str, float], train_summary: Mapping[str, float],
                       pass_k: int) -> dict[str, float]:
    """One arm's results for its evaluate run: held-out accuracy, then the training summary.

    Logged before the evaluate stage's own metrics, so the held-out accuracy is the run's first metric (the
    compare view colours its plot by it) and the mean effective ratio its second.

    Args:
        eval_metrics: ``trace.training.evaluation.evaluate_policy`` metrics (``accuracy/greedy``, ``accuracy/pass@k``).
        train_summary: ``Trainer.summary()`` of the arm (its ``summary.json``; other keys are ignored).
        pass_k: ``evaluate.pass_k``.

    Returns:
        ``{"arm/acc": ..., "arm/eff_ratio": ..., "arm/pass_<k>": ..., "arm/eff_tok_ratio": ..., ...}``.
    """
    out: dict[str, float] = {}
    if GREEDY_ACCURACY in eval_metrics:
        out[HELDOUT_ACCURACY] = float(eval_metrics[GREEDY_ACCURACY])
    summary = summary_metrics(train_summary)
    if "arm/eff_ratio" in summary:
        out["arm/eff_ratio"] = summary.pop("arm/eff_ratio")
    for key in (pass_at_k_name(pass_k), metric_key(pass_at_k_name(pass_k))):
        if key in eval_metrics:
            out[heldout_pass_name(pass_k)] = float(eval_metrics[key])
            break
    out.update(summary)
    return out


def _flatten(prefix: str, value, out: dict) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def flatten_params(params: Mapping) -> dict[str, str]:
    """Dotted-key view of a nested mapping, values as strings (MLflow caps a value at 6000 chars)."""
    flat: dict = {}
    _flatten("", params, flat)
    return {k: str(v)[:6000] for k, v in flat.items()}


def metric_key(name: str) -> str:
    """A key MLflow accepts: ``@`` becomes ``_at_``, any other character it refuses becomes ``_``."""
    return re.sub(r"[^0-9A-Za-z_\-. :/]", "_", name.replace("@", "_at_"))


def dvc_experiment_name(environ: Mapping[str, str] | None = None) -> str:
    """Name of the DVC experiment running this stage (``$DVC_EXP_NAME``, set by ``dvc exp run``), else ''."""
    return (os.environ if environ is None else environ).get("DVC_EXP_NAME", "")


def run_name(stage: str, ablation: str, seed: int | None, experiment: str) -> str:
    """``<stage>[-<ablation>][-s<seed>][-<experiment>]``, e.g. ``train-trace-s0-lr-sweep``.

    Args:
        stage: DVC stage name without ``@item``.
        ablation: the arm, '' for shared stages.
        seed: the run's ``seed`` param, None to leave it out.
        experiment: DVC experiment name or a params-hash prefix, '' to leave it out.
    """
    parts = [stage, ablation, "" if seed is None else f"s{seed}", experiment]
    return "-".join(p for p in parts if p)
