"""MLflow experiment set-up and links into its UI.

Experiment: created with the tag ``mlflow.experimentKind = custom_model_development``, MLflow 3's mark of a
model-training experiment (one without opens in the GenAI view, traces first). MLflow 3.17's UI follows
its sidebar toggle (GenAI / Model training) over the tag; ``experiment_url`` links straight to the runs
table (``?workflowType=machine_learning``).

The tracking URI defaults to SQLite ``mlflow.db`` at the root of the main repository (``resolve_tracking_uri``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import urllib.parse
from pathlib import Path
from typing import Sequence

from trace.configuration.process_env import main_repository
from trace.tracking.names import HEADLINE_METRICS, HELDOUT_ACCURACY, SEED_TAG, heldout_pass_name

REPO_ROOT = Path(__file__).resolve().parents[2]

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
EXPERIMENT_NOTE = (
    "TRACE pipeline runs, one per stage execution, named `<stage>-<ablation>-s<seed>-<experiment>`. The arms' "
    "results are the `evaluate-*` runs: `arm/acc` is the held-out greedy accuracy after training, "
    "`arm/eff_ratio` the mean effective ratio over training steps; the link in `reports/summary.md` lists them "
    "side by side, and selecting them and pressing *Compare* plots them. The `train-*` runs hold the per-step "
    "curves (*Chart* view).")
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # `make ui`
# An experiment tag of this prefix holds a runs-table view as JSON, opened by ``?viewStateShareKey=<rest>``:
# the format the MLflow UI's own *Share* button writes (read as plain JSON by MLflow 3.17).
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."


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
    root = main_repository()
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"



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


def arms_view(run_ids: Sequence[str], pass_k: int) -> dict:
    """Runs-table view of the arms' results: the given evaluate runs (every arm and seed of one report),
    grouped by arm (the ``ablation`` param) with the group row the mean over its seeds, best held-out accuracy
    first, with the ``arm/*`` columns in front (the headline numbers first) and each run's seed.

    The filter names the runs by id: a run's params hash holds its seed, so no tag of the runs marks all
    seeds of one report, and ``attributes.run_id IN (...)`` is the one list filter MLflow's search takes.

    Args:
        run_ids: the evaluate runs' ids.
        pass_k: ``evaluate.pass_k`` (names the pass@k column).

    Returns:
        The view as MLflow 3.17's *Share* button stores it: ``searchFilter``, order, columns and ``groupBy``
        (``{"aggregateFunction": "average", "groupByKeys": [{"mode": "param", "groupByData": "ablation"}]}``).

    Raises:
        ValueError: no run ids.
    """
    if not run_ids:
        raise ValueError("arms_view needs the evaluate runs to show; got none")
    metrics = [*HEADLINE_METRICS, heldout_pass_name(pass_k), "arm/eff_tok_ratio", "arm/active_prompts",
               "arm/reward", "arm/tokens", "arm/sec_step"]
    columns = ([f"metrics.`{m}`" for m in metrics]
               + ["params.`ablation`", f"tags.`{SEED_TAG}`", "params.`dvc.exp_name`"])
    ids = ", ".join(f"'{run_id}'" for run_id in sorted(run_ids))
    return {"searchFilter": f"attributes.run_id IN ({ids})",
            "orderByKey": f"metrics.`{HELDOUT_ACCURACY}`", "orderByAsc": False, "lifecycleFilter": "Active",
            "selectedColumns": columns, "columnOrder": columns,
            "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "param", "groupByData": "ablation"}]}}


def share_arms_view(client, experiment_id: str, run_ids: Sequence[str], pass_k: int) -> str:
    """Store ``arms_view`` of ``run_ids`` on the experiment as a shared runs-table view and return its key
    (``arms-<first 12 hex of the sha256 of the sorted ids>``, for ``experiment_url``): the same runs give the
    same key, so the same report links the same view."""
    digest = hashlib.sha256(",".join(sorted(run_ids)).encode()).hexdigest()[:12]
    key = f"arms-{digest}"
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG_PREFIX + key, json.dumps(arms_view(run_ids, pass_k)))
    return key


def run_artifacts_url(base_url: str, experiment_id: str, run_id: str) -> str:
    """Link to a run's artifacts tab in the MLflow UI (where a logged ``summary.md`` renders as Markdown)."""
    return f"{base_url}/#/experiments/{experiment_id}/runs/{run_id}/artifacts"


def compare_url(base_url: str, experiment_id: str, run_ids: list[str]) -> str:
    """Link to MLflow's compare view of ``run_ids`` (the page the runs table's *Compare* button opens)."""
    runs = urllib.parse.quote(json.dumps(list(run_ids)), safe="")
    experiments = urllib.parse.quote(json.dumps([experiment_id]), safe="")
    return f"{base_url}/#/compare-runs?runs={runs}&experiments={experiments}"
