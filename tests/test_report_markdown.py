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
    "| rank | ablation | eval greedy | eval mean@2 | eval pass@2 | effective ratio | effective token ratio | "
    "active prompts | train reward | generated tokens | trajectories/step | s/step |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
ONE_SEED_TEXT = (
    "Seed 0 only: one seed, no interval (run more with `dvc exp run -S 'train.seeds=[0,1,2]'`).\n\n"
    "Ranked by mean held-out greedy accuracy after RL (ties: effective ratio). Training columns are means over "
    "steps;\nevery arm samples the same number of trajectories per step.\n\n" + HEADER +
    "| 1 | trace | 0.400 | nan | nan | 0.900 | nan | nan | nan | nan | nan | nan |\n"
    "| 2 | grpo | 0.400 | 0.350 | 0.500 | 0.600 | 0.550 | 0.300 | 0.500 | 12,345 | 16 | 0.25 |\n"
    "| 3 | tree_random | nan | nan | nan | nan | nan | nan | nan | nan | nan | nan |\n"
    "\n## Against grpo\n\n"
    "Paired differences (arm minus grpo at the same seed), mean and 95% t-interval; a difference is real only "
    "when its interval excludes 0.\n\n"
    "| ablation | Δ eval greedy | Δ eval mean@2 | Δ effective ratio | Δ effective token ratio | "
    "Δ generated tokens |\n|---|---:|---:|---:|---:|---:|\n"
    "| trace | +0.000 | nan | +0.300 | nan | nan |\n"
    "| tree_random | nan | nan | nan | nan | nan |\n\n"
    "- trace against grpo: held-out greedy accuracy +0.000 (one seed, no interval); held-out sampled accuracy "
    "nan (no value); effective ratio +0.300 (one seed, no interval); effective token ratio nan (no value); "
    "generated tokens nan (no value).\n"
    "- tree_random against grpo: held-out greedy accuracy nan (no value); held-out sampled accuracy nan "
    "(no value); effective ratio nan (no value); effective token ratio nan (no value); generated tokens nan "
    "(no value).\n"
    "\n## Sample efficiency\n\n"
    "Generated tokens to reach grpo's final in-training held-out greedy accuracy (0.400, mean over seeds of its last "
    "`accuracy/eval`): per seed the first crossing of accuracy against cumulative generated tokens, linearly "
    "interpolated; mean over the seeds that reach it.\n\n"
    "| ablation | tokens to 0.400 | seeds reaching |\n|---|---:|---:|\n"
    "| trace | 150 | 1/1 |\n| grpo | 200 | 1/1 |\n| tree_random | not reached | 0/1 |\n"
    "\n## Sample efficiency, avg@k\n\n"
    "Generated tokens to reach grpo's final in-training held-out avg@k (0.350, mean over seeds of its last "
    "`accuracy/eval_sampled`): per seed the first crossing of accuracy against cumulative generated tokens, "
    "linearly interpolated; mean over the seeds that reach it.\n\n"
    "| ablation | tokens to 0.350 | seeds reaching |\n|---|---:|---:|\n"
    "| trace | 175 | 1/1 |\n| grpo | 200 | 1/1 |\n| tree_random | not reached | 0/1 |\n\n")
