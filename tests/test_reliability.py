"""Reliability diagrams against Monte-Carlo truth: each audit's bins as step metrics, pooled exactly over audits
and seeds, drawn into the report and the run's MLflow images."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest

from trace.predictor.ground_truth import reliability_diagram
from trace.predictor.calibration import expected_calibration_error
from trace.predictor.reliability import audit_diagrams, calibration_noise, debiased_ece_difference, diagram_ece, \
    diagram_metrics, draw_reliability, history_diagram, is_diagram_key, pool_diagrams, pooled_ece_interval


def _audit(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pred = rng.uniform(0, 1, n)
    weight = rng.integers(1, 17, n).astype(float)
    rate = rng.binomial(weight.astype(int), np.clip(pred * 0.7 + 0.1, 0, 1)) / weight
    return pred, rate, weight


def _history(audits: dict[int, tuple], stage: str = "prefix") -> dict[str, list[tuple[int, float]]]:
    history: dict[str, list[tuple[int, float]]] = {"truth/prefix_ece": [(s, 0.1) for s in audits]}
    for step, (pred, rate, weight) in audits.items():
        for key, value in diagram_metrics(stage, reliability_diagram(pred, rate, weight, 10), 10).items():
            history.setdefault(key, []).append((step, value))
    return history


def _close(rows, expected) -> None:
    assert [r["lower"] for r in rows] == [r["lower"] for r in expected]
    for got, want in zip(rows, expected):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_pooling_the_audits_of_a_run_is_the_diagram_of_their_union():
    rng = np.random.default_rng(3)
    audits = {10: _audit(rng, 40), 20: _audit(rng, 25), 30: _audit(rng, 60)}
    union = [np.concatenate([a[i] for a in audits.values()]) for i in range(3)]
    _close(history_diagram(_history(audits), "prefix"), reliability_diagram(*union, num_bins=10))
    assert history_diagram(_history(audits), "root") == []  # the other stage: nothing audited


def test_each_audit_is_its_own_diagram_and_they_pool_to_the_runs():
    rng = np.random.default_rng(4)
    audits = {30: _audit(rng, 40), 10: _audit(rng, 25), 20: _audit(rng, 60)}
    per_audit = audit_diagrams(_history(audits), "prefix")
    assert len(per_audit) == 3
    for rows, step in zip(per_audit, (10, 20, 30)):  # in step order
        _close(rows, reliability_diagram(*audits[step], num_bins=10))
    _close(pool_diagrams(per_audit), history_diagram(_history(audits), "prefix"))
    assert audit_diagrams(_history(audits), "root") == []


def test_the_pooled_ece_interval_resamples_runs_then_their_audits():
    rng = np.random.default_rng(6)
    runs = [audit_diagrams(_history({s: _audit(rng, 30) for s in range(6)}), "prefix") for _ in range(3)]
    point = diagram_ece(pool_diagrams(d for run in runs for d in run))
    low, high = pooled_ece_interval(runs, resamples=500)
    assert low < point < high and high - low > 0.01
    assert pooled_ece_interval(runs, resamples=500) == (low, high)  # deterministic
    # audits that agree leave nothing to resample: the interval is the point
    same = [[runs[0][0]] * 3] * 3
    assert pooled_ece_interval(same, resamples=200) == pytest.approx((diagram_ece(runs[0][0]),) * 2)
    # runs that disagree (one over-, one under-confident, each consistent within) widen it; pooling the same audits
    # as one run hides that spread
    shifted = [[[{**r, "realised_rate": min(1.0, max(0.0, r["realised_rate"] + shift))} for r in d] for d in run]
               for run, shift in zip(runs[:2], (0.25, -0.25))]
    between, as_one = pooled_ece_interval(shifted, resamples=500), pooled_ece_interval([sum(shifted, [])],
                                                                                       resamples=500)
    assert between[1] - between[0] > 1.5 * (as_one[1] - as_one[0])
    assert all(math.isnan(x) for x in pooled_ece_interval([runs[0][:1], []]))


def test_pooling_seeds_is_the_diagram_of_every_seed_together():
    rng = np.random.default_rng(5)
    seeds = [{10: _audit(rng, 30), 20: _audit(rng, 30)} for _ in range(3)]
    union = [np.concatenate([a[i] for s in seeds for a in s.values()]) for i in range(3)]
    pooled = pool_diagrams(history_diagram(_history(s), "prefix") for s in seeds)
    _close(pooled, reliability_diagram(*union, num_bins=10))
    assert sum(r["count"] for r in pooled) == union[2].sum()


def test_the_pooled_ece_is_the_ece_of_the_union_and_below_the_mean_of_per_audit_eces_of_a_calibrated_predictor():
    rng = np.random.default_rng(11)
    audits = {}
    for step in range(40):  # calibrated but unsharp: x ~ Beta(2p, 2(1 - p)), 16 outcomes each, 32 items an audit
        p = rng.uniform(0.02, 0.98, 32)
        x = rng.beta(2 * p, 2 * (1 - p))
        audits[step] = (p, rng.binomial(16, x) / 16, np.full(32, 16.0))
    union = [np.concatenate([a[i] for a in audits.values()]) for i in range(3)]
    pooled = history_diagram(_history(audits), "prefix")
    assert diagram_ece(pooled) == pytest.approx(expected_calibration_error(*union, num_bins=10), rel=1e-9)
    per_audit = np.mean([expected_calibration_error(*a, num_bins=10) for a in audits.values()])
    assert diagram_ece(pooled) < 0.05 < per_audit  # the per-audit mean reads the items' scatter as miscalibration
    assert np.isnan(diagram_ece([]))


def _seed_audits(rng: np.random.Generator, seeds: int, gap: float, high: float = 0.85) -> dict[int, list]:
    """seed -> its 8 audits' diagrams, each of 32 items with forecasts uniform in [0.05, ``high``] and 16 outcomes:
    true probabilities scattered around the forecast (Beta with mean ``forecast + gap``, clipped), a predictor
    calibrated when ``gap`` is 0."""
    out = {}
    for seed in range(seeds):
        history = {}
        for step in range(8):
            p = rng.uniform(0.05, high, 32)
            mean = np.clip(p + gap, 0.01, 0.99)
            history[step] = (p, rng.binomial(16, rng.beta(4 * mean, 4 * (1 - mean))) / 16, np.full(32, 16.0))
        out[seed] = audit_diagrams(_history(history), "prefix")
    return out


def _seed_diagrams(rng: np.random.Generator, seeds: int, gap: float = 0.0) -> list[list[dict]]:
    """Each seed's pooled diagram (``_seed_audits`` with forecasts up to 0.95)."""
    return [pool_diagrams(audits) for audits in _seed_audits(rng, seeds, gap, high=0.95).values()]


