"""Stage 1 root allocation: the activation probability, the exact DP and the certified Lagrangian solver."""

import itertools
import time

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trace.allocation.objectives import objective_table, objective_value
from trace.allocation.root import activation_increment, activation_prob, allocate_roots
from trace.allocation.table_solvers import dual_value


def brute_force(p, budget, m_min, m_max, allow_skip=True):
    """Best objective over every assignment (the slow obvious reference); None when infeasible."""
    options = ([0] if allow_skip else []) + list(range(m_min, m_max + 1))
    best = None
    for counts in itertools.product(options, repeat=len(p)):
        if sum(counts) == budget:
            value = sum(1 - q ** m - (1 - q) ** m if m >= 2 else 0.0 for q, m in zip(p, counts))
            best = value if best is None else max(best, value)
    return best


def assert_valid(counts, budget, m_min, m_max):
    assert counts.dtype == np.int64
    assert counts.sum() == budget
    assert np.all((counts == 0) | ((counts >= m_min) & (counts <= m_max)))


# ---- activation probability ---------------------------------------------------------------------------------
def test_activation_prob_matches_design_vectors():
    np.testing.assert_allclose(activation_prob(0.1819, np.array([2, 4, 8, 16])),
                               [0.2976, 0.5510, 0.7993, 0.9597], atol=5e-5)
    assert activation_prob(0.5, 2) == 0.5
    m = np.arange(0, 20)
    assert np.all(activation_prob(0.0, m) == 0.0) and np.all(activation_prob(1.0, m) == 0.0)


def test_activation_prob_is_zero_for_zero_and_one_rollouts():
    # 0**0 == 1 in floating point would give A(p, 0) = 1 - 1 - 1 = -1 without the special case
    p = np.array([0.0, 0.1, 0.5, 0.99, 1.0])
    assert np.all(activation_prob(p, 0) == 0.0)
    assert np.all(activation_prob(p, 1) == 0.0)


def test_activation_prob_broadcasts_and_matches_the_formula():
    p = np.linspace(0, 1, 7)[:, None]
    m = np.arange(2, 9)[None, :]
    np.testing.assert_allclose(activation_prob(p, m), 1 - p ** m - (1 - p) ** m, atol=1e-15)
    assert activation_prob(p, m).shape == (7, 7)


def test_activation_increment_equals_the_difference_and_shrinks():
    p = np.linspace(0, 1, 11)[:, None]
    m = np.arange(1, 12)[None, :]
    inc = activation_increment(p, m)
    np.testing.assert_allclose(inc, activation_prob(p, m + 1) - activation_prob(p, m), atol=1e-14)
    assert np.all(np.diff(inc, axis=1) <= 0)


@pytest.mark.parametrize("p,m", [(-0.1, 2), (1.5, 2), (float("nan"), 2), (0.5, -1), (0.5, 2.5)])
def test_activation_prob_rejects_bad_inputs(p, m):
    with pytest.raises(ValueError):
        activation_prob(p, m)


# ---- hand-worked allocations -------------------------------------------------------------------------------
@pytest.mark.parametrize("exact_max_cells", [2_000_000, 0])
def test_hand_worked_allocation(exact_max_cells):
    # A(0.5, .) = 0.5, 0.75, 0.875 and A(0.9, .) = 0.18, 0.27, 0.3438 for m = 2, 3, 4; p = 0 is worth 0.
    # M = 4: {0.5: 4} = 0.875 beats {0.5: 2, 0.9: 2} = 0.68.
    # M = 6: {0.5: 4, 0.9: 2} = 1.055 beats {0.5: 3, 0.9: 3} = 1.02 and {0.5: 2, 0.9: 4} = 0.8438.
    p = [0.5, 0.0, 0.9]
    four = allocate_roots(p, 4, 2, 4, exact_max_cells=exact_max_cells)
    assert four.counts.tolist() == [4, 0, 0] and four.objective == pytest.approx(0.875)
    six = allocate_roots(p, 6, 2, 4, exact_max_cells=exact_max_cells)
    assert six.counts.tolist() == [4, 0, 2] and six.objective == pytest.approx(1.055)


