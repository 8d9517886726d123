"""Rollout budget allocation: stage 1 (roots), stage 2 (prefixes), the arms by name, and one step over a sampler."""

from trace.allocation.arms import ARMS, RootPlan, get_arm, plan_root_counts, register_arm, root_budget_for
from trace.allocation.dapo import NoMixedGroupError, run_dapo
from trace.allocation.prefix_rules import ExpansionPlan, plan_expansion
from trace.allocation.registry import (
    PREFIX_RULES,
    ROOT_RULES,
    Arm,
    get_prefix_rule,
    get_root_rule,
    register_prefix_rule,
    register_root_rule,
)
from trace.allocation.step import StepResult, StepSampler, allocate_step

__all__ = [
    "ARMS", "Arm", "ExpansionPlan", "NoMixedGroupError", "PREFIX_RULES", "ROOT_RULES", "RootPlan", "StepResult",
    "StepSampler", "allocate_step", "get_arm", "get_prefix_rule", "get_root_rule", "plan_expansion",
    "plan_root_counts", "register_arm", "register_prefix_rule", "register_root_rule", "root_budget_for", "run_dapo",
]
