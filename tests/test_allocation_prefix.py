"""Stage 2 prefix expansion: V_pref, the greedy allocator against a heap and brute force, anchors, budget split."""

import heapq
import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_advantages import make_tree
from trace.allocation.prefix import (
    allocate_prefixes,
    candidate_anchors,
    prefix_marginal_gain,
    prefix_value,
    split_expansion_budget,
)


# ---- V_pref ------------------------------------------------------------------------------------------------
def test_prefix_value_matches_design_vectors():
    assert prefix_value(1, 0.3, 2) == pytest.approx(0.91)  # 1 - 0.3^2
    assert prefix_value(0, 0.3, 2) == pytest.approx(0.51)  # 1 - 0.7^2
    assert prefix_value(0, 0.3, 1) == pytest.approx(0.30)
    r, v = np.meshgrid([0.0, 0.5, 1.0], [0.0, 0.3, 1.0])
    assert np.all(prefix_value(r, v, 0) == 0.0)


def test_prefix_value_is_concave_and_its_gain_has_a_closed_form():
    r = np.array([0.0, 1.0, 0.5, 1.0])[:, None]
    v = np.array([0.3, 0.3, 0.8, 0.99])[:, None]
    k = np.arange(0, 12)[None, :]
    values = prefix_value(r, v, k)
    gains = np.diff(values, axis=1)
    np.testing.assert_allclose(gains, prefix_marginal_gain(r, v, k[:, 1:]), atol=1e-15)
    assert np.all(np.diff(gains, axis=1) <= 1e-15)


def test_prefix_value_rejects_out_of_range_inputs():
    with pytest.raises(ValueError):
        prefix_value(1.5, 0.3, 1)
    with pytest.raises(ValueError):
        prefix_value(1.0, 0.3, -1)


# ---- allocate_prefixes -------------------------------------------------------------------------------------
def heap_allocation(r, v, budget, tie_keys=None):
    """Pop the best marginal gain ``budget`` times (ties by tie key, then k): the slow obvious reference."""
    keys = list(range(len(r))) if tie_keys is None else list(tie_keys)
    heap = [(-prefix_marginal_gain(r[i], v[i], 1), keys[i], 1, i) for i in range(len(r))]
    heapq.heapify(heap)
    counts = np.zeros(len(r), dtype=np.int64)
    for _ in range(budget):
        _, key, k, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (-prefix_marginal_gain(r[i], v[i], k + 1), key, k + 1, i))
    return counts


def test_hand_worked_allocation_and_tie():
    # gains: anchor 0 (r=1, v=0.3): 0.7, 0.21, ...; anchor 1 (r=0, v=0.3): 0.3, 0.21, ...
    r, v = np.array([1.0, 0.0]), np.array([0.3, 0.3])
    assert allocate_prefixes(r, v, 2).tolist() == [1, 1]
    assert allocate_prefixes(r, v, 3).tolist() == [2, 1]  # the 0.21 tie goes to the smaller tie key
    assert allocate_prefixes(r, v, 3, tie_keys=[5, 4]).tolist() == [1, 2]


def test_certain_outcomes_get_nothing_while_others_have_gain():
    # r=1, v=1: no continuation can fail; r=0, v=0: none can succeed
    r, v = np.array([1.0, 0.0, 1.0]), np.array([1.0, 0.0, 0.5])
    assert allocate_prefixes(r, v, 3).tolist() == [0, 0, 3]


def test_allocation_budget_edge_cases():
    assert allocate_prefixes([], [], 0).tolist() == []
    with pytest.raises(ValueError, match="no candidate anchors"):
        allocate_prefixes([], [], 3)
    with pytest.raises(ValueError):
        allocate_prefixes([1.0], [0.5], -1)
    with pytest.raises(ValueError):
        allocate_prefixes([1.0, 0.0], [0.5], 2)


probs = st.one_of(st.floats(0, 1), st.sampled_from([0.0, 0.3, 0.5, 1.0]))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), num_anchors=st.integers(1, 8), budget=st.integers(0, 40))
def test_allocation_equals_the_heap(data, num_anchors, budget):
    r = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=num_anchors, max_size=num_anchors)))
    v = np.array(data.draw(st.lists(probs, min_size=num_anchors, max_size=num_anchors)))
    keys = np.array(data.draw(st.permutations(list(range(num_anchors)))))
    counts = allocate_prefixes(r, v, budget, tie_keys=keys)
    assert counts.sum() == budget and counts.dtype == np.int64
    np.testing.assert_array_equal(counts, heap_allocation(r, v, budget, keys))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_anchors=st.integers(1, 3), budget=st.integers(0, 6))
