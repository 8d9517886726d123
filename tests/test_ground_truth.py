"""The predictor's ground-truth audit (trace/predictor/ground_truth.py) and its wiring in Trainer.step."""

from __future__ import annotations

import numpy as np
import pytest

from trace.predictor.calibration import brier_score
from trace.predictor.ground_truth import (brier_decomposition, monte_carlo_truth, reliability_diagram,
                                          score_forecasts, unselected_sample, visited_prefixes)
from trace.tree import Origin, RolloutTree
from tests.test_loop import tiny_trainer


# ---- the Brier decomposition ----------------------------------------------------------------------------------
def test_brier_decomposition_matches_a_hand_worked_vector():
    # forecasts 0.1, 0.1, 0.8, 0.8 with outcomes 0, 1, 1, 1: bins 1 and 8, each of weight 2.
    # obar = 3/4; bin 1: pbar 0.1, obar_b 0.5; bin 8: pbar 0.8, obar_b 1.0.
    # REL = (2 (0.1 - 0.5)^2 + 2 (0.8 - 1)^2) / 4 = (0.32 + 0.08) / 4 = 0.1
    # RES = (2 (0.5 - 0.75)^2 + 2 (1 - 0.75)^2) / 4 = 0.25 / 4 = 0.0625
    # UNC = 0.75 * 0.25 = 0.1875
    # BS = (0.01 + 0.81 + 0.04 + 0.04) / 4 = 0.225 = 0.1 - 0.0625 + 0.1875; residual 0 (one forecast per bin)
    parts = brier_decomposition([0.1, 0.1, 0.8, 0.8], [0.0, 1.0, 1.0, 1.0])
    assert parts == pytest.approx({"brier": 0.225, "reliability": 0.1, "resolution": 0.0625,
                                   "uncertainty": 0.1875, "residual": 0.0}, abs=1e-12)


def test_the_residual_is_the_within_bin_term_of_a_hand_worked_vector():
    # forecasts 0.12, 0.18 (both bin 1) with outcomes 0, 1: pbar = 0.15, obar_b = obar = 0.5.
    # REL = (0.15 - 0.5)^2 = 0.1225, RES = 0, UNC = 0.25; BS = (0.0144 + 0.6724) / 2 = 0.3434.
    # residual = sum w (p - pbar)(p + pbar - 2y) / W = (-0.03 * 0.27 + 0.03 * (0.33 - 2)) / 2 = -0.0291
    parts = brier_decomposition([0.12, 0.18], [0.0, 1.0])
    assert parts == pytest.approx({"brier": 0.3434, "reliability": 0.1225, "resolution": 0.0,
                                   "uncertainty": 0.25, "residual": -0.0291}, abs=1e-12)


def test_brier_equals_reliability_minus_resolution_plus_uncertainty_plus_residual_exactly():
    rng = np.random.default_rng(0)
    pred, rate, weight = rng.uniform(size=200), rng.uniform(size=200), rng.integers(1, 20, size=200)
    for num_bins in (1, 5, 10, 37):
        parts = brier_decomposition(pred, rate, weight, num_bins)
        assert parts["brier"] == pytest.approx(brier_score(pred, rate, weight), abs=1e-12)
        assert parts["brier"] == pytest.approx(parts["reliability"] - parts["resolution"] + parts["uncertainty"]
                                               + parts["residual"], abs=1e-12)
    # forecasts that take one value per bin: Murphy's identity holds with no residual
    centred = (np.floor(pred * 10) + 0.5) / 10
    assert brier_decomposition(centred, rate, weight)["residual"] == pytest.approx(0.0, abs=1e-12)


def test_the_reliability_diagram_lists_each_filled_bin_with_its_binomial_standard_error():
    rows = reliability_diagram([0.1, 0.1, 0.8, 0.8], [0.0, 1.0, 1.0, 1.0], [3, 1, 2, 2])
    # bin 1: weight 4, mean forecast 0.1, realised (3 * 0 + 1 * 1) / 4 = 0.25, se sqrt(0.25 * 0.75 / 4)
    # bin 8: weight 4, realised 1.0, se 0
    assert rows == [
        pytest.approx({"lower": 0.1, "upper": 0.2, "count": 4.0, "mean_forecast": 0.1, "realised_rate": 0.25,
                       "std_error": np.sqrt(0.25 * 0.75 / 4)}),
        pytest.approx({"lower": 0.8, "upper": 0.9, "count": 4.0, "mean_forecast": 0.8, "realised_rate": 1.0,
                       "std_error": 0.0})]


# ---- Monte-Carlo truth on a toy environment whose probabilities are known -------------------------------------
def _tree(name: str, depth: int = 2) -> RolloutTree:
    """A root with one trajectory of ``depth`` turns (non-terminal nodes 1..depth-1) ending in reward 0."""
    tree = RolloutTree(tree_id=f"toy/0/{name}", prompt_uid=f"toy/{name}", data_source="toy", example_id=name)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, env_state=name)
    for t in range(depth):
        last = t == depth - 1
        tree.add_node(t, turn_idx=t, origin=Origin.ROLLOUT, env_state=None if last else f"{name}/{t + 1}",
                      reward=0.0 if last else None)
    return tree


