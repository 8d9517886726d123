"""Sampling is seeded per trajectory: a trajectory's tokens do not depend on what else was sampled with it.

Each turn of a trajectory draws from a random stream named by (sampling seed, tree id, the trajectory's key in
its tree, turn index) (``trace.sampling.trajectory_seed``), so a prompt's trajectories come out the same when
the prompt is rolled out alone, among others, in another order, or in smaller chunks, although the batches
of later turns differ (other trajectories end earlier or later). The same holds for the branches of an anchor.
"""

from __future__ import annotations

import itertools

import pytest

from trace.configuration.config import KGQAConfig, PolicyConfig
from trace.envs.kgqa import KGQAEnvironment
from trace.policy.model import build_tiny_policy
from trace.rollout import expand_prefixes, rollout_roots
from trace.sampling import SamplingSpec, trajectory_seed
from trace.tree import FinishReason, Origin

POLICY_CFG = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                          max_context_tokens=256)
KGQA_CFG = KGQAConfig(num_entities=30, num_relations=4, facts_per_entity=2, num_distractors=1, num_train=40,
                      num_eval=10)
SAMPLING = SamplingSpec(max_new_tokens=10, seed=7)
NUM_ROLLOUTS = 4


@pytest.fixture(scope="module")
def env():
    return KGQAEnvironment(KGQA_CFG, seed=3, max_turns=4)


@pytest.fixture(scope="module")
def policy(env):
    return build_tiny_policy(POLICY_CFG, env.vocabulary(), seed=0)


@pytest.fixture(scope="module")
def prompts(env):
    return env.prompts("train")[:6]


def roll(policy, env, prompts, counts, sampling=SAMPLING):
    return rollout_roots(policy, env, prompts, counts, sampling, step=2, ablation="seeding",
                         max_context_tokens=POLICY_CFG.max_context_tokens)


def trajectories(tree, origin=Origin.ROLLOUT, anchor_id=-1) -> list[tuple[int, ...]]:
    """The token ids of the tree's trajectories of one origin (and anchor), as a sorted list."""
    out = []
    for leaf, path in tree.iter_leaf_paths():
        turns = [n for n in path if n.origin == origin and n.branch_anchor_id == anchor_id]
        if turns:
            out.append(tuple(tree.prefix_token_ids(leaf.node_id)))
    return sorted(out)


def by_prompt(trees) -> dict[str, list[tuple[int, ...]]]:
    return {tree.prompt_uid: trajectories(tree) for tree in trees}


def test_a_prompts_trajectories_are_the_same_alone_among_others_in_another_order_or_chunked(policy, env, prompts):
    trees = roll(policy, env, prompts, [NUM_ROLLOUTS] * len(prompts))
    together = by_prompt(trees)
    # later turns are batched differently in the runs below: trajectories end at different turns
    assert len({max(len(path) for _, path in tree.iter_leaf_paths()) for tree in trees}) > 1
    assert {len(path) for tree in trees for _, path in tree.iter_leaf_paths()} > {2}
    alone = {}
    for prompt in prompts:
        alone.update(by_prompt(roll(policy, env, [prompt], [NUM_ROLLOUTS])))
    reversed_order = by_prompt(roll(policy, env, prompts[::-1], [NUM_ROLLOUTS] * len(prompts)))
    chunked = by_prompt(roll(policy, env, prompts, [NUM_ROLLOUTS] * len(prompts),
                             SamplingSpec(max_new_tokens=10, seed=7, batch_size=3)))
    assert alone == together and reversed_order == together and chunked == together
    assert len({t for ts in together.values() for t in ts}) > len(prompts)  # rollouts of a prompt differ
    other_seed = by_prompt(roll(policy, env, prompts, [NUM_ROLLOUTS] * len(prompts), SamplingSpec(max_new_tokens=10,
                                                                                                  seed=8)))
    assert other_seed != together


def test_more_rollouts_of_a_prompt_keep_the_first_ones(policy, env, prompts):
    few = by_prompt(roll(policy, env, prompts[:3], [2, 2, 2]))
    more = by_prompt(roll(policy, env, prompts[:3], [5, 2, 1]))
    for uid in few:  # rollout j of a prompt is the same whatever the count: the smaller set is in the larger
        small, large = sorted([few[uid], more[uid]], key=len)
        remaining = list(large)
        for trajectory in small:
            assert trajectory in remaining, uid
            remaining.remove(trajectory)


def test_an_anchors_branches_do_not_depend_on_the_other_anchors_expanded_with_it(policy, env, prompts):
    def fresh_trees_and_anchors():
        trees = roll(policy, env, prompts, [2] * len(prompts))
        anchors = {(t_idx, node.node_id): 3 for t_idx, tree in enumerate(trees) for node in tree.nodes
                   if node.turn_idx == 0 and node.finish_reason == FinishReason.NONE}
        return trees, dict(sorted(anchors.items())[:4])

    def expand(trees, branches):
        expand_prefixes(policy, env, trees, branches, SamplingSpec(max_new_tokens=10, seed=9),
                        max_context_tokens=POLICY_CFG.max_context_tokens)
        return {(t_idx, a_id): trajectories(trees[t_idx], Origin.BRANCH, a_id) for t_idx, a_id in branches}

    trees, anchors = fresh_trees_and_anchors()
    assert len(anchors) >= 2, "too few second turns to branch from"
    together = expand(trees, anchors)
    for key in anchors:
        trees, _ = fresh_trees_and_anchors()
        assert expand(trees, {key: anchors[key]}) == {key: together[key]}
    trees, _ = fresh_trees_and_anchors()
    reordered = dict(reversed(list(anchors.items())))
    assert expand(trees, reordered) == together


def test_a_second_round_of_branches_from_an_anchor_samples_new_streams(policy, env, prompts):
    trees = roll(policy, env, prompts[:1], [1])
    sampling = SamplingSpec(max_new_tokens=10, seed=9)
    expand_prefixes(policy, env, trees, {(0, 0): 3}, sampling, max_context_tokens=POLICY_CFG.max_context_tokens)
    first = trajectories(trees[0], Origin.BRANCH, 0)
    expand_prefixes(policy, env, trees, {(0, 0): 3}, sampling, max_context_tokens=POLICY_CFG.max_context_tokens)
    both = trajectories(trees[0], Origin.BRANCH, 0)
    assert trees[0].root.num_branches == 6 and len(both) == 6
    assert set(both) - set(first)  # the same round seed gives the new branches their own streams


def test_trajectory_seeds_differ_in_every_part_of_the_identity_and_fit_63_bits():
    identities = [(seed, tree_id, key, turn) for seed, tree_id, key, turn in itertools.product(
        [0, 1], ["a/0/p", "a/0/q"], [(0, 0), (0, 1), (1, 0, 0), (1, 0, 1), (1, 2, 0)], [0, 1])]
    seeds = [trajectory_seed(*identity) for identity in identities]
    assert len(set(seeds)) == len(identities)
    assert all(0 <= s < 2**63 for s in seeds)
    assert seeds == [trajectory_seed(*identity) for identity in identities]
