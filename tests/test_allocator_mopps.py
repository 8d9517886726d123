"""The mopps root rule: the decayed Beta update, Thompson selection toward the target, the budget, its state on resume."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_allocation_step import seeded, simulator
from trace.allocation.arms import get_arm, make_allocator_state, plan_root_counts
from trace.allocation.mopps import MoppsState
from trace.allocation.samplers import SimulatorSampler
from trace.allocation.step import allocate_step
from trace.configuration.config import AllocationConfig
from trace.configuration.config_allocators import MoppsConfig

UIDS = [f"q{i}" for i in range(5)]


class ScriptedBeta:
    """Stands in for ``rng_for("mopps")``: ``beta(alpha, beta)`` returns fixed draws and records its arguments."""

    def __init__(self, gammas):
        self.gammas = np.asarray(gammas, dtype=np.float64)
        self.calls = []

    def beta(self, alpha, beta):
        self.calls.append((np.array(alpha), np.array(beta)))
        return self.gammas


def decide(state, gammas, budget, group_size=4):
    """The mopps rule's plan for the candidates ``UIDS`` with scripted Thompson draws; returns plan, draws, purposes."""
    draws, purposes = ScriptedBeta(gammas), []

    def rng_for(purpose):
        purposes.append(purpose)
        return draws

    plan = plan_root_counts(get_arm("mopps"), np.full(len(UIDS), np.nan), trajectory_budget=budget,
                            expansion_ratio=1.0, group_size=group_size, m_min=2, m_max=16, rng_for=rng_for,
                            prompt_uids=UIDS, prompt_texts=UIDS, state=state)
    return plan, draws, purposes


def mopps_state(**settings) -> MoppsState:
    return MoppsState(AllocationConfig(mopps=MoppsConfig(**settings)))


def run_steps(arm_name, state, steps, acfg, env, num_candidates=8):
    """Steps ``steps`` of ``arm_name`` on the simulator, each seeded by its step alone (candidates, rollouts, draws).

    Returns one ``StepResult`` per step.
    """
    prompts = env.prompts()
    results = []
    for step in steps:
        order = np.random.default_rng(step).permutation(len(prompts))[:num_candidates]
        sampler = SimulatorSampler(env, None, np.random.default_rng(1000 + step),
                                   lambda salt, step=step: seeded(f"{step}/{salt}"), step=step, ablation=arm_name)
        results.append(allocate_step(get_arm(arm_name), [prompts[i] for i in order], sampler, acfg,
                                     lambda purpose, step=step: np.random.default_rng([step, sum(map(ord, purpose))]),
                                     state=state))
    return results


def records(results):
    """Per step, ``(prompt_uid, trajectories, leaf rewards)`` of every tree it trained on."""
    return [[(t.prompt_uid, t.num_trajectories(), t.leaf_rewards().tolist()) for t in r.trees] for r in results]


def assert_the_rule_spent_the_budget(results, budget):
    """Every step trained on ``budget`` trajectories, all of them the rule's root rollouts (no extra roots made up
    for a plan that fell short)."""
    for result in results:
        assert sum(t.num_trajectories() for t in result.trees) == budget
        assert result.root_counts.sum() == budget and "allocation/extra_root_rollouts" not in result.metrics


# ---- the posterior update --------------------------------------------------------------------------------------
def test_at_decay_one_the_posterior_counts_every_success_and_failure():
    state = mopps_state()  # Beta(1, 1), lambda = 1
    state.observe(["q1", "q2"], [np.array([1.0, 0.0, 1.0]), np.array([0.0, 0.0])])
    # q1: k = 3, s = 2: alpha = 1 + 2 = 3, beta = 1 + 1 = 2;  q2: k = 2, s = 0: alpha = 1, beta = 1 + 2 = 3
    assert state.state_dict() == {"alpha": {"q1": 3.0, "q2": 1.0}, "beta": {"q1": 2.0, "q2": 3.0}}
    state.observe(["q1", "q2"], [np.array([1.0, 1.0]), np.array([0.5, 0.25])])
    # q1: alpha = 3 + 2 = 5, beta = 2 + 0 = 2;  q2 (rewards in [0, 1] count fractionally): s = 0.75, k - s = 1.25
    assert state.state_dict() == {"alpha": {"q1": 5.0, "q2": 1.75}, "beta": {"q1": 2.0, "q2": 4.25}}
    alpha, beta = state.posterior(["q1", "never_seen"])
    assert alpha.tolist() == [5.0, 1.0] and beta.tolist() == [2.0, 1.0]


