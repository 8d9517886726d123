"""Per-question held-out results: written by the evaluations, read back and checked by the report, and the
report's gain over warmup and differences against grpo bootstrapped over questions and seeds."""

import json
from pathlib import Path

import numpy as np
import pytest

from trace.reporting.report import arm_statistics, regime_summary
from trace.reporting.report_json import metrics_table
from trace.reporting.report_markdown import render_markdown
from trace.reporting.report_questions import attach_question_results, read_question_results
from trace.tracking.names import QUESTIONS_KEY

ROOT = Path(__file__).resolve().parents[1]
IDS = [f"kgqa/q{i:03d}" for i in range(200)]


def _warmup_row() -> np.ndarray:
    """The warmup policy on 200 held-out questions: questions 0..79 right (accuracy 0.400, SE 0.035)."""
    row = np.zeros(200)
    row[:80] = 1.0
    return row


def _rows(base: np.ndarray, fixed: int, broken: int) -> list[np.ndarray]:
    """Three seeds of a policy that, against ``base``, breaks questions 0..broken-1 and fixes questions
    80..80+fixed+s-1 at seed s: its gain is (fixed - broken + s) / 200."""
    out = []
    for seed in range(3):
        row = base.copy()
        row[:broken] = 0.0
        row[80:80 + fixed + seed] = 1.0
        out.append(row)
    return out


def _arm(rows: list[np.ndarray], questions: bool = True) -> dict:
    """``collect_results`` entries of one arm at seeds 0, 1, 2 (with per-question results)."""
    out = {}
    for seed, row in enumerate(rows):
        res = {"run_id": f"r{seed}", "experiment_id": "7", "history": {}, "summary": {"arm/eff_ratio": 0.5},
               "eval": {"accuracy/greedy": float(row.mean())}}
        if questions:
            res["questions"] = dict(zip(IDS, row.tolist()))
        out[seed] = res
    return out


def _gain_line(text: str) -> str:
    return next(line for line in text.splitlines() if "gain in held-out greedy accuracy over warmup" in line)


def test_a_gain_of_one_standard_error_over_one_warmup_evaluation_is_not_called_real():
    # the fresh-clone report's case: grpo's seeds gain 0.035, 0.040, 0.045 over a warmup at 0.400 on 200
    # questions. The t-interval over seeds, [+0.028, +0.052], ignores the warmup evaluation's own error
    # (SE sqrt(0.4 * 0.6 / 200) = 0.035); 35 questions change answer, and resampling them puts it back
    warmup = _warmup_row()
    results = {"grpo": _arm(_rows(warmup, fixed=20, broken=13))}
    text = render_markdown(results, {"accuracy/greedy": 0.4}, 2, num_eval=200,
                           warmup_questions={"questions": dict(zip(IDS, warmup.tolist()))})
    line = _gain_line(text)
    assert line.startswith("- grpo's gain in held-out greedy accuracy over warmup: +0.040 [-0.0")
    assert "+0.040 [-0.017, +0.097] (within noise; paired bootstrap over the held-out " \
           "questions and 3 seeds)." in line
    assert "real" not in line and "[+0.028, +0.052]" not in line


def test_a_clear_gain_over_warmup_stays_real_under_the_bootstrap():
    warmup = _warmup_row()
    results = {"grpo": _arm(_rows(warmup, fixed=40, broken=2))}  # gains 0.190, 0.195, 0.200
    regime = regime_summary(results, {"accuracy/greedy": 0.4}, 200,
                            warmup_questions={"questions": dict(zip(IDS, warmup.tolist()))})
    assert regime["gain"].estimator == "bootstrap" and regime["gain"].excludes_zero
    assert 0.1 < regime["gain"].low < 0.195 < regime["gain"].high < 0.3
    text = render_markdown(results, {"accuracy/greedy": 0.4}, 2, num_eval=200,
                           warmup_questions={"questions": dict(zip(IDS, warmup.tolist()))})
    assert "(real; paired bootstrap over the held-out questions and 3 seeds)." in _gain_line(text)


