"""``predictor.explore_weight``: the exploration groups' roots weighted in the predictor's fit."""

import numpy as np
import pytest

from trace.configuration.params_file import ConfigError, load_config
from trace.predictor.labels import node_examples


def two_trees():
    """Two trees from the simulator: each a root with 4 rollouts and one continued prefix."""
    from trace.allocation.arms import get_arm
    from trace.allocation.samplers import SimulatorSampler
    from trace.allocation.step import allocate_step
    from trace.configuration.config import AllocationConfig, PredictorConfig, PredictorKind, SimulatorConfig
    from trace.envs.simulator import SimulatorEnvironment
    from trace.predictor.registry import make_predictor

    env = SimulatorEnvironment(SimulatorConfig(num_prompts=8, min_turns=3, max_turns=4), seed=0)
    oracle = make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)
    seeded = lambda salt: np.random.default_rng(sum(map(ord, salt)))  # noqa: E731
    sampler = SimulatorSampler(env, oracle, np.random.default_rng(0), seeded, step=0, ablation="test")
    acfg = AllocationConfig(trajectory_budget=16, num_candidates=2, group_size=4, m_min=4, m_max=4)
    return allocate_step(get_arm("tree_random"), env.prompts()[:2], sampler, acfg, seeded).trees


def test_root_weights_multiply_each_trees_root_and_leave_its_turn_nodes():
    trees = two_trees()
    ids, labels, plain, is_root = node_examples(trees)
    assert is_root.sum() == 2 and (~is_root).sum() > 0  # both trees were continued below the root
    _, labels_w, weighted, _ = node_examples(trees, [3.0, 0.5])
    first = len(ids[0])
    expected = plain.copy()
    expected[0] *= 3.0  # tree 0's root is its first labelled node, tree 1's the first of its own
    expected[first] *= 0.5
    np.testing.assert_array_equal(weighted, expected)
    np.testing.assert_array_equal(labels_w, labels)
    np.testing.assert_array_equal(node_examples(trees, [1.0, 1.0])[2], plain)
    for bad in ([1.0], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="root_weights must be 2 finite positive values, one per tree"):
            node_examples(trees, bad)


def test_the_history_predictor_counts_a_weighted_trees_outcomes_that_many_times(tmp_path):
    from trace.configuration.config import PredictorConfig, PredictorKind
    from trace.predictor.registry import load_predictor, make_predictor

    trees = two_trees()
    plain, weighted = (make_predictor(PredictorConfig(kind=PredictorKind.HISTORY)) for _ in range(2))
    plain.fit(trees)
    weighted.fit(trees, [1.0, 3.0])
    uid0, uid1 = trees[0].prompt_uid, trees[1].prompt_uid
    assert plain.successes[uid1] > 0 and plain.failures[uid1] > 0  # both counts show the weight
    assert weighted.successes[uid1] == 3.0 * plain.successes[uid1]
    assert weighted.failures[uid1] == 3.0 * plain.failures[uid1]
    assert weighted.failures[uid0] == plain.failures[uid0] > 0
    weighted.save(tmp_path / "history.pt")  # the weighted counts save and load back (torch's weights_only load)
    loaded = load_predictor(tmp_path / "history.pt", PredictorConfig(kind=PredictorKind.HISTORY))
    assert loaded.successes == weighted.successes
    with pytest.raises(ValueError, match="root_weights must be 2 finite positive values"):
        make_predictor(PredictorConfig(kind=PredictorKind.HISTORY)).fit(trees, [1.0, -1.0])


def test_explore_weight_is_checked_at_load_and_hashed_only_where_it_weights():
    from trace.configuration.config import config_from_dict

    # these params' hash from before the key existed (tests/test_config.py pins it too)
    assert config_from_dict({"policy": {"dtype": "float32"}, "update": {"bf16": False}}).params_hash() == "1d1ea06a8418"
    base = {"allocation.explore_groups": 2}
    default = load_config("params.yaml", base)
    assert load_config("params.yaml", {**base, "predictor.explore_weight": 1.0}).params_hash() == default.params_hash()
    for weight in ("balanced", 4.0):
        assert load_config("params.yaml", {**base, "predictor.explore_weight": weight}).params_hash() != \
            default.params_hash()
    with pytest.raises(ConfigError, match="explore_weight='balanced' weights the exploration groups' roots .* "
                                          "allocation.explore_groups is 0"):
        load_config("params.yaml", {"predictor.explore_weight": "balanced"})
    for bad in (0.0, -2.0, "uniform"):
        with pytest.raises(ConfigError, match="explore_weight"):
            load_config("params.yaml", {**base, "predictor.explore_weight": bad})


@pytest.mark.slow
@pytest.mark.parametrize("weight", [1.0, 2.5, "balanced"])
def test_a_run_weights_the_roots_of_the_exploration_groups_it_drew(tmp_path, weight):
    from tests.test_loop import tiny_trainer
    from trace.allocation.arms import get_arm
    from trace.training.recalibration import exploration_trees

    over = {"allocation.explore_groups": 1, "predictor.explore_weight": weight, "train.num_steps": 3,
            "predictor.window_steps": 2}
    trainer = tiny_trainer("trace", tmp_path, over)
    calls, fit = [], trainer.predictor.fit

    def recorded(trees, root_weights=None):
        calls.append((list(trees), None if root_weights is None else np.asarray(root_weights)))
        return fit(trees, root_weights)

    trainer.predictor.fit = recorded
    trainer.run()
    assert len(calls) == 3
    acfg = trainer.cfg.allocation
    for step, (window, weights) in enumerate(calls):
        assert {t.step for t in window} == set(range(max(0, step - 2), step + 1))  # 2 steps before, and this one
        if weight == 1.0:  # as without the key
            assert weights is None
            continue
        drawn = {t.tree_id for t in exploration_trees(window, get_arm("trace"), trainer.train_prompts, acfg,
                                                      trainer.cfg.seed)}
        assert len(drawn) == len({t.step for t in window})  # one exploration group a step
        chosen = {s: sum(t.step == s and t.tree_id not in drawn for t in window) for s in {t.step for t in window}}
        for tree, w in zip(window, weights):
            if tree.tree_id not in drawn:
                assert w == 1.0
            elif weight == "balanced":  # the candidates stage 1 passed over, over the one exploration group
                assert w == acfg.num_candidates - chosen[tree.step] and w > 1.0
            else:
                assert w == weight
