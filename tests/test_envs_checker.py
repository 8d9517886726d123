from dataclasses import dataclass, replace

import pytest

from trace.configuration.config import KGQAConfig, SimulatorConfig, TaskConfig, TaskName
from trace.envs import registry
from trace.envs.base import Environment, EnvState, EpisodeFinishedError, Prompt, StepResult
from trace.envs.checker import EnvironmentCheckError, check_environment, garbage_actions
from trace.envs.kgqa import KGQAEnvironment
from trace.envs.registry import make_environment, valid_task_names
from trace.envs.simulator import SimulatorEnvironment

PROMPTS = [Prompt("toy", "a", "say finish"), Prompt("toy", "b", "say finish twice")]


class ToyEnv:
    """A correct toy task: an action containing 'finish' ends the episode with reward 1, anything else goes on."""

    name = "toy"
    max_turns = 3
    observation_marker = "Observation:"

    def reset(self, prompt):
        return EnvState(prompt=prompt, data=()), prompt.question

    def step(self, state, action_text):
        if state.done:
            raise EpisodeFinishedError("done")
        turns = state.num_turns + 1
        data = state.data + (len(action_text),)
        if "finish" in action_text.split("Observation:")[0]:
            return StepResult(EnvState(state.prompt, turns, True, data), "", 1.0, True, False)
        if turns >= self.max_turns:
            return StepResult(EnvState(state.prompt, turns, True, data), "", 0.0, False, True)
        return StepResult(EnvState(state.prompt, turns, False, data), f"seen {len(action_text)}", 0.0, False, False)

    def solve(self, prompt):
        return ["finish"]


class RaisesOnEmpty(ToyEnv):
    def step(self, state, action_text):
        if not action_text:
            raise ValueError("no action")
        return super().step(state, action_text)


class RewardBeforeTheEnd(ToyEnv):
    def step(self, state, action_text):
        return replace(super().step(state, action_text), reward=0.5)


class BothTerminatedAndTruncated(ToyEnv):
    def step(self, state, action_text):
        result = super().step(state, action_text)
        return replace(result, truncated=True) if result.terminated else result


class EmptyObservation(ToyEnv):
    def step(self, state, action_text):
        return replace(super().step(state, action_text), observation="")


class SteppingFinishedStateWorks(ToyEnv):
    def step(self, state, action_text):
        return super().step(replace(state, done=False), action_text)


class NeverTruncates(ToyEnv):
    def step(self, state, action_text):
        turns = state.num_turns + 1
        return StepResult(EnvState(state.prompt, turns, False, ()), "more", 0.0, False, False)


class RewardAboveOne(ToyEnv):
    def step(self, state, action_text):
        result = super().step(state, action_text)
        return replace(result, reward=1.5) if result.terminated else result


class CountsCalls(ToyEnv):
    """Observations depend on a counter shared across episodes: not deterministic."""

    def __init__(self):
        self.calls = 0

    def step(self, state, action_text):
        self.calls += 1
        result = super().step(state, action_text)
        return result if result.state.done else replace(result, observation=f"call {self.calls}")


class MutatesState(ToyEnv):
    def reset(self, prompt):
        return EnvState(prompt=prompt, data=[]), prompt.question

    def step(self, state, action_text):
        if state.done:
            raise EpisodeFinishedError("done")
        state.data.append(action_text)
        turns = state.num_turns + 1
        done = turns >= self.max_turns
        return StepResult(EnvState(state.prompt, turns, done, state.data), "" if done else "ok", 0.0, False, done)


@dataclass
class _Memory:
    last: str = ""


class RemembersLastEpisode(ToyEnv):
    """Keeps the previous action in the environment: branching from an old state sees a later action."""

    def __init__(self):
        self.memory = _Memory()

    def step(self, state, action_text):
        previous, self.memory.last = self.memory.last, action_text
        result = super().step(state, action_text)
        return result if result.state.done else replace(result, observation=f"after {len(previous)}")


class EmptyUserMessage(ToyEnv):
    def reset(self, prompt):
        return EnvState(prompt=prompt, data=()), " "


class SkipsTurnCount(ToyEnv):
    def step(self, state, action_text):
        result = super().step(state, action_text)
        return replace(result, state=replace(result.state, num_turns=state.num_turns))


def test_correct_toy_environment_passes():
    check_environment(ToyEnv(), PROMPTS, num_random_episodes=10)


