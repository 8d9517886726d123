"""The grid across workers (flows.grid): one Prefect flow run per (arm, seed), stage results through DVC.

The fast tests check the pieces. The slow ones run the real thing on 127.0.0.1: a Prefect server, two process
workers in two clones of a copy of the project (two machines), a DVC remote in a temporary folder and an MLflow
server on PostgreSQL (a private cluster; skipped, with how to install it, where the server binaries are
missing), and compare the grid with `dvc exp run` in one folder.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.grid import postgres_bindir, wait_http, wait_online
from flows.grid import grid_jobs, prepare_checkout, queue_name, tracking_uri, worker_command
from flows.grid_dvc import GridError, check_remote, failure_line, grid_params, uncommitted_code
from flows.train import checkpoint_dir
from trace.configuration.params_file import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "params_tiny.yaml"
BIN = Path(sys.executable).parent


def test_a_shared_checkpoint_dir_moves_the_checkpoint_folder_but_changes_no_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "worker"))
    cfg = load_config(TINY)
    shared = load_config(TINY, overrides={"train.checkpoint_dir": str(tmp_path / "shared")})
    local = checkpoint_dir(cfg, "trace")
    assert local.parent == tmp_path / "worker" / "data" / "checkpoints" / "trace"
    assert checkpoint_dir(shared, "trace") == tmp_path / "shared" / "trace" / local.name  # same key, other place
    assert (shared.params_hash(), shared.resume_hash()) == (cfg.params_hash(), cfg.resume_hash())
    relative = load_config(TINY, overrides={"train.checkpoint_dir": "../ckpt"})
    assert checkpoint_dir(relative, "trace").parent == tmp_path / "worker" / ".." / "ckpt" / "trace"


def test_every_train_and_evaluate_stage_can_be_restored_from_the_run_cache():
    """DVC saves a run-cache entry only for a stage whose outputs are cached, metrics or plots (an uncached
    plain output, `cache: false`, makes it skip the entry): the grid's coordinator restores these stages from
    the entries its workers push."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        stages = [s for s in repo.index.stages if s.name.split("@")[0] in ("train", "evaluate")]
        assert stages
        for stage in stages:
            blocking = [str(out) for out in stage.outs if not out.use_cache and not (out.is_metric or out.is_plot)]
            assert not blocking, f"{stage.addressing}: uncached outputs {blocking} keep it out of the run-cache"


def test_the_costs_in_docs_scale_are_those_of_the_committed_benchmark_report():
    from benchmarks.grid import DOCS_MARKER, docs_table

    report = json.loads((ROOT / "reports" / "benchmarks" / "grid.json").read_text())
    text = (ROOT / "docs" / "scale.md").read_text()
    block = text.split(f"<!-- {DOCS_MARKER} -->\n", 1)[1].split(f"\n<!-- /{DOCS_MARKER} -->", 1)[0]
    assert block == docs_table(report), "run `python -m benchmarks.grid` (it rewrites the table) and commit both"


def test_the_grid_is_every_arm_at_every_training_seed_each_job_two_stages():
    cfg = load_config(TINY, overrides={"train.seeds": [0, 1], "train.ablations": ["grpo", "trace"]})
    jobs = grid_jobs(cfg)
    assert [job.name for job in jobs] == ["grpo-0", "grpo-1", "trace-0", "trace-1"]
    assert jobs[1].stages == ("train@grpo-1", "evaluate@grpo-1")


def test_a_worker_takes_one_job_at_a_time_from_the_queue_of_its_size(tmp_path):
    cmd, env = worker_command("gpus", "2,3", None, root=tmp_path)
    assert cmd[1:6] == ["worker", "start", "--pool", "gpus", "--type"] and "process" in cmd
    assert cmd[cmd.index("--limit") + 1] == "1" and cmd[cmd.index("--work-queue") + 1] == queue_name(2) == "ranks-2"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["TRACE_CHECKOUT"] == env["PYTHONPATH"] == str(tmp_path)
    cmd, env = worker_command("cpu", None, "w1", root=tmp_path)
    assert cmd[cmd.index("--work-queue") + 1] == "ranks-1" and cmd[cmd.index("--name") + 1] == "w1"


