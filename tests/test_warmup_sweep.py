"""scripts/warmup_sweep.py: checkpoints of one warmup equal warmups stopped there; the paired gain; bad steps."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.warmup_sweep import check_prepared, claim_folder, markdown_table, paired_gain

REPO = Path(__file__).resolve().parents[1]


def test_the_paired_gain_is_the_mean_per_question_difference_with_its_standard_error():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 1.0}
    after = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0}
    gain, se = paired_gain(after, before)
    assert gain == 0.0
    assert math.isclose(se, math.sqrt(2 / 3) / 2)  # differences 1, 0, 0, -1: sd sqrt(2/3), Q = 4
    with pytest.raises(ValueError, match="same >= 2 questions"):
        paired_gain({"a": 1.0, "x": 0.0}, {"a": 0.0, "b": 0.0})


def test_the_table_lists_checkpoints_in_step_order_and_marks_a_task_without_decision_probabilities():
    rows = [{"sft_step": 1000, "sampled_success": 0.4, "held_out": 0.5, "p_right_ambiguous": None,
             "p_right_plain": 0.8, "held_out_after": 0.55, "gain": 0.05, "gain_se": 0.02},
            {"sft_step": 900, "sampled_success": 0.3, "held_out": 0.45, "p_right_ambiguous": 0.25,
             "p_right_plain": 0.7, "held_out_after": 0.5, "gain": 0.05, "gain_se": 0.03}]
    lines = markdown_table(rows).splitlines()
    assert lines[2].startswith("| 900 | 0.300 | 0.450 | 0.250 | 0.700 | 0.500 | +0.050 (0.030) |")
    assert lines[3].startswith("| 1,000 | 0.400 | 0.500 | - | 0.800 |")


def test_a_folder_of_another_configs_sweep_is_refused_and_its_own_is_reused(tmp_path):
    from trace.configuration.config import ConfigError

    out = tmp_path / "sw"
    claim_folder(out, "aaa", "params.yaml")
    claim_folder(out, "aaa", "params.yaml")  # the same config resumes
    with pytest.raises(ConfigError, match="holds a sweep of other params.*Give another --out"):
        claim_folder(out, "bbb", "other.yaml")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        claim_folder(tmp_path / "file", "aaa", "params.yaml")


def test_prompts_prepared_with_other_params_are_refused_with_how_to_prepare():
    from trace.configuration.params_file import load_config
    from trace.data_paths import DataError
    from trace.envs.registry import make_environment

    cfg = load_config(REPO / "tests" / "params_tiny.yaml")
    env = make_environment(cfg.task, cfg.seed)
    train, evals = env.prompts("train"), env.prompts("eval")
    check_prepared(cfg, env, {"train": train, "eval": evals}, "tiny.yaml")
    other = make_environment(cfg.task, cfg.seed + 1)
    with pytest.raises(DataError, match="train.jsonl holds other prompts than tiny.yaml.*dvc repro prepare"):
        check_prepared(cfg, env, {"train": other.prompts("train"), "eval": evals}, "tiny.yaml")


@pytest.mark.slow
def test_a_sweep_keeps_the_weights_a_warmup_stopped_at_that_step_keeps(tmp_path):
    """On the tiny params: checkpoint 10 of a 20-step sweep is the policy of a warmup whose band stops it at
    step 10 (same SFT batches and measurements), and a step off the measurement grid is refused."""
    import torch

    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment
    from trace.policy.build import build_policy
    from trace.policy.model import load_policy
    from trace.training.warmup import run_warmup

    cfg = load_config(REPO / "tests" / "params_tiny.yaml")
    env = make_environment(cfg.task, cfg.seed)
    train = env.prompts("train")
    # the sweep's checkpoints (through the hook the script uses)
    saved, seen = {}, []
    policy = build_policy(cfg.policy, env, cfg.seed, cfg.task.name.value)
    sweep_cfg = cfg.model_copy(update={"warmup": cfg.warmup.model_copy(
        update={"max_steps": 20, "target_low": 1.0, "target_high": 1.0})})

    def keep(step, success):
        seen.append((step, success))
        saved[step] = {k: v.clone() for k, v in policy.model.state_dict().items()}

    result = run_warmup(policy, env, train, sweep_cfg, on_measure=keep, progress=False)
    assert [s for s, _ in seen] == [10, 20] and result.history == seen
    # a warmup whose band keeps the step-10 weights
    stopped = build_policy(cfg.policy, env, cfg.seed, cfg.task.name.value)
    band = cfg.model_copy(update={"warmup": cfg.warmup.model_copy(
        update={"max_steps": 10, "target_low": 0.0, "target_high": 1.0})})
    first = run_warmup(stopped, env, train, band, progress=False)
    assert first.chosen_step == 10 and first.chosen_success == seen[0][1]
    for name, value in stopped.model.state_dict().items():
        assert torch.equal(value, saved[10][name]), name
    assert not all(torch.equal(saved[10][k], saved[20][k]) for k in saved[10])  # training went on after it
    # the script refuses a step the warmup never measures, naming the fix
    out = subprocess.run([sys.executable, "-m", "scripts.warmup_sweep", "--steps", "15", "--params",
                          str(REPO / "tests" / "params_tiny.yaml"), "--out", str(tmp_path / "sw")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "multiple of warmup.eval_every=10" in out.stderr and "--steps 20" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "sw" / "sweep.json").exists()
    out = subprocess.run([sys.executable, "-m", "scripts.warmup_sweep", "--steps", "10", "--rl-steps", "0",
                          "--params", str(REPO / "tests" / "params_tiny.yaml"), "--out", str(tmp_path / "sw")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "--rl-steps 0" in out.stderr and "Traceback" not in out.stderr
