"""Means and t-intervals over seeds, paired differences, the paired bootstrap over questions and seeds, tokens to a
target, bands on a common grid."""

import math

import numpy as np
import pytest

from trace.reporting.statistics import mean_interval, paired_bootstrap, paired_difference, t_quantile, \
    tokens_to_target


def test_t_interval_of_three_seeds_is_the_textbook_one():
    # mean 0.7, s = 0.1, t_{0.975, 2} = 4.303: 0.7 +- 4.303 * 0.1 / sqrt(3) = 0.7 +- 0.2484
    iv = mean_interval([0.6, 0.7, 0.8])
    assert iv.n == 3 and iv.mean == pytest.approx(0.7)
    assert iv.half_width == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-6)
    assert (iv.low, iv.high) == pytest.approx((0.7 - 0.248414, 0.7 + 0.248414), abs=1e-6)
    assert t_quantile(3) == pytest.approx(4.302653, rel=1e-6)


def test_a_slow_loop_gives_the_same_interval():
    values = [0.31, 0.52, 0.47, 0.40, 0.38]
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = 2.776445 * sd / math.sqrt(n)  # t_{0.975, 4}
    iv = mean_interval(values)
    assert (iv.low, iv.mean, iv.high) == pytest.approx((mean - half, mean, mean + half), rel=1e-6)


def test_one_seed_has_a_mean_but_no_interval_and_nothing_is_real():
    iv = mean_interval([0.42])
    assert iv.mean == 0.42 and iv.n == 1 and not iv.has_interval
    assert math.isnan(iv.low) and math.isnan(iv.high) and not iv.excludes_zero
    empty = mean_interval([])
    assert empty.n == 0 and math.isnan(empty.mean)


def test_non_finite_values_are_left_out_of_the_sample():
    assert mean_interval([0.6, float("nan"), 0.8, float("inf")]).n == 2
    assert mean_interval([0.6, float("nan"), 0.8]).mean == pytest.approx(0.7)


def test_bad_confidence_names_the_range():
    with pytest.raises(ValueError, match=r"confidence must lie in \(0, 1\)"):
        mean_interval([0.1, 0.2], confidence=95)
    with pytest.raises(ValueError, match="at least 2 values"):
        t_quantile(1)


def test_paired_differences_pair_by_seed_and_skip_unpaired_seeds():
    # diffs at seeds 0, 1, 2: 0.1, 0.2, 0.15 -> mean 0.15, s = 0.05, half = 4.303 * 0.05 / sqrt(3) = 0.1242
    arm = {0: 0.5, 1: 0.6, 2: 0.55, 7: 0.9}
    grpo = {2: 0.4, 0: 0.4, 1: 0.4, 5: 0.0}
    iv = paired_difference(arm, grpo)
    assert iv.n == 3 and iv.mean == pytest.approx(0.15)
    assert iv.half_width == pytest.approx(4.302653 * 0.05 / math.sqrt(3), rel=1e-5)
    assert iv.excludes_zero  # 0.15 - 0.124 > 0
    noisy = paired_difference({0: 0.5, 1: 0.3, 2: 0.45}, {0: 0.4, 1: 0.4, 2: 0.4})  # diffs 0.1, -0.1, 0.05
    assert noisy.has_interval and not noisy.excludes_zero


def test_paired_differences_beat_unpaired_when_seeds_share_noise():
    # a seed effect of +-0.2 shared by both arms: the paired interval is tight, the arm's own interval wide
    arm, grpo = {0: 0.31, 1: 0.71, 2: 0.52}, {0: 0.30, 1: 0.70, 2: 0.50}
    assert paired_difference(arm, grpo).half_width < mean_interval(list(arm.values())).half_width / 10


