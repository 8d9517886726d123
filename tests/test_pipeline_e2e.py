"""End to end: the real DVC pipeline on a tiny params file, its caching, and a Prefect schedule.

One local Prefect server (127.0.0.1, free port) serves every stage of the session; the tests stop it.
"""

import os
import shutil
import signal
import socket
import sqlite3
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
_TOP_LEVEL_ONLY = {"data", "reports", "metrics"}  # outputs at the repository root; trace/data is code
# what a pipeline run leaves in the working tree that git does not ignore: never part of a copy
_RUN_OUTPUTS = {"dvc.lock", "metrics"}


def _source_files() -> list[str] | None:
    """The working tree's source files, as git sees them: tracked, or untracked and not ignored (None outside a
    git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return None
    return [rel for rel in out.split("\0") if rel]


def copy_project(dst: Path, skip: set[str] = _SKIP) -> None:
    """Copy the working tree's source to ``dst``: what git tracks or would add, without the pipeline's outputs
    (the ignored ones, and ``dvc.lock`` and ``metrics/`` that a run leaves at the root), caches, databases and
    ``skip`` names, so a copy is the same whatever ``make run`` left in the folder."""
    def skipped(parts: tuple[str, ...]) -> bool:
        return (parts[0] in _RUN_OUTPUTS or parts[-1].endswith(".db")
                or any(n in skip and (i == 0 or n not in _TOP_LEVEL_ONLY) for i, n in enumerate(parts)))

    files = _source_files()
    if files is None:  # not a git checkout: every file but the outputs, caches and databases
        def ignore(folder: str, names: list[str]) -> list[str]:
            rel = Path(folder).relative_to(ROOT).parts
            return [n for n in names if skipped((*rel, n))]

        shutil.copytree(ROOT, dst, ignore=ignore)
        return
    for rel in files:
        src = ROOT / rel
        if skipped(Path(rel).parts) or not src.is_file():  # a tracked file deleted in the working tree
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(project: Path, api_url: str) -> dict:
    # without the distributed variables an in-process DeepSpeed engine of an earlier test set: a stage
    # inheriting MASTER_PORT would try to listen on a port the test process still holds
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.pop("DVC_ROOT", None)
    env.update({"PREFECT_API_URL": api_url, "PREFECT_HOME": str(project / ".prefect"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}", "PYTHONPATH": str(project),
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "DO_NOT_TRACK": "1"})
    return env


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the working tree with the tiny params file and a running Prefect server."""
    dst = tmp_path_factory.mktemp("project") / "trace"
    copy_project(dst)
    shutil.copy(ROOT / "tests" / "params_tiny.yaml", dst / "params.yaml")
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    # a first commit: experiments (dvc exp run) are based on one
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True)
    subprocess.run(["git", "-c", "user.name=trace", "-c", "user.email=trace@localhost", "commit", "-qm", "tiny"],
                   cwd=dst, check=True)
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
        assert (project_dir / "data" / "runs" / ablation / "s0" / "final").is_dir()
        evaluated = json.loads((project_dir / "data" / "eval" / ablation / "s0.json").read_text())
        assert (evaluated["ablation"], evaluated["seed"]) == (ablation, 0)
        assert 0.0 <= evaluated["accuracy_train/greedy"] <= 1.0  # memorisation: training questions beside held-out
    warmup = json.loads((project_dir / "metrics" / "warmup.json").read_text())
    assert "accuracy_train/greedy" in warmup and "accuracy/greedy" in warmup
    assert "one seed, no interval" in summary and "## Against grpo" in summary
    assert "grpo's gain in held-out greedy accuracy over warmup" in summary and "(standard error" in summary
    # avg@k beside greedy: per question in every evaluation, the gains over warmup, the in-training curve
    assert "grpo's gain in held-out avg@2 over warmup" in summary and "## Gain over warmup" in summary
    assert "## Sample efficiency, avg@2" in summary  # pass_k 2 in params_tiny.yaml
    for path in (project_dir / "data" / "eval" / "warmup.json", project_dir / "data" / "eval" / "trace" / "s0.json"):
        sampled = json.loads(path.read_text())["sampled_by_question"]
        assert len(sampled) == 8 and all(v in (0.0, 0.5, 1.0) for v in sampled.values())  # 8 questions x 2 samples
    for png in ("effective_ratio.png", "accuracy_vs_tokens.png", "accuracy_vs_trajectories.png", "reward.png",
                "tokens.png", "avgk_vs_steps.png", "avgk_vs_tokens.png"):
        assert (project_dir / "reports" / png).stat().st_size > 1000

    # the report where users look: its own MLflow run holds summary.md and the plots; DVC's metrics and curves
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{project_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("trace-tiny")
    report_run = client.search_runs([experiment.experiment_id], "tags.`trace.stage` = 'report'")[0]
    logged = {a.path for a in client.list_artifacts(report_run.info.run_id)}
    assert {"summary.md", "metrics.json", "arms.json", "avgk_vs_tokens.png", "train.csv", "eval.csv"} <= logged
    assert f"runs/{report_run.info.run_id}/artifacts" in summary
    arms = json.loads((project_dir / "reports" / "arms.json").read_text())
    assert set(arms) == {"grpo", "dapo", "trace"} and "gain_avgk" in arms["grpo"]
    # each train run shows its rollouts at the evaluation steps (1 and 2: every 2 steps and the last): a table of
    # at most tracking.rollout_rows (5) rows a step, cut to rollout_chars (80), and the tree pictures by step
    train_run = client.search_runs([experiment.experiment_id], "tags.`trace.stage` = 'train' and "
                                   "tags.`trace.ablation` = 'trace'")[0]
    table = json.loads(Path(client.download_artifacts(train_run.info.run_id, "rollouts.json",
                                                      str(project_dir / "downloaded"))).read_text())
    assert table["columns"][:4] == ["step", "prompt_uid", "prompt", "trajectory"] and "branch_turn" in table["columns"]
    assert sorted({row[0] for row in table["data"]}) == [1, 2] and len(table["data"]) == 10
    assert max(len(row[3]) for row in table["data"]) <= 80
    images = [a.path for a in client.list_artifacts(train_run.info.run_id, "images")]
    assert any("rollout_trees+step+1+" in p for p in images), images
    assert any("rollout_trees+step+2+" in p for p in images), images

    from trace.tree_io import read_trees, tree_path

    trees = read_trees(tree_path(project_dir / "data" / "runs" / "trace" / "s0" / "trees", "trace", 0))
    assert trees and all(t.ablation == "trace" and t.step == 0 for t in trees)
    assert sum(t.num_trajectories() for t in trees) == 16  # allocation.trajectory_budget

    again = _dvc(project_dir, env, "repro")
    assert again.returncode == 0
    assert "Running stage" not in again.stdout, again.stdout

    params = (project_dir / "params.yaml").read_text()
    assert "update: {micro_batch_size: 16," in params
    (project_dir / "params.yaml").write_text(params.replace("update: {micro_batch_size: 16,",
                                                            "update: {micro_batch_size: 16, lr: 0.0002,"))
    status = _dvc(project_dir, env, "status")
    changed = status.stdout
    assert "train@trace-0" in changed and "train@grpo-0" in changed
    for upstream in ("prepare:", "warmup:", "seed_rollouts:", "fit_predictor:"):
        assert upstream not in changed, changed


def test_bytecode_written_next_to_the_code_deps_keeps_the_pipeline_up_to_date(project):
    project_dir, env = project
    subprocess.run(["git", "checkout", "params.yaml"], cwd=project_dir, check=True)  # undo an earlier -S edit
    repro = _dvc(project_dir, env, "repro")
    assert repro.returncode == 0, repro.stdout[-4000:] + repro.stderr[-4000:]
    compiled = subprocess.run([sys.executable, "-m", "compileall", "-q", "trace", "flows"], cwd=project_dir, env=env)
    assert compiled.returncode == 0
    (project_dir / "trace" / "policy" / "__pycache__" / "stray.cpython-311.opt-1.pyc").write_bytes(b"\0")
    assert any((project_dir / "trace" / "envs" / "__pycache__").iterdir())
    status = _dvc(project_dir, env, "status")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout


def _store_dirs(project_dir: Path, ablation: str) -> set[Path]:
    return set((project_dir / "data" / "checkpoints" / ablation).glob("*-*"))


def _step_history(project_dir: Path, resume_hash: str, ablation: str) -> list[int]:
    """Steps of ``tokens/cumulative`` in the newest train run of ``ablation`` with that resume hash."""
    with sqlite3.connect(project_dir / "mlflow.db") as db:
        run_id = db.execute(
            "select r.run_uuid from runs r join tags a on a.run_uuid = r.run_uuid and a.key = 'trace.ablation' "
            "join tags h on h.run_uuid = r.run_uuid and h.key = 'trace.params_hash' "
            "join tags s on s.run_uuid = r.run_uuid and s.key = 'trace.stage' "
            "where a.value = ? and h.value = ? and s.value = 'train' order by r.start_time desc limit 1",
            (ablation, resume_hash)).fetchone()[0]
        return sorted(row[0] for row in db.execute(
            "select step from metrics where run_uuid = ? and key = 'tokens/cumulative'", (run_id,)))


def _without_times(data: dict) -> dict:
    return {k: v for k, v in data.items() if "time/" not in k}


def test_a_killed_dvc_exp_run_resumes_training_and_records_the_experiment(project):
    """SIGKILL during train@dapo-0 after its step-2 checkpoint; the same `dvc exp run` again resumes at step 2
    (though DVC restores the stage's outputs from dvc.lock first) and ends as an uninterrupted run does."""
    from trace.configuration.params_file import load_config
    from trace.tree_io import tree_path

    project_dir, env = project
    # checkpoints at steps 2, 4, 5; dapo alone: the other arms' stages would add nothing to what is checked
    args = ("exp", "run", "-S", "advantages.clip=4.0", "-S", "train.num_steps=5", "-S", "train.ablations=[dapo]")
    before = _store_dirs(project_dir, "dapo")
    with open(project_dir / "killed.log", "w") as log:
        proc = subprocess.Popen([str(BIN / "dvc"), *args], cwd=project_dir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 900
    marker = None
    while proc.poll() is None and time.time() < deadline and marker is None:
        time.sleep(0.05)
        for folder in _store_dirs(project_dir, "dapo") - before:
            if tree_path(folder / "trees", "dapo", 2).exists():  # step 2 ran, checkpoint 2 saved, 4 not yet
                marker = folder
    assert marker is not None and proc.poll() is None, (project_dir / "killed.log").read_text()[-4000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    again = _dvc(project_dir, env, *args)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "resuming dapo at step 2" in again.stdout, again.stdout[-4000:]
    cfg = load_config(project_dir / "params.yaml")
    assert cfg.advantages.clip == 4.0 and cfg.train.num_steps == 5
    ran = [line for line in again.stdout.splitlines() if line.startswith("Running stage")]
    assert "Running stage 'train@dapo-0':" in ran and not any("grpo" in line or "trace-0" in line for line in ran), ran
    assert _step_history(project_dir, cfg.resume_hash(), "dapo") == [0, 1, 2, 3, 4]  # each step logged once
    resumed_summary = json.loads((project_dir / "data" / "runs" / "dapo" / "s0" / "summary.json").read_text())
    resumed_metrics = json.loads((project_dir / "metrics" / "ablations" / "dapo" / "s0.json").read_text())

    shown = _dvc(project_dir, env, "exp", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    assert "metrics/ablations/dapo/s0.json" in shown.stdout and "accuracy/greedy" in shown.stdout

    # the same params uninterrupted, from an empty checkpoint folder
    shutil.rmtree(marker)
    for stage in ("train", "evaluate"):
        out = subprocess.run([sys.executable, "-m", f"flows.{stage}", "--ablation", "dapo"], cwd=project_dir,
                             env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "resuming" not in out.stdout
    fresh_summary = json.loads((project_dir / "data" / "runs" / "dapo" / "s0" / "summary.json").read_text())
    assert _without_times(resumed_summary) == _without_times(fresh_summary)
    assert resumed_metrics == json.loads((project_dir / "metrics" / "ablations" / "dapo" / "s0.json").read_text())


def _train_runs(project_dir: Path, resume_hash: str, ablation: str) -> int:
    """MLflow train runs of ``ablation`` with that resume hash."""
    with sqlite3.connect(project_dir / "mlflow.db") as db:
        return db.execute(
            "select count(*) from runs r join tags a on a.run_uuid = r.run_uuid and a.key = 'trace.ablation' "
            "join tags h on h.run_uuid = r.run_uuid and h.key = 'trace.params_hash' "
            "join tags s on s.run_uuid = r.run_uuid and s.key = 'trace.stage' "
            "where a.value = ? and h.value = ? and s.value = 'train'", (ablation, resume_hash)).fetchone()[0]


def _tree_rows(trees_root: Path) -> list[tuple]:
    from trace.tree_io import read_trees, tree_files

    return [(step, tree.tree_id, n.node_id, tuple(n.token_ids), n.reward)
            for _, step, path in tree_files(trees_root) for tree in read_trees(path) for n in tree.nodes]


def test_a_train_stage_launched_on_two_ranks_writes_one_run_and_the_trees_one_process_writes(project):
    """`dvc exp run -S +launch.launcher=torchrun -S +launch.num_processes=2`: the stage command starts torchrun, two
    gloo ranks train, rank 0 alone writes; the same params in one process sample the same trees."""
    from trace.configuration.params_file import load_config

    project_dir, env = project
    env = {**env, "OMP_NUM_THREADS": "1"}  # one thread per rank in both runs
    subprocess.run(["git", "checkout", "params.yaml"], cwd=project_dir, check=True)
    before = _store_dirs(project_dir, "trace")
    # the tiny params file has no launch section: `+key=value` adds one (params.yaml has it: `-S launch...`)
    out = _dvc(project_dir, env, "exp", "run", "-S", "+launch.launcher=torchrun", "-S", "+launch.num_processes=2",
               "-S", "advantages.clip=3.0", "-S", "train.ablations=[trace]")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "launching:" in out.stdout and "--nproc_per_node 2" in out.stdout, out.stdout[-4000:]
    cfg = load_config(project_dir / "params.yaml")
    assert cfg.launch.num_processes == 2 and cfg.advantages.clip == 3.0
    assert _train_runs(project_dir, cfg.resume_hash(), "trace") == 1  # one MLflow run, not one per rank
    assert _step_history(project_dir, cfg.resume_hash(), "trace") == [0, 1, 2]  # each step logged once
    trees_root = project_dir / "data" / "runs" / "trace" / "s0" / "trees"
    two_ranks = _tree_rows(trees_root)
    assert len({step for step, *_ in two_ranks}) == cfg.train.num_steps  # one Parquet file a step
    summary = json.loads((project_dir / "data" / "runs" / "trace" / "s0" / "summary.json").read_text())

    new = {folder for folder in _store_dirs(project_dir, "trace") - before if folder.is_dir()}
    assert len(new) == 1, new
    shutil.rmtree(new.pop())  # the same params in one process, from an empty checkpoint folder
    import yaml

    params = yaml.safe_load((project_dir / "params.yaml").read_text())
    params.pop("launch")
    (project_dir / "one_process.yaml").write_text(yaml.safe_dump(params))
    one = subprocess.run([sys.executable, "-m", "flows.train", "--ablation", "trace",
                          "--params", str(project_dir / "one_process.yaml")], cwd=project_dir,
                         env=env, capture_output=True, text=True, timeout=900)
    assert one.returncode == 0 and "launching:" not in one.stdout, one.stdout[-3000:] + one.stderr[-3000:]
    assert _tree_rows(trees_root) == two_ranks
    one_summary = json.loads((project_dir / "data" / "runs" / "trace" / "s0" / "summary.json").read_text())
    numbers = {k: v for k, v in _without_times(summary).items() if isinstance(v, float)}
    assert {k: one_summary[k] for k in numbers} == pytest.approx(numbers, rel=1e-6, nan_ok=True)
    assert one_summary.keys() == summary.keys() and (one_summary["ablation"], one_summary["seed"]) == ("trace", 0)
    subprocess.run(["git", "checkout", "params.yaml"], cwd=project_dir, check=True)


def test_a_bad_param_stops_dvc_exp_run_at_the_check_before_any_other_stage(project):
    project_dir, env = project
    subprocess.run(["git", "checkout", "params.yaml"], cwd=project_dir, check=True)
    out = _dvc(project_dir, env, "exp", "run", "-S", "allocation.trajectory_budget=-5", timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "allocation.trajectory_budget = -5" in text and "greater than or equal to 2" in text
    assert "git checkout params.yaml" in text and "Traceback" not in text
    assert [line for line in text.splitlines() if line.startswith("Running stage")] == \
        ["Running stage 'check_params':"]
    subprocess.run(["git", "checkout", "params.yaml"], cwd=project_dir, check=True)


def test_a_queued_experiment_of_a_real_data_task_reads_its_data_beside_the_main_repository(project):
    """`dvc exp run --queue` runs in a temporary copy under .dvc/tmp/exps; a preset-like relative path
    ``../shared/data/...`` must still mean the folder beside the main repository."""
    project_dir, env = project
    subprocess.run(["git", "checkout", "params.yaml"], cwd=project_dir, check=True)
    data = project_dir.parent / "shared" / "data" / "nq"
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"who is number {i}?", "answer": [f"n{i}"]} for i in range(12)]
    (data / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = ["-S", "task.name=nq", "-S", "+task.files.train_path=../shared/data/nq/questions.jsonl",
                 "-S", "+task.files.eval_fraction=0.5"]
    out = _dvc(project_dir, env, "exp", "run", "--queue", "-n", "queued-nq", *overrides, "prepare", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out = _dvc(project_dir, env, "queue", "start", "-j", "1", timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    deadline, status = time.monotonic() + 600, ""
    while time.monotonic() < deadline:
        status = _dvc(project_dir, env, "queue", "status", timeout=120).stdout
        if "queued-nq" in status and not any(word in status for word in ("Queued", "Running")):
            break
        time.sleep(5)
    logs = _dvc(project_dir, env, "queue", "logs", "queued-nq", timeout=120)
    text = logs.stdout + logs.stderr
    _dvc(project_dir, env, "queue", "stop", "--kill", timeout=120)
    assert "Success" in status, status + text[-4000:]
    assert "not found" not in text and "train/num_prompts" in text, text[-4000:]
    subprocess.run(["git", "checkout", "params.yaml"], cwd=project_dir, check=True)


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
