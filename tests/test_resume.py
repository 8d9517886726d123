"""A training run killed with SIGKILL mid-step resumes from its checkpoint and ends bitwise identical."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trace.tree_io import tree_path

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SCRIPT = r"""
import sys, json
from pathlib import Path
from trace.configuration.params_file import load_config
from trace.envs.registry import make_environment
from trace.training.loop import Trainer
from trace.policy.model import build_tiny_policy
from trace.predictor import make_predictor

run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
cfg = load_config(sys.argv[3], overrides={"train.num_steps": steps, "train.checkpoint_every": 2,
                                          "train.eval_every": 100, "predictor.kind": "history"})
env = make_environment(cfg.task, cfg.seed)
policy = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=cfg.seed)
trainer = Trainer(cfg, "trace", policy=policy, env=env, train_prompts=env.prompts("train"),
                  eval_prompts=env.prompts("eval"), predictor=predictor, run_dir=run_dir, progress=False)
start = trainer.resume()
print("START", start, flush=True)
trainer.run()
import torch
state = trainer.updater.policy_state_dict()
digest = __import__("hashlib").sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
(run_dir / "weights.sha256").write_text(digest)
(run_dir / "history.json").write_text(json.dumps([{k: v for k, v in h.items() if not k.startswith("time/") and "seconds" not in k}
                                                 for h in trainer.history], sort_keys=True))
"""


_DIST_VARS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def clean_env() -> dict:
    """This process's environment without the distributed variables an in-process DeepSpeed engine set:
    a child inheriting MASTER_PORT would try to listen on a port this process still holds."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(run_dir: Path, steps: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(run_dir), str(steps),
                             str(ROOT / "tests" / "params_tiny.yaml")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _tree_digest(run_dir: Path) -> str:
    from trace.tree_io import read_trees, tree_files

    h = hashlib.sha256()
    paths = [path for _, _, path in tree_files(run_dir / "trees")]
    assert paths, f"no tree files under {run_dir / 'trees'}"
    for path in paths:
        for tree in read_trees(path):
            for node in tree.nodes:
                h.update(repr((tree.tree_id, node.node_id, node.token_ids, node.reward, node.advantage)).encode())
    return h.hexdigest()


def test_killed_run_resumes_and_matches_an_uninterrupted_run(tmp_path):
    env = clean_env()
    steps = 5
    full = _run(tmp_path / "full", steps, env)  # alongside the run to kill: each process keeps about one core busy
    killed_dir = tmp_path / "killed"
    proc = _run(killed_dir, steps, env)
    marker = tree_path(killed_dir / "trees", "trace", 2)
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)  # during step 3, after the checkpoint of step 2
    proc.wait()
    out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, out[-3000:]

    resumed = _run(killed_dir, steps, env)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert "START 2" in out
    assert (killed_dir / "weights.sha256").read_text() == (tmp_path / "full" / "weights.sha256").read_text()
    assert _tree_digest(killed_dir) == _tree_digest(tmp_path / "full")
    full_hist = (tmp_path / "full" / "history.json").read_text()
    assert (killed_dir / "history.json").read_text() == full_hist


def test_resuming_a_finished_run_runs_no_extra_step_and_a_longer_run_only_the_remaining(tmp_path):
    env = clean_env()
    steps_dir = tree_path(tmp_path / "r" / "trees", "trace", 0).parent
    first = _run(tmp_path / "r", 2, env)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:]
    again = _run(tmp_path / "r", 2, env)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and "START 2" in out
    assert sorted(p.name for p in steps_dir.iterdir()) == [tree_path("", "trace", i).name for i in range(2)]
    longer = _run(tmp_path / "r", 4, env)  # the same run extended: only steps 2 and 3 run
    out, _ = longer.communicate(timeout=600)
    assert longer.returncode == 0 and "START 2" in out, out[-3000:]
    assert sorted(p.name for p in steps_dir.iterdir()) == [tree_path("", "trace", i).name for i in range(4)]


