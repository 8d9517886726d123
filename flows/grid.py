"""The grid at scale: one Prefect flow run per (arm, seed), placed on process workers; stage results move through DVC.

A study is a grid, ``train.ablations`` x ``train.seeds``, each job the pair ``train@<arm>-<seed>`` +
``evaluate@<arm>-<seed>`` after one shared warmup and predictor. ``run`` fans it out on an existing engine:

1. It checks first and refuses with the reason: the code is committed (workers run the commit), params.yaml
   is the commit's plus the ``-S`` overrides, the DVC remote (the default one) answers, the MLflow tracking
   server answers (one server for every worker: ``mlflow server`` on PostgreSQL), and the work pool has an
   online worker that polls the queue ``ranks-<launch.num_processes>``.
2. It runs the shared stages once, here (``dvc repro fit_predictor``), and pushes their outputs to the remote.
3. It submits one flow run of the deployment ``trace-grid-job/<pool>`` per job that is neither recorded in
   ``dvc.lock`` nor in the remote's run-cache. A process worker (``python -m flows.grid worker``, one per GPU or
   group of GPUs, started in its own checkout of the same commit) runs ``grid_job`` there: it writes this
   params.yaml and dvc.lock, ``dvc pull``s the outputs train@ reads, runs exactly ``dvc repro --single-item
   train@<arm>-<seed> evaluate@<arm>-<seed>`` and pushes their outputs and the run-cache.
4. It shows each job as it goes (queued, running on which worker, done or failed, the MLflow run link). A job
   whose worker went offline (killed, machine lost) is set Crashed and rescheduled, up to ``--retries`` times,
   and resumes from its last checkpoint when ``train.checkpoint_dir`` is a folder every worker sees. A job that
   fails on its own (its stage exits non-zero: a bad param, a missing file) fails once.
5. It restores every finished job's stages from the run-cache here and runs ``dvc repro`` (``dvc exp run``
   with ``-S``): DVC restores each train@ and evaluate@ instead of running it, and only the report runs, so
   ``dvc.lock``, ``metrics/``, ``dvc exp show`` and ``reports/summary.md`` are those of a local run. Running
   the same command again runs only the jobs that are missing or failed.

Placement, queues, concurrency (one job per worker at a time), crash states and retries are Prefect's; what
is done and what reruns is DVC's. Nothing here schedules, queues or talks to workers.

DVC 3 gaps this works around: ``dvc push --run-cache`` no longer pushes the files its entries name, so a
metrics file (``cache: false``) of a stage would be missing elsewhere (``flows.grid_dvc.push_run_cache_files``
pushes them); and the worker receives the coordinator's ``dvc.lock`` (the pointer file, as ``git pull`` would
bring it) instead of restoring the shared stages from the run-cache, which keeps no entry for a stage with an
uncached plain output.

Usage:
    python -m flows.grid run --pool gpus [-S train.seeds=[0,1,2] ...] [--retries 2] [--record grid.json]
    python -m flows.grid worker --pool gpus [--devices 0,1] [--name node1-gpu01]   # in each checkout
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flows.common import REPO_ROOT, setup_process_env
from flows.grid_dvc import GridError, check_remote, command_env, dvc, executable, grid_params, head_commit, \
    restore_from_run_cache, run_command, uncommitted_code
from flows.grid_job import GRID_TAG, KEY_TAG_PREFIX, Job, grid_job, grid_jobs, job_key, prepare_checkout, queue_name
from flows.grid_pool import RunLinks, _crash_count, _reason, _read_runs_by_key, check_pool, ensure_deployment, \
    online_workers, tracking_uri, worker_command
from trace.errors import user_errors

# the job, the engine side and the coordinator live in three modules; these names are the grid's public surface
__all__ = ["GridResult", "Job", "JobRecord", "RunLinks", "check_pool", "ensure_deployment", "format_summary", "grid_job",
           "grid_jobs", "job_key", "main", "online_workers", "prepare_checkout", "queue_name", "run_grid", "tracking_uri",
           "worker_command"]

# ---- the coordinator ------------------------------------------------------------------------------------------
@dataclass
class JobRecord:
    """What the coordinator knows of one job."""

    job: Job
    status: str = "missing"  # done (restored here) | queued | running | retrying | completed | failed
    flow_run_id: str | None = None
    worker: str | None = None
    attempts: int = 0
    message: str = ""
    link: str | None = None
    submitted: float | None = None  # unix seconds
    started: float | None = None
    ended: float | None = None
    seconds: dict = field(default_factory=dict)

    def row(self) -> dict:
        return {"job": self.job.name, "arm": self.job.arm, "seed": self.job.seed, "status": self.status,
                "worker": self.worker, "attempts": self.attempts, "message": self.message, "mlflow": self.link,
                "flow_run_id": self.flow_run_id, "submitted": self.submitted, "started": self.started,
                "ended": self.ended, "seconds": self.seconds}


def _ts(value) -> float | None:
    return value.timestamp() if value is not None else None


def _clock(seconds: float | None) -> str:
    return dt.datetime.fromtimestamp(seconds).strftime("%H:%M:%S") if seconds else "-"


@dataclass
class GridResult:
    """The outcome of ``run_grid``."""

    commit: str
    jobs: list[JobRecord]
    submitted: list[str]
    report_ran: bool
    seconds: dict

    @property
    def failed(self) -> list[JobRecord]:
        return [r for r in self.jobs if r.status == "failed"]

    def to_dict(self) -> dict:
        return {"commit": self.commit, "submitted": self.submitted, "report_ran": self.report_ran,
                "seconds": self.seconds, "jobs": [r.row() for r in self.jobs]}


def run_grid(root: Path, pool: str, overrides: list[str] | None = None, retries: int = 2, poll_s: float = 5.0,
             timeout_s: float | None = None, out: Callable[[str], None] = print) -> GridResult:
    """Run the grid of ``root``'s params (with ``overrides``) on the work pool ``pool``; see the module docstring.

    Args:
        root: the coordinator's checkout (committed code).
        pool: the Prefect work pool (type process) the workers serve.
        overrides: ``-S`` overrides, as ``dvc exp run -S``.
        retries: how many times a crashed job (its worker went offline) is rescheduled.
        poll_s: seconds between looks at the jobs.
        timeout_s: give up waiting after this long (None: wait); unfinished jobs go on and a later run attaches.
        out: where progress lines go.

    Returns:
        ``GridResult``: per job its status, worker, attempts, times and MLflow link.

    Raises:
        GridError: a check failed before anything ran, or a shared stage failed.
    """
    from prefect.client.orchestration import get_client

    from trace.configuration.params_file import load_config

    overrides = list(overrides or [])
    timings: dict[str, float] = {}
    began = time.perf_counter()
    commit = head_commit(root)
    changed = uncommitted_code(root)
    if changed:
        raise GridError(f"uncommitted changes in {changed[:5]}: workers run commit {commit[:12]}, so commit them "
                        "(or `git stash`; an untracked file that is no code: add it to .gitignore) first")
    params_text = grid_params(root, overrides, commit)
    cfg = load_config(root / "params.yaml")
    remote_url = check_remote(root)
    uri = tracking_uri(cfg)
    if not os.environ.get("PREFECT_API_URL"):
        raise GridError("no Prefect server: the workers and this command share one; export PREFECT_API_URL="
                        "http://<host>:4200/api (`prefect server start --host 0.0.0.0` on one machine)")
    queue = queue_name(cfg.launch.num_processes)
    jobs = grid_jobs(cfg)
    env = command_env(root, {"MLFLOW_TRACKING_URI": uri})
    with get_client(sync_client=True) as client:
        online = check_pool(client, pool, queue)
        out(f"grid of {len(jobs)} jobs at {commit[:12]}: pool {pool!r} (online: {', '.join(online)}), queue "
            f"{queue!r}, DVC remote {remote_url}, MLflow {uri}")
        if cfg.train.checkpoint_dir is None:
            out("note: train.checkpoint_dir is unset, so checkpoints stay on each worker: a crashed job restarts "
                "from step 0 elsewhere (set it to a folder every worker sees)")
        timings["checks"] = time.perf_counter() - began

        start = time.perf_counter()
        out("shared stages: dvc repro fit_predictor")
        dvc(root, env, "repro", "fit_predictor")
        dvc(root, env, "push", "--with-deps", "fit_predictor", echo=None)
        timings["shared"] = time.perf_counter() - start

        start = time.perf_counter()
        restored = restore_from_run_cache(root, {job: job.stages for job in jobs})
        records = {job: JobRecord(job) for job in jobs}
        for job, why in restored.items():
            if why is None:
                records[job].status, records[job].message = "done", "restored from the run-cache"
        timings["restore_before"] = time.perf_counter() - start
        todo = [job for job in jobs if records[job].status != "done"]
        out(f"{len(jobs) - len(todo)} of {len(jobs)} jobs done already; {len(todo)} to run"
            + (f": {', '.join(j.name for j in todo)}" if todo else ""))

        links = RunLinks(cfg, uri)
        submitted: list[str] = []
        if todo:
            deployment_id = ensure_deployment(client, pool)
            lock_text = (root / "dvc.lock").read_text()
            keys = {job_key(cfg, job, commit): job for job in todo}
            existing = _read_runs_by_key(client, deployment_id, keys)
            for key, job in keys.items():
                rec = records[job]
                alive = [r for r in existing.get(job, []) if not r.state.is_final()]
                if alive:
                    rec.flow_run_id, rec.status = str(alive[0].id), "queued"
                    out(f"{job.name}: attached to its unfinished flow run {alive[0].name}")
                    continue
                run = client.create_flow_run_from_deployment(
                    deployment_id, parameters={"arm": job.arm, "seed": job.seed, "commit": commit,
                                               "params_text": params_text, "lock_text": lock_text},
                    tags=[GRID_TAG, KEY_TAG_PREFIX + key], work_queue_name=queue,
                    job_variables={"env": {"MLFLOW_TRACKING_URI": uri}}, name=f"grid-{job.name}")
                rec.flow_run_id, rec.status, rec.submitted = str(run.id), "queued", time.time()
                submitted.append(job.name)
                out(f"{_clock(time.time())}  {job.name:<16} queued ({run.name})")
            _watch(client, pool, [records[j] for j in todo], links, retries, poll_s, timeout_s, out)

        start = time.perf_counter()
        finished = [job for job in todo if records[job].status == "completed"]
        if finished:
            for job, why in restore_from_run_cache(root, {job: job.stages for job in finished}).items():
                if why is None:
                    records[job].status = "done"
                else:
                    records[job].status, records[job].message = "failed", f"finished, but not restorable: {why}"
        timings["restore_after"] = time.perf_counter() - start

        start = time.perf_counter()
        report_ran = False
        if not todo and not _pipeline_changed(root, env):
            out("every job done and the report up to date: nothing to run")
        elif all(r.status == "done" for r in records.values()):
            cmd = ["exp", "run"] if overrides else ["repro"]
            out(f"every job done: dvc {' '.join(cmd)} (train@ and evaluate@ from the run-cache, then the report)")
            ran_here: list[str] = []

            def echo(line: str) -> None:
                print(line)
                if line.startswith(("Running stage 'train@", "Running stage 'evaluate@")):
                    ran_here.append(line)

            dvc(root, env, *cmd, echo=echo)
            report_ran = True
            if ran_here:
                out(f"warning: these stages ran here instead of being restored: {ran_here}")
        elif finished:
            done = [name for job in finished if records[job].status == "done" for name in job.stages]
            if done:  # record the landed jobs in dvc.lock; the report waits for the rest
                dvc(root, env, "repro", *done, echo=None)
        timings["final"] = time.perf_counter() - start
        timings["total"] = time.perf_counter() - began
        for rec in records.values():
            rec.link = links.link(rec.job, since=rec.started) or rec.link
        if any(r.flow_run_id for r in records.values()):
            _read_task_seconds(client, records.values())
    return GridResult(commit, list(records.values()), submitted, report_ran, timings)


def _pipeline_changed(root: Path, env: dict[str, str]) -> bool:
    """Whether ``dvc status`` finds any stage of the pipeline out of date."""
    status, tail = run_command([executable("dvc"), "status", "--json"], root, env, echo=None)
    try:
        return status != 0 or bool(json.loads("\n".join(tail) or "{}"))
    except json.JSONDecodeError:
        return True


def _watch(client, pool: str, records: list[JobRecord], links: RunLinks, retries: int, poll_s: float,
           timeout_s: float | None, out: Callable[[str], None]) -> None:
    """Follow the flow runs until each is final; a run whose worker is offline (Prefect's own verdict: it
    missed its heartbeats) in two looks in a row is set Crashed and, up to ``retries`` times, rescheduled
    (AwaitingRetry: any worker of the queue takes it)."""
    from prefect.client.schemas.objects import StateType, WorkerStatus
    from prefect.states import AwaitingRetry, Crashed

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(records)
    warned_idle = False
    offline_before: set[str] = set()
    while pending:
        workers = {w.name: w.status for w in client.read_workers_for_work_pool(pool)}
        offline = {name for name, status in workers.items() if status != WorkerStatus.ONLINE}
        gone, offline_before = offline & offline_before, offline
        if not any(s == WorkerStatus.ONLINE for s in workers.values()) and not warned_idle:
            out(f"warning: pool {pool!r} has no online worker now; the jobs wait for one")
            warned_idle = True
        for rec in list(pending):
            run = client.read_flow_run(rec.flow_run_id)
            state = run.state
            worker = (run.labels or {}).get("prefect.worker.name")
            if rec.submitted is None:
                rec.submitted = _ts(run.expected_start_time) or _ts(run.created)
            if state.type in (StateType.RUNNING, StateType.PENDING) and worker and \
                    (worker in gone or worker not in workers):
                client.set_flow_run_state(run.id, Crashed(message=f"worker {worker} went offline"), force=True)
                continue  # next look sees it Crashed
            if state.type == StateType.RUNNING and rec.status != "running":
                rec.status, rec.worker = "running", worker
                rec.started = rec.started or _ts(run.start_time) or time.time()
                out(f"{_clock(time.time())}  {rec.job.name:<16} running on {worker} (attempt {run.run_count})")
            if rec.status == "running" and rec.link is None:
                rec.link = links.link(rec.job, since=rec.started)
                if rec.link:
                    out(f"{_clock(time.time())}  {rec.job.name:<16} MLflow {rec.link}")
            if state.type == StateType.CRASHED:
                rec.attempts = _crash_count(client, run.id)
                if rec.attempts <= retries:
                    out(f"{_clock(time.time())}  {rec.job.name:<16} crashed on {worker} ({state.message}); "
                        f"retry {rec.attempts} of {retries}")
                    client.set_flow_run_state(run.id, AwaitingRetry(), force=True)
                    rec.status = "retrying"
                    continue
            if state.is_final():
                rec.attempts = run.run_count
                rec.worker = worker or rec.worker
                rec.ended = _ts(run.end_time) or time.time()
                rec.started = rec.started or _ts(run.start_time)
                if state.type == StateType.COMPLETED:
                    rec.status = "completed"
                else:
                    rec.status, rec.message = "failed", _reason(state)
                minutes = (rec.ended - rec.started) / 60 if rec.started else float("nan")
                out(f"{_clock(time.time())}  {rec.job.name:<16} {rec.status} on {rec.worker} after {minutes:.1f} "
                    f"min{'' if rec.status == 'completed' else ': ' + rec.message}")
                pending.remove(rec)
        if pending and deadline is not None and time.monotonic() > deadline:
            for rec in pending:
                rec.status, rec.message = "failed", "still unfinished at --timeout (it goes on; run again to attach)"
            return
        if pending:
            time.sleep(poll_s)


def _read_task_seconds(client, records) -> None:
    """Each job's seconds in the job's tasks (dvc-pull, dvc-repro, dvc-push) of its last attempt."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    for rec in records:
        if not rec.flow_run_id:
            continue
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[rec.flow_run_id])))
        for run in tasks:
            name = run.name.rsplit("-", 1)[0]  # "dvc-pull-1a2" -> "dvc-pull"
            if run.start_time and run.end_time:
                rec.seconds[name] = (run.end_time - run.start_time).total_seconds()


