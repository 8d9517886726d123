"""predictor.recalibrate: the allocator reads forecasts recalibrated online against the window's outcomes
(trace.training.recalibration)."""

from __future__ import annotations

import numpy as np
import pytest

from trace.predictor.forecast import ForecastModel
from trace.training.recalibration import KNOTS, IsotonicMap, RecalibratedSampler, candidate_outcomes, \
    fit_isotonic_map, invert, logged_maps, map_metrics, step_maps
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


def test_invert_reads_the_predictors_forecast_back_through_a_map():
    model = ForecastModel(-0.5, 1.4, kappa=7.0)
    p = np.array([0.02, 0.3, 0.5, 0.9, 0.98])
    assert invert(model, model.mean(p)) == pytest.approx(p, rel=1e-9)
    assert invert(ForecastModel(), p) == pytest.approx(p)
    assert np.isnan(invert(ForecastModel(0.3, 0.0), [0.4, 0.6])).all()  # a flat map: nothing to read back


def test_an_isotonic_map_is_read_back_exactly_and_logged_by_its_knots():
    model = IsotonicMap(tuple(0.1 + 0.05 * x + (0.6 * x if x > 0.4 else 0.0) for x in KNOTS))
    p = np.array([0.0, 0.03, 0.35, 0.45, 0.9, 1.0])
    assert invert(model, model.mean(p)) == pytest.approx(p, abs=1e-12)
    assert invert(IsotonicMap(), p) == pytest.approx(p)
    history = [{"step": 3, **map_metrics({"root": model, "prefix": ForecastModel(0.2, 1.1)})}]
    assert "recalibration/root_knot10" in history[0] and "recalibration/root_alpha" not in history[0]
    maps = logged_maps(history)[3]
    assert maps["root"].values == pytest.approx(model.values) and maps["prefix"] == ForecastModel(0.2, 1.1)


def test_the_maps_of_earlier_steps_are_read_back_from_the_history():
    assert logged_maps([]) == {}
    history = [{"step": 0, **map_metrics({"root": ForecastModel(0.1, 0.9), "prefix": ForecastModel(0.2, 1.1)})},
               {"step": 1, "loss": 0.3},
               {"step": 2, **map_metrics({"root": ForecastModel(-0.4, 0.7), "prefix": ForecastModel(0.0, 1.3)})}]
    maps = logged_maps(history)
    assert sorted(maps) == [0, 2] and (maps[2]["root"].alpha, maps[2]["root"].beta, maps[0]["prefix"].beta) == (
        -0.4, 0.7, 1.1)


def _truth(p, alpha=-1.0, beta=0.5):
    return 1 / (1 + np.exp(-(alpha + beta * _logit(p))))


def _step_trees(rng, step, maps, n=64):
    p = rng.uniform(0.05, 0.95, n)
    stored = maps["root"].mean(p)
    trees = [_root_group(f"{step}-{i}", float(q), rng.binomial(1, x, 8)) for i, (q, x) in enumerate(zip(stored, _truth(p)))]
    for tree in trees:
        tree.step = step
    return trees


def test_the_recalibrated_forecasts_are_calibrated_where_the_predictors_are_not():
    # the predictor forecasts p; the truth is sigmoid(-1 + 0.5 logit p): too optimistic and too sharp
    rng = np.random.default_rng(0)
    trees = _step_trees(rng, 0, {"root": ForecastModel()}, n=600)
    maps = step_maps({}, trees)
    assert maps["root"].alpha == pytest.approx(-1.0, abs=0.2) and maps["root"].beta == pytest.approx(0.5, abs=0.1)
    assert maps["prefix"] == ForecastModel()  # no anchors: the identity, unfitted
    fresh = rng.uniform(0.05, 0.95, 2000)
    assert np.abs(maps["root"].mean(fresh) - _truth(fresh)).mean() < 0.03 < np.abs(fresh - _truth(fresh)).mean()
    # trees that stored the mapped forecasts are read back through their step's map: the same fit, no drift
    stored = _step_trees(rng, 1, maps, n=600)
    again = step_maps({1: maps}, stored)
    assert again["root"].alpha == pytest.approx(-1.0, abs=0.2) and again["root"].beta == pytest.approx(0.5, abs=0.1)
    # read as if unmapped, the same trees would ask for a second correction on top of the first
    assert step_maps({}, stored)["root"].beta == pytest.approx(1.0, abs=0.25)


