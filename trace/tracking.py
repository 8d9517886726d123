"""Thin MLflow helpers: one run per stage execution, named, tagged and closed so arms compare side by side.

Experiment: created with the tag ``mlflow.experimentKind = custom_model_development``, MLflow 3's mark of a
model-training experiment (one without opens in the GenAI view, traces first). MLflow 3.17's UI follows
its sidebar toggle (GenAI / Model training) over the tag; ``experiment_url`` links straight to the runs
table (``?workflowType=machine_learning``).

Run identity: a run is named ``<stage>[-<ablation>]-s<seed>-<experiment>``, where the experiment is the DVC
experiment name under ``dvc exp run`` (``$DVC_EXP_NAME``) and the first 6 characters of the params hash
otherwise; its params are the stage's own plus ``ablation`` and ``dvc.exp_name`` (``workspace`` outside
``dvc exp run``); its tags are ``trace.stage``, ``trace.ablation``, ``trace.params_hash``,
``trace.run_key``, ``trace.process`` and ``git.commit``.

Invariants:
- No run stays RUNNING after its process is gone. A stage that raises ends FAILED; one interrupted
  (Ctrl-C, SIGTERM through Prefect) ends KILLED; one killed outright (SIGKILL, out of memory, power) is
  closed KILLED by the next stage start on the same host, ended at its last logged metric.
- A run's duration is time spent computing. A resumed stage (``resume=True``) opens a new run that
  carries the metric history and tags of the newest earlier run with the same run key and starts as long
  before now as that run was alive; the earlier run is then deleted (MLflow's soft delete: the UI's
  *State: Deleted* filter lists it, ``mlflow runs restore`` brings it back), so an arm keeps one run.
- Run-level results are ``arm/*`` metrics (``SUMMARY_METRIC_NAMES``, ``arm_result_metrics``) whose first
  ``UI_COLUMN_CHARS`` characters differ, so truncated column headers still tell them apart. An evaluate run
  logs the headline numbers (``HEADLINE_METRICS``: held-out accuracy, mean effective ratio) first: MLflow's
  compare view plots a run's first metric by default.

Metrics are logged in batches (``log_batch`` costs ~0.04 ms a metric on SQLite against ~2.3 ms for a
``log_metric`` call).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Iterator, Mapping

REPO_ROOT = Path(__file__).resolve().parents[1]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
EXPERIMENT_NOTE = (
    "TRACE pipeline runs, one per stage execution, named `<stage>-<ablation>-s<seed>-<experiment>`. The arms' "
    "results are the `evaluate-*` runs: `arm/acc` is the held-out greedy accuracy after training, "
    "`arm/eff_ratio` the mean effective ratio over training steps; the link in `reports/summary.md` lists them "
    "side by side, and selecting them and pressing *Compare* plots them. The `train-*` runs hold the per-step "
    "curves (*Chart* view).")
PROCESS_TAG = "trace.process"
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # `make ui`
# An experiment tag of this prefix holds a runs-table view as JSON, opened by ``?viewStateShareKey=<rest>``:
# the format the MLflow UI's own *Share* button writes (read as plain JSON by MLflow 3.17).
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."

# Characters of a metric name that MLflow 3.17's runs table shows in a metric column: 100 px wide, of which
# 88 px hold the 12 px semibold header text; "summary/mean" fills them (measured in Chromium).
UI_COLUMN_CHARS = 12

# Trainer.summary() key -> MLflow name of the run-level metric.
SUMMARY_METRIC_NAMES: dict[str, str] = {
    "mean/effective_ratio": "arm/eff_ratio",
    "mean/effective_token_ratio": "arm/eff_tok_ratio",
    "mean/active_prompt_ratio": "arm/active_prompts",
    "mean/mixed_group_ratio": "arm/mixed_groups",
    "mean/reward/mean": "arm/reward",
    "mean/tokens/generated": "arm/tok_step",
    "mean/rollout/trajectories": "arm/traj_step",
    "mean/tools/calls": "arm/tools_step",
    "mean/time/step": "arm/sec_step",
    "mean/predictor/brier": "arm/brier",
    "mean/predictor/auc": "arm/auc",
    "last/accuracy_eval": "arm/last_eval_acc",
    "tokens/cumulative": "arm/tokens",
    "train/steps": "arm/steps",
}
HELDOUT_ACCURACY = "arm/acc"  # evaluate stage: held-out greedy accuracy of the trained policy
HEADLINE_METRICS = (HELDOUT_ACCURACY, "arm/eff_ratio")


def heldout_pass_name(pass_k: int) -> str:
    """MLflow name of the held-out pass@k of the trained policy, e.g. ``arm/pass_4`` (short enough to show
    whole: ``arm/pass_at_4`` and ``arm/pass_at_16`` would both read ``arm/pass_at_``)."""
    return f"arm/pass_{int(pass_k)}"


def summary_metrics(summary: Mapping[str, float]) -> dict[str, float]:
    """The training summary under its ``arm/*`` names, mean effective ratio first.

    Args:
        summary: ``Trainer.summary()`` (``mean/effective_ratio``, ``tokens/cumulative``, ...); values that are
            not numbers are left out. A key the table ``SUMMARY_METRIC_NAMES`` lacks keeps its name below
            ``arm/`` with ``/`` replaced by ``_``.

    Returns:
        ``{"arm/eff_ratio": ..., "arm/eff_tok_ratio": ..., ...}`` in the table's order.
    """
    numeric = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    ordered = [k for k in SUMMARY_METRIC_NAMES if k in numeric] + [k for k in numeric if k not in SUMMARY_METRIC_NAMES]
    return {SUMMARY_METRIC_NAMES.get(k) or "arm/" + k.replace("/", "_"): float(numeric[k]) for k in ordered}


def arm_result_metrics(eval_metrics: Mapping[str, float], train_summary: Mapping[str, float],
                       pass_k: int) -> dict[str, float]:
    """One arm's results for its evaluate run: held-out accuracy, then the training summary.

    Logged before the evaluate stage's own metrics, so the held-out accuracy is the run's first metric (the
    compare view colours its plot by it) and the mean effective ratio its second.

    Args:
        eval_metrics: ``trace.loop.evaluate_policy`` metrics (``accuracy/greedy``, ``accuracy/pass@k``).
        train_summary: ``Trainer.summary()`` of the arm (its ``summary.json``; other keys are ignored).
        pass_k: ``evaluate.pass_k``.

    Returns:
        ``{"arm/acc": ..., "arm/eff_ratio": ..., "arm/pass_<k>": ..., "arm/eff_tok_ratio": ..., ...}``.
    """
    out: dict[str, float] = {}
    if "accuracy/greedy" in eval_metrics:
        out[HELDOUT_ACCURACY] = float(eval_metrics["accuracy/greedy"])
    summary = summary_metrics(train_summary)
    if "arm/eff_ratio" in summary:
        out["arm/eff_ratio"] = summary.pop("arm/eff_ratio")
    for key in (f"accuracy/pass@{pass_k}", metric_key(f"accuracy/pass@{pass_k}")):
        if key in eval_metrics:
            out[heldout_pass_name(pass_k)] = float(eval_metrics[key])
            break
    out.update(summary)
    return out


def git_commit() -> str:
    """Current commit hash of the repository, or ``"unknown"`` outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve_tracking_uri(tracking_uri: str | None) -> str:
    """The param if set, else ``$MLFLOW_TRACKING_URI``, else SQLite ``mlflow.db`` at the repository root.

    The repository root is ``$DVC_ROOT`` when DVC runs the stage: a queued experiment (``dvc exp run --queue``)
    runs in a temporary copy of the repository, and its runs belong in the main repository's database.
    """
    if tracking_uri:
        return tracking_uri
    root = Path(os.environ.get("DVC_ROOT") or REPO_ROOT)
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"


def _flatten(prefix: str, value, out: dict) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def flatten_params(params: Mapping) -> dict[str, str]:
    """Dotted-key view of a nested mapping, values as strings (MLflow caps a value at 6000 chars)."""
    flat: dict = {}
    _flatten("", params, flat)
    return {k: str(v)[:6000] for k, v in flat.items()}


def metric_key(name: str) -> str:
    """A key MLflow accepts: ``@`` becomes ``_at_``, any other character it refuses becomes ``_``."""
    return re.sub(r"[^0-9A-Za-z_\-. :/]", "_", name.replace("@", "_at_"))


def dvc_experiment_name(environ: Mapping[str, str] | None = None) -> str:
    """Name of the DVC experiment running this stage (``$DVC_EXP_NAME``, set by ``dvc exp run``), else ''."""
    return (os.environ if environ is None else environ).get("DVC_EXP_NAME", "")


def run_name(stage: str, ablation: str, seed: int | None, experiment: str) -> str:
    """``<stage>[-<ablation>][-s<seed>][-<experiment>]``, e.g. ``train-trace-s0-lr-sweep``.

    Args:
        stage: DVC stage name without ``@item``.
        ablation: the arm, '' for shared stages.
        seed: the run's ``seed`` param, None to leave it out.
        experiment: DVC experiment name or a params-hash prefix, '' to leave it out.
    """
    parts = [stage, ablation, "" if seed is None else f"s{seed}", experiment]
    return "-".join(p for p in parts if p)


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


def ensure_experiment(client, name: str) -> str:
    """Id of the MLflow experiment ``name``, created as a model-training experiment if missing.

    A new experiment gets ``mlflow.experimentKind = custom_model_development`` and a description
    (``mlflow.note.content``); an existing one without a kind gets the kind, and keeps its description.

    Raises:
        RuntimeError: the experiment exists but is deleted (MLflow refuses to log to it or re-create it).
    """
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND,
                                                        "mlflow.note.content": EXPERIMENT_NOTE})
        except MlflowException:  # created meanwhile by another stage process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise RuntimeError(f"MLflow experiment {name!r} (id {exp.experiment_id}) is deleted: restore it with "
                           f"`mlflow experiments restore --experiment-id {exp.experiment_id}` or set another "
                           "tracking.experiment_name in params.yaml")
    if EXPERIMENT_KIND_TAG not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return exp.experiment_id


def ui_url(tracking_uri: str | None) -> str:
    """Base URL of the MLflow UI: the tracking server itself, else ``make ui``'s http://127.0.0.1:5000."""
    uri = resolve_tracking_uri(tracking_uri)
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_UI_URL


def experiment_url(base_url: str, experiment_id: str, view_key: str | None = None) -> str:
    """Link to the experiment's runs table in the model-training view of the MLflow UI, showing the shared
    view ``view_key`` (``share_arms_view``) if given."""
    url = f"{base_url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    return f"{url}&viewStateShareKey={urllib.parse.quote(view_key, safe='')}" if view_key else url


def arms_view(params_hash: str, pass_k: int) -> dict:
    """Runs-table view of the arms' results: the evaluate runs of one params hash, best held-out accuracy
    first, with the ``arm/*`` columns in front (the headline numbers first)."""
    metrics = [*HEADLINE_METRICS, heldout_pass_name(pass_k), "arm/eff_tok_ratio", "arm/active_prompts",
               "arm/reward", "arm/tokens", "arm/sec_step"]
    columns = [f"metrics.`{m}`" for m in metrics] + ["params.`ablation`", "params.`dvc.exp_name`"]
    return {"searchFilter": f"tags.`trace.stage` = 'evaluate' and tags.`trace.params_hash` = '{params_hash}'",
            "orderByKey": f"metrics.`{HELDOUT_ACCURACY}`", "orderByAsc": False, "lifecycleFilter": "Active",
            "selectedColumns": columns, "columnOrder": columns}


def share_arms_view(client, experiment_id: str, params_hash: str, pass_k: int) -> str:
    """Store ``arms_view`` on the experiment as a shared runs-table view and return its key
    (``arms-<params_hash>``, for ``experiment_url``)."""
    key = f"arms-{params_hash}"
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG_PREFIX + key, json.dumps(arms_view(params_hash, pass_k)))
    return key


def compare_url(base_url: str, experiment_id: str, run_ids: list[str]) -> str:
    """Link to MLflow's compare view of ``run_ids`` (the page the runs table's *Compare* button opens)."""
    runs = urllib.parse.quote(json.dumps(list(run_ids)), safe="")
    experiments = urllib.parse.quote(json.dumps([experiment_id]), safe="")
    return f"{base_url}/#/compare-runs?runs={runs}&experiments={experiments}"


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


_OWN_TAGS = ("trace.stage", "trace.ablation", "trace.params_hash", "trace.run_key", PROCESS_TAG, "git.commit",
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
        seed: the ``seed`` param, shown in the run name; None leaves it out.
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
            "trace.run_key": run_key, PROCESS_TAG: process_identity(), "git.commit": git_commit()}
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


def finished_runs(tracking_uri: str | None, experiment_name: str, stage: str) -> list:
    """Newest FINISHED run per ablation of one stage (``mlflow.entities.Run`` objects)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"tags.`trace.stage` = '{stage}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1000)
    newest: dict[str, object] = {}
    for run in runs:
        newest.setdefault(run.data.tags.get("trace.ablation", ""), run)
    return list(newest.values())
