"""predictor.recalibrate: the allocator reads forecasts recalibrated online against the window's outcomes
(trace.training.recalibration)."""

from __future__ import annotations

import numpy as np
import pytest

from trace.predictor.forecast import ForecastModel
from trace.training.recalibration import RecalibratedSampler, compose, last_maps, map_metrics, step_maps
from trace.tree import Origin, RolloutTree


def _root_group(name: str, p: float, rewards) -> RolloutTree:
    tree = RolloutTree(tree_id=f"t/{name}", prompt_uid=f"u/{name}", data_source="toy", example_id=name)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
    tree.nodes[0].pred_success_prob = p
    for reward in rewards:
        tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, reward=float(reward))
    return tree


def _logit(x):
    x = np.asarray(x, dtype=np.float64)
    return np.log(x / (1 - x))


def test_composing_two_maps_is_applying_one_after_the_other():
    inner, outer = ForecastModel(0.3, 0.8), ForecastModel(-0.5, 1.4, kappa=7.0, num_items=12)
    p = np.array([0.05, 0.3, 0.5, 0.9])
    both = compose(outer, inner)
    assert both.mean(p) == pytest.approx(outer.mean(inner.mean(p)), rel=1e-12)
    assert _logit(both.mean(p)) == pytest.approx(-0.5 + 1.4 * (0.3 + 0.8 * _logit(p)), rel=1e-9)
    assert (both.kappa, both.num_items) == (7.0, 12)
    assert compose(ForecastModel(), inner).mean(p) == pytest.approx(inner.mean(p))


def test_the_previous_map_is_read_back_from_the_last_step_that_logged_it():
    assert all(m == ForecastModel() for m in last_maps([]).values())
    history = [{"step": 0, **map_metrics({"root": ForecastModel(0.1, 0.9), "prefix": ForecastModel(0.2, 1.1)})},
               {"step": 1, "loss": 0.3},
               {"step": 2, **map_metrics({"root": ForecastModel(-0.4, 0.7), "prefix": ForecastModel(0.0, 1.3)})},
               {"step": 3, "loss": 0.2}]
    maps = last_maps(history)
    assert (maps["root"].alpha, maps["root"].beta, maps["prefix"].beta) == (-0.4, 0.7, 1.3)


def test_the_recalibrated_forecasts_are_calibrated_where_the_predictors_are_not():
    # the predictor forecasts p; the truth is sigmoid(-1 + 0.5 logit p): too optimistic and too sharp
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.95, 600)
    x = 1 / (1 + np.exp(-(-1.0 + 0.5 * _logit(p))))
    trees = [_root_group(str(i), float(pi), rng.binomial(1, xi, 8)) for i, (pi, xi) in enumerate(zip(p, x))]
    maps, corrections = step_maps([], trees)
    assert maps["root"].alpha == pytest.approx(-1.0, abs=0.2) and maps["root"].beta == pytest.approx(0.5, abs=0.1)
    assert corrections["prefix"] == ForecastModel()  # no anchors: the identity, unfitted
    fresh = rng.uniform(0.05, 0.95, 2000)
    truth = 1 / (1 + np.exp(-(-1.0 + 0.5 * _logit(fresh))))
    assert np.abs(maps["root"].mean(fresh) - truth).mean() < 0.03 < np.abs(fresh - truth).mean()
    # the next step composes on the map before: calibrated forecasts need no further correction
    history = [{"step": 0, **map_metrics(maps)}]
    stored = [_root_group(str(i), float(q), rng.binomial(1, xi, 8))
              for i, (q, xi) in enumerate(zip(maps["root"].mean(p), x))]
    again, correction = step_maps(history, stored)
    assert correction["root"].alpha == pytest.approx(0.0, abs=0.2)
    assert correction["root"].beta == pytest.approx(1.0, abs=0.2)
    assert again["root"].mean(fresh) == pytest.approx(maps["root"].mean(fresh), abs=0.05)


