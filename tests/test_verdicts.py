"""The report's verdict rule: p-values from the deciding intervals, Holm within a family, the margin words
(equivalence, non-inferiority, non-superiority) and the minimum detectable difference."""

import math

import numpy as np
import pytest

from trace.reporting.statistics import Interval, mean_interval, paired_difference
from trace.reporting.verdicts import (BETTER, EQUIVALENT, NOT_BETTER, NOT_WORSE, UNDECIDED, WORSE,
                                      deciding_bounds, deciding_p, family_verdicts, groups, holm,
                                      margin_verdict, minimum_detectable_difference, p_value, power_of,
                                      primary_margins)


def test_holm_adjusts_a_hand_worked_family():
    # sorted: d 0.005, a 0.01, c 0.03, b 0.04 (m = 4)
    # d: 4 x 0.005 = 0.02; a: max(0.02, 3 x 0.01 = 0.03) = 0.03; c: max(0.03, 2 x 0.03 = 0.06) = 0.06;
    # b: max(0.06, 1 x 0.04 = 0.04) = 0.06 (the step-down never lowers a later one). At 0.05: d and a rejected.
    # e has no interval: left out of m, stays NaN.
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005, "e": float("nan")})
    assert list(adjusted) == ["a", "b", "c", "d", "e"]
    assert [adjusted[k] for k in "abcd"] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert math.isnan(adjusted["e"])
    assert [k for k in "abcd" if adjusted[k] < 0.05] == ["a", "d"]
    assert holm({"x": 0.4, "y": 0.9}) == pytest.approx({"x": 0.8, "y": 0.9})  # 2 x 0.4; max(0.8, 0.9); capped at 1


def test_a_t_intervals_p_value_is_the_one_sample_t_test():
    from scipy.stats import ttest_1samp

    diffs = [0.012, -0.004, 0.021]
    iv = mean_interval(diffs)
    assert p_value(iv) == pytest.approx(ttest_1samp(diffs, 0.0).pvalue, rel=1e-9)
    # the interval excludes 0 exactly when p < 0.05: shift it to touch 0
    touching = Interval(iv.half_width, 0.0, 2 * iv.half_width, 3)
    assert p_value(touching) == pytest.approx(0.05, rel=1e-9)


def test_the_weaker_interval_decides_and_is_named():
    # bootstrap -0.024 [-0.045, -0.002] excludes 0; the seed t-interval [-0.053, +0.005] does not: t decides
    seed = Interval(-0.024, -0.053, 0.005, 3)
    boot = Interval(-0.024, -0.045, -0.002, 3, estimator="bootstrap", seed_interval=seed)
    p, by = deciding_p(boot)
    assert by == "t" and p == pytest.approx(p_value(seed)) and p > 0.05
    assert p_value(boot) < 0.05  # its near side: se = 0.022 / 1.96, |z| = 2.14
    # the reverse: the seed interval excludes 0, the bootstrap does not: the bootstrap decides
    seed2 = Interval(-0.03, -0.042, -0.018, 3)
    boot2 = Interval(-0.03, -0.07, 0.01, 3, estimator="bootstrap", seed_interval=seed2)
    assert deciding_p(boot2)[1] == "bootstrap" and deciding_p(boot2)[0] > 0.05
    # at their own level the deciding bounds are the hull of both intervals
    assert deciding_bounds(boot, 0.95) == pytest.approx((-0.053, 0.005))


@pytest.mark.parametrize("low, high, words", [
    (-0.015, 0.012, EQUIVALENT),   # inside (-0.02, +0.02): both one-sided tests reject
    (-0.053, 0.005, NOT_BETTER),   # excludes +0.02, reaches below -0.02: non-superior
    (-0.030, 0.030, UNDECIDED),    # reaches past both margins
    (0.025, 0.060, BETTER),        # lower end above +0.02
    (-0.050, -0.001, WORSE),       # wholly below 0
    (-0.010, 0.050, NOT_WORSE),    # excludes -0.02, reaches above +0.02: non-inferior
    (0.005, 0.015, EQUIVALENT),    # above 0 but inside the margin: equivalent, not better by delta
])
def test_the_margin_verdicts_of_hand_worked_intervals(low, high, words):
    assert margin_verdict(low, high, 0.02) == words