def test_greedy_is_optimal_against_brute_force(data, num_anchors, budget):
    r = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=num_anchors, max_size=num_anchors)))
    v = np.array(data.draw(st.lists(probs, min_size=num_anchors, max_size=num_anchors)))
    best = max(prefix_value(r, v, np.array(ks)).sum()
               for ks in itertools.product(range(budget + 1), repeat=num_anchors) if sum(ks) == budget)
    assert prefix_value(r, v, allocate_prefixes(r, v, budget)).sum() == pytest.approx(best, abs=1e-12)


def test_permuting_anchors_with_their_keys_permutes_counts():
    rng = np.random.default_rng(3)
    r, v = rng.integers(0, 2, 50).astype(float), rng.choice([0.2, 0.5, 0.8], 50)
    keys = np.arange(50) * 3
    base = allocate_prefixes(r, v, 120, tie_keys=keys)
    perm = rng.permutation(50)
    np.testing.assert_array_equal(allocate_prefixes(r[perm], v[perm], 120, tie_keys=keys[perm]), base[perm])


def test_one_slowly_decaying_anchor_can_take_most_of_the_budget():
    # r=1, v=0.999: gains 0.001 * 0.999^(k-1), above every other anchor's (0.0005 at most)
    r = np.array([1.0, 1.0, 0.0])
    v = np.array([0.999, 0.9995, 0.0005])
    counts = allocate_prefixes(r, v, 500)
    np.testing.assert_array_equal(counts, heap_allocation(r, v, 500))
    assert counts[0] > 400


@pytest.mark.parametrize("budget,limit_s", [(20_000, 0.2), (100_000, 0.2), (400_000, 0.6)])
def test_hundred_thousand_anchors_are_fast(budget, limit_s):
    rng = np.random.default_rng(4)
    r, v = rng.integers(0, 2, 100_000).astype(float), rng.random(100_000)
    best = np.inf
    for _ in range(3):
        start = time.perf_counter()
        counts = allocate_prefixes(r, v, budget)
        best = min(best, time.perf_counter() - start)
    assert counts.sum() == budget
    assert best < limit_s


# ---- candidate anchors -------------------------------------------------------------------------------------
def test_candidate_anchors_are_visited_non_terminal_prefixes_with_factual_rewards():
    # rollout 1: root -> a -> b -> leaf (1); a branched once: a -> d (0); rollout 2: root -> c (one turn, 0)
    tree, ids = make_tree([(0, 0, 0), (0, 1), (1,)], [1.0, 0.0, 0.0])
    anchors = candidate_anchors(tree)
    assert anchors == [(ids[(0,)], 0.5), (ids[(0, 0)], 1.0)]  # a: mean of its leaves [1, 0]; c is terminal
    assert candidate_anchors(tree, new_only_from=[ids[(0, 0)], ids[(1,)]]) == [(ids[(0, 0)], 1.0)]


def test_truncated_trajectory_anchors_carry_reward_zero():
    tree, ids = make_tree([(0, 0)], [None])
    assert candidate_anchors(tree) == [(ids[(0,)], 0.0)]


# ---- split_expansion_budget ----------------------------------------------------------------------------------
def test_split_gives_round_m_times_n_when_integral():
    assert split_expansion_budget([8, 8, 0, 4], 20).tolist() == [8, 8, 0, 4]  # N = 1
    assert split_expansion_budget([4, 2, 2], 4).tolist() == [2, 1, 1]  # N = 0.5


def test_split_uses_largest_remainders_with_tie_keys():
    # quotas 3.5, 2.1, 1.4 -> floors 3, 2, 1, the leftover unit to the largest remainder (0.5)
    assert split_expansion_budget([5, 3, 2], 7).tolist() == [4, 2, 1]
    # equal remainders: the smaller tie key wins
    assert split_expansion_budget([3, 3, 3], 10).tolist() == [4, 3, 3]
    assert split_expansion_budget([3, 3, 3], 10, tie_keys=["c", "a", "b"]).tolist() == [3, 4, 3]


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 20), min_size=1, max_size=12), total=st.integers(0, 300))
def test_split_is_exact_and_proportional(counts, total):
    if sum(counts) == 0:
        if total:
            with pytest.raises(ValueError):
                split_expansion_budget(counts, total)
        return
    share = split_expansion_budget(counts, total)
    assert share.sum() == total
    quota = total * np.array(counts) / sum(counts)
    assert np.all(np.abs(share - quota) < 1.0)
    assert np.all(share[np.array(counts) == 0] == 0)
