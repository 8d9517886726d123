import math

import pytest

from trace.envs.base import DEFAULT_REWARD_RANGE, reward_range_of
from trace.envs.fc import FunctionCallingEnvironment
from trace.envs.kgqa import KGQAEnvironment
from trace.envs.math import MathEnvironment
from trace.envs.qa import QAEnvironment
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
