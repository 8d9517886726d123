"""The grid's engine: makespan through 1 and 2 Prefect workers, and the per-job overhead of running a job there.

Setting: the committed repository cloned to a temporary folder (the coordinator, ``git clone``: committed files
only) with ``tests/params_tiny.yaml`` as params.yaml, a DVC remote in a folder, workers in clones of it, a
Prefect server (``flows.server``), and an MLflow tracking server on PostgreSQL (a private cluster, as
``tests/test_grid.py`` starts it; on a SQLite file where PostgreSQL's binaries are missing: the report says which).
Two grids of 2 arms x 2 seeds (4 jobs) run with ``python -m flows.grid run``:
- through 1 worker (``-S train.seeds=[0,1] -S train.ablations=[grpo,trace]``);
- through 2 workers, the same with ``-S advantages.clip=4.5`` (new train@ and evaluate@ stages, the shared stages
  cached, so both grids run the same amount of work).
The makespan is the first job's submission to the last job's end; the command's wall time (checks, shared
stages, restore, report) is reported beside it.

Per-job overhead of the engine (medians over the jobs of both grids): submit -> start (flow run created to
Running, for jobs a worker was free for), start -> first task (the job's process, the pull step, the checkout
check), ``dvc pull``, ``dvc push`` (outputs, run-cache entries and the files they name), and the coordinator's
restore from the run-cache per job. Its share is of a default train stage: ``train.num_steps`` of params.yaml
times the default step's seconds in ``reports/benchmarks/orchestration.json`` (measured there on this machine).

On 2 cores, two workers do not halve the makespan: both jobs' stages compete for the same cores (and the
machine's other load, recorded), so the ratio says how much of a job is waiting rather than computing.

``--quick``: 1 arm x 1 seed per grid (2 jobs in all); still minutes (servers and stage processes start).

Usage: ``python -m benchmarks.grid [--quick]``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import yaml

from benchmarks.common import REPO_ROOT, figure_path, parse_args, pyplot, write_report

NAME = "grid"
BIN = Path(sys.executable).parent
POOL = "bench"
WORKER_ENV = {"PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_LOGGING_LEVEL": "INFO"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, seconds: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Wait until ``url`` answers 200; stop early when ``proc`` (the server) exits.

    Raises:
        RuntimeError: no answer within ``seconds``; the message ends with the tail of ``log``.
    """
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(1)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{url} did not answer within {seconds} s\n{tail}")