@pytest.mark.parametrize("window", [2, 8])
def test_the_map_stays_at_the_truth_step_after_step_with_a_window_of_several_steps(window):
    rng = np.random.default_rng(window)
    used, trees, alphas, betas = {}, [], [], []
    for step in range(30):
        previous = [t for t in trees if t.step >= step - window]
        maps = used[step] = step_maps(used, previous)
        trees += _step_trees(rng, step, maps)
        alphas.append(maps["root"].alpha)
        betas.append(maps["root"].beta)
    # from step 3 on the fit has data; it neither oscillates away from the truth nor collapses to a flat map
    assert np.abs(np.array(alphas[3:]) + 1.0).max() < 0.5 and np.abs(np.array(betas[3:]) - 0.5).max() < 0.25


def _step_truth(p):
    """A truth with a step that no logistic map follows: 0.15 below a forecast of 0.4, then 0.2 + 0.7 p."""
    p = np.asarray(p, dtype=np.float64)
    return np.where(p < 0.4, 0.15, 0.2 + 0.7 * p)


def test_the_isotonic_map_follows_a_step_that_the_logistic_map_cannot():
    rng = np.random.default_rng(5)
    p = rng.uniform(0.02, 0.98, 800)
    trees = [_root_group(str(i), float(pi), rng.binomial(1, x, 8)) for i, (pi, x) in enumerate(zip(p, _step_truth(p)))]
    for tree in trees:
        tree.step = 0
    isotonic, platt = step_maps({}, trees, "isotonic")["root"], step_maps({}, trees, "platt")["root"]
    fresh = rng.uniform(0.02, 0.98, 4000)
    error = {name: np.abs(m.mean(fresh) - _step_truth(fresh)).mean() for name, m in (("iso", isotonic), ("platt", platt))}
    assert error["iso"] < 0.03 < error["platt"], error
    assert isotonic.num_items == 800 and 1 < isotonic.kappa < np.inf  # the spread around the mapped forecasts
    assert np.all(np.diff(isotonic.values) > 0)  # strictly increasing: invertible
    assert step_maps({}, trees[:5], "isotonic")["root"] == IsotonicMap()  # too few items: the identity
    with pytest.raises(ValueError, match="recalibrate_map"):
        step_maps({}, trees, "beta")


def test_the_isotonic_map_stays_at_the_truth_step_after_step():
    rng = np.random.default_rng(11)
    used, trees, errors = {}, [], []
    grid = np.linspace(0.05, 0.95, 19)
    for step in range(20):
        maps = used[step] = step_maps(used, [t for t in trees if t.step >= step - 8], "isotonic")
        p = rng.uniform(0.05, 0.95, 64)
        for i, (q, x) in enumerate(zip(maps["root"].mean(p), _step_truth(p))):
            tree = _root_group(f"{step}-{i}", float(q), rng.binomial(1, x, 8))  # the tree stores what was read
            tree.step = step
            trees.append(tree)
        errors.append(np.abs(maps["root"].mean(grid) - _step_truth(grid)).mean())
    # read back through each step's own map, the window keeps fitting the predictor's forecasts: no drift
    assert max(errors[4:]) < 0.05 < errors[0]


