"""build_policy: the run's starting policy from the ``policy`` section and the task's environment."""

from types import SimpleNamespace

import pytest
import torch

from trace.configuration.config import KGQAConfig, PolicyConfig
from trace.envs.kgqa import KGQAEnvironment
from trace.policy.build import build_policy
from trace.policy.format import FormatKind
from trace.policy.model import build_tiny_policy

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
KGQA_CFG = KGQAConfig(num_entities=30, num_relations=4, facts_per_entity=2, num_distractors=1, num_train=40,
                      num_eval=10)


def test_a_tiny_policy_is_built_over_the_tasks_vocabulary_with_the_given_seed():
    env = KGQAEnvironment(KGQA_CFG, seed=3, max_turns=4)
    built = build_policy(TINY, env, 5, "kgqa")
    direct = build_tiny_policy(TINY, env.vocabulary(), 5)
    assert built.tokenizer.get_vocab() == direct.tokenizer.get_vocab()
    assert all(torch.equal(a, b) for a, b in zip(built.model.state_dict().values(), direct.model.state_dict().values()))


def test_a_tiny_policy_for_a_task_without_a_closed_vocabulary_is_an_error():
    env = SimpleNamespace(observation_marker="Observation:")
    with pytest.raises(ValueError, match="policy.kind=tiny needs a task with a closed vocabulary; task gsm8k"):
        build_policy(TINY, env, 0, "gsm8k")


def test_a_pretrained_policy_is_loaded_from_its_folder_with_the_environments_marker(tmp_path):
    words = ["question", ":", "?", "e1", "Observation:"]
    source = build_tiny_policy(TINY, words, 0)
    source.model.save_pretrained(tmp_path)
    source.tokenizer.save_pretrained(tmp_path)
    env = SimpleNamespace(observation_marker="Observation:")  # no vocabulary: a pretrained policy needs none
    loaded = build_policy(PolicyConfig(kind="pretrained", model_path=str(tmp_path)), env, 0, "kgqa")
    assert loaded.format.kind == FormatKind.PLAIN
    assert loaded.format.observation_marker == "Observation:"
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(),
                                                 source.model.state_dict().values()))
