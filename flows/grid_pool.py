"""The engine side of the grid (``flows.grid``): the deployment its jobs run as, the work pool's online workers, the
state of a job's flow runs, the command that starts a worker, and the MLflow tracking server every job logs to. Placement, queues and crash states are Prefect's;
this module only reads and names them.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
import urllib.request
from pathlib import Path

from flows.common import REPO_ROOT
from flows.grid_dvc import GridError, executable
from flows.grid_job import CHECKOUT_ENV, FLOW_NAME, GRID_TAG, KEY_TAG_PREFIX, Job, grid_job, queue_name

# ---- MLflow -------------------------------------------------------------------------------------------------
def tracking_uri(cfg) -> str:
    """The MLflow tracking URI of the grid: ``tracking.tracking_uri``, else ``$MLFLOW_TRACKING_URI``.

    Raises:
        GridError: neither is an http(s) URI of a tracking server, or the server does not answer.
    """
    uri = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        raise GridError(f"the grid's workers log to one MLflow tracking server, and the tracking URI is "
                        f"{uri or 'unset (sqlite:///mlflow.db per machine)'}: start one (`mlflow server "
                        "--backend-store-uri postgresql://user@host/db --serve-artifacts --host 0.0.0.0`, "
                        "docs/scale.md) and export MLFLOW_TRACKING_URI=http://host:5000")
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10) as resp:
            if resp.status == 200:
                return uri.rstrip("/")
    except OSError as err:
        raise GridError(f"the MLflow tracking server {uri} does not answer ({err}): start it or fix "
                        "MLFLOW_TRACKING_URI / tracking.tracking_uri") from None
    raise GridError(f"the MLflow tracking server {uri} answered /health with status {resp.status}")


class RunLinks:
    """Links to the MLflow runs of each job's stages on the grid's tracking server (found by their run keys)."""

    def __init__(self, cfg, uri: str):
        self.cfg, self.uri, self._client, self._experiment_id = cfg, uri, None, None

    def link(self, job: Job, since: float | None = None) -> str | None:
        """The newest evaluate run of the job, else its newest train run, started at ``since`` (unix seconds)
        or later; None before either exists."""
        from flows.common import run_config

        run_cfg = run_config(self.cfg, job.seed)
        try:
            if self._client is None:
                from mlflow.tracking import MlflowClient

                self._client = MlflowClient(self.uri)
            if self._experiment_id is None:
                exp = self._client.get_experiment_by_name(self.cfg.tracking.experiment_name)
                if exp is None:
                    return None
                self._experiment_id = exp.experiment_id
            for key in (f"evaluate/{job.arm}/{run_cfg.params_hash()}", f"train/{job.arm}/{run_cfg.resume_hash()}"):
                query = f"tags.`trace.run_key` = '{key}'"
                if since is not None:
                    query += f" and attributes.start_time >= {int(since * 1000)}"
                runs = self._client.search_runs([self._experiment_id], query,
                                                order_by=["attributes.start_time DESC"], max_results=1)
                if runs:
                    return f"{self.uri}/#/experiments/{self._experiment_id}/runs/{runs[0].info.run_id}"
        except Exception:  # noqa: BLE001  a link is a convenience: the grid goes on without it
            return None
        return None


def ensure_deployment(client, pool: str):
    """The deployment ``trace-grid-job/<pool>`` (created or updated): entrypoint ``flows/grid_job.py:grid_job``,
    one pull step that changes into the worker's checkout (``$TRACE_CHECKOUT``, set by ``flows.grid worker``)."""
    from prefect.utilities.callables import parameter_schema

    flow_id = client.create_flow_from_name(FLOW_NAME)
    return client.create_deployment(
        flow_id=flow_id, name=pool, work_pool_name=pool, entrypoint="flows/grid_job.py:grid_job",
        pull_steps=[{"prefect.deployments.steps.set_working_directory":
                     {"directory": "{{ $" + CHECKOUT_ENV + " }}"}}],
        parameter_openapi_schema=parameter_schema(grid_job).model_dump(), tags=[GRID_TAG],
        description="One (arm, seed) of the TRACE grid: train@ and evaluate@ in the worker's checkout (flows/grid_job.py)")


