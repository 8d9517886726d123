"""A ZeRO checkpoint written by 2 ranks resumes on 1 rank through a DeepSpeed universal checkpoint.

Two gloo processes (CPU) train a tiny Qwen3 for two RL steps under ZeRO-2, save, and take a third step; the
checkpoint is converted with ``convert_to_universal_checkpoint`` and loaded by a single process (the test's
own) with ``universal=True``, which takes the same third step. Every rank sees the same trees, so the global token-mean
loss, and with it every optimizer step, is the same for 2 ranks and for 1: the third step's weights must
agree, which needs the fp32 weights, both Adam moments and the step counter restored. A fresh optimizer on the
restored weights (what a weights-only ``zero_to_fp32`` export gives) takes a different step.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
ZERO_STAGE = 2


def _tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, attn_implementation="eager",
                      pad_token_id=2, eos_token_id=2, bos_token_id=1)
    return Qwen3ForCausalLM(cfg)


def _trees():
    from trace.tree import Origin, RolloutTree

    trees = []
    for i in range(4):
        tree = RolloutTree(tree_id=f"t{i}", prompt_uid=f"p{i}", data_source="toy", example_id=str(i))
        tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=[1, 5 + i], logprobs=[0.0, 0.0],
                      loss_mask=[0, 0])
        tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, token_ids=[7, 8 + i, 9], logprobs=[-1.0, -1.2, -2.0],
                      loss_mask=[1, 1, 1], advantage=1.0 if i % 2 else -0.5)
        trees.append(tree)
    return trees


def run_rank(mode: str, folder: str) -> None:
    """One rank's work: ``save`` (2 steps, checkpoint, 1 step) or ``resume`` (universal load, 1 step)."""
    from trace.configuration.config import UpdateConfig
    from trace.update import PolicyUpdater

    cfg = UpdateConfig(lr=1e-2, micro_batch_size=2, zero_stage=ZERO_STAGE)
    updater = PolicyUpdater(_tiny_model(), cfg, pad_token_id=2)
    out = Path(folder)
    if mode == "save":
        for _ in range(2):
            updater.rl_step(_trees())
        updater.save_checkpoint(out / "ckpt", tag="step2")
    else:
        updater.load_checkpoint(out / "ckpt", tag="step2_universal", universal=True)
        assert updater.num_optimizer_steps == 2
        restored = updater.policy_state_dict()
    updater.rl_step(_trees())
    weights = updater.policy_state_dict()
    if int(os.environ["RANK"]) == 0:
        torch.save(weights, out / f"{mode}_step3.pt")
    if mode == "resume":  # the same weights with a fresh optimizer: a weights-only export
        fresh = _tiny_model()
        fresh.load_state_dict(restored)
        fresh_updater = PolicyUpdater(fresh, cfg, pad_token_id=2)
        fresh_updater.rl_step(_trees())
        torch.save(fresh_updater.policy_state_dict(), out / "fresh_optimizer_step3.pt")


def _launch(world_size: int, mode: str, folder: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO_ROOT))
        procs.append(subprocess.Popen(
            [sys.executable, "-c",
             f"from tests.test_update_reshard import run_rank; run_rank({mode!r}, {str(folder)!r})"],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"{mode} rank {rank}/{world_size} failed:\n{log[-3000:]}"


@pytest.mark.slow
def test_a_two_rank_zero2_checkpoint_resumes_on_one_rank_through_a_universal_checkpoint(tmp_path):
    from trace.update import convert_to_universal_checkpoint

    _launch(2, "save", tmp_path)
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step2").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert convert_to_universal_checkpoint(tmp_path / "ckpt", "step2") == "step2_universal"
    assert (tmp_path / "ckpt" / "latest_universal").read_text().strip() == "step2_universal"
    run_rank("resume", str(tmp_path))  # in this process: world size 1
    two_ranks = torch.load(tmp_path / "save_step3.pt")
    one_rank = torch.load(tmp_path / "resume_step3.pt")
    fresh = torch.load(tmp_path / "fresh_optimizer_step3.pt")
    assert two_ranks.keys() == one_rank.keys()
    for name in two_ranks:
        torch.testing.assert_close(one_rank[name], two_ranks[name], atol=1e-6, rtol=0)
    assert max((fresh[k] - two_ranks[k]).abs().max().item() for k in two_ranks) > 1e-4


def test_converting_a_missing_checkpoint_names_the_folder(tmp_path):
    from trace.update import convert_to_universal_checkpoint

    with pytest.raises(FileNotFoundError, match="step9"):
        convert_to_universal_checkpoint(tmp_path, "step9")
