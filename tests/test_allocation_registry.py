"""The arm registry: rules and arms registered by name, looked up with a clear error, validated by the config."""

import numpy as np
import pytest

from trace.allocation.arms import ARMS, get_arm, register_arm, stage1_floor, uniform_root_counts
from trace.allocation.registry import (
    PREFIX_RULES,
    ROOT_RULES,
    Arm,
    RootDecision,
    get_prefix_rule,
    get_root_rule,
    register_prefix_rule,
    register_root_rule,
)
from trace.allocation.samplers import SimulatorSampler
from trace.allocation.step import allocate_step
from trace.configuration.config import ConfigError, PredictorConfig, PredictorKind, SimulatorConfig, config_from_dict
from trace.envs.simulator import SimulatorEnvironment
from trace.predictor.registry import make_predictor


@pytest.fixture
def scratch_registry():
    """Names registered inside a test are removed afterwards, so no made-up arm leaks into other tests."""
    before = (set(ROOT_RULES), set(PREFIX_RULES), set(ARMS))
    yield
    for table, names in zip((ROOT_RULES, PREFIX_RULES, ARMS), before):
        for name in set(table) - names:
            del table[name]


def _register_topk_variance_arm() -> Arm:
    @register_root_rule("test_topk_variance")
    def topk_variance(request):
        # the candidates of largest predicted p (1 - p) first, uniform groups of n
        order = np.argsort(-(request.pred_success_prob * (1 - request.pred_success_prob)), kind="stable")
        return RootDecision(uniform_root_counts(request.num_candidates, request.root_budget, request.group_size,
                                                order))

    return register_arm(Arm("test_topk", "test_topk_variance", "none", "grpo", uses_predictor=True))


def test_a_registered_root_rule_and_arm_are_valid_in_the_config_and_run_in_the_step(scratch_registry):
    arm = _register_topk_variance_arm()
    cfg = config_from_dict({"allocation": {"trajectory_budget": 16, "num_candidates": 8, "group_size": 4},
                            "train": {"ablations": ["grpo", "test_topk"]}})
    assert cfg.train.ablations == ("grpo", "test_topk") and get_arm("test_topk") is arm

    env = SimulatorEnvironment(SimulatorConfig(num_prompts=8), seed=0)
    oracle = make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)
    candidates = env.prompts()
    sampler = SimulatorSampler(env, oracle, np.random.default_rng(0), lambda salt: np.random.default_rng(1),
                               step=0, ablation="test_topk")
    result = allocate_step(arm, candidates, sampler, cfg.allocation, lambda salt: np.random.default_rng(2))
    p = np.asarray(oracle.predict_prompts(candidates, [c.question for c in candidates]))
    chosen = {t.prompt_uid for t in result.trees}
    expected = {candidates[i].prompt_uid for i in np.argsort(-(p * (1 - p)), kind="stable")[:4]}
    assert chosen == expected  # 16 trajectories in groups of 4: the 4 most uncertain prompts
    assert sum(t.num_trajectories() for t in result.trees) == 16


def test_unknown_names_fail_with_the_registered_ones():
    with pytest.raises(ValueError) as err:
        get_arm("ppo")
    assert all(name in str(err.value) for name in ARMS)
    with pytest.raises(ValueError) as err:
        get_root_rule("magic")
    assert all(name in str(err.value) for name in ROOT_RULES)
    with pytest.raises(ValueError) as err:
        get_prefix_rule("magic")
    assert all(name in str(err.value) for name in PREFIX_RULES)
    with pytest.raises(ConfigError) as err:
        config_from_dict({"train": {"ablations": ["magic"]}})
    assert all(name in str(err.value) for name in ARMS)


def test_a_name_registered_twice_fails(scratch_registry):
    with pytest.raises(ValueError, match="registered already"):
        register_root_rule("uniform")(lambda request: None)
    with pytest.raises(ValueError, match="registered already"):
        register_prefix_rule("random")(lambda request: None)
    with pytest.raises(ValueError, match="registered already"):
        register_arm(Arm("grpo", "uniform", "none", "grpo", uses_predictor=False))
    assert get_root_rule("uniform").fn.__name__ == "uniform_root_rule"  # the first registration stands


def test_an_arm_naming_an_unregistered_rule_is_refused(scratch_registry):
    with pytest.raises(ValueError, match="unknown root rule 'nope'"):
        register_arm(Arm("broken", "nope", "none", "grpo", uses_predictor=False))
    with pytest.raises(ValueError, match="unknown prefix rule 'nope'"):
        register_arm(Arm("broken", "uniform", "nope", "grpo", uses_predictor=False))
    assert "broken" not in ARMS


def test_a_registered_floor_is_checked_at_config_load(scratch_registry):
    @register_root_rule("test_floor8", floor=lambda num_candidates, root_budget, m_min, knapsack_m_min:
                        (8, "allocation.m_min", False))
    def floor8(request):
        return RootDecision(np.full(request.num_candidates, 8, dtype=np.int64))

    register_arm(Arm("test_floor8_arm", "test_floor8", "none", "grpo", uses_predictor=True))
    assert stage1_floor("test_floor8", 4, 32, 2, None) == (8, "allocation.m_min", False)
    with pytest.raises(ConfigError, match="train.ablations has test_floor8_arm"):
        config_from_dict({"allocation": {"num_candidates": 4, "trajectory_budget": 16, "m_max": 16},
                          "train": {"ablations": ["test_floor8_arm"]}})
    with pytest.raises(ValueError, match="no stage-1 floor"):
        stage1_floor("uniform", 4, 32, 2, None)

