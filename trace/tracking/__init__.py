"""Thin MLflow helpers: metric and run names (``names``), the experiment and links into its UI
(``experiment``), and one run per stage execution (``runs``).
"""

from trace.tracking.experiment import (DEFAULT_UI_URL, EXPERIMENT_KIND_TAG, EXPERIMENT_NOTE, MODEL_TRAINING_KIND,
                                       REPO_ROOT, SHARED_VIEW_TAG_PREFIX, arms_view, compare_url, ensure_experiment,
                                       experiment_url, git_commit, resolve_tracking_uri, share_arms_view, ui_url)
from trace.tracking.names import (GREEDY_ACCURACY, HEADLINE_METRICS, HELDOUT_ACCURACY, SUMMARY_METRIC_NAMES,
                                  UI_COLUMN_CHARS, arm_result_metrics, dvc_experiment_name, flatten_params,
                                  heldout_pass_name, metric_key, pass_at_k_name, run_name, summary_metrics)
from trace.tracking.runs import (PROCESS_TAG, StageRun, close_stale_runs, finished_runs, process_identity,
                                 process_is_gone, stage_run)

__all__ = [
    "DEFAULT_UI_URL", "EXPERIMENT_KIND_TAG", "EXPERIMENT_NOTE", "GREEDY_ACCURACY", "HEADLINE_METRICS",
    "HELDOUT_ACCURACY", "MODEL_TRAINING_KIND", "PROCESS_TAG", "REPO_ROOT", "SHARED_VIEW_TAG_PREFIX",
    "SUMMARY_METRIC_NAMES", "UI_COLUMN_CHARS", "StageRun", "arm_result_metrics", "arms_view", "close_stale_runs",
    "compare_url", "dvc_experiment_name", "ensure_experiment", "experiment_url", "finished_runs", "flatten_params",
    "git_commit", "heldout_pass_name", "metric_key", "pass_at_k_name", "process_identity", "process_is_gone",
    "resolve_tracking_uri", "run_name", "share_arms_view", "stage_run", "summary_metrics", "ui_url",
]
