"""The environment protocol every task implements (Gymnasium's reset/step contract, for text agents).

An environment owns a task's data (questions, corpus, tools) and a verifier. Episodes are functional: the
state after each step is an immutable value returned to the caller, so the rollout engine can branch from
any visited prefix by reusing the state stored on that tree node (no re-simulation, no shared mutation).

Contract (checked by ``trace.envs.checker.check_environment``):
- ``reset(prompt)`` returns the initial ``EnvState`` and the opening user message.
- ``step(state, action_text)`` returns a ``StepResult``. Exactly one of three cases:
  * not done: ``terminated = truncated = False``, ``reward = 0.0``, ``observation`` non-empty;
  * terminated: the policy gave a final answer; ``reward`` is the verifier's score, a finite float in
    the environment's declared ``reward_range`` (``(0.0, 1.0)`` for every task here; read it with
    ``reward_range_of``);
  * truncated: the turn limit was reached without an answer; ``reward`` is 0.0 and must not be read as
    a verified failure of a completed attempt.
- Stepping a finished state raises ``EpisodeFinishedError``.
- The same prompt and the same actions give the same observations and rewards (determinism).
- Actions are data: a tool call is parsed from text and executed by safe code; model text is never executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from trace.tree import make_prompt_uid


class EpisodeFinishedError(RuntimeError):
    """``step`` was called on a state whose episode already terminated or was truncated."""


@dataclass(frozen=True)
class Prompt:
    """One task instance.

    Attributes:
        data_source: dataset / environment name, e.g. ``"kgqa"``; no ``/``.
        example_id: id unique within ``data_source``.
        question: the question or instruction shown to the policy.
        answer: gold answer(s) in the task's own form (JSON-serialisable).
        meta: extra JSON-serialisable fields (hop count, context paragraphs, tool specs, latent p, ...).
    """

    data_source: str
    example_id: str
    question: str
    answer: Any = None
    meta: dict = field(default_factory=dict)

    @property
    def prompt_uid(self) -> str:
        return make_prompt_uid(self.data_source, self.example_id)


@dataclass(frozen=True)
class EnvState:
    """Immutable episode state after ``turn_idx`` completed turns.

    Attributes:
        prompt: the episode's prompt.
        num_turns: completed turns so far.
        done: the episode ended (terminated or truncated).
        data: task-specific immutable payload (e.g. a tuple of visited entities, a latent value).
    """

    prompt: Prompt
    num_turns: int = 0
    done: bool = False
    data: Any = None


@dataclass(frozen=True)
class StepResult:
    """Outcome of one ``step``.

    Attributes:
        state: the new state.
        observation: tool output appended to the context ("" when the episode ended).
        reward: verifier reward in the environment's ``reward_range`` when terminated, else 0.0.
        terminated: the policy gave a final answer.
        truncated: the turn limit was reached without a final answer.
        num_tool_calls: tool calls this step executed (0 or 1).
        info: diagnostics (``"parse_error"``, ``"f1"``, ``"true_success_prob"``, ...).
    """

    state: EnvState
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    num_tool_calls: int = 0
    info: dict = field(default_factory=dict)


DEFAULT_REWARD_RANGE = (0.0, 1.0)  # a binary / [0, 1] verifier: what an environment without a declaration gets


@runtime_checkable
class Environment(Protocol):
    """What the rollout engine needs from a task.

    Attributes:
        name: the data source name (``Prompt.data_source``).
        max_turns: turns after which an unfinished episode is truncated.
        observation_marker: the text that starts an observation; generation stops when the policy emits it.

    An environment also declares ``reward_range = (low, high)``, the inclusive range of its terminal
    rewards, after Gymnasium's ``Env.reward_range`` (a shaped verifier may declare e.g. ``(-1.0, 1.0)``);
    it is read with ``reward_range_of``, which gives ``DEFAULT_REWARD_RANGE`` when it is missing, so it is
    not a member ``isinstance`` requires.
    """

    name: str
    max_turns: int
    observation_marker: str

    def reset(self, prompt: Prompt) -> tuple[EnvState, str]:
        """Start an episode: return the initial state and the user message (question + instructions)."""
        ...

    def step(self, state: EnvState, action_text: str) -> StepResult:
        """Apply the policy's turn text (thought + action) and return the result.

        Raises:
            EpisodeFinishedError: if ``state.done``.
        """
        ...


# Optional capabilities: an environment has one when it defines the method; test with ``isinstance``.

@runtime_checkable
class KnowsTrueSuccessProb(Protocol):
    """Environments that can report the true ``V(H) = P(r = 1 | H)`` of a state (the simulator)."""

    def true_success_prob(self, state: EnvState) -> float:
        ...


@runtime_checkable
class GeneratesPrompts(Protocol):
    """Environments that generate their own prompts (the embedded tasks: kgqa, simulator)."""

    def prompts(self, split: str = "train") -> list[Prompt]:
        """The prompts of ``split`` (``"train"`` or ``"eval"``), the same on every call."""
        ...


@runtime_checkable
class HasVocabulary(Protocol):
    """Environments whose every text is words of a closed vocabulary (a word-level tokenizer covers it)."""

    def vocabulary(self) -> list[str]:
        """Every word the policy reads or writes."""
        ...


@runtime_checkable
class Demonstrates(Protocol):
    """Environments that can write a correct episode's action texts for a prompt (warmup demonstrations)."""

    def solve(self, prompt: Prompt) -> list[str]:
        """Action texts that, stepped in order from ``reset(prompt)``, end the episode with a full reward."""
        ...