def test_exact_solver_reports_zero_gap():
    result = allocate_roots([0.2, 0.5, 0.7], 7, 2, 4)
    assert result.method == "exact" and result.gap == 0.0 and result.upper_bound == result.objective


def test_zero_budget_skips_everyone():
    result = allocate_roots([0.3, 0.6], 0, 2, 8)
    assert result.counts.tolist() == [0, 0] and result.objective == 0.0


@pytest.mark.parametrize("exact_max_cells", [2_000_000, 0])
def test_exact_ties_go_to_the_smaller_tie_key(exact_max_cells):
    # two identical prompts, room for one group of 2
    first = allocate_roots([0.5, 0.5], 2, 2, 2, exact_max_cells=exact_max_cells, tie_keys=["q0", "q1"])
    second = allocate_roots([0.5, 0.5], 2, 2, 2, exact_max_cells=exact_max_cells, tie_keys=["q1", "q0"])
    assert first.counts.tolist() == [2, 0]
    assert second.counts.tolist() == [0, 2]


def test_no_skip_serves_every_prompt_and_is_optimal():
    p = [0.05, 0.5, 0.95, 0.3]
    result = allocate_roots(p, 12, 2, 5, allow_skip=False)
    assert np.all(result.counts >= 2)
    assert result.counts.sum() == 12
    assert result.objective == pytest.approx(brute_force(p, 12, 2, 5, allow_skip=False))


# ---- infeasible budgets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,budget,m_min,m_max", [
    ([0.5, 0.5], 1, 2, 8),  # below m_min
    ([0.5, 0.5], 17, 2, 8),  # above B * m_max
    ([0.5, 0.5], 5, 3, 3),  # between reachable sums 3 and 6
    ([], 4, 2, 8),  # no candidates
])
def test_infeasible_budget_names_the_config_keys(p, budget, m_min, m_max):
    with pytest.raises(ValueError) as err:
        allocate_roots(p, budget, m_min, m_max)
    msg = str(err.value)
    for key in ("allocation.trajectory_budget", "allocation.m_min", "allocation.m_max", "allocation.num_candidates"):
        assert key in msg


def test_no_skip_refuses_a_budget_below_everyone_at_m_min():
    with pytest.raises(ValueError, match="without skips"):
        allocate_roots([0.5, 0.5, 0.5], 5, 2, 4, allow_skip=False)


# ---- properties against brute force ------------------------------------------------------------------------
@st.composite
def small_problems(draw):
    num_prompts = draw(st.integers(1, 4))
    m_min = draw(st.integers(1, 3))
    m_max = draw(st.integers(m_min, m_min + 3))
    prob = st.one_of(st.floats(0, 1), st.sampled_from([0.0, 0.5, 0.25, 1.0]))
    p = draw(st.lists(prob, min_size=num_prompts, max_size=num_prompts))
    budget = draw(st.integers(0, num_prompts * m_max))
    return p, budget, m_min, m_max


@settings(max_examples=80, deadline=None)
@given(problem=small_problems())
def test_exact_matches_brute_force(problem):
    p, budget, m_min, m_max = problem
    best = brute_force(p, budget, m_min, m_max)
    if best is None:
        with pytest.raises(ValueError):
            allocate_roots(p, budget, m_min, m_max)
        return
    result = allocate_roots(p, budget, m_min, m_max)
    assert result.method == "exact"
    assert_valid(result.counts, budget, m_min, m_max)
    assert result.objective == pytest.approx(best, abs=1e-12)