class _Base:
    rollouts = 7

    def score_prompts(self, prompts):
        return np.array([0.2, 0.6])

    def score_anchors(self, trees, node_ids):
        return [np.array([0.1, 0.9]), np.array([0.5])]

    def sample_roots(self, prompts, counts, salt):
        return ["sampled", salt]


def test_the_sampler_maps_both_stages_scores_and_samples_as_its_base():
    maps = {"root": ForecastModel(0.5, 1.0), "prefix": ForecastModel(-1.0, 2.0)}
    sampler = RecalibratedSampler(_Base(), maps)
    assert sampler.score_prompts(["a", "b"]) == pytest.approx(maps["root"].mean([0.2, 0.6]))
    anchors = sampler.score_anchors(None, None)
    assert anchors[0] == pytest.approx(maps["prefix"].mean([0.1, 0.9])) and len(anchors) == 2
    assert sampler.sample_roots([], [], "roots") == ["sampled", "roots"] and sampler.rollouts == 7


def test_recalibration_off_keeps_the_params_hash_and_on_changes_it():
    from trace.configuration.config import Config, config_from_dict

    assert Config().predictor.recalibrate is False
    assert config_from_dict({"predictor": {"recalibrate": False}}).params_hash() == Config().params_hash()
    assert config_from_dict({"predictor": {"recalibrate": True}}).params_hash() != Config().params_hash()


@pytest.mark.slow
def test_a_recalibrated_run_reads_the_mapped_forecasts_and_resumes_with_the_same_maps(tmp_path, monkeypatch):
    # the tiny policy never succeeds, so every fit is the identity: a fixed correction G stands in for the fit,
    # and F_t = G o F_{t-1} must then compose step after step, also across a resume
    import trace.training.recalibration as recalibration
    from tests.test_loop import tiny_trainer
    from trace.tree_io import read_trees, tree_path

    correction = ForecastModel(0.3, 0.8, kappa=5.0, num_items=10)
    monkeypatch.setattr(recalibration, "fit_forecast_model", lambda *a, **k: correction)
    over = {"predictor.recalibrate": True, "train.checkpoint_every": 2, "train.num_steps": 4}
    runs = {}
    for on in (False, True):
        trainer = tiny_trainer("trace", tmp_path / f"whole{on}", {**over, "predictor.recalibrate": on})
        runs[on] = (trainer, trainer.run())
    off, on = runs[False][1], runs[True][1]
    assert not any(k.startswith("recalibration/") for k in off[0])
    expected = ForecastModel()
    for metrics in on:
        expected = compose(correction, expected)
        assert metrics["recalibration/root_alpha"] == pytest.approx(expected.alpha)
        assert metrics["recalibration/prefix_beta"] == pytest.approx(expected.beta)
    # step 0: the same predictor in both runs; the recalibrated run's roots hold F_0 of the forecasts it read
    read = lambda on_, step: {t.prompt_uid: t.nodes[0].pred_success_prob  # noqa: E731
                              for t in read_trees(tree_path(runs[on_][0].trees_root, "trace", step))}
    raw, mapped = read(False, 0), read(True, 0)
    shared = sorted(set(raw) & set(mapped))
    assert shared and [mapped[u] for u in shared] == pytest.approx(correction.mean([raw[u] for u in shared]))
    # an interrupted run (steps 0-1, then resumed) reads F_1 back from its history and continues the composition
    tiny_trainer("trace", tmp_path / "cut", over).run(until_step=2)  # checkpointed after step 1
    resumed = tiny_trainer("trace", tmp_path / "cut", over)
    assert resumed.resume() == 2
    again = resumed.run()
    for a, b in zip(again, on[2:]):
        assert {k: v for k, v in a.items() if k.startswith("recalibration/")} == pytest.approx(
            {k: v for k, v in b.items() if k.startswith("recalibration/")})
