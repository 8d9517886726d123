"""Benchmarks: each entry point runs on its --quick setting and writes a valid report; helpers are exact."""

import json

import numpy as np
import pytest

from benchmarks import (allocation_quality, lora_update, orchestration, real_task_step, rollout_engine, run_all,
                        solver_speed, step_dtype)
from trace.allocation.arms import ARMS, get_arm, make_allocator_state
from trace.precision import BF16_CPU_FLAGS
from trace.allocation.prefix import allocate_prefixes, prefix_value
from trace.configuration.config import AllocationConfig, PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.simulator import SimulatorEnvironment
from trace.metrics import rollout_metrics
from trace.predictor import make_predictor
from trace.tree import FinishReason, Origin, RolloutTree

MAINS = {"solver_speed": solver_speed.main, "allocation_quality": allocation_quality.main,
         "rollout_engine": rollout_engine.main, "orchestration": orchestration.main, "lora_update": lora_update.main,
         "real_task_step": real_task_step.main, "step_dtype": step_dtype.main}


@pytest.fixture(scope="module")
def quick_reports(tmp_path_factory):
    """Every benchmark's --quick run, written to one temporary folder (never to reports/)."""
    out = tmp_path_factory.mktemp("bench")
    for main in MAINS.values():
        main(["--quick", "--out", str(out)])
    return out


# ---- entry points --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MAINS))
def test_quick_run_writes_json_report_and_figure(quick_reports, name):
    report = json.loads((quick_reports / f"{name}.json").read_text())
    assert report["benchmark"] == name and report["quick"] is True
    assert set(report) >= {"settings", "results", "machine", "git_commit", "duration_s"}
    assert "targets" in report["results"]["headline"]
    assert (quick_reports / f"{name}.png").stat().st_size > 10_000


def test_quick_lora_report_trains_only_the_adapters_of_the_same_model(quick_reports):
    results = json.loads((quick_reports / "lora_update.json").read_text())["results"]
    full, lora = results["full"], results["lora"]
    assert 0 < lora["trained_parameters"] < full["trained_parameters"]
    assert lora["optimizer_state_bytes"] == 8 * lora["trained_parameters"]  # two fp32 moments
    assert results["headline"]["lora_vs_full_optimizer_memory"] == pytest.approx(
        lora["optimizer_state_bytes"] / full["optimizer_state_bytes"])
    assert all(t > 0 for t in full["step_seconds"] + lora["step_seconds"])


def test_quick_dtype_report_steps_both_dtypes_alike_and_its_ratio_is_of_their_medians(quick_reports):
    results = json.loads((quick_reports / "step_dtype.json").read_text())["results"]
    steps = results["default_step"]["steps"]
    assert len(steps["float32"]) == len(steps["bfloat16"]) == 2
    # the same weights, seeds and prompts: both trainers generate from step 0 on
    assert all(s["tokens/generated"] > 0 for rows in steps.values() for s in rows)
    summary = results["default_step"]["summary"]
    assert results["headline"]["float32_over_bfloat16_step"] == pytest.approx(
        summary["float32"]["time/step"] / summary["bfloat16"]["time/step"])
    assert summary["float32"]["time/step"] == steps["float32"][1]["time/step"]  # step 0 is reported apart
    assert set(results["cpu_bf16_flags"]) == set(BF16_CPU_FLAGS)
    # the FLOPs of each phase, counted on a second trainer per dtype taking the same steps: the model's FLOPs
    # in the rollouts and the update, the phases within the step's total
    flops = results["default_step"]["flops"]
    for step in flops["float32"] + flops["bfloat16"]:
        assert step["rollout"] > 0 and step["update"] > 0
        assert sum(v for k, v in step.items() if k != "total") <= step["total"]
    for dtype, limits in results["roofline"].items():
        assert results["matmul_peak"][dtype]["gflops"] > 0
        for phase in limits["phases"].values():
            assert 0 <= phase["share_of_peak"] <= 1 and phase["gflops"] == pytest.approx(phase["gflop"] / phase["seconds"])
        assert 0 < limits["outside_model_compute_share"] < 1 and limits["step_over_compute_bound"] > 1
    assert results["auto_precision"] in ("float32", "bfloat16")
    assert {"import torch", "import prefect", "import mlflow", "mlflow run on an existing SQLite store"} <= set(
        results["startup_seconds"])
    assert all(m["float32_gflops"] > 0 and m["bfloat16_gflops"] > 0 for m in results["matmul"])


