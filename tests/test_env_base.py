import math

import numpy as np
import pytest

from trace.configuration.config import KGQAConfig, SimulatorConfig, TaskConfig
from trace.data_paths import DataError
from trace.envs.base import (DEFAULT_REWARD_RANGE, ChecksPrompts, Demonstrates, GeneratesPrompts, HasVocabulary,
                             KnowsTrueSuccessProb, Prompt, reward_range_of)
from trace.envs.checker import _action_pool, _random_action
from trace.envs.fc import FunctionCallingEnvironment
from trace.envs.kgqa import KGQAEnvironment
from trace.envs.math import MathEnvironment
from trace.envs.qa import QAEnvironment
from trace.envs.registry import make_environment
from trace.envs.retrieval import ContextBM25Retriever
from trace.envs.simulator import SimulatorEnvironment


@pytest.mark.parametrize("env_class", [QAEnvironment, MathEnvironment, FunctionCallingEnvironment, KGQAEnvironment,
                                       SimulatorEnvironment], ids=lambda c: c.__name__)
def test_every_environment_declares_its_binary_reward_range(env_class):
    assert env_class.reward_range == (0.0, 1.0)
    assert reward_range_of(env_class) == (0.0, 1.0)


def test_an_environment_without_a_declaration_gets_the_default_range():
    class Undeclared:
        name = "toy"

    assert reward_range_of(Undeclared()) == DEFAULT_REWARD_RANGE == (0.0, 1.0)


def test_a_shaped_range_is_read_as_declared():
    class Shaped:
        name = "shaped"
        reward_range = (-1, 1)

    assert reward_range_of(Shaped()) == (-1.0, 1.0)


@pytest.mark.parametrize("declared", [(1.0, 0.0), (0.0, math.inf), ("a", "b"), (0.0,), None])
def test_a_malformed_reward_range_is_refused_naming_the_environment(declared):
    class Bad:
        name = "bad"
        reward_range = declared

    with pytest.raises(ValueError, match=r"environment 'bad' declares reward_range"):
        reward_range_of(Bad())


# ---- optional capabilities --------------------------------------------------------------------------------

def _kgqa():
    return KGQAEnvironment(KGQAConfig(num_train=20, num_eval=5), seed=0)


def test_environments_declare_their_optional_capabilities():
    kg, sim = _kgqa(), SimulatorEnvironment(SimulatorConfig(num_prompts=5), seed=0)
    math_env, fc_env = MathEnvironment("gsm8k"), FunctionCallingEnvironment("bfcl")
    qa_env = QAEnvironment("hotpotqa", ContextBM25Retriever())
    has = {cap.__name__: [type(e).__name__ for e in (kg, sim, math_env, fc_env, qa_env) if isinstance(e, cap)]
           for cap in (GeneratesPrompts, HasVocabulary, Demonstrates, KnowsTrueSuccessProb, ChecksPrompts)}
    assert has == {
        "GeneratesPrompts": ["KGQAEnvironment", "SimulatorEnvironment"],
        "HasVocabulary": ["KGQAEnvironment", "SimulatorEnvironment"],
        "Demonstrates": ["KGQAEnvironment", "MathEnvironment", "FunctionCallingEnvironment", "QAEnvironment"],
        "KnowsTrueSuccessProb": ["SimulatorEnvironment"],
        "ChecksPrompts": ["QAEnvironment"],
    }


def test_the_checker_draws_solver_actions_and_vocabulary_words_only_from_capable_environments():
    class Plain:
        name, max_turns, observation_marker = "toy", 2, "Observation:"

    kg = _kgqa()
    prompt = kg.prompts("train")[0]
    assert set(kg.solve(prompt)) <= set(_action_pool(kg, prompt))
    assert len(_action_pool(kg, prompt)) > len(_action_pool(Plain(), prompt))
    rng = np.random.default_rng(0)
    vocabulary = set(kg.vocabulary())
    pool = ["<pool>"]
    drawn = [_random_action(kg, pool, rng) for _ in range(50)]
    assert any(a != "<pool>" and set(a.split()) <= vocabulary for a in drawn)
    assert {_random_action(Plain(), pool, rng) for _ in range(20)} == {"<pool>"}


def test_the_registry_checks_given_prompts_before_serving_them():
    hotpot = TaskConfig(name="hotpotqa")
    with_context = Prompt("hotpotqa", "1", "q?", ["a"], {"context": [["T", "text"]]})
    assert isinstance(make_environment(hotpot, 0, prompts=[with_context]), QAEnvironment)
    make_environment(hotpot, 0)  # no prompts given: nothing to check
    with pytest.raises(DataError, match=r"task 'hotpotqa': 1 prompts \(first 'hotpotqa/2'\) have no context"):
        make_environment(hotpot, 0, prompts=[with_context, Prompt("hotpotqa", "2", "q?", ["a"])])
    with pytest.raises(DataError, match="belongs to 'kgqa', not task 'gsm8k'"):
        make_environment(TaskConfig(name="gsm8k"), 0, prompts=[Prompt("kgqa", "1", "q?")])