class BernoulliSampler:
    """Every continuation of root ``u`` (prefix ``(u, node)``) succeeds with the fixed ``p[u]`` (``p[(u, node)]``),
    from a generator of its salt; records the salts and what it was asked."""

    def __init__(self, p: dict, seed: int = 0):
        self.p, self.seed, self.salts = p, seed, []

    def _rng(self, salt):
        return np.random.default_rng([self.seed, sum(map(ord, salt))])

    def sample_roots(self, prompts, counts, salt):
        self.salts.append(salt)
        rng, out = self._rng(salt), []
        for name, k in zip(prompts, counts):
            tree = RolloutTree(tree_id=f"toy/0/{name}", prompt_uid=f"toy/{name}", data_source="toy", example_id=name)
            tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT)
            for _ in range(k):
                tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, reward=float(rng.random() < self.p[name]),
                              loss_mask=[1, 1])
            out.append(tree)
        return out

    def sample_continuations(self, trees, counts, salt):
        self.salts.append(salt)
        rng = self._rng(salt)
        for (t_idx, node_id), k in sorted(counts.items()):
            tree = trees[t_idx]
            tree.nodes[node_id].num_branches += k
            for _ in range(k):
                tree.add_node(node_id, turn_idx=tree.nodes[node_id].turn_idx + 1, origin=Origin.BRANCH,
                              branch_anchor_id=node_id, loss_mask=[1, 1, 1],
                              reward=float(rng.random() < self.p[(tree.example_id, node_id)]))


def test_monte_carlo_truth_recovers_known_probabilities_within_four_standard_errors():
    p = {"a": 0.1, "b": 0.5, "c": 0.85, ("a", 1): 0.3, ("b", 1): 0.7, ("b", 2): 0.95}
    trees = {"a": _tree("a", 2), "b": _tree("b", 3)}
    prefixes = [(trees["a"], 1), (trees["b"], 1), (trees["b"], 2)]
    sizes = {name: len(t.nodes) for name, t in trees.items()}
    sampler = BernoulliSampler(p)
    truth = monte_carlo_truth(sampler, ["a", "b", "c"], prefixes, samples=400)
    for est, key in ((truth.roots, ["a", "b", "c"]), (truth.prefixes, [("a", 1), ("b", 1), ("b", 2)])):
        assert est.num_samples.tolist() == [400] * len(key)
        assert est.estimate == pytest.approx(est.successes / 400, abs=0)
        np.testing.assert_array_equal(est.std_error, np.sqrt(est.estimate * (1 - est.estimate) / 400))
        true_p = np.array([p[k] for k in key])
        assert np.all(np.abs(est.estimate - true_p) <= 4 * np.sqrt(true_p * (1 - true_p) / 400))
    assert truth.num_rollouts == 6 * 400 and truth.num_tokens == 3 * 400 * 2 + 3 * 400 * 3
    assert sampler.salts == ["truth_roots", "truth_prefixes"]
    # the continuations went to copies: the given trees are as they were
    assert {name: len(t.nodes) for name, t in trees.items()} == sizes
    assert all(n.num_branches == 0 for t in trees.values() for n in t.nodes)


def test_monte_carlo_truth_defaults_to_sixteen_continuations():
    truth = monte_carlo_truth(BernoulliSampler({"a": 0.5}), ["a"], [])
    assert truth.roots.num_samples.tolist() == [16] and truth.prefixes.estimate.size == 0


# ---- the unselected sample ------------------------------------------------------------------------------------
def test_unselected_sample_draws_only_visited_non_terminal_prefixes():
    trees = [_tree("a", 1), _tree("b", 3)]
    assert visited_prefixes(trees) == [(1, 1), (1, 2)]  # tree a's one turn is a leaf; roots are never prefixes
    prompts, prefixes = unselected_sample(["a", "b"], trees, 5, 5, np.random.default_rng(0))
    assert prompts == ["a", "b"] and [(t.example_id, n) for t, n in prefixes] == [("b", 1), ("b", 2)]


def test_unselected_sample_ignores_what_an_allocator_chose():
    candidates = [f"q{i}" for i in range(10)]
    trees = [_tree(f"q{i}", 4) for i in range(10)]
    other = [t.copy_without_state() for t in trees]
    for t_new, t_old in zip(other, trees):  # another arm's marks: its predictions and branch counts
        for n_new, n_old in zip(t_new.nodes, t_old.nodes):
            n_new.env_state = n_old.env_state
            n_new.pred_success_prob, n_new.num_branches = 0.9, 3
    a = unselected_sample(candidates, trees, 4, 6, np.random.default_rng(7))
    b = unselected_sample(candidates, other, 4, 6, np.random.default_rng(7))
    assert a[0] == b[0] and [(t.tree_id, n) for t, n in a[1]] == [(t.tree_id, n) for t, n in b[1]]


