import numpy as np
import pytest

from trace.configuration.config import SimulatorConfig
from trace.envs.base import EpisodeFinishedError, KnowsTrueSuccessProb, Prompt
from trace.envs.checker import check_environment
from trace.envs.simulator import SimulatorEnvironment, martingale_step
from trace.tree import FinishReason, Origin

C = 4.0
CFG = SimulatorConfig(num_prompts=50, step_concentration=C, mean_tokens_per_turn=5.0, min_turns=2, max_turns=4)


@pytest.fixture(scope="module")
def env():
    return SimulatorEnvironment(CFG, seed=11)


def sim_prompt(p, num_turns, idx=0):
    return Prompt("simulator", f"hand-{idx}", "task hand", meta={"latent_success_prob": p, "num_turns": num_turns})


def trajectories(tree):
    """(V along the path from the root, reward) for each leaf: a slow walk up the parent links."""
    out = []
    for leaf, path in tree.iter_leaf_paths():
        out.append(([n.true_success_prob for n in path], leaf.reward))
    return out


def test_martingale_step_keeps_the_mean_and_has_variance_v_one_minus_v_over_c_plus_one():
    rng = np.random.default_rng(0)
    for v in (0.05, 0.3, 0.5, 0.9):
        draws = martingale_step(np.full(40_000, v), C, rng)
        assert draws.min() >= 0.0 and draws.max() <= 1.0
        se = np.sqrt(v * (1 - v) / (C + 1) / len(draws))
        assert abs(draws.mean() - v) < 4 * se
        # Var Beta(cv, c(1-v)) = v(1-v)/(c+1): v=0.3, c=4 -> 0.21/5 = 0.042
        assert draws.var() == pytest.approx(v * (1 - v) / (C + 1), rel=0.05)


def test_martingale_step_leaves_absorbed_values_in_place():
    out = martingale_step(np.array([0.0, 1.0, 0.5]), C, np.random.default_rng(0))
    assert out[0] == 0.0 and out[1] == 1.0 and 0.0 <= out[2] <= 1.0


def test_sampled_paths_are_martingales_given_the_previous_value(env):
    rng = np.random.default_rng(1)
    prompts = [sim_prompt(p, 3, i) for i, p in enumerate((0.2, 0.5, 0.7))]
    trees = env.sample_root_rollouts(prompts, [6000, 6000, 6000], rng)
    pairs = np.array([(vs[t], vs[t + 1]) for tree in trees for vs, _ in trajectories(tree) for t in range(3)])
    # E[V_{t+1} | V_t] = V_t: the mean step within every bin of V_t is ~0
    bins = np.digitize(pairs[:, 0], np.linspace(0, 1, 11))
    for b in np.unique(bins):
        steps = pairs[bins == b, 1] - pairs[bins == b, 0]
        if len(steps) > 500:
            assert abs(steps.mean()) < 4 * steps.std() / np.sqrt(len(steps)) + 1e-3


def test_expected_sum_of_squared_steps_below_a_prefix_is_v_times_one_minus_v(env):
    # Proposition 2: counting the final step V_T -> r, E[sum of squared steps] = p (1 - p) = 0.3 * 0.7 = 0.21
    rng = np.random.default_rng(2)
    tree = env.sample_root_rollouts([sim_prompt(0.3, 4)], [20_000], rng)[0]
    total, beta_only = [], []
    for vs, reward in trajectories(tree):
        squared = np.diff(np.array(vs + [reward])) ** 2
        total.append(squared.sum())
        beta_only.append(squared[:-1].sum())
    assert np.mean(total) == pytest.approx(0.21, abs=4 * np.std(total) / np.sqrt(len(total)))
    # the Beta steps alone carry part of it: 0.21 * (1 - (c/(c+1))^4) = 0.21 * (1 - 0.8^4) = 0.124
    assert np.mean(beta_only) == pytest.approx(0.21 * (1 - 0.8 ** 4), rel=0.05)


def test_leaf_success_rate_matches_the_latent_probability(env):
    rng = np.random.default_rng(3)
    for p in (0.0, 0.1, 0.55, 0.9, 1.0):
        rewards = env.sample_root_rollouts([sim_prompt(p, 3)], [8000], rng)[0].leaf_rewards()
        assert abs(rewards.mean() - p) < 4 * np.sqrt(p * (1 - p) / len(rewards)) + 1e-9


def test_environment_episodes_match_the_vectorised_sampler(env):
    # the slow path: one episode per distinct action text through reset/step
    prompt = sim_prompt(0.35, 3)
    rewards, first_values = [], []
    for i in range(3000):
        state, _ = env.reset(prompt)
        for t in range(3):
            result = env.step(state, f"act {i} {t}")
            if t == 0:
                first_values.append(env.true_success_prob(result.state))
            state = result.state
        assert result.terminated and not result.truncated
        rewards.append(result.reward)
    assert abs(np.mean(rewards) - 0.35) < 4 * np.sqrt(0.35 * 0.65 / 3000)
    assert abs(np.mean(first_values) - 0.35) < 4 * np.sqrt(0.35 * 0.65 / 5 / 3000)
    assert np.var(first_values) == pytest.approx(0.35 * 0.65 / (C + 1), rel=0.1)