def format_summary(result: GridResult) -> str:
    """The per-job table: status, worker, attempts, start and end, minutes, MLflow link."""
    lines = [f"{'job':<16} {'status':<9} {'worker':<14} {'tries':>5}  {'start':>8}  {'end':>8}  {'min':>5}  mlflow"]
    for rec in result.jobs:
        minutes = f"{(rec.ended - rec.started) / 60:.1f}" if rec.started and rec.ended else "-"
        lines.append(f"{rec.job.name:<16} {rec.status:<9} {rec.worker or '-':<14} {rec.attempts:>5}  "
                     f"{_clock(rec.started):>8}  {_clock(rec.ended):>8}  {minutes:>5}  {rec.link or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the grid on a work pool's workers and wait")
    run_p.add_argument("--pool", required=True, help="Prefect work pool (type process) the workers serve")
    run_p.add_argument("-S", "--set-param", action="append", default=[], dest="overrides",
                       help="param override KEY=VALUE (repeatable), as dvc exp run -S")
    run_p.add_argument("--retries", type=int, default=2, help="reschedules of a crashed job (default 2)")
    run_p.add_argument("--poll", type=float, default=5.0, help="seconds between looks at the jobs (default 5)")
    run_p.add_argument("--timeout", type=float, default=None, help="stop waiting after this many seconds")
    run_p.add_argument("--record", default=None, help="write the per-job record (JSON) to this file")
    worker_p = sub.add_parser("worker", help="start a process worker of the pool in this checkout (blocks)")
    worker_p.add_argument("--pool", required=True)
    worker_p.add_argument("--devices", default=None, help="GPUs it may use, e.g. 0 or 0,1 (CUDA_VISIBLE_DEVICES)")
    worker_p.add_argument("--ranks", type=int, default=None, help="ranks of the jobs it takes (default: devices)")
    worker_p.add_argument("--name", default=None, help="worker name (default <host>-<devices>)")
    args = parser.parse_args(argv)
    setup_process_env()
    with user_errors():
        if args.command == "worker":
            cmd, env = worker_command(args.pool, args.devices, args.name, args.ranks)
            print(" ".join(cmd), flush=True)
            os.execve(cmd[0], cmd, env)
        result = run_grid(REPO_ROOT, args.pool, args.overrides, retries=args.retries, poll_s=args.poll,
                          timeout_s=args.timeout)
        print(format_summary(result))
        if args.record:
            Path(args.record).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        if result.failed:
            names = ", ".join(f"{r.job.name} ({r.message})" for r in result.failed)
            raise GridError(f"{len(result.failed)} of {len(result.jobs)} jobs failed: {names}. The others landed; "
                            "run the same command again to run only the missing and failed ones")


if __name__ == "__main__":
    main()
