"""One MLflow run per stage execution, named, tagged and closed so arms compare side by side.

Run identity: a run is named ``<stage>[-<ablation>]-s<seed>-<experiment>``, where the experiment is the DVC
experiment name under ``dvc exp run`` (``$DVC_EXP_NAME``) and the first 6 characters of the params hash
otherwise; its params are the stage's own plus ``ablation`` and ``dvc.exp_name`` (``workspace`` outside
``dvc exp run``); its tags are ``trace.stage``, ``trace.ablation``, ``trace.params_hash``,
``trace.run_key``, ``trace.process``, ``git.commit``, the machine's ``trace.cpu`` and ``trace.native_bf16``
(``trace.precision.machine_tags``), ``trace.precision`` (the resolved ``policy.dtype``) where the stage reads the
policy, and, for a run with a seed, ``trace.seed``.

Invariants:
- No run stays RUNNING after its process is gone. A stage that raises ends FAILED; one interrupted
  (Ctrl-C, SIGTERM through Prefect) ends KILLED; one killed outright (SIGKILL, out of memory, power) is
  closed KILLED by the next stage start on the same host, ended at its last logged metric.
- A run's duration is time spent computing. A resumed stage (``resume=True``) opens a new run that
  carries the metric history and tags of the newest earlier run with the same run key and starts as long
  before now as that run was alive; the earlier run is then deleted (MLflow's soft delete: the UI's
  *State: Deleted* filter lists it, ``mlflow runs restore`` brings it back), so an arm keeps one run.

Metrics are logged in batches (``log_batch`` costs ~0.04 ms a metric on SQLite against ~2.3 ms for a
``log_metric`` call).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Mapping

from trace.precision import machine_tags
from trace.tracking.experiment import ensure_experiment, git_commit, resolve_tracking_uri
from trace.tracking.names import SEED_TAG, dvc_experiment_name, flatten_params, metric_key, run_name

PROCESS_TAG = "trace.process"


def process_identity(pid: int | None = None) -> str:
    """``host:pid:start`` of a process (default: this one); ``start`` is its creation time in Unix seconds,
    which tells a process from a later one that got the same pid."""
    import psutil

    proc = psutil.Process(pid or os.getpid())
    return f"{socket.gethostname()}:{proc.pid}:{proc.create_time():.2f}"


def process_is_gone(identity: str | None) -> bool:
    """Whether the process named by ``process_identity`` has ended.

    False when that cannot be told from here: another host, or an identity that does not parse. A zombie
    and a process with the same pid but a later creation time count as gone.
    """
    import psutil

    try:
        host, pid, started = (identity or "").rsplit(":", 2)
        pid_num, started_s = int(pid), float(started)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    try:
        proc = psutil.Process(pid_num)
        return proc.status() == psutil.STATUS_ZOMBIE or abs(proc.create_time() - started_s) > 1.0
    except psutil.NoSuchProcess:
        return True


def _last_activity_ms(run) -> int:
    """Timestamp of the run's newest logged metric, or its start when it logged none."""
    stamps = [m.timestamp for m in run.data.to_proto().metrics]
    return max(stamps) if stamps else run.info.start_time


def close_stale_runs(client, experiment_id: str, run_key: str | None = None) -> list[str]:
    """End as KILLED the RUNNING runs of the experiment whose process is gone.

    A run's process is its ``trace.process`` tag (``process_is_gone``); a RUNNING run without that tag (made
    by an older version) counts as stale only if it has ``run_key``, since DVC never runs one stage twice
    at once. A closed run ends at its last logged metric and gets the tag ``trace.killed`` saying why.

    Args:
        client: ``mlflow.tracking.MlflowClient``.
        experiment_id: the experiment to sweep.
        run_key: ``trace.run_key`` of the stage now starting, or None.

    Returns:
        The ids of the runs closed.
    """
    closed = []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000):
        identity = run.data.tags.get(PROCESS_TAG)
        stale = process_is_gone(identity) if identity else run_key is not None and \
            run.data.tags.get("trace.run_key") == run_key
        if not stale:
            continue
        client.set_tag(run.info.run_id, "trace.killed",
                       f"process {identity or '(not recorded)'} was gone when a stage started on "
                       f"{socket.gethostname()} at {time.strftime('%Y-%m-%d %H:%M:%S')}")
        client.set_terminated(run.info.run_id, status="KILLED", end_time=_last_activity_ms(run))
        closed.append(run.info.run_id)
    return closed



class StageRun:
    """An open MLflow run with batched metric logging."""

    def __init__(self, client, run_id: str, experiment_id: str = ""):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log finite numeric metrics in one batch, in the mapping's order (non-finite values are skipped,
        not logged as NaN)."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(key=metric_key(k), value=float(v), timestamp=ts, step=step or 0)
                 for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))]
        for i in range(0, len(batch), 900):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 900])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))


def _carry_history(client, source, target_id: str) -> None:
    """Copy every metric point of ``source`` (a ``Run``) to ``target_id``, keys in their logged order."""
    from mlflow.entities import Metric

    keys = list(dict.fromkeys(m.key for m in source.data.to_proto().metrics))
    batch: list = []
    for key in keys:
        for m in client.get_metric_history(source.info.run_id, key):
            batch.append(Metric(key=m.key, value=m.value, timestamp=m.timestamp, step=m.step))
            if len(batch) == 900:
                client.log_batch(target_id, metrics=batch)
                batch = []
    if batch:
        client.log_batch(target_id, metrics=batch)