def test_a_failed_stage_is_reported_by_its_own_error_line():
    dvc_error = "ERROR: failed to reproduce 'train@dapo-0': failed to run: python -m flows.train, exited with 1"
    tail = ["Running stage 'train@dapo-0':", "Traceback (most recent call last):", '  File "x.py", line 1',
            "ValueError: allocation.trajectory_budget=16 < group_size=32: dapo cannot sample one group", dvc_error]
    assert failure_line(tail).startswith("ValueError: allocation.trajectory_budget=16 < group_size=32")
    ranked = [line.replace("ValueError", "[rank0]: ValueError") for line in tail]  # printed under a launcher
    assert failure_line(ranked) == failure_line(tail)
    assert failure_line(["error: allocation.m_max=1 < m_min=2", dvc_error]) == "error: allocation.m_max=1 < m_min=2"
    assert failure_line(["Running stage 'train@dapo-0':", dvc_error]) == dvc_error
    assert failure_line([]) == "(no output)"


def test_a_failed_job_is_reported_by_its_own_error_without_prefects_wrapping():
    from prefect.states import Crashed, Failed

    from flows.grid import _reason

    wrapped = "Flow run encountered an exception: JobFailedError: `dvc repro` exited with status 255: ValueError: x"
    assert _reason(Failed(message=wrapped)) == "`dvc repro` exited with status 255: ValueError: x"
    assert _reason(Crashed(message="worker w went offline")) == "crashed: worker w went offline"


def test_the_grid_refuses_a_tracking_uri_that_is_no_server(monkeypatch):
    from tests.test_pipeline_e2e import _free_port

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(GridError, match="one MLflow tracking server"):
        tracking_uri(load_config(TINY))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    with pytest.raises(GridError, match="sqlite:///mlflow.db: start one"):
        tracking_uri(load_config(TINY))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(GridError, match="does not answer"):
        tracking_uri(load_config(TINY))


def _git_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    return path


def _commit(path: Path, message: str = "c") -> str:
    subprocess.run(["git", "add", "-A"], cwd=path, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", message], cwd=path,
                   check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()


def test_the_grid_refuses_a_repository_without_a_reachable_dvc_remote(tmp_path):
    repo = _git_repo(tmp_path / "repo")
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=repo, check=True)
    with pytest.raises(GridError, match="no default one: `dvc remote add -d"):
        check_remote(repo)
    subprocess.run([str(BIN / "dvc"), "remote", "add", "-q", "-d", "storage", str(tmp_path / "gone")], cwd=repo,
                   check=True)
    with pytest.raises(GridError, match=r"DVC remote 'storage' .* cannot be reached: .*gone does not exist"):
        check_remote(repo)
    (tmp_path / "gone").mkdir()
    assert check_remote(repo) == str(tmp_path / "gone")


def test_the_grid_refuses_uncommitted_code_and_params_changes_the_workers_would_not_see(tmp_path):
    repo = _git_repo(tmp_path / "repo")
    shutil.copy(TINY, repo / "params.yaml")
    (repo / "code.py").write_text("x = 1\n")
    commit = _commit(repo)
    (repo / "code.py").write_text("x = 2\n")
    (repo / "dvc.lock").write_text("schema: '2.0'\n")
    (repo / "new.py").write_text("y = 1\n")
    assert uncommitted_code(repo) == ["code.py", "new.py"]  # dvc.lock and params.yaml are written by every run
    subprocess.run(["git", "checkout", "-q", "code.py"], cwd=repo, check=True)
    (repo / "new.py").unlink()
    assert uncommitted_code(repo) == []

    text = grid_params(repo, ["train.num_steps=2"], commit)
    assert "num_steps: 2" in text and (repo / "params.yaml").read_text() == text
    assert grid_params(repo, ["train.num_steps=2"], commit) == text  # the same overrides again: same params
    assert "num_steps: 1" in grid_params(repo, ["train.num_steps=1"], commit)  # an override replaces it
    with pytest.raises(GridError, match="neither in commit .* nor among the -S overrides"):
        grid_params(repo, ["train.eval_every=1"], commit)  # num_steps=1 is left in params.yaml
    with pytest.raises(GridError, match="train.num_steps = -1"):
        grid_params(repo, ["train.num_steps=-1"], commit)
    with pytest.raises(GridError, match=r"\+key=value"):
        grid_params(repo, ["train.checkpoint_dir=/shared"], commit)  # a key params.yaml lacks needs +
    added = grid_params(repo, ["train.num_steps=1", "+train.checkpoint_dir=/shared"], commit)
    assert yaml.safe_load(added)["train"]["checkpoint_dir"] == "/shared"
    assert grid_params(repo, ["train.num_steps=1", "+train.checkpoint_dir=/shared"], commit) == added  # again