@pytest.mark.parametrize("env_cls, message", [
    (RaisesOnEmpty, r"step raised ValueError: no action; malformed actions"),
    (RewardBeforeTheEnd, r"reward 0.5 on a step that did not terminate"),
    (BothTerminatedAndTruncated, r"both terminated and truncated"),
    (EmptyObservation, r"empty observation on a step that did not end"),
    (SteppingFinishedStateWorks, r"did not raise EpisodeFinishedError"),
    (NeverTruncates, r"reached max_turns=3 without ending"),
    (RewardAboveOne, r"reward 1.5 is outside \[0, 1\]"),
    (CountsCalls, r"same action twice|not deterministic"),
    (MutatesState, r"step mutated its input state"),
    (RemembersLastEpisode, r"same action twice|not deterministic|branching"),
    (EmptyUserMessage, r"non-empty user message"),
    (SkipsTurnCount, r"num_turns went from 0 to 0"),
])
def test_checker_rejects_each_broken_rule_with_a_precise_message(env_cls, message):
    with pytest.raises(EnvironmentCheckError, match=message):
        check_environment(env_cls(), PROMPTS, num_random_episodes=10)


def test_checker_names_prompt_and_action_in_its_message():
    with pytest.raises(EnvironmentCheckError, match=r"prompt 'toy/a', turn 0, action ''"):
        check_environment(RaisesOnEmpty(), PROMPTS)


def test_checker_rejects_empty_prompt_list_and_non_environments():
    with pytest.raises(EnvironmentCheckError, match="no prompts"):
        check_environment(ToyEnv(), [])
    with pytest.raises(EnvironmentCheckError, match="does not implement the Environment protocol"):
        check_environment(object(), PROMPTS)


def test_garbage_actions_cover_the_listed_malformed_kinds():
    actions = garbage_actions("Observation:")
    assert "" in actions
    assert any(a.startswith("launch_rockets") for a in actions)  # unknown tool
    assert "search [ a b c d ]" in actions and "search [ ]" in actions  # wrong argument counts
    assert any("Observation:" in a and a.index("Observation:") > 0 for a in actions)  # fake observation
    assert max(len(a) for a in actions) >= 19_000  # very long text


@pytest.mark.parametrize("name", [TaskName.KGQA, TaskName.SIMULATOR])
def test_embedded_environments_from_the_registry_pass_the_checker(name):
    task_cfg = TaskConfig(name=name, kgqa=KGQAConfig(num_train=40, num_eval=10),
                          simulator=SimulatorConfig(num_prompts=20))
    env = make_environment(task_cfg, seed=3)
    assert isinstance(env, Environment)
    prompts = env.prompts("train")[:6] + env.prompts("eval")[:2]
    check_environment(env, prompts, num_random_episodes=24, seed=1)


def test_registry_builds_the_configured_embedded_task():
    kg = make_environment(TaskConfig(max_turns=6, kgqa=KGQAConfig(num_train=30, num_eval=5)), seed=0)
    assert isinstance(kg, KGQAEnvironment) and kg.max_turns == 6 and len(kg.prompts("train")) == 30
    sim = make_environment(TaskConfig(name="simulator", simulator=SimulatorConfig(num_prompts=7, max_turns=4)), 0)
    assert isinstance(sim, SimulatorEnvironment) and sim.max_turns == 4 and len(sim.prompts("train")) == 7


def test_registry_unknown_name_lists_the_valid_names():
    bad = TaskConfig.model_construct(name="chess")
    with pytest.raises(ValueError, match=r"unknown task name 'chess'; valid names: \['kgqa', 'simulator', "):
        make_environment(bad, seed=0)
    assert set(valid_task_names()) == {t.value for t in TaskName}


def test_registry_reports_a_real_data_module_that_cannot_be_imported(monkeypatch):
    monkeypatch.setitem(registry.REAL_DATA_MODULES, TaskName.GSM8K, "trace.envs.no_such_module")
    with pytest.raises(ImportError, match=r"task 'gsm8k' needs the module trace.envs.no_such_module"):
        make_environment(TaskConfig(name="gsm8k"), seed=0)


def test_registry_reports_a_module_without_the_factory(monkeypatch):
    monkeypatch.setitem(registry.REAL_DATA_MODULES, TaskName.BFCL, "trace.envs.base")
    with pytest.raises(ImportError, match=r"trace.envs.base has no from_task_config"):
        make_environment(TaskConfig(name="bfcl"), seed=0)


class RewardsUpToTwo(ToyEnv):
    """Declares rewards in [0, 2] and pays 1.5 on a correct finish."""

    reward_range = (0.0, 2.0)

    def step(self, state, action_text):
        result = super().step(state, action_text)
        return replace(result, reward=1.5) if result.terminated and result.reward == 1.0 else result


def test_checker_reads_the_environments_declared_reward_range():
    check_environment(RewardsUpToTwo(), PROMPTS, num_random_episodes=10)
    with pytest.raises(EnvironmentCheckError, match=r"reward 1.5 is outside \[0, 1\]"):
        check_environment(RewardAboveOne(), PROMPTS, num_random_episodes=10)