def postgres_bindir() -> Path | None:
    """The folder of PostgreSQL's initdb, pg_ctl and createdb (Debian keeps them in /usr/lib/postgresql/<v>/bin,
    newest version first); None where they are missing."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    candidates += sorted((p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")),
                         key=lambda p: int(p.parts[-2]) if p.parts[-2].isdigit() else 0, reverse=True)
    return next((c for c in candidates if all((c / name).exists() for name in ("initdb", "pg_ctl", "createdb"))),
                None)


def wait_online(prefect_api: str, pool: str, name: str, seconds: float = 300) -> bool:
    """Wait until worker ``name`` of ``pool`` is online (``flows.grid.online_workers``); False after ``seconds``."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.grid import online_workers

    deadline = time.monotonic() + seconds
    with temporary_settings(updates={PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if name in (online_workers(client, pool) or []):
                return True
            time.sleep(2)
    return False


def _env(checkout: Path, prefect_api: str, mlflow_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "DVC_ROOT")}
    env.update({"PREFECT_API_URL": prefect_api, "PREFECT_HOME": str(checkout / ".prefect"),
                "MLFLOW_TRACKING_URI": mlflow_url, "PYTHONPATH": str(checkout), "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"})
    env.update(extra)
    return env


def _postgres(folder: Path) -> tuple[str, list[str]] | None:
    """Start a private PostgreSQL cluster; returns (backend URI, stop command), or None without its binaries."""
    bindir = postgres_bindir()
    if bindir is None:
        return None
    folder.mkdir(parents=True)
    owner: list[str] = []
    if os.geteuid() == 0:
        os.chmod(folder, 0o755)
        shutil.chown(folder, user="postgres")
        owner = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    run = lambda *cmd: subprocess.run(list(cmd), check=True, capture_output=True, timeout=120)  # noqa: E731
    run(*owner, str(bindir / "initdb"), "-D", str(folder / "db"), "-A", "trust", "-U", "mlflow")
    run(*owner, str(bindir / "pg_ctl"), "-D", str(folder / "db"), "-w", "-l", str(folder / "log"), "-o",
        f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start")
    run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow")
    return (f"postgresql+psycopg2://mlflow@127.0.0.1:{port}/mlflow",
            [*owner, str(bindir / "pg_ctl"), "-D", str(folder / "db"), "-m", "fast", "stop"])


def _tree_kill(proc: subprocess.Popen) -> None:
    import psutil

    try:
        root = psutil.Process(proc.pid)
        for child in [root, *root.children(recursive=True)]:
            child.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait(timeout=60)


def _grid(coordinator: Path, env: dict, overrides: list[str], record: Path, log: Path) -> tuple[dict, float]:
    args = [sys.executable, "-m", "flows.grid", "run", "--pool", POOL, "--poll", "2", "--record", str(record)]
    for item in overrides:
        args += ["-S", item]
    start = time.perf_counter()
    with open(log, "w") as handle:
        status = subprocess.run(args, cwd=coordinator, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                timeout=7200).returncode
    seconds = time.perf_counter() - start
    if status:
        raise RuntimeError(f"the grid exited with {status}; see {log}:\n{log.read_text()[-3000:]}")
    return json.loads(record.read_text()), seconds


def _job_phases(record: dict) -> list[dict]:
    """Per job: submitted, started, ended (unix seconds), its worker, and the seconds of its tasks."""
    return [{"job": row["job"], "worker": row["worker"], "submitted": row["submitted"], "started": row["started"],
             "ended": row["ended"], "seconds": row["seconds"]} for row in record["jobs"]]


def _first_task_delay(prefect_api: str, record: dict) -> list[float]:
    """Per job: seconds from its flow run's start to its first task's start (process, pull step, checkout)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    out = []
    with temporary_settings(updates={PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as client:
        for row in record["jobs"]:
            run = client.read_flow_run(row["flow_run_id"])
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            starts = [t.start_time for t in tasks if t.start_time]
            if run.start_time and starts:
                out.append((min(starts) - run.start_time).total_seconds())
    return out


def _pickup_seconds(phases: list[dict], workers: int) -> list[float]:
    """Submit -> start of the jobs a worker was free for: the first ``workers`` jobs to start."""
    first = sorted(phases, key=lambda p: p["started"])[:workers]
    return [p["started"] - p["submitted"] for p in first]


def _default_train_stage_seconds() -> dict:
    """A default train stage on this machine: params.yaml's train.num_steps x the default step's seconds of
    ``reports/benchmarks/orchestration.json``."""
    steps = int(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["train"]["num_steps"])
    report = json.loads((REPO_ROOT / "reports" / "benchmarks" / "orchestration.json").read_text())
    step = float(report["results"]["headline"]["step_seconds"])
    return {"num_steps": steps, "step_seconds": step, "seconds": steps * step,
            "source": "params.yaml train.num_steps x reports/benchmarks/orchestration.json step_seconds",
            "orchestration_machine_load_1m": report["machine"].get("load_average_1m")}


def _median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _plot(grids: dict, out_dir: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(grids), 1, figsize=(9, 2.2 * len(grids)), squeeze=False)
    for ax, (label, grid) in zip(axes[:, 0], grids.items()):
        phases = grid["jobs"]
        t0 = min(p["submitted"] for p in phases)
        workers = sorted({p["worker"] for p in phases})
        for p in phases:
            y = workers.index(p["worker"])
            ax.barh(y, p["started"] - p["submitted"], left=p["submitted"] - t0, color="#dddddd", height=0.5)
            ax.barh(y, p["ended"] - p["started"], left=p["started"] - t0, color="#4c72b0", height=0.5)
            ax.text(p["started"] - t0 + 1, y, p["job"], va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(workers)), workers)
        ax.set_title(f"{label}: makespan {grid['makespan_seconds']:.0f} s (grey: queued, blue: running)", fontsize=9)
        ax.set_xlabel("seconds since the first submission")
    fig.tight_layout()
    fig.savefig(figure_path(NAME, out_dir), dpi=120)
    plt.close(fig)


DOCS_MARKER = "grid-benchmark"  # docs/scale.md holds docs_table(report) between <!-- grid-benchmark --> markers


def docs_table(report: dict) -> str:
    """The Markdown table of ``docs/scale.md`` made from a report of this benchmark (``tests/test_grid.py``
    checks that the docs hold exactly this for the committed ``reports/benchmarks/grid.json``)."""
    res = report["results"]
    head, over, stage = res["headline"], res["per_job_overhead_seconds"], res["default_train_stage"]
    loads = ", ".join(f"{v:.1f}" for v in res["machine_load_1m_before_between_after"])
    rows = [
        ("makespan, 4 tiny jobs, 1 worker", f"{head['makespan_1_worker_seconds']:.0f} s"),
        ("makespan, 4 tiny jobs, 2 workers", f"{head['makespan_2_workers_seconds']:.0f} s "
                                              f"({head['speedup_2_workers']:.2f}x)"),
        ("per job: submit -> start (a free worker)", f"{over['submit_to_start']:.1f} s"),
        ("per job: start -> first task (process, pull step, checkout)", f"{over['start_to_first_task']:.1f} s"),
        ("per job: `dvc pull`", f"{over['dvc_pull']:.1f} s"),
        ("per job: `dvc push` (outputs, run-cache)", f"{over['dvc_push']:.1f} s"),
        ("per job: restore from the run-cache (coordinator)", f"{over['run_cache_restore']:.1f} s"),
        ("per job: engine overhead in all", f"{over['total']:.1f} s"),
        (f"default train stage ({stage['num_steps']} steps x {stage['step_seconds']:.2f} s)",
         f"{stage['seconds']:.0f} s"),
        ("overhead / default train stage", f"{head['overhead_share_of_default_train_stage']:.0%} (target < 5 %)"),
        ("a train stage this long makes it 5 %", f"{head['stage_seconds_for_5pct'] / 60:.0f} min"),
    ]
    lines = ["| measured (`reports/benchmarks/grid.json`) | |", "|---|---:|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines.append(f"\nAt commit {report['git_commit'][:7]}, {report['machine']['cpu_count']} cores, load (1 min) "
                 f"{loads} before, between and after the grids; tracking on {res['tracking_backend']}.")
    return "\n".join(lines)


def update_docs(report: dict, doc: Path = REPO_ROOT / "docs" / "scale.md") -> None:
    """Put ``docs_table(report)`` between the ``grid-benchmark`` markers of ``doc``."""
    text = doc.read_text()
    begin, end = f"<!-- {DOCS_MARKER} -->", f"<!-- /{DOCS_MARKER} -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{docs_table(report)}\n{end}{tail}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    started = time.perf_counter()
    seeds, arms = ("[0]", "[grpo]") if args.quick else ("[0,1]", "[grpo,trace]")
    base_overrides = [f"train.seeds={seeds}", f"train.ablations={arms}"]
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="trace-grid-bench-", dir="/tmp") as tmp:
        base = Path(tmp)
        os.chmod(base, 0o755)  # the postgres user reaches its cluster folder through it
        coordinator = base / "c"
        subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(coordinator)], check=True)
        shutil.copy(REPO_ROOT / "tests" / "params_tiny.yaml", coordinator / "params.yaml")
        (base / "remote").mkdir()
        subprocess.run([str(BIN / "dvc"), "remote", "add", "-q", "-d", "storage", str(base / "remote")],
                       cwd=coordinator, check=True)
        subprocess.run(["git", "add", "-A"], cwd=coordinator, check=True)
        subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm",
                        "tiny params"], cwd=coordinator, check=True)
        for name in ("a", "b"):
            subprocess.run(["git", "clone", "-q", str(coordinator), str(base / name)], check=True)

        pg = _postgres(base / "pg")
        backend = pg[0] if pg else f"sqlite:///{base / 'mlflow.db'}"
        prefect_port, mlflow_port = _free_port(), _free_port()
        prefect_api, mlflow_url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
        env = _env(coordinator, prefect_api, mlflow_url)
        procs: list[subprocess.Popen] = []
        workers: dict[str, subprocess.Popen] = {}
        try:
            procs.append(subprocess.Popen(
                [str(BIN / "mlflow"), "server", "--backend-store-uri", backend, "--serve-artifacts",
                 "--artifacts-destination", str(base / "artifacts"), "--host", "127.0.0.1", "--port",
                 str(mlflow_port), "--workers", "1"], stdout=open(base / "mlflow.log", "w"),
                stderr=subprocess.STDOUT, start_new_session=True))
            subprocess.run([sys.executable, "-m", "flows.server", "ensure", "--port", str(prefect_port)],
                           cwd=coordinator, env=env, check=True, capture_output=True, timeout=300)
            wait_http(f"{mlflow_url}/health", 600)

            def start_worker(name: str) -> None:
                checkout = base / name
                workers[name] = subprocess.Popen(
                    [sys.executable, "-m", "flows.grid", "worker", "--pool", POOL, "--name", f"worker-{name}"],
                    cwd=checkout, env=_env(checkout, prefect_api, mlflow_url, **WORKER_ENV),
                    stdout=open(base / f"worker-{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
                if not wait_online(prefect_api, POOL, f"worker-{name}"):
                    raise RuntimeError(f"worker-{name} did not come online within 300 s")

            grids = {}
            start_worker("a")
            record, seconds = _grid(coordinator, env, base_overrides, base / "one.json", base / "one.log")
            loads.append(os.getloadavg()[0])
            grids["1 worker"] = {"record": record, "command_seconds": seconds}
            start_worker("b")
            record, seconds = _grid(coordinator, env, [*base_overrides, "advantages.clip=4.5"], base / "two.json",
                                    base / "two.log")
            loads.append(os.getloadavg()[0])
            grids["2 workers"] = {"record": record, "command_seconds": seconds}
            first_task = {label: _first_task_delay(prefect_api, g["record"]) for label, g in grids.items()}
        finally:
            for proc in workers.values():
                _tree_kill(proc)
            subprocess.run([sys.executable, "-m", "flows.server", "stop"], cwd=coordinator, env=env, timeout=120)
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            if pg:
                subprocess.run(pg[1], capture_output=True, timeout=120)

    results: dict = {"grids": {}}
    all_phases = []
    for count, (label, grid) in enumerate(grids.items(), start=1):
        phases = _job_phases(grid["record"])
        all_phases += phases
        makespan = max(p["ended"] for p in phases) - min(p["submitted"] for p in phases)
        jobs = len(phases)
        results["grids"][label] = {
            "workers": count, "jobs": phases, "makespan_seconds": makespan,
            "command_seconds": grid["command_seconds"], "coordinator_seconds": grid["record"]["seconds"],
            "restore_seconds_per_job": grid["record"]["seconds"]["restore_after"] / jobs,
            "pickup_seconds": _pickup_seconds(phases, count), "first_task_seconds": first_task[label]}
    one, two = results["grids"]["1 worker"], results["grids"]["2 workers"]
    overhead = {
        "submit_to_start": _median(one["pickup_seconds"] + two["pickup_seconds"]),
        "start_to_first_task": _median(one["first_task_seconds"] + two["first_task_seconds"]),
        "dvc_pull": _median([p["seconds"].get("dvc-pull") for p in all_phases]),
        "dvc_push": _median([p["seconds"].get("dvc-push") for p in all_phases]),
        "run_cache_restore": statistics.fmean([one["restore_seconds_per_job"], two["restore_seconds_per_job"]]),
    }
    overhead["total"] = sum(v for v in overhead.values() if v is not None)
    repro = _median([p["seconds"].get("dvc-repro") for p in all_phases])
    stage = _default_train_stage_seconds()
    share = overhead["total"] / stage["seconds"]
    results["per_job_overhead_seconds"] = overhead
    results["tiny_job_repro_seconds"] = repro
    results["default_train_stage"] = stage
    results["machine_load_1m_before_between_after"] = [round(v, 2) for v in loads]
    results["tracking_backend"] = "postgresql" if pg else "sqlite (PostgreSQL binaries missing)"
    results["headline"] = {
        "makespan_1_worker_seconds": one["makespan_seconds"], "makespan_2_workers_seconds": two["makespan_seconds"],
        "speedup_2_workers": one["makespan_seconds"] / two["makespan_seconds"],
        "per_job_overhead_seconds": overhead["total"], "default_train_stage_seconds": stage["seconds"],
        "overhead_share_of_default_train_stage": share,
        # the train stage length at which this overhead is 5 %
        "stage_seconds_for_5pct": overhead["total"] / 0.05,
        "targets": {"overhead_under_5pct_of_default_train_stage": share < 0.05},
    }
    _plot(results["grids"], args.out)
    settings = {"params": "tests/params_tiny.yaml", "overrides": base_overrides,
                "second_grid_extra": "advantages.clip=4.5", "worker_query_seconds": 2, "poll_seconds": 2,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1")}
    path = write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    if not args.quick and Path(args.out).resolve() == (REPO_ROOT / "reports" / "benchmarks").resolve():
        update_docs(json.loads(path.read_text()))
    return results


if __name__ == "__main__":
    head = main()["headline"]
    print(json.dumps(head, indent=2))
