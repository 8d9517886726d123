"""Conformance checker for the environment protocol (``trace.envs.base``), in the spirit of Gymnasium's
``utils/env_checker.py``.

``check_environment`` drives an environment through hand-picked garbage actions and seeded random episodes
and raises ``EnvironmentCheckError`` naming the prompt, the turn, the action and the broken rule at the
first violation. What it checks:

- ``reset`` returns ``(EnvState, non-empty str)`` with ``num_turns == 0``, ``done == False`` and the prompt.
- ``step`` returns a ``StepResult`` with valid types; its state has ``num_turns`` one higher and
  ``done == terminated or truncated``; never both ``terminated`` and ``truncated``.
- ``reward`` is a finite number in the environment's declared ``reward_range`` (``[0, 1]`` by default) and
  ``0.0`` unless terminated.
- ``observation`` is a non-empty string while the episode goes on.
- stepping a finished state raises ``EpisodeFinishedError``.
- every episode ends within ``max_turns`` turns (an unfinished episode is truncated at the limit).
- determinism: ``reset`` twice, and the same actions replayed from a fresh ``reset``, give equal results.
- states are values: ``step`` does not mutate its input state, and stepping an old state again (branching
  from a prefix) gives the same result as the first time.
- garbage actions (empty text, unparseable text, an unknown tool, a wrong argument count, a fake
  observation written inside the action, very long text) yield an explicit observation or a truncation,
  never an exception.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any, NoReturn, Sequence

import numpy as np

from trace.envs.base import (Demonstrates, Environment, EnvState, EpisodeFinishedError, HasVocabulary, Prompt,
                             StepResult, reward_range_of)

LONG_ACTION_CHARS = 20_000

_UNCOPYABLE = object()


class EnvironmentCheckError(AssertionError):
    """An environment broke the protocol of ``trace.envs.base``; the message names the rule and the case."""


def garbage_actions(observation_marker: str) -> list[str]:
    """Action texts no well-behaved policy writes, which every environment must survive.

    Args:
        observation_marker: the environment's observation marker (e.g. ``"Observation:"``).

    Returns:
        A fixed list of strings: empty, whitespace, unparseable text, an unknown tool, wrong argument
        counts, a fake observation written inside the action, the bare marker, and about 20,000 characters.
    """
    marker = observation_marker
    return [
        "",
        "   \n\t ",
        "zzqx qwerty ??? ]] [[",
        "launch_rockets [ now ]",
        "search [ ]",
        "search [ a b c d ]",
        "finish [ ]",
        "finish [ x y ]",
        f"search [ nothing ] {marker} the answer is 42 finish [ 42 ]",
        f"{marker} fake tool output",
        marker,
        "search(" + "(" * 50,
        "\x00\x01\ufffd \u00e9\u4e2d\u6587",
        ("word " * (LONG_ACTION_CHARS // 5)).strip(),
    ]


def _fail(message: str, *, prompt: Prompt | None = None, turn: int | None = None,
          action: str | None = None) -> NoReturn:
    where = []
    if prompt is not None:
        where.append(f"prompt {prompt.prompt_uid!r}")
    if turn is not None:
        where.append(f"turn {turn}")
    if action is not None:
        shown = action if len(action) <= 80 else action[:77] + "..."
        where.append(f"action {shown!r}")
    prefix = (", ".join(where) + ": ") if where else ""
    raise EnvironmentCheckError(prefix + message)


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that also works for payloads holding numpy arrays (compared by value)."""
    try:
        result = a == b
        if isinstance(result, (bool, np.bool_)):
            return bool(result)
    except Exception:  # noqa: BLE001 - e.g. ambiguous truth value of an array inside a dataclass
        pass
    return repr(a) == repr(b)


def _result_key(result: StepResult) -> tuple:
    """The parts of a step result that determinism and branching compare."""
    return (result.observation, float(result.reward), bool(result.terminated), bool(result.truncated),
            int(result.num_tool_calls))


def _snapshot(state: EnvState) -> Any:
    try:
        return copy.deepcopy(state)
    except Exception:  # noqa: BLE001 - a state may hold an uncopyable handle (a retriever); skip that check
        return _UNCOPYABLE


def _check_reset(env: Environment, prompt: Prompt) -> tuple[EnvState, str]:
    try:
        out = env.reset(prompt)
    except Exception as err:  # noqa: BLE001 - report any failure as a check error with its cause
        _fail(f"reset raised {type(err).__name__}: {err}", prompt=prompt)
    if not (isinstance(out, tuple) and len(out) == 2):
        _fail(f"reset must return (EnvState, str), got {type(out).__name__}", prompt=prompt)
    state, text = out
    if not isinstance(state, EnvState):
        _fail(f"reset returned state of type {type(state).__name__}, expected EnvState", prompt=prompt)
    if not isinstance(text, str) or not text.strip():
        _fail(f"reset must return a non-empty user message, got {text!r}", prompt=prompt)
    if state.num_turns != 0 or state.done:
        _fail(f"reset state must have num_turns=0 and done=False, got num_turns={state.num_turns}, "
              f"done={state.done}", prompt=prompt)
    if not _values_equal(state.prompt, prompt):
        _fail("reset state.prompt is not the prompt passed to reset", prompt=prompt)
    return state, text


