"""One job of the grid (``flows.grid``), on a worker: an (arm, seed) pair of stages in the worker's own checkout.

``grid_job`` is the flow the deployment ``trace-grid-job/<pool>`` runs (entrypoint ``flows/grid_job.py:grid_job``):
it writes the coordinator's params.yaml and dvc.lock into the checkout, ``dvc pull``s what ``train@`` reads, runs
exactly ``dvc repro --single-item train@<arm>-<seed> evaluate@<arm>-<seed>`` and pushes their outputs and the
run-cache. Also here: the job's identity (``Job``, ``job_key``) and the work queue of a rank count.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.common import REPO_ROOT, setup_process_env
from flows.grid_dvc import GridError, command_env, dvc, executable, failure_line, head_commit, \
    push_run_cache_files, run_command, stage_inputs, uncommitted_code
from trace.errors import UserError, quiet_orchestrator_tracebacks

FLOW_NAME = "trace-grid-job"
CHECKOUT_ENV = "TRACE_CHECKOUT"  # a worker's checkout: the deployment's pull step changes into it
GRID_TAG = "trace.grid"
KEY_TAG_PREFIX = "trace.grid.key="  # a job's identity: its run config's params hash and the commit


class JobFailedError(UserError):
    """A job's stage exited non-zero on its worker (a bad param, a missing file): it is not retried."""


@dataclass(frozen=True)
class Job:
    """One (arm, seed) of the grid: the stages ``train@<arm>-<seed>`` and ``evaluate@<arm>-<seed>``."""

    arm: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm}-{self.seed}"

    @property
    def stages(self) -> tuple[str, str]:
        return f"train@{self.name}", f"evaluate@{self.name}"


def grid_jobs(cfg) -> list[Job]:
    """Every (arm, seed) of ``train.ablations`` x ``train.seeds``, in ``dvc.yaml``'s matrix order."""
    return [Job(arm, int(seed)) for arm in cfg.train.ablations for seed in cfg.train.run_seeds(cfg.seed)]


def job_key(cfg, job: Job, commit: str) -> str:
    """Identity of a job's work: its run config's ``params_hash`` (the arm's seed included) and the commit."""
    from flows.common import run_config

    return f"{job.name}-{run_config(cfg, job.seed).params_hash()}-{commit[:12]}"


def queue_name(num_processes: int) -> str:
    """The work queue of jobs that run ``launch.num_processes`` ranks: a worker polls the one of its size."""
    return f"ranks-{int(num_processes)}"


# ---- the job, on a worker ------------------------------------------------------------------------------------
def prepare_checkout(root: Path, commit: str, params_text: str, lock_text: str) -> None:
    """Make the worker's checkout the coordinator's: same commit, its params.yaml and dvc.lock.

    Raises:
        GridError: the checkout is at another commit, or has uncommitted code.
    """
    here = head_commit(root)
    if here != commit:
        raise GridError(f"worker checkout {root} is at commit {here[:12]}, the grid runs {commit[:12]}: "
                        f"`git fetch && git checkout {commit[:12]}` there (the worker needs no restart)")
    changed = uncommitted_code(root)
    if changed:
        raise GridError(f"worker checkout {root} has uncommitted changes in {changed[:5]}: the grid runs the commit; "
                        "`git checkout -- <files>` (or remove the untracked ones) there")
    (root / "params.yaml").write_text(params_text)
    (root / "dvc.lock").write_text(lock_text)


@task(name="dvc-pull", cache_policy=NONE, retries=2, retry_delay_seconds=5)
def pull_inputs(root: str, paths: list[str]) -> float:
    """``dvc pull`` of the shared outputs the job reads; returns seconds."""
    start = time.perf_counter()
    if paths:
        dvc(Path(root), command_env(Path(root)), "pull", *paths)
    return time.perf_counter() - start


@task(name="dvc-repro", cache_policy=NONE)
def repro_stages(root: str, stages: list[str]) -> float:
    """``dvc repro --single-item`` of the job's stages; returns seconds.

    Raises:
        JobFailedError: a stage exited non-zero (its own error line in the message).
    """
    start = time.perf_counter()
    args = ["repro", "--single-item", *stages]
    status, tail = run_command([executable("dvc"), *args], Path(root), command_env(Path(root)))
    if status:
        raise JobFailedError(f"`dvc {' '.join(args)}` exited with status {status} on {socket.gethostname()}: "
                             f"{failure_line(tail)}")
    return time.perf_counter() - start


@task(name="dvc-push", cache_policy=NONE, retries=2, retry_delay_seconds=5)
def push_results(root: str, stages: list[str]) -> float:
    """``dvc push --run-cache`` of the job's stages, and the files their run-cache entries name; returns seconds."""
    start = time.perf_counter()
    dvc(Path(root), command_env(Path(root)), "push", "--run-cache", *stages)
    push_run_cache_files(Path(root))
    return time.perf_counter() - start


@flow(name=FLOW_NAME, retries=0, log_prints=True)
def grid_job(arm: str, seed: int, commit: str, params_text: str, lock_text: str) -> dict:
    """One job of the grid, in the worker's checkout: pull the shared outputs, run ``train@<arm>-<seed>`` and
    ``evaluate@<arm>-<seed>``, push their outputs and run-cache.

    Args:
        arm: the arm (``train.ablations``).
        seed: the training seed (``train.seeds``).
        commit: the commit the coordinator runs; the checkout must be at it.
        params_text: the coordinator's params.yaml (the commit's with the grid's overrides).
        lock_text: the coordinator's dvc.lock after the shared stages: which outputs to pull.

    Returns:
        ``{"job", "worker", "host", "seconds": {"pull", "repro", "push"}}``.

    Raises:
        GridError: the checkout is not at the commit or has uncommitted code.
        JobFailedError: a stage exited non-zero (not retried).
    """
    setup_process_env()
    quiet_orchestrator_tracebacks()
    root = REPO_ROOT
    job = Job(arm, int(seed))
    prepare_checkout(root, commit, params_text, lock_text)
    worker = os.environ.get("PREFECT__WORKER_NAME", "?")
    print(f"{job.name} on worker {worker} ({socket.gethostname()}:{root})")
    inputs = stage_inputs(root, "train", {"ablation": job.arm, "seed": job.seed}, lock_text)
    seconds = {"pull": pull_inputs(str(root), inputs),
               "repro": repro_stages(str(root), list(job.stages)),
               "push": push_results(str(root), list(job.stages))}
    return {"job": job.name, "worker": worker, "host": socket.gethostname(), "seconds": seconds}
