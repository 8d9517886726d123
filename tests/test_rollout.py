"""Rollout engine: multi-turn batched rollouts, truncations, branches from prefixes, teacher forcing."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from trace.configuration.config import KGQAConfig, PolicyConfig, RolloutConfig
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult
from trace.envs.kgqa import KGQAEnvironment
from trace.policy.backends import continuation_logprobs
from trace.policy.hf_backend import HFBackend
from trace.policy.model import build_tiny_policy
from trace.rollout import expand_prefixes, rollout_roots, trajectory_from_actions
from trace.sampling import SamplingSpec
from trace.tree import FinishReason, Origin, RewardError

MARKER = "Observation:"


class TallyEnv:
    """A tiny deterministic tool environment over 12 words, so a random policy often stops and finishes.

    A turn's words before the first marker are its action. ``done`` ends the episode with reward 1.0 if the
    action also says ``yes``, else 0.0. Any other turn gets the observation ``seen <first word of the action>``
    (``seen nothing`` for an empty action); the turn that reaches ``max_turns`` is truncated.
    ``state.data`` is the tuple of actions so far; every ``step`` call is recorded.
    """

    name = "tally"
    observation_marker = MARKER
    words = ["tally", ":", "add", "done", "yes", "no", MARKER, "seen", "one", "two", "three", "nothing"]

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns
        self.calls: list[tuple[tuple, str]] = []

    def vocabulary(self):
        return list(self.words)

    def observation_for(self, action_text: str) -> str:
        words = action_text.split(MARKER, 1)[0].split()
        return "seen " + (words[0] if words else "nothing")

    def reset(self, prompt):
        return EnvState(prompt=prompt, num_turns=0, done=False, data=()), prompt.question

    def step(self, state, action_text):
        if state.done:
            raise EpisodeFinishedError("episode ended")
        self.calls.append((state.data, action_text))
        words = action_text.split(MARKER, 1)[0].split()
        new = EnvState(state.prompt, state.num_turns + 1, False, state.data + (action_text,))
        if "done" in words:
            return StepResult(replace(new, done=True), "", 1.0 if "yes" in words else 0.0, True, False)
        if new.num_turns >= self.max_turns:
            return StepResult(replace(new, done=True), "", 0.0, False, True)
        return StepResult(new, self.observation_for(action_text), 0.0, False, False, num_tool_calls=1)


TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
PROMPTS = [Prompt("tally", str(i), q) for i, q in enumerate(["tally : one two", "tally : three", "tally : add one"])]


@pytest.fixture(scope="module")
def policy():
    return build_tiny_policy(TINY, TallyEnv.words, seed=0)


@pytest.fixture(scope="module")
def trees(policy):
    return rollout_roots(policy, TallyEnv(), PROMPTS, [12, 0, 20], SamplingSpec(max_new_tokens=12, seed=0), step=3,
                         ablation="trace")


def turns(tree):
    return [n for n in tree.nodes if not n.is_root]


def split_turn(node):
    """(generated ids, observation ids) of a turn node, cut at the loss mask."""
    num_gen = node.num_generated_tokens
    return node.token_ids[:num_gen], node.token_ids[num_gen:]


def test_one_tree_per_prompt_with_the_requested_number_of_trajectories(trees):
    assert [t.tree_id for t in trees] == ["trace/3/tally/0", "trace/3/tally/1", "trace/3/tally/2"]
    assert [t.num_trajectories() for t in trees] == [12, 0, 20]
    for tree, prompt in zip(trees, PROMPTS):
        root = tree.root
        assert (root.origin, root.turn_idx, root.text) == (Origin.PROMPT, -1, prompt.question)
        assert root.loss_mask == [0] * len(root.token_ids) and root.token_ids[0] == 1  # [BOS] first
        assert all(n.origin == Origin.ROLLOUT and n.branch_anchor_id == -1 for n in turns(tree))
        assert all(n.turn_idx == tree.depth(n.node_id) - 1 for n in turns(tree))


def test_every_leaf_has_a_finish_reason_and_truncated_leaves_get_reward_zero(trees):
    reasons = Counter(leaf.finish_reason for tree in trees for leaf in tree.leaves())
    assert set(reasons) <= {FinishReason.TERMINATED, FinishReason.MAX_TURNS, FinishReason.MAX_TOKENS}
    assert reasons[FinishReason.TERMINATED] > 0 and reasons[FinishReason.MAX_TURNS] > 0
    for tree in trees:
        for leaf in tree.leaves():
            assert leaf.reward is not None
            if leaf.finish_reason.is_truncated:
                assert leaf.reward == 0.0
        assert all(n.finish_reason == FinishReason.NONE and n.reward is None
                   for n in tree.nodes if n.node_id not in {leaf.node_id for leaf in tree.leaves()})


def test_turns_stop_at_the_marker_and_only_the_environment_writes_observations(policy, trees):
    marker_id, eos_id = policy.tokenizer.convert_tokens_to_ids(MARKER), policy.tokenizer.eos_token_id
    env = TallyEnv()
    for tree in trees:
        for node in turns(tree):
            gen, obs = split_turn(node)
            assert marker_id not in gen[:-1] and eos_id not in gen[:-1]  # nothing generated past a stop
            if node.finish_reason == FinishReason.MAX_TOKENS:
                assert len(gen) == 12 and gen[-1] not in (marker_id, eos_id)
                continue
            assert gen[-1] in (marker_id, eos_id)
            if not tree.children()[node.node_id] and node.finish_reason != FinishReason.NONE:
                assert obs == []  # terminal turn: no observation
                if gen[-1] == eos_id:  # EOS ends the episode, answer or not
                    assert node.finish_reason == FinishReason.TERMINATED and node.env_state.done
                continue
            # an inner turn ended at the marker (an EOS would have ended the episode); the observation is the
            # environment's answer to the action text, without a second marker
            assert gen[-1] == marker_id
            assert node.observation_text == env.observation_for(node.action_text)
            expected = policy.format.observation_text(node.action_text, node.observation_text)
            assert obs == policy.tokenizer(expected, add_special_tokens=False)["input_ids"] and obs[0] != marker_id
            assert node.env_state.data[-1] == node.action_text and node.num_tool_calls == 1


def test_loss_mask_is_one_exactly_on_generated_tokens_and_logprobs_zero_elsewhere(trees):
    for tree in trees:
        for node in tree.nodes:
            num_gen = node.num_generated_tokens
            assert len(node.token_ids) == len(node.logprobs) == len(node.loss_mask)
            assert node.loss_mask == [1] * num_gen + [0] * (len(node.token_ids) - num_gen)
            assert all(lp == 0.0 for lp, m in zip(node.logprobs, node.loss_mask) if not m)
            assert all(lp < 0.0 for lp, m in zip(node.logprobs, node.loss_mask) if m)
            assert num_gen > 0 or node.is_root


def test_logprobs_equal_a_teacher_forced_recompute_of_the_whole_trajectory(policy, trees):
    for tree in trees:
        for leaf in tree.leaves():
            path = tree.path(leaf.node_id)
            ids = [t for n in path[1:] for t in n.token_ids]
            mask = [m for n in path[1:] for m in n.loss_mask]
            sampled = torch.tensor([lp for n in path[1:] for lp in n.logprobs])
            ref = continuation_logprobs(policy.model, tree.root.token_ids, ids)
            keep = torch.tensor(mask, dtype=torch.bool)
            torch.testing.assert_close(sampled[keep], ref[keep], atol=1e-4, rtol=0)


def test_same_seed_gives_identical_token_ids_and_another_seed_differs(policy, trees):
    again = rollout_roots(policy, TallyEnv(), PROMPTS, [12, 0, 20], SamplingSpec(max_new_tokens=12, seed=0),
                          step=3, ablation="trace", backend=HFBackend(policy.model, policy.tokenizer, max_batch_size=5))
    other = rollout_roots(policy, TallyEnv(), PROMPTS, [12, 0, 20], SamplingSpec(max_new_tokens=12, seed=1))
    ids = [[n.token_ids for n in t.nodes] for t in trees]
    assert [[n.token_ids for n in t.nodes] for t in again] == ids
    assert [[n.token_ids for n in t.nodes] for t in other] != ids


def test_a_turn_that_reaches_max_new_tokens_truncates_as_max_tokens(policy):
    env = TallyEnv()
    trees = rollout_roots(policy, env, PROMPTS[:1], [16], SamplingSpec(max_new_tokens=2, seed=0))
    leaves = trees[0].leaves()
    hit = [leaf for leaf in leaves if leaf.finish_reason == FinishReason.MAX_TOKENS]
    assert hit  # P(no stop in 2 tokens) ~ (17/19)^2 per turn for a near-uniform policy
    for leaf in hit:
        assert leaf.num_generated_tokens == 2 and leaf.reward == 0.0
        assert leaf.action_text not in [action for _, action in env.calls]  # an unfinished action is not executed


def test_the_turn_limit_truncates_as_max_turns_at_that_depth(policy):
    # 64 trajectories: a turn ended by EOS ends its episode, so few of a random policy's reach the limit
    trees = rollout_roots(policy, TallyEnv(max_turns=2), PROMPTS[:1], [64], SamplingSpec(max_new_tokens=12, seed=2))
    tree = trees[0]
    truncated = [leaf for leaf in tree.leaves() if leaf.finish_reason == FinishReason.MAX_TURNS]
    assert truncated and all(tree.depth(leaf.node_id) == 2 and leaf.reward == 0.0 for leaf in truncated)
    assert max(tree.depth(leaf.node_id) for leaf in tree.leaves()) <= 2


def test_the_context_limit_truncates_as_max_context(policy):
    trees = rollout_roots(policy, TallyEnv(max_turns=5), PROMPTS[:1], [16], SamplingSpec(max_new_tokens=12, seed=0),
                          max_context_tokens=14)
    tree = trees[0]
    reasons = Counter(leaf.finish_reason for leaf in tree.leaves())
    assert reasons[FinishReason.MAX_CONTEXT] > 0
    for leaf in tree.leaves():
        assert len(tree.prefix_token_ids(leaf.node_id)) <= 14 or leaf.finish_reason == FinishReason.MAX_CONTEXT
        if leaf.finish_reason == FinishReason.MAX_CONTEXT:
            assert leaf.reward == 0.0
    with pytest.raises(ValueError, match="max_context_tokens"):
        rollout_roots(policy, TallyEnv(), PROMPTS[:1], [1], SamplingSpec(), max_context_tokens=4)


def test_branches_continue_from_the_anchor_prefix_and_environment_state(policy):
    env = TallyEnv(max_turns=4)
    trees = rollout_roots(policy, env, PROMPTS, [6, 6, 6], SamplingSpec(max_new_tokens=12, seed=0))
    anchors = {}
    for tree_idx, tree in enumerate(trees):
        inner = [n.node_id for n in turns(tree) if tree.children()[n.node_id]]
        if inner:
            anchors[(tree_idx, inner[0])] = 3
    anchors[(0, 0)] = 2  # the root is a valid anchor too
    before = [len(t.nodes) for t in trees]
    added = expand_prefixes(policy, env, trees, anchors, SamplingSpec(max_new_tokens=12, seed=5))
    assert added == sum(anchors.values())
    for (tree_idx, anchor_id), k in anchors.items():
        tree = trees[tree_idx]
        anchor = tree.nodes[anchor_id]
        assert anchor.num_branches == k
        new_leaves = [leaf for leaf in tree.leaves() if leaf.node_id >= before[tree_idx]
                      and tree.nodes[leaf.node_id].branch_anchor_id == anchor_id]
        assert len(new_leaves) == k
        prefix = tree.prefix_token_ids(anchor_id)
        for leaf in new_leaves:
            path = tree.path(leaf.node_id)
            branch = path[[n.node_id for n in path].index(anchor_id) + 1:]
            assert all(n.origin == Origin.BRANCH and n.branch_anchor_id == anchor_id for n in branch)
            assert branch[0].turn_idx == anchor.turn_idx + 1
            assert tree.prefix_token_ids(leaf.node_id)[:len(prefix)] == prefix
            # the environment continued from the anchor's state: its actions are the history's prefix
            assert leaf.env_state.data[:len(anchor.env_state.data)] == anchor.env_state.data
    for tree_idx, tree in enumerate(trees):  # sampled tokens stay consistent with the policy
        for leaf in tree.leaves():
            if leaf.node_id < before[tree_idx]:
                continue
            path = tree.path(leaf.node_id)
            ids = [t for n in path[1:] for t in n.token_ids]
            keep = torch.tensor([m for n in path[1:] for m in n.loss_mask], dtype=torch.bool)
            sampled = torch.tensor([lp for n in path[1:] for lp in n.logprobs])
            ref = continuation_logprobs(policy.model, tree.root.token_ids, ids)
            torch.testing.assert_close(sampled[keep], ref[keep], atol=1e-4, rtol=0)


def test_branches_of_one_anchor_prefill_its_prefix_once(policy):
    env = TallyEnv(max_turns=4)
    trees = rollout_roots(policy, env, PROMPTS[:1], [1], SamplingSpec(max_new_tokens=12, seed=0))
    backend = HFBackend(policy.model, policy.tokenizer)
    expand_prefixes(policy, env, trees, {(0, 0): 8}, SamplingSpec(max_new_tokens=12, seed=1), backend=backend)
    first_call_prefill = len(trees[0].root.token_ids)  # 8 copies, one prefill of the prompt
    later_tokens = sum(len(n.token_ids) for n in trees[0].nodes[2:]) - trees[0].nodes[0].num_branches
    assert first_call_prefill <= backend.stats["prefill_tokens"] <= first_call_prefill + later_tokens


def test_anchors_must_be_unfinished_nodes_with_state(policy):
    env = TallyEnv()
    trees = rollout_roots(policy, env, PROMPTS[:1], [4], SamplingSpec(max_new_tokens=12, seed=0))
    leaf = trees[0].leaves()[0]
    with pytest.raises(ValueError, match="cannot be a branch anchor"):
        expand_prefixes(policy, env, trees, {(0, leaf.node_id): 2}, SamplingSpec())
    with pytest.raises(ValueError, match="no node 999"):
        expand_prefixes(policy, env, trees, {(0, 999): 1}, SamplingSpec())
    stripped = [trees[0].copy_without_state()]
    with pytest.raises(ValueError, match="no env_state"):
        expand_prefixes(policy, env, stripped, {(0, 0): 1}, SamplingSpec())
    assert expand_prefixes(policy, env, trees, {(0, 0): 0}, SamplingSpec()) == 0


def test_an_eos_that_doubles_as_pad_is_still_trained_at_the_end_of_a_turn():
    policy = build_tiny_policy(TINY, TallyEnv.words, seed=0)
    policy.tokenizer.pad_token = policy.tokenizer.eos_token  # as in many chat models
    eos_id = policy.tokenizer.eos_token_id
    trees = rollout_roots(policy, TallyEnv(), PROMPTS[:1], [16], SamplingSpec(max_new_tokens=12, seed=0))
    ended_by_eos = [n for n in turns(trees[0]) if split_turn(n)[0][-1] == eos_id]
    assert ended_by_eos
    for node in ended_by_eos:
        gen, _ = split_turn(node)
        assert node.loss_mask[len(gen) - 1] == 1 and node.logprobs[len(gen) - 1] < 0


class ForcedNextWord:
    """Forward hook that makes a real model pick a scripted next word after given words (+1e4 on its logit).

    Rows whose last input word is not in ``script`` keep the model's own distribution.
    """

    def __init__(self, tokenizer, script: dict[str, str]):
        ids = lambda word: tokenizer.convert_tokens_to_ids(word)  # noqa: E731
        self.script = {ids(after): ids(word) for after, word in script.items()}

    def __call__(self, module, args, kwargs, output):
        last_words = kwargs["input_ids"][:, -1].tolist()
        for row, last in enumerate(last_words):
            if last in self.script:
                output.logits[row, -1, self.script[last]] += 1e4
        return output


@pytest.fixture
def scripted_policy():
    """The tiny tally policy, with EOS forced right after ``add`` (a tool call) and after ``done yes``."""
    policy = build_tiny_policy(TINY, TallyEnv.words, seed=0)
    script = {"one": "add", "add": policy.tokenizer.eos_token, "two": "done", "done": "yes",
              "yes": policy.tokenizer.eos_token}
    handle = policy.model.register_forward_hook(ForcedNextWord(policy.tokenizer, script), with_kwargs=True)
    yield policy
    handle.remove()


def test_eos_after_a_tool_call_ends_the_episode_as_terminated_with_reward_zero(scripted_policy):
    policy, env = scripted_policy, TallyEnv(max_turns=3)
    eos_id, add_id = policy.tokenizer.eos_token_id, policy.tokenizer.convert_tokens_to_ids("add")
    prompt = Prompt("tally", "eos", "tally : one")  # the policy answers "add [EOS]": a tool call, then EOS
    trees = rollout_roots(policy, env, [prompt], [3], SamplingSpec(max_new_tokens=12, seed=0))
    added = expand_prefixes(policy, env, trees, {(0, 0): 2}, SamplingSpec(max_new_tokens=12, seed=1))
    tree = trees[0]
    assert added == 2 and len(tree.leaves()) == 5
    for leaf in tree.leaves():
        # one turn, no observation after the EOS, and generation did not resume past it
        assert tree.depth(leaf.node_id) == 1 and leaf.parent_id == 0
        assert leaf.token_ids == [add_id, eos_id] and leaf.loss_mask == [1, 1]  # the stop is trained
        assert (leaf.finish_reason, leaf.reward) == (FinishReason.TERMINATED, 0.0)
        assert leaf.observation_text == "" and leaf.env_state.done and leaf.num_tool_calls == 1
    assert [action for _, action in env.calls] == ["add"] * 5  # the environment read each action once


def test_eos_after_a_final_answer_keeps_the_verifiers_reward(scripted_policy):
    policy, env = scripted_policy, TallyEnv(max_turns=3)
    prompt = Prompt("tally", "answer", "tally : two")  # the policy answers "done yes [EOS]"
    tree = rollout_roots(policy, env, [prompt], [2], SamplingSpec(max_new_tokens=12, seed=0))[0]
    for leaf in tree.leaves():
        assert tree.depth(leaf.node_id) == 1 and leaf.action_text == "done yes"
        assert (leaf.finish_reason, leaf.reward, leaf.num_generated_tokens) == (FinishReason.TERMINATED, 1.0, 3)


def test_a_marker_mismatch_between_policy_and_environment_is_an_error(policy):
    env = TallyEnv()
    env.observation_marker = "Result:"
    with pytest.raises(ValueError, match="marker"):
        rollout_roots(policy, env, PROMPTS[:1], [1], SamplingSpec())


def test_sampling_spec_reads_the_rollout_config():
    spec = SamplingSpec.from_config(RolloutConfig(temperature=0.7, top_p=0.9, max_new_tokens=20, batch_size=8), 11)
    assert spec == SamplingSpec(temperature=0.7, top_p=0.9, max_new_tokens=20, seed=11, batch_size=8)


# ---- kgqa -------------------------------------------------------------------------------------------------
KGQA_CFG = KGQAConfig(num_entities=30, num_relations=4, facts_per_entity=2, num_distractors=1, num_train=40,
                      num_eval=10)


@pytest.fixture(scope="module")
def kgqa():
    return KGQAEnvironment(KGQA_CFG, seed=3, max_turns=4)


def test_solver_demonstrations_teacher_force_to_reward_one_with_masks_on_actions(kgqa):
    policy = build_tiny_policy(TINY, kgqa.vocabulary(), seed=0)
    tok = policy.tokenizer
    for prompt in kgqa.prompts("train")[:5]:
        actions = kgqa.solve(prompt)
        tree = trajectory_from_actions(policy, kgqa, prompt, actions, compute_logprobs=True)
        leaf = tree.leaves()[0]
        assert (leaf.reward, leaf.finish_reason, tree.depth(leaf.node_id)) == (1.0, FinishReason.TERMINATED,
                                                                               len(actions))
        for node, action in zip(turns(tree), actions):
            gen, obs = split_turn(node)
            expected = tok(action, add_special_tokens=False)["input_ids"]
            assert gen == (expected + [tok.eos_token_id] if node is leaf else expected)
            assert node.action_text == action
            if node is not leaf:  # "search [ e ] Observation:" already ends with the marker
                assert obs == tok(f" {node.observation_text} ", add_special_tokens=False)["input_ids"]
        ids = [t for n in turns(tree) for t in n.token_ids]
        keep = torch.tensor([m for n in turns(tree) for m in n.loss_mask], dtype=torch.bool)
        ref = continuation_logprobs(policy.model, tree.root.token_ids, ids)
        got = torch.tensor([lp for n in turns(tree) for lp in n.logprobs])
        torch.testing.assert_close(got[keep], ref[keep], atol=1e-5, rtol=0)
        assert (got[~keep] == 0).all()
    with pytest.raises(ValueError, match="end before the episode"):
        trajectory_from_actions(policy, kgqa, prompt, actions[:-1])
    with pytest.raises(ValueError, match="comes after the episode ended"):
        trajectory_from_actions(policy, kgqa, prompt, actions + actions[-1:])


def test_kgqa_rollouts_and_branches_build_consistent_trees(kgqa):
    policy = build_tiny_policy(TINY, kgqa.vocabulary(), seed=1)
    prompts = kgqa.prompts("train")[:4]
    trees = rollout_roots(policy, kgqa, prompts, [3, 3, 3, 3], SamplingSpec(max_new_tokens=8, seed=0), progress=True)
    assert [t.prompt_uid for t in trees] == [p.prompt_uid for p in prompts]
    assert sum(t.num_trajectories() for t in trees) == 12
    for tree in trees:
        for leaf in tree.leaves():
            assert leaf.finish_reason != FinishReason.NONE and leaf.reward in (0.0, 1.0)
            assert tree.depth(leaf.node_id) <= kgqa.max_turns
    assert expand_prefixes(policy, kgqa, trees, {(0, 0): 2, (3, 0): 1}, SamplingSpec(max_new_tokens=8, seed=1)) == 3
    assert trees[0].num_trajectories() == 5 and trees[3].num_trajectories() == 4


class PaysOutOfRange(TallyEnv):
    """A verifier that pays ``payout`` for every finished episode, whatever its range says."""

    def __init__(self, payout):
        super().__init__()
        self.payout = payout

    def step(self, state, action_text):
        result = super().step(state, action_text)
        return replace(result, reward=self.payout) if result.terminated else result


@pytest.mark.parametrize("payout, message", [(5.0, r"outside the environment's reward_range \[0.0, 1.0\]"),
                                             (-1.0, r"outside the environment's reward_range"),
                                             ("1", r"is not a number"),
                                             (float("nan"), r"not finite")])
def test_a_reward_outside_the_verifiers_range_stops_the_rollout_naming_tree_and_node(policy, payout, message):
    with pytest.raises(RewardError, match=r"tree 'trace/3/tally/0' node \d+: reward .*" + message):
        rollout_roots(policy, PaysOutOfRange(payout), PROMPTS[:1], [32], SamplingSpec(max_new_tokens=12, seed=0),
                      step=3, ablation="trace")
    with pytest.raises(RewardError, match=message):
        trajectory_from_actions(policy, PaysOutOfRange(payout), PROMPTS[0], ["done yes"])


def test_a_declared_reward_range_admits_rewards_inside_it(policy):
    env = PaysOutOfRange(5.0)
    env.reward_range = (0.0, 5.0)
    tree = trajectory_from_actions(policy, env, PROMPTS[0], ["done yes"])
    assert [leaf.reward for leaf in tree.leaves()] == [5.0]