def test_quick_step_report_splits_the_step_and_the_profile_adds_up(quick_reports):
    results = json.loads((quick_reports / "real_task_step.json").read_text())["results"]
    assert set(real_task_step.VARIANTS) == {"full", "lora", "full_bf16", "lora_bf16"}
    for arm in real_task_step.VARIANTS:
        seconds = results[arm]["seconds_median"]
        assert 0 < sum(seconds[k] for k in real_task_step.COMPONENTS) <= seconds["time/step"] * 1.001
        assert results[arm]["trajectories"] == [16.0]
    profile = results["profile_full_step"]
    assert sum(profile["parts"].values()) == pytest.approx(profile["step_seconds"])
    assert profile["parts"]["model forward (rollouts, predictor, update)"] > 0
    assert profile["parts"]["autograd backward"] > 0 and profile["parts"]["optimizer step"] > 0
    assert 0 < profile["of_which_forward"]["linear layers"] < profile["parts"]["model forward (rollouts, predictor, update)"]


def test_quick_solver_report_is_exact_on_small_cases(quick_reports):
    results = json.loads((quick_reports / "solver_speed.json").read_text())["results"]
    assert results["root_brute_force"]["dp_max_gap"] == pytest.approx(0.0, abs=1e-12)
    assert results["root_brute_force"]["dual_bound_violations"] == 0
    assert all(row["budget_met"] and row["gap"] < 1e-12 for row in results["prefix"])
    assert "B=64, M=8192, m_max=16: M=8192 > B*m_max=1024" in results["headline"]["infeasible_root_pairs"]


def test_quick_allocation_report_spends_equal_budgets(quick_reports):
    summary = json.loads((quick_reports / "allocation_quality.json").read_text())["results"]["summary"]
    for arm, by_setting in summary.items():
        for cell in by_setting.values():
            trajectories = cell["metrics"]["rollout/trajectories"]["mean"]
            assert trajectories == 128 if arm != "dapo" else trajectories <= 128


def test_quick_engine_generates_the_same_number_of_tokens_as_generate(quick_reports):
    rows = json.loads((quick_reports / "rollout_engine.json").read_text())["results"]["models"]["tiny"]["throughput"]
    for row in rows:
        assert row["engine_tokens"] == row["hf_generate_tokens"] == row["batch"] * row["new_tokens"]


def test_headline_table_lists_every_target(quick_reports):
    reports = {name: json.loads((quick_reports / f"{name}.json").read_text()) for name in MAINS}
    table = run_all.headline_table(reports)
    for phrase in ("grpo", "certified gap", "model.generate", "shared prefix", "orchestration", "dvc repro",
                   "real-task step"):
        assert phrase in table


def test_summary_only_rewrites_the_summary_from_the_reports_without_running_any(quick_reports, monkeypatch):
    monkeypatch.setattr(run_all.subprocess, "run", lambda *a, **k: pytest.fail("--summary-only ran a benchmark"))
    (quick_reports / "summary.md").write_text("stale\n")
    summary = run_all.main(["--quick", "--summary-only", "--out", str(quick_reports)])
    assert set(summary["runs"]) == set(MAINS) and all(r["from_earlier_run"] for r in summary["runs"].values())
    assert "real-task step" in (quick_reports / "summary.md").read_text()


# ---- helpers: hand-worked values ---------------------------------------------------------------------------
def _tree(uid, trajectories, tree_id=None):
    """One tree: each trajectory is (rewards along is ignored) a list of observation texts then a reward."""
    tree = RolloutTree(tree_id=tree_id or f"t/{uid}", prompt_uid=uid, data_source="simulator", example_id=uid)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, text="task")
    for observations, reward in trajectories:
        parent = 0
        for t, obs in enumerate(observations):
            parent = tree.add_node(parent, turn_idx=t, origin=Origin.ROLLOUT, observation_text=obs,
                                   loss_mask=[1]).node_id
        tree.add_node(parent, turn_idx=len(observations), origin=Origin.ROLLOUT, reward=float(reward),
                      finish_reason=FinishReason.TERMINATED, loss_mask=[1])
    return tree


def test_empirical_bayes_prior_matches_the_moment_equations():
    # rates [0.25, 0.75, 0.25, 0.75] from n=4: mu = 0.5, var = 0.0833 (ddof 1),
    # rho = (4 * 0.0833 / 0.25 - 1) / 3 = 1/9, alpha + beta = 9 - 1 = 8 -> (4, 4)
    trees = [_tree(f"p{i}", [([], r) for r in rewards]) for i, rewards in
             enumerate([[1, 0, 0, 0], [1, 1, 1, 0], [0, 1, 0, 0], [1, 0, 1, 1]])]
    assert allocation_quality.empirical_bayes_prior(trees) == pytest.approx((4.0, 4.0))
    # all-or-nothing prompts: rho clips to 0.999, the concentration floors at 0.05 -> (0.025, 0.025)
    polar = [_tree(f"q{i}", [([], r)] * 4) for i, r in enumerate([0, 0, 1, 1])]
    assert allocation_quality.empirical_bayes_prior(polar) == pytest.approx((0.025, 0.025))