def test_an_arm_difference_within_question_noise_is_bootstrapped_and_not_called_real():
    # trace against grpo at each seed: +0.035, +0.040, +0.045 (the paired t-interval [+0.028, +0.052] calls it
    # real), but 35 of the 200 questions change answer between them
    grpo_rows = [_warmup_row() for _ in range(3)]
    results = {"grpo": _arm(grpo_rows), "trace": _arm(_rows(grpo_rows[0], fixed=20, broken=13))}
    diff = arm_statistics(results, 2)["arms"]["trace"]["vs_grpo"]
    assert diff["eval greedy"].estimator == "bootstrap" and not diff["eval greedy"].excludes_zero
    assert diff["eval greedy"].seed_interval.excludes_zero  # what the seed-only interval would have said
    assert diff["effective ratio"].estimator == "t"
    text = render_markdown(results, {}, 2)
    # both intervals shown; the bootstrap, which reaches 0, decides
    assert "- trace against grpo: held-out greedy accuracy +0.040, bootstrap [-0.0" in text
    assert "t over seeds [+0.028, +0.052]; decided by the bootstrap, p 0." in text
    assert "(within noise); held-out sampled accuracy" in text
    table = json.loads(json.dumps(metrics_table(results, 2)))
    greedy = table["trace"]["vs_grpo"]["eval greedy"]
    assert greedy["estimator"] == "bootstrap" and greedy["real"] is False
    assert greedy["seed_interval"]["low"] == pytest.approx(0.0276, abs=1e-4)


def test_without_per_question_results_the_differences_stay_t_intervals_over_seeds():
    grpo_rows = [_warmup_row() for _ in range(3)]
    results = {"grpo": _arm(grpo_rows, questions=False),
               "trace": _arm(_rows(grpo_rows[0], fixed=20, broken=13), questions=False)}
    diff = arm_statistics(results, 2)["arms"]["trace"]["vs_grpo"]["eval greedy"]
    assert diff.estimator == "t" and diff.excludes_zero
    text = render_markdown(results, {}, 2)
    assert "held-out greedy accuracy +0.040, t over seeds [+0.028, +0.052]; decided by t over seeds" in text
    assert "bootstrap [" not in text


def _write_eval(path: Path, rows: dict, **metrics) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**metrics, QUESTIONS_KEY: rows}))


def test_the_report_reads_each_evaluations_questions_and_checks_them_against_its_logged_accuracy(tmp_path):
    results = {"grpo": {0: {"run_id": "r0", "history": {}, "summary": {}, "eval": {"accuracy/greedy": 0.5}},
                        1: {"run_id": "r1", "history": {}, "summary": {}}}}  # seed 1 was never evaluated
    _write_eval(tmp_path / "grpo" / "s0.json", {"a": 1.0, "b": 0.0})
    _write_eval(tmp_path / "warmup.json", {"a": 0.0, "b": 0.0}, **{"accuracy/greedy": 0.0})
    path_of = lambda abl, seed: tmp_path / abl / f"s{seed}.json"  # noqa: E731
    attached, warmup = attach_question_results(results, path_of, tmp_path / "warmup.json", {"accuracy/greedy": 0.0})
    assert attached["grpo"][0]["questions"] == {"a": 1.0, "b": 0.0} and "questions" not in attached["grpo"][1]
    assert warmup == {"questions": {"a": 0.0, "b": 0.0}} and "questions" not in results["grpo"][0]  # the input is kept
    assert read_question_results(tmp_path / "missing.json", 0.5, "x") is None  # written before: no results
    (tmp_path / "old.json").write_text(json.dumps({"accuracy/greedy": 0.5}))
    assert read_question_results(tmp_path / "old.json", 0.5, "x") is None

    with pytest.raises(ValueError, match=r"s0.json: its 2 per-question greedy rewards average 0.500000, but the "
                                         r"logged accuracy/greedy is 0.600000.*rerun `dvc repro evaluate@grpo-0`"):
        attach_question_results({"grpo": {0: {**results["grpo"][0], "eval": {"accuracy/greedy": 0.6}}}}, path_of)
    _write_eval(tmp_path / "warmup.json", {"a": 0.0, "c": 0.0})
    with pytest.raises(ValueError, match="hold different held-out questions"):
        attach_question_results(results, path_of, tmp_path / "warmup.json", {})
    _write_eval(tmp_path / "grpo" / "s0.json", {"a": "yes"})
    with pytest.raises(ValueError, match="must map each held-out question id to its finite greedy reward"):
        attach_question_results(results, path_of)


