"""The vip root rule: vip_counts by hand, the GP forecast against the textbook posterior mean, the budget, resume."""

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.test_allocation_step import simulator
from tests.test_allocator_mopps import assert_resume_equals_uninterrupted, assert_the_rule_spent_the_budget, run_steps
from trace.allocation.arms import get_arm, make_allocator_state, plan_root_counts
from trace.allocation.vip import VipState, embed_prompts, vip_counts
from trace.configuration.config import AllocationConfig
from trace.configuration.config_allocators import VipConfig

# pairwise orthogonal under the hashed uni/bigram embedding (no shared word, no hash collision at 256 features)
SPIDER = "how many legs does a spider have"
RIVER = "which river flows through paris"
HAMLET = "who wrote the book hamlet"
# overlapping ones ("is the", "the"): cosine 0.516, 0.156, 0.101
CAPITAL = "what is the capital of france"
SKY = "why is the sky blue"


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, dtype=np.float64)))


def is_within_bounds(counts, n_drop, n_max):
    return all(k == 0 or n_drop <= k <= n_max for k in counts)


# ---- vip_counts by hand ----------------------------------------------------------------------------------------
def test_vip_counts_floors_the_continuous_optimum_drops_the_small_and_fills_greedily():
    # gamma = 0: b = 0, so n_i = 1 + sqrt(a_i / lambda): n_i - 1 is proportional to sqrt(a_i), a_i = p_i (1 - p_i).
    # p = [0.5, 0.2, 0.1, 0.02]: a = [0.25, 0.16, 0.09, 0.0196], sqrt(a) = [0.5, 0.4, 0.3, 0.14], sum 1.34.
    # sum n_i = 24 (no clip at n_max = 16): n_i - 1 = sqrt(a_i) * 20 / 1.34 = [7.46, 5.97, 4.48, 2.09],
    # n = [8.46, 6.97, 5.48, 3.09], floored [8, 6, 5, 3]; 3 < n_drop = 4 leaves: [8, 6, 5, 0], 5 left.
    # One at a time to the largest gain a / (n - 1) - a / n = a / (n (n - 1)):
    #   [0.25/56 = .004464, 0.16/30 = .005333, 0.09/20 = .0045]  -> q1: 7
    #   [.004464, 0.16/42 = .003810, .0045]                       -> q2: 6
    #   [.004464, .003810, 0.09/30 = .003]                        -> q0: 9
    #   [0.25/72 = .003472, .003810, .003]                        -> q1: 8
    #   [.003472, 0.16/56 = .002857, .003]                        -> q0: 10
    counts = vip_counts(np.array([0.5, 0.2, 0.1, 0.02]), 24, gamma=0.0, n_max=16, n_drop=4)
    assert counts.tolist() == [10, 8, 6, 0] and counts.dtype == np.int64


def test_vip_counts_keeps_a_prompt_whose_continuous_optimum_reaches_n_drop():
    # as above with p = 0.05 last: a = 0.0475, sqrt(a) = 0.2179, sum 1.4179; n - 1 = sqrt(a) * 20 / 1.4179 =
    # [7.05, 5.64, 4.23, 3.07], n = [8.05, 6.64, 5.23, 4.07], floored [8, 6, 5, 4]: all kept (n_drop = 4), 1 left,
    # gains [0.25/56 = .00446, 0.16/30 = .00533, 0.09/20 = .0045, 0.0475/12 = .00396] -> q1.
    # (Were n - 1 proportional to a instead of sqrt(a), the last would floor to 2 and leave.)
    assert vip_counts(np.array([0.5, 0.2, 0.1, 0.05]), 24, gamma=0.0, n_max=16, n_drop=4).tolist() == [8, 7, 5, 4]


