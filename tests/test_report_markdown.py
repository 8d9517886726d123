"""reports/summary.md as a whole: the same results give the same bytes, ranked and formatted as documented."""

from pathlib import Path

from trace.report import PLOTS, TABLE_SUMMARY_KEYS, metrics_table, render_markdown, write_plots
from trace.tracking.names import SUMMARY_METRIC_NAMES

# trace and grpo tie on held-out accuracy (0.400); trace ranks first on effective ratio (0.9 > 0.6); an arm
# without results ranks last with nan everywhere; 12345 generated tokens print with a thousands separator
RESULTS = {
    "grpo": {"run_id": "r1", "experiment_id": "7", "eval_run_id": "e1", "history": {},
             "summary": {"arm/eff_ratio": 0.6, "arm/eff_tok_ratio": 0.55, "arm/active_prompts": 0.3,
                         "arm/reward": 0.5, "arm/tokens": 12345.0, "arm/traj_step": 16.0, "arm/sec_step": 0.25},
             "eval": {"accuracy/greedy": 0.4, "accuracy/pass_at_2": 0.5}},
    "trace": {"run_id": "r2", "experiment_id": "7", "history": {}, "summary": {"arm/eff_ratio": 0.9},
              "eval": {"accuracy/greedy": 0.4}},
    "tree_random": {"run_id": "r3", "experiment_id": "7", "history": {}, "summary": {}},
}
TABLE = (
    "| rank | ablation | eval greedy | eval pass@2 | effective ratio | effective token ratio | active prompts | "
    "train reward | generated tokens | trajectories/step | s/step |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    "| 1 | trace | 0.400 | nan | 0.900 | nan | nan | nan | nan | nan | nan |\n"
    "| 2 | grpo | 0.400 | 0.500 | 0.600 | 0.550 | 0.300 | 0.500 | 12,345 | 16 | 0.25 |\n"
    "| 3 | tree_random | nan | nan | nan | nan | nan | nan | nan | nan | nan |\n"
    "\n"
    "Plots: `effective_ratio.png`, `reward.png`, `tokens.png`, `accuracy_vs_tokens.png`.\n"
)
INTRO = ("Ranked by held-out greedy accuracy after RL (ties: effective ratio). Means are over training steps;\n"
         "every arm samples the same number of trajectories per step.\n\n")


def test_summary_markdown_is_byte_for_byte_the_documented_report():
    links = {"runs": "http://ui/runs", "compare": "http://ui/compare"}
    text = render_markdown(RESULTS, {"accuracy/greedy": 0.3}, 2, links)
    assert text == ("# Ablation report\n\nHeld-out greedy accuracy after warmup: **0.300**\n\n" + INTRO + TABLE +
                    "\nMLflow (`make ui`): [the arms' results](http://ui/runs) (`arm/acc`, `arm/eff_ratio`, ...), "
                    "[compare the arms](http://ui/compare).\n")


def test_without_a_warmup_baseline_or_links_the_report_keeps_its_blank_lines():
    assert render_markdown(RESULTS, {}, 2, None) == "# Ablation report\n\n\n\n" + INTRO + TABLE


def test_the_report_columns_are_named_by_the_tracking_table():
    assert [SUMMARY_METRIC_NAMES[k] for k in TABLE_SUMMARY_KEYS] == [
        "arm/eff_ratio", "arm/eff_tok_ratio", "arm/active_prompts", "arm/reward", "arm/tokens", "arm/traj_step",
        "arm/sec_step"]


def test_write_plots_writes_every_plot_the_report_names(tmp_path: Path):
    history = {"effective_ratio": [(0, 0.5), (1, 0.6)], "reward/mean": [(0, 0.1)], "tokens/generated": [(0, 9.0)],
               "accuracy/eval": [(1, 0.3)], "tokens/cumulative": [(0, 9.0), (1, 20.0)]}
    results = {"grpo": {**RESULTS["grpo"], "history": history}}
    paths = write_plots(results, tmp_path)
    assert [p.name for p in paths] == list(PLOTS) and all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PLOTS)


def test_metrics_table_puts_evaluate_metrics_under_eval():
    table = metrics_table(RESULTS)
    assert table["grpo"]["arm/eff_ratio"] == 0.6 and table["grpo"]["eval/accuracy/pass_at_2"] == 0.5
    assert table["tree_random"] == {}