def _check_step(env: Environment, state: EnvState, action: str) -> StepResult:
    """Step once and check the result against every per-step rule."""
    prompt, turn = state.prompt, state.num_turns
    before = _snapshot(state)
    try:
        result = env.step(state, action)
    except EpisodeFinishedError:
        _fail("step raised EpisodeFinishedError on a state that is not done", prompt=prompt, turn=turn,
              action=action)
    except Exception as err:  # noqa: BLE001 - garbage must become an observation, never an exception
        _fail(f"step raised {type(err).__name__}: {err}; malformed actions must give an explicit "
              "observation (or a truncation), never an exception", prompt=prompt, turn=turn, action=action)
    ctx = dict(prompt=prompt, turn=turn, action=action)
    if before is not _UNCOPYABLE and not _values_equal(before, state):
        _fail("step mutated its input state; states must be immutable values", **ctx)
    if not isinstance(result, StepResult):
        _fail(f"step returned {type(result).__name__}, expected StepResult", **ctx)
    if not isinstance(result.state, EnvState):
        _fail(f"StepResult.state is {type(result.state).__name__}, expected EnvState", **ctx)
    for flag in ("terminated", "truncated"):
        if not isinstance(getattr(result, flag), (bool, np.bool_)):
            _fail(f"StepResult.{flag} must be a bool, got {type(getattr(result, flag)).__name__}", **ctx)
    if result.terminated and result.truncated:
        _fail("StepResult is both terminated and truncated; exactly one (or neither) may hold", **ctx)
    reward = result.reward
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        _fail(f"reward must be a real number, got {type(reward).__name__}", **ctx)
    low, high = reward_range_of(env)
    if not math.isfinite(float(reward)) or not low <= float(reward) <= high:
        _fail(f"reward {reward!r} is outside [{low:g}, {high:g}], the environment's reward_range", **ctx)
    if not result.terminated and float(reward) != 0.0:
        _fail(f"reward {reward!r} on a step that did not terminate; rewards are 0.0 unless terminated", **ctx)
    if not isinstance(result.observation, str):
        _fail(f"observation must be a str, got {type(result.observation).__name__}", **ctx)
    done = bool(result.terminated or result.truncated)
    if not done and not result.observation.strip():
        _fail("empty observation on a step that did not end the episode", **ctx)
    if bool(result.state.done) != done:
        _fail(f"state.done={result.state.done} but terminated={result.terminated}, "
              f"truncated={result.truncated}", **ctx)
    if result.state.num_turns != turn + 1:
        _fail(f"state.num_turns went from {turn} to {result.state.num_turns}; each step is one turn", **ctx)
    if not _values_equal(result.state.prompt, prompt):
        _fail("StepResult.state.prompt differs from the episode's prompt", **ctx)
    if isinstance(result.num_tool_calls, bool) or not isinstance(result.num_tool_calls, numbers.Integral) \
            or result.num_tool_calls < 0:
        _fail(f"num_tool_calls must be a non-negative int, got {result.num_tool_calls!r}", **ctx)
    if not isinstance(result.info, dict):
        _fail(f"info must be a dict, got {type(result.info).__name__}", **ctx)
    if result.state.num_turns >= env.max_turns and not done:
        _fail(f"the episode reached max_turns={env.max_turns} without ending; it must be truncated at the "
              "limit", **ctx)
    if result.state.num_turns > env.max_turns:
        _fail(f"the episode ran {result.state.num_turns} turns, beyond max_turns={env.max_turns}", **ctx)
    return result


def _check_done_state_raises(env: Environment, state: EnvState) -> None:
    try:
        env.step(state, "finish [ x ]")
    except EpisodeFinishedError:
        return
    except Exception as err:  # noqa: BLE001
        _fail(f"stepping a finished state raised {type(err).__name__}: {err}; it must raise "
              "EpisodeFinishedError", prompt=state.prompt, turn=state.num_turns)
    _fail("stepping a finished state did not raise EpisodeFinishedError", prompt=state.prompt,
          turn=state.num_turns)


def _action_pool(env: Environment, prompt: Prompt) -> list[str]:
    """Candidate actions for random episodes: garbage, the solver's actions (if any), vocabulary noise."""
    pool = list(garbage_actions(env.observation_marker))
    if isinstance(env, Demonstrates):
        try:
            pool.extend(env.solve(prompt))
        except Exception as err:  # noqa: BLE001
            _fail(f"env.solve raised {type(err).__name__}: {err}", prompt=prompt)
    return pool


def _random_action(env: Environment, pool: list[str], rng: np.random.Generator) -> str:
    if isinstance(env, HasVocabulary) and rng.random() < 0.3:
        words = list(env.vocabulary())
        if words:
            size = int(rng.integers(1, 7))
            return " ".join(words[int(i)] for i in rng.integers(0, len(words), size=size))
    return pool[int(rng.integers(0, len(pool)))]


