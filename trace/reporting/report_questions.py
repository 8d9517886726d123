"""Per-question held-out results for the report: read from the evaluation outputs, checked against the MLflow
runs, and the paired bootstrap intervals over questions and seeds built from them.

Every policy (the warmup and each arm at each training seed) answers the same held-out questions, and its
evaluation output keeps, by ``prompt_uid``, each question's greedy reward (``trace.tracking.names.QUESTIONS_KEY``)
and its sampled success, the mean reward of its k sampled rollouts (``SAMPLED_QUESTIONS_KEY``), in
``data/eval/<ablation>/s<seed>.json`` and ``data/eval/warmup.json``. These are the two measures (``MEASURES``):
``greedy`` (mean: greedy accuracy) and ``sampled`` (mean: avg@k). The report pairs them question by question
(``trace.reporting.statistics.paired_bootstrap``), so a difference carries the evaluations' own sampling error:
for avg@k, the k samples' noise sits in each question's value and is resampled with the question.

Invariant: a result's per-question values average exactly to the accuracy its MLflow evaluate run (or
``metrics/warmup.json``) logged, and all of them hold the same questions; a file that disagrees is an error,
not a silently different number. Outputs written before per-question results existed have none: the report
then falls back to intervals over seeds and says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from trace.reporting.statistics import Interval, paired_bootstrap
from trace.tracking.names import GREEDY_ACCURACY, QUESTIONS_KEY, SAMPLED_QUESTIONS_KEY, metric_key, \
    sampled_accuracy_name

_TOLERANCE = 1e-9  # per-question mean against the logged accuracy: the same floats, summed in another order
# measure -> key of a seed's result ("questions": greedy, "sampled_questions": avg@k) that holds its per-question values
MEASURES = {"greedy": "questions", "sampled": "sampled_questions"}


def measure_source(measure: str, pass_k: int | None) -> tuple[str, str]:
    """``(key in the evaluation output, accuracy metric it averages to)`` of a measure.

    Args:
        measure: ``greedy`` or ``sampled`` (``MEASURES``).
        pass_k: ``evaluate.pass_k``, for ``sampled`` (its metric is ``accuracy/mean@<k>``).

    Raises:
        ValueError: an unknown measure, or ``sampled`` without ``pass_k``.
    """
    if measure == "greedy":
        return QUESTIONS_KEY, GREEDY_ACCURACY
    if measure == "sampled" and pass_k:
        return SAMPLED_QUESTIONS_KEY, sampled_accuracy_name(pass_k)
    raise ValueError(f"measure must be one of {sorted(MEASURES)} (sampled with pass_k >= 1), got {measure!r} "
                     f"with pass_k={pass_k}")


def read_question_results(path: Path, greedy_accuracy: float | None, rerun: str, key: str = QUESTIONS_KEY,
                          metric: str = GREEDY_ACCURACY) -> dict[str, float] | None:
    """One evaluation's per-question results of one measure, checked against the accuracy it logged.

    Args:
        path: the evaluation's JSON output (``data/eval/<ablation>/s<seed>.json``, ``data/eval/warmup.json``).
        greedy_accuracy: the accuracy the same evaluation logged for this measure (MLflow run, warmup
            metrics: ``metric``), or None to skip the check.
        rerun: the command that rewrites ``path``, named in errors (e.g. ``dvc repro evaluate@grpo-0``).
        key: the output's key of the per-question values (``QUESTIONS_KEY`` greedy, ``SAMPLED_QUESTIONS_KEY``
            avg@k; ``measure_source``).
        metric: the accuracy they average to, named in errors.

    Returns:
        ``{prompt_uid: value}``, or None when the file is missing or has no per-question results of this
        measure (written before they existed).

    Raises:
        ValueError: the per-question results are not a non-empty mapping of finite numbers, or their mean
            differs from the logged accuracy (the file and the run come from different evaluations).
    """
    if not path.is_file():
        return None
    raw = json.loads(path.read_text()).get(key)
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in raw.values()):
        raise ValueError(f"{path}: {key!r} must map each held-out question id to its finite "
                         f"{'greedy reward' if key == QUESTIONS_KEY else 'sampled success'}; rewrite it with `{rerun}`")
    rewards = {str(k): float(v) for k, v in raw.items()}
    mean = float(np.mean(list(rewards.values())))
    what = "greedy rewards" if key == QUESTIONS_KEY else f"sampled successes ({key!r})"
    if greedy_accuracy is not None and abs(mean - greedy_accuracy) > _TOLERANCE:
        raise ValueError(f"{path}: its {len(rewards)} per-question {what} average {mean:.6f}, but the "
                         f"logged {metric} is {greedy_accuracy:.6f}: the file and the run come from "
                         f"different evaluations; rerun `{rerun}` (or `dvc repro`)")
    return rewards


def attach_question_results(results: dict, path_of: Callable[[str, int], Path],
                            warmup_path: Path | None = None, warmup: Mapping[str, float] | None = None,
                            pass_k: int | None = None) -> tuple[dict, dict[str, dict[str, float]] | None]:
    """Per-question results of every evaluated (arm, seed) of ``results`` and of the warmup policy, for each
    measure: greedy, and avg@k (``sampled``) when ``pass_k`` is given.

    Args:
        results: ``trace.reporting.report.collect_results`` output (each evaluated seed's MLflow ``eval`` metrics).
        path_of: ``(ablation, seed) -> path`` of that evaluation's output (``flows.common.eval_path``).
        warmup_path: the warmup policy's held-out evaluation output, or None.
        warmup: the warmup stage's metrics (its ``accuracy/greedy`` and ``accuracy/mean@k`` are checked
            against ``warmup_path``).
        pass_k: ``evaluate.pass_k``: also read the sampled successes (checked against ``accuracy/mean@<k>``);
            None reads greedy results only.

    Returns:
        ``(results with "questions": {prompt_uid: greedy reward} and "sampled_questions": {prompt_uid: sampled
        success} added where an output has them, the warmup's {"questions": ..., "sampled_questions": ...}
        (the keys it has) or None)``; ``results`` itself is left unchanged.

    Raises:
        ValueError: an output disagrees with its logged accuracy (``read_question_results``), or two outputs
            hold different questions.
    """
    measures = {m: measure_source(m, pass_k) for m in (("greedy", "sampled") if pass_k else ("greedy",))}
    out: dict = {}
    seen: dict[frozenset, str] = {}

    def read(path: Path, logged: Mapping[str, float], rerun: str) -> dict[str, dict[str, float]]:
        found = {}
        for measure, (key, metric) in measures.items():
            logged_value = logged.get(metric, logged.get(metric_key(metric)))
            values = read_question_results(path, logged_value, rerun, key, metric)
            if values is not None:
                seen.setdefault(frozenset(values), str(path))
                found[MEASURES[measure]] = values
        return found

    for abl, by_seed in results.items():
        out[abl] = {}
        for seed, res in by_seed.items():
            found = read(path_of(abl, seed), res["eval"], f"dvc repro evaluate@{abl}-{seed}") if "eval" in res else {}
            out[abl][seed] = {**res, **found}
    warmup_questions = None
    if warmup_path is not None:
        warmup_questions = read(warmup_path, warmup or {}, "dvc repro warmup") or None
    if len(seen) > 1:
        (ids_a, path_a), (ids_b, path_b) = list(seen.items())[:2]
        raise ValueError(f"{path_a} and {path_b} hold different held-out questions ({len(ids_a ^ ids_b)} in one "
                         "only): every evaluation must answer the same evaluate.num_prompts questions; rerun "
                         "`dvc repro` so all of them are evaluated with the current params")
    return out, warmup_questions


def _matrix(per_seed: list[Mapping[str, float]], ids: list[str]) -> np.ndarray:
    """(S, Q) rewards of the seeds' per-question results, columns in ``ids`` order."""
    for questions in per_seed:
        if set(questions) != set(ids):
            raise ValueError("per-question results hold different questions: build them with "
                             "attach_question_results, which checks them")
    return np.array([[questions[q] for q in ids] for questions in per_seed], dtype=np.float64)