def test_vip_counts_brings_a_dropped_prompt_back_at_n_drop_once_every_kept_one_is_full():
    # gamma = 0, p = [0.5, 0.45, 0.03, 0.02]: sqrt(a) = [0.5, 0.4975, 0.1706, 0.14], sum 1.3081; budget 11:
    # n - 1 = sqrt(a) * 7 / 1.3081 = [2.68, 2.66, 0.91, 0.75], floored [3, 3, 1, 1]; below n_drop = 3: [3, 3, 0, 0].
    # 5 left: q0 and q1 rise to n_max = 4 (gains 0.25/6, 0.2475/6), 3 left and nobody can take one more:
    # a prompt comes back at n_drop = 3, the one of least entry cost a / (3 - 1) / 3: q3 (0.0196 < 0.0291).
    counts = vip_counts(np.array([0.5, 0.45, 0.03, 0.02]), 11, gamma=0.0, n_max=4, n_drop=3)
    assert counts.tolist() == [4, 4, 0, 3]


def test_the_log_p_cost_moves_rollouts_toward_the_less_likely_prompt():
    # p = 0.2 and 0.8 share a = 0.16: without the cost an even 10 / 10; with gamma > 0, b = gamma log p is more
    # negative for p = 0.2, which then takes more. The slow obvious check: every split n0 + n1 = 20 within [4, 16].
    p = np.array([0.2, 0.8])
    assert vip_counts(p, 20, gamma=0.0, n_max=16, n_drop=2).tolist() == [10, 10]
    b = 0.002 * np.log(p)
    best = min(range(4, 17), key=lambda n0: 0.16 / (n0 - 1) + b[0] * n0 + 0.16 / (19 - n0) + b[1] * (20 - n0))
    assert vip_counts(p, 20, gamma=0.002, n_max=16, n_drop=2).tolist() == [best, 20 - best] == [13, 7]


def test_equal_forecasts_split_the_budget_evenly():
    # the first step: every forecast is the prior. 18 over 4: 4 each and the first two one more. Forecasts within
    # 1e-6 count as equal (otherwise the last, a hair nearer 0.5, would take the first extra one: [5, 4, 4, 5]).
    assert vip_counts(np.full(4, 0.3), 18, gamma=0.0007, n_max=8, n_drop=4).tolist() == [5, 5, 4, 4]
    assert vip_counts(np.array([0.3, 0.3, 0.3, 0.3 + 5e-7]), 18, gamma=0.0, n_max=8, n_drop=4).tolist() == [5, 5, 4, 4]
    # a budget of exactly B * n_max fills every prompt whatever the forecasts
    assert vip_counts(np.array([0.1, 0.5, 0.9]), 24, gamma=0.0007, n_max=8, n_drop=4).tolist() == [8, 8, 8]
    assert vip_counts(np.array([0.1, 0.5]), 0, gamma=0.0007, n_max=8, n_drop=4).tolist() == [0, 0]


def test_a_budget_beyond_b_times_n_max_is_refused_with_the_keys_to_raise():
    with pytest.raises(ValueError, match=r"17 trajectories on 2 candidates of at most n_max=8.*allocation.vip.n_max"):
        vip_counts(np.array([0.5, 0.2]), 17, gamma=0.0007, n_max=8, n_drop=4)
    assert vip_counts(np.array([0.5, 0.2]), 16, gamma=0.0007, n_max=8, n_drop=4).tolist() == [8, 8]
    with pytest.raises(ValueError, match="finite forecast"):
        vip_counts(np.array([0.5, np.nan]), 8, gamma=0.0007, n_max=8, n_drop=4)