def online_workers(client, pool: str) -> list[str] | None:
    """Names of the online workers of work pool ``pool``; None while the pool does not exist (a worker's first
    start creates it). ``client``: a Prefect client (``get_client(sync_client=True)``)."""
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_work_pool(pool)
    except ObjectNotFound:
        return None
    return [w.name for w in client.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE]


def check_pool(client, pool: str, queue: str, wait_s: float = 30.0) -> list[str]:
    """Names of the pool's online workers, once one of them polls ``queue`` (created here if missing: a worker
    started with ``--work-queue`` polls it from its next query on, within ``wait_s``).

    Raises:
        GridError: the pool does not exist, has no online worker, or none polls ``queue``.
    """
    from prefect.exceptions import ObjectNotFound

    start = f"start one per GPU in each checkout: `CUDA_VISIBLE_DEVICES=0 python -m flows.grid worker --pool {pool}`"
    online = online_workers(client, pool)
    if online is None:
        raise GridError(f"work pool {pool!r} does not exist, so no worker serves it: {start} (docs/scale.md)")
    if not online:
        raise GridError(f"work pool {pool!r} has no online worker: {start}")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            polled = client.read_work_queue_by_name(queue, work_pool_name=pool).last_polled
        except ObjectNotFound:
            client.create_work_queue(name=queue, work_pool_name=pool)
            polled = None
        if polled is not None and (dt.datetime.now(dt.timezone.utc) - polled).total_seconds() < 120:
            return online
        if time.monotonic() > deadline:
            ranks = queue.split("-")[-1]
            raise GridError(f"no worker of pool {pool!r} polls its queue {queue!r} (the jobs run launch.num_processes="
                            f"{ranks} ranks): start one with {ranks} device(s), `python -m flows.grid worker "
                            f"--pool {pool} --devices <ids>` (it polls ranks-<number of devices>)")
        time.sleep(2.0)


def _read_runs_by_key(client, deployment_id, keys: dict[str, Job]):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, \
        FlowRunFilterTags

    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[GRID_TAG])),
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])), limit=200)
    found: dict[Job, list] = {}
    for run in runs:
        for tag in run.tags or ():
            if tag.startswith(KEY_TAG_PREFIX) and tag[len(KEY_TAG_PREFIX):] in keys:
                found.setdefault(keys[tag[len(KEY_TAG_PREFIX):]], []).append(run)
    return found


def _reason(state) -> str:
    """Why a flow run ended as it did, without Prefect's wrapping: a job's own error as it raised it
    (``JobFailedError``, ``GridError``), else the state's type and message."""
    from prefect.client.schemas.objects import StateType

    message = (state.message or "").removeprefix("Flow run encountered an exception: ")
    for name in ("JobFailedError: ", "GridError: "):
        if message.startswith(name):
            return message[len(name):]
    return f"{state.type.value.lower()}: {message}" if state.type != StateType.FAILED else message


def _crash_count(client, flow_run_id) -> int:
    from prefect.client.schemas.objects import StateType

    return sum(state.type == StateType.CRASHED for state in client.read_flow_run_states(flow_run_id))


# ---- worker -------------------------------------------------------------------------------------------------------
def worker_command(pool: str, devices: str | None, name: str | None, ranks: int | None = None,
                   root: Path = REPO_ROOT) -> tuple[list[str], dict[str, str]]:
    """The ``prefect worker start`` command and environment of one grid worker in checkout ``root``.

    Args:
        pool: the work pool (created as type process if missing).
        devices: the GPUs it may use, e.g. ``"0,1"`` (CUDA_VISIBLE_DEVICES); None = leave it as it is.
        name: worker name (default ``<host>-<devices or cpu>``).
        ranks: jobs of how many ranks it takes (its queue ``ranks-<n>``); default the number of devices, or 1.

    Returns:
        (command, environment): one job at a time (``--limit 1``), from the queue of its size; the
        environment names the checkout (``TRACE_CHECKOUT``, the deployment's pull step changes into it).
    """
    count = ranks or (len([d for d in devices.split(",") if d.strip()]) if devices else 1)
    name = name or f"{socket.gethostname()}-{devices.replace(',', '') if devices else 'cpu'}"
    env = {**os.environ, CHECKOUT_ENV: str(root), "PYTHONPATH": str(root)}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    cmd = [executable("prefect"), "worker", "start", "--pool", pool, "--type", "process", "--limit", "1",
           "--work-queue", queue_name(count), "--name", name]
    return cmd, env
