"""The predictor's labels: ``subtree`` (every leaf below a node) against ``branch_point`` (the trajectories sampled at
or above it), on a hand-worked tree and on the simulator, whose true success probabilities are known."""

import numpy as np
import pytest

from trace.configuration.config import AllocationConfig, Config, PredictorConfig, PredictorKind
from trace.predictor.labels import branch_point_labels, node_examples
from trace.tree import FinishReason, Origin, RolloutTree


def hand_tree() -> RolloutTree:
    """Root 0; root rollouts 0-1-2-3 (reward 0) and 0-4 (reward 1); 2 continuations of anchor 2 (5, 6: reward 1);
    a two-turn continuation of anchor 1 (7-8: reward 1)."""
    t = RolloutTree(tree_id="t", prompt_uid="kgqa/1", data_source="kgqa", example_id="1")
    t.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
    t.add_node(0, turn_idx=0, origin=Origin.ROLLOUT)  # 1
    t.add_node(1, turn_idx=1, origin=Origin.ROLLOUT)  # 2
    t.add_node(2, turn_idx=2, origin=Origin.ROLLOUT, reward=0.0, finish_reason=FinishReason.TERMINATED)  # 3
    t.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, reward=1.0, finish_reason=FinishReason.TERMINATED)  # 4
    for _ in range(2):  # 5, 6
        t.add_node(2, turn_idx=2, origin=Origin.BRANCH, branch_anchor_id=2, reward=1.0,
                   finish_reason=FinishReason.TERMINATED)
    t.add_node(1, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=1)  # 7
    t.add_node(7, turn_idx=2, origin=Origin.BRANCH, branch_anchor_id=1, reward=1.0,
               finish_reason=FinishReason.TERMINATED)  # 8
    return t


def test_branch_point_labels_count_each_trajectory_up_to_where_it_was_sampled():
    tree = hand_tree()
    label, weight = branch_point_labels(tree)
    # root: the two root rollouts; 1: its root rollout and anchor 1's continuation; 2: its root rollout and its own
    # two continuations; 7: the continuation through it; leaves: themselves
    np.testing.assert_allclose(weight[[0, 1, 2, 7]], [2, 2, 3, 1])
    np.testing.assert_allclose(label[[0, 1, 2, 7]], [0.5, 0.5, 2 / 3, 1.0])
    sub_label, sub_weight = tree.node_success_labels()  # every leaf below
    np.testing.assert_allclose(sub_weight[[0, 1, 2, 7]], [5, 4, 3, 1])
    np.testing.assert_allclose(sub_label[[0, 1, 2, 7]], [0.8, 0.75, 2 / 3, 1.0])


def test_node_examples_reads_the_scheme_and_refuses_an_unknown_one():
    trees = [hand_tree()]
    ids, labels, weights, is_root = node_examples(trees, scheme="branch_point")
    assert ids == [[0, 1, 2, 7]] and is_root.tolist() == [True, False, False, False]
    np.testing.assert_allclose(weights, [2, 2, 3, 1])
    _, _, root_weighted, _ = node_examples(trees, [3.0], scheme="branch_point")
    np.testing.assert_allclose(root_weighted, [6, 2, 3, 1])
    np.testing.assert_allclose(node_examples(trees)[2], [5, 4, 3, 1])  # subtree by default
    with pytest.raises(ValueError, match="predictor.labels='leaf'.*subtree, branch_point"):
        node_examples(trees, scheme="leaf")


def test_a_continuation_whose_anchor_is_not_on_its_path_is_refused():
    tree = hand_tree()
    tree.nodes[8].branch_anchor_id = 4  # a leaf of another root rollout
    with pytest.raises(ValueError, match="leaf 8 names branch anchor 4"):
        branch_point_labels(tree)


def test_labels_are_hashed_only_where_they_differ_from_subtree():
    from trace.configuration.config import config_from_dict

    # these params' hash from before the key existed (tests/test_config.py pins it too)
    assert config_from_dict({"policy": {"dtype": "float32"}, "update": {"bf16": False}}).params_hash() == "1d1ea06a8418"
    base = Config()
    assert Config(predictor=PredictorConfig(labels="subtree")).params_hash() == base.params_hash()
    assert Config(predictor=PredictorConfig(labels="branch_point")).params_hash() != base.params_hash()
    with pytest.raises(ValueError):
        PredictorConfig(labels="leaves")


def test_a_head_predictor_fits_and_scores_on_its_configured_labels():
    from trace.predictor.registry import make_predictor
    trees = [hand_tree()]
    for scheme, outcomes in (("subtree", 13.0), ("branch_point", 8.0)):
        predictor = make_predictor(PredictorConfig(kind=PredictorKind.ENCODER, labels=scheme, epochs=1))
        assert predictor.fit(trees)["predictor/fit_outcomes"] == outcomes
        assert predictor.evaluate(trees)["predictor/num_outcomes"] == outcomes


def simulated_labels(scheme: str, seeds=(0, 1, 2), num_steps: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Root labels of ``trace`` on the simulator, forecasts of a noisy oracle: (true V, label, weight)."""
    from benchmarks import allocation_quality as aq
    from trace.allocation.arms import get_arm, make_allocator_state
    from trace.configuration.config import SimulatorConfig
    from trace.envs.simulator import SimulatorEnvironment
    acfg, spec, rows = AllocationConfig(), get_arm("trace"), []
    for seed in seeds:
        env = SimulatorEnvironment(SimulatorConfig(num_prompts=256), seed=seed)
        pool = env.prompts("train")
        predictor = aq.make_setting_predictor("noisy_0.5", env, [])
        state = make_allocator_state(spec, acfg)
        for step in range(num_steps):
            trees, _ = aq.simulated_step(spec, env, pool, predictor, acfg, seed=seed, step=step, state=state)
            _, labels, weights, is_root = node_examples(trees, scheme=scheme)
            truth = [tree.nodes[0].true_success_prob for tree in trees]
            rows.append((np.asarray(truth), labels[is_root], weights[is_root]))
    return tuple(np.concatenate(col) for col in zip(*rows))


def test_on_the_simulator_branch_point_root_labels_are_unbiased_and_subtree_ones_pulled_to_the_middle():
    """Stage 2 picks anchors by forecast and factual reward; their continuations pull a root's subtree label toward
    the anchors' values. Binned by the true success probability, an unbiased label's weighted mean equals it."""
    def bias_by_truth(scheme: str) -> np.ndarray:
        truth, label, weight = simulated_labels(scheme)
        bins = np.minimum((truth * 5).astype(int), 4)
        return np.array([np.average(label[bins == b] - truth[bins == b], weights=weight[bins == b])
                         for b in range(5)])

    subtree, branch = bias_by_truth("subtree"), bias_by_truth("branch_point")
    assert subtree[0] > 0.04 and subtree[4] < -0.04, subtree  # low roots labelled high, high roots low
    assert np.all(np.abs(branch) < 0.03), branch