def test_the_floor_is_what_a_calibrated_predictor_reads_and_the_debiased_ece_removes_it():
    rng = np.random.default_rng(12)
    calibrated = [calibration_noise(_seed_diagrams(rng, 6)) for _ in range(40)]
    pooled = np.mean([c["pooled"] for c in calibrated])
    floor = np.mean([c["floor"] for c in calibrated])
    debiased = np.mean([c["debiased"] for c in calibrated])
    assert pooled > 0.01  # noise alone reads as miscalibration
    assert floor == pytest.approx(pooled, rel=0.15)  # the floor predicts it
    assert debiased < 0.6 * pooled  # and the debiased ECE takes half of it out or more
    # a predictor whose forecasts are 0.1 too low everywhere: the debiased ECE reads the gap, the pooled one above it
    low = [calibration_noise(_seed_diagrams(rng, 6, gap=0.1)) for _ in range(20)]
    assert np.mean([c["debiased"] for c in low]) == pytest.approx(0.1, abs=0.015)
    assert np.mean([c["pooled"] for c in low]) > np.mean([c["debiased"] for c in low])
    # the floor falls about as 1 / sqrt(seeds): one seed's noise is the per-seed ECE's
    four, sixteen = (np.mean([calibration_noise(_seed_diagrams(rng, n))["floor"] for _ in range(10)]) for n in (4, 16))
    assert four / sixteen == pytest.approx(2.0, rel=0.25)


def test_calibration_noise_pools_like_diagram_ece_and_needs_two_runs():
    rng = np.random.default_rng(13)
    runs = _seed_diagrams(rng, 3, gap=0.05)
    noise = calibration_noise(runs)
    assert noise["pooled"] == pytest.approx(diagram_ece(pool_diagrams(runs)), rel=1e-12)
    assert 0 < noise["floor"] and 0 <= noise["debiased"] <= noise["pooled"]
    one = calibration_noise(runs[:1] + [[]])  # an empty run is dropped; one run has no spread to measure
    assert one["pooled"] == pytest.approx(diagram_ece(runs[0])) and math.isnan(one["floor"])
    assert math.isnan(one["debiased"]) and all(math.isnan(v) for v in calibration_noise([]).values())
    # identical runs: no spread, nothing to remove
    same = calibration_noise([runs[0]] * 3)
    assert same["floor"] == pytest.approx(0, abs=1e-12) and same["debiased"] == pytest.approx(same["pooled"])


