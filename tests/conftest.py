"""Test-session environment: offline, CPU, quiet Prefect and MLflow state in a temporary folder.

The defaults come from ``trace.configuration.process_env`` (those of the stages plus the launcher's thread count). The
Prefect home and MLflow database are always a temporary folder's, even when the caller (``make test``
exports the stages' table) set the repository's: a test never touches the repository's runs.
"""

import os
import tempfile
from pathlib import Path

from trace.configuration.process_env import LAUNCHER_ENV, PROCESS_ENV, apply_process_env

_TMP = Path(tempfile.mkdtemp(prefix="trace-tests-"))
for key, value in {
    "PREFECT_HOME": str(_TMP / "prefect"),
    "MLFLOW_TRACKING_URI": f"sqlite:///{_TMP / 'mlflow.db'}",
}.items():
    os.environ[key] = value
apply_process_env({**PROCESS_ENV, **LAUNCHER_ENV})

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