def test_a_job_refuses_a_worker_checkout_at_another_commit_or_with_changed_code(tmp_path):
    repo = _git_repo(tmp_path / "repo")
    (repo / "code.py").write_text("x = 1\n")
    first = _commit(repo)
    (repo / "code.py").write_text("x = 2\n")
    second = _commit(repo)
    with pytest.raises(GridError, match=f"is at commit {second[:12]}, the grid runs {first[:12]}"):
        prepare_checkout(repo, first, "seed: 0\n", "schema: '2.0'\n")
    (repo / "code.py").write_text("x = 3\n")
    with pytest.raises(GridError, match=r"uncommitted changes in \['code.py'\]"):
        prepare_checkout(repo, second, "seed: 0\n", "schema: '2.0'\n")
    subprocess.run(["git", "checkout", "-q", "code.py"], cwd=repo, check=True)
    prepare_checkout(repo, second, "seed: 1\n", "lock\n")
    assert (repo / "params.yaml").read_text() == "seed: 1\n" and (repo / "dvc.lock").read_text() == "lock\n"


# ---- the real grid on 127.0.0.1 -----------------------------------------------------------------------------
POOL = "grid-test"
# the tiny params, 2 arms x 2 seeds, 4 steps: checkpoints after steps 2 and 4 (train.checkpoint_every 2), so a
# kill after the step-2 checkpoint leaves steps to resume
GRID_OVERRIDES = ["train.seeds=[0,1]", "train.ablations=[grpo,trace]", "train.num_steps=4"]
# a worker missing 3 heartbeats of 10 s is offline (Prefect's foreman, every 3 s here); the default is 30 s
WORKER_ENV = {"PREFECT_WORKER_HEARTBEAT_SECONDS": "10", "PREFECT_WORKER_QUERY_SECONDS": "2",
              "PREFECT_LOGGING_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL cluster on 127.0.0.1 (as the `postgres` user when run as root); yields MLflow's
    backend URI for its database `mlflow`, then stops and removes the cluster."""
    from tests.test_pipeline_e2e import _free_port

    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: install Debian's postgresql package "
                    "(`apt-get update && apt-get install -y postgresql`, as .ci/run does)")
    as_owner: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="trace-pg-", dir="/tmp"))
    if os.geteuid() == 0:  # initdb refuses root: the package's `postgres` user owns the cluster
        if shutil.which("runuser") is None:
            pytest.skip("running as root without `runuser` to start PostgreSQL as the postgres user")
        shutil.chown(folder, user="postgres")
        as_owner = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    data = folder / "db"
    run = lambda *cmd: subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=120)  # noqa: E731
    run(*as_owner, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "mlflow")
    run(*as_owner, str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(folder / "log"), "-o",
        f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start")
    try:
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow")
        yield f"postgresql+psycopg2://mlflow@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run([*as_owner, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


class Cluster:
    """The grid test's machines: coordinator checkout `c`, worker checkouts `a` and `b`, the reference `one`
    (one folder), the shared DVC remote and checkpoint folder, and the servers' URLs."""

    def __init__(self, base: Path, prefect_api: str, mlflow_url: str):
        self.base, self.prefect_api, self.mlflow_url = base, prefect_api, mlflow_url
        self.c, self.a, self.b, self.one = (base / name for name in ("c", "a", "b", "one"))
        self.remote, self.shared = base / "remote", base / "shared-checkpoints"
        self.workers: dict[str, subprocess.Popen] = {}

    def env(self, checkout: Path, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "DVC_ROOT")}
        env.update({"PREFECT_API_URL": self.prefect_api, "PREFECT_HOME": str(checkout / ".prefect"),
                    "MLFLOW_TRACKING_URI": self.mlflow_url, "PYTHONPATH": str(checkout), "DO_NOT_TRACK": "1",
                    "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
        env.update(extra)
        return env

    def start_worker(self, name: str) -> None:
        checkout = getattr(self, name)
        log = open(self.base / f"worker-{name}.log", "a")
        self.workers[name] = subprocess.Popen(
            [sys.executable, "-m", "flows.grid", "worker", "--pool", POOL, "--name", f"worker-{name}"], cwd=checkout,
            env=self.env(checkout, **WORKER_ENV), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_online(self, name: str, seconds: float = 300) -> None:
        """Wait until worker ``name`` is online in the pool (its first start creates the pool)."""
        if not wait_online(self.prefect_api, POOL, f"worker-{name}", seconds):
            raise AssertionError(f"worker-{name} is not online after {seconds} s:\n{self.worker_log(name)[-3000:]}")

    def kill_worker(self, name: str) -> int:
        """SIGKILL the worker and every process under it (its job, DVC, the stage); returns how many."""
        import psutil

        worker = psutil.Process(self.workers[name].pid)
        procs = [worker, *worker.children(recursive=True)]
        for proc in procs:
            with _suppress_gone():
                proc.send_signal(signal.SIGKILL)
        self.workers[name].wait(timeout=60)
        return len(procs)

    def worker_log(self, name: str) -> str:
        return (self.base / f"worker-{name}.log").read_text()

    def grid(self, *overrides: str, log: str, wait: bool = True):
        args = [sys.executable, "-m", "flows.grid", "run", "--pool", POOL, "--poll", "2",
                "--record", str(self.base / f"{log}.json")]
        for item in overrides:
            args += ["-S", item]
        handle = open(self.base / f"{log}.log", "w")
        proc = subprocess.Popen(args, cwd=self.c, env=self.env(self.c), stdout=handle, stderr=subprocess.STDOUT)
        if wait:
            proc.wait(timeout=3600)
        return proc

    def record(self, log: str) -> dict:
        return json.loads((self.base / f"{log}.json").read_text())

    def text(self, log: str) -> str:
        return (self.base / f"{log}.log").read_text()


class _suppress_gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        import psutil

        return kind is not None and issubclass(kind, psutil.NoSuchProcess)


@pytest.fixture(scope="module")
def cluster(postgres, tmp_path_factory):
    """Servers on 127.0.0.1 (Prefect, MLflow on PostgreSQL), a DVC remote folder, the coordinator's copy of the
    project (tiny params, committed), two worker clones running `flows.grid worker`, and a clone for the
    one-folder reference run."""
    from tests.test_pipeline_e2e import _free_port, copy_project

    base = tmp_path_factory.mktemp("grid")
    prefect_port, mlflow_port = _free_port(), _free_port()
    cluster = Cluster(base, f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}")
    mlflow_log = base / "mlflow.log"
    with open(mlflow_log, "w") as log:
        mlflow = subprocess.Popen([str(BIN / "mlflow"), "server", "--backend-store-uri", postgres, "--serve-artifacts",
                                   "--artifacts-destination", str(base / "artifacts"), "--host", "127.0.0.1",
                                   "--port", str(mlflow_port), "--workers", "1"],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    copy_project(cluster.c)
    shutil.copy(TINY, cluster.c / "params.yaml")
    cluster.remote.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=cluster.c, check=True)
    subprocess.run([str(BIN / "dvc"), "remote", "add", "-q", "-d", "storage", str(cluster.remote)], cwd=cluster.c,
                   check=True)
    _commit(cluster.c, "tiny")
    for clone in (cluster.a, cluster.b, cluster.one):
        subprocess.run(["git", "clone", "-q", str(cluster.c), str(clone)], check=True)
    # Prefect's foreman marks workers offline every 3 s here (default 15 s)
    server_env = cluster.env(cluster.c, PREFECT_SERVER_SERVICES_FOREMAN_LOOP_SECONDS="3")
    out = subprocess.run([sys.executable, "-m", "flows.server", "ensure", "--port", str(prefect_port)], cwd=cluster.c,
                         env=server_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    try:
        cluster.start_worker("a")
        cluster.start_worker("b")
        wait_http(f"{cluster.mlflow_url}/health", 600, mlflow, mlflow_log)
        cluster.wait_online("a")
        cluster.wait_online("b")
        yield cluster
    finally:
        for name, proc in list(cluster.workers.items()):
            if proc.poll() is None:
                cluster.kill_worker(name)
        subprocess.run([sys.executable, "-m", "flows.server", "stop"], cwd=cluster.c, env=server_env, timeout=120)
        os.killpg(mlflow.pid, signal.SIGTERM)
        try:
            mlflow.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(mlflow.pid, signal.SIGKILL)
            mlflow.wait(timeout=30)


def _flow_runs(cluster: Cluster) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: cluster.prefect_api}), get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["trace.grid"])),
                                     limit=200)


