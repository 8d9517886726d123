"""The oracle arm: ``trace`` allocating on Monte-Carlo success rates (``MonteCarloScorer``, ``trace_oracle``)."""

from __future__ import annotations

import numpy as np
import pytest

from trace.allocation.arms import ARMS, DIAGNOSTIC_ARMS, get_arm, register_arm
from trace.allocation.registry import Arm
from trace.allocation.samplers import MonteCarloScorer
from trace.allocation.step import allocate_step
from trace.configuration.config import AllocationConfig, ConfigError
from tests.test_ground_truth import BernoulliSampler, _tree
from tests.test_loop import tiny_trainer


def test_the_scorer_estimates_prompts_and_prefixes_by_fresh_rollouts_on_its_own_salts():
    p = {"a": 0.1, "b": 0.5, ("a", 1): 0.3, ("b", 1): 0.7, ("b", 2): 0.95}
    trees = [_tree("a", 2), _tree("b", 3)]
    sizes = [len(t.nodes) for t in trees]
    base = BernoulliSampler(p)
    scorer = MonteCarloScorer(base, samples=400)
    roots = scorer.score_prompts(["a", "b"])
    anchors = scorer.score_anchors(trees, [[1], [1, 2]])
    assert [a.shape for a in anchors] == [(1,), (2,)]
    for est, key in ((roots, ["a", "b"]), (np.concatenate(anchors), [("a", 1), ("b", 1), ("b", 2)])):
        true_p = np.array([p[k] for k in key])
        assert np.all(np.abs(est - true_p) <= 4 * np.sqrt(true_p * (1 - true_p) / 400))
    # each call on its own salts, none of the arm's (roots, branch<r>) nor the audit's (truth_*)
    assert base.salts == ["oracle_roots1", "oracle_prefixes2"]
    assert [len(t.nodes) for t in trees] == sizes and all(n.num_branches == 0 for t in trees for n in t.nodes)
    assert scorer.metrics() == {"oracle/rollouts": 5 * 400.0, "oracle/tokens": 2 * 400 * 2 + 3 * 400 * 3.0}
    assert MonteCarloScorer(BernoulliSampler(p), 2, salt="truth_oracle").score_prompts(["a"]).shape == (1,)


def test_the_scorer_refuses_fewer_than_one_sample_and_node_lists_that_miss_a_tree():
    with pytest.raises(ValueError, match="allocation.oracle_samples=0"):
        MonteCarloScorer(BernoulliSampler({}), 0)
    with pytest.raises(ValueError, match="2 trees but 1 lists"):
        MonteCarloScorer(BernoulliSampler({}), 2).score_anchors([_tree("a"), _tree("b")], [[1]])


def test_the_oracle_is_a_family_of_its_own_so_the_methods_corrections_do_not_move():
    from trace.reporting.statistics import Interval
    from trace.reporting.verdicts import family_verdicts, primary_margins

    iv = lambda mean: Interval(mean, mean - 0.01, mean + 0.01, 3)  # noqa: E731  (p about 0.002)
    arms = {"trace": {"vs_grpo": {"eval mean@k": iv(0.03)}}, "pcl": {"vs_grpo": {"eval mean@k": iv(0.03)}}}
    with_oracle = {**arms, "trace_oracle": {"vs_grpo": {"eval mean@k": iv(0.05)}}}
    before, after = family_verdicts(arms), family_verdicts(with_oracle)
    key = ("trace", "vs_grpo", "eval mean@k")
    assert after[key].p_adjusted == before[key].p_adjusted and after[key].family_size == 2
    assert "diagnostic" in after[("trace_oracle", "vs_grpo", "eval mean@k")].family
    assert primary_margins(with_oracle, 0.02)["trace"] == primary_margins(arms, 0.02)["trace"]