@pytest.mark.parametrize("decay,second,third", [
    # prior Beta(2, 1). Step 1, q1 with k = 3, s = 2, from the prior: alpha = l 2 + (1 - l) 2 + 2 = 4,
    # beta = l 1 + (1 - l) 1 + 1 = 2 for every l.
    # Step 2, k = 2, s = 2:  l = 0.5:  alpha = 0.5 * 4 + 0.5 * 2 + 2 = 5,      beta = 0.5 * 2 + 0.5 * 1 + 0 = 1.5
    #                        l = 0.75: alpha = 0.75 * 4 + 0.25 * 2 + 2 = 5.5,  beta = 0.75 * 2 + 0.25 * 1 + 0 = 1.75
    # Step 3, k = 4, s = 0:  l = 0.5:  alpha = 0.5 * 5 + 0.5 * 2 + 0 = 3.5,    beta = 0.5 * 1.5 + 0.5 * 1 + 4 = 5.25
    #                        l = 0.75: alpha = 0.75 * 5.5 + 0.25 * 2 = 4.625, beta = 0.75 * 1.75 + 0.25 * 1 + 4 = 5.5625
    (0.5, (5.0, 1.5), (3.5, 5.25)),
    (0.75, (5.5, 1.75), (4.625, 5.5625)),
])
def test_a_decay_below_one_forgets_toward_the_prior(decay, second, third):
    state = mopps_state(prior_alpha=2.0, prior_beta=1.0, decay=decay)
    state.observe(["q1"], [np.array([1.0, 0.0, 1.0])])
    assert (state.alpha["q1"], state.beta["q1"]) == (4.0, 2.0)
    state.observe(["q1"], [np.array([1.0, 1.0])])
    assert (state.alpha["q1"], state.beta["q1"]) == second
    state.observe(["q1"], [np.zeros(4)])
    assert (state.alpha["q1"], state.beta["q1"]) == third


@pytest.mark.parametrize("rewards", [[1.5, 0.0], [-0.5, 1.0]])
def test_a_reward_outside_zero_one_is_refused(rewards):
    state = mopps_state()
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        state.observe(["q1"], [np.array(rewards)])
    assert state.state_dict() == {"alpha": {}, "beta": {}}


# ---- the selection ---------------------------------------------------------------------------------------------
# draws gamma = [0.875, 0.375, 0.25, 0.625, 0.75]: (gamma - 0.5)^2 = [0.140625, 0.015625, 0.0625, 0.015625, 0.0625]
# (exact in binary), so the preference order is q1, q3 (tied, by position), q2, q4 (tied), q0.
GAMMAS = [0.875, 0.375, 0.25, 0.625, 0.75]


@pytest.mark.parametrize("budget,expected", [
    (8, [0, 4, 0, 4, 0]),   # R // n = 2 groups of 4: the two draws nearest 0.5
    (12, [0, 4, 4, 4, 0]),  # 3 groups: q2 and q4 tie at 0.0625, q2 comes first by position
    (9, [0, 5, 0, 4, 0]),   # 2 groups share 9: the first chosen (q1, before q3 by position) takes the extra one
    (40, [8, 8, 8, 8, 8]),  # more groups than candidates: all five share the budget
])
def test_the_candidates_whose_draw_lies_nearest_one_half_get_n_each(budget, expected):
    plan, _, purposes = decide(mopps_state(), GAMMAS, budget)
    assert plan.counts.tolist() == expected and purposes == ["mopps"]
    assert plan.expansion_budget == 0 and plan.info["method"] == "thompson"


def test_the_draws_come_from_each_prompts_posterior_and_the_metrics_describe_the_chosen():
    state = mopps_state()
    state.observe(["q1", "q4"], [np.array([1.0, 0.0, 1.0]), np.array([0.0, 0.0])])  # q1 Beta(3, 2), q4 Beta(1, 3)
    plan, draws, _ = decide(state, GAMMAS, 8)
    (alpha, beta), = draws.calls
    assert alpha.tolist() == [1.0, 3.0, 1.0, 1.0, 1.0] and beta.tolist() == [1.0, 2.0, 1.0, 1.0, 3.0]
    assert plan.counts.tolist() == [0, 4, 0, 4, 0]
    # chosen q1 (mean 3 / 5 = 0.6, seen) and q3 (prior, mean 0.5, unseen)
    assert plan.metrics == {"mopps/selected_posterior_mean": pytest.approx(0.55), "mopps/selected_seen": 0.5}