def _stop(*procs: subprocess.Popen) -> None:
    """SIGKILL what is still running of ``procs`` and everything under them (a failed test leaves none)."""
    import psutil

    for proc in procs:
        if proc.poll() is None:
            with _suppress_gone():
                root = psutil.Process(proc.pid)
                for child in [*root.children(recursive=True), root]:
                    with _suppress_gone():
                        child.kill()
            proc.wait(timeout=60)


def _kill_during_second_train(cluster: Cluster, grid: subprocess.Popen) -> str:
    """Wait until worker a has finished one job and its next job's train stage has saved the step-2 checkpoint
    (the step-2 trees are written after it), then SIGKILL worker a and everything under it. Returns the job."""
    from flows.common import run_config
    from trace.tree_io import tree_path

    deadline = time.monotonic() + 2400
    target = None
    while target is None:
        assert grid.poll() is None and time.monotonic() < deadline, cluster.text("grid")[-4000:]
        runs = [r for r in _flow_runs(cluster) if (r.labels or {}).get("prefect.worker.name") == "worker-a"]
        if any(r.state.is_completed() for r in runs):
            target = next((r for r in runs if r.state.is_running()), None)
        time.sleep(0.5)
    arm, seed = target.parameters["arm"], int(target.parameters["seed"])
    cfg = load_config(cluster.c / "params.yaml")
    prefix = run_config(cfg, seed).resume_hash() + "-"
    while True:
        assert grid.poll() is None and time.monotonic() < deadline, cluster.text("grid")[-4000:]
        folders = [f for f in (cluster.shared / arm).glob(prefix + "*") if f.is_dir()]
        if any(tree_path(f / "trees", arm, 2).exists() for f in folders):
            break
        time.sleep(0.05)
    assert cluster.kill_worker("a") >= 3  # worker, its job's engine, dvc and the stage
    return f"{arm}-{seed}"


