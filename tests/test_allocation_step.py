"""One allocation step over a sampler: call order and salts, dapo's filtering, extra roots, the samplers."""

import numpy as np
import pytest

from trace.allocation.arms import get_arm, plan_root_counts
from trace.allocation.prefix import candidate_anchors, split_expansion_budget
from trace.allocation.prefix_rules import plan_expansion
from trace.allocation.samplers import PolicySampler, SimulatorSampler
from trace.allocation.step import StepSampler, allocate_step
from trace.configuration.config import AllocationConfig, PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.simulator import SimulatorEnvironment
from trace.predictor.registry import make_predictor

ACFG = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=4, m_max=8)


def seeded(salt: str) -> np.random.Generator:
    return np.random.default_rng(sum(map(ord, salt)))


class RecordingSampler(SimulatorSampler):
    """The simulator sampler, recording each call (and its salt) in order."""

    def __init__(self, env, predictor, *, zero_rewards=False):
        super().__init__(env, predictor, np.random.default_rng(0), seeded, step=0, ablation="test")
        self.calls = []
        self.zero_rewards = zero_rewards

    def score_prompts(self, prompts):
        self.calls.append(("score_prompts",))
        return super().score_prompts(prompts)

    def score_anchors(self, trees, node_ids):
        self.calls.append(("score_anchors",))
        return super().score_anchors(trees, node_ids)

    def sample_roots(self, prompts, counts, salt):
        self.calls.append(("sample_roots", salt))
        trees = super().sample_roots(prompts, counts, salt)
        if self.zero_rewards:
            for tree in trees:
                for leaf in tree.leaves():
                    leaf.reward = 0.0
        return trees

    def sample_continuations(self, trees, counts, salt):
        self.calls.append(("sample_continuations", salt))
        super().sample_continuations(trees, counts, salt)


def simulator(min_turns=2, max_turns=4, seed=0):
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=16, min_turns=min_turns, max_turns=max_turns), seed=seed)
    return env, make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)


def node_records(trees):
    return [[(n.node_id, n.parent_id, n.reward, n.num_branches, n.pred_success_prob) for n in t.nodes] for t in trees]


def test_the_samplers_implement_the_protocol():
    env, oracle = simulator()
    assert isinstance(SimulatorSampler(env, oracle, np.random.default_rng(0), seeded, step=0, ablation="x"),
                      StepSampler)
    assert isinstance(PolicySampler(None, env, None, oracle, lambda salt: None, step=0, ablation="x",
                                    max_context_tokens=64), StepSampler)


def test_the_step_samples_in_the_loop_order_with_named_salts():
    env, oracle = simulator()
    sampler = RecordingSampler(env, oracle)
    result = allocate_step(get_arm("trace"), env.prompts()[:8], sampler, ACFG, seeded)
    assert sampler.calls == [("score_prompts",), ("sample_roots", "roots"), ("score_anchors",),
                             ("sample_continuations", "branch0")]
    assert sum(t.num_trajectories() for t in result.trees) == 32 and result.sampled_trees is result.trees
    assert {"allocation/root_gap", "allocation/root_objective"} <= set(result.metrics)
    assert list(result.timings)[:2] == ["time/predict", "time/rollout"]

    sampler = RecordingSampler(env, oracle)
    allocate_step(get_arm("grpo"), env.prompts()[:8], sampler, ACFG, seeded)
    assert sampler.calls == [("sample_roots", "roots")]  # no predictor read, no stage 2


