"""The params check that runs before every other stage: fast, clear, and never changes params.yaml."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from flows.check_params import check_params, parse_overrides

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "params_tiny.yaml"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _project(tmp_path: Path, params_text: str) -> Path:
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(params_text)
    return tmp_path / "params.yaml"


def test_a_bad_value_exits_1_naming_key_value_rule_and_fix_without_a_traceback(tmp_path):
    params = _project(tmp_path, TINY.read_text().replace("trajectory_budget: 16", "trajectory_budget: -5"))
    out = subprocess.run([sys.executable, "-m", "flows.check_params", "--params", str(params), "--out",
                          str(tmp_path / "checked")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "allocation.trajectory_budget = -5" in out.stderr and "greater than or equal to 2" in out.stderr
    assert "git checkout params.yaml" in out.stderr and "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "checked").exists()


def test_a_valid_file_writes_the_fixed_marker_the_pipeline_depends_on(tmp_path):
    params = _project(tmp_path, TINY.read_text())
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "flows.check_params", "--params", str(params), "--out",
                              str(tmp_path / "checked")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
    assert (tmp_path / "checked").read_text() == "params.yaml passed trace.configuration.config validation\n"


def test_the_check_imports_neither_torch_prefect_nor_mlflow():
    code = ("import sys, flows.check_params as c; c.check_params(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'prefect', 'mlflow', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "params.yaml")], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_params_yaml_without_a_key_dvc_yaml_tracks_is_refused_with_the_default_to_add(tmp_path):
    params = _project(tmp_path, TINY.read_text().replace(" max_grad_norm: 1.0,", ""))
    problem = check_params(params)
    assert problem is not None
    assert "update.max_grad_norm (read by warmup)" in problem and "max_grad_norm: 1.0" in problem


def test_a_params_file_without_a_whole_tracked_section_names_the_section_and_its_defaults(tmp_path):
    lines = [line for line in TINY.read_text().splitlines() if not line.startswith("report:")]
    problem = check_params(_project(tmp_path, "\n".join(lines) + "\n"))
    assert problem is not None
    assert "report (read by report)" in problem and '"margin": 0.02' in problem


def test_overrides_are_checked_without_writing_the_file(tmp_path):
    params = _project(tmp_path, TINY.read_text())
    before = params.read_bytes()
    assert check_params(params, parse_overrides(["train.num_steps=4", "train.ablations=[grpo]"])) is None
    problem = check_params(params, parse_overrides(["allocation.trajectory_budget=-5"]), undo_hint=False)
    assert "allocation.trajectory_budget = -5" in problem and "params.yaml is unchanged" in problem
    assert params.read_bytes() == before


def test_the_pipeline_command_refuses_a_bad_override_before_dvc_touches_params_yaml():
    before = (ROOT / "params.yaml").read_bytes()
    out = subprocess.run([sys.executable, "-m", "flows.pipeline", "run", "-S", "allocation.trajectory_budget=-5"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "allocation.trajectory_budget = -5" in out.stderr and "Traceback" not in out.stderr
    assert (ROOT / "params.yaml").read_bytes() == before


def test_an_added_key_override_is_checked_as_dvc_exp_run_applies_it():
    """`dvc exp run -S +key=value` adds a key the file lacks; the check reads the same override without the `+`."""
    assert parse_overrides(["+task.files.train_path=a.jsonl", "++train.num_steps=4", "seed=1"]) == {
        "task.files.train_path": "a.jsonl", "train.num_steps": 4, "seed": 1}
    preset = ROOT / "params" / "hotpotqa.yaml"
    assert check_params(preset, parse_overrides(["+task.files.train_path=hotpotqa/x.jsonl"])) is None
    out = subprocess.run([sys.executable, "-m", "flows.check_params", "--params", str(preset), "-S",
                          "+rollout.top_p=0.9"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_bad_value_in_another_params_file_is_reported_against_that_file():
    problem = check_params(ROOT / "params" / "hotpotqa.yaml", parse_overrides(["allocation.trajectory_budget=-5"]))
    assert "Fix the value in hotpotqa.yaml" in problem and "in params.yaml (or" not in problem