def test_tokens_to_target_interpolates_the_first_crossing():
    # 0.3 at 100, 0.5 at 200: 0.4 is crossed halfway, at 150; the later dip and second crossing are ignored
    assert tokens_to_target([100, 200, 300, 400], [0.3, 0.5, 0.2, 0.6], 0.4) == pytest.approx(150.0)
    assert tokens_to_target([100, 200], [0.45, 0.5], 0.4) == 100.0  # reached at the first evaluation
    assert tokens_to_target([100, 200], [0.3, 0.5], 0.5) == 200.0  # reached exactly at a point
    assert tokens_to_target([100, 200], [0.3, 0.35], 0.4) is None
    assert tokens_to_target([], [], 0.4) is None
    with pytest.raises(ValueError, match="one value per evaluation"):
        tokens_to_target([1, 2], [0.1], 0.4)


def _warmup_and_grpo(fixed: int, broken: int) -> tuple[np.ndarray, np.ndarray]:
    """200 held-out questions: warmup answers questions 0..79 right (0.400); at seed s grpo breaks questions
    0..broken-1 and fixes questions 80..80+fixed+s-1, so its gain over warmup is (fixed - broken + s) / 200."""
    warmup = np.zeros(200)
    warmup[:80] = 1.0
    seeds = []
    for seed in range(3):
        row = warmup.copy()
        row[:broken] = 0.0
        row[80:80 + fixed + seed] = 1.0
        seeds.append(row)
    return np.array(seeds), warmup  # (3, 200), (200,)


def test_a_gain_the_seed_t_interval_calls_real_is_within_noise_once_questions_are_resampled():
    # grpo fixes 20-22 questions and breaks 13: gains 0.035, 0.040, 0.045 over one warmup evaluation. The
    # seed-only t-interval, 0.04 +- 4.303 * 0.005 / sqrt(3) = [+0.028, +0.052], excludes 0; but 35 of the 200
    # questions change answer, so the question sampling error of the gain is about
    # sqrt((35 / 200 - 0.04^2) / 200) = 0.029 and the bootstrap interval is about 0.04 +- 0.057
    grpo, warmup = _warmup_and_grpo(fixed=20, broken=13)
    seed_only = mean_interval((grpo - warmup).mean(axis=1).tolist())
    assert (seed_only.low, seed_only.high) == pytest.approx((0.0276, 0.0524), abs=1e-4) and seed_only.excludes_zero
    iv = paired_bootstrap(grpo, warmup)
    assert iv.estimator == "bootstrap" and iv.n == 3 and iv.mean == pytest.approx(0.04)
    assert iv.low < 0 < iv.high and not iv.excludes_zero
    assert iv.seed_interval == seed_only


def test_a_clear_gain_stays_real_under_the_bootstrap():
    # grpo fixes 40-42 questions and breaks 2: gains 0.190, 0.195, 0.200, question error about 0.03
    grpo, warmup = _warmup_and_grpo(fixed=40, broken=2)
    iv = paired_bootstrap(grpo, warmup)
    assert iv.mean == pytest.approx(0.195) and 0.1 < iv.low < iv.mean < iv.high < 0.3
    assert iv.excludes_zero


def test_a_bootstrap_interval_is_real_only_when_the_seed_t_interval_also_excludes_zero():
    # one question, ten seeds: gains with mean 0.049 and s = 0.073. The percentile bootstrap of ten values,
    # about 0.049 +- 1.96 * 0.073 * sqrt(0.9 / 10), excludes 0; the t-interval, 0.049 +- 2.262 * 0.073 /
    # sqrt(10), does not: too few seeds to call it real
    gains = np.array([0.15, -0.05, 0.10, 0.0, 0.12, -0.02, 0.09, 0.03, 0.11, -0.04])
    iv = paired_bootstrap(gains[:, None], np.zeros(1))
    assert iv.low > 0 and iv.seed_interval.low < 0
    assert not iv.excludes_zero


