"""End to end: the real DVC pipeline on a tiny params file, its caching, and a Prefect schedule.

One local Prefect server (127.0.0.1, free port) serves every stage of the session; the tests stop it.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import json
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow

_SKIP = {".git", ".venv", "data", "mlruns", ".prefect", "__pycache__", ".hypothesis", "reports", ".pytest_cache"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(project: Path, api_url: str) -> dict:
    # without the distributed variables an in-process DeepSpeed engine of an earlier test set: a stage
    # inheriting MASTER_PORT would try to listen on a port the test process still holds
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update({"PREFECT_API_URL": api_url, "PREFECT_HOME": str(project / ".prefect"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}", "PYTHONPATH": str(project),
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "DO_NOT_TRACK": "1"})
    return env


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the working tree with the tiny params file and a running Prefect server."""
    dst = tmp_path_factory.mktemp("project") / "trace"
    shutil.copytree(ROOT, dst, ignore=lambda d, names: [n for n in names if n in _SKIP or n.endswith(".db")])
    shutil.copy(ROOT / "tests" / "params_tiny.yaml", dst / "params.yaml")
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    port = _free_port()
    env = _env(dst, f"http://127.0.0.1:{port}/api")
    out = subprocess.run([sys.executable, "-m", "flows.server", "ensure", "--port", str(port)], cwd=dst, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    yield dst, env
    subprocess.run([sys.executable, "-m", "flows.server", "stop"], cwd=dst, env=env, timeout=60)


def _dvc(project_dir: Path, env: dict, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dvc"), *args], cwd=project_dir, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_pipeline_runs_end_to_end_then_caches_and_reruns_only_downstream_of_a_changed_param(project):
    project_dir, env = project
    first = _dvc(project_dir, env, "repro")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]

    summary = (project_dir / "reports" / "summary.md").read_text()
    for ablation in ("grpo", "dapo", "trace"):
        assert f"| {ablation} |" in summary
        assert (project_dir / "data" / "runs" / ablation / "final").is_dir()
        assert json.loads((project_dir / "data" / "eval" / f"{ablation}.json").read_text())["ablation"] == ablation
    for png in ("effective_ratio.png", "accuracy_vs_tokens.png", "reward.png", "tokens.png"):
        assert (project_dir / "reports" / png).stat().st_size > 1000

    from trace.tree_io import read_trees, tree_path

    trees = read_trees(tree_path(project_dir / "data" / "runs" / "trace" / "trees", "trace", 0))
    assert trees and all(t.ablation == "trace" and t.step == 0 for t in trees)
    assert sum(t.num_trajectories() for t in trees) == 16  # allocation.trajectory_budget

    again = _dvc(project_dir, env, "repro")
    assert again.returncode == 0
    assert "Running stage" not in again.stdout, again.stdout

    params = (project_dir / "params.yaml").read_text().replace("update: {micro_batch_size: 16, zero_stage: 0}",
                                                               "update: {micro_batch_size: 16, zero_stage: 0, lr: 0.0002}")
    (project_dir / "params.yaml").write_text(params)
    status = _dvc(project_dir, env, "status")
    changed = status.stdout
    assert "train@trace" in changed and "train@grpo" in changed
    for upstream in ("prepare:", "warmup:", "seed_rollouts:", "fit_predictor:"):
        assert upstream not in changed, changed


def test_schedule_is_registered_and_a_scheduled_run_appears(project):
    project_dir, env = project
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline", "serve", "--cron", "*/5 * * * *",
                             "--name", "e2e-schedule"], cwd=project_dir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    api = env["PREFECT_API_URL"]
    try:
        runs = []
        deadline = time.time() + 180
        while time.time() < deadline and not runs:
            time.sleep(3)
            req = urllib.request.Request(f"{api}/flow_runs/filter", method="POST",
                                         data=json.dumps({"flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}})
                                         .encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                runs = [r for r in json.loads(resp.read()) if r.get("deployment_id")]
        assert runs, "no scheduled flow run appeared within 180 s"
        req = urllib.request.Request(f"{api}/deployments/filter", method="POST", data=b"{}",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            names = [d["name"] for d in json.loads(resp.read())]
        assert "e2e-schedule" in names
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