class Question(str):
    """A candidate prompt of the Bernoulli toy: its name, with the ``prompt_uid`` and ``question`` a step reads."""

    @property
    def prompt_uid(self) -> str:
        return f"toy/{self}"

    @property
    def question(self) -> str:
        return str(self)


def test_trace_oracle_spends_the_budget_on_the_prompts_whose_estimates_promise_contrast():
    # 8 candidates: four never or always succeed, four succeed half the time. With the estimates, stage 1 gives
    # its 16 roots to the 0.5 prompts; the estimates' 8 x 32 rollouts stay out of the trees.
    names = [Question(f"q{i}") for i in range(8)]
    p = {n: (0.5 if i % 2 else float(i % 4 == 0)) for i, n in enumerate(names)}
    base = BernoulliSampler({**p, **{(str(n), 0): v for n, v in p.items()}})  # (n, 0): more rollouts of a root
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=4, m_min=4, m_max=8,
                            expansion_ratio=1.0)
    result = allocate_step(get_arm("trace_oracle"), names, MonteCarloScorer(base, samples=32), acfg,
                           lambda salt: np.random.default_rng(0))
    active = {t.example_id for t in result.trees}
    assert active and active <= {n for n in names if p[n] == 0.5}
    # one-turn trees have no prefix to branch: stage 2's half comes back as extra root rollouts, T in all
    assert sum(t.num_trajectories() for t in result.trees) == 32
    assert result.root_pred_success_prob == pytest.approx([0.5] * len(active), abs=0.35)
    # the same step on the plain trace arm reads the sampler's predictor instead
    assert get_arm("trace").scores == "predictor" and get_arm("trace_oracle").scores == "monte_carlo"


def test_the_oracle_arm_is_a_diagnostic_outside_the_grid_that_params_accept():
    from trace.configuration.params_file import load_config

    assert "trace_oracle" in DIAGNOSTIC_ARMS and "trace_oracle" not in ARMS
    cfg = load_config("params.yaml", {"train.ablations": ["grpo", "trace_oracle"]})
    assert cfg.train.ablations == ("grpo", "trace_oracle")
    default = load_config("params.yaml")
    assert default.allocation.oracle_samples == 16
    # the default K leaves the hash of every run as it was; another K is a different run
    assert load_config("params.yaml", {"allocation.oracle_samples": 8}).params_hash() != default.params_hash()
    with pytest.raises(ConfigError, match="allocation.oracle_samples"):
        load_config("params.yaml", {"allocation.oracle_samples": 0})
    with pytest.raises(ValueError, match="scores='guess'"):
        register_arm(Arm("guess_arm", "trace", "trace", "tree_grpo", uses_predictor=True, scores="guess"))
    with pytest.raises(ValueError, match="registered already"):
        register_arm(Arm("trace_oracle", "trace", "trace", "tree_grpo", uses_predictor=True), diagnostic=True)


@pytest.mark.slow
def test_a_trace_oracle_step_trains_on_the_budget_and_counts_its_estimates_apart(tmp_path):
    from trace.tree_io import read_trees, tree_path

    trainer = tiny_trainer("trace_oracle", tmp_path, {"allocation.oracle_samples": 2,
                                                       "train.ablations": ["trace_oracle"]})
    metrics = trainer.step(0)
    trees = read_trees(tree_path(trainer.trees_root, trainer.ablation, 0))
    budget = trainer.cfg.allocation.trajectory_budget
    assert metrics["rollout/trajectories"] == budget == sum(t.num_trajectories() for t in trees)
    assert metrics["tokens/generated"] == sum(t.num_generated_tokens() for t in trees)
    # 6 candidates x 2, then 2 per candidate prefix of the sampled trees
    assert metrics["oracle/rollouts"] >= 6 * 2 and metrics["oracle/tokens"] > 0
    roots = [t.nodes[0] for t in trees]
    assert all(r.pred_success_prob in (0.0, 0.5, 1.0) for r in roots)  # a mean of 2 rewards of 0 or 1