def test_paired_bootstrap_matches_a_slow_loop_over_the_drawn_seeds_and_questions():
    rng = np.random.default_rng(3)
    arm, base = rng.random((3, 7)), rng.random((3, 7))
    iv = paired_bootstrap(arm, base, num_resamples=400, rng_seed=11)
    draws = np.random.default_rng(11)  # the same draws, in the same order: seeds, then questions
    seed_idx, question_idx = draws.integers(0, 3, size=(400, 3)), draws.integers(0, 7, size=(400, 7))
    means = []
    for seeds, questions in zip(seed_idx, question_idx):
        cells = [arm[s, q] - base[s, q] for s in seeds for q in questions]
        means.append(sum(cells) / len(cells))
    assert (iv.low, iv.high) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])), abs=1e-12)
    assert iv.mean == pytest.approx(float((arm - base).mean()))


def test_paired_bootstrap_is_deterministic_and_needs_two_seeds_for_an_interval():
    grpo, warmup = _warmup_and_grpo(fixed=20, broken=13)
    assert paired_bootstrap(grpo, warmup) == paired_bootstrap(grpo, warmup)
    one = paired_bootstrap(grpo[:1], warmup)
    assert one.n == 1 and one.mean == pytest.approx(0.035) and not one.has_interval and not one.excludes_zero


def test_paired_bootstrap_names_what_does_not_line_up():
    with pytest.raises(ValueError, match=r"baseline must be \(seeds, questions\) = \(3, 200\)"):
        paired_bootstrap(np.zeros((3, 200)), np.zeros(199))
    with pytest.raises(ValueError, match="values must be"):
        paired_bootstrap(np.zeros(200), np.zeros(200))
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap(np.full((2, 2), np.nan), np.zeros(2))


def test_a_seed_that_never_reaches_the_target_is_censored_not_dropped():
    from trace.reporting.statistics import tokens_to_target_censored

    curves = {0: ([100, 200, 300], [0.50, 0.60, 0.70]),   # crosses 0.55 halfway: 150
              1: ([100, 200, 300], [0.52, 0.58, 0.65]),   # 100 + (0.55 - 0.52) / 0.06 x 100 = 150
              2: ([100, 200, 300], [0.50, 0.52, 0.54])}   # never: censored at its last 300 tokens
    hits = tokens_to_target_censored(curves, 0.55)
    assert hits.reached == pytest.approx({0: 150.0, 1: 150.0}) and hits.censored == {2: 300.0}
    assert hits.num_seeds == 3
    # ordered 150, 150, (censored above every crossing): the middle one is 150
    assert hits.median == pytest.approx(150.0)
    # two of three censored: the median lies beyond the runs
    curves[1] = ([100, 200, 300], [0.50, 0.51, 0.52])
    late = tokens_to_target_censored(curves, 0.55)
    assert late.censored == {1: 300.0, 2: 300.0} and math.isnan(late.median)


def test_the_target_is_half_the_baselines_gain_and_a_degenerate_one_is_refused():
    from trace.reporting.statistics import crossing_target, target_refusal

    # warmup 0.43, grpo finals 0.52 / 0.54 / 0.56 (mean 0.54): 0.43 + 0.11 / 2 = 0.485
    assert crossing_target(0.43, [0.52, 0.54, 0.56]) == pytest.approx(0.485)
    assert crossing_target(0.43, [0.52], declared=0.50) == 0.50
    assert target_refusal(0.485, 0.43, [16, 16, 16]) is None
    # the all-arms run: grpo's final 0.650 below the warmup's 0.670, evaluations at steps 9 and 19 only
    below = target_refusal(crossing_target(0.67, [0.65]), 0.67, [2, 2, 2])
    assert below is not None and "at or below the warmup's 0.670" in below
    few = target_refusal(0.70, 0.67, [2, 5])
    assert few is not None and "2 in-training evaluations, fewer than 3" in few
    assert "no target" in target_refusal(crossing_target(0.67, []), 0.67, [5])
