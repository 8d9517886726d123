"""reports/summary.md as a whole: the same results give the same bytes, ranked and formatted as documented;
the plots with their bands, the audit only when logged, and reports/metrics.json."""

import json
import math
from pathlib import Path

import pytest

from trace.reporting.report import TABLE_SUMMARY_KEYS, arm_statistics, regime_summary
from trace.reporting.report_markdown import render_markdown
from trace.reporting.report_json import metrics_table
from trace.reporting.report_plots import AUDIT_PLOT, PLOTS, PROBE_PLOT, measured_points, plot_band, write_plots
from trace.tracking.names import SUMMARY_METRIC_NAMES

# one seed: trace and grpo tie on held-out accuracy (0.400); trace ranks first on effective ratio (0.9 > 0.6);
# an arm without results ranks last with nan everywhere; 12345 generated tokens print with a thousands
# separator. grpo ends training at 0.40 held-out accuracy; trace passes 0.40 between 100 tokens (0.30) and
# 200 tokens (0.50), at 150; tree_random never evaluates. On the avg@k curve grpo ends at 0.35; trace passes 0.35
# between 100 tokens (0.20) and 200 tokens (0.40), at 100 + 100 * 0.15 / 0.20 = 175
ONE_SEED = {
    "grpo": {0: {"run_id": "r1", "experiment_id": "7", "eval_run_id": "e1",
                 "history": {"accuracy/eval": [(0, 0.2), (1, 0.4)], "accuracy/eval_sampled": [(0, 0.25), (1, 0.35)],
                             "tokens/cumulative": [(0, 100.0), (1, 200.0)]},
                 "summary": {"arm/eff_ratio": 0.6, "arm/eff_tok_ratio": 0.55, "arm/active_prompts": 0.3,
                             "arm/reward": 0.5, "arm/tokens": 12345.0, "arm/traj_step": 16.0, "arm/sec_step": 0.25},
                 "eval": {"accuracy/greedy": 0.4, "accuracy/mean_at_2": 0.35, "accuracy/pass_at_2": 0.5}}},
    "trace": {0: {"run_id": "r2", "experiment_id": "7",
                  "history": {"accuracy/eval": [(0, 0.3), (1, 0.5)], "accuracy/eval_sampled": [(0, 0.2), (1, 0.4)],
                              "tokens/cumulative": [(0, 100.0), (1, 200.0)]},
                  "summary": {"arm/eff_ratio": 0.9}, "eval": {"accuracy/greedy": 0.4}}},
    "tree_random": {0: {"run_id": "r3", "experiment_id": "7", "history": {}, "summary": {}}},
}
HEADER = (
    "| group | ablation | eval greedy | eval mean@2 | eval pass@2 | effective ratio | effective token ratio | "
    "active prompts | train reward | generated tokens | trajectories/step | s/step |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
# no interval anywhere: every arm is grouped with grpo (grpo first, then by name: no rank), every family is
# empty, and the curves of two evaluations are too short for a tokens-to-target crossing
RULE_TEXT = (
    "\n## The rule\n\n"
    "Paired differences (arm minus the other at the same seed), mean and 95% intervals: a t-interval over seeds, and "
    "where per-question results exist also a paired bootstrap over the held-out questions and seeds (percentile "
    "interval of 10,000 resamples). A difference is real only when every one of its intervals excludes 0; its "
    "p-value is the larger of theirs, and the interval that gave it is named (\"decided by\"). Families, each "
    "corrected by Holm's step-down at 5% (number of comparisons): primary: held-out avg@k minus grpo (0); greedy "
    "minus grpo (0); effective ratio minus grpo (0); generated tokens minus grpo (0); minus trace (0); gain over "
    "warmup (0). *Real after correction*: Holm's adjusted p below 0.05; *real before correction only*: every "
    "interval excludes 0 but not after correction.\n\n"
    "Primary comparisons against the margin delta = 0.02 (`report.margin`), read on the hull of their intervals at "
    "the family-wise level 1 - 0.05/m: *better by >= delta* (lower end >= delta), *worse* (upper end < 0), "
    "*equivalent within ±delta* (inside (-delta, +delta): two one-sided tests), *not worse (non-inferior)* (lower "
    "end > -delta), *not better by delta (non-superior)* (upper end < delta), else *undecided*.\n")
ONE_SEED_TEXT = (
    "Seed 0 only: one seed, no interval (run more with `dvc exp run -S 'train.seeds=[0,1,2]'`).\n\n"
    "Grouped by held-out greedy accuracy against grpo after Holm's correction (above, as, below grpo; no order "
    "within a group). Training columns are means over steps;\nevery arm samples the same number of trajectories "
    "per step.\n\n" + HEADER +
    "| as grpo | grpo | 0.400 | 0.350 | 0.500 | 0.600 | 0.550 | 0.300 | 0.500 | 12,345 | 16 | 0.25 |\n"
    "| as grpo | trace | 0.400 | nan | nan | 0.900 | nan | nan | nan | nan | nan | nan |\n"
    "| as grpo | tree_random | nan | nan | nan | nan | nan | nan | nan | nan | nan | nan |\n"
    + RULE_TEXT +
    "\n## Against grpo\n\n"
    "| ablation | Δ eval greedy | Δ eval mean@2 | Δ effective ratio | Δ effective token ratio | "
    "Δ generated tokens |\n|---|---:|---:|---:|---:|---:|\n"
    "| trace | +0.000 | nan | +0.300 | nan | nan |\n"
    "| tree_random | nan | nan | nan | nan | nan |\n\n"
    "- trace against grpo: held-out greedy accuracy +0.000 (one seed, no interval); held-out sampled accuracy "
    "no value; effective ratio +0.300 (one seed, no interval); effective token ratio no value; "
    "generated tokens no value.\n"
    "- tree_random against grpo: held-out greedy accuracy no value; held-out sampled accuracy no value; "
    "effective ratio no value; effective token ratio no value; generated tokens no value.\n")
EFFICIENCY_TEXT = (
    "\n## Sample efficiency\n\n"
    "Tokens to a target greedy accuracy (the warmup's 0.300 plus half of grpo's mean gain in final in-training "
    "greedy accuracy): not reported, a curve has 2 in-training evaluations, fewer than 3: too few to place a "
    "crossing (lower train.eval_every).\n"
    "\n## Sample efficiency, avg@2\n\n"
    "Tokens to a target avg@2 (the warmup's 0.250 plus half of grpo's mean gain in final in-training avg@2): not "
    "reported, a curve has 2 in-training evaluations, fewer than 3: too few to place a crossing (lower "
    "train.eval_every).\n\n")
# with the warmup's accuracies (greedy 0.300, avg@2 0.250): every evaluated arm's gain over it, grpo +0.100 in both
# (0.400 - 0.300, 0.350 - 0.250), trace +0.100 greedy and no avg@2 (its evaluation logged none); tree_random
# never evaluated, so it has no row
GAIN_TEXT = (
    "\n## Gain over warmup\n\n"
    "Held-out accuracy after RL minus the warmup policy's, mean and 95% intervals: a paired bootstrap over the "
    "held-out questions and seeds where per-question results exist (the warmup's own evaluation error included) "
    "and the t-interval over seeds, with the one that decided and the verdict after Holm's correction within the "
    "family of gains. Greedy: one rollout at temperature 0 "
    "(Search-R1's exact match); avg@2: the mean reward of 2 sampled rollouts per question (DeepScaleR's avg@k, "
    "verl's mean@k).\n\n"
    "| ablation | Δ greedy | Δ avg@2 |\n|---|---:|---:|\n"
    "| grpo | +0.100 (one seed, no interval) | +0.100 (one seed, no interval) |\n"
    "| trace | +0.100 (one seed, no interval) | nan |\n")


def _seeded(values: dict[str, list[float]], curves: list[list[float]] | None = None,
            audit: bool = False) -> dict:
    """An arm's runs at seeds 0, 1, 2 with the given held-out greedy accuracies and effective ratios."""
    out = {}
    for seed in range(3):
        history = {"tokens/cumulative": [(0, 100.0), (1, 200.0), (2, 300.0)],
                   "rollout/cumulative_trajectories": [(0, 16.0), (1, 32.0), (2, 48.0)],
                   "effective_ratio": [(0, 0.5), (1, 0.6), (2, 0.7)]}
        if curves:
            history["accuracy/eval"] = [(s, acc) for s, acc in enumerate(curves[seed])]
        if audit:
            history.update({"audit/expected_mixed_groups": [(0, 4.0), (1, 6.0)],
                            "audit/mixed_groups": [(0, 3.0), (1, 4.0)],
                            "audit/expected_flips": [(0, 1.0)], "audit/flips": [(0, 2.0)],
                            "audit/integrated_mixed_groups": [(0, 3.0), (1, 3.5)],
                            "truth/root_ece": [(1, 0.1 * (seed + 1))], "truth/root_auc": [(1, 0.7)],
                            "truth/rollouts": [(1, 96.0)]})
        out[seed] = {"run_id": f"r{seed}", "experiment_id": "7", "history": history,
                     "summary": {"arm/eff_ratio": values["eff"][seed]},
                     "eval": {"accuracy/greedy": values["acc"][seed]}}
    return out


# three seeds: trace - grpo = 0.10, 0.12, 0.11 in accuracy (mean 0.11, s = 0.01: real); effective ratio
# differences 0.1, -0.1, 0.0 (within noise)
THREE_SEEDS = {
    "grpo": _seeded({"acc": [0.40, 0.30, 0.35], "eff": [0.5, 0.6, 0.5]},
                    [[0.1, 0.2, 0.4], [0.1, 0.2, 0.3], [0.1, 0.4, 0.35]]),
    "trace": _seeded({"acc": [0.50, 0.42, 0.46], "eff": [0.6, 0.5, 0.5]},
                     [[0.2, 0.4, 0.5], [0.2, 0.3, 0.5], [0.1, 0.2, 0.3]], audit=True),
}


def test_summary_markdown_is_byte_for_byte_the_documented_report():
    links = {"runs": "http://ui/runs", "compare": "http://ui/compare"}
    text = render_markdown(ONE_SEED, {"accuracy/greedy": 0.3, "accuracy/mean@2": 0.25}, 2, links, ["a.png", "b.png"])
    assert text == ("# Ablation report\n\nHeld-out greedy accuracy after warmup: **0.300**.\n"
                    "- grpo's gain in held-out greedy accuracy over warmup: +0.100 (one seed, no interval).\n"
                    "- Held-out avg@2 after warmup (mean reward of 2 sampled rollouts per question, DeepScaleR's / "
                    "verl's mean@k): **0.250**.\n"
                    "- grpo's gain in held-out avg@2 over warmup: +0.100 (one seed, no interval).\n\n"
                    + ONE_SEED_TEXT + GAIN_TEXT + EFFICIENCY_TEXT +
                    "Plots: `a.png`, `b.png`.\n\n"
                    "MLflow (`make ui`): [the arms' results](http://ui/runs) (every seed's evaluate run, grouped by "
                    "arm with the mean over seeds: `arm/acc`, `arm/eff_ratio`, ...), "
                    "[compare the arms](http://ui/compare).\n")


def test_without_a_warmup_baseline_or_links_the_report_starts_with_the_seeds():
    refused = ("not reported, no warmup accuracy to start from, and report.target_accuracy is not set.\n")
    assert render_markdown(ONE_SEED, {}, 2, None) == (
        "# Ablation report\n\n" + ONE_SEED_TEXT + "\n## Sample efficiency\n\nTokens to a target greedy accuracy (the "
        "warmup's nan plus half of grpo's mean gain in final in-training greedy accuracy): " + refused +
        "\n## Sample efficiency, avg@2\n\nTokens to a target avg@2 (the warmup's nan plus half of grpo's mean gain in "
        "final in-training avg@2): " + refused)


def test_the_regime_states_warmup_with_its_standard_error_grpos_waste_and_gain():
    runs = {arm: {seed: {**res, "history": {**res["history"],
                                           "mixed_group_ratio": [(0, 0.5 + 0.1 * seed), (1, 0.9)],
                                           "predictor/root_auc": [(0, 0.7), (1, 0.8 + 0.01 * seed)]}}
                  for seed, res in by_seed.items()} for arm, by_seed in THREE_SEEDS.items()}
    warmup = {"accuracy/greedy": 0.2, "accuracy_train/greedy": 0.25}
    regime = regime_summary(runs, warmup, num_eval=100)
    assert regime["se"] == pytest.approx(0.04)  # sqrt(0.2 * 0.8 / 100)
    assert regime["all_equal_first"].mean == pytest.approx(0.4)  # 1 - mean(0.5, 0.6, 0.7)
    assert regime["all_equal"].mean == pytest.approx(1 - (0.7 + 0.75 + 0.8) / 3)
    assert regime["gain"].mean == pytest.approx(0.15)  # grpo 0.40, 0.30, 0.35 against 0.2
    assert regime["root_auc"]["trace"].mean == pytest.approx(0.755)
    text = render_markdown(runs, warmup, 2, num_eval=100)
    assert "Held-out greedy accuracy after warmup: **0.200** (standard error 0.040); on as many training " \
           "questions 0.250" in text
    # no per-question results: a t-interval over seeds against one warmup evaluation leaves out that
    # evaluation's own error, so the gain is not called real (tests/test_report_questions.py bootstraps it)
    # (a paired gain is not divided by the unpaired standard error of one evaluation)
    assert "at its first step" in text and "standard errors of the evaluation" not in text
    assert "(not judged: this t-interval over seeds leaves out the warmup evaluation's own error" in text


def test_three_seeds_show_intervals_and_call_only_intervals_that_exclude_zero_real():
    text = render_markdown(THREE_SEEDS, {"accuracy/greedy": 0.1}, 2)
    half = 4.302653 * 0.01 / math.sqrt(3)  # the accuracy differences' t-interval
    assert (f"held-out greedy accuracy +0.110, t over seeds [{0.11 - half:+.3f}, {0.11 + half:+.3f}]; decided by t "
            "over seeds, p 0.003, Holm 0.003 of 1 (real after correction)") in text  # t = 0.11 / (0.01 / sqrt 3) = 19.05
    assert "effective ratio +0.000, t over seeds [-0.248, +0.248]; decided by t over seeds, p 1.000" in text
    assert "| above grpo | trace | 0.460 ± 0.099 |" in text and "| as grpo | grpo |" in text
    assert "Seeds 0, 1, 2 (3 runs per arm)" in text and "one seed" not in text
    # target: warmup 0.1 + half of grpo's mean final gain ((0.4 + 0.3 + 0.35) / 3 - 0.1 = 0.25): 0.225. grpo
    # crosses it at 200 + 0.025 / 0.2 x 100 = 212.5, 200 + 0.025 / 0.1 x 100 = 225, 100 + 0.125 / 0.3 x 100 = 141.7;
    # trace at 112.5, 125, 225: medians 212.5 (printed 212, round half to even) and 125
    stats = arm_statistics(THREE_SEEDS, 2, warmup={"accuracy/greedy": 0.1})
    assert stats["targets"]["eval greedy"]["target"] == pytest.approx(0.225)
    assert stats["arms"]["trace"]["crossings"].reached == pytest.approx({0: 112.5, 1: 125.0, 2: 225.0})
    assert "| trace | 125 | 3/3 | s0: 112, s1: 125, s2: 225 |" in text
    # a declared target of 0.45: grpo never reaches it (censored at 300, not dropped); trace at 250 and 275, its
    # seed 2 censored: median of 250, 275, (above every crossing) = 275
    declared = render_markdown(THREE_SEEDS, {"accuracy/greedy": 0.1}, 2, target_accuracy=0.45)
    assert "| grpo | not reached by half the seeds | 0/3 | s0: > 300 (censored), s1: > 300 (censored), " \
           "s2: > 300 (censored) |" in declared
    assert "| trace | 275 | 2/3 | s0: 250, s1: 275, s2: > 300 (censored) |" in declared
    # the audit: mean over steps then seeds; only trace logged it
    assert "## Allocation audit" in text
    assert "| trace | 5.00 ± 0.00 | 3.25 ± 0.00 | 3.50 ± 0.00 | 1.00 ± 0.00 | nan | 2.00 ± 0.00 |" in text
    # the predictor against Monte-Carlo truth, where an arm logged it: ECE 0.1, 0.2, 0.3 over seeds
    assert "## Predictor" in text
    assert "| trace | root | 0.200 ± 0.248 | nan | nan | nan | 0.700 ± 0.000 | nan | nan |" in text
    assert "| trace | prefix | nan |" in text and "`trace` audit 96" in text


def test_the_seeds_line_names_an_arm_that_ran_other_seeds_instead_of_the_union():
    # grpo at seeds 0, 1, 2 and trace at seed 0 only: the union "0, 1, 2 (3 runs per arm)" would claim two trace
    # runs that never happened
    runs = {"grpo": THREE_SEEDS["grpo"], "trace": {0: THREE_SEEDS["trace"][0]}}
    text = render_markdown(runs, {}, 2)
    assert "Seeds 0, 1, 2 (3 runs per arm); trace: seed 0 only: a value is the mean over an arm's seeds" in text
    runs = {"grpo": THREE_SEEDS["grpo"], "trace": {s: THREE_SEEDS["trace"][s] for s in (1, 2)}}
    assert "Seeds 0, 1, 2 (3 runs per arm); trace: seeds 1, 2:" in render_markdown(runs, {}, 2)


def test_without_audit_keys_the_report_says_nothing_of_the_audit(tmp_path: Path):
    results = {"grpo": THREE_SEEDS["grpo"]}
    assert "audit" not in render_markdown(results, {}, 2).lower()
    (tmp_path / AUDIT_PLOT).write_bytes(b"stale")
    paths = write_plots(results, tmp_path)
    assert [p.name for p in paths] == list(PLOTS) and not (tmp_path / AUDIT_PLOT).exists()


def test_the_probe_plot_is_drawn_only_when_a_run_logged_the_probe(tmp_path: Path):
    import copy

    results = {"grpo": copy.deepcopy(THREE_SEEDS["grpo"])}
    (tmp_path / PROBE_PLOT[0]).write_bytes(b"stale")
    assert PROBE_PLOT[0] not in [p.name for p in write_plots(results, tmp_path)]
    assert not (tmp_path / PROBE_PLOT[0]).exists()
    for seed, res in results["grpo"].items():
        res["history"]["probe/gain"] = [(1, 0.01 * seed), (3, 0.02 + 0.01 * seed)]
    paths = write_plots(results, tmp_path)
    assert [p.name for p in paths] == [*PLOTS, PROBE_PLOT[0]]
    assert (tmp_path / PROBE_PLOT[0]).read_bytes()[:4] == b"\x89PNG"


def test_the_report_columns_are_named_by_the_tracking_table():
    assert [SUMMARY_METRIC_NAMES[k] for k in TABLE_SUMMARY_KEYS] == [
        "arm/eff_ratio", "arm/eff_tok_ratio", "arm/active_prompts", "arm/reward", "arm/tokens", "arm/traj_step",
        "arm/sec_step"]


def test_write_plots_writes_every_plot_with_bands_and_the_audit_when_logged(tmp_path: Path):
    paths = write_plots(THREE_SEEDS, tmp_path)
    assert [p.name for p in paths] == [*PLOTS, AUDIT_PLOT]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert "accuracy_vs_tokens.png" in PLOTS and "accuracy_vs_trajectories.png" in PLOTS
    one = write_plots({"grpo": {0: THREE_SEEDS["grpo"][0]}}, tmp_path)  # one seed: no band, still drawn
    assert all(p.stat().st_size > 1000 for p in one)


def test_metrics_table_keeps_each_seed_and_the_statistics_as_json():
    table = json.loads(json.dumps(metrics_table(THREE_SEEDS, 2)))  # strict JSON: no NaN
    assert table["trace"]["s1"]["eval/accuracy/greedy"] == 0.42
    assert table["trace"]["mean"]["eval greedy"]["n"] == 3
    assert table["trace"]["vs_grpo"]["eval greedy"]["real"] is True
    assert table["trace"]["vs_grpo"]["effective ratio"]["real"] is False
    assert "vs_grpo" not in table["grpo"] and table["grpo"]["mean"]["eval pass@k"]["mean"] is None
    # every arm is also paired against trace: grpo's difference from trace is trace's from grpo, negated
    assert "vs_trace" not in table["trace"]
    for column in ("effective ratio", "eval greedy"):
        assert table["grpo"]["vs_trace"][column]["mean"] == pytest.approx(-table["trace"]["vs_grpo"][column]["mean"])
    # no warmup: the target is refused, and the reason is kept
    assert table["trace"]["tokens_to_target"]["refused"].startswith("no warmup accuracy")
    judged = metrics_table(THREE_SEEDS, 2, warmup={"accuracy/greedy": 0.1}, target_accuracy=0.45)["trace"]
    assert judged["tokens_to_target"] == {"target": 0.45, "reached": {"s0": 250.0, "s1": 275.0},
                                          "censored": {"s2": 300.0}, "median": 275.0}
    greedy = judged["vs_grpo"]["eval greedy"]
    assert greedy["decided_by"] == "t" and greedy["family"] == "greedy minus grpo" and greedy["real_after_correction"]
    assert judged["group"] == "above grpo"
    one = metrics_table(ONE_SEED, 2)
    assert one["grpo"]["s0"]["arm/eff_ratio"] == 0.6 and one["tree_random"]["s0"] == {}
    assert one["trace"]["vs_grpo"]["eval greedy"]["low"] is None


def test_the_summary_states_each_arms_probe_gain_at_its_last_evaluation():
    # grpo's last probe/gain per seed 0.05, 0.07, 0.06 (earlier points ignored): mean 0.06, sd 0.01, t(2) 4.303,
    # half-width 4.303 * 0.01 / sqrt(3) = 0.0248: [+0.035, +0.085], real
    runs = {"grpo": _seeded({"acc": [0.4, 0.3, 0.35], "eff": [0.5, 0.6, 0.5]})}
    for seed, last in enumerate((0.05, 0.07, 0.06)):
        runs["grpo"][seed]["history"]["probe/gain"] = [(9, -0.5), (19, last)]
    text = render_markdown(runs, {}, 2)
    assert "## Probe" in text and "| grpo | +0.060 [+0.035, +0.085] | real |" in text
    assert "## Probe" not in render_markdown(THREE_SEEDS, {}, 2)  # no run probed


def test_measured_points_are_the_seeds_means_at_the_logged_steps_only():
    # grpo's accuracy at steps 0, 1, 2 for seeds 0-2: (0.1, 0.1, 0.1), (0.2, 0.2, 0.4), (0.4, 0.3, 0.35); the
    # tokens 100, 200, 300 at every seed
    points = measured_points(THREE_SEEDS["grpo"], "accuracy/eval", "tokens/cumulative")
    assert [step for step, _, _ in points] == [0, 1, 2]
    assert [x.mean for _, x, _ in points] == pytest.approx([100.0, 200.0, 300.0])
    assert [y.mean for _, _, y in points] == pytest.approx([0.1, 0.8 / 3, 0.35])
    # a seed that did not evaluate at step 1: that point is the mean over the two seeds that did
    runs = {seed: {**res, "history": {**res["history"],
                                       "accuracy/eval": [p for p in res["history"]["accuracy/eval"]
                                                         if seed != 2 or p[0] != 1]}}
            for seed, res in THREE_SEEDS["grpo"].items()}
    points = measured_points(runs, "accuracy/eval", "tokens/cumulative")
    assert points[1][2].mean == pytest.approx(0.2) and points[1][2].n == 2


def test_the_accuracy_plot_draws_one_marker_per_evaluation_and_no_interpolated_point(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    drawn = {}
    savefig = Figure.savefig

    def spy(self, *args, **kwargs):
        for ax in self.axes:  # a plain line, or an errorbar's data line (its container holds the label)
            drawn.update({line.get_label(): (list(line.get_xdata()), line.get_marker())
                          for line in ax.get_lines() if line.get_label() in THREE_SEEDS})
            drawn.update({c.get_label(): (list(c.lines[0].get_xdata()), c.lines[0].get_marker())
                          for c in ax.containers if c.get_label() in THREE_SEEDS and c.lines[0] is not None})
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    plot_band(THREE_SEEDS, "accuracy/eval", "held-out greedy accuracy", tmp_path / "a.png", x_key="tokens/cumulative")
    # three evaluations per seed: three points per arm, each with a marker, none between them
    assert drawn == {arm: ([100.0, 200.0, 300.0], "o") for arm in THREE_SEEDS}


def _token_run(seed_steps: list[int], mark_every: int, per_step: list[float]) -> dict:
    """An arm stopped by a token budget: per seed its steps and tokens a step, marks every ``mark_every`` tokens
    (the step that crosses a mark logs it and an evaluation)."""
    out = {}
    for seed, (steps, per_step) in enumerate(zip(seed_steps, per_step)):
        cumulative = [(s, per_step * (s + 1)) for s in range(steps)]
        marks = [(s, float(mark_every * (int(t // mark_every)))) for s, t in cumulative
                 if int(t // mark_every) > int((t - per_step) // mark_every)]
        out[seed] = {"run_id": f"r{seed}", "experiment_id": "7",
                     "history": {"tokens/cumulative": cumulative, "eval/token_mark": marks,
                                 "accuracy/eval": [(s, 0.5 + 0.01 * seed) for s, _ in marks],
                                 "tokens/prompt": [(s, 10.0) for s in range(steps)],
                                 "tokens/budget": [(s, 400.0) for s in range(steps)],
                                 "tokens/observation": [(s, 4.0) for s in range(steps)]},
                     "summary": {}, "eval": {"accuracy/greedy": 0.5}}
    return out


def test_an_equal_tokens_run_says_so_and_plots_its_evaluations_at_the_same_marks(tmp_path):
    # grpo spends 100 tokens a step, trace 80 at seed 0 and 100 at seed 1: all stop at the 400-token budget,
    # trace's seed 0 after more steps
    results = {"grpo": _token_run([4, 4], 200, [100.0, 100.0]), "trace": _token_run([5, 4], 200, [80.0, 100.0])}
    text = render_markdown(results, {}, 2)
    assert "Accounting: **equal tokens**" in text and "`train.token_budget` = 400" in text
    assert "Steps taken (mean over seeds): grpo 4.0, trace 4.5." in text
    assert "grpo 40 prompt, 16 observation, trace 45 prompt, 18 observation" in text
    # the seeds of trace reach the marks at other steps than grpo's; against the mark both arms have a point at
    # 200 and 400, each over its 2 seeds
    for arm in ("grpo", "trace"):
        points = measured_points(results[arm], "accuracy/eval", "eval/token_mark")
        assert [(x.mean, x.n, y.n) for _, x, y in points] == [(200.0, 2, 2), (400.0, 2, 2)]
    names = [p.name for p in write_plots(results, tmp_path, 2)]
    assert "accuracy_vs_token_marks.png" in names and "avgk_vs_token_marks.png" not in names
    assert "Accounting" not in render_markdown(THREE_SEEDS, {}, 2)  # equal steps: the table's line says it
    assert "Not at equal tokens" not in text
    # a seed capped by train.num_steps before the budget is named, and the claim is not made for every arm
    results["trace"][1] = _token_run([3], 200, [100.0])[0]
    capped = render_markdown(results, {}, 2)
    assert "every arm stopped" not in capped and "**Not at equal tokens**" in capped and "trace s1 (300)" in capped


def test_stage_two_flips_are_paired_with_random_anchors_seed_by_seed():
    def arm(flips: list[float]) -> dict:
        return {seed: {"run_id": f"r{seed}", "experiment_id": "7", "summary": {}, "eval": {"accuracy/greedy": 0.5},
                       "history": {"audit/flips": [(0, f), (1, f)], "audit/anchors": [(0, 60.0), (1, 60.0)],
                                   "truth/root_auc": [(1, 0.8)]}} for seed, f in enumerate(flips)}
    results = {"tree_random": arm([10.0, 8.0, 12.0]), "trace": arm([15.0, 14.0, 18.0])}
    text = render_markdown(results, {}, 2)
    # per seed 1.5, 1.75, 1.5: mean 1.583, t(2) half-width 4.303 * 0.1443 / sqrt(3) = 0.358
    assert "`trace` 1.58 [1.22, 1.94]" in text and "`tree_random` " not in text.split("Stage 2 against")[1][:200]


def test_the_allocators_state_is_summarised_per_arm_and_only_where_logged():
    def arm(skipped: list[float], key: str = "greso/skipped") -> dict:
        return {seed: {"run_id": f"r{seed}", "experiment_id": "7", "summary": {}, "eval": {"accuracy/greedy": 0.5},
                       "history": {key: [(0, s), (1, s + 2.0)]}} for seed, s in enumerate(skipped)}
    results = {"grpo": _seeded({"acc": [0.4, 0.3, 0.35], "eff": [0.5, 0.6, 0.5]}), "greso": arm([4.0, 6.0, 8.0]),
               "mopps": arm([0.25, 0.5, 0.75], "mopps/selected_seen")}
    text = render_markdown(results, {}, 2)
    section = text.split("## Allocator state")[1]
    # greso: per-seed means 5, 7, 9 -> 7 ± t(2) 4.3027 * 2 / sqrt(3) = 4.968; mopps: 1.25, 1.5, 1.75 -> 0.621
    assert "| greso | `greso/skipped` | candidates skipped a step | 7.000 ± 4.968 |" in section
    assert "| mopps | `mopps/selected_seen` | share of the chosen prompts seen before | 1.500 ± 0.621 |" in section
    assert "| grpo |" not in section
    assert "## Allocator state" not in render_markdown(THREE_SEEDS, {}, 2)
    stats = arm_statistics(results, 2)
    assert stats["arms"]["greso"]["allocator_state_seeds"]["greso/skipped"] == {0: 5.0, 1: 7.0, 2: 9.0}
    assert stats["arms"]["grpo"]["allocator_state"] == {}
    table = metrics_table(results, 2)
    assert table["greso"]["allocator_state_seeds"]["greso/skipped"] == {"s0": 5.0, "s1": 7.0, "s2": 9.0}
    assert table["greso"]["allocator_state"]["greso/skipped"]["mean"] == 7.0
    assert "allocator_state" not in table["grpo"]
