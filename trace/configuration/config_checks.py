"""The rules of ``params.yaml`` that read several sections, run when a ``Config`` is built (its ``after``
validator), so a bad combination fails at load with the keys to change, not after the warmup.

Each check takes the built ``trace.configuration.config.Config`` and raises ``ValueError`` naming the keys.
"""

from __future__ import annotations

from trace.allocation.arms import get_arm, root_budget_for
from trace.allocation.registry import get_root_rule
from trace.allocation.root import check_root_budget_feasible
from trace.allocation.step import explores


def check_root_budgets(cfg) -> None:
    """Every arm in ``train.ablations`` that solves stage 1 can split its root budget (for an arm that explores, what
    ``allocation.explore_groups`` leaves of it over the other candidates).

    Raises:
        ValueError: naming the arm and the budget keys that make its stage 1 infeasible.
    """
    acfg = cfg.allocation
    for ablation in cfg.train.ablations:
        spec = get_arm(ablation)
        root_budget = root_budget_for(spec, acfg.trajectory_budget, acfg.expansion_ratio)
        num_candidates = acfg.num_candidates
        if acfg.explore_groups and explores(spec):  # the root rule allocates what the exploration groups leave
            reserved = acfg.explore_groups * acfg.group_size
            if reserved >= root_budget:
                raise ValueError(f"train.ablations has {spec.name}: allocation.explore_groups={acfg.explore_groups} x "
                                 f"group_size={acfg.group_size} leaves nothing of its root budget {root_budget}: "
                                 "lower explore_groups")
            root_budget, num_candidates = root_budget - reserved, num_candidates - acfg.explore_groups
        floor_fn = get_root_rule(spec.root_rule).floor
        if floor_fn is None:  # the rule does not solve stage 1
            continue
        floor, floor_key, allow_skip = floor_fn(num_candidates, root_budget, acfg.m_min, acfg.knapsack_m_min)
        try:
            check_root_budget_feasible(num_candidates, root_budget, floor, acfg.m_max,
                                       allow_skip=allow_skip, m_min_key=floor_key)
        except ValueError as err:
            where = (f" after allocation.explore_groups={acfg.explore_groups} (left: {num_candidates} candidates, "
                     f"{root_budget} root rollouts)" if num_candidates != acfg.num_candidates else "")
            raise ValueError(f"train.ablations has {spec.name}{where}: {err}") from None


def check_candidate_pool(cfg) -> None:
    """A step's ``allocation.num_candidates`` distinct prompts fit in the training pool, where the params fix its
    size (the train stage checks the prepared prompts of every task), and ``train.prompt_pool`` fits in the task's.

    Raises:
        ValueError: naming ``allocation.num_candidates`` and the key that sizes the pool, or ``train.prompt_pool``
            and the task's key (or ``train.probe_prompts``, whose prompts come from the pool).
    """
    if cfg.task.name.value == "kgqa":
        key, pool = "task.kgqa.num_train", cfg.task.kgqa.num_train
    elif cfg.task.name.value == "simulator":
        key, pool = "task.simulator.num_prompts", cfg.task.simulator.num_prompts
    elif cfg.task.files.max_train is not None:
        key, pool = "task.files.max_train", cfg.task.files.max_train
    else:
        key, pool = None, None
    if cfg.train.prompt_pool is not None:
        if pool is not None and cfg.train.prompt_pool > pool:
            raise ValueError(f"train.prompt_pool={cfg.train.prompt_pool} exceeds {key}={pool} training prompts: "
                             f"lower train.prompt_pool, or leave it unset (null) to draw from all of them")
        key, pool = "train.prompt_pool", cfg.train.prompt_pool
        if cfg.train.probe_prompts > pool:  # the probe reads the first probe_prompts of the pool
            raise ValueError(f"train.probe_prompts={cfg.train.probe_prompts} exceeds train.prompt_pool={pool}: the "
                             "probe reads its prompts from the pool; lower train.probe_prompts or raise the pool")
    if pool is None:
        return
    if cfg.allocation.num_candidates > pool:
        raise ValueError(f"allocation.num_candidates={cfg.allocation.num_candidates} exceeds {key}={pool} "
                         "training prompts, and a step's candidates are distinct prompts: lower "
                         f"allocation.num_candidates or raise {key}")


def check_root_recalibration(cfg) -> None:
    """``predictor.recalibrate_roots: explore`` fits the root map on the exploration groups: the map must be on, and
    every arm that reads forecasts at stage 1 must draw such groups.

    Raises:
        ValueError: naming ``predictor.recalibrate``, ``allocation.explore_groups`` or the arm.
    """
    if cfg.predictor.recalibrate_roots != "explore":
        return
    if not cfg.predictor.recalibrate:
        raise ValueError("predictor.recalibrate_roots=explore chooses what the root map is fitted on, but "
                         "predictor.recalibrate is false: set predictor.recalibrate: true, or recalibrate_roots: window")
    if not cfg.allocation.explore_groups:
        raise ValueError("predictor.recalibrate_roots=explore fits the root map on the exploration groups, and "
                         "allocation.explore_groups is 0: set allocation.explore_groups > 0, or recalibrate_roots: "
                         "window")
    for ablation in cfg.train.ablations:  # an arm whose stage 1 reads forecasts it draws no such groups for
        spec = get_arm(ablation)
        if spec.uses_predictor and spec.scores == "predictor" and spec.root_rule != "uniform" and not explores(spec):
            raise ValueError(f"train.ablations has {spec.name}, whose stage 1 reads forecasts but draws no exploration "
                             "groups (its root rule is not in EXPLORING_ROOT_RULES), so predictor.recalibrate_roots="
                             "explore leaves its root map nothing to fit: drop the arm, or set recalibrate_roots: "
                             "window")


def check_explore_weight(cfg) -> None:
    """``predictor.explore_weight`` other than 1 weights the exploration groups' roots: there must be some.

    Raises:
        ValueError: naming ``predictor.explore_weight`` and ``allocation.explore_groups``.
    """
    if cfg.predictor.explore_weight != 1.0 and not cfg.allocation.explore_groups:
        raise ValueError(f"predictor.explore_weight={cfg.predictor.explore_weight!r} weights the exploration groups' "
                         "roots in the predictor's fit, and allocation.explore_groups is 0: set "
                         "allocation.explore_groups > 0, or explore_weight: 1")


def check_evaluate_split(cfg) -> None:
    """``evaluate.split: test`` reads a test split the task generates: ``task.kgqa.num_test`` questions, at least
    ``evaluate.num_prompts`` of them (a held-out claim on fewer questions than asked for would be silent).

    Raises:
        ValueError: naming ``evaluate.split`` and the key that gives the task its test split.
    """
    if cfg.evaluate.split != "test":
        return
    if cfg.task.name.value != "kgqa":
        raise ValueError(f"evaluate.split=test needs a test split, which only task kgqa generates "
                         f"(task.kgqa.num_test); task {cfg.task.name.value!r} has train and eval only: "
                         "set evaluate.split=eval")
    num_test = cfg.task.kgqa.num_test
    if num_test < cfg.evaluate.num_prompts:
        raise ValueError(f"evaluate.split=test reads evaluate.num_prompts={cfg.evaluate.num_prompts} questions but "
                         f"task.kgqa.num_test={num_test}: raise task.kgqa.num_test to at least "
                         f"{cfg.evaluate.num_prompts} or lower evaluate.num_prompts")
