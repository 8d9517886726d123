"""One table of process defaults: applied with setdefault by the stages and tests, printed for make."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trace.configuration.process_env import (LAUNCHER_ENV, PROCESS_ENV, REPO_ROOT, apply_process_env, make_assignments,
                               select_accelerator)

ROOT = Path(__file__).resolve().parents[1]


def test_apply_sets_only_missing_variables_and_reports_them():
    environ = {"HF_HUB_OFFLINE": "0"}
    newly_set = apply_process_env(PROCESS_ENV, environ)
    assert environ["HF_HUB_OFFLINE"] == "0" and "HF_HUB_OFFLINE" not in newly_set
    assert newly_set == {k: v for k, v in PROCESS_ENV.items() if k != "HF_HUB_OFFLINE"}
    assert environ == {**PROCESS_ENV, "HF_HUB_OFFLINE": "0"}


def test_the_stage_defaults_are_the_pipelines_values():
    assert PROCESS_ENV == {
        "DS_ACCELERATOR": "cpu", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_HOME": str(REPO_ROOT / ".prefect"), "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert LAUNCHER_ENV == {"OMP_NUM_THREADS": "2"}
    assert REPO_ROOT == ROOT


def test_deepspeeds_ops_are_kept_in_the_running_environment_and_the_stages_and_tests_use_that_folder():
    from trace.configuration.process_env import interpreter_env

    assert interpreter_env() == {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}
    assert os.environ["TORCH_EXTENSIONS_DIR"] == interpreter_env()["TORCH_EXTENSIONS_DIR"]  # conftest applied it


def test_a_read_only_environment_keeps_torchs_own_extension_folder(monkeypatch):
    from trace.configuration.process_env import interpreter_env

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert interpreter_env() == {}


def test_the_accelerator_switches_to_cuda_only_from_cpu_and_only_with_a_gpu():
    import torch

    environ = {"DS_ACCELERATOR": "cpu"}
    assert select_accelerator(environ) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert select_accelerator({"DS_ACCELERATOR": "mps"}) == "mps"
    assert select_accelerator({}) is None


def test_the_test_session_runs_under_the_table_with_its_own_prefect_home():
    assert all(key in os.environ for key in {**PROCESS_ENV, **LAUNCHER_ENV})
    assert os.environ["PREFECT_HOME"] != PROCESS_ENV["PREFECT_HOME"]  # conftest's temporary one comes first


def test_make_assignments_are_one_word_each_and_refuse_whitespace():
    assert make_assignments({"A": "1", "B": "x/y"}) == ["A?=1", "B?=x/y"]
    with pytest.raises(ValueError, match="whitespace"):
        make_assignments({"A": "a b"})


def test_the_module_prints_the_launcher_table_without_importing_torch():
    out = subprocess.run([sys.executable, "-m", "trace.configuration.process_env", "--make"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == make_assignments({**PROCESS_ENV, **LAUNCHER_ENV})
    check = ("import sys, trace.configuration.process_env; bad = [m for m in ('torch', 'numpy') if m in sys.modules]; "
             "assert not bad, bad")
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_exports_the_table_and_keeps_what_the_caller_set():
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_ENV and k not in LAUNCHER_ENV}
    env["HF_HUB_OFFLINE"] = "0"
    show = "show-env: ; @env"
    out = subprocess.run(["make", "-s", "-C", str(ROOT), f"PYTHON={sys.executable}", "--eval", show, "show-env"],
                         env=env, capture_output=True, text=True, check=True).stdout
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    expected = {**PROCESS_ENV, **LAUNCHER_ENV, "HF_HUB_OFFLINE": "0"}
    assert {k: seen.get(k) for k in expected} == expected
