"""The training loop: candidate prompts of a step, and which errors the dapo arm's step absorbs."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace.configuration.config import ConfigError, config_from_dict
from trace.training.seeding import candidate_indices, check_candidate_pool, step_seed

ROOT = Path(__file__).resolve().parents[1]


# ---- candidate prompts -------------------------------------------------------------------------------------
def plain_epoch_slices(num_prompts, num_candidates, seed, step, permutations):
    """Position ``pos`` of the stream is ``permutation(epoch = pos // P)[pos % P]``, with no boundary repair:
    the drawing rule before steps that straddle an epoch were repaired, kept for the divisible pool."""
    out = []
    for pos in range(step * num_candidates, (step + 1) * num_candidates):
        epoch, idx = divmod(pos, num_prompts)
        if epoch not in permutations:
            permutations[epoch] = np.random.default_rng(step_seed(seed, epoch, "epoch")).permutation(num_prompts)
        out.append(permutations[epoch][idx])
    return np.asarray(out, dtype=np.int64)


@pytest.mark.parametrize("num_prompts,num_candidates,seed", [(8000, 32, 0), (64, 32, 0), (96, 32, 5), (6, 6, 1),
                                                             (300, 30, 2)])
def test_a_divisible_pool_draws_exactly_the_plain_epoch_slices(num_prompts, num_candidates, seed):
    # the default run (8,000 prompts, 32 candidates) must draw the same prompts at every step as before
    permutations = {}
    for step in range(2 * num_prompts // num_candidates + 3):  # two epochs and into the third
        np.testing.assert_array_equal(
            candidate_indices(num_prompts, num_candidates, seed, step),
            plain_epoch_slices(num_prompts, num_candidates, seed, step, permutations), err_msg=f"step {step}")


def test_a_step_straddling_an_epoch_boundary_holds_distinct_prompts():
    # positions 48..51: the last two of epoch 0 and the first two of epoch 1; plain slices gave [24, 32, 32, 46]
    idx = candidate_indices(50, 4, 29, 12)
    assert len(set(idx.tolist())) == 4
    assert idx[:2].tolist() == plain_epoch_slices(50, 4, 29, 12, {})[:2].tolist()  # epoch 0's tail is kept


@settings(max_examples=150, deadline=None)
@given(num_prompts=st.integers(1, 90), data=st.data(), seed=st.integers(0, 2 ** 31 - 1),
       num_epochs=st.integers(1, 4))
def test_candidates_are_distinct_and_each_epoch_draws_every_prompt_once(num_prompts, data, seed, num_epochs):
    num_candidates = data.draw(st.integers(1, num_prompts), label="num_candidates")
    num_steps = -(-num_epochs * num_prompts // num_candidates)  # the fewest steps covering E whole epochs
    drawn = [candidate_indices(num_prompts, num_candidates, seed, step) for step in range(num_steps)]
    for step, idx in enumerate(drawn):
        assert idx.dtype == np.int64 and idx.shape == (num_candidates,)
        assert len(set(idx.tolist())) == num_candidates, f"step {step} repeats a prompt: {idx.tolist()}"
    stream = np.concatenate(drawn)
    for epoch in range(num_epochs):
        assert sorted(stream[epoch * num_prompts:(epoch + 1) * num_prompts].tolist()) == list(range(num_prompts))
    counts = np.bincount(stream, minlength=num_prompts)
    assert counts.min() >= num_epochs and counts.max() <= num_epochs + 1
    # a step far into the run, alone, in a fresh call: distinct and the same however often it is drawn
    late = data.draw(st.integers(0, 10 ** 6), label="late_step")
    first = candidate_indices(num_prompts, num_candidates, seed, late)
    assert len(set(first.tolist())) == num_candidates
    np.testing.assert_array_equal(first, candidate_indices(num_prompts, num_candidates, seed, late))


def test_more_candidates_than_prompts_names_the_params_to_change():
    with pytest.raises(ValueError, match=r"allocation.num_candidates=6 exceeds the 5 training prompts"):
        candidate_indices(5, 6, 0, 0)
    with pytest.raises(ValueError, match="allocation.num_candidates"):
        check_candidate_pool(5, 6)
    with pytest.raises(ValueError, match="prepare stage"):
        candidate_indices(0, 1, 0, 0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        candidate_indices(10, 2, 0, -1)


@pytest.mark.parametrize("task,key", [({"name": "kgqa", "kgqa": {"num_train": 20}}, "task.kgqa.num_train"),
                                      ({"name": "simulator", "simulator": {"num_prompts": 20}},
                                       "task.simulator.num_prompts"),
                                      ({"name": "gsm8k", "files": {"max_train": 20}}, "task.files.max_train")])
def test_a_pool_smaller_than_the_candidates_fails_at_config_load(task, key):
    with pytest.raises(ConfigError, match=rf"allocation.num_candidates=32 exceeds {key}=20"):
        config_from_dict({"task": task, "allocation": {"num_candidates": 32}, "train": {"ablations": ["grpo"]}})
    config_from_dict({"task": task, "allocation": {"num_candidates": 20}, "train": {"ablations": ["grpo"]}})


# ---- the dapo arm's step -------------------------------------------------------------------------------------
def tiny_trainer(ablation, run_dir, overrides=None):
    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment
    from trace.training.loop import Trainer
    from trace.policy.model import build_tiny_policy
    from trace.predictor import make_predictor

    cfg = load_config(ROOT / "tests" / "params_tiny.yaml",
                      overrides={"train.eval_every": 100, "predictor.kind": "history", **(overrides or {})})
    env = make_environment(cfg.task, cfg.seed)
    policy = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
    predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=cfg.seed)
    return Trainer(cfg, ablation, policy=policy, env=env, train_prompts=env.prompts("train"),
                   eval_prompts=env.prompts("eval"), predictor=predictor, run_dir=run_dir, progress=False)


@pytest.mark.slow
def test_dapo_step_stops_on_a_retriever_error_inside_the_rollouts(tmp_path, monkeypatch):
    from trace.envs.qa import RetrieverError

    trainer = tiny_trainer("dapo", tmp_path)
    calls = []

    def unreachable(state, action):
        calls.append(action)
        raise RetrieverError("retriever http://127.0.0.1:9/retrieve did not answer")

    monkeypatch.setattr(trainer.env, "step", unreachable)
    with pytest.raises(RetrieverError, match="did not answer"):
        trainer.step(0)
    assert calls


@pytest.mark.slow
def test_dapo_step_stops_when_generation_runs_out_of_memory(tmp_path, monkeypatch):
    import torch

    trainer = tiny_trainer("dapo", tmp_path)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer.backend, "generate", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.step(0)


@pytest.mark.slow
def test_dapo_step_without_a_mixed_group_trains_on_nothing_and_logs_it(tmp_path, monkeypatch):
    from trace.tree_io import read_trees, tree_path

    trainer = tiny_trainer("dapo", tmp_path)
    real_step = trainer.env.step
    monkeypatch.setattr(trainer.env, "step", lambda state, action: dataclasses.replace(real_step(state, action),
                                                                                       reward=0.0))
    metrics = trainer.step(0)
    assert metrics["dapo/no_mixed_group"] == 1.0 and metrics["dapo/kept_groups"] == 0.0
    assert metrics["dapo/rounds"] >= 1.0
    assert metrics["rollout/trajectories"] == trainer.cfg.allocation.trajectory_budget
    assert metrics["effective_ratio"] == 0.0
    assert len(read_trees(tree_path(trainer.trees_root, "dapo", 0))) == metrics["rollout/prompts"]
    # the audit counts every group dapo sampled; none is mixed, and dapo forecasts nothing
    assert metrics["audit/groups"] == metrics["rollout/prompts"] and metrics["audit/mixed_groups"] == 0.0
    assert np.isnan(metrics["audit/expected_mixed_groups"]) and metrics["audit/anchors"] == 0.0


@pytest.mark.slow
def test_a_trace_step_logs_the_allocation_audit_of_its_trees(tmp_path):
    from trace.reporting.audit import AUDIT_METRIC_KEYS, mixed_root_groups
    from trace.tree_io import read_trees, tree_path

    trainer = tiny_trainer("trace", tmp_path)
    logged = []
    trainer.log_metrics = lambda metrics, step: logged.append(metrics)
    metrics = trainer.step(0)
    assert set(AUDIT_METRIC_KEYS) <= set(logged[0])
    trees = read_trees(tree_path(trainer.trees_root, "trace", 0))
    assert metrics["audit/groups"] == len(trees) and metrics["audit/mixed_groups"] == mixed_root_groups(trees)
    assert np.isfinite(metrics["audit/expected_mixed_groups"]) and np.isfinite(metrics["audit/expected_flips"])
    assert 0.0 <= metrics["audit/expected_flips"] <= metrics["audit/anchors"]
    assert metrics["audit/flips"] <= metrics["audit/anchors"]
    assert metrics["audit/anchors"] == sum(n.num_branches > 0 for t in trees for n in t.nodes[1:])


# ---- the probe: a learning curve free of the per-step prompt draw ---------------------------------------------
def end_episodes_at_the_first_turn(monkeypatch):
    """An untrained tiny policy never answers: end each episode at its first turn, rewarded by a checksum of the
    action, so success rates are strictly between 0 and 1 and move when the policy does."""
    import zlib

    from trace.envs.kgqa import KGQAEnvironment

    real_step = KGQAEnvironment.step

    def first_turn_ends(self, state, action):
        result = real_step(self, state, action)
        return dataclasses.replace(result, state=dataclasses.replace(result.state, done=True), observation="",
                                   reward=float(zlib.crc32(repr(action).encode()) % 2), terminated=True,
                                   truncated=False)

    monkeypatch.setattr(KGQAEnvironment, "step", first_turn_ends)


@pytest.mark.slow
def test_the_probe_measures_the_gain_over_the_starting_policy_and_survives_a_resume(tmp_path, monkeypatch):
    from trace.training.evaluation import success_rates
    from trace.tree_io import read_trees, tree_path

    end_episodes_at_the_first_turn(monkeypatch)
    # a large step, so that the policy after 3 updates samples other actions than the starting one
    settings_ = {"train.num_steps": 3, "train.eval_every": 2, "train.checkpoint_every": 2, "update.lr": 0.05}
    plain = tiny_trainer("grpo", tmp_path / "plain", {**settings_, "train.probe_prompts": 0})
    probe = {"train.probe_prompts": 8, "train.probe_samples": 4}
    probed = tiny_trainer("grpo", tmp_path / "probed", {**settings_, **probe})
    # the starting policy's probe, measured apart on the same prompts and seeds
    initial = success_rates(probed.policy, probed.env, probed.train_prompts[:8], probed.cfg.rollout,
                            seed=step_seed(0, 0, "probe"), samples=4, max_context_tokens=256)
    plain_metrics, probed_metrics = plain.run(), probed.run()
    assert "probe/initial" not in plain_metrics[0]
    assert probed_metrics[0]["probe/initial"] == pytest.approx(np.mean(list(initial.values())))
    assert 0.0 < probed_metrics[0]["probe/initial"] < 1.0
    for m in probed_metrics:  # steps 1 and 2 evaluate (every 2 steps and at the end)
        if "accuracy/eval" in m:
            assert m["probe/gain"] == pytest.approx(m["probe/success"] - probed_metrics[0]["probe/initial"])
    assert [("probe/gain" in m) for m in probed_metrics] == [False, True, True]
    assert probed_metrics[-1]["probe/success"] != probed_metrics[0]["probe/initial"]  # the policy moved
    # probing samples on its own seeds: the run's trees are those of the run without it
    for step in range(3):
        a = read_trees(tree_path(plain.trees_root, "grpo", step))
        b = read_trees(tree_path(probed.trees_root, "grpo", step))
        assert [[n.token_ids for n in t.nodes] for t in a] == [[n.token_ids for n in t.nodes] for t in b]
    # a run resumed after step 3 reads the starting policy's probe back from its checkpoint's history
    resumed = tiny_trainer("grpo", tmp_path / "probed", {**settings_, **probe, "train.num_steps": 4})
    assert resumed.resume() == 3  # the checkpoint at the end of the 3 steps
    last = resumed.run()[-1]
    assert last["probe/gain"] == pytest.approx(last["probe/success"] - probed_metrics[0]["probe/initial"])


@pytest.mark.slow
def test_the_in_training_avg_at_k_samples_the_same_streams_at_every_evaluation(tmp_path, monkeypatch):
    import zlib

    import trace.training.loop as loop
    from trace.envs.kgqa import KGQAEnvironment
    from trace.training.evaluation import evaluate_policy

    real_step = KGQAEnvironment.step

    def first_turn_ends(self, state, action):  # success rates strictly between 0 and 1 (see the probe test)
        result = real_step(self, state, action)
        return dataclasses.replace(result, state=dataclasses.replace(result.state, done=True), observation="",
                                   reward=float(zlib.crc32(repr(action).encode()) % 2), terminated=True,
                                   truncated=False)

    monkeypatch.setattr(KGQAEnvironment, "step", first_turn_ends)
    calls = []

    def recording(*args, **kwargs):
        calls.append((kwargs["seed"], kwargs["pass_k"], kwargs["temperature"]))
        return evaluate_policy(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate_policy", recording)
    trainer = tiny_trainer("grpo", tmp_path / "run", {"train.num_steps": 2, "train.eval_every": 1,
                                                      "train.eval_samples": 4, "train.eval_prompts": 16})
    metrics = trainer.run()
    seed = step_seed(trainer.cfg.seed, 0, "eval")
    assert calls == [(seed, 4, trainer.cfg.evaluate.temperature)] * 2  # one seed for every point of the curve
    # the last point is the final policy on those streams: measured again apart, the same avg@3
    again, _ = evaluate_policy(trainer.policy, trainer.env, trainer.eval_prompts[:16], trainer.cfg.rollout, seed=seed,
                               max_context_tokens=trainer.cfg.policy.max_context_tokens, pass_k=4,
                               temperature=trainer.cfg.evaluate.temperature)
    assert metrics[-1]["accuracy/eval_sampled"] == again["accuracy/mean@4"]
    assert 0.0 < metrics[-1]["accuracy/eval_sampled"] < 1.0
    assert trainer.summary()["last/accuracy_eval_sampled"] == metrics[-1]["accuracy/eval_sampled"]
    # without train.eval_samples the curve is greedy only
    plain = tiny_trainer("grpo", tmp_path / "plain", {"train.num_steps": 1, "train.eval_every": 1, "train.eval_samples": 0})
    assert "accuracy/eval_sampled" not in plain.run()[-1]