_OWN_TAGS = (SEED_TAG, "trace.stage", "trace.ablation", "trace.params_hash", "trace.run_key", PROCESS_TAG, "git.commit",
             "trace.cpu", "trace.native_bf16", "trace.precision",
             "trace.killed", "trace.continues", "trace.continued_in")


@contextlib.contextmanager
def stage_run(stage: str, *, tracking_uri: str | None, experiment_name: str, params: Mapping,
              params_hash: str, ablation: str = "", resume: bool = False, seed: int | None = None,
              dvc_experiment: str | None = None) -> Iterator[StageRun]:
    """Open the MLflow run of one stage execution (with ``resume``, one that continues an earlier run).

    First closes the experiment's runs whose process is gone (``close_stale_runs``).

    Args:
        stage: DVC stage name (``train``, ``evaluate``, ...).
        tracking_uri: MLflow URI or None (see ``resolve_tracking_uri``).
        experiment_name: MLflow experiment (created by ``ensure_experiment`` if missing).
        params: the stage's params (nested), logged flattened, with ``ablation`` and ``dvc.exp_name``.
        params_hash: hash of the config; part of the run key and, outside ``dvc exp run``, of the run name.
        ablation: ablation name, '' for shared stages.
        resume: continue the newest ended run with the same stage, ablation and params hash: the new run
            carries its metric history and tags, starts as long before now as it ran, and the earlier run is
            deleted (soft delete). Without an earlier run, a fresh run.
        seed: the run's seed, shown in the run name and tagged ``trace.seed``; None leaves both out.
        dvc_experiment: DVC experiment name; None reads ``$DVC_EXP_NAME`` (``dvc_experiment_name``).

    Yields:
        ``StageRun``; the run ends FINISHED on success, FAILED on an exception and KILLED on an
        interruption (``KeyboardInterrupt``, Prefect's ``TerminationSignal`` for SIGTERM).

    Raises:
        RuntimeError: the experiment is deleted (see ``ensure_experiment``).
    """
    import mlflow
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    exp_id = ensure_experiment(client, experiment_name)
    run_key = f"{stage}/{ablation}/{params_hash}"
    close_stale_runs(client, exp_id, run_key)
    previous = None
    if resume:
        found = client.search_runs([exp_id], filter_string=f"tags.`trace.run_key` = '{run_key}' and "
                                                           "attributes.status != 'RUNNING'",
                                   order_by=["attributes.start_time DESC"], max_results=1)
        previous = found[0] if found else None
    exp_name = dvc_experiment_name() if dvc_experiment is None else dvc_experiment
    tags = {"trace.stage": stage, "trace.ablation": ablation, "trace.params_hash": params_hash,
            "trace.run_key": run_key, PROCESS_TAG: process_identity(), "git.commit": git_commit(), **machine_tags()}
    policy = params.get("policy")
    if isinstance(policy, Mapping) and "dtype" in policy:
        tags["trace.precision"] = str(policy["dtype"])
    if seed is not None:
        tags[SEED_TAG] = str(seed)
    start_ms = int(time.time() * 1000)
    if previous is not None:
        tags["trace.continues"] = previous.info.run_id
        alive_ms = max(0, (previous.info.end_time or previous.info.start_time) - previous.info.start_time)
        start_ms -= alive_ms
    run = client.create_run(exp_id, start_time=start_ms, tags=tags,
                            run_name=run_name(stage, ablation, seed, exp_name or params_hash[:6]))
    run_id = run.info.run_id
    flat = {**flatten_params(params), "dvc.exp_name": exp_name or "workspace"}
    if ablation:
        flat["ablation"] = ablation
    items = [Param(k, v) for k, v in flat.items()]
    for i in range(0, len(items), 90):
        client.log_batch(run_id, params=items[i:i + 90])
    if previous is not None:
        _carry_history(client, previous, run_id)
        carried = [RunTag(k, v) for k, v in previous.data.tags.items()
                   if k not in _OWN_TAGS and (not k.startswith("mlflow.") or k == "mlflow.note.content")]
        if carried:
            client.log_batch(run_id, tags=carried)
        client.set_tag(previous.info.run_id, "trace.continued_in", run_id)
        client.delete_run(previous.info.run_id)
    handle = StageRun(client, run_id, exp_id)
    try:
        yield handle
    except Exception:
        client.set_terminated(run_id, status="FAILED")
        raise
    except BaseException:
        client.set_terminated(run_id, status="KILLED")
        raise
    client.set_terminated(run_id, status="FINISHED")


def finished_runs(tracking_uri: str | None, experiment_name: str, stage: str,
                  key_tags: tuple[str, ...] = ("trace.ablation",)) -> list:
    """Newest FINISHED run of one stage per value of ``key_tags`` (``mlflow.entities.Run`` objects).

    Args:
        key_tags: the tags whose values tell runs apart; the default keeps one run per ablation,
            ``("trace.ablation", "trace.params_hash")`` one per ablation and params hash (so per seed).
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"tags.`trace.stage` = '{stage}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1000)
    newest: dict[tuple, object] = {}
    for run in runs:
        newest.setdefault(tuple(run.data.tags.get(tag, "") for tag in key_tags), run)
    return list(newest.values())
