"""Exploration groups (``allocation.explore_groups``): uniformly drawn candidates get a group inside the budget."""

import numpy as np
import pytest

from trace.allocation.arms import get_arm
from trace.allocation.samplers import SimulatorSampler
from trace.allocation.step import allocate_step, exploration_draw
from trace.configuration.params_file import ConfigError
from trace.configuration.config import AllocationConfig, PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.simulator import SimulatorEnvironment
from trace.predictor.registry import make_predictor

ACFG = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=4, m_max=8)
FORECASTS = np.array([0.5, 0.45, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # stage 1 passes over every candidate at 0


def seeded(salt: str) -> np.random.Generator:
    return np.random.default_rng(sum(map(ord, salt)))


class FixedForecasts(SimulatorSampler):
    """The simulator's rollouts under fixed root forecasts, so which candidates stage 1 skips is known."""

    def score_prompts(self, prompts):
        return FORECASTS[: len(prompts)].copy()


def step(arm: str, explore_groups: int, seed: int = 0):
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=16, min_turns=2, max_turns=4), seed=seed)
    oracle = make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)
    sampler = FixedForecasts(env, oracle, np.random.default_rng(0), seeded, step=0, ablation="test")
    acfg = ACFG.model_copy(update={"explore_groups": explore_groups})
    candidates = env.prompts()[:8]
    return candidates, allocate_step(get_arm(arm), candidates, sampler, acfg, seeded)


def roots_by_prompt(trees):
    return {t.prompt_uid: t.root.num_branches for t in trees}


@pytest.mark.parametrize("arm", ["trace", "trace_root", "pcl"])
def test_drawn_candidates_get_a_group_inside_the_budget_whatever_their_forecast(arm):
    candidates, plain = step(arm, 0)
    if arm == "trace":  # its root budget (16) fits the two candidates forecast near 0.5: it passes over the rest
        assert set(roots_by_prompt(plain.trees)) == {candidates[0].prompt_uid, candidates[1].prompt_uid}
    drawn = exploration_draw(get_arm(arm), 8, 2, seeded)
    assert len(drawn) == 2 and FORECASTS[drawn].max() == 0.0  # this draw shows the point: both forecast at 0
    _, explored = step(arm, 2)
    roots = roots_by_prompt(explored.trees)
    assert all(roots[candidates[i].prompt_uid] == ACFG.group_size for i in drawn)
    # the step still spends exactly the budget, all of it trained on
    assert sum(t.num_trajectories() for t in explored.trees) == ACFG.trajectory_budget
    assert explored.sampled_trees is explored.trees
    assert explored.metrics["allocation/explore_groups"] == 2.0
    root_budget = ACFG.root_budget if get_arm(arm).has_expansion else ACFG.trajectory_budget
    assert explored.root_counts.sum() == root_budget
    # the root rule spent the rest of the root budget on the other candidates
    assert sum(roots[c.prompt_uid] for i, c in enumerate(candidates) if i not in drawn
               and c.prompt_uid in roots) == root_budget - 2 * ACFG.group_size


def test_the_draw_is_uniform_and_ignores_the_forecasts():
    counts = np.zeros(8)
    for s in range(4000):
        rng = np.random.default_rng(s)
        counts[exploration_draw(get_arm("trace"), 8, 2, lambda salt: rng)] += 1
    assert np.allclose(counts / 4000, 2 / 8, atol=0.03)


@pytest.mark.parametrize("arm", ["grpo", "tree_random", "knapsack", "trace_oracle"])
def test_arms_that_do_not_pass_over_prompts_by_forecast_do_not_explore(arm):
    assert exploration_draw(get_arm(arm), 8, 2, seeded).size == 0
    if arm == "trace_oracle":
        return
    (_, plain), (_, explored) = step(arm, 0), step(arm, 2)
    records = [[[(n.node_id, n.parent_id, n.reward, n.num_branches) for n in t.nodes] for t in r.trees]
               for r in (plain, explored)]
    assert records[0] == records[1]
    assert "allocation/explore_groups" not in explored.metrics


def test_explore_groups_are_checked_at_load_against_what_they_leave_each_exploring_arm():
    from trace.configuration.params_file import load_config

    small = {"allocation.trajectory_budget": 128, "allocation.num_candidates": 8, "allocation.group_size": 4,
             "allocation.m_min": 4, "allocation.m_max": 8}
    # trace: root budget 64; 2 groups of 4 leave 56 for 6 candidates, more than 6 x m_max = 48 can take
    with pytest.raises(ConfigError, match=r"trace after allocation.explore_groups=2 \(left: 6 candidates, 56 root "):
        load_config("params.yaml", {**small, "allocation.explore_groups": 2, "train.ablations": ["trace"]})
    load_config("params.yaml", {**small, "allocation.explore_groups": 2, "train.ablations": ["grpo"]})  # no explorer
    with pytest.raises(ConfigError, match="explore_groups=8 leaves no candidate to stage 1 of num_candidates=8"):
        load_config("params.yaml", {**small, "allocation.explore_groups": 8, "train.ablations": ["grpo"]})
    # the default task: 8 groups of 8 would take trace's whole root budget of 64; 7 leave it one group
    with pytest.raises(ConfigError, match=r"explore_groups=8 x group_size=8 leaves nothing of its root budget 64"):
        load_config("params.yaml", {"allocation.explore_groups": 8, "train.ablations": ["trace"]})
    load_config("params.yaml", {"allocation.explore_groups": 7, "train.ablations": ["trace", "trace_root", "pcl"]})


def test_no_exploration_keeps_the_params_hash_and_exploration_changes_it():
    from trace.configuration.params_file import load_config

    from trace.configuration.config import config_from_dict

    # these params' hash from before the key existed (tests/test_config.py pins it too)
    assert config_from_dict({"policy": {"dtype": "float32"}, "update": {"bf16": False}}).params_hash() == "1d1ea06a8418"
    default = load_config("params.yaml")
    assert load_config("params.yaml", {"allocation.explore_groups": 0}).params_hash() == default.params_hash()
    assert load_config("params.yaml", {"allocation.explore_groups": 1}).params_hash() != default.params_hash()


def test_a_root_rule_that_samples_itself_refuses_exploration_groups(monkeypatch):
    import trace.allocation.step as step_module

    monkeypatch.setattr(step_module, "EXPLORING_ROOT_RULES", ("trace", "pcl", "dapo"))
    with pytest.raises(ValueError, match="dapo: root rule 'dapo' samples its own groups and cannot take"):
        step("dapo", 2)
