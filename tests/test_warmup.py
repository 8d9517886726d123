"""Warmup demonstrations: solver arguments, prompts without a demonstration, and a warmup with none at all."""

from types import SimpleNamespace

import pytest

import trace.training.warmup as warmup
from trace.configuration.config import Config
from trace.envs.base import Prompt

PROMPTS = [Prompt("toy", str(i), f"question {i}", "a", {}) for i in range(4)]


class PlainSolver:
    """A solver that takes no noise (as the real-data ones): every odd prompt has no demonstration."""

    def solve(self, prompt):
        return [] if int(prompt.example_id) % 2 else [f"finish[{prompt.example_id}]"]


class NoisySolver:
    def __init__(self):
        self.calls = []

    def solve(self, prompt, *, demo_noise=0.0, seed=0):
        self.calls.append((prompt.example_id, demo_noise, seed))
        return [f"finish[{prompt.example_id}]"]


@pytest.fixture()
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(warmup, "trajectory_from_actions",
                        lambda policy, env, prompt, actions: calls.append((prompt.example_id, actions)) or prompt)
    return calls


def test_prompts_without_a_demonstration_are_skipped_and_plain_solvers_get_no_noise(recorded):
    trees = warmup.demonstration_trees(None, PlainSolver(), PROMPTS, demo_noise=0.3, seed=1)
    assert [p.example_id for p in trees] == ["0", "2"]
    assert recorded == [("0", ["finish[0]"]), ("2", ["finish[2]"])]


def test_a_solver_that_takes_noise_gets_the_warmup_noise_and_a_seed_per_prompt(recorded):
    env = NoisySolver()
    warmup.demonstration_trees(None, env, PROMPTS, demo_noise=0.3, seed=1)
    assert [c[1] for c in env.calls] == [0.3] * 4
    assert len({c[2] for c in env.calls}) == 4  # one seed per prompt
    again = NoisySolver()
    warmup.demonstration_trees(None, again, PROMPTS, demo_noise=0.3, seed=1)
    assert again.calls == env.calls  # a function of the params alone


def test_a_warmup_without_any_demonstration_stops_with_the_fix(recorded):
    env = SimpleNamespace(solve=lambda prompt: [])
    with pytest.raises(ValueError, match="none of the 4 training prompts has a demonstration.*warmup.enabled"):
        warmup.run_warmup(SimpleNamespace(model=None), env, PROMPTS, Config(), progress=False)