def test_history_path_predictor_leaves_out_the_outcome_below_each_prefix():
    predictor = allocation_quality.HistoryPathPredictor(1.0, 1.0)
    tree = _tree("p", [(["progress up"], 1), (["progress down"], 0), (["progress down"], 0)])
    mean, features = predictor._tree_features(tree)
    # root: its own outcomes are its label -> the prior alone, 1 / 2
    assert mean[0] == pytest.approx(0.5)
    # node 1 (trajectory of reward 1): prior + the two other failures -> 1 / 4
    assert mean[1] == pytest.approx(0.25)
    # node 3 (a failure): prior + one success and one failure from the others -> 2 / 4
    assert mean[3] == pytest.approx(0.5)
    assert features[1, 3:].tolist() == [1.0, 1.0, 1.0]  # ups - downs, last, turns
    assert features[3, 3:].tolist() == [-1.0, -1.0, 1.0]


def test_history_path_predictor_never_reads_true_success_probabilities():
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=16), seed=0)
    trees = env.sample_root_rollouts(env.prompts(), [4] * 16, np.random.default_rng(0))
    predictor = allocation_quality.HistoryPathPredictor(0.5, 0.5)
    predictor.fit(trees[:8])
    ids = [list(range(len(t.nodes) - 1)) for t in trees[8:]]
    before = predictor.predict_trees(trees[8:], ids)
    for tree in trees[8:]:
        for node in tree.nodes:
            node.true_success_prob = None
    after = predictor.predict_trees(trees[8:], ids)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_count_mixed_groups_follows_the_metric_definitions():
    tree = _tree("p", [(["progress up"], 1), (["progress down"], 0)])
    # two branches below node 1 (the rewarded trajectory's first turn), both rewarded: an unmixed anchor group
    for _ in range(2):
        tree.add_node(1, turn_idx=1, origin=Origin.BRANCH, branch_anchor_id=1, reward=1.0,
                      finish_reason=FinishReason.TERMINATED, loss_mask=[1])
    assert allocation_quality.count_mixed_groups([tree]) == (1, 0)
    assert rollout_metrics([tree])["mixed_group_ratio"] == pytest.approx(1 / 2)  # prompt group of 2 groups


def test_simulated_step_spends_the_trajectory_budget_for_every_arm():
    acfg = AllocationConfig(trajectory_budget=32, num_candidates=8, group_size=4, m_max=8)
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=32), seed=1)
    oracle = make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)
    for arm in ARMS:
        _, metrics = allocation_quality.simulated_step(get_arm(arm), env, env.prompts(), oracle, acfg,
                                                       seed=0, step=0,
                                                       state=make_allocator_state(get_arm(arm), acfg))
        assert metrics["rollout/trajectories"] == 32 or (arm == "dapo" and metrics["rollout/trajectories"] <= 32)
        # the audit of each arm: a forecast only where the arm reads predictions
        assert metrics["audit/groups"] == metrics["rollout/prompts"]
        assert np.isnan(metrics["audit/expected_mixed_groups"]) != get_arm(arm).uses_predictor
        assert set(allocation_quality.METRIC_KEYS) >= {"audit/expected_flips", "audit/flips", "audit/anchors"}


def _root_counts(trees):
    return np.array([sum(1 for n in t.nodes[1:] if n.origin == Origin.ROLLOUT and n.turn_idx == 0) for t in trees])


def test_simulated_step_solves_the_configured_root_objective():
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=64), seed=2)
    oracle = make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)
    runs = {}
    for objective in ("groups", "leaves"):
        acfg = AllocationConfig(m_min=4, root_objective=objective)
        trees, metrics = allocation_quality.simulated_step(get_arm("trace_root"), env, env.prompts(), oracle, acfg,
                                                           seed=0, step=0)
        counts = _root_counts(trees)
        p = np.array([t.root.pred_success_prob for t in trees])
        weight = counts if objective == "leaves" else 1
        # the logged stage-1 objective is that of the sampled counts, under the configured objective
        assert metrics["allocation/root_objective"] == pytest.approx(
            float(np.sum(weight * (1 - p ** counts - (1 - p) ** counts))))
        runs[objective] = counts
    assert runs["groups"].sum() == runs["leaves"].sum() == 128
    assert runs["leaves"].size < runs["groups"].size  # fewer, larger groups


def test_default_benchmark_step_is_the_groups_objective():
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=64), seed=3)
    oracle = make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=env)
    steps = [allocation_quality.simulated_step(get_arm("trace"), env, env.prompts(), oracle, acfg, seed=0, step=1)
             for acfg in (AllocationConfig(), AllocationConfig(root_objective="groups"))]
    assert steps[0][1] == steps[1][1]
    np.testing.assert_array_equal(_root_counts(steps[0][0]), _root_counts(steps[1][0]))