def test_root_rollout_trees_have_the_requested_shape_and_fields(env):
    prompts = env.prompts("train")[:3]
    trees = env.sample_root_rollouts(prompts, [2, 0, 3], np.random.default_rng(4), step=5, ablation="trace")
    assert [t.tree_id for t in trees] == [f"trace/5/{p.prompt_uid}" for p in prompts]
    assert [t.num_trajectories() for t in trees] == [2, 0, 3]
    for tree, prompt in zip(trees, prompts):
        num_turns = prompt.meta["num_turns"]
        root = tree.root
        assert root.origin == Origin.PROMPT and root.text == prompt.question
        assert root.true_success_prob == prompt.meta["latent_success_prob"] and sum(root.loss_mask) == 0
        for leaf, path in tree.iter_leaf_paths():
            assert [n.turn_idx for n in path] == list(range(-1, num_turns))
            assert leaf.finish_reason == FinishReason.TERMINATED and leaf.reward in (0.0, 1.0)
            for node in path[1:]:
                assert node.origin == Origin.ROLLOUT and node.branch_anchor_id == -1
                assert 0.0 <= node.true_success_prob <= 1.0
                assert len(node.token_ids) == len(node.loss_mask) == len(node.logprobs)
                assert node.num_generated_tokens >= 1
                # generated tokens (mask 1), then on non-terminal turns the 2 observation tokens (mask 0)
                num_obs = 0 if node is leaf else 2
                assert node.loss_mask == [1] * (len(node.loss_mask) - num_obs) + [0] * num_obs
                assert (node.reward is None) == (node is not leaf)


def test_generated_tokens_per_turn_have_the_configured_mean(env):
    tree = env.sample_root_rollouts([sim_prompt(0.5, 2)], [5000], np.random.default_rng(5))[0]
    tokens = [n.num_generated_tokens for n in tree.nodes[1:]]
    assert min(tokens) >= 1
    assert np.mean(tokens) == pytest.approx(CFG.mean_tokens_per_turn, abs=0.1)


def test_continuations_branch_from_anchors_and_end_at_the_terminal_turn(env):
    prompts = [sim_prompt(0.5, 3)]
    trees = env.sample_root_rollouts(prompts, [2], np.random.default_rng(6))
    tree = trees[0]
    first_rollout = [n.node_id for n in tree.nodes if n.parent_id == 0][0]  # turn 0 of rollout 1
    num_before = len(tree.nodes)
    env.sample_continuations(trees, {(0, first_rollout): 3, (0, 0): 1, (0, 2): 0}, np.random.default_rng(7))
    assert tree.nodes[first_rollout].num_branches == 3 and tree.root.num_branches == 1
    new = tree.nodes[num_before:]
    # 3 continuations from turn 0 take turns 1, 2 (2 nodes each); 1 from the root takes turns 0..2 (3 nodes)
    assert len(new) == 3 * 2 + 3
    assert all(n.origin == Origin.BRANCH for n in new)
    assert sorted({n.branch_anchor_id for n in new}) == [0, first_rollout]
    assert tree.num_trajectories() == 2 + 4
    for leaf in tree.leaves():
        assert leaf.turn_idx == 2 and leaf.finish_reason == FinishReason.TERMINATED


def test_continuation_rewards_average_to_the_anchor_success_probability(env):
    rng = np.random.default_rng(8)
    trees = env.sample_root_rollouts([sim_prompt(0.5, 3, i) for i in range(40)], [1] * 40, rng)
    anchors = {(i, 1): 400 for i in range(40)}  # turn 0 of each tree's only rollout
    env.sample_continuations(trees, anchors, rng)
    gaps = []
    for tree in trees:
        v = tree.nodes[1].true_success_prob
        rewards = [leaf.reward for leaf in tree.leaves() if leaf.branch_anchor_id == 1]
        assert len(rewards) == 400
        gaps.append(np.mean(rewards) - v)
    # each gap has std <= sqrt(0.25 / 400) = 0.025; their mean over 40 anchors <= 0.004
    assert abs(np.mean(gaps)) < 0.016
    assert max(abs(g) for g in gaps) < 0.1


def test_continuations_reject_bad_anchors(env):
    trees = env.sample_root_rollouts([sim_prompt(0.5, 2)], [1], np.random.default_rng(9))
    leaf_id = trees[0].leaves()[0].node_id
    with pytest.raises(ValueError, match="is a terminal turn"):
        env.sample_continuations(trees, {(0, leaf_id): 1}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="K must be an int >= 0"):
        env.sample_continuations(trees, {(0, 1): -1}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="tree_idx out of range"):
        env.sample_continuations(trees, {(3, 1): 1}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="counts has shape"):
        env.sample_root_rollouts([sim_prompt(0.5, 2)], [1, 2], np.random.default_rng(0))
    with pytest.raises(ValueError, match="needs meta latent_success_prob"):
        env.sample_root_rollouts([Prompt("simulator", "x", "task")], [1], np.random.default_rng(0))