def _prefix_tree(name: str, v: float, x: float, rng, k: int = 4) -> tuple[RolloutTree, bool]:
    """A root with one 2-turn rollout whose middle node is a scored candidate (forecast ``v``, true success ``x``);
    stage 2 chooses it when the factual reward disagrees with the forecast, as ``V_pref`` does, and then adds
    ``k`` continuations."""
    tree = RolloutTree(tree_id=f"t/{name}", prompt_uid=f"u/{name}", data_source="toy", example_id=name)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
    mid = tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT)
    mid.pred_success_prob = v
    factual = float(rng.random() < x)
    tree.add_node(mid.node_id, turn_idx=1, origin=Origin.ROLLOUT, reward=factual)
    chosen = (factual == 1.0) != (v > 0.5)
    if chosen:
        for _ in range(k):
            tree.add_node(mid.node_id, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=mid.node_id,
                          reward=float(rng.random() < x))
    return tree, chosen


def test_every_scored_prefix_enters_the_fit_so_choosing_by_the_factual_reward_biases_nothing():
    from trace.predictor.forecast import fit_forecast_model
    from trace.reporting.audit import anchor_outcomes

    rng = np.random.default_rng(4)
    v = rng.uniform(0.05, 0.95, 3000)
    built = [_prefix_tree(str(i), float(vi), float(vi), rng) for i, vi in enumerate(v)]  # calibrated forecasts
    trees = [t for t, _ in built]
    pred, successes, trials = candidate_outcomes(trees)
    assert pred.size == 3000 and trials.sum() == 3000 + 4 * sum(c for _, c in built)
    every = fit_forecast_model(pred, successes, trials)
    assert every.alpha == pytest.approx(0.0, abs=0.15) and every.beta == pytest.approx(1.0, abs=0.15)
    # the chosen anchors alone: their factual rewards disagree with the forecast by construction
    chosen = fit_forecast_model(*anchor_outcomes(trees))
    assert chosen.beta < 0.8


def test_a_few_outcomes_move_the_shrunk_map_little():
    from trace.predictor.forecast import fit_forecast_model

    rng = np.random.default_rng(2)
    p = rng.uniform(0.3, 0.7, 10)  # stage 1's narrow range of forecasts
    successes = rng.binomial(8, 0.5, 10).astype(float)
    free, shrunk = fit_forecast_model(p, successes, np.full(10, 8)), fit_forecast_model(p, successes, np.full(10, 8),
                                                                                          shrink=8.0)
    assert free.beta == 0.0 < shrunk.beta  # the free fit goes flat on noise, the prior keeps a slope
    assert fit_forecast_model(p, successes, np.full(10, 8), shrink=0.0) == free


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
    # the map's kind: the Platt map keeps the hash of runs from before the key existed, isotonic is another run
    platt = config_from_dict({"predictor": {"recalibrate": True}}).params_hash()
    assert config_from_dict({"predictor": {"recalibrate": True, "recalibrate_map": "platt"}}).params_hash() == platt
    assert config_from_dict({"predictor": {"recalibrate": True, "recalibrate_map": "isotonic"}}).params_hash() not in (
        platt, Config().params_hash())
    assert config_from_dict({"predictor": {"recalibrate_map": "isotonic"}}).params_hash() == Config().params_hash()


def test_the_sampler_can_be_copied():
    import copy

    sampler = copy.copy(RecalibratedSampler(_Base(), {"root": ForecastModel(), "prefix": ForecastModel()}))
    assert sampler.rollouts == 7


