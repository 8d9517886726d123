"""predictor.recalibrate_roots: explore: the root map is fitted on the exploration groups alone (uniformly drawn
candidates), not on the root groups stage 1 chose by the forecast it recalibrates."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_recalibration import _root_group, _step_trees
from trace.configuration.params_file import ConfigError, load_config
from trace.predictor.forecast import ForecastModel
from trace.training.recalibration import step_maps

IDENTITY = {"root": ForecastModel(), "prefix": ForecastModel()}


def test_the_root_map_is_fitted_on_the_trees_given_for_it_and_the_prefix_map_on_the_window():
    rng = np.random.default_rng(3)
    chosen = _step_trees(rng, 0, IDENTITY, n=300)  # truth sigmoid(-1 + 0.5 logit p): miscalibrated
    p = rng.uniform(0.05, 0.95, 300)
    drawn = [_root_group(f"x{i}", float(q), rng.binomial(1, q, 8)) for i, q in enumerate(p)]  # calibrated
    for tree in drawn:
        tree.step = 0
    both = step_maps({}, chosen + drawn)
    alone = step_maps({}, chosen + drawn, root_trees=drawn)
    assert both["root"].alpha < -0.4  # the chosen groups pull the map fitted on every group away from the identity
    assert alone["root"].alpha == pytest.approx(0.0, abs=0.25) and alone["root"].beta == pytest.approx(1.0, abs=0.2)
    assert alone["root"].num_items == 300
    assert alone["prefix"] == both["prefix"]
    assert step_maps({}, chosen + drawn, root_trees=[])["root"] == ForecastModel()  # nothing drawn yet: identity


def test_recalibrating_roots_on_exploration_groups_is_checked_at_load():
    on = {"predictor.recalibrate": True, "predictor.recalibrate_roots": "explore", "train.ablations": ["trace"]}
    with pytest.raises(ConfigError, match="allocation.explore_groups is 0: set allocation.explore_groups > 0"):
        load_config("params.yaml", on)
    with pytest.raises(ConfigError, match="predictor.recalibrate is false: set predictor.recalibrate: true"):
        load_config("params.yaml", {**on, "predictor.recalibrate": False, "allocation.explore_groups": 2})
    with pytest.raises(ConfigError, match="has knapsack, whose stage 1 reads forecasts but draws no exploration"):
        load_config("params.yaml", {**on, "allocation.explore_groups": 2, "train.ablations": ["trace", "knapsack"]})
    # arms whose stage 1 reads no forecast, or the oracle's estimates, are left as they are
    load_config("params.yaml", {**on, "allocation.explore_groups": 2,
                                "train.ablations": ["grpo", "trace_prefix", "trace_oracle", "trace", "pcl"]})


def test_the_window_keeps_the_params_hash_and_explore_changes_it():
    base = {"predictor.recalibrate": True, "allocation.explore_groups": 2}
    window = load_config("params.yaml", base).params_hash()
    from trace.configuration.config import config_from_dict

    fixed = {"policy": {"dtype": "float32"}, "update": {"bf16": False}, "predictor": {"recalibrate": True},
             "allocation": {"explore_groups": 2}}
    assert config_from_dict(fixed).params_hash() == "69b95ab356c5"  # these params' hash from before the key existed
    assert load_config("params.yaml", {**base, "predictor.recalibrate_roots": "window"}).params_hash() == window
    assert load_config("params.yaml", {**base, "predictor.recalibrate_roots": "explore"}).params_hash() != window


@pytest.mark.slow
def test_a_run_fits_its_root_map_on_the_exploration_groups_it_drew(tmp_path, monkeypatch):
    import inspect

    import trace.allocation.step as step_module
    import trace.training.recalibration as recalibration
    from tests.test_loop import tiny_trainer
    from trace.allocation.arms import get_arm
    from trace.tree_io import read_trees, tree_path

    drawn_by_step, draw = [], step_module.exploration_draw

    def recorded(arm, num_candidates, explore_groups, rng_for):
        out = draw(arm, num_candidates, explore_groups, rng_for)
        if "allocate_step" in [frame.function for frame in inspect.stack()[1:3]]:  # via exploration_split
            drawn_by_step.append(out)
        return out

    fits = []

    def fake_fit(pred, successes, trials, min_items=8, shrink=0.0):
        fits.append(len(pred))  # root, then prefix, each step
        return ForecastModel(0.0, 1.0, kappa=5.0, num_items=len(pred))

    monkeypatch.setattr(step_module, "exploration_draw", recorded)
    monkeypatch.setattr(recalibration, "fit_forecast_model", fake_fit)
    over = {"predictor.recalibrate": True, "predictor.recalibrate_window": 2, "allocation.explore_groups": 1,
            "train.num_steps": 3}
    runs = {}
    for roots in ("window", "explore"):
        fits.clear(), drawn_by_step.clear()
        trainer = tiny_trainer("trace", tmp_path / roots, {**over, "predictor.recalibrate_roots": roots})
        trainer.run()
        runs[roots] = list(fits[::2]), [list(d) for d in drawn_by_step], trainer
    # the root map's items by step: window 3 groups a step (a root budget of 8: one drawn group of 4, two chosen of
    # 2), explore only the drawn one
    assert runs["window"][0] == [0, 3, 6] and runs["explore"][0] == [0, 1, 2]
    # the trees it picks are those allocate_step gave exploration groups, made again from the seed and the step
    trainer = runs["explore"][2]
    trees = [t for s in range(3) for t in read_trees(tree_path(trainer.trees_root, "trace", s))]
    picked = recalibration.exploration_trees(trees, get_arm("trace"), trainer.train_prompts, trainer.cfg.allocation,
                                             trainer.cfg.seed)
    from trace.training.seeding import candidate_indices

    prompts = trainer.train_prompts
    expected = [prompts[candidate_indices(len(prompts), 6, trainer.cfg.seed, s)[i]].prompt_uid
                for s, drawn in enumerate(runs["explore"][1]) for i in drawn]
    assert [t.prompt_uid for t in picked] == expected and len(expected) == 3
    from trace.reporting.audit import root_rollout_rewards

    assert [root_rollout_rewards(t).size for t in picked] == [trainer.cfg.allocation.group_size] * 3