SHARED_STAGES = ("prepare", "warmup", "seed_rollouts", "fit_predictor")  # check_params reads the changed params
SHARED_OUTPUTS = ("data/params_checked", "data/prepared", "data/models", "data/seed_trees", "data/predictor",
                  "data/eval/warmup.json", "metrics/warmup.json", "metrics/seed_rollouts.json",
                  "metrics/fit_predictor.json", "dvc.lock")


def _start_reference(cluster: Cluster, grid: subprocess.Popen) -> subprocess.Popen:
    """Once the coordinator has run the shared stages, the one-folder run: their outputs and dvc.lock copied to
    `one` and committed to its own cache (so that DVC takes them as done), the same params but checkpoints of its
    own, then `dvc repro` there (every train@, evaluate@ and the report one after another, in one folder, from
    nothing of the grid's but the shared stages' outputs)."""
    import yaml

    deadline = time.monotonic() + 2400
    while "jobs done already" not in cluster.text("grid"):
        assert grid.poll() is None and time.monotonic() < deadline, cluster.text("grid")[-4000:]
        time.sleep(1)
    for rel in SHARED_OUTPUTS:
        src, dst = cluster.c / rel, cluster.one / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    params = yaml.safe_load((cluster.c / "params.yaml").read_text())
    params["train"].pop("checkpoint_dir")
    (cluster.one / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = cluster.env(cluster.one, MLFLOW_TRACKING_URI=f"sqlite:///{cluster.one}/mlflow.db")
    commit = subprocess.run([str(BIN / "dvc"), "commit", "-f", *SHARED_STAGES], cwd=cluster.one, env=env,
                            capture_output=True, text=True, timeout=300)
    assert commit.returncode == 0, commit.stdout[-3000:] + commit.stderr[-3000:]
    return subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=cluster.one, stdout=open(cluster.base / "one.log", "w"),
                            stderr=subprocess.STDOUT, env=env)


def _tree_hashes(run_dir: Path) -> dict[str, str]:
    return {p.relative_to(run_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run_dir / "trees").rglob("*.parquet"))}


def _without_times(data: dict) -> dict:
    return {k: v for k, v in data.items() if "time" not in k}