def test_continuations_from_trees_without_state_use_the_leaf_depth(env):
    trees = [t.copy_without_state() for t in env.sample_root_rollouts([sim_prompt(0.5, 3)], [1],
                                                                        np.random.default_rng(10))]
    env.sample_continuations(trees, {(0, 2): 2}, np.random.default_rng(0))  # anchor at turn 1
    assert all(leaf.turn_idx == 2 for leaf in trees[0].leaves())


def tree_signature(trees):
    return [[(n.parent_id, n.origin, n.true_success_prob, n.reward, tuple(n.loss_mask), n.branch_anchor_id)
             for n in t.nodes] for t in trees]


def test_sampler_is_deterministic_given_the_generator_seed(env):
    def run(seed):
        rng = np.random.default_rng(seed)
        trees = env.sample_root_rollouts(env.prompts("train")[:5], [3, 1, 0, 2, 4], rng)
        env.sample_continuations(trees, {(0, 1): 2, (3, 0): 1}, rng)
        return tree_signature(trees)

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_prompts_are_deterministic_and_latent_probabilities_follow_the_u_shape():
    a = SimulatorEnvironment(SimulatorConfig(num_prompts=3000), seed=1)
    assert a.prompts("train") == SimulatorEnvironment(SimulatorConfig(num_prompts=3000), seed=1).prompts("train")
    assert len(a.prompts("eval")) == 300
    assert {p.prompt_uid for p in a.prompts("train")}.isdisjoint(p.prompt_uid for p in a.prompts("eval"))
    probs = np.array([p.meta["latent_success_prob"] for p in a.prompts("train")])
    turns = np.array([p.meta["num_turns"] for p in a.prompts("train")])
    assert probs.mean() == pytest.approx(0.5, abs=0.03)  # Beta(0.3, 0.3) has mean 0.5
    # U-shape: P(p < 0.2) = 0.355 against P(0.4 < p < 0.6) = 0.089 under Beta(0.3, 0.3)
    assert ((probs < 0.2).mean() > 2 * ((probs > 0.4) & (probs < 0.6)).mean())
    assert set(turns) == set(range(2, 7))


def test_environment_steps_terminate_at_the_prompt_turn_count_and_report_v(env):
    assert isinstance(env, KnowsTrueSuccessProb)
    prompt = sim_prompt(0.4, 3)
    state, text = env.reset(prompt)
    assert text == "task hand" and env.true_success_prob(state) == 0.4
    for t in range(3):
        result = env.step(state, "any text at all")
        assert result.info["true_success_prob"] == env.true_success_prob(result.state)
        assert result.terminated == (t == 2) and not result.truncated
        assert result.observation in (("",) if t == 2 else ("progress up", "progress down"))
        state = result.state
    assert result.reward == result.state.data.reward
    with pytest.raises(EpisodeFinishedError):
        env.step(state, "more")
    certain = env.reset(sim_prompt(1.0, 2))[0]
    assert env.step(env.step(certain, "a").state, "b").reward == 1.0


def test_prompt_longer_than_the_turn_limit_is_truncated(env):
    state, _ = env.reset(sim_prompt(0.5, 9))
    for _ in range(CFG.max_turns):
        result = env.step(state, "go")
        state = result.state
    assert result.truncated and not result.terminated and result.reward == 0.0


def test_branching_from_a_prefix_draws_fresh_moves_for_a_different_text(env):
    state, _ = env.reset(sim_prompt(0.5, 4))
    prefix = env.step(state, "first").state
    a = env.step(prefix, "continuation a").state.data.success_prob
    b = env.step(prefix, "continuation b").state.data.success_prob
    assert a != b
    assert env.step(prefix, "continuation a").state.data.success_prob == a


def test_simulator_passes_the_environment_checker(env):
    check_environment(env, env.prompts("train")[:6] + env.prompts("eval")[:2], num_random_episodes=30, seed=3)


def test_min_turns_above_max_turns_is_rejected():
    with pytest.raises(ValueError, match="set min_turns <= max_turns"):
        SimulatorEnvironment(SimulatorConfig(min_turns=5, max_turns=3))


def test_vocabulary_covers_prompts_observations_and_sampler_text(env):
    vocab = set(env.vocabulary())
    words = {w for split in ("train", "eval") for p in env.prompts(split) for w in p.question.split()}
    tree = env.sample_root_rollouts(env.prompts("eval")[:3], [2, 2, 2], np.random.default_rng(0))
    words |= {w for t in tree for n in t.nodes for w in n.text.split()}
    assert words <= vocab and "Observation:" in vocab
