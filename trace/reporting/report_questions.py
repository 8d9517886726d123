"""Per-question held-out results for the report: read from the evaluation outputs, checked against the MLflow
runs, and the paired bootstrap intervals over questions and seeds built from them.

Every policy (the warmup and each arm at each training seed) answers the same held-out questions, and its
evaluation output keeps each question's greedy reward by ``prompt_uid`` (``trace.training.evaluation.QUESTIONS_KEY``:
``data/eval/<ablation>/s<seed>.json`` and ``data/eval/warmup.json``). The report pairs them question by
question (``trace.reporting.statistics.paired_bootstrap``), so a difference carries the evaluations' own sampling error.

Invariant: a result's per-question rewards average exactly to the greedy accuracy its MLflow evaluate run (or
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
from trace.tracking.names import GREEDY_ACCURACY, QUESTIONS_KEY

_TOLERANCE = 1e-9  # per-question mean against the logged accuracy: the same floats, summed in another order


def read_question_results(path: Path, greedy_accuracy: float | None, rerun: str) -> dict[str, float] | None:
    """One evaluation's per-question greedy rewards, checked against its logged greedy accuracy.

    Args:
        path: the evaluation's JSON output (``data/eval/<ablation>/s<seed>.json``, ``data/eval/warmup.json``).
        greedy_accuracy: the ``accuracy/greedy`` the same evaluation logged (MLflow run, warmup metrics), or
            None to skip the check.
        rerun: the command that rewrites ``path``, named in errors (e.g. ``dvc repro evaluate@grpo-0``).

    Returns:
        ``{prompt_uid: reward}``, or None when the file is missing or has no per-question results (written
        before they existed).

    Raises:
        ValueError: the per-question results are not a non-empty mapping of finite numbers, or their mean
            differs from ``greedy_accuracy`` (the file and the run come from different evaluations).
    """
    if not path.is_file():
        return None
    raw = json.loads(path.read_text()).get(QUESTIONS_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in raw.values()):
        raise ValueError(f"{path}: {QUESTIONS_KEY!r} must map each held-out question id to its finite greedy "
                         f"reward; rewrite it with `{rerun}`")
    rewards = {str(k): float(v) for k, v in raw.items()}
    mean = float(np.mean(list(rewards.values())))
    if greedy_accuracy is not None and abs(mean - greedy_accuracy) > _TOLERANCE:
        raise ValueError(f"{path}: its {len(rewards)} per-question greedy rewards average {mean:.6f}, but the "
                         f"logged {GREEDY_ACCURACY} is {greedy_accuracy:.6f}: the file and the run come from "
                         f"different evaluations; rerun `{rerun}` (or `dvc repro`)")
    return rewards


def attach_question_results(results: dict, path_of: Callable[[str, int], Path],
                            warmup_path: Path | None = None, warmup: Mapping[str, float] | None = None
                            ) -> tuple[dict, dict[str, float] | None]:
    """Per-question results of every evaluated (arm, seed) of ``results`` and of the warmup policy.

    Args:
        results: ``trace.reporting.report.collect_results`` output (each evaluated seed's MLflow ``eval`` metrics).
        path_of: ``(ablation, seed) -> path`` of that evaluation's output (``flows.common.eval_path``).
        warmup_path: the warmup policy's held-out evaluation output, or None.
        warmup: the warmup stage's metrics (its ``accuracy/greedy`` is checked against ``warmup_path``).

    Returns:
        ``(results with "questions": {prompt_uid: reward} added where an output has them, warmup's
        {prompt_uid: reward} or None)``; ``results`` itself is left unchanged.

    Raises:
        ValueError: an output disagrees with its logged accuracy (``read_question_results``), or two outputs
            hold different questions.
    """
    out: dict = {}
    seen: dict[frozenset, str] = {}
    for abl, by_seed in results.items():
        out[abl] = {}
        for seed, res in by_seed.items():
            questions = None
            if "eval" in res:
                path = path_of(abl, seed)
                questions = read_question_results(path, res["eval"].get(GREEDY_ACCURACY),
                                                  f"dvc repro evaluate@{abl}-{seed}")
                if questions is not None:
                    seen.setdefault(frozenset(questions), str(path))
            out[abl][seed] = {**res, "questions": questions} if questions is not None else res
    warmup_questions = None
    if warmup_path is not None:
        warmup_questions = read_question_results(warmup_path, (warmup or {}).get(GREEDY_ACCURACY),
                                                 "dvc repro warmup")
        if warmup_questions is not None:
            seen.setdefault(frozenset(warmup_questions), str(warmup_path))
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


def bootstrap_against(arm: Mapping[int, dict], baseline: Mapping[int, dict], confidence: float) -> Interval | None:
    """Held-out greedy accuracy of ``arm`` minus ``baseline`` (another arm), paired by seed and question.

    Args:
        arm: ``{seed: result}`` of one arm (``attach_question_results`` output).
        baseline: ``{seed: result}`` of the baseline arm.
        confidence: interval coverage.

    Returns:
        ``paired_bootstrap`` over the seeds both evaluated, or None when one of those seeds lacks
        per-question results (or no seed is shared).
    """
    seeds = sorted(s for s in set(arm) & set(baseline) if "eval" in arm[s] and "eval" in baseline[s])
    if not seeds or any("questions" not in arm[s] or "questions" not in baseline[s] for s in seeds):
        return None
    ids = sorted(arm[seeds[0]]["questions"])
    return paired_bootstrap(_matrix([arm[s]["questions"] for s in seeds], ids),
                            _matrix([baseline[s]["questions"] for s in seeds], ids), confidence)


def bootstrap_gain(arm: Mapping[int, dict], warmup_questions: Mapping[str, float] | None,
                   confidence: float) -> Interval | None:
    """Held-out greedy accuracy of ``arm`` minus the one warmup evaluation, paired by question.

    Args:
        arm: ``{seed: result}`` of one arm (``attach_question_results`` output).
        warmup_questions: the warmup policy's ``{prompt_uid: reward}``, or None.
        confidence: interval coverage.

    Returns:
        ``paired_bootstrap`` over the arm's evaluated seeds and the questions, the warmup's answers resampled
        with them; None without warmup per-question results or when an evaluated seed lacks them.
    """
    seeds = sorted(s for s, res in arm.items() if "eval" in res)
    if warmup_questions is None or not seeds or any("questions" not in arm[s] for s in seeds):
        return None
    ids = sorted(warmup_questions)
    return paired_bootstrap(_matrix([arm[s]["questions"] for s in seeds], ids),
                            _matrix([warmup_questions], ids)[0], confidence)
