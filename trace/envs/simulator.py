"""A rollout simulator with known truth: conditional success probabilities that move as a bounded martingale.

Each prompt has a latent success probability ``p ~ Beta(difficulty_alpha, difficulty_beta)`` (U-shaped by
default: most prompts are nearly always or nearly never solved, as for a real policy) and a number of turns
``T`` drawn uniformly from ``[min_turns, max_turns]``. Along a trajectory the conditional success
probability starts at ``V_0 = p`` and moves once per turn,

    V_t ~ Beta(c * V_{t-1}, c * (1 - V_{t-1})),   c = step_concentration,   t = 1 .. T,

so ``E[V_t | V_{t-1}] = V_{t-1}`` and ``V_t`` stays in ``[0, 1]``; the terminal turn's reward is
``Bernoulli(V_T)``. ``V`` is therefore the true ``V(H_t) = P(r = 1 | H_t)`` of every prefix (Proposition 1),
and the expected sum of squared steps below a prefix, counting the last step from ``V_T`` to the reward,
equals ``V(H_t)(1 - V(H_t))`` (Proposition 2). The step variance is ``V(1 - V) / (c + 1)``: a small ``c``
decides outcomes early in the trajectory, a large ``c`` leaves them to the last turn.

Two faces of the same process:
- ``SimulatorEnvironment`` implements the environment protocol. Any action text is accepted; the
  observation is ``progress up`` or ``progress down`` (the direction ``V`` moved). The randomness of a step
  comes from a hash of the state's key (itself a hash of seed, prompt and every earlier action text) and
  the action text, so the same actions replay identically and two continuations of a prefix that sample
  different texts draw different moves. ``true_success_prob(state)`` reads ``V``.
- ``sample_root_rollouts`` / ``sample_continuations`` draw whole rollout trees with numpy and no language
  model, for benchmarks of allocators at scale: every node carries ``true_success_prob``, per-turn token
  counts are ``1 + Poisson(mean_tokens_per_turn - 1)`` generated tokens (the ``loss_mask`` length; token
  ids are zeros) plus the observation's 2 tokens on non-terminal turns.

Convention: a terminal node's ``true_success_prob`` is ``V_T``, the probability its reward was drawn with
(not the reward itself).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import numpy as np

from trace.configuration.config import SimulatorConfig
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult
from trace.tree import FinishReason, Origin, RolloutTree

DATA_SOURCE = "simulator"
OBSERVATION_MARKER = "Observation:"
OBS_UP, OBS_DOWN = "progress up", "progress down"
OBS_NUM_TOKENS = 2  # "progress" + "up" / "down"
ACTION_TEXT = "act"  # action text of nodes drawn by the tree sampler


def _digest(*parts: object) -> str:
    return hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=16).hexdigest()


def martingale_step(success_prob: np.ndarray, concentration: float, rng: np.random.Generator) -> np.ndarray:
    """One Beta step of the conditional success probability: ``V' ~ Beta(c V, c (1 - V))``.

    Args:
        success_prob: (S,) float64 current ``V`` in ``[0, 1]``.
        concentration: ``c > 0``; the step variance is ``V (1 - V) / (c + 1)``.
        rng: numpy generator (one ``beta`` draw per row where ``0 < V < 1``).

    Returns:
        (S,) float64 next ``V``, with mean ``V``; rows at exactly 0 or 1 (absorbed) stay there.

    References:
        docs/method.md#simulator; the mean of ``Beta(a, b)`` is ``a / (a + b)``, which makes ``V`` a
        martingale (TRACE, arXiv 2606.11119, Proposition 1).
    """
    v = np.asarray(success_prob, dtype=np.float64)
    a, b = concentration * v, concentration * (1.0 - v)
    movable = (a > 0) & (b > 0)
    out = v.copy()
    if movable.any():
        out[movable] = rng.beta(a[movable], b[movable])
    return out


@dataclass(frozen=True)
class SimulatorStateData:
    """``EnvState.data`` of the simulator.

    Attributes:
        success_prob: ``V`` after the completed turns (``p`` at reset; ``V_T`` once terminated).
        key: hash of (seed, prompt uid, every action text so far): the source of the next step's randomness.
        reward: the drawn reward once terminated, else ``None``.
    """

    success_prob: float
    key: str
    reward: float | None = None


def _prompt_params(prompt: Prompt) -> tuple[float, int]:
    """(latent success probability, number of turns) of a simulator prompt, validated."""
    try:
        p = float(prompt.meta["latent_success_prob"])
        num_turns = int(prompt.meta["num_turns"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"prompt {prompt.prompt_uid!r} needs meta latent_success_prob (float) and num_turns "
                         f"(int), got meta {prompt.meta!r}; use SimulatorEnvironment.prompts()") from None
    if not 0.0 <= p <= 1.0 or num_turns < 1:
        raise ValueError(f"prompt {prompt.prompt_uid!r}: latent_success_prob={p} must be in [0, 1] and "
                         f"num_turns={num_turns} >= 1")
    return p, num_turns


class SimulatorEnvironment:
    """The martingale simulator (see the module docstring) as an environment and as a tree sampler.

    Attributes:
        name: ``"simulator"``.
        max_turns: ``cfg.max_turns``; every trajectory terminates at its prompt's ``T <= max_turns``.
        observation_marker: ``"Observation:"``.
        reward_range: ``(0.0, 1.0)``: the terminal reward is ``Bernoulli(V_T)``.
        cfg: the ``SimulatorConfig``.
        seed: seed of the prompts and of the environment's hashed step randomness.
    """

    name = DATA_SOURCE
    observation_marker = OBSERVATION_MARKER
    reward_range = (0.0, 1.0)

    def __init__(self, cfg: SimulatorConfig, *, seed: int = 0, num_eval: int | None = None) -> None:
        """Draw the prompts' latent success probabilities and turn counts.

        Args:
            cfg: simulator section of the config.
            seed: seed of prompts and steps.
            num_eval: held-out prompts (``eval`` split); default ``max(1, num_prompts // 10)``.

        Raises:
            ValueError: if ``cfg.min_turns > cfg.max_turns`` or ``num_eval < 1``.
        """
        if cfg.min_turns > cfg.max_turns:
            raise ValueError(f"simulator.min_turns={cfg.min_turns} > simulator.max_turns={cfg.max_turns}; "
                             "set min_turns <= max_turns")
        num_eval = max(1, cfg.num_prompts // 10) if num_eval is None else int(num_eval)
        if num_eval < 1:
            raise ValueError(f"num_eval={num_eval} must be >= 1")
        self.cfg = cfg
        self.seed = int(seed)
        self.max_turns = int(cfg.max_turns)
        self._prompts = {split: self._make_prompts(split, n)
                         for split, n in (("train", cfg.num_prompts), ("eval", num_eval))}

    def _make_prompts(self, split: str, count: int) -> list[Prompt]:
        cfg = self.cfg
        rng = np.random.default_rng(int(_digest(self.seed, "simulator-prompts", split)[:16], 16))
        probs = rng.beta(cfg.difficulty_alpha, cfg.difficulty_beta, size=count)
        turns = rng.integers(cfg.min_turns, cfg.max_turns + 1, size=count)
        width = max(5, len(str(count - 1)))
        return [Prompt(data_source=DATA_SOURCE, example_id=f"{split}-{i:0{width}d}",
                       question=f"task {split} {i}", answer=None,
                       meta={"latent_success_prob": float(probs[i]), "num_turns": int(turns[i])})
                for i in range(count)]

    def prompts(self, split: Literal["train", "eval"] = "train") -> list[Prompt]:
        """The prompts of ``split``; ``meta`` holds ``latent_success_prob`` and ``num_turns``.

        Raises:
            ValueError: on an unknown split.
        """
        if split not in self._prompts:
            raise ValueError(f"unknown split {split!r}; valid splits: {sorted(self._prompts)}")
        return list(self._prompts[split])

    # ---- environment protocol ---------------------------------------------------------------------
    def reset(self, prompt: Prompt) -> tuple[EnvState, str]:
        """Start an episode at ``V_0 = p``; the user message is the prompt's question.

        Raises:
            ValueError: if the prompt lacks ``meta["latent_success_prob"]`` / ``meta["num_turns"]``.
        """
        p, _ = _prompt_params(prompt)
        data = SimulatorStateData(success_prob=p, key=_digest(self.seed, "simulator-episode", prompt.prompt_uid))
        return EnvState(prompt=prompt, num_turns=0, done=False, data=data), prompt.question

    def step(self, state: EnvState, action_text: str) -> StepResult:
        """Move ``V`` one Beta step; at the prompt's last turn draw the reward ``Bernoulli(V_T)``.

        Any text is a valid action; its text (hashed with the state's key) seeds the step. A prompt whose
        ``num_turns`` exceeds ``max_turns`` is truncated at ``max_turns``.

        Raises:
            EpisodeFinishedError: if ``state.done``.
        """
        if state.done:
            raise EpisodeFinishedError(f"episode of {state.prompt.prompt_uid!r} already ended after "
                                       f"{state.num_turns} turns; reset to start a new one")
        _, num_turns_total = _prompt_params(state.prompt)
        data: SimulatorStateData = state.data
        key = _digest(data.key, action_text)
        rng = np.random.default_rng(int(key[:16], 16))
        v = float(martingale_step(np.array([data.success_prob]), self.cfg.step_concentration, rng)[0])
        num_turns = state.num_turns + 1
        info = {"true_success_prob": v}
        if num_turns >= num_turns_total:
            reward = float(rng.random() < v)
            new = EnvState(state.prompt, num_turns, True, SimulatorStateData(v, key, reward))
            return StepResult(new, "", reward, terminated=True, truncated=False, info=info)
        if num_turns >= self.max_turns:
            new = EnvState(state.prompt, num_turns, True, SimulatorStateData(v, key))
            return StepResult(new, "", 0.0, terminated=False, truncated=True, info=info)
        observation = OBS_UP if v >= data.success_prob else OBS_DOWN
        new = EnvState(state.prompt, num_turns, False, SimulatorStateData(v, key))
        return StepResult(new, observation, 0.0, terminated=False, truncated=False, info=info)

    def true_success_prob(self, state: EnvState) -> float:
        """``V(H)`` of the state's prefix (``p`` at reset, ``V_T`` once terminated)."""
        return float(state.data.success_prob)

    def vocabulary(self) -> list[str]:
        """Every word of prompts, observations, the sampler's action text and the marker, in a stable order.

        Returns:
            ``task train eval act progress up down Observation:`` then the prompt numbers ``0 .. n-1``
            (n = the larger split). Policy actions are free text and are not covered.
        """
        count = max(len(prompts) for prompts in self._prompts.values())
        return (["task", "train", "eval", ACTION_TEXT, "progress", "up", "down", OBSERVATION_MARKER]
                + [str(i) for i in range(count)])

    # ---- vectorised tree sampler ------------------------------------------------------------------
    def _sample_paths(self, start_prob: np.ndarray, num_steps: np.ndarray, rng: np.random.Generator
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draw ``num_steps[s]`` martingale steps from ``start_prob[s]`` for every row s, then the reward.

        Returns:
            values: (S, L + 1) float64, column 0 the start, column t the ``V`` after step t (NaN past the
                row's end); L = max(num_steps).
            rewards: (S,) float64 in {0, 1}, ``Bernoulli`` of the row's last ``V``.
            gen_tokens: (S, L) int64 generated tokens per turn, ``1 + Poisson(mean_tokens_per_turn - 1)``.
        """
        num_rows = len(start_prob)
        max_steps = int(num_steps.max()) if num_rows else 0
        values = np.full((num_rows, max_steps + 1), np.nan)
        values[:, 0] = start_prob
        for t in range(1, max_steps + 1):
            active = num_steps >= t
            values[active, t] = martingale_step(values[active, t - 1], self.cfg.step_concentration, rng)
        final = values[np.arange(num_rows), num_steps]
        rewards = (rng.random(num_rows) < final).astype(np.float64)
        gen_tokens = 1 + rng.poisson(max(self.cfg.mean_tokens_per_turn - 1.0, 0.0), size=(num_rows, max_steps))
        return values, rewards, gen_tokens

    @staticmethod
    def _add_turns(tree: RolloutTree, parent_id: int, first_turn_idx: int, values: np.ndarray,
                   num_steps: int, reward: float, gen_tokens: np.ndarray, anchor_id: int) -> None:
        """Append one trajectory's turns below ``parent_id`` (``values[0]`` is the parent's ``V``)."""
        origin = Origin.ROLLOUT if anchor_id < 0 else Origin.BRANCH
        for t in range(1, num_steps + 1):
            is_last = t == num_steps
            v = float(values[t])
            observation = "" if is_last else (OBS_UP if v >= values[t - 1] else OBS_DOWN)
            num_gen = int(gen_tokens[t - 1])
            num_obs = 0 if is_last else OBS_NUM_TOKENS
            node = tree.add_node(
                parent_id, turn_idx=first_turn_idx + t - 1, origin=origin, branch_anchor_id=anchor_id,
                text=f"{ACTION_TEXT} {observation}".strip(), action_text=ACTION_TEXT, observation_text=observation,
                token_ids=[0] * (num_gen + num_obs), logprobs=[0.0] * (num_gen + num_obs),
                loss_mask=[1] * num_gen + [0] * num_obs, true_success_prob=v,
                reward=reward if is_last else None,
                finish_reason=FinishReason.TERMINATED if is_last else FinishReason.NONE)
            parent_id = node.node_id

    def sample_root_rollouts(self, prompts: Sequence[Prompt], counts: Sequence[int], rng: np.random.Generator,
                             *, step: int = -1, ablation: str = "") -> list[RolloutTree]:
        """Draw ``counts[i]`` bare rollouts of ``prompts[i]``, one tree per prompt.

        Args:
            prompts: (B,) simulator prompts (``meta`` with ``latent_success_prob`` and ``num_turns``).
            counts: (B,) non-negative ints, rollouts per prompt (0 gives a root-only tree).
            rng: numpy generator; the same generator state gives the same trees.
            step: training step recorded on the trees.
            ablation: ablation name recorded on the trees.

        Returns:
            B trees in prompt order, ``tree_id = f"{ablation}/{step}/{prompt_uid}"``. The root carries the
            question, ``true_success_prob = p`` and ``env_state`` = the reset state; each rollout is a
            chain of ``T`` ``ROLLOUT`` nodes whose last node is a ``TERMINATED`` leaf with its reward.

        Raises:
            ValueError: if lengths differ, a count is negative, or a prompt lacks its simulator meta.
        """
        counts_arr = np.asarray(counts, dtype=np.int64)
        if counts_arr.shape != (len(prompts),):
            raise ValueError(f"counts has shape {counts_arr.shape}, expected ({len(prompts)},): one per prompt")
        if (counts_arr < 0).any():
            raise ValueError(f"counts must be >= 0, got {int(counts_arr.min())} at prompt index "
                             f"{int(np.argmin(counts_arr))}")
        params = [_prompt_params(p) for p in prompts]
        start = np.repeat(np.array([p for p, _ in params], dtype=np.float64), counts_arr)
        num_steps = np.repeat(np.array([t for _, t in params], dtype=np.int64), counts_arr)
        values, rewards, gen_tokens = self._sample_paths(start, num_steps, rng)
        trees, row = [], 0
        for prompt, (p, num_turns), count in zip(prompts, params, counts_arr):
            tree = RolloutTree(tree_id=f"{ablation}/{step}/{prompt.prompt_uid}", prompt_uid=prompt.prompt_uid,
                               data_source=prompt.data_source, example_id=prompt.example_id, step=step,
                               ablation=ablation)
            num_words = len(prompt.question.split())
            tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, text=prompt.question,
                          token_ids=[0] * num_words, logprobs=[0.0] * num_words, loss_mask=[0] * num_words,
                          true_success_prob=p, env_state=self.reset(prompt)[0])
            for _ in range(int(count)):
                self._add_turns(tree, 0, 0, values[row], num_turns, float(rewards[row]), gen_tokens[row], -1)
                row += 1
            trees.append(tree)
        return trees

    @staticmethod
    def _tree_num_turns(tree: RolloutTree) -> int:
        """T of the tree's prompt: from the root's reset state, else from its terminated leaves."""
        state = tree.root.env_state
        if isinstance(state, EnvState):
            return _prompt_params(state.prompt)[1]
        depths = {n.turn_idx + 1 for n in tree.leaves() if n.finish_reason == FinishReason.TERMINATED}
        if len(depths) != 1:
            raise ValueError(f"tree {tree.tree_id}: cannot tell its prompt's num_turns (root has no env_state "
                             f"and terminated leaves end at turns {sorted(depths)})")
        return depths.pop()

    def sample_continuations(self, trees: Sequence[RolloutTree], branches: Mapping[tuple[int, int], int],
                             rng: np.random.Generator) -> None:
        """Append ``K`` continuations below each anchor, in place, each run to the prompt's terminal turn.

        Each continuation starts from the anchor's stored ``true_success_prob`` and takes the remaining
        ``T - (anchor.turn_idx + 1)`` martingale steps; its nodes are ``BRANCH`` nodes with
        ``branch_anchor_id`` = the anchor, the last a ``TERMINATED`` leaf. The anchor's ``num_branches``
        grows by ``K``. Anchors are processed in sorted ``(tree_idx, node_id)`` order, so the result does not
        depend on the mapping's order.

        Args:
            trees: trees from ``sample_root_rollouts`` (or read back with the same fields).
            branches: ``{(tree_idx, node_id): K}`` with ``K >= 0``; anchors are the root or non-terminal turns.
            rng: numpy generator.

        Raises:
            ValueError: on a missing tree or node, a negative ``K``, a terminal anchor, or an anchor without
                ``true_success_prob``.
        """
        anchors: list[tuple[int, int, int, int]] = []  # (tree_idx, node_id, K, remaining steps)
        for (tree_idx, node_id), k in sorted(branches.items()):
            if not 0 <= tree_idx < len(trees):
                raise ValueError(f"branches key ({tree_idx}, {node_id}): tree_idx out of range [0, {len(trees)})")
            tree = trees[tree_idx]
            if not 0 <= node_id < len(tree.nodes):
                raise ValueError(f"branches key ({tree_idx}, {node_id}): tree {tree.tree_id} has "
                                 f"{len(tree.nodes)} nodes")
            if int(k) != k or k < 0:
                raise ValueError(f"branches[({tree_idx}, {node_id})] = {k!r}: K must be an int >= 0")
            if k == 0:
                continue
            anchor = tree.nodes[node_id]
            remaining = self._tree_num_turns(tree) - (anchor.turn_idx + 1)
            if remaining < 1:
                raise ValueError(f"tree {tree.tree_id} node {node_id} is a terminal turn (turn_idx "
                                 f"{anchor.turn_idx}); anchors must be the root or non-terminal turns")
            if anchor.true_success_prob is None:
                raise ValueError(f"tree {tree.tree_id} node {node_id} has no true_success_prob to continue from")
            anchors.append((tree_idx, node_id, int(k), remaining))
        if not anchors:
            return
        ks = np.array([k for _, _, k, _ in anchors], dtype=np.int64)
        start = np.repeat([trees[t].nodes[n].true_success_prob for t, n, _, _ in anchors], ks).astype(np.float64)
        num_steps = np.repeat([r for _, _, _, r in anchors], ks).astype(np.int64)
        values, rewards, gen_tokens = self._sample_paths(start, num_steps, rng)
        row = 0
        for tree_idx, node_id, k, remaining in anchors:
            tree = trees[tree_idx]
            anchor = tree.nodes[node_id]
            for _ in range(k):
                self._add_turns(tree, node_id, anchor.turn_idx + 1, values[row], remaining, float(rewards[row]),
                                gen_tokens[row], node_id)
                row += 1
            anchor.num_branches += k