@pytest.mark.slow
def test_a_pool_without_a_worker_is_refused_before_anything_runs(cluster):
    proc = subprocess.run([sys.executable, "-m", "flows.grid", "run", "--pool", "nobody-serves-this"], cwd=cluster.c,
                          env=cluster.env(cluster.c), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "work pool 'nobody-serves-this' does not exist, so no worker serves it" in proc.stderr
    assert "python -m flows.grid worker --pool nobody-serves-this" in proc.stderr and "Traceback" not in proc.stderr
    assert not (cluster.c / "dvc.lock").exists()  # no stage ran


@pytest.mark.slow
def test_the_grid_through_two_workers_equals_one_folder_and_a_killed_job_resumes_on_the_other_worker(cluster):
    """2 arms x 2 seeds through workers a and b, one folder for checkpoints both see; worker a is SIGKILLed during
    its second job's train stage. Each job lands once, the killed one on worker b from its checkpoint, and every
    tree, metrics file and report number equals `dvc repro` of the same params in one folder."""
    start = time.monotonic()
    grid = cluster.grid(*GRID_OVERRIDES, f"+train.checkpoint_dir={cluster.shared}", log="grid", wait=False)
    reference = None
    try:
        reference = _start_reference(cluster, grid)
        killed = _kill_during_second_train(cluster, grid)
        assert grid.wait(timeout=3600) == 0, cluster.text("grid")[-6000:]
        grid_seconds = time.monotonic() - start
        assert reference.wait(timeout=3600) == 0, (cluster.base / "one.log").read_text()[-4000:]
    finally:
        _stop(grid, *([reference] if reference else []))
    print(f"grid of 4 jobs with one crash: {grid_seconds:.0f} s (the one-folder run alongside)")

    record = cluster.record("grid")
    jobs = {row["job"]: row for row in record["jobs"]}
    assert sorted(jobs) == ["grpo-0", "grpo-1", "trace-0", "trace-1"] and record["report_ran"]
    assert all(row["status"] == "done" for row in jobs.values()), jobs
    runs = _flow_runs(cluster)
    assert sorted(r.parameters["arm"] + f"-{r.parameters['seed']}" for r in runs) == sorted(jobs)  # one run a job
    assert all(r.state.is_completed() for r in runs)
    assert jobs[killed]["worker"] == "worker-b" and jobs[killed]["attempts"] == 2
    assert all(row["attempts"] == 1 for name, row in jobs.items() if name != killed)
    assert {row["worker"] for row in jobs.values()} == {"worker-a", "worker-b"}
    arm = killed.split("-")[0]
    resumed = re.search(rf"resuming {arm} at step (\d+)", cluster.worker_log("b"))
    assert resumed and int(resumed.group(1)) >= 2, cluster.worker_log("b")[-4000:]
    text = cluster.text("grid")
    assert f"{killed:<16} crashed on worker-a (worker worker-a went offline); retry 1 of 2" in text
    finale = text[text.index("every job done"):]
    assert "Running stage 'report'" in finale and "Running stage 'train@" not in finale
    assert "Running stage 'evaluate@" not in finale
    assert all(row["mlflow"] and row["mlflow"].startswith(cluster.mlflow_url) for row in jobs.values())

    # the same trees, metrics and report numbers as one folder
    for name in jobs:
        arm, seed = name.split("-")
        run = Path("data") / "runs" / arm / f"s{seed}"
        assert _tree_hashes(cluster.c / run) == _tree_hashes(cluster.one / run) != {}, name
        metrics = Path("metrics") / "ablations" / arm / f"s{seed}.json"
        assert _without_times(json.loads((cluster.c / metrics).read_text())) == \
            _without_times(json.loads((cluster.one / metrics).read_text())), name
    report_c = json.loads((cluster.c / "reports" / "metrics.json").read_text())
    report_one = json.loads((cluster.one / "reports" / "metrics.json").read_text())
    assert _numbers(report_c) == _numbers(report_one)
    # two training seeds in one folder: every arm trains twice from the one warmup, the report has intervals
    ran = [line for line in (cluster.base / "one.log").read_text().splitlines() if line.startswith("Running stage")]
    assert {f"Running stage '{stage}@{name}':" for stage in ("train", "evaluate") for name in jobs} <= set(ran), ran
    assert not any(f"'{stage}'" in line for line in ran for stage in SHARED_STAGES), ran
    summary = (cluster.one / "reports" / "summary.md").read_text()
    assert "Seeds 0, 1 (2 runs per arm)" in summary and "one seed, no interval" not in summary
    assert all((cluster.one / "data" / "runs" / arm / f"s{seed}" / "final").is_dir()
               for arm in ("grpo", "trace") for seed in (0, 1))
    status = subprocess.run([str(BIN / "dvc"), "status", "--json"], cwd=cluster.c, env=cluster.env(cluster.c),
                            capture_output=True, text=True)
    assert json.loads(status.stdout or "{}") == {}, status.stdout

    # one tracking server on PostgreSQL: every evaluate run, and each train step exactly once
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cluster.mlflow_url)
    exp = client.get_experiment_by_name(load_config(cluster.c / "params.yaml").tracking.experiment_name)
    for name in jobs:
        arm, seed = name.split("-")
        evals = client.search_runs([exp.experiment_id], f"tags.`trace.stage` = 'evaluate' and "
                                   f"tags.`trace.ablation` = '{arm}' and tags.`trace.seed` = '{seed}'")
        assert len(evals) == 1, name
        train = client.search_runs([exp.experiment_id], f"tags.`trace.stage` = 'train' and tags.`trace.ablation` = "
                                   f"'{arm}' and tags.`trace.seed` = '{seed}'", order_by=["attributes.start_time DESC"])
        steps = sorted(m.step for m in client.get_metric_history(train[0].info.run_id, "tokens/cumulative"))
        assert steps == [0, 1, 2, 3], (name, steps)