@pytest.mark.parametrize("p,budget,n_max,n_drop,expected", [
    # 2 + 2 is the only split of 4 with counts in {0} U [2, 3]
    ([0.5, 0.1], 4, 3, 2, [[2, 2]]),
    # 14 with counts in {0} U [6, 9]: two prompts of 6..8 each
    ([0.089, 0.982], 14, 9, 6, [[8, 6], [7, 7], [6, 8]]),
    # 2 rollouts, 3 candidates, budget below n_drop: counts in {0} U [1, 4] summing to 2
    ([0.5, 0.1, 0.2], 2, 4, 4, [[1, 1, 0], [1, 0, 1], [0, 1, 1], [2, 0, 0], [0, 2, 0], [0, 0, 2]]),
])
def test_vip_counts_spends_exactly_the_budget_within_the_bounds_when_only_a_few_splits_fit(p, budget, n_max, n_drop,
                                                                                          expected):
    # the rounding's last rollouts: when every kept prompt is at n_max and fewer than n_drop are left, or when
    # there are fewer rollouts than candidates, the result must still sum to the budget and keep the bounds
    counts = vip_counts(np.array(p), budget, gamma=0.0, n_max=n_max, n_drop=n_drop)
    assert counts.tolist() in expected


# ---- the rule --------------------------------------------------------------------------------------------------
def vip_plan(state, num_candidates, budget, group_size):
    uids = [f"q{i}" for i in range(num_candidates)]
    return plan_root_counts(get_arm("vip"), np.full(num_candidates, np.nan), trajectory_budget=budget,
                            expansion_ratio=1.0, group_size=group_size, m_min=2, m_max=16, prompt_uids=uids,
                            prompt_texts=[f"question {u}" for u in uids], state=state)


def test_the_rule_allocates_over_the_first_r_over_n_candidates_only():
    # first step: every forecast is the prior, an even split over the batch of R // n = 8 // 4 = 2 candidates
    state = VipState()
    assert vip_plan(state, 6, 8, 4).counts.tolist() == [4, 4, 0, 0, 0, 0]
    assert set(state.prior_logit) == {"q0", "q1"}  # only the batch was forecast

    # carried priors (no observation): p = sigmoid([0, -3, 0, 0, 0, 0]) = [0.5, 0.0474, 0.5, ...]; q2..q5 lie
    # outside the batch however promising. vip_counts(p[:2], 8): n - 1 = 6 sqrt(a) / sum sqrt(a) = [4.21, 1.79]
    # (gamma 0.0007 barely moves it), floored [5, 2], 2 < n_drop = 4 leaves, q0 takes the other 3.
    state = VipState()
    state.load_state_dict({"prior_logit": {"q0": 0.0, "q1": -3.0, "q2": 0.0, "q3": 0.0, "q4": 0.0, "q5": 0.0},
                           "last": []})
    plan = vip_plan(state, 6, 8, 4)
    assert plan.counts.tolist() == [8, 0, 0, 0, 0, 0]
    assert plan.metrics == {"vip/mean_forecast": pytest.approx((0.5 + sigmoid(-3.0)) / 2), "vip/active_prompts": 1.0}


def test_the_rule_refuses_to_plan_without_its_state():
    with pytest.raises(ValueError, match="make_allocator_state"):
        plan_root_counts(get_arm("vip"), np.full(4, np.nan), trajectory_budget=8, expansion_ratio=1.0,
                         group_size=4, m_min=2, m_max=16, prompt_uids=["a", "b", "c", "d"])


# ---- the GP forecast -------------------------------------------------------------------------------------------
def test_without_observations_the_forecast_is_the_carried_prior_or_prior_logit():
    state = VipState()
    assert state.forecast(["q/a", "q/b"], [SPIDER, RIVER]).tolist() == [-5.0, -5.0]  # prior_logit
    state.load_state_dict({"prior_logit": {"q/a": 1.5}, "last": []})
    assert state.forecast(["q/a", "q/c"], [SPIDER, HAMLET]).tolist() == [1.5, -5.0]
    assert state.prior_logit == {"q/a": 1.5, "q/c": -5.0}
    other = VipState(AllocationConfig(vip=VipConfig(prior_logit=-2.0)))
    assert other.forecast(["q/a"], [SPIDER]).tolist() == [-2.0]


