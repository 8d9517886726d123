"""Data-parallel training: the split of trees over ranks, the launcher command, and a 2-rank run on gloo that
samples the same trees and ends with the same weights as a 1-rank run, and resumes at another world size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flows.launch import launch_command, relaunch
from trace.configuration.config import ConfigError, LaunchConfig
from trace.configuration.params_file import load_config
from trace.training.parallel import DataParallelSampler, split_longest_first

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "params_tiny.yaml"


# ---- the split -------------------------------------------------------------------------------------------
def test_longest_first_puts_each_item_on_the_least_loaded_rank_and_is_within_the_largest_item_of_even():
    rng = np.random.default_rng(0)
    for _ in range(50):
        costs = rng.integers(1, 200, size=rng.integers(1, 40)).astype(float)
        parts = int(rng.integers(1, 5))
        owner = split_longest_first(costs, parts)
        loads = np.bincount(owner, weights=costs, minlength=parts)
        assert owner.dtype == np.int64 and owner.min() >= 0 and owner.max() < parts
        # LPT: the most loaded bin exceeds the least loaded by at most one item
        assert loads.max() - loads.min() <= costs.max() + 1e-9
    assert split_longest_first([5, 5, 5, 5], 2).tolist() == [0, 1, 0, 1]  # ties: by index, then by bin
    assert split_longest_first([1, 9, 4, 4], 2).tolist() == [1, 0, 1, 1]
    assert split_longest_first([3.0], 2, loads=[10.0, 0.0]).tolist() == [1]  # work placed earlier this step counts
    assert split_longest_first([], 3).tolist() == []


@pytest.mark.parametrize("args,match", [(([1, -1], 2), "finite and >= 0"), (([1, float("nan")], 2), "finite"),
                                        (([1], 0), "num_parts"), (([1], 2, [0.0]), "loads must have 2")])
def test_the_split_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        split_longest_first(*args)


class _Prompt:
    def __init__(self, uid):
        self.prompt_uid = uid


class _Inner:
    """Records what the rank-local sampler was asked for."""

    def __init__(self):
        self.calls = []

    def sample_roots(self, prompts, counts, salt):
        from trace.tree import Origin, RolloutTree

        self.calls.append([p.prompt_uid for p in prompts])
        trees = []
        for p, c in zip(prompts, counts):
            tree = RolloutTree(tree_id=f"x/0/{p.prompt_uid}", prompt_uid=p.prompt_uid, data_source="t", example_id="0")
            tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=[1])
            for _ in range(c):
                tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, token_ids=[2, 3], logprobs=[0.0, 0.0],
                              loss_mask=[1, 1], reward=1.0)
            trees.append(tree)
        return trees


def test_at_world_size_one_the_sampler_samples_everything_and_costs_follow_observed_tokens():
    inner = _Inner()
    costs: dict[str, float] = {}
    sampler = DataParallelSampler(inner, costs, rank=0, world_size=1)
    trees = sampler.sample_roots([_Prompt("a"), _Prompt("b")], [2, 3], "roots")
    assert inner.calls == [["a", "b"]] and sampler.owned(trees) == trees
    sampler.observe(trees)
    assert costs == {"a": 2.0, "b": 2.0}  # generated tokens per trajectory, kept for the next step's split
    assert sampler.split(trees)["parallel/trajectories_share_rank0"] == 1.0


# ---- the launcher ----------------------------------------------------------------------------------------
def test_the_launch_params_build_each_launcher_command_and_never_change_a_result():
    argv = ["--ablation", "trace", "--seed", "1"]
    assert launch_command(LaunchConfig(), "flows.train", argv) is None
    cmd = launch_command(LaunchConfig(launcher="torchrun", num_processes=2), "flows.train", argv)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "flows.train",
                       *argv]
    multi = launch_command(LaunchConfig(launcher="torchrun", num_processes=8, args=("--nnodes", "2")), "m", [])
    assert "--standalone" not in multi and multi[-4:] == ["--nnodes", "2", "-m", "m"]
    ds = launch_command(LaunchConfig(launcher="deepspeed", num_processes=4, hostfile="hosts",
                                     args=("--master_addr", "n1")), "flows.train", argv)
    assert ds[1:] == ["-m", "deepspeed.launcher.runner", "--hostfile", "hosts", "--num_gpus", "4", "--no_local_rank",
                      "--master_addr", "n1", "--module", "flows.train", *argv]
    base = load_config(TINY)
    launched = load_config(TINY, overrides={"launch": {"launcher": "deepspeed", "num_processes": 2}})
    assert launched.params_hash() == base.params_hash() and launched.resume_hash() == base.resume_hash()


def test_a_rank_never_launches_again(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert relaunch(LaunchConfig(launcher="torchrun", num_processes=2), "flows.train", []) is None


@pytest.mark.parametrize("launch,match", [({"num_processes": 2}, "needs a launcher"),
                                          ({"launcher": "torchrun", "hostfile": "h"}, "deepspeed launcher only"),
                                          ({"launcher": "mpirun"}, "launch.launcher")])
def test_bad_launch_params_name_the_key_and_the_fix(launch, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, overrides={"launch": launch})


# ---- a 2-rank run against a 1-rank run -------------------------------------------------------------------
SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch
from trace.configuration.params_file import load_config
from trace.envs.registry import make_environment
from trace.predictor import make_predictor

mode, run_dir, steps, params = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = load_config(params, overrides={
    "train.num_steps": steps, "train.checkpoint_every": 2, "train.eval_every": 100, "predictor.kind": "history",
    "update.zero_stage": 2, "warmup": {"max_steps": 300, "lr": 0.01, "eval_every": 25, "target_low": 0.3,
                                       "target_high": 0.7}})
env = make_environment(cfg.task, cfg.seed)
train, evals = env.prompts("train"), env.prompts("eval")
if mode == "warm":  # one shared warmed policy: the tiny random policy never succeeds
    from trace.policy.model import build_tiny_policy, save_policy
    from trace.training.warmup import run_warmup
    policy = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
    run_warmup(policy, env, train, cfg, progress=False)
    save_policy(policy, run_dir)
    sys.exit(0)
from trace.training.loop import Trainer
from trace.policy.model import load_policy
policy = load_policy(Path(sys.argv[5]))
predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=cfg.seed)
trainer = Trainer(cfg, "trace", policy=policy, env=env, train_prompts=train, eval_prompts=evals,
                  predictor=predictor, run_dir=run_dir, progress=False)
start = trainer.resume()
trainer.run()
state = trainer.updater.policy_state_dict()
if int(os.environ.get("RANK", "0")) == 0:
    print("START", start, flush=True)
    torch.save(state, run_dir / "weights.pt")
    (run_dir / "history.json").write_text(json.dumps(trainer.history))
"""


