"""Test-session environment: offline, CPU, quiet Prefect and MLflow state in a temporary folder.

The defaults come from ``trace.configuration.process_env`` (those of the stages plus the launcher's thread count). The
Prefect home and MLflow database are always a temporary folder's, even when the caller (``make test``
exports the stages' table) set the repository's: a test never touches the repository's runs.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest

from trace.configuration.process_env import LAUNCHER_ENV, PROCESS_ENV, apply_process_env, interpreter_env

_TMP = Path(tempfile.mkdtemp(prefix="trace-tests-"))
for key, value in {
    "PREFECT_HOME": str(_TMP / "prefect"),
    "MLFLOW_TRACKING_URI": f"sqlite:///{_TMP / 'mlflow.db'}",
}.items():
    os.environ[key] = value
apply_process_env({**PROCESS_ENV, **LAUNCHER_ENV, **interpreter_env()})
# policy.dtype / update.bf16 "auto" resolve to float32 on every CPU kind, so no test's numbers depend on whether
# the CPU has native bf16 (trace/precision.py); TRACE_NATIVE_BF16=1 make test runs them in bf16
os.environ.setdefault("TRACE_NATIVE_BF16", "0")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest -n N: the cores shared out, before any import of torch
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True)
def torch_linear_as_torch_defines_it():
    """Put ``torch.nn.functional.linear`` back after each test. A ZeRO-3 engine replaces it with DeepSpeed's
    ``zero3_linear_wrap`` for the rest of the process ("This will persist unless manually reset"), which a stage
    process can keep but a later test in the same process (a pytest-xdist worker runs many) must not see."""
    yield
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(zero, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None:
        sys.modules["torch"].nn.functional.linear = original