def test_t_interval_matches_the_hand_value():
    # [0.6, 0.7, 0.8]: mean 0.7, s = 0.1, t_{0.975, 2} = 4.3027: 0.7 +- 4.3027 * 0.1 / sqrt(3) = 0.7 +- 0.24842
    stat = allocation_quality.t_interval([0.6, 0.7, 0.8])
    assert stat["mean"] == pytest.approx(0.7) and stat["n"] == 3
    assert stat["half_width"] == pytest.approx(0.24842, abs=1e-5)
    assert (stat["low"], stat["high"]) == pytest.approx((0.7 - 0.24842, 0.7 + 0.24842), abs=1e-5)
    assert np.isnan(allocation_quality.t_interval([0.5])["half_width"])


def test_quick_objective_comparison_reports_both_objectives(tmp_path):
    results = allocation_quality.compare_objectives(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "allocation_objectives.json").read_text())
    assert report["benchmark"] == "allocation_objectives" and (tmp_path / "allocation_objectives.png").exists()
    for m_min in (4, 8):
        for arm in ("trace", "trace_root"):
            cell = results[f"m_min={m_min}"]["oracle"][arm]
            assert cell["groups"]["effective_ratio"]["n"] == cell["leaves"]["effective_ratio"]["n"] == 2
            assert cell["leaves_minus_groups"]["mean"] == pytest.approx(
                cell["leaves"]["effective_ratio"]["mean"] - cell["groups"]["effective_ratio"]["mean"])
            # leaves spends the same roots on fewer, larger groups
            assert cell["leaves"]["active_prompt_ratio"]["mean"] < cell["groups"]["active_prompt_ratio"]["mean"]


def test_solver_brute_force_check_covers_both_objectives():
    for objective in ("groups", "leaves"):
        check = solver_speed.brute_force_check(np.random.default_rng(0), 6, root_objective=objective)
        assert check["root_objective"] == objective and check["cases"] == 6
        assert check["dp_max_gap"] == pytest.approx(0.0, abs=1e-12) and check["dual_bound_violations"] == 0
        assert check["lagrangian_max_true_gap"] <= check["lagrangian_max_certified_gap"] + 1e-12


def test_root_feasibility_names_infeasible_pairs():
    assert solver_speed.root_feasibility(64, 8192, 2, 16) == "M=8192 > B*m_max=1024"
    assert solver_speed.root_feasibility(4096, 65536, 2, 16) is None
    assert solver_speed.root_feasibility(4, 3, 2, 2) == "no k <= 4 with 2k <= 3 <= 2k"


def test_heap_reference_equals_the_vectorised_prefix_allocator():
    rng = np.random.default_rng(3)
    probs = rng.random(50)
    rewards = (rng.random(50) < probs).astype(float)
    counts = allocate_prefixes(rewards, probs, 80)
    assert solver_speed.heap_prefix_objective(rewards, probs, 80) == pytest.approx(
        float(prefix_value(rewards, probs, counts).sum()), rel=1e-12)


def test_quick_logprob_chunks_report_times_both_ways_and_they_agree_bit_for_bit(tmp_path):
    from benchmarks import logprob_chunks

    results = logprob_chunks.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "logprob_chunks.json").read_text())
    assert report["results"]["same_bits"] is True and report["settings"]["torch_threads"] == 1
    assert report["settings"]["processes"] == ["chunked", "per_sequence"]
    # each process stepped with its own way: the reference's calls counted in the per-sequence one alone
    calls = report["results"]["per_sequence_calls"]
    assert calls["chunked"] == [0] and calls["per_sequence"][0] >= 4
    assert len(results["seconds"]["chunked"]) == len(results["seconds"]["per_sequence"]) == 2
    assert results["speedup"] == pytest.approx(results["median_seconds"]["per_sequence"]
                                               / results["median_seconds"]["chunked"])


def test_the_per_sequence_reference_is_the_chunked_log_probs_and_a_difference_shows(monkeypatch):
    import torch

    from benchmarks import logprob_chunks
    from trace.losses import token_logprobs

    gen = torch.Generator().manual_seed(2)
    logits, ids = torch.randn(5, 7, 13, generator=gen).to(torch.bfloat16), torch.randint(0, 13, (5, 7), generator=gen)
    assert torch.equal(logprob_chunks.per_sequence_logprobs(logits, ids), token_logprobs(logits, ids))
    assert logprob_chunks.same_bits(logits, ids)
    monkeypatch.setattr(logprob_chunks, "per_sequence_logprobs", lambda x, i: token_logprobs(x, i) * (1 + 2 ** -10))
    assert not logprob_chunks.same_bits(logits, ids)
