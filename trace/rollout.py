"""Multi-turn batched rollouts and continuations from prefixes, recorded as rollout trees.

A trajectory alternates policy turns and tool observations: the policy generates until it emits the
observation marker, the environment executes the parsed action (model text is data, never code), and the
observation segment (``trace.policy.format``) is appended before the next turn. All active trajectories of
all prompts are generated together, one backend call per turn; identical prefixes share their KV and each
trajectory's KV is carried from turn to turn (``HFBackend``). Each turn is sampled with its trajectory's own
seed (``trajectory_seed``: sampling seed, tree id, the trajectory's key in its tree, turn index), so a
trajectory's tokens do not depend on the batch it was sampled in.

EOS ends the episode, in whatever turn the policy emits it. The environment still reads that turn's action
text: a final answer gets the verifier's reward as usual. If the environment would have gone on (a tool
call, no well-formed action) or hit its turn limit, the trajectory still ends there, as ``TERMINATED`` with
reward 0.0. No observation follows, and generation never resumes after an EOS. Two reasons for this rule.
In Gymnasium's contract, an episode the agent ended itself is *terminated*; *truncated* means an outside
limit cut it short. And in multi-turn agent RL, a response that stops without a tool call ends the rollout
and is scored as given, so an attempt that stops without an answer is a failure (Search-R1, Jin et al.
2025, arXiv 2503.09516). The EOS is kept as the turn's last generated token (loss mask 1), so the choice
to stop is what gets trained. A tool call in that last turn was executed to find out the turn was not an
answer, so it counts in ``num_tool_calls``.

- ``rollout_roots``: stage 1, ``m_i`` bare rollouts of each prompt, one ``RolloutTree`` per prompt.
- ``expand_prefixes``: stage 2, ``K`` continuations from each chosen anchor's exact prefix token ids and
  stored environment state (no re-simulation), appended to the anchor's tree as ``BRANCH`` nodes.
- ``trajectory_from_actions``: a teacher-forced trajectory from given action texts (SFT demonstrations).

Invariants of every node written here:
- ``token_ids`` = generated tokens then observation tokens; ``loss_mask`` is 1 exactly on the generated
  tokens (built from their count, never from padding) and ``logprobs`` is 0.0 elsewhere;
- ``tree.prefix_token_ids(node)`` is exactly the context the next turn (or a branch) is sampled from;
- every trajectory ends in a leaf with a ``finish_reason``: ``TERMINATED`` (the verifier's reward, or 0.0
  when the policy ended the episode with EOS and no final answer) or a truncation (``MAX_TURNS``,
  ``MAX_TOKENS``: a turn used ``max_new_tokens`` without stopping, ``MAX_CONTEXT``: the context reached
  ``max_context_tokens``), whose reward is 0.0;
- only a leaf's turn can end with EOS; a sampled inner turn ends at the observation marker.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from trace.envs.base import EnvState, Environment, KnowsTrueSuccessProb, Prompt, prompts_by_uid, reward_range_of
from trace.sampling import SamplingSpec, make_backend, trajectory_seed
from trace.tree import FinishReason, Origin, RolloutTree, checked_reward

_SALT_ROOTS, _SALT_BRANCHES = 0, 1


@dataclass
class _Trajectory:
    """An unfinished trajectory: where its next turn attaches and what it is conditioned on."""

    tree_idx: int
    parent_id: int  # node the next turn attaches to
    state: EnvState
    prefix: list[int]  # token ids of the whole context so far
    turn_idx: int  # index of the next turn
    origin: Origin
    anchor_id: int
    stream_key: tuple[int, ...]  # the trajectory's identity within its tree (``trajectory_seed``)


def _check_marker(policy: Any, env: Environment) -> None:
    if policy.format.observation_marker != env.observation_marker:
        raise ValueError(f"policy format marker {policy.format.observation_marker!r} differs from environment "
                         f"{env.name!r} marker {env.observation_marker!r}; build the policy's ChatFormat with "
                         "observation_marker=env.observation_marker")


def _true_success_prob(env: Environment, state: EnvState) -> float | None:
    if isinstance(env, KnowsTrueSuccessProb) and not state.done:
        return float(env.true_success_prob(state))
    return None


def _clear(backend: Any) -> None:
    clear = getattr(backend, "clear_cache", None)
    if callable(clear):
        clear()


def _run_trajectories(policy: Any, env: Environment, trees: list[RolloutTree], active: list[_Trajectory],
                      sampling: SamplingSpec, backend: Any, max_context_tokens: int, progress: bool,
                      desc: str) -> None:
    """Generate turns for ``active`` trajectories until every one ends in a leaf (mutates ``trees``)."""
    from tqdm.auto import tqdm

    tokenizer, fmt = policy.tokenizer, policy.format
    stop_token_ids, stop_strings = fmt.stop_criteria(tokenizer)
    bar = tqdm(total=len(active), desc=desc, unit="traj", disable=not progress, leave=False)
    try:
        while active:
            ready: list[tuple[_Trajectory, int]] = []
            for traj in active:
                if traj.turn_idx >= env.max_turns:
                    raise RuntimeError(
                        f"environment {env.name!r} did not end the episode of {traj.state.prompt.prompt_uid!r} "
                        f"after max_turns={env.max_turns} turns; its step must return truncated=True at the limit")
                room = max_context_tokens - len(traj.prefix)
                if room <= 0:  # the last turn's observation filled the context
                    leaf = trees[traj.tree_idx].nodes[traj.parent_id]
                    leaf.finish_reason, leaf.reward = FinishReason.MAX_CONTEXT, 0.0
                    bar.update(1)
                    continue
                ready.append((traj, min(sampling.max_new_tokens, room)))
            if not ready:
                break
            generations = backend.generate(
                [traj.prefix for traj, _ in ready], max_new_tokens=[budget for _, budget in ready],
                temperature=sampling.temperature, top_p=sampling.top_p, stop_token_ids=stop_token_ids,
                stop_strings=stop_strings,
                seed=[trajectory_seed(sampling.seed, trees[traj.tree_idx].tree_id, traj.stream_key, traj.turn_idx)
                      for traj, _ in ready])
            next_active: list[_Trajectory] = []
            for (traj, budget), gen in zip(ready, generations):
                tree = trees[traj.tree_idx]
                gen_ids, gen_logprobs = [int(t) for t in gen.token_ids], [float(x) for x in gen.logprobs]
                num_gen = len(gen_ids)
                action = fmt.action_text(tokenizer, gen_ids)
                text = fmt.decode(tokenizer, gen_ids)
                common = dict(turn_idx=traj.turn_idx, origin=traj.origin, branch_anchor_id=traj.anchor_id,
                              action_text=action)
                if gen.finish == "length":  # unfinished action: not executed, trajectory truncated
                    reason = FinishReason.MAX_TOKENS if budget >= sampling.max_new_tokens else FinishReason.MAX_CONTEXT
                    tree.add_node(traj.parent_id, text=text, token_ids=gen_ids, logprobs=gen_logprobs,
                                  loss_mask=[1] * num_gen, reward=0.0, finish_reason=reason, env_state=traj.state,
                                  **common)
                    bar.update(1)
                    continue
                result = env.step(traj.state, action)
                # EOS ends the episode whatever the environment would do next (module docstring)
                stopped_without_answer = gen.finish == "eos" and not result.terminated
                if result.terminated or result.truncated or stopped_without_answer:
                    if result.terminated:
                        reason = FinishReason.TERMINATED
                        reward = checked_reward(result.reward, f"tree {tree.tree_id!r} node {len(tree.nodes)}",
                                                reward_range_of(env))
                    elif stopped_without_answer:
                        reason, reward = FinishReason.TERMINATED, 0.0
                    else:
                        reason, reward = FinishReason.MAX_TURNS, 0.0
                    state = result.state if result.state.done else replace(result.state, done=True)
                    tree.add_node(traj.parent_id, text=text, token_ids=gen_ids, logprobs=gen_logprobs,
                                  loss_mask=[1] * num_gen, reward=reward, finish_reason=reason,
                                  num_tool_calls=result.num_tool_calls, env_state=state, **common)
                    bar.update(1)
                    continue
                obs_text = fmt.observation_text(action, result.observation)
                obs_ids = fmt.encode(tokenizer, obs_text)
                node = tree.add_node(
                    traj.parent_id, text=text + obs_text, token_ids=gen_ids + obs_ids,
                    logprobs=gen_logprobs + [0.0] * len(obs_ids), loss_mask=[1] * num_gen + [0] * len(obs_ids),
                    observation_text=result.observation, num_tool_calls=result.num_tool_calls,
                    env_state=result.state, true_success_prob=_true_success_prob(env, result.state), **common)
                next_active.append(_Trajectory(traj.tree_idx, node.node_id, result.state, traj.prefix + gen_ids + obs_ids,
                                               traj.turn_idx + 1, traj.origin, traj.anchor_id, traj.stream_key))
            active = next_active
    finally:
        bar.close()


def rollout_roots(
    policy: Any,
    env: Environment,
    prompts: Sequence[Prompt],
    num_rollouts: Sequence[int],
    sampling: SamplingSpec,
    *,
    step: int = -1,
    ablation: str = "",
    backend: Any = None,
    max_context_tokens: int = 512,
    progress: bool = False,
) -> list[RolloutTree]:
    """Sample ``num_rollouts[i]`` bare rollouts of each prompt (stage 1), batched across prompts per turn.

    Args:
        policy: ``trace.policy.model.Policy`` (model, tokenizer, format).
        env: the task environment; its ``observation_marker`` must equal the policy format's.
        prompts: P prompts with distinct ``prompt_uid``.
        num_rollouts: P counts ``m_i >= 0`` (0 = skipped prompt: its tree holds only the root).
        sampling: ``SamplingSpec``.
        step: training step (``-1`` for seed rollouts and evaluation).
        ablation: ablation name; trees get ``tree_id = f"{ablation}/{step}/{prompt_uid}"``.
        backend: a ``GenerationBackend``; default ``HFBackend`` over the policy.
        max_context_tokens: most tokens of a trajectory's context (prompt + turns); a trajectory that reaches
            it ends with ``MAX_CONTEXT``.
        progress: show a tqdm bar of finished trajectories.

    Returns:
        P ``RolloutTree``: root = prompt tokens (loss mask 0, ``text`` = user message, ``env_state`` = initial
        state), then ``sum(m_i)`` trajectories of ``ROLLOUT`` turn nodes (see the module invariants).

    Raises:
        ValueError: length mismatch, a negative count, duplicate prompt uids, a marker mismatch, or a prompt
            whose tokens already fill ``max_context_tokens``.
        RuntimeError: the environment never ends an episode within ``env.max_turns`` turns.
    """
    if len(prompts) != len(num_rollouts):
        raise ValueError(f"{len(prompts)} prompts but {len(num_rollouts)} rollout counts; pass one count per prompt")
    prompts_by_uid(prompts)
    _check_marker(policy, env)
    backend = backend if backend is not None else make_backend(policy, sampling)
    tokenizer, fmt = policy.tokenizer, policy.format
    trees: list[RolloutTree] = []
    active: list[_Trajectory] = []
    for tree_idx, (prompt, count) in enumerate(zip(prompts, num_rollouts)):
        if int(count) < 0:
            raise ValueError(f"num_rollouts[{tree_idx}]={count} for prompt {prompt.prompt_uid!r} must be >= 0")
        state, user_message = env.reset(prompt)
        ids = fmt.prompt_token_ids(tokenizer, user_message)
        if len(ids) >= max_context_tokens:
            raise ValueError(f"prompt {prompt.prompt_uid!r} has {len(ids)} tokens, at least max_context_tokens="
                             f"{max_context_tokens}; raise policy.max_context_tokens or shorten the prompt")
        tree = RolloutTree(tree_id=f"{ablation}/{step}/{prompt.prompt_uid}", prompt_uid=prompt.prompt_uid,
                           data_source=prompt.data_source, example_id=prompt.example_id, step=step, ablation=ablation)
        tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, text=user_message, token_ids=ids,
                      logprobs=[0.0] * len(ids), loss_mask=[0] * len(ids), env_state=state,
                      true_success_prob=_true_success_prob(env, state))
        trees.append(tree)
        active += [_Trajectory(tree_idx, 0, state, list(ids), 0, Origin.ROLLOUT, -1, (_SALT_ROOTS, j))
                   for j in range(int(count))]
    _clear(backend)
    try:
        _run_trajectories(policy, env, trees, active, sampling, backend, max_context_tokens, progress, "rollouts")
    finally:
        _clear(backend)
    return trees


def expand_prefixes(
    policy: Any,
    env: Environment,
    trees: list[RolloutTree],
    branches: Mapping[tuple[int, int], int],
    sampling: SamplingSpec,
    *,
    backend: Any = None,
    max_context_tokens: int = 512,
    progress: bool = False,
) -> int:
    """Sample ``K`` continuations from each anchor's exact prefix and run them to a leaf (stage 2).

    Each continuation starts from ``tree.prefix_token_ids(anchor)`` (observation included) and the anchor's
    stored ``env_state`` (no re-simulation); its turns are ``BRANCH`` nodes with ``branch_anchor_id`` = the
    anchor, appended to the anchor's tree. The ``K`` branches of one anchor share the prefix KV (HF backend).

    Args:
        policy: ``Policy``.
        env: the environment the trees were sampled in.
        trees: trees from ``rollout_roots`` (mutated in place).
        branches: ``{(tree_idx, anchor_node_id): K}`` with ``K >= 0``; anchors are non-leaf nodes holding an
            ``env_state`` (the root is allowed). Processed in sorted key order (deterministic).
        sampling: ``SamplingSpec``; use a different ``seed`` per round.
        backend: a ``GenerationBackend``; default ``HFBackend`` over the policy.
        max_context_tokens: as in ``rollout_roots``.
        progress: show a tqdm bar.

    Returns:
        The number of trajectories (leaves) added, ``sum(K)``. ``anchor.num_branches`` grows by ``K``.

    Raises:
        ValueError: an unknown tree index or node id, a negative ``K``, an anchor that is a leaf, has no
            ``env_state`` (trees read back from disk), or whose prefix already fills the context.
    """
    _check_marker(policy, env)
    active: list[_Trajectory] = []
    for (tree_idx, node_id), count in sorted(branches.items()):
        if not 0 <= tree_idx < len(trees):
            raise ValueError(f"branches key ({tree_idx}, {node_id}): tree index out of range (have {len(trees)} trees)")
        tree = trees[tree_idx]
        if not 0 <= node_id < len(tree.nodes):
            raise ValueError(f"branches key ({tree_idx}, {node_id}): tree {tree.tree_id} has no node {node_id}")
        if int(count) < 0:
            raise ValueError(f"branches[({tree_idx}, {node_id})]={count} must be >= 0")
        if count == 0:
            continue
        anchor = tree.nodes[node_id]
        state = anchor.env_state
        if anchor.finish_reason != FinishReason.NONE or (state is not None and state.done):
            ended = anchor.finish_reason.value or "episode done"
            raise ValueError(f"tree {tree.tree_id} node {node_id} ends its trajectory ({ended}) and cannot be a "
                             "branch anchor; choose a non-terminal prefix")
        if state is None:
            raise ValueError(f"tree {tree.tree_id} node {node_id} has no env_state (trees read from disk drop it); "
                             "branch from trees sampled in this process")
        prefix = tree.prefix_token_ids(node_id)
        if len(prefix) >= max_context_tokens:
            raise ValueError(f"tree {tree.tree_id} node {node_id}: prefix of {len(prefix)} tokens fills "
                             f"max_context_tokens={max_context_tokens}; allocate no branches to it")
        first_branch = anchor.num_branches  # earlier rounds' branches keep their streams; these get new ones
        anchor.num_branches += int(count)
        active += [_Trajectory(tree_idx, node_id, state, list(prefix), anchor.turn_idx + 1, Origin.BRANCH, node_id,
                               (_SALT_BRANCHES, node_id, first_branch + k)) for k in range(int(count))]
    if not active:
        return 0
    backend = backend if backend is not None else make_backend(policy, sampling)
    _clear(backend)
    try:
        _run_trajectories(policy, env, trees, active, sampling, backend, max_context_tokens, progress, "branches")
    finally:
        _clear(backend)
    return len(active)


def trajectory_from_actions(
    policy: Any,
    env: Environment,
    prompt: Prompt,
    actions: Sequence[str],
    *,
    compute_logprobs: bool = False,
    step: int = -1,
    ablation: str = "",
) -> RolloutTree:
    """A teacher-forced trajectory: the given action texts as policy turns, with the tool's observations.

    Each action is read as the policy would write it after the format's ``turn_prefix``
    (``ChatFormat.turn_text``: a leading copy of the prefix is dropped, since the prompt and every observation
    already end with it as context), then tokenized as written (non-final actions normally end with the
    observation marker); the turn that ends the episode gets EOS appended, so the policy learns to stop. The
    environment steps on that same text and it is the node's ``action_text``, exactly as in a rollout. Masks
    follow the module invariants (1 on action tokens and that EOS, 0 on prompt, prefix and observation tokens).

    Args:
        policy: ``Policy``.
        env: the environment.
        prompt: the task.
        actions: the turns' texts, e.g. ``env.solve(prompt)`` (``"Thought: ... Action: ..."``, with or without
            the format's ``turn_prefix``); the last one must end the episode.
        compute_logprobs: fill ``logprobs`` of action tokens with the policy's teacher-forced log-probabilities
            (temperature 1, one forward pass); otherwise 0.0.
        step, ablation: recorded on the tree (``tree_id = f"{ablation}/{step}/{prompt_uid}"``).

    Returns:
        A ``RolloutTree`` with one ``ROLLOUT`` trajectory ending in a leaf (``TERMINATED`` with the verifier's
        reward, or ``MAX_TURNS`` if the environment truncated it at the last action).

    Raises:
        ValueError: an empty action list, actions after the episode ended, or actions that run out before it
            ends; a marker mismatch.
    """
    _check_marker(policy, env)
    if not actions:
        raise ValueError(f"no actions for prompt {prompt.prompt_uid!r}: pass at least the final answer")
    tokenizer, fmt = policy.tokenizer, policy.format
    state, user_message = env.reset(prompt)
    ids = fmt.prompt_token_ids(tokenizer, user_message)
    tree = RolloutTree(tree_id=f"{ablation}/{step}/{prompt.prompt_uid}", prompt_uid=prompt.prompt_uid,
                       data_source=prompt.data_source, example_id=prompt.example_id, step=step, ablation=ablation)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, text=user_message, token_ids=ids, logprobs=[0.0] * len(ids),
                  loss_mask=[0] * len(ids), env_state=state, true_success_prob=_true_success_prob(env, state))
    parent_id = 0
    for turn_idx, written in enumerate(actions):
        if state.done:
            raise ValueError(f"prompt {prompt.prompt_uid!r}: actions[{turn_idx}] = {written!r} comes after the "
                             f"episode ended at turn {turn_idx - 1}; drop the extra actions")
        action = fmt.turn_text(written)  # the prompt / previous observation already ends with the turn prefix
        gen_ids = fmt.encode(tokenizer, action)
        result = env.step(state, action)
        common = dict(turn_idx=turn_idx, origin=Origin.ROLLOUT, action_text=action,
                      num_tool_calls=result.num_tool_calls, env_state=result.state)
        if result.terminated or result.truncated:
            if result.terminated:
                gen_ids = gen_ids + fmt.end_of_turn_token_ids(tokenizer)
            node = tree.add_node(parent_id, text=fmt.decode(tokenizer, gen_ids), token_ids=gen_ids,
                                 logprobs=[0.0] * len(gen_ids), loss_mask=[1] * len(gen_ids),
                                 reward=checked_reward(result.reward, f"tree {tree.tree_id!r} node {len(tree.nodes)}",
                                                       reward_range_of(env)) if result.terminated else 0.0,
                                 finish_reason=FinishReason.TERMINATED if result.terminated else FinishReason.MAX_TURNS,
                                 **common)
        else:
            obs_text = fmt.observation_text(action, result.observation)
            obs_ids = fmt.encode(tokenizer, obs_text)
            node = tree.add_node(parent_id, text=fmt.decode(tokenizer, gen_ids) + obs_text, token_ids=gen_ids + obs_ids,
                                 logprobs=[0.0] * (len(gen_ids) + len(obs_ids)),
                                 loss_mask=[1] * len(gen_ids) + [0] * len(obs_ids), observation_text=result.observation,
                                 true_success_prob=_true_success_prob(env, result.state), **common)
        parent_id, state = node.node_id, result.state
    if not state.done:
        raise ValueError(f"prompt {prompt.prompt_uid!r}: the {len(actions)} actions end before the episode does; "
                         "finish with a final-answer action")
    if compute_logprobs:
        from trace.policy.backends import continuation_logprobs

        turns = tree.nodes[1:]
        scores = continuation_logprobs(policy.model, ids, [t for n in turns for t in n.token_ids]).tolist()
        offset = 0
        for node in turns:
            n = len(node.token_ids)
            node.logprobs = [lp if m else 0.0 for lp, m in zip(scores[offset:offset + n], node.loss_mask)]
            offset += n
    return tree