_NOT_RESULTS = ("time", "sec_step", "s/step", "url", "run_id")  # wall-clock times and MLflow links


def _numbers(data, prefix=""):
    """Every number of a nested report, by its path; times and MLflow links left out."""
    out = {}
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for key, value in items:
        path = f"{prefix}/{key}"
        if any(word in path for word in _NOT_RESULTS):
            continue
        if isinstance(value, (dict, list)):
            out.update(_numbers(value, path))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[path] = value
    return out


@pytest.mark.slow
def test_a_second_grid_after_a_complete_grid_runs_no_job(cluster):
    before = len(_flow_runs(cluster))
    summary = (cluster.c / "reports" / "summary.md").stat().st_mtime
    proc = cluster.grid(*GRID_OVERRIDES, f"+train.checkpoint_dir={cluster.shared}", log="again")
    assert proc.returncode == 0, cluster.text("again")[-4000:]
    record = cluster.record("again")
    assert record["submitted"] == [] and not record["report_ran"]
    assert "4 of 4 jobs done already; 0 to run" in cluster.text("again")
    assert len(_flow_runs(cluster)) == before
    assert (cluster.c / "reports" / "summary.md").stat().st_mtime == summary


@pytest.mark.slow
def test_a_job_with_a_bad_param_fails_once_the_others_land_and_a_rerun_runs_only_it(cluster):
    """allocation.group_size above the budget is valid for grpo but not for dapo, which cannot sample one group:
    dapo-0 fails on its worker, once, and grpo-0 lands; the same command again submits dapo-0 alone."""
    if cluster.workers["a"].poll() is not None:
        cluster.start_worker("a")  # the machine is back
        cluster.wait_online("a")
    subprocess.run(["git", "checkout", "-q", "params.yaml"], cwd=cluster.c, check=True)
    bad = ["train.seeds=[0]", "train.ablations=[grpo,dapo]", "allocation.group_size=32"]
    proc = cluster.grid(*bad, log="bad")
    text = cluster.text("bad")
    assert proc.returncode == 1, text[-4000:]
    jobs = {row["job"]: row for row in cluster.record("bad")["jobs"]}
    assert jobs["grpo-0"]["status"] == "done" and jobs["dapo-0"]["status"] == "failed"
    assert jobs["dapo-0"]["attempts"] == 1 and "dapo cannot sample one group" in jobs["dapo-0"]["message"]
    assert "1 of 2 jobs failed: dapo-0" in text and "Running stage 'report'" not in text
    status = subprocess.run([str(BIN / "dvc"), "status", "--json", "train@grpo-0", "evaluate@grpo-0"], cwd=cluster.c,
                            env=cluster.env(cluster.c), capture_output=True, text=True)
    assert json.loads(status.stdout or "{}") == {}, status.stdout  # grpo-0 landed here

    proc = cluster.grid(*bad, log="bad-again")
    assert proc.returncode == 1
    assert cluster.record("bad-again")["submitted"] == ["dapo-0"]
    assert "1 of 2 jobs done already; 1 to run: dapo-0" in cluster.text("bad-again")
