"""The update package: batch building is pure torch, and the package re-exports the public names."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_building_training_batches_imports_no_deepspeed():
    code = ("import sys, trace.update.batch; "
            "assert 'deepspeed' not in sys.modules, 'trace.update.batch imported deepspeed'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_update_package_re_exports_the_names_of_its_modules():
    import trace.update as update
    from trace.update import batch, deepspeed_setup, updater

    assert update.TrainingBatch is batch.TrainingBatch
    assert update.build_training_batch is batch.build_training_batch
    assert update.deepspeed_config is deepspeed_setup.deepspeed_config
    assert update.init_distributed_env is deepspeed_setup.init_distributed_env
    assert update.convert_to_universal_checkpoint is deepspeed_setup.convert_to_universal_checkpoint
    assert update.PolicyUpdater is updater.PolicyUpdater