def test_the_primary_margins_widen_the_intervals_to_the_family_level():
    # two primary comparisons: level 1 - 0.05 / 2 = 0.975. A t-interval over 3 seeds of mean -0.005 and
    # se 0.003 has at 0.95 the half-width 4.303 x 0.003 = 0.0129 ([-0.018, +0.008]: equivalent at 0.95), at
    # 0.975 6.205 x 0.003 = 0.0186 ([-0.0236, +0.0136]: reaches past -0.02, so only non-superior)
    se = 0.003
    narrow = Interval(-0.005, -0.005 - 4.302653 * se, -0.005 + 4.302653 * se, 3)
    other = Interval(0.05, 0.03, 0.07, 3)
    arms = {"a": {"vs_grpo": {"eval mean@k": narrow}}, "b": {"vs_grpo": {"eval mean@k": other}}}
    margins = primary_margins(arms, 0.02)
    assert margin_verdict(narrow.low, narrow.high, 0.02) == EQUIVALENT
    words, low, high = margins["a"]
    assert (low, high) == pytest.approx((-0.005 - 6.205338 * se, -0.005 + 6.205338 * se), rel=1e-5)
    assert words == NOT_BETTER


def test_family_verdicts_correct_within_a_family_and_group_the_arms():
    real = lambda m: Interval(m, m - 0.01, m + 0.01, 3)  # noqa: E731  p about 0.011 (t 4.3 x 0.01/0.01 ... )
    arms = {"x": {"vs_grpo": {"eval mean@k": real(0.0105), "generated tokens": real(-5.0)}},
            "y": {"vs_grpo": {"eval mean@k": real(0.0105)}},
            "z": {"vs_grpo": {"eval mean@k": Interval(-0.2, -0.3, -0.1, 3)}}}
    verdicts = family_verdicts(arms)
    x = verdicts[("x", "vs_grpo", "eval mean@k")]
    assert x.real and x.family_size == 3 and x.p < 0.05 < x.p_adjusted  # real before correction only
    assert x.words == "real before correction only"
    tokens = verdicts[("x", "vs_grpo", "generated tokens")]
    assert tokens.family_size == 1 and tokens.words == "real after correction"  # its own family of one
    assert groups(["grpo", "x", "y", "z"], "grpo", verdicts) == {"grpo": "as grpo", "x": "as grpo",
                                                                  "y": "as grpo", "z": "below grpo"}


@pytest.mark.parametrize("num_seeds", [3, 5])
def test_the_minimum_detectable_difference_has_80_percent_power_in_a_simulated_study(num_seeds):
    # per-seed differences ~ N(d, 0.02^2); the study is a two-sided t-test at 5 % over num_seeds seeds
    sigma, rng = 0.02, np.random.default_rng(0)
    mdd = minimum_detectable_difference(sigma / math.sqrt(num_seeds), num_seeds - 1)
    from scipy.stats import t

    crit = t.ppf(0.975, num_seeds - 1)
    diffs = rng.normal(mdd, sigma, size=(4000, num_seeds))
    stat = diffs.mean(axis=1) / (diffs.std(axis=1, ddof=1) / math.sqrt(num_seeds))
    power = float(np.mean(np.abs(stat) > crit))
    assert power == pytest.approx(0.8, abs=0.1)


def test_the_normal_mdd_and_the_needed_seeds_and_questions():
    # normal: (1.960 + 0.842) x se = 2.802 x se
    assert minimum_detectable_difference(0.01, math.inf) == pytest.approx(0.028016, rel=1e-4)
    seed = paired_difference({0: 0.03, 1: 0.01, 2: 0.02}, {0: 0.0, 1: 0.0, 2: 0.0})  # sd 0.01, se 0.00577
    boot = Interval(0.02, 0.02 - 1.959964 * 0.01, 0.02 + 1.959964 * 0.01, 3, estimator="bootstrap",
                    seed_interval=seed)
    power = power_of(boot, 0.02)
    se_t = 0.01 / math.sqrt(3)
    assert power.mdd_bootstrap == pytest.approx(0.028016, rel=1e-4)
    assert power.mdd == max(power.mdd_seeds, power.mdd_bootstrap)
    # question component: sqrt(0.01^2 - se_t^2) = 0.008165; 2.802 x 0.008165 = 0.02287 -> (0.02287/0.02)^2 = 1.31
    assert power.question_se == pytest.approx(math.sqrt(1e-4 - se_t ** 2), rel=1e-6)
    assert power.questions_factor == pytest.approx((2.8016 * power.question_se / 0.02) ** 2, rel=1e-3)
    n = power.seeds_needed
    assert minimum_detectable_difference(se_t * math.sqrt(3 / n), n - 1) <= 0.02
    assert minimum_detectable_difference(se_t * math.sqrt(3 / (n - 1)), n - 2) > 0.02
