"""The warm-start fit: a held-out score by prompt, then a fit on every tree."""

import zlib

import numpy as np
import pytest

from trace.configuration.config import PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.simulator import SimulatorEnvironment
from trace.predictor.fitting import fit_with_holdout, holdout_split
from trace.predictor.registry import make_predictor


@pytest.fixture(scope="module")
def trees():
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=30, min_turns=2, max_turns=3), seed=2)
    prompts = env.prompts()
    rng = np.random.default_rng(0)
    # two trees per prompt (two steps), so the split must keep a prompt's trees together
    return [t for step in range(2) for t in env.sample_root_rollouts(prompts, [3] * len(prompts), rng, step=step)]


def test_holdout_split_keeps_every_prompt_on_one_side_and_holds_out_one_fold(trees):
    fit, held = holdout_split(trees)
    assert {t.prompt_uid for t in fit}.isdisjoint({t.prompt_uid for t in held})
    assert len(fit) + len(held) == len(trees) and held and fit
    assert held == [t for t in trees if zlib.crc32(t.prompt_uid.encode()) % 5 == 0]  # order of the input
    with pytest.raises(ValueError, match="num_folds"):
        holdout_split(trees, num_folds=1)


def test_fit_with_holdout_scores_a_probe_then_fits_a_fresh_predictor_on_all_trees(trees):
    cfg = PredictorConfig(kind=PredictorKind.HISTORY)
    predictor, metrics = fit_with_holdout(cfg, trees, seed=1)
    fit, held = holdout_split(trees)
    probe = make_predictor(cfg, seed=1)
    probe.fit(fit)
    expected = {f"{k}_heldout": v for k, v in probe.evaluate(held).items()}
    final = make_predictor(cfg, seed=1)
    expected.update(final.fit(trees))
    assert list(metrics) == list(expected)  # held-out metrics first, then the final fit's
    np.testing.assert_equal(metrics, expected)
    np.testing.assert_array_equal(predictor.predict_nodes(trees[0], [0, 1]), final.predict_nodes(trees[0], [0, 1]))
    assert metrics["predictor/fit_new_trees"] == len(trees)  # the returned predictor saw every tree


def test_fit_with_holdout_skips_the_score_when_nothing_is_held_out(trees):
    fit, _ = holdout_split(trees)
    _, metrics = fit_with_holdout(PredictorConfig(kind=PredictorKind.HISTORY), fit)
    assert not any(k.endswith("_heldout") for k in metrics) and metrics["predictor/fit_new_trees"] == len(fit)