@settings(max_examples=80, deadline=None)
@given(problem=small_problems())
def test_lagrangian_gap_is_certified(problem):
    p, budget, m_min, m_max = problem
    best = brute_force(p, budget, m_min, m_max)
    assume(best is not None and budget > 0)
    result = allocate_roots(p, budget, m_min, m_max, exact_max_cells=0)
    assert result.method == "lagrangian"
    assert_valid(result.counts, budget, m_min, m_max)
    assert result.objective <= best + 1e-12
    assert best <= result.upper_bound + 1e-12
    if result.upper_bound > 0:
        assert result.gap == pytest.approx((result.upper_bound - result.objective) / result.upper_bound)


@settings(max_examples=60, deadline=None)
@given(problem=small_problems(), seed=st.integers(0, 2 ** 32 - 1), exact=st.booleans())
def test_permuting_inputs_with_tie_keys_permutes_the_counts(problem, seed, exact):
    p, budget, m_min, m_max = problem
    assume(brute_force(p, budget, m_min, m_max) is not None)
    cells = 2_000_000 if exact else 0
    keys = np.arange(len(p)) * 7 + 3
    base = allocate_roots(p, budget, m_min, m_max, exact_max_cells=cells, tie_keys=keys)
    perm = np.random.default_rng(seed).permutation(len(p))
    moved = allocate_roots(np.asarray(p)[perm], budget, m_min, m_max, exact_max_cells=cells, tie_keys=keys[perm])
    np.testing.assert_array_equal(moved.counts, base.counts[perm])
    again = allocate_roots(p, budget, m_min, m_max, exact_max_cells=cells, tie_keys=keys)
    np.testing.assert_array_equal(again.counts, base.counts)


# ---- scale -------------------------------------------------------------------------------------------------
def test_lagrangian_on_a_medium_problem_is_within_its_bound_of_the_dp():
    p = np.random.default_rng(0).beta(0.5, 0.5, size=96)
    exact = allocate_roots(p, 400, 2, 12)
    relaxed = allocate_roots(p, 400, 2, 12, exact_max_cells=0)
    assert exact.method == "exact" and relaxed.method == "lagrangian"
    assert relaxed.objective <= exact.objective + 1e-9 <= relaxed.upper_bound + 2e-9
    assert relaxed.gap < 1e-2


@pytest.mark.parametrize("budget", [65_536, 32_768, 8_192])
def test_large_lagrangian_is_fast_and_tight(budget):
    p = np.random.default_rng(1).beta(0.5, 0.5, size=4096)
    best = np.inf
    for _ in range(3):
        start = time.perf_counter()
        result = allocate_roots(p, budget, 2, 16)
        best = min(best, time.perf_counter() - start)
    assert result.method == "lagrangian"
    assert_valid(result.counts, budget, 2, 16)
    assert result.gap < 1e-3
    assert best < 0.5


def test_exact_dp_at_its_cell_limit_is_fast():
    p = np.random.default_rng(2).random(1024)
    start = time.perf_counter()
    result = allocate_roots(p, 128, 2, 16)  # 1024 * 128 * 15 = 1.97 M cells
    assert time.perf_counter() - start < 2.0
    assert result.method == "exact"
    assert_valid(result.counts, 128, 2, 16)


# ---- the leaves objective ----------------------------------------------------------------------------------
def brute_force_objective(p, budget, m_min, m_max, objective, allow_skip=True):
    """Best ``sum f(p_i, m_i)`` by enumeration, f = A (groups) or m A (leaves), A written out; None if infeasible."""
    options = ([0] if allow_skip else []) + list(range(m_min, m_max + 1))
    best = None
    for counts in itertools.product(options, repeat=len(p)):
        if sum(counts) == budget:
            value = sum((m if objective == "leaves" else 1) * (1 - q ** m - (1 - q) ** m if m >= 2 else 0.0)
                        for q, m in zip(p, counts))
            best = value if best is None else max(best, value)
    return best


