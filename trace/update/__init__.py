"""Policy update: training batches from rollout trees (``batch``), DeepSpeed set-up (``deepspeed_setup``)
and the updater with the RL and SFT steps (``updater``).

Importing ``trace.update.batch`` needs torch only; DeepSpeed is imported when a ``PolicyUpdater`` is built.
"""

from trace.update.batch import TrainingBatch, build_training_batch
from trace.update.deepspeed_setup import convert_to_universal_checkpoint, deepspeed_config, init_distributed_env, \
    init_process_group
from trace.update.updater import REFERENCE_POLICY_FILE, LossFn, PolicyUpdater

__all__ = ["REFERENCE_POLICY_FILE", "LossFn", "PolicyUpdater", "TrainingBatch", "build_training_batch",
           "convert_to_universal_checkpoint", "deepspeed_config", "init_distributed_env",
           "init_process_group"]