# with the warmup's accuracies (greedy 0.300, avg@2 0.250): every evaluated arm's gain over it, grpo +0.100 in both
# (0.400 - 0.300, 0.350 - 0.250), trace +0.100 greedy and no avg@2 (its evaluation logged none); tree_random
# never evaluated, so it has no row
GAIN_TEXT = (
    "\n## Gain over warmup\n\n"
    "Held-out accuracy after RL minus the warmup policy's, mean and 95% interval: a paired bootstrap over the "
    "held-out questions and seeds where per-question results exist (the warmup's own evaluation error included), "
    "real only when it and the t-interval over seeds both exclude 0. Greedy: one rollout at temperature 0 "
    "(Search-R1's exact match); avg@2: the mean reward of 2 sampled rollouts per question (DeepScaleR's avg@k, "
    "verl's mean@k).\n\n"
    "| ablation | Δ greedy | Δ avg@2 |\n|---|---:|---:|\n"
    "| trace | +0.100 (one seed, no interval) | nan |\n"
    "| grpo | +0.100 (one seed, no interval) | +0.100 (one seed, no interval) |\n")


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
                            "audit/expected_flips": [(0, 1.0)], "audit/flips": [(0, 2.0)]})
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
    vs_grpo, efficiency = ONE_SEED_TEXT.split("\n## Sample efficiency\n")
    assert text == ("# Ablation report\n\nHeld-out greedy accuracy after warmup: **0.300**.\n"
                    "- grpo's gain in held-out greedy accuracy over warmup: +0.100 (one seed, no interval).\n"
                    "- Held-out avg@2 after warmup (mean reward of 2 sampled rollouts per question, DeepScaleR's / "
                    "verl's mean@k): **0.250**.\n"
                    "- grpo's gain in held-out avg@2 over warmup: +0.100 (one seed, no interval).\n\n"
                    + vs_grpo + GAIN_TEXT + "\n## Sample efficiency\n" + efficiency +
                    "Plots: `a.png`, `b.png`.\n\n"
                    "MLflow (`make ui`): [the arms' results](http://ui/runs) (every seed's evaluate run, grouped by "
                    "arm with the mean over seeds: `arm/acc`, `arm/eff_ratio`, ...), "
                    "[compare the arms](http://ui/compare).\n")


def test_without_a_warmup_baseline_or_links_the_report_starts_with_the_seeds():
    assert render_markdown(ONE_SEED, {}, 2, None) == "# Ablation report\n\n" + ONE_SEED_TEXT[:-1]


def test_the_regime_states_warmup_with_its_standard_error_grpos_waste_and_gain_in_standard_errors():
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
    assert "at its first step" in text and "+3.8 standard errors of the evaluation (not judged: this " \
           "t-interval over seeds leaves out the warmup evaluation's own error" in text


def test_three_seeds_show_intervals_and_call_only_intervals_that_exclude_zero_real():
    text = render_markdown(THREE_SEEDS, {}, 2)
    half = 4.302653 * 0.01 / math.sqrt(3)  # the accuracy differences' t-interval
    assert f"held-out greedy accuracy +0.110 [{0.11 - half:+.3f}, {0.11 + half:+.3f}] (real)" in text
    assert "effective ratio +0.000 [-0.248, +0.248] (within noise)" in text  # s = 0.1: 4.303 * 0.1 / sqrt(3)
    assert "| 1 | trace | 0.460 ± 0.099 |" in text
    assert "Seeds 0, 1, 2 (3 runs per arm)" in text and "one seed" not in text
    # grpo's final (not best) accuracies 0.4, 0.3, 0.35: target 0.35. trace crosses it at 175 (0.2 -> 0.4 over
    # 100..200), 225 (0.3 -> 0.5 over 200..300), and seed 2 never (0.3): mean 200 over 2 seeds
    stats = arm_statistics(THREE_SEEDS, 2)
    assert stats["target"].mean == pytest.approx(0.35)
    assert stats["arms"]["trace"]["tokens_to_target"].mean == pytest.approx(200.0)
    assert stats["arms"]["trace"]["reached"] == 2
    assert "| trace | 200 ± 318 | 2/3 |" in text  # 2 seeds: s = 35.36, t_{0.975,1} = 12.706: 12.706 * 35.36 / sqrt(2)
    # the audit: mean over steps then seeds; only trace logged it
    assert "## Allocation audit" in text
    assert "| trace | 5.00 ± 0.00 | 3.50 ± 0.00 | 1.00 ± 0.00 | 2.00 ± 0.00 |" in text


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
    assert table["trace"]["tokens_to_grpo_final"]["mean"] == pytest.approx(200.0)
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
