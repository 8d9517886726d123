"""The training loop and its parts: the trainer (``loop``), warmup SFT, seed rollouts, evaluation,
checkpoints, data-parallel ranks, seeding.

Nothing is imported here: import the module you need (``from trace.training.loop import Trainer``).
"""