def _env() -> dict:
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # the same threads per rank in every run
    return env


def _run(args: list[str], ranks: int = 1) -> str:
    """Run ``args`` (the script and its arguments) in one process, or under torchrun on ``ranks`` gloo ranks."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
                if ranks > 1 else [sys.executable])
    proc = subprocess.run([*launcher, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _trees(run_dir: Path) -> list[tuple]:
    from trace.tree_io import read_trees, tree_files

    out = []
    for _, step, path in tree_files(run_dir / "trees"):
        for tree in read_trees(path):
            out.extend((step, tree.tree_id, n.node_id, n.parent_id, tuple(n.token_ids), n.reward, n.num_branches)
                       for n in tree.nodes)
    return out


_ALLOCATION_KEYS = ("allocation/root_objective", "rollout/trajectories", "tokens/generated", "reward/mean",
                    "effective_ratio", "audit/expected_mixed_groups", "update/num_tokens")


@pytest.mark.slow
def test_two_ranks_sample_the_same_trees_and_train_the_same_weights_as_one_and_resume_on_one(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    warm = tmp_path / "warm"
    _run([str(script), "warm", str(warm), "0", str(TINY)])
    one, two, mixed = tmp_path / "one", tmp_path / "two", tmp_path / "mixed"
    _run([str(script), "train", str(one), "4", str(TINY), str(warm)])
    _run([str(script), "train", str(two), "4", str(TINY), str(warm)], ranks=2)
    _run([str(script), "train", str(mixed), "2", str(TINY), str(warm)], ranks=2)  # ZeRO-2 shards of 2 ranks ...
    out = _run([str(script), "train", str(mixed), "4", str(TINY), str(warm)])  # ... resumed on 1 (universal)
    assert "START 2" in out

    reference = _trees(one)
    assert reference and any(node[5] for node in reference), "the warmed policy never succeeded: nothing to train"
    assert _trees(two) == reference and _trees(mixed) == reference
    ref_w = torch.load(one / "weights.pt")
    for other in (two, mixed):
        w = torch.load(other / "weights.pt")
        for name in ref_w:
            torch.testing.assert_close(w[name], ref_w[name], rtol=1e-4, atol=1e-5, msg=f"{other.name}: {name}")
    from trace.policy.model import load_policy

    warm_w = load_policy(warm).model.state_dict()
    assert any(not torch.allclose(warm_w[name], ref_w[name]) for name in ref_w), "no update moved the weights"
    h1, h2 = json.loads((one / "history.json").read_text()), json.loads((two / "history.json").read_text())
    for a, b in zip(h1, h2):
        for key in _ALLOCATION_KEYS:
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-6, equal_nan=True, err_msg=f"{a['step']} {key}")
        assert "parallel/world_size" not in a and b["parallel/world_size"] == 2.0
        shares = [b["parallel/trajectories_share_rank0"], b["parallel/trajectories_share_rank1"]]
        assert sum(shares) == pytest.approx(1.0) and min(shares) >= 0.25, shares  # each rank sampled its part
        if "update/num_sequences" in a:  # ... and trained on its own sequences only
            assert b["update/num_sequences"] < a["update/num_sequences"], a["step"]
    assert json.loads((mixed / "checkpoint" / "train_state.json").read_text())["world_size"] == 1


def test_zero3_with_the_hf_backend_on_several_ranks_is_refused_with_the_reason(tmp_path, monkeypatch):
    """The HF backend generates with the partitioned module (every forward a collective) while ranks sample
    different trees: it would hang, so the trainer refuses it."""
    import trace.training.loop
    from trace.envs.registry import make_environment
    from trace.policy.model import build_tiny_policy
    from trace.predictor import make_predictor

    monkeypatch.setattr(trace.training.loop, "world_size", lambda: 2)
    cfg = load_config(TINY, overrides={"update.zero_stage": 3, "predictor.kind": "history"})
    env = make_environment(cfg.task, cfg.seed)
    policy = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
    with pytest.raises(ValueError, match="zero_stage=3 with rollout.backend=hf on several ranks"):
        trace.training.loop.Trainer(cfg, "trace", policy=policy, env=env, train_prompts=env.prompts("train"),
                           eval_prompts=env.prompts("eval"), predictor=make_predictor(cfg.predictor, env=env,
                                                                                     policy=policy, seed=cfg.seed),
                           run_dir=tmp_path, progress=False)