def test_leaves_objective_weighs_each_group_by_its_rollouts():
    # m A(p, m): 2 * A(0.5, 2) = 2 * 0.5; 4 * A(0.1819, 4) = 4 * 0.5510; 0 at m in {0, 1}
    values = objective_table(np.array([0.5, 0.1819, 0.3, 0.3]), np.array([2, 4, 0, 1]), "leaves")
    np.testing.assert_allclose(values, [1.0, 2.2040, 0.0, 0.0], atol=2e-4)
    assert objective_value([0.5, 0.1819], [2, 4], "groups") == pytest.approx(0.5 + 0.5510, abs=1e-4)


def test_leaves_objective_is_not_concave_for_small_p():
    # m A(0.05, m) for m = 2, 3, 4: 2 * 0.095 = 0.19, 3 * 0.1425 = 0.4275, 4 * 0.18549 = 0.74196: increments
    # 0.2375 < 0.3145 grow, so greedy by increment is not exact for leaves (it is for groups: A's shrink)
    leaves = objective_table(0.05, np.arange(2, 5), "leaves")
    np.testing.assert_allclose(leaves, [0.19, 0.4275, 0.74196], atol=1e-5)
    assert np.diff(leaves, n=2)[0] > 0
    assert np.all(np.diff(objective_table(0.05, np.arange(2, 17), "groups"), n=2) <= 1e-15)


@pytest.mark.parametrize("exact_max_cells", [2_000_000, 0])
def test_hand_worked_leaves_allocation_prefers_one_large_group(exact_max_cells):
    # four prompts at p = 0.5, M = 8, m in {0} U [4, 8]: the splits are 4,4 and 8. groups: 4,4 gives
    # 2 * (1 - 2/16) = 1.75 > 8's 1 - 2/256 = 0.9921875. leaves: 4,4 gives 8 * 0.875 = 7.0 < 8's
    # 8 * 0.9921875 = 7.9375. Ties between prompts go to the smallest tie key
    groups = allocate_roots([0.5] * 4, 8, 4, 8, exact_max_cells=exact_max_cells)
    leaves = allocate_roots([0.5] * 4, 8, 4, 8, exact_max_cells=exact_max_cells, root_objective="leaves")
    np.testing.assert_array_equal(groups.counts, [4, 4, 0, 0])
    np.testing.assert_array_equal(leaves.counts, [8, 0, 0, 0])
    assert leaves.objective == pytest.approx(7.9375) and leaves.root_objective == "leaves"
    assert groups.objective == pytest.approx(1.75) and groups.root_objective == "groups"


def test_unknown_root_objective_names_the_key():
    with pytest.raises(ValueError, match=r"allocation\.root_objective.*'groups', 'leaves'"):
        allocate_roots([0.5, 0.5], 4, 2, 4, root_objective="prompts")


@settings(max_examples=80, deadline=None)
@given(problem=small_problems(), allow_skip=st.booleans(), objective=st.sampled_from(["groups", "leaves"]))
def test_exact_matches_brute_force_for_both_objectives(problem, allow_skip, objective):
    p, budget, m_min, m_max = problem
    best = brute_force_objective(p, budget, m_min, m_max, objective, allow_skip)
    if best is None:
        with pytest.raises(ValueError):
            allocate_roots(p, budget, m_min, m_max, allow_skip=allow_skip, root_objective=objective)
        return
    result = allocate_roots(p, budget, m_min, m_max, allow_skip=allow_skip, root_objective=objective)
    assert result.method == "exact" and result.gap == 0.0
    assert_valid(result.counts, budget, m_min, m_max)
    if not allow_skip:
        assert np.all(result.counts >= m_min)
    assert result.objective == pytest.approx(best, abs=1e-12)
    assert result.upper_bound == pytest.approx(best, abs=1e-12)