def _tiny_evaluation(pass_k: int):
    """An untrained tiny policy evaluated on 4 held-out prompts: (prompts, metrics, trees)."""
    from trace.envs.registry import make_environment
    from trace.training.evaluation import evaluate_policy
    from trace.configuration.params_file import load_config
    from trace.policy.model import build_tiny_policy

    cfg = load_config(ROOT / "tests" / "params_tiny.yaml")
    env = make_environment(cfg.task, cfg.seed)
    policy = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
    prompts = env.prompts("eval")[:4]
    metrics, trees = evaluate_policy(policy, env, prompts, cfg.rollout, seed=0,
                                     max_context_tokens=cfg.policy.max_context_tokens, pass_k=pass_k)
    return prompts, metrics, trees


def test_an_evaluation_keeps_each_questions_greedy_reward_by_prompt_uid():
    from trace.training.evaluation import question_rewards

    prompts, metrics, trees = _tiny_evaluation(pass_k=2)
    by_question = question_rewards(trees[: len(prompts)])
    assert list(by_question) == [p.prompt_uid for p in prompts]
    assert np.mean(list(by_question.values())) == metrics["accuracy/greedy"]
    with pytest.raises(ValueError, match="leaves: pass the greedy trees"):
        question_rewards(trees[len(prompts):])  # the sampled trees have pass_k leaves each


def test_the_warmup_stage_declares_its_per_question_evaluation_as_a_cached_output():
    """dvc.yaml names the file flows/warmup.py writes, and keeps it cached: an uncached plain output would keep
    the warmup stage out of DVC's run-cache."""
    import yaml

    from flows.common import REPO_ROOT
    from flows.warmup import WARMUP_EVAL

    outs = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["warmup"]["outs"]
    assert WARMUP_EVAL.relative_to(REPO_ROOT).as_posix() in outs  # a plain entry: cached


