"""Test-session environment: offline, CPU, quiet Prefect and MLflow state in a temporary folder."""

import os
import tempfile
from pathlib import Path

_TMP = Path(tempfile.mkdtemp(prefix="trace-tests-"))
for key, value in {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "2",
    "PREFECT_HOME": str(_TMP / "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "DO_NOT_TRACK": "1",
    "MLFLOW_TRACKING_URI": f"sqlite:///{_TMP / 'mlflow.db'}",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
