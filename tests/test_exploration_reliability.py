"""scripts.exploration_reliability: stage 1's forecasts against the outcomes of the exploration groups of a run."""

from __future__ import annotations

import math

import pytest


@pytest.mark.slow
def test_the_exploration_groups_of_a_run_are_scored_apart_from_the_chosen_groups(tmp_path):
    from scripts.exploration_reliability import exploration_reliability
    from tests.test_loop import tiny_trainer
    from trace.reporting.audit import root_outcomes
    from trace.tree_io import read_trees, tree_path

    over = {"allocation.explore_groups": 1, "train.num_steps": 3}
    trainer = tiny_trainer("trace", tmp_path / "runs" / "trace" / "s0", over)
    trainer.run()
    result = exploration_reliability(trainer.cfg, "trace", tmp_path / "runs", trainer.train_prompts)
    group_size = trainer.cfg.allocation.group_size
    assert result["steps"] == {"s0": 3} and result["explore"]["groups"] == 3  # one drawn group a step
    explored = sum(r["count"] for r in result["explore"]["diagram"])
    chosen = sum(r["count"] for r in result["chosen"]["diagram"])
    trees = [t for s in range(3) for t in read_trees(tree_path(trainer.trees_root, "trace", s))]
    assert explored == 3 * group_size and explored + chosen == root_outcomes(trees)[2].sum()
    for name in ("explore", "chosen"):
        low, high = result[name]["interval"]
        assert 0.0 <= low <= high <= 1.0 and 0.0 <= result[name]["ece"] <= 1.0 and set(result[name]["seeds"]) == {"s0"}
        # one seed: no spread over seeds to measure the noise by
        assert math.isnan(result[name]["floor"]) and math.isnan(result[name]["debiased"])
        assert all(math.isnan(x) for x in result[name]["debiased_interval"])
    with pytest.raises(ValueError, match="grpo draws no exploration groups"):
        exploration_reliability(trainer.cfg, "grpo", tmp_path / "runs", trainer.train_prompts)
