"""The report as DVC reads it: per-arm curves that `dvc plots show` draws and the per-arm summary that
`dvc metrics show` (and so `dvc exp show`) lists."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trace.reporting.report import arm_statistics
from trace.reporting.report_dvc import EVAL_CURVES, TRAIN_CURVES, arm_summary, curve_rows, write_curves

ROOT = Path(__file__).resolve().parents[1]
DVC = Path(sys.executable).parent / "dvc"


def _run(history: dict, acc: float, mean_k: float) -> dict:
    return {"run_id": "r", "experiment_id": "1", "history": history, "summary": {"arm/eff_ratio": 0.5},
            "eval": {"accuracy/greedy": acc, "accuracy/mean_at_2": mean_k}}


# grpo at two seeds: reward 0.2 / 0.4 at step 0 and 0.4 / 0.6 at step 1 (means 0.3, 0.5); evaluated at step 1 only,
# greedy 0.5 / 0.7 (mean 0.6) and avg@k 0.3 / 0.5 (mean 0.4) at cumulative tokens 100 / 300 (mean 200). trace at
# one seed, evaluated at steps 0 and 1.
RESULTS = {
    "grpo": {0: _run({"reward/mean": [(0, 0.2), (1, 0.4)], "tokens/cumulative": [(0, 50.0), (1, 100.0)],
                      "accuracy/eval": [(1, 0.5)], "accuracy/eval_sampled": [(1, 0.3)]}, 0.5, 0.3),
             1: _run({"reward/mean": [(0, 0.4), (1, 0.6)], "tokens/cumulative": [(0, 150.0), (1, 300.0)],
                      "accuracy/eval": [(1, 0.7)], "accuracy/eval_sampled": [(1, 0.5)]}, 0.7, 0.5)},
    "trace": {0: _run({"reward/mean": [(0, 0.1), (1, 0.2)], "tokens/cumulative": [(0, 40.0), (1, 80.0)],
                       "accuracy/eval": [(0, 0.4), (1, 0.6)], "accuracy/eval_sampled": [(0, 0.2), (1, 0.3)]},
                      0.6, 0.3)},
}


def test_curves_are_the_mean_over_seeds_of_each_arm_at_each_step():
    train = curve_rows(RESULTS, TRAIN_CURVES)
    assert [(r["arm"], r["step"]) for r in train] == [("grpo", 0), ("grpo", 1), ("trace", 0), ("trace", 1)]
    assert train[0]["train_reward"] == pytest.approx(0.3) and train[1]["train_reward"] == pytest.approx(0.5)
    assert train[1]["tokens"] == pytest.approx(200.0)
    assert train[0]["effective_ratio"] != train[0]["effective_ratio"]  # never logged: NaN, an empty cell
    evals = curve_rows(RESULTS, EVAL_CURVES)
    assert [(r["arm"], r["step"]) for r in evals] == [("grpo", 1), ("trace", 0), ("trace", 1)]
    assert evals[0]["heldout_greedy"] == pytest.approx(0.6) and evals[0]["heldout_avgk"] == pytest.approx(0.4)
    assert evals[0]["tokens"] == pytest.approx(200.0)


def test_the_summary_holds_each_arms_interval_and_its_gain_over_warmup():
    stats = arm_statistics(RESULTS, 2, warmup={"accuracy/greedy": 0.5, "accuracy/mean@2": 0.3})["arms"]
    summary = arm_summary(stats)
    assert summary["grpo"]["heldout_greedy"]["mean"] == pytest.approx(0.6)
    assert summary["grpo"]["heldout_greedy"]["low"] < 0.6 < summary["grpo"]["heldout_greedy"]["high"]
    assert summary["grpo"]["gain_avgk"]["mean"] == pytest.approx(0.1)  # 0.4 - 0.3, t over seeds (no questions)
    assert summary["trace"]["heldout_greedy"] == {"mean": 0.6}  # one seed: no bounds
    json.dumps(summary, allow_nan=False)  # strict JSON: undefined values are left out


@pytest.mark.slow
def test_dvc_draws_the_curves_per_arm_and_lists_the_arm_summary_as_metrics(tmp_path):
    """The project's dvc.yaml plots and template on curves written by write_curves: one series per arm."""
    project = tmp_path / "p"
    project.mkdir()
    env = {**os.environ, "DO_NOT_TRACK": "1"}
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run([str(DVC), "init", "-q"], cwd=project, check=True, env=env)
    for rel in ("dvc.yaml", "params.yaml", ".dvc/plots/by_arm.json"):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, project / rel)
    write_curves(RESULTS, project / "reports" / "curves")
    stats = arm_statistics(RESULTS, 2, warmup={"accuracy/greedy": 0.5, "accuracy/mean@2": 0.3})["arms"]
    (project / "reports" / "arms.json").write_text(json.dumps(arm_summary(stats)))

    shown = subprocess.run([str(DVC), "plots", "show", "--json"], cwd=project, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    plots = json.loads(shown.stdout)["data"]
    assert set(plots) == {"train_reward", "effective_ratio", "heldout_greedy_vs_step", "heldout_greedy_vs_tokens",
                          "heldout_avgk_vs_step", "heldout_avgk_vs_tokens"}
    values = plots["heldout_avgk_vs_tokens"][0]["content"]["data"]["values"]
    assert sorted({v["arm"] for v in values}) == ["grpo", "trace"] and len(values) == 3
    assert plots["heldout_avgk_vs_tokens"][0]["content"]["encoding"]["color"]["field"] == "arm"

    metrics = subprocess.run([str(DVC), "metrics", "show", "--json"], cwd=project, env=env, capture_output=True,
                             text=True)
    assert metrics.returncode == 0, metrics.stderr
    data = json.loads(metrics.stdout)
    arms = next(iter(data.values()))["data"]["reports/arms.json"]["data"]
    assert arms["grpo"]["heldout_greedy"]["mean"] == pytest.approx(0.6) and "gain_avgk" in arms["grpo"]