def test_avg_at_k_is_paired_question_by_question_against_the_warmup_and_grpo(tmp_path):
    """Questions x samples x seeds, worked by hand: k = 2 samples per question, 3 questions, 2 seeds.

    Sampled successes (mean of the 2 samples' rewards): warmup [0.5, 0.5, 0.0]; grpo seed 0 [0.5, 0.5, 0.5],
    seed 1 [0.5, 1.0, 0.0]; trace seed 0 [1.0, 0.5, 0.0], seed 1 [1.0, 1.0, 0.5]. grpo minus warmup: seed 0
    [0, 0, 0.5] (1/6), seed 1 [0, 0.5, 0] (1/6): gain 1/6. trace minus warmup: seed 0 [0.5, 0, 0] (1/6), seed 1
    [0.5, 0.5, 0.5] (1/2): gain 1/3. trace minus grpo: seed 0 [0.5, 0, -0.5] (0), seed 1 [0.5, 0, 0.5] (1/3): 1/6.
    Every bootstrap mean lies between the smallest and largest cell difference."""
    from trace.tracking.names import SAMPLED_QUESTIONS_KEY

    ids = ["q0", "q1", "q2"]
    rows = {"warmup": [0.5, 0.5, 0.0], ("grpo", 0): [0.5, 0.5, 0.5], ("grpo", 1): [0.5, 1.0, 0.0],
            ("trace", 0): [1.0, 0.5, 0.0], ("trace", 1): [1.0, 1.0, 0.5]}
    greedy = {"q0": 1.0, "q1": 0.0, "q2": 0.0}

    def write(path: Path, sampled: list[float]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"accuracy/greedy": 1 / 3, "accuracy/mean@2": float(np.mean(sampled)),
                                    QUESTIONS_KEY: greedy, SAMPLED_QUESTIONS_KEY: dict(zip(ids, sampled))}))

    results: dict = {}
    for (arm, seed), sampled in ((k, v) for k, v in rows.items() if k != "warmup"):
        write(tmp_path / arm / f"s{seed}.json", sampled)
        results.setdefault(arm, {})[seed] = {
            "run_id": f"{arm}{seed}", "history": {}, "summary": {},
            "eval": {"accuracy/greedy": 1 / 3, "accuracy/mean_at_2": float(np.mean(sampled))}}
    write(tmp_path / "warmup.json", rows["warmup"])
    warmup = {"accuracy/greedy": 1 / 3, "accuracy/mean@2": 1 / 3}
    attached, warmup_questions = attach_question_results(
        results, lambda abl, seed: tmp_path / abl / f"s{seed}.json", tmp_path / "warmup.json", warmup, pass_k=2)
    assert attached["trace"][1]["sampled_questions"] == {"q0": 1.0, "q1": 1.0, "q2": 0.5}
    assert warmup_questions["sampled_questions"] == {"q0": 0.5, "q1": 0.5, "q2": 0.0}

    arms = arm_statistics(attached, 2, warmup=warmup, warmup_questions=warmup_questions)["arms"]
    for arm, gain, seeds in (("grpo", 1 / 6, [1 / 6, 1 / 6]), ("trace", 1 / 3, [1 / 6, 1 / 2])):
        iv = arms[arm]["vs_warmup"]["eval mean@k"]
        assert iv.estimator == "bootstrap" and iv.n == 2 and iv.mean == pytest.approx(gain)
        assert iv.seed_interval.mean == pytest.approx(np.mean(seeds))
        assert -0.5 <= iv.low <= iv.mean <= iv.high <= 0.5
        assert arms[arm]["vs_warmup"]["eval greedy"].mean == pytest.approx(0.0)  # same greedy answers
    diff = arms["trace"]["vs_grpo"]["eval mean@k"]
    assert diff.estimator == "bootstrap" and diff.mean == pytest.approx(1 / 6)
    assert diff.seed_interval.mean == pytest.approx(1 / 6) and -0.5 <= diff.low <= diff.high <= 0.5
    regime = regime_summary(attached, warmup, 3, warmup_questions=warmup_questions, pass_k=2)
    assert regime["warmup_sampled"] == pytest.approx(1 / 3)
    assert regime["gain_sampled"].mean == pytest.approx(1 / 6) and regime["gain_sampled"].estimator == "bootstrap"
    table = metrics_table(attached, 2, warmup=warmup, warmup_questions=warmup_questions)
    assert table["trace"]["vs_warmup"]["eval mean@k"]["mean"] == pytest.approx(1 / 3)

    # a file whose sampled successes do not average to the logged mean@2 is refused, naming the key
    write(tmp_path / "trace" / "s1.json", [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"s1.json: its 3 per-question sampled successes \('sampled_by_question'\) "
                                         r"average 0.000000, but the logged accuracy/mean@2 is 0.833333"):
        attach_question_results(results, lambda abl, seed: tmp_path / abl / f"s{seed}.json", pass_k=2)


def test_an_evaluation_keeps_each_questions_sampled_success_and_it_reads_back(tmp_path):
    """The record the evaluate stage writes (``sampled_by_question``) averages to its mean@k, and the report
    reads the same values back."""
    from flows.common import write_json
    from trace.training.evaluation import sampled_question_rewards
    from trace.tracking.names import SAMPLED_QUESTIONS_KEY

    prompts, metrics, trees = _tiny_evaluation(pass_k=3)
    sampled = sampled_question_rewards(trees[len(prompts):])
    assert list(sampled) == [p.prompt_uid for p in prompts]
    assert all(v in (0.0, 1 / 3, 2 / 3, 1.0) for v in sampled.values())
    assert np.mean(list(sampled.values())) == pytest.approx(metrics["accuracy/mean@3"], abs=1e-12)
    write_json(tmp_path / "s0.json", {**metrics, SAMPLED_QUESTIONS_KEY: sampled})
    back = read_question_results(tmp_path / "s0.json", metrics["accuracy/mean@3"], "x", SAMPLED_QUESTIONS_KEY,
                                 "accuracy/mean@3")
    assert back == sampled
    with pytest.raises(ValueError, match="every question needs the same k samples"):
        sampled_question_rewards([trees[0], *trees[len(prompts) + 1:]])  # a greedy tree has 1 leaf, the others 3
