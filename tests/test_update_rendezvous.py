"""Training processes started together never race for a rendezvous port.

A single-process update builds its ``torch.distributed`` group over a file (``init_process_group``), so it
binds no port that another process could take first. The test makes the race certain for any code that picks
a free port and binds it later: the processes run in a private network namespace whose ephemeral port range
holds 16 ports, so two processes that each pick a "free" port pick the same one within a few starts.
A DeepSpeed-launched stage that still loses its port to another process is relaunched on a new one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One single-rank update: the tiny policy, a DeepSpeed engine, one supervised step on one demonstration.
UPDATE = r"""
import torch
from trace.configuration.config import PolicyConfig, UpdateConfig
from trace.policy.model import build_tiny_policy
from trace.tree import Origin, RolloutTree, make_prompt_uid
from trace.update import PolicyUpdater

words = ["question", ":", "search", "finish", "[", "]", "e1", "e2"]
policy = build_tiny_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                        intermediate_size=64), words, seed=0)
updater = PolicyUpdater(policy.model, UpdateConfig(lr=1e-2, micro_batch_size=4),
                        pad_token_id=policy.tokenizer.pad_token_id)
tree = RolloutTree(tree_id="toy/0", prompt_uid=make_prompt_uid("toy", "0"), data_source="toy", example_id="0")
tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=[5, 6, 7], logprobs=[0.0] * 3, loss_mask=[0] * 3)
tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, token_ids=[8, 9, 10], logprobs=[-1.0] * 3, loss_mask=[1] * 3)
metrics = updater.sft_step([tree])
assert torch.isfinite(torch.tensor(metrics["losses/sft"])), metrics
print("UPDATED", flush=True)
"""

# Rounds of processes started at once, each round more processes than cores.
ROUNDS = 2
PROCESSES = max(4, (os.cpu_count() or 1) + 2)
PORT_RANGE = "40001 40016"


def _child_env() -> dict[str, str]:
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _can_make_a_network_namespace() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_make_a_network_namespace(),
                    reason="needs `unshare -n` and `ip` (root, iproute2) for a private network namespace")
def test_single_rank_updates_started_together_never_collide_on_a_port(tmp_path):
    script = tmp_path / "update.py"
    script.write_text(UPDATE)
    # one namespace for all processes: loopback up, 16 ephemeral ports; then every process at once
    starts = " ".join(f"{sys.executable} {script} > {tmp_path}/out.$round.{i} 2>&1 & " for i in range(PROCESSES))
    shell = (f"ip link set lo up && sysctl -q -w net.ipv4.ip_local_port_range='{PORT_RANGE}' && "
             f"for round in $(seq 1 {ROUNDS}); do {starts} wait; done")
    proc = subprocess.run(["unshare", "-n", "sh", "-c", shell], cwd=ROOT, env=_child_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outputs = {path.name: path.read_text() for path in sorted(tmp_path.glob("out.*"))}
    assert len(outputs) == ROUNDS * PROCESSES
    collided = [name for name, text in outputs.items() if "EADDRINUSE" in text or "address already in use" in text]
    assert not collided, f"{len(collided)} of {len(outputs)} updates lost their port:\n{outputs[collided[0]][-3000:]}"
    failed = [name for name, text in outputs.items() if "UPDATED" not in text]
    assert not failed, f"{len(failed)} updates failed:\n{outputs[failed[0]][-3000:]}"


def test_a_single_process_group_is_built_over_a_file_and_binds_no_port(monkeypatch):
    """In-process: the group exists after the updater's set-up, and no MASTER_PORT was invented for it."""
    import torch.distributed as dist

    from trace.update import init_distributed_env, init_process_group

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    init_distributed_env()
    assert "MASTER_PORT" not in os.environ
    init_process_group()  # False where another test of this worker built the group first
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
    assert "MASTER_PORT" not in os.environ  # the group needed no port
    assert init_process_group() is False  # idempotent: the existing group is kept