def test_an_observed_question_pulls_the_forecast_of_its_text_toward_the_observed_logit():
    x = embed_prompts([SPIDER, RIVER, HAMLET], 256)
    np.testing.assert_allclose(x @ x.T, np.eye(3), atol=1e-12)  # the premise: orthogonal, squared distance 2

    state = VipState()  # prior_logit -5, length_scale 0.27, noise 1e-4
    state.forecast(["q/a", "q/b"], [SPIDER, RIVER])
    metrics = state.observe(["q/a", "q/b"], [np.array([1.0, 1.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0, 0.0])],
                            [SPIDER, RIVER])
    # Brier of the forecasts sigmoid(-5) = 0.006693 against the rates 0.75, 0.25:
    # (0.743307^2 + 0.243307^2) / 2 = (0.552505 + 0.059198) / 2 = 0.305852
    assert metrics == {"vip/forecast_brier": pytest.approx(0.305852, abs=1e-6)}
    # targets: logit(0.75) = ln 3 = 1.098612 and -ln 3, each minus its prior -5: residuals 6.098612, 3.901388.
    # k(SPIDER, RIVER) = exp(-2 / (2 * 0.27^2)) = exp(-13.72) = 1.1e-6, so the GP is two independent points:
    # mean at a text = prior + residual / (1 + noise) = -5 + 6.098612 / 1.0001 = 1.098002 (SPIDER),
    # -5 + 3.901388 / 1.0001 = -1.099002 (RIVER), and -5 at HAMLET, far from both.
    mu = state.forecast(["q/a", "q/again", "q/b", "q/new"], [SPIDER, SPIDER, RIVER, HAMLET])
    np.testing.assert_allclose(mu, [1.098002, 1.098002, -1.099002, -5.0], atol=2e-5)
    # the same question under another id gets the same pull; each forecast becomes that prompt's prior
    assert state.prior_logit == dict(zip(["q/a", "q/again", "q/b", "q/new"], mu.tolist()))


def test_the_forecast_is_the_gp_posterior_mean_around_the_carried_priors():
    state = VipState(AllocationConfig(vip=VipConfig(length_scale=1.0, noise=0.01)))
    state.load_state_dict({"prior_logit": {"q/a": 0.5}, "last": []})
    assert state.forecast(["q/a", "q/b"], [CAPITAL, SKY]).tolist() == [0.5, -5.0]
    state.observe(["q/a", "q/b"], [np.array([1.0, 1.0, 1.0, 0.0]), np.array([0.0, 0.0, 0.0, 1.0])], [CAPITAL, SKY])

    # the textbook posterior mean: m(x*) + k(x*, X) (K(X, X) + noise I)^-1 (y - m(X)), RBF exp(-d^2 / (2 l^2))
    def rbf(a, b):
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return np.exp(-d2 / 2.0)

    x_obs = embed_prompts([CAPITAL, SKY], 256)
    x_new = embed_prompts([CAPITAL, SKY, RIVER], 256)
    residual = np.array([np.log(3.0), -np.log(3.0)]) - np.array([0.5, -5.0])  # observed logit minus carried prior
    weights = np.linalg.solve(rbf(x_obs, x_obs) + 0.01 * np.eye(2), residual)
    expected = np.array([0.5, -5.0, -5.0]) + rbf(x_new, x_obs) @ weights
    assert rbf(x_obs, x_obs)[0, 1] > 0.5  # the two observations inform each other
    # sklearn adds its default alpha = 1e-10 to the diagonal as well: far below the tolerance
    np.testing.assert_allclose(state.forecast(["q/a", "q/b", "q/c"], [CAPITAL, SKY, RIVER]), expected, atol=1e-8)


# ---- the budget ------------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(num_prompts=st.integers(1, 8), n_max=st.integers(2, 12), n_drop=st.integers(2, 12),
       gamma=st.sampled_from([0.0, 0.0007, 0.01]), data=st.data())