def bootstrap_against(arm: Mapping[int, dict], baseline: Mapping[int, dict], confidence: float,
                      measure: str = "greedy") -> Interval | None:
    """Held-out accuracy (``measure``: greedy or avg@k) of ``arm`` minus ``baseline`` (another arm), paired by
    seed and question.

    Args:
        arm: ``{seed: result}`` of one arm (``attach_question_results`` output).
        baseline: ``{seed: result}`` of the baseline arm.
        confidence: interval coverage.
        measure: ``greedy`` or ``sampled`` (``MEASURES``).

    Returns:
        ``paired_bootstrap`` over the seeds both evaluated, or None when one of those seeds lacks
        per-question results of the measure (or no seed is shared).
    """
    key = MEASURES[measure]
    seeds = sorted(s for s in set(arm) & set(baseline) if "eval" in arm[s] and "eval" in baseline[s])
    if not seeds or any(key not in arm[s] or key not in baseline[s] for s in seeds):
        return None
    ids = sorted(arm[seeds[0]][key])
    return paired_bootstrap(_matrix([arm[s][key] for s in seeds], ids),
                            _matrix([baseline[s][key] for s in seeds], ids), confidence)


def bootstrap_gain(arm: Mapping[int, dict], warmup_questions: Mapping[str, Mapping[str, float]] | None,
                   confidence: float, measure: str = "greedy") -> Interval | None:
    """Held-out accuracy (``measure``: greedy or avg@k) of ``arm`` minus the one warmup evaluation, paired by
    question.

    Args:
        arm: ``{seed: result}`` of one arm (``attach_question_results`` output).
        warmup_questions: the warmup's per-question results (``attach_question_results``' second value:
            ``{"questions": {prompt_uid: reward}, "sampled_questions": {...}}``), or None.
        confidence: interval coverage.
        measure: ``greedy`` or ``sampled`` (``MEASURES``).

    Returns:
        ``paired_bootstrap`` over the arm's evaluated seeds and the questions, the warmup's answers resampled
        with them; None without warmup per-question results of the measure or when an evaluated seed lacks
        them.
    """
    key = MEASURES[measure]
    seeds = sorted(s for s, res in arm.items() if "eval" in res)
    base = (warmup_questions or {}).get(key)
    if base is None or not seeds or any(key not in arm[s] for s in seeds):
        return None
    ids = sorted(base)
    return paired_bootstrap(_matrix([arm[s][key] for s in seeds], ids), _matrix([base], ids)[0], confidence)