# A stand-in for the deepspeed runner: it reports EADDRINUSE on the first port it is given and trains on the
# next one; every port it is given is appended to a file.
FLAKY_RUNNER = r"""
import sys
from pathlib import Path
ports = Path(sys.argv[1])
port = sys.argv[sys.argv.index("--master_port") + 1]
seen = ports.read_text().split() if ports.exists() else []
ports.write_text(" ".join([*seen, port]))
if not seen:
    print("torch.distributed.DistNetworkError: port: " + port + ", code: -98, name: EADDRINUSE", file=sys.stderr)
    sys.exit(1)
print("TRAINED on", port)
"""


def _fake_runner(monkeypatch, folder: Path, script: str) -> Path:
    """Make ``flows.launch.launch_command`` return ``script`` (with the launch args) in place of the runner."""
    import flows.launch as launch

    folder.mkdir(exist_ok=True)
    runner, ports = folder / "runner.py", folder / "ports"
    runner.write_text(script)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(launch.LAUNCHED_VAR, raising=False)
    monkeypatch.setattr(launch, "launch_command", lambda cfg, module, argv: [
        sys.executable, str(runner), str(ports), *cfg.args, "--module", module])
    return ports


def test_a_deepspeed_launch_that_lost_its_port_is_launched_again_on_a_new_port(monkeypatch, tmp_path, capfd):
    from flows.launch import relaunch
    from trace.configuration.config import LaunchConfig

    ports = _fake_runner(monkeypatch, tmp_path, FLAKY_RUNNER)
    assert relaunch(LaunchConfig(launcher="deepspeed", num_processes=2), "flows.train", []) == 0
    first, second = ports.read_text().split()
    out, err = capfd.readouterr()
    assert f"TRAINED on {second}" in out and "EADDRINUSE" in out
    assert f"port {first} was taken" in err and "launching again on a new port (2 of 4)" in err


def test_the_port_retries_are_bounded_and_only_for_a_lost_port(monkeypatch, tmp_path, capfd):
    from flows.launch import PORT_TRIES, relaunch
    from trace.configuration.config import LaunchConfig

    launch_cfg = LaunchConfig(launcher="deepspeed", num_processes=2)
    always_lost = _fake_runner(monkeypatch, tmp_path / "lost", FLAKY_RUNNER.replace("if not seen:", "if True:"))
    assert relaunch(launch_cfg, "flows.train", []) == 1
    assert len(always_lost.read_text().split()) == PORT_TRIES
    assert f"giving up after {PORT_TRIES} ports" in capfd.readouterr().err

    other_error = _fake_runner(monkeypatch, tmp_path / "other", FLAKY_RUNNER.replace("EADDRINUSE", "ValueError"))
    assert relaunch(launch_cfg, "flows.train", []) == 1
    assert len(other_error.read_text().split()) == 1  # not a lost port: the failure stands

    given = _fake_runner(monkeypatch, tmp_path / "given", FLAKY_RUNNER)
    with_port = LaunchConfig(launcher="deepspeed", num_processes=2, args=("--master_port", "29611"))
    assert relaunch(with_port, "flows.train", []) == 1  # the user's port: launched once, as given
    assert given.read_text().split() == ["29611"]


def test_a_port_in_the_launch_args_is_read_as_text_as_yaml_gives_it():
    """`-S 'launch.args=[--master_addr,gpu-node-1,--master_port,29500]'` (docs/gpu.md) parses 29500 as an int."""
    from trace.configuration.params_file import load_config

    cfg = load_config(ROOT / "tests" / "params_tiny.yaml", overrides={"launch": {
        "launcher": "deepspeed", "num_processes": 8, "hostfile": "hostfile",
        "args": ["--master_addr", "gpu-node-1", "--master_port", 29500]}})
    assert cfg.launch.args == ("--master_addr", "gpu-node-1", "--master_port", "29500")