def test_the_debiased_ece_interval_resamples_seeds_and_covers_the_true_gap():
    rng = np.random.default_rng(14)
    audits = list(_seed_audits(rng, 6, 0.1).values())  # forecasts 0.1 too low
    low, high = pooled_ece_interval(audits, resamples=400, debiased=True)
    point = calibration_noise([pool_diagrams(a) for a in audits])["debiased"]
    assert low < point < high and low < 0.1 < high
    plain = pooled_ece_interval(audits, resamples=400)
    assert plain[0] > low  # the pooled ECE's interval sits higher: noise adds to it
    assert pooled_ece_interval(audits, resamples=400, debiased=True) == (low, high)
    assert all(math.isnan(x) for x in pooled_ece_interval(audits[:1], debiased=True))


def test_the_paired_debiased_difference_draws_the_seeds_once_for_both_arms():
    rng = np.random.default_rng(15)
    calibrated, off = _seed_audits(rng, 6, 0.0), _seed_audits(rng, 6, 0.08)
    result = debiased_ece_difference(off, calibrated, resamples=300)
    assert result["seeds"] == 6 and result["difference"] == pytest.approx(result["a"] - result["b"])
    assert result["a"] == pytest.approx(calibration_noise([pool_diagrams(off[s]) for s in range(6)])["debiased"])
    assert 0.04 < result["low"] < result["difference"] < result["high"]  # 0.08 off: the interval excludes 0
    same = debiased_ece_difference(calibrated, calibrated, resamples=300)
    assert same["difference"] == 0 and same["low"] < 0 < same["high"]  # each arm's audits resampled apart
    # seeds that differ (half of them 0.15 off) move both arms alike: drawn once for both, the difference's
    # interval is far narrower than either arm's own (drawn apart, it would be about sqrt(2) times wider)
    mixed = {**{s: _seed_audits(np.random.default_rng(s), 1, 0.15 * (s % 2))[0] for s in range(6)}}
    paired = debiased_ece_difference(mixed, mixed, resamples=300)
    own_low, own_high = pooled_ece_interval(list(mixed.values()), resamples=300, debiased=True)
    assert paired["high"] - paired["low"] < 0.6 * (own_high - own_low)
    # only common seeds count; fewer than two: nothing to say
    assert debiased_ece_difference(off, {0: calibrated[0], 9: calibrated[1]}, resamples=10)["seeds"] == 1
    assert math.isnan(debiased_ece_difference(off, {0: calibrated[0]}, resamples=10)["low"])


def test_the_bin_metrics_name_the_stage_and_the_bin_and_refuse_an_unknown_stage():
    rows = reliability_diagram([0.05, 0.95, 0.97], [0.0, 1.0, 0.5], [4, 2, 2], 10)
    metrics = diagram_metrics("root", rows, 10)
    assert metrics == {"truth/root_bin00_outcomes": 4.0, "truth/root_bin00_forecast": 0.05,
                       "truth/root_bin00_realised": 0.0, "truth/root_bin09_outcomes": 4.0,
                       "truth/root_bin09_forecast": pytest.approx(0.96), "truth/root_bin09_realised": 0.75}
    assert all(is_diagram_key(k) for k in metrics) and not is_diagram_key("truth/root_ece")
    with pytest.raises(ValueError, match="stage 'leaf'"):
        diagram_metrics("leaf", rows, 10)


def test_the_audit_logs_its_diagrams_as_bin_metrics():
    from trace.predictor.ground_truth import MonteCarloTruth, TruthSample, score_forecasts

    truth = TruthSample(roots=MonteCarloTruth.from_rewards([np.array([1, 0, 0, 0.0]), np.array([1, 1, 1, 0.0])]),
                        prefixes=MonteCarloTruth.from_rewards([np.array([1, 1.0])]), num_rollouts=10, num_tokens=30)
    metrics, diagrams = score_forecasts([0.15, 0.82], truth, [0.5])
    assert metrics["truth/root_bin01_realised"] == 0.25 and metrics["truth/root_bin08_outcomes"] == 4.0
    assert metrics["truth/prefix_bin05_forecast"] == 0.5 and metrics["truth/prefix_bin05_realised"] == 1.0
    assert history_diagram({k: [(0, v)] for k, v in metrics.items()}, "root") == diagrams["root"]


def test_draw_reliability_writes_a_png_or_returns_the_figure(tmp_path: Path):
    rows = reliability_diagram([0.1, 0.5, 0.9], [0.0, 0.5, 1.0], [8, 8, 8], 10)
    path = tmp_path / "r.png"
    assert draw_reliability({"trace": {"root": rows, "prefix": []}}, path) is None
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 5000
    fig = draw_reliability({"trace": {"root": rows, "prefix": rows}})
    assert fig.axes[0].get_title() == "roots" and len(fig.axes) == 2
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---- the report and the train flow -----------------------------------------------------------------------------
def _with_diagrams(results: dict) -> dict:
    rng = np.random.default_rng(0)
    out = copy.deepcopy(results)
    for res in out["trace"].values():
        res["history"].update(_history({1: _audit(rng, 20), 2: _audit(rng, 20)}, "root"))
    return out