def test_the_selection_aims_at_the_configured_target():
    # target 0.25: (gamma - 0.25)^2 = [0.390625, 0.015625, 0, 0.140625, 0.25]: q2 then q1
    plan, _, _ = decide(mopps_state(target=0.25), GAMMAS, 8)
    assert plan.counts.tolist() == [0, 4, 4, 0, 0]


def test_the_rule_refuses_to_plan_without_its_state_or_a_random_stream():
    with pytest.raises(ValueError, match="make_allocator_state"):
        plan_root_counts(get_arm("mopps"), np.full(5, np.nan), trajectory_budget=8, expansion_ratio=1.0,
                         group_size=4, m_min=2, m_max=16, prompt_uids=UIDS)


# ---- the budget ------------------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(budget=st.integers(2, 64), group_size=st.integers(2, 8), num_candidates=st.integers(1, 16),
       decay=st.sampled_from([0.0, 0.5, 0.9, 1.0]), prior=st.sampled_from([(1.0, 1.0), (0.5, 2.0), (3.0, 1.0)]),
       seed=st.integers(0, 2 ** 16))
def test_every_step_samples_exactly_the_trajectory_budget(budget, group_size, num_candidates, decay, prior, seed):
    acfg = AllocationConfig(trajectory_budget=budget, num_candidates=num_candidates, group_size=group_size,
                            expansion_ratio=0.0, mopps=MoppsConfig(decay=decay, prior_alpha=prior[0], prior_beta=prior[1]))
    env, _ = simulator(seed=seed % 7)
    state = make_allocator_state(get_arm("mopps"), acfg)
    results = run_steps("mopps", state, range(seed, seed + 3), acfg, env, num_candidates)
    assert_the_rule_spent_the_budget(results, budget)
    for result in results:  # grpo's groups, other prompts
        assert len(result.trees) == min(num_candidates, max(1, budget // group_size))
    assert state.alpha and set(state.alpha) == set(state.beta)


# ---- state across steps ----------------------------------------------------------------------------------------
def test_the_state_survives_a_json_round_trip():
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=4, mopps=MoppsConfig(decay=0.7))
    env, _ = simulator(seed=1)
    state = make_allocator_state(get_arm("mopps"), acfg)
    run_steps("mopps", state, range(3), acfg, env)
    fresh = make_allocator_state(get_arm("mopps"), acfg)
    fresh.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert fresh.state_dict() == state.state_dict()
    assert len(state.alpha) > 4 and any(v != round(v) for v in state.alpha.values())  # decayed, not integers
    uids = sorted(state.alpha) + ["never_seen"]
    for ours, theirs in zip(fresh.posterior(uids), state.posterior(uids)):
        np.testing.assert_array_equal(ours, theirs)


def assert_resume_equals_uninterrupted(name, acfg, env):
    """6 steps with one state equal 3 steps, a JSON round trip of the state into a fresh one, then 3 more; and a
    fresh state at step 3 allocates otherwise (the state decides). Returns the uninterrupted run's records."""
    arm = get_arm(name)
    uninterrupted = make_allocator_state(arm, acfg)
    straight = records(run_steps(name, uninterrupted, range(6), acfg, env))
    before = make_allocator_state(arm, acfg)
    first = records(run_steps(name, before, range(3), acfg, env))
    resumed = make_allocator_state(arm, acfg)
    resumed.load_state_dict(json.loads(json.dumps(before.state_dict())))
    assert first + records(run_steps(name, resumed, range(3, 6), acfg, env)) == straight
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert records(run_steps(name, make_allocator_state(arm, acfg), range(3, 6), acfg, env)) != straight[3:]
    return straight


def test_a_run_resumed_from_its_saved_state_allocates_as_an_uninterrupted_one():
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=8, mopps=MoppsConfig(decay=0.8))
    env, _ = simulator(seed=2)
    assert_resume_equals_uninterrupted("mopps", acfg, env)