def test_vip_counts_spends_exactly_the_budget_and_keeps_every_count_in_bounds(num_prompts, n_max, n_drop, gamma,
                                                                             data):
    assume(n_drop <= n_max)
    p = np.array(data.draw(st.lists(st.floats(0, 1), min_size=num_prompts, max_size=num_prompts)))
    budget = data.draw(st.integers(0, num_prompts * n_max))
    counts = vip_counts(p, budget, gamma=gamma, n_max=n_max, n_drop=n_drop)
    assert counts.sum() == budget and counts.min() >= 0 and counts.max() <= n_max
    if budget < n_drop:
        assert is_within_bounds(counts, 1, n_max)
    elif p.max() - p.min() >= 1e-6:  # (equal forecasts split evenly, whatever n_drop)
        fits = any(k * n_drop <= budget <= k * n_max for k in range(1, num_prompts + 1))
        assert is_within_bounds(counts, n_drop if fits else 1, n_max)


@settings(max_examples=50, deadline=None)
@given(budget=st.integers(2, 64), group_size=st.integers(2, 8), num_candidates=st.integers(1, 16),
       n_max=st.integers(2, 32), n_drop=st.integers(2, 8), gamma=st.sampled_from([0.0, 0.0007, 0.01]),
       seed=st.integers(0, 2 ** 16))
def test_every_step_samples_exactly_the_trajectory_budget(budget, group_size, num_candidates, n_max, n_drop, gamma,
                                                          seed):
    assume(n_drop <= n_max)
    acfg = AllocationConfig(trajectory_budget=budget, num_candidates=num_candidates, group_size=group_size,
                            expansion_ratio=0.0, vip=VipConfig(n_max=n_max, n_drop=n_drop, gamma=gamma))
    env, _ = simulator(seed=seed % 7)
    state = make_allocator_state(get_arm("vip"), acfg)
    if num_candidates * n_max < budget:  # no batch of the candidates can hold the budget
        with pytest.raises(ValueError, match="allocation.vip.n_max"):
            run_steps("vip", state, [seed], acfg, env, num_candidates)
        return
    results = run_steps("vip", state, range(seed, seed + 3), acfg, env, num_candidates)
    assert_the_rule_spent_the_budget(results, budget)
    for result in results:
        assert result.root_counts.max() <= n_max
    assert state.last and state.prior_logit


# ---- state across steps ----------------------------------------------------------------------------------------
def test_the_state_survives_a_json_round_trip():
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=8)
    env, _ = simulator(seed=1)
    state = make_allocator_state(get_arm("vip"), acfg)
    run_steps("vip", state, range(3), acfg, env)
    fresh = make_allocator_state(get_arm("vip"), acfg)
    fresh.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert fresh.state_dict() == state.state_dict()
    assert state.last and len(state.prior_logit) > 4
    uids = sorted(state.prior_logit)[:3] + ["never_seen"]
    texts = ["task train 12", "task train 13", "task train 5", "task train 9"]
    np.testing.assert_array_equal(fresh.forecast(uids, texts), state.forecast(uids, texts))


def test_a_run_resumed_from_its_saved_state_allocates_as_an_uninterrupted_one():
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=8)
    env, _ = simulator(seed=2)
    straight = assert_resume_equals_uninterrupted("vip", acfg, env)
    # the state decides: from step 1 the counts are no longer grpo's 8 each (a fresh state would give 8 each)
    assert any(k != 8 for record in straight[3:] for _, k, _ in record)


def test_n_drop_above_n_max_is_refused_by_the_config_and_the_solver():
    from pydantic import ValidationError

    from trace.configuration.config_allocators import VipConfig

    with pytest.raises(ValidationError, match="n_drop=6 > n_max=4"):
        VipConfig(n_drop=6, n_max=4)
    with pytest.raises(ValueError, match="n_drop=6 > n_max=4"):
        vip_counts(np.array([0.5, 0.1, 0.3]), 10, gamma=0.0, n_max=4, n_drop=6)


def test_questions_that_differ_in_one_digit_embed_apart():
    from trace.allocation.vip import embed_prompts

    x = embed_prompts(["task train 1", "task train 2", "task train 1"], 256)
    assert np.allclose(x[0], x[2]) and not np.allclose(x[0], x[1])
