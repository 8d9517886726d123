"""GRESO's root rule: streaks, keep probabilities and their moves worked by hand; the budget, the state's JSON
round trip and a resumed run on the simulator."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_allocation_step import simulator
from trace.allocation.arms import get_arm, make_allocator_state
from trace.allocation.greso import GresoState, greso_root_rule, group_outcome
from trace.allocation.registry import RootRequest
from trace.allocation.samplers import SimulatorSampler
from trace.allocation.step import allocate_step
from trace.configuration.config import AllocationConfig
from trace.configuration.config_allocators import GresoConfig


class ScriptedUniforms:
    """A stand-in generator whose ``random(n)`` returns the given uniforms (checking ``n``)."""

    def __init__(self, uniforms):
        self.uniforms = np.asarray(uniforms, dtype=np.float64)

    def random(self, size):
        assert size == self.uniforms.size
        return self.uniforms.copy()


def greso_config(**greso):
    return AllocationConfig(greso=GresoConfig(**greso))


def test_group_outcome_bounds_are_inclusive():
    assert group_outcome(np.array([0.98, 0.98])) == "easy"  # mean >= 0.98
    assert group_outcome(np.array([1.0, 1.0, 1.0, 0.9])) == "mixed"  # mean 0.975
    assert group_outcome(np.array([0.11, 0.11])) == "hard"  # mean <= 0.11
    assert group_outcome(np.array([0.1, 0.2])) == "mixed"  # mean 0.15
    assert group_outcome(np.zeros(0)) == "mixed"


def test_observe_counts_streaks_and_moves_each_probability_toward_its_target():
    """Defaults: p_easy = p_hard = 0.5, p_step 0.01; targets 0.25 / 3 = 0.0833 (easy), 0.25 * 2 / 3 = 0.1667 (hard).

    step 1: a easy (mean 1), b hard (0.075), c mixed (0.5), d easy (0.9875 >= 0.98).
        streaks a (1, 0), b (0, 1), c (0, 0), d (1, 0). easy share 2/4 >= 0.0833: p_easy 0.49;
        hard share 1/4 >= 0.1667: p_hard 0.49.
    step 2: a easy, b hard, c hard, d mixed.
        streaks a (2, 0), b (0, 2), c (0, 1), d (0, 0). easy 1/4 >= 0.0833: p_easy 0.48; hard 2/4: p_hard 0.48.
    keep: a 0.48^2 = 0.2304, b 0.48^2 = 0.2304, c 0.48, d 1, e (never seen) 1.
    step 3: a easy, c mixed, d mixed, e mixed: easy 1/4 >= 0.0833: p_easy 0.47; hard 0 < 0.1667: p_hard up 0.49.
        a (3, 0), c (0, 0): keep a 0.47^3 = 0.103823, b 0.49^2 = 0.2401, c 1.
    step 4: 8 groups, a hard, b easy, the rest mixed: a (3, 0) -> (0, 1), b (0, 2) -> (1, 0);
        easy 1/8 = 0.125 >= 0.0833: p_easy 0.46; hard 0.125 < 0.1667: p_hard up 0.50.
    (The gate of the first epoch off: ``test_the_probabilities_stay_put_through_the_first_epoch`` tests it.)
    """
    state = GresoState(greso_config(adapt_after_first_epoch=False))
    metrics = state.observe(["a", "b", "c", "d"], [np.ones(4), np.array([0.1, 0.1, 0.0, 0.1]),
                                                   np.array([1.0, 0.0, 1.0, 0.0]), np.array([1.0, 1.0, 1.0, 0.95])])
    assert state.streaks == {"a": (1, 0), "b": (0, 1), "c": (0, 0), "d": (1, 0)}
    assert metrics == pytest.approx({"greso/p_easy": 0.49, "greso/p_hard": 0.49})

    state.observe(["a", "b", "c", "d"], [np.ones(4), np.zeros(4), np.zeros(4), np.array([1.0, 0.0, 0.0, 0.0])])
    assert state.streaks == {"a": (2, 0), "b": (0, 2), "c": (0, 1), "d": (0, 0)}
    assert (state.p_easy, state.p_hard) == pytest.approx((0.48, 0.48))
    assert state.keep_probability(["a", "b", "c", "d", "e"]) == pytest.approx([0.2304, 0.2304, 0.48, 1.0, 1.0])

    metrics = state.observe(["a", "c", "d", "e"], [np.ones(2), np.array([1.0, 0.0]), np.array([0.5, 0.5]),
                                                   np.array([0.0, 1.0])])
    assert metrics == pytest.approx({"greso/p_easy": 0.47, "greso/p_hard": 0.49})
    assert state.keep_probability(["a", "b", "c"]) == pytest.approx([0.47 ** 3, 0.49 ** 2, 1.0])

    # shares between the two targets: easy 1/8 = 0.125 >= 0.0833 -> p_easy 0.46; hard 1/8 < 0.1667 -> p_hard 0.50
    metrics = state.observe(list("abcdefgh"), [np.zeros(2), np.ones(2)] + [np.array([0.0, 1.0])] * 6)
    assert metrics == pytest.approx({"greso/p_easy": 0.46, "greso/p_hard": 0.50})
    assert state.streaks == {"a": (0, 1), "b": (1, 0), **{uid: (0, 0) for uid in "cdefgh"}}  # a run ends the other


def test_a_share_at_its_target_moves_the_probability_down():
    """target_zero_variance 0.5, easy_share 0.5: both targets 0.25. 1 easy and 1 hard of 4 groups: both shares are
    0.25, at the target: both probabilities down, 0.5 - 0.01 = 0.49."""
    state = GresoState(greso_config(target_zero_variance=0.5, easy_share=0.5, adapt_after_first_epoch=False))
    metrics = state.observe(list("abcd"), [np.ones(2), np.zeros(2), np.array([0.0, 1.0]), np.array([1.0, 0.0])])
    assert metrics == pytest.approx({"greso/p_easy": 0.49, "greso/p_hard": 0.49})


def test_observing_no_groups_leaves_the_probabilities_alone():
    state = GresoState()
    assert state.observe([], []) == {"greso/p_easy": 0.5, "greso/p_hard": 0.5}


def test_the_probabilities_are_clipped_to_p_min_and_p_max():
    """p_step 0.3: p_easy 0.9 + 0.3 = 1.2 -> p_max 0.95 (no easy group); p_hard 0.1 - 0.3 = -0.2 -> p_min 0.05
    (hard share 1 >= 0.1667)."""
    state = GresoState(greso_config(p_easy=0.9, p_hard=0.1, p_step=0.3, adapt_after_first_epoch=False))
    state.observe(["a"], [np.zeros(3)])
    assert (state.p_easy, state.p_hard) == (0.95, 0.05)


def test_keep_probability_is_the_streak_power_with_a_floor():
    """p_easy 0.5, p_hard 0.4, keep_floor 0.01: a 0.5^7 = 0.0078 -> 0.01; b 0.4^2 = 0.16; c 1; d 0.5; e 1."""
    state = GresoState()
    state.load_state_dict({"p_easy": 0.5, "p_hard": 0.4, "streaks": {"a": [7, 0], "b": [0, 2], "c": [0, 0],
                                                                     "d": [1, 0]}, "seen": [], "past_first_epoch": True})
    assert state.keep_probability(["a", "b", "c", "d", "e"]) == pytest.approx([0.01, 0.16, 1.0, 0.5, 1.0])


def test_the_probabilities_stay_put_through_the_first_epoch():
    """The original adapts only when epoch > 0. Pool of 5 prompts, 2 candidates a step
    (``candidate_indices``): steps 0 and 1 draw 4 distinct prompts; step 2 holds the last prompt of the first
    permutation and the first of the second, a repeat: the second epoch starts there (ceil(5 / 2) - 1 = 2).
    Every step observes one easy and one hard group (shares 1/2 each, both >= their targets): no move at steps 0
    and 1, then both 0.5 - 0.01 = 0.49 at step 2, 0.48 at step 3."""
    from trace.training.seeding import candidate_indices

    state = GresoState()
    moves = []
    for step in range(4):
        uids = [f"q{i}" for i in candidate_indices(5, 2, 0, step)]
        state.see_candidates(uids)
        moves.append(state.observe(uids, [np.ones(4), np.zeros(4)])["greso/p_easy"])
    assert moves == pytest.approx([0.5, 0.5, 0.49, 0.48])
    assert state.streaks["q" + str(candidate_indices(5, 2, 0, 0)[0])][0] >= 1  # the streaks ran from step 0
    # without the gate, from the first step
    ungated = GresoState(greso_config(adapt_after_first_epoch=False))
    assert ungated.observe(["q0", "q1"], [np.ones(4), np.zeros(4)])["greso/p_easy"] == pytest.approx(0.49)


def test_a_state_without_one_of_its_keys_is_refused_naming_it():
    with pytest.raises(ValueError, match="lacks 'past_first_epoch'"):
        GresoState().load_state_dict({"p_easy": 0.5, "p_hard": 0.5, "streaks": {}, "seen": []})


def plan(state, uniforms, budget, group_size=4):
    """The rule on candidates a..e with scripted uniforms; returns the decision and the purposes drawn."""
    purposes = []

    def rng_for(purpose):
        purposes.append(purpose)
        return ScriptedUniforms(uniforms)

    request = RootRequest(pred_success_prob=np.full(5, np.nan), root_budget=budget, trajectory_budget=budget,
                          group_size=group_size, m_min=2, m_max=16, knapsack_m_min=None, tie_keys=None,
                          exact_max_cells=1, max_retries=0, rng_for=rng_for, prompt_uids=list("abcde"), state=state)
    return greso_root_rule(request), purposes


@pytest.mark.parametrize("budget, counts, refilled", [
    # 16 // 4 = 4 groups: the 3 kept (b, c, e), then the first skipped (a)
    (16, [4, 4, 4, 0, 4], 1),
    # 12 // 4 = 3 groups: the kept only
    (12, [0, 4, 4, 0, 4], 0),
    # 14 // 4 = 3 groups of 14 // 3 = 4, the first 14 % 3 = 2 of the order (b, c) one more
    (14, [0, 5, 5, 0, 4], 0),
    # 20 // 4 = 5 groups: everyone, no matter the draw
    (20, [4, 4, 4, 4, 4], 2),
])
def test_kept_candidates_come_first_in_candidate_order_and_skipped_ones_fill(budget, counts, refilled):
    """keep a..e = 0.01, 0.16, 1, 0.5, 1 (the floor test's state); uniforms 0.5, 0.1, 0.99, 0.5, 0.2.

    kept when u < keep: a 0.5 < 0.01 no; b 0.1 < 0.16 yes; c 0.99 < 1 yes; d 0.5 < 0.5 no (strict); e yes.
    order: kept b, c, e, then skipped a, d.
    """
    state = GresoState()
    state.load_state_dict({"p_easy": 0.5, "p_hard": 0.4, "streaks": {"a": [7, 0], "b": [0, 2], "c": [0, 0],
                                                                     "d": [1, 0]}, "seen": [], "past_first_epoch": True})
    decision, purposes = plan(state, [0.5, 0.1, 0.99, 0.5, 0.2], budget)
    assert purposes == ["greso"]
    assert decision.counts.tolist() == counts and decision.counts.dtype == np.int64
    assert decision.metrics == {"greso/skipped": 2.0, "greso/refilled": float(refilled)}
    assert decision.trees is None and decision.expansion_budget is None


def test_the_rule_refuses_without_state_prompt_ids_or_a_random_stream():
    with pytest.raises(ValueError, match="make_allocator_state"):
        greso_root_rule(RootRequest(pred_success_prob=np.full(3, np.nan), root_budget=8, trajectory_budget=8,
                                    group_size=4, m_min=2, m_max=16, knapsack_m_min=None, tie_keys=None,
                                    exact_max_cells=1, max_retries=0))


def test_the_state_round_trips_through_json():
    state = GresoState(greso_config(p_step=0.05))
    state.observe(["a", "b", "c"], [np.ones(4), np.zeros(4), np.array([1.0, 0.0])])
    state.observe(["a", "b", "d"], [np.ones(4), np.zeros(4), np.ones(2)])
    restored = GresoState(greso_config(p_step=0.05))
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored.state_dict() == state.state_dict()
    uids = ["a", "b", "c", "d", "never-seen"]
    assert restored.keep_probability(uids).tolist() == state.keep_probability(uids).tolist()
    assert state.keep_probability(uids).tolist() != [1.0] * 5  # the round trip carries something


# ---- the simulator -----------------------------------------------------------------------------------------
# 3 groups from 8 candidates; base probabilities 0.2, so one agreed group makes a prompt likely skipped
ACFG = AllocationConfig(trajectory_budget=12, num_candidates=8, group_size=4,
                        greso=GresoConfig(p_easy=0.2, p_hard=0.2))


def run_steps(env, oracle, state, steps, acfg=ACFG):
    """``allocate_step`` of the greso arm at each step: 8 of the 16 prompts, drawn per step."""
    out = []
    for step in steps:
        order = np.random.default_rng([7, step]).permutation(len(env.prompts()))[:acfg.num_candidates]

        def rng_for(salt, step=step):
            return np.random.default_rng([step, sum(map(ord, salt))])

        sampler = SimulatorSampler(env, oracle, np.random.default_rng([1, step]), rng_for, step=step,
                                   ablation="greso")
        result = allocate_step(get_arm("greso"), [env.prompts()[i] for i in order], sampler, acfg, rng_for,
                               state=state)
        out.append(([(t.prompt_uid, t.num_trajectories()) for t in result.sampled_trees],
                    [t.leaf_rewards().tolist() for t in result.sampled_trees], result.metrics))
    return out


def test_a_resumed_run_allocates_as_an_uninterrupted_one():
    env, oracle = simulator(seed=1)
    whole = run_steps(env, oracle, make_allocator_state(get_arm("greso"), ACFG), range(6))

    first = make_allocator_state(get_arm("greso"), ACFG)
    head = run_steps(env, oracle, first, range(3))
    resumed = make_allocator_state(get_arm("greso"), ACFG)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = run_steps(env, oracle, resumed, range(3, 6))
    assert head + tail == whole

    # the state matters here: a fresh state at step 3 allocates otherwise, and some draw skipped a prompt
    forgetful = run_steps(env, oracle, make_allocator_state(get_arm("greso"), ACFG), range(3, 6))
    assert [counts for counts, _, _ in forgetful] != [counts for counts, _, _ in tail]
    assert any(metrics["greso/skipped"] > 0 for _, _, metrics in whole)


@settings(max_examples=40, deadline=None)
@given(budget=st.integers(4, 64), num_candidates=st.integers(1, 16), group_size=st.integers(2, 8),
       p_easy=st.floats(0.05, 0.95), p_hard=st.floats(0.05, 0.95), p_step=st.sampled_from([0.0, 0.01, 0.2]),
       keep_floor=st.sampled_from([0.0, 0.01, 0.5]), seed=st.integers(0, 3))
def test_every_step_samples_exactly_the_trajectory_budget(budget, num_candidates, group_size, p_easy, p_hard,
                                                          p_step, keep_floor, seed):
    env, oracle = simulator(seed=seed)
    acfg = AllocationConfig(trajectory_budget=budget, num_candidates=num_candidates, group_size=group_size,
                            greso=GresoConfig(p_easy=p_easy, p_hard=p_hard, p_step=p_step, keep_floor=keep_floor))
    state = make_allocator_state(get_arm("greso"), acfg)
    for uids, _, metrics in run_steps(env, oracle, state, range(3), acfg):
        assert sum(count for _, count in uids) == budget
        assert len({uid for uid, _ in uids}) == len(uids) == min(num_candidates, max(1, budget // group_size))
        assert 0 <= metrics["greso/refilled"] <= metrics["greso/skipped"] <= num_candidates
        assert 0.05 <= metrics["greso/p_easy"] <= 0.95 and 0.05 <= metrics["greso/p_hard"] <= 0.95