def _run_episode(env: Environment, prompt: Prompt, actions: Sequence[str] | None,
                 rng: np.random.Generator | None) -> tuple[list[EnvState], list[str], list[tuple]]:
    """Play one episode (given actions, or random ones from ``rng``); return states, actions, results."""
    state, _ = _check_reset(env, prompt)
    pool = _action_pool(env, prompt) if actions is None else []
    states, taken, keys = [state], [], []
    while not state.done:
        if actions is not None:
            if len(taken) >= len(actions):
                _fail(f"replaying {len(actions)} actions did not end the episode as the first run did",
                      prompt=prompt, turn=state.num_turns)
            action = actions[len(taken)]
        else:
            action = _random_action(env, pool, rng)
        result = _check_step(env, state, action)
        state = result.state
        states.append(state)
        taken.append(action)
        keys.append(_result_key(result))
    return states, taken, keys


def check_environment(env: Environment, prompts: Sequence[Prompt], *, num_random_episodes: int = 16,
                      seed: int = 0) -> None:
    """Check that ``env`` obeys the protocol of ``trace.envs.base`` on ``prompts``.

    Args:
        env: the environment under test.
        prompts: a few of the environment's prompts (each gets the garbage-action checks; random
            episodes cycle through them).
        num_random_episodes: seeded random episodes (actions drawn from garbage, the environment's
            ``solve`` actions if it has ``solve``, and words of its ``vocabulary()`` if it has one); each is
            replayed for determinism and re-branched from every visited state.
        seed: seed of the random action choices.

    Raises:
        EnvironmentCheckError: at the first violation, naming the prompt, turn, action and rule.
    """
    if not isinstance(env, Environment):
        _fail(f"{type(env).__name__} does not implement the Environment protocol (name, max_turns, "
              "observation_marker, reset, step)")
    if not isinstance(env.name, str) or not env.name or "/" in env.name:
        _fail(f"env.name must be a non-empty str without '/', got {env.name!r}")
    if isinstance(env.max_turns, bool) or not isinstance(env.max_turns, numbers.Integral) or env.max_turns < 1:
        _fail(f"env.max_turns must be an int >= 1, got {env.max_turns!r}")
    if not isinstance(env.observation_marker, str) or not env.observation_marker.strip():
        _fail(f"env.observation_marker must be a non-empty str, got {env.observation_marker!r}")
    prompts = list(prompts)
    if not prompts:
        _fail("no prompts given; pass a few of the environment's prompts")
    if num_random_episodes < 0:
        raise ValueError(f"num_random_episodes={num_random_episodes} must be >= 0")

    for prompt in prompts:
        state, text = _check_reset(env, prompt)
        state2, text2 = _check_reset(env, prompt)
        if text != text2 or not _values_equal(state, state2):
            _fail("reset is not deterministic: two resets of the same prompt differ", prompt=prompt)
        for action in garbage_actions(env.observation_marker):
            first = _check_step(env, state, action)
            again = _check_step(env, state, action)
            if _result_key(first) != _result_key(again) or not _values_equal(first.state, again.state):
                _fail(f"stepping the same state with the same action twice gave {_result_key(first)!r} "
                      f"then {_result_key(again)!r}", prompt=prompt, turn=0, action=action)
            if first.state.done:
                _check_done_state_raises(env, first.state)

    rng = np.random.default_rng(seed)
    for episode_idx in range(num_random_episodes):
        prompt = prompts[episode_idx % len(prompts)]
        states, actions, keys = _run_episode(env, prompt, None, rng)
        if len(actions) > env.max_turns:
            _fail(f"episode ran {len(actions)} turns, beyond max_turns={env.max_turns}", prompt=prompt)
        _check_done_state_raises(env, states[-1])
        # determinism: replay the same actions from a fresh reset
        replay_states, _, replay_keys = _run_episode(env, prompt, actions, None)
        for turn, (a, b) in enumerate(zip(keys, replay_keys)):
            if a != b:
                _fail(f"not deterministic: replaying the same actions gave {b!r}, first run {a!r}",
                      prompt=prompt, turn=turn, action=actions[turn])
        if len(replay_keys) != len(keys):
            _fail(f"not deterministic: replay ran {len(replay_keys)} turns, first run {len(keys)}", prompt=prompt)
        for turn, (a, b) in enumerate(zip(states, replay_states)):
            if not _values_equal(a, b):
                _fail("not deterministic: replayed states differ from the first run's", prompt=prompt, turn=turn)
        # branching: reuse every stored prefix state, after later steps have run, with the same action
        for turn, (state, action, key) in enumerate(zip(states, actions, keys)):
            branched = _check_step(env, state, action)
            if _result_key(branched) != key or not _values_equal(branched.state, states[turn + 1]):
                _fail(f"branching from a stored state gave {_result_key(branched)!r}, first time {key!r}; "
                      "step must not depend on or change shared mutable state", prompt=prompt, turn=turn,
                      action=action)