@pytest.mark.slow
def test_a_recalibrated_run_reads_the_mapped_forecasts_and_resumes_with_the_same_maps(tmp_path, monkeypatch):
    # the tiny policy never succeeds, so every real fit is the identity: a fit that reads its input stands in
    # (alpha = the mean forecast it is given), so the forecasts read back through the earlier steps' maps show
    import trace.training.recalibration as recalibration
    from tests.test_loop import tiny_trainer
    from trace.tree_io import read_trees, tree_path

    def fake_fit(pred, successes, trials, min_items=8, shrink=0.0):
        return ForecastModel(float(np.mean(pred)) if len(pred) else 0.0, 0.8, kappa=5.0, num_items=len(pred))

    monkeypatch.setattr(recalibration, "fit_forecast_model", fake_fit)
    over = {"predictor.recalibrate": True, "predictor.recalibrate_window": 2, "train.checkpoint_every": 2,
            "train.num_steps": 4}
    runs = {}
    for on in (False, True):
        trainer = tiny_trainer("trace", tmp_path / f"whole{on}", {**over, "predictor.recalibrate": on})
        runs[on] = (trainer, trainer.run())
    off, on = runs[False][1], runs[True][1]
    assert not any(k.startswith("recalibration/") for k in off[0])
    assert on[0]["recalibration/root_alpha"] == 0.0 and on[0]["recalibration/root_beta"] == 0.8  # no window yet
    # step 0: the same predictor in both runs; the recalibrated run's roots hold F_0 of the forecasts it read
    read = lambda on_, step: {t.prompt_uid: t.nodes[0].pred_success_prob  # noqa: E731
                              for t in read_trees(tree_path(runs[on_][0].trees_root, "trace", step))}
    raw, mapped = read(False, 0), read(True, 0)
    shared = sorted(set(raw) & set(mapped))
    assert shared and [mapped[u] for u in shared] == pytest.approx(ForecastModel(0.0, 0.8).mean([raw[u] for u in shared]))
    # step 1 fits on step 0's forecasts read back through F_0: the predictor's own
    read_back = recalibration.invert(ForecastModel(0.0, 0.8), list(read(True, 0).values()))
    assert on[1]["recalibration/root_alpha"] == pytest.approx(np.mean(read_back))
    # an interrupted run (steps 0-1, then resumed) reads the earlier maps back from its history: the same maps
    tiny_trainer("trace", tmp_path / "cut", over).run(until_step=2)  # checkpointed after step 1
    resumed = tiny_trainer("trace", tmp_path / "cut", over)
    assert resumed.resume() == 2
    again = resumed.run()
    for a, b in zip(again, on[2:]):
        assert {k: v for k, v in a.items() if k.startswith("recalibration/")} == pytest.approx(
            {k: v for k, v in b.items() if k.startswith("recalibration/")})


@pytest.mark.slow
def test_an_isotonic_run_logs_its_knots_and_resumes_with_the_same_maps(tmp_path, monkeypatch):
    # the tiny policy never succeeds, so every real fit is the identity: a fit that reads its input stands in (the
    # knots x ** (1.5 + the mean forecast it is given)), so the forecasts read back through the earlier maps show
    import trace.training.recalibration as recalibration
    from tests.test_loop import tiny_trainer

    def fake_fit(pred, successes, trials, shrink=8.0):
        power = 1.5 + float(np.mean(pred)) if len(pred) else 1.0
        return IsotonicMap(tuple(x ** power for x in KNOTS), kappa=5.0, num_items=len(pred))

    monkeypatch.setattr(recalibration, "fit_isotonic_map", fake_fit)
    over = {"predictor.recalibrate": True, "predictor.recalibrate_map": "isotonic", "predictor.recalibrate_window": 2,
            "train.checkpoint_every": 2, "train.num_steps": 4}
    whole = tiny_trainer("trace", tmp_path / "whole", over).run()
    knots = [{k: v for k, v in m.items() if k.startswith("recalibration/")} for m in whole]
    assert all(len(k) == 2 * 11 and "recalibration/prefix_knot10" in k for k in knots)
    assert "forecast/root_kappa" in whole[-1] and "forecast/root_alpha" not in whole[-1]
    assert knots[0]["recalibration/root_knot05"] == 0.5  # no window yet: power 1
    assert all(k["recalibration/root_knot05"] != 0.5 for k in knots[1:])  # fitted on the window's forecasts
    tiny_trainer("trace", tmp_path / "cut", over).run(until_step=2)
    resumed = tiny_trainer("trace", tmp_path / "cut", over)
    assert resumed.resume() == 2
    again = resumed.run()
    # the resumed steps read the earlier steps' forecasts back through the logged knots: the same maps
    assert [{k: v for k, v in m.items() if k.startswith("recalibration/")} for m in again] == [
        pytest.approx(k) for k in knots[2:]]