@settings(max_examples=120, deadline=None)
@given(problem=small_problems(), allow_skip=st.booleans(), objective=st.sampled_from(["groups", "leaves"]))
def test_lagrangian_gap_is_certified_for_both_objectives(problem, allow_skip, objective):
    p, budget, m_min, m_max = problem
    best = brute_force_objective(p, budget, m_min, m_max, objective, allow_skip)
    assume(best is not None and budget > 0)
    assume(objective == "leaves" or allow_skip)  # groups without skips is solved exactly by greedy
    result = allocate_roots(p, budget, m_min, m_max, exact_max_cells=0, allow_skip=allow_skip,
                            root_objective=objective)
    assert result.method == "lagrangian"
    assert_valid(result.counts, budget, m_min, m_max)
    reached = sum((m if objective == "leaves" else 1) * (1 - q ** m - (1 - q) ** m if m >= 2 else 0.0)
                  for q, m in zip(p, result.counts))
    assert result.objective == pytest.approx(reached, abs=1e-12)
    assert result.objective <= best + 1e-12
    assert best <= result.upper_bound + 1e-12
    # the certified gap bounds the true shortfall; compared in absolute terms, since a relative gap
    # amplifies float rounding when the upper bound itself is tiny (every p near 0 or 1)
    assert best - result.objective <= result.gap * result.upper_bound + 1e-12
    if result.upper_bound > 0:
        assert result.gap == pytest.approx((result.upper_bound - result.objective) / result.upper_bound)


@settings(max_examples=60, deadline=None)
@given(problem=small_problems(), seed=st.integers(0, 2 ** 32 - 1), exact=st.booleans())
def test_leaves_permuting_inputs_with_tie_keys_permutes_the_counts(problem, seed, exact):
    p, budget, m_min, m_max = problem
    assume(brute_force(p, budget, m_min, m_max) is not None)
    cells = 2_000_000 if exact else 0
    keys = np.arange(len(p)) * 7 + 3
    base = allocate_roots(p, budget, m_min, m_max, exact_max_cells=cells, tie_keys=keys, root_objective="leaves")
    perm = np.random.default_rng(seed).permutation(len(p))
    moved = allocate_roots(np.asarray(p)[perm], budget, m_min, m_max, exact_max_cells=cells, tie_keys=keys[perm],
                           root_objective="leaves")
    np.testing.assert_array_equal(moved.counts, base.counts[perm])


@pytest.mark.parametrize("allow_skip", [True, False])
def test_leaves_lagrangian_on_a_medium_problem_is_within_its_bound_of_the_dp(allow_skip):
    p = np.random.default_rng(0).beta(0.5, 0.5, size=96)
    exact = allocate_roots(p, 400, 2, 12, allow_skip=allow_skip, root_objective="leaves")
    relaxed = allocate_roots(p, 400, 2, 12, exact_max_cells=0, allow_skip=allow_skip, root_objective="leaves")
    assert exact.method == "exact" and relaxed.method == "lagrangian"
    assert relaxed.objective <= exact.objective + 1e-9 <= relaxed.upper_bound + 2e-9
    assert relaxed.gap < 1e-2


@pytest.mark.parametrize("budget", [65_536, 32_768, 8_192])
def test_large_leaves_lagrangian_is_tight(budget):
    p = np.random.default_rng(1).beta(0.5, 0.5, size=4096)
    result = allocate_roots(p, budget, 2, 16, root_objective="leaves")
    assert result.method == "lagrangian"
    assert_valid(result.counts, budget, 2, 16)
    assert result.objective == pytest.approx(objective_value(p, result.counts, "leaves"))
    assert result.gap < 1e-3


@settings(max_examples=80, deadline=None)
@given(problem=small_problems(), allow_skip=st.booleans(), objective=st.sampled_from(["groups", "leaves"]),
       price=st.floats(0, 4))
def test_dual_value_bounds_the_optimum_at_any_price(problem, allow_skip, objective, price):
    # weak duality, with no concavity: g(lambda) >= the brute-force optimum for every lambda >= 0
    p, budget, m_min, m_max = problem
    best = brute_force_objective(p, budget, m_min, m_max, objective, allow_skip)
    assume(best is not None)
    m_values = np.arange(m_min, m_max + 1)
    values = objective_table(np.asarray(p, dtype=float)[:, None], m_values[None, :], objective)
    assert dual_value(values, m_values, price, budget, allow_skip) >= best - 1e-12
