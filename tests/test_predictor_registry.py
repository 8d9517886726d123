"""The predictor registry: every kind has one backend, built by make_predictor and restored by load_predictor."""

from pathlib import Path

import numpy as np
import pytest

from trace.configuration.config import PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.simulator import SimulatorEnvironment
from trace.predictor.base import PredictorBase, SuccessPredictor
from trace.predictor.history import HistoryPredictor
from trace.predictor.history_path import HistoryPathPredictor
from trace.predictor.registry import PREDICTORS, load_predictor, make_predictor, register_predictor, registered_kinds


def bag_of_words(texts, dim: int = 16) -> np.ndarray:
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for i, text in enumerate(texts):
        for word in text.split():
            out[i, len(word) % dim] += 1.0
    return out


class TinyPolicy:
    def __init__(self):
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        self.model = Qwen3ForCausalLM(Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                  head_dim=8, max_position_embeddings=64)).eval()


@pytest.fixture(scope="module")
def simulator():
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=12, min_turns=2, max_turns=4), seed=1)
    trees = env.sample_root_rollouts(env.prompts(), [4] * 12, np.random.default_rng(0), step=0)
    return env, trees


def test_every_predictor_kind_has_exactly_one_registered_backend_of_that_kind():
    assert set(PREDICTORS) == set(PredictorKind)
    assert registered_kinds() == [k.value for k in PredictorKind]
    for kind, cls in PREDICTORS.items():
        assert issubclass(cls, PredictorBase) and cls.kind == kind


def test_make_predictor_builds_the_registered_class_of_every_kind(simulator):
    env, _ = simulator
    for kind, cls in PREDICTORS.items():
        predictor = make_predictor(PredictorConfig(kind=kind), env=env, policy=TinyPolicy(), seed=3,
                                   encode_fn=bag_of_words)
        assert type(predictor) is cls and isinstance(predictor, SuccessPredictor) and predictor.seed == 3


def test_register_predictor_refuses_a_class_of_another_kind_and_a_second_backend():
    with pytest.raises(ValueError, match="not 'oracle'"):
        register_predictor(PredictorKind.ORACLE, HistoryPredictor)

    class OtherHistory(HistoryPredictor):
        pass

    with pytest.raises(ValueError, match="already implemented by HistoryPredictor"):
        register_predictor(PredictorKind.HISTORY, OtherHistory)
    assert PREDICTORS[PredictorKind.HISTORY] is HistoryPredictor
    assert register_predictor(PredictorKind.HISTORY, HistoryPredictor) is HistoryPredictor  # idempotent


def test_a_kind_without_a_backend_is_refused_with_the_registered_kinds(monkeypatch):
    monkeypatch.delitem(PREDICTORS, PredictorKind.HISTORY_PATH)
    with pytest.raises(ValueError, match=r"'history_path' has no implementation; valid kinds: \['encoder', "
                                         r"'history', 'policy_head', 'oracle', 'noisy_oracle'\]"):
        make_predictor(PredictorConfig(kind=PredictorKind.HISTORY_PATH))


def test_history_path_kind_is_built_from_the_config_prior_and_clip(simulator):
    _, trees = simulator
    cfg = PredictorConfig(kind=PredictorKind.HISTORY_PATH, prior_alpha=0.5, prior_beta=1.5, clip=0.05)
    built = make_predictor(cfg, seed=2)
    direct = HistoryPathPredictor(0.5, 1.5, clip=0.05, seed=2)
    for predictor in (built, direct):
        predictor.fit(trees[:6])
    ids = [list(range(len(t.nodes))) for t in trees[6:]]
    for a, b in zip(built.predict_trees(trees[6:], ids), direct.predict_trees(trees[6:], ids)):
        np.testing.assert_array_equal(a, b)
        assert a.min() >= 0.05 and a.max() <= 0.95
    with pytest.raises(ValueError, match="does not exist"):
        built.predict_nodes(trees[0], [len(trees[0].nodes)])


def test_history_path_state_round_trips_and_refuses_another_prior(tmp_path: Path, simulator):
    _, trees = simulator
    cfg = PredictorConfig(kind=PredictorKind.HISTORY_PATH, prior_alpha=0.5, prior_beta=1.5)
    predictor = make_predictor(cfg, seed=4)
    predictor.fit(trees[:6])
    path = tmp_path / "predictor.pt"
    predictor.save(path)
    loaded = load_predictor(path, cfg)
    assert loaded.seed == 4
    for tree in trees:
        ids = list(range(len(tree.nodes)))
        np.testing.assert_array_equal(loaded.predict_nodes(tree, ids), predictor.predict_nodes(tree, ids))
    predictor.fit(trees)
    loaded.fit(trees)
    np.testing.assert_array_equal(loaded.weights, predictor.weights)
    assert loaded.evaluate(trees) == predictor.evaluate(trees)
    with pytest.raises(ValueError, match="prior"):
        load_predictor(path, cfg.model_copy(update={"prior_alpha": 1.0}))