@pytest.mark.parametrize("name", ["trace", "tree_random", "treepo"])
def test_the_step_equals_the_plan_then_sample_loop_written_out(name):
    env, oracle = simulator(seed=3)
    candidates = env.prompts()[:8]
    arm = get_arm(name)
    result = allocate_step(arm, candidates, RecordingSampler(env, oracle), ACFG, seeded)

    # the same step by hand: predict, plan roots, sample, score anchors, plan and sample continuations
    pred = (np.asarray(oracle.predict_prompts(candidates, [c.question for c in candidates])) if arm.uses_predictor
            else np.full(8, np.nan))
    plan = plan_root_counts(arm, pred, trajectory_budget=32, expansion_ratio=1.0, group_size=4, m_min=2, m_max=8,
                            knapsack_m_min=2, tie_keys=[c.prompt_uid for c in candidates])
    active = np.flatnonzero(plan.counts)
    trees = env.sample_root_rollouts([candidates[i] for i in active], plan.counts[active], np.random.default_rng(0),
                                     step=0, ablation="test")
    for tree, i in zip(trees, active):
        tree.root.pred_success_prob = float(pred[i]) if arm.uses_predictor else None
        tree.root.num_branches = int(plan.counts[i])
    probs = None
    if arm.prefix_rule == "trace":
        ids = [[n for n, _ in candidate_anchors(tree)] for tree in trees]
        probs = {}
        for t, (tree, tree_ids, preds) in enumerate(zip(trees, ids, oracle.predict_trees(trees, ids))):
            for node_id, v in zip(tree_ids, preds):
                probs[(t, node_id)] = tree.nodes[node_id].pred_success_prob = float(v)
    expansion = plan_expansion(arm, trees, probs, split_expansion_budget(plan.counts[active], plan.expansion_budget),
                               seeded("expand0"))
    env.sample_continuations(trees, expansion.counts, seeded("branch0"))
    assert node_records(result.trees) == node_records(trees)


def test_dapo_samples_in_rounds_and_trains_on_the_mixed_groups_only():
    env, oracle = simulator()
    sampler = RecordingSampler(env, oracle)
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=16, group_size=4, m_max=8)
    result = allocate_step(get_arm("dapo"), env.prompts(), sampler, acfg, seeded)
    assert sampler.calls[0] == ("sample_roots", "dapo0")  # later rounds: "dapo<trees sampled so far>"
    assert result.is_filtered and set(map(id, result.trees)) <= set(map(id, result.sampled_trees))
    assert all(len(set(t.leaf_rewards())) > 1 for t in result.trees)
    assert len(result.trees) == result.metrics["dapo/kept_groups"] and result.metrics["dapo/rounds"] >= 1


def test_dapo_without_a_mixed_group_trains_on_nothing_but_keeps_what_it_sampled():
    env, oracle = simulator()
    sampler = RecordingSampler(env, oracle, zero_rewards=True)
    result = allocate_step(get_arm("dapo"), env.prompts()[:8], sampler, ACFG, seeded)
    assert result.trees == [] and len(result.sampled_trees) == 8  # round 1 spent T = 32 on 8 groups of 4
    assert result.metrics == {"dapo/rounds": 1.0, "dapo/no_mixed_group": 1.0, "dapo/kept_groups": 0.0}


def test_other_errors_of_the_sampler_stop_the_step():
    env, oracle = simulator()

    class Unreachable(RecordingSampler):
        def sample_roots(self, prompts, counts, salt):
            raise ConnectionError("retriever did not answer")

    for arm in ("dapo", "grpo"):
        with pytest.raises(ConnectionError):
            allocate_step(get_arm(arm), env.prompts()[:8], Unreachable(env, oracle), ACFG, seeded)


def test_continuations_no_prefix_can_take_become_extra_root_rollouts(monkeypatch):
    import trace.allocation.step as step_module

    clock = [0.0]
    monkeypatch.setattr(step_module.time, "perf_counter", lambda: clock[0])

    class SlowSampler(RecordingSampler):  # each sampling call takes 1 s (roots) or 10 s (extra roots) of the clock
        def sample_roots(self, prompts, counts, salt):
            clock[0] += 1.0
            return super().sample_roots(prompts, counts, salt)

        def sample_continuations(self, trees, counts, salt):
            clock[0] += 10.0
            super().sample_continuations(trees, counts, salt)

    env, oracle = simulator(min_turns=1, max_turns=1)  # every trajectory ends after one turn: no anchors
    sampler = SlowSampler(env, oracle)
    result = allocate_step(get_arm("tree_random"), env.prompts()[:8], sampler, ACFG, seeded)
    assert sampler.calls == [("sample_roots", "roots"), ("sample_continuations", "extra_roots")]
    assert result.metrics["allocation/extra_root_rollouts"] == 16.0  # T - M = 32 - 16
    assert sum(t.num_trajectories() for t in result.trees) == 32
    assert result.timings["time/rollout"] == 11.0 and "time/expand" not in result.timings  # every sampling timed