@runtime_checkable
class ChecksPrompts(Protocol):
    """Environments that can tell before any episode whether they can serve given prompts."""

    def check_prompts(self, prompts: Sequence[Prompt]) -> None:
        """Raise ``ValueError`` (``trace.data_paths.DataError`` for data problems) naming the first prompt
        the environment cannot serve and the fix."""
        ...


def reward_range_of(env: Any) -> tuple[float, float]:
    """The inclusive range ``(low, high)`` of ``env``'s terminal rewards.

    Args:
        env: an environment; its ``reward_range`` attribute, or ``DEFAULT_REWARD_RANGE`` when it has none.

    Returns:
        ``(low, high)`` as floats.

    Raises:
        ValueError: if the declaration is not two finite numbers with ``low <= high`` (names the environment).
    """
    declared = getattr(env, "reward_range", DEFAULT_REWARD_RANGE)
    try:
        low, high = (float(v) for v in declared)
    except (TypeError, ValueError):
        raise ValueError(f"environment {getattr(env, 'name', env)!r} declares reward_range {declared!r}; "
                         "declare two numbers (low, high), e.g. reward_range = (0.0, 1.0)") from None
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"environment {getattr(env, 'name', env)!r} declares reward_range {declared!r}; it needs "
                         "finite low <= high, e.g. (0.0, 1.0)")
    return low, high


def continue_or_truncate(state: EnvState, num_turns: int, history: Any, observation: str, max_turns: int, *,
                         num_tool_calls: int = 0, info: dict | None = None) -> StepResult:
    """The result of a turn that gave no final answer: the episode goes on with ``observation``, or, once
    ``num_turns`` reaches ``max_turns``, is truncated (empty observation, reward 0, not a verified failure).

    Args:
        state: the state the turn was taken from.
        num_turns: completed turns including this one.
        history: the new state's ``data``.
        observation: tool output shown to the policy when the episode goes on.
        max_turns: the environment's turn limit.
        num_tool_calls: tool calls this turn executed (reported when the episode goes on).
        info: diagnostics.
    """
    info = {} if info is None else info
    if num_turns >= max_turns:
        return StepResult(state=EnvState(state.prompt, num_turns, True, history), observation="", reward=0.0,
                          terminated=False, truncated=True, info=info)
    return StepResult(state=EnvState(state.prompt, num_turns, False, history), observation=observation,
                      reward=0.0, terminated=False, truncated=False, num_tool_calls=num_tool_calls, info=info)


def prompts_by_uid(prompts: Sequence[Prompt]) -> dict[str, Prompt]:
    """Index prompts by ``prompt_uid``.

    Raises:
        ValueError: on a duplicate ``prompt_uid`` (names both examples).
    """
    out: dict[str, Prompt] = {}
    for p in prompts:
        if p.prompt_uid in out:
            raise ValueError(f"duplicate prompt_uid {p.prompt_uid!r}: ids must be unique within a data source")
        out[p.prompt_uid] = p
    return out
