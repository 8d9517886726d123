"""This project's allocators inside other trainers.

``RolloutAllocator`` (``allocator.py``) is framework-free: candidates in, per-prompt counts out, rewards back.
``trl_grpo.py`` is the TRL adapter (``TraceGRPOTrainer``, needs the ``trl`` extra) and is loaded only when
that name is asked for; ``verl_recipe.py`` holds the pure functions of the verl recipe (docs/integrations.md).
"""

from __future__ import annotations

import importlib

from trace.integrations.allocator import Allocation, RolloutAllocator, group_outcome_metrics, planning_arms, \
    predictor_arms, stage2_arms

__all__ = ["Allocation", "RolloutAllocator", "TraceGRPOTrainer", "group_outcome_metrics", "planning_arms",
           "predictor_arms", "stage2_arms"]


def __getattr__(name: str):
    # TRL (and torch with it) loads only when the adapter is asked for
    if name == "TraceGRPOTrainer":
        return importlib.import_module("trace.integrations.trl_grpo").TraceGRPOTrainer
    raise AttributeError(f"module 'trace.integrations' has no attribute {name!r}")