def test_unselected_sample_is_uniform_over_candidates_and_prefixes():
    from scipy.stats import chisquare

    candidates = [f"q{i}" for i in range(8)]
    trees = [_tree(f"q{i}", 3) for i in range(5)]  # 10 visited prefixes
    rng = np.random.default_rng(1)
    root_hits, prefix_hits = np.zeros(8), np.zeros(10)
    index = {(t.example_id, n): j for j, (t, n) in enumerate((trees[i], n) for i, n in visited_prefixes(trees))}
    for _ in range(2000):
        prompts, prefixes = unselected_sample(candidates, trees, 3, 4, rng)
        assert len(set(prompts)) == 3 and len({(t.tree_id, n) for t, n in prefixes}) == 4  # without replacement
        root_hits[[candidates.index(q) for q in prompts]] += 1
        prefix_hits[[index[(t.example_id, n)] for t, n in prefixes]] += 1
    assert chisquare(root_hits).pvalue > 1e-3 and chisquare(prefix_hits).pvalue > 1e-3


# ---- scoring --------------------------------------------------------------------------------------------------
def test_score_forecasts_names_every_metric_and_counts_the_audit_cost():
    truth = monte_carlo_truth(BernoulliSampler({"a": 0.2, "b": 0.9, ("a", 1): 0.5}), ["a", "b"],
                              [(_tree("a", 2), 1)], samples=20)
    metrics, diagrams = score_forecasts([0.25, 0.8], truth, [0.4])
    for stage in ("root", "prefix"):
        for name in ("ece", "brier", "reliability", "resolution", "uncertainty", "auc", "forecast_mean",
                     "realised_mean"):
            assert f"truth/{stage}_{name}" in metrics
    assert metrics["truth/rollouts"] == 60 and metrics["truth/tokens"] == 2 * 20 * 2 + 20 * 3
    assert metrics["truth/root_forecast_mean"] == pytest.approx(0.525)
    assert metrics["truth/root_realised_mean"] == pytest.approx(truth.roots.estimate.mean())
    assert np.isnan(metrics["truth/prefix_auc"]) == (truth.prefixes.estimate[0] in (0.0, 1.0))
    assert sum(r["count"] for r in diagrams["root"]) == 40
    with pytest.raises(ValueError, match="forecasts for"):
        score_forecasts([0.25], truth, [0.4])


# ---- config ---------------------------------------------------------------------------------------------------
def test_the_audit_is_off_by_default_and_leaves_the_params_hash_alone():
    from trace.configuration.config import Config, config_from_dict

    assert Config().predictor.truth.every == 0
    assert config_from_dict({"predictor": {"truth": {"roots": 3}}}).params_hash() == Config().params_hash()
    assert config_from_dict({"predictor": {"truth": {"every": 2}}}).params_hash() != Config().params_hash()


@pytest.mark.parametrize("bad, key", [({"every": -1}, "predictor.truth.every"),
                                      ({"samples": 1}, "predictor.truth.samples"),
                                      ({"roots": -2}, "predictor.truth.roots"),
                                      ({"every": 1, "roots": 0, "prefixes": 0}, "predictor.truth.roots"),
                                      ({"evry": 1}, "predictor.truth.evry")])
def test_a_bad_truth_param_is_refused_naming_its_key(bad, key):
    from trace.configuration.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"predictor": {"truth": bad}})


# ---- the audit in the training loop ---------------------------------------------------------------------------
@pytest.mark.slow
def test_the_audit_logs_truth_metrics_and_trains_exactly_as_without_it(tmp_path):
    import torch

    from trace.tree_io import read_trees, tree_path

    truth = {"predictor.truth.roots": 3, "predictor.truth.prefixes": 4, "predictor.truth.samples": 2}
    runs = {}
    for every in (0, 1):
        trainer = tiny_trainer("trace", tmp_path / f"every{every}", {**truth, "predictor.truth.every": every})
        metrics = [trainer.step(s) for s in range(2)]
        trees = [read_trees(tree_path(trainer.trees_root, trainer.ablation, s)) for s in range(2)]
        runs[every] = (metrics, trees, {k: v.clone() for k, v in trainer.policy.model.state_dict().items()},
                       trainer.predictor.state_dict(), trainer.cumulative_tokens)
    (m_off, trees_off, w_off, pred_off, tok_off), (m_on, trees_on, w_on, pred_on, tok_on) = runs[0], runs[1]
    for off, on in zip(m_off, m_on):
        assert not any(k.startswith("truth/") for k in off)
        assert on["truth/num_roots"] == 3 and on["truth/rollouts"] == 2 * (3 + on["truth/num_prefixes"]) > 0
        assert on["truth/tokens"] > 0 and on["truth/num_prefixes"] > 0
        same = lambda m: {k: v for k, v in m.items()  # noqa: E731  (all but the audit's and the clocks')
                          if not k.startswith(("truth/", "time/")) and not k.endswith("/seconds")}
        assert same(on) == pytest.approx(same(off), nan_ok=True)
    assert trees_on == trees_off and tok_on == tok_off
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_off)
    assert str(pred_on) == str(pred_off)