def test_the_report_pools_each_arms_diagrams_and_draws_them(tmp_path: Path):
    from tests.test_report_markdown import THREE_SEEDS
    from trace.reporting.report import arm_statistics
    from trace.reporting.report_json import metrics_table
    from trace.reporting.report_markdown import render_markdown
    from trace.reporting.report_plots import RELIABILITY_PLOT, write_plots

    results = _with_diagrams(THREE_SEEDS)
    stats = arm_statistics(results, 2)["arms"]
    assert stats["grpo"]["reliability"] is None
    expected = pool_diagrams(history_diagram(r["history"], "root") for r in results["trace"].values())
    assert stats["trace"]["reliability"]["root"] == expected and stats["trace"]["reliability"]["prefix"] == []
    assert sum(r["count"] for r in expected) > 0
    text = render_markdown(results, {}, 2)
    first = expected[0]
    seeds = {s: diagram_ece(history_diagram(r["history"], "root")) for s, r in results["trace"].items()}
    assert stats["trace"]["pooled_ece_seeds"]["root"] == seeds
    low, high = pooled_ece_interval([audit_diagrams(r["history"], "root") for r in results["trace"].values()])
    assert stats["trace"]["pooled_ece_interval"]["root"] == (low, high) and low < diagram_ece(expected) < high
    noise = stats["trace"]["ece_noise"]["root"]
    assert noise["debiased_interval"] == pooled_ece_interval([audit_diagrams(r["history"], "root")
                                                              for r in results["trace"].values()], debiased=True)
    assert {k: noise[k] for k in ("floor", "debiased")} == {
        k: v for k, v in calibration_noise([history_diagram(r["history"], "root") for r in results["trace"].values()]
                                           ).items() if k != "pooled"}
    dlow, dhigh = noise["debiased_interval"]
    assert (f"| trace | root | {diagram_ece(expected):.3f} [{low:.3f}, {high:.3f}] | {noise['floor']:.3f} | "
            f"{noise['debiased']:.3f} [{dlow:.3f}, {dhigh:.3f}] | s0 {seeds[0]:.3f}, "
            f"s1 {seeds[1]:.3f}, s2 {seeds[2]:.3f} | "
            f"{first['mean_forecast']:.2f} -> "
            f"{first['realised_rate']:.2f} ({first['count']:,.0f});" in text)
    table = metrics_table(results, 2)["trace"]
    assert table["reliability"]["root"][0]["count"] == first["count"]
    assert table["pooled_ece"] == {"root": pytest.approx(diagram_ece(expected)), "prefix": None}
    assert table["pooled_ece_seeds"]["root"] == {f"s{s}": pytest.approx(v) for s, v in seeds.items()}
    assert table["pooled_ece_interval"] == {"root": {"low": low, "high": high}, "prefix": {"low": None, "high": None}}
    assert table["ece_floor"]["root"] == pytest.approx(noise["floor"]) and table["ece_floor"]["prefix"] is None
    assert table["debiased_ece_interval"]["root"] == {"low": dlow, "high": dhigh}
    from trace.predictor.reliability import expand_rows
    kept = {s: [expand_rows(rows) for rows in audits] for s, audits in table["audit_diagrams"]["root"].items()}
    assert kept == {f"s{s}": [[{k: r[k] for k in ("lower", "count", "mean_forecast", "realised_rate")} for r in rows]
                              for rows in audit_diagrams(res["history"], "root")] for s, res in results["trace"].items()}
    assert RELIABILITY_PLOT in [p.name for p in write_plots(results, tmp_path)]
    assert RELIABILITY_PLOT not in [p.name for p in write_plots(THREE_SEEDS, tmp_path)]  # stale one removed
    assert not (tmp_path / RELIABILITY_PLOT).exists()


class _Client:
    def __init__(self):
        self.figures = []

    def log_figure(self, run_id, figure, artifact_file):
        self.figures.append((run_id, artifact_file, [ax.get_title() for ax in figure.axes]))


class _Run:
    run_id = "r1"

    def __init__(self):
        self.client = _Client()


def test_the_train_flow_logs_the_runs_pooled_diagram_as_an_mlflow_image():
    from flows.train import log_reliability

    rng = np.random.default_rng(1)
    history = [{"step": step, "loss": 0.1, **{k: v for k, pts in _history({step: _audit(rng, 20)}).items()
                                              for s, v in pts if s == step}} for step in (10, 20)]
    run = _Run()
    assert log_reliability(run, history, "trace")
    assert run.client.figures == [("r1", "truth/reliability.png", ["roots: 2 audits", "prefixes: 2 audits"])]
    assert not log_reliability(run, [{"step": 0, "loss": 0.1}], "grpo") and len(run.client.figures) == 1
