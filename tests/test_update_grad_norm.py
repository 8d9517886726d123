"""``losses/grad_norm`` is the norm of the gradient the optimizer applies, averaged over data-parallel ranks.

Two gloo processes (CPU) each train on half of four trees (rank r takes trees r and r + 2) for two RL steps;
this process trains on all four alone. Each rank's loss is divided by the global token count and DeepSpeed
averages the ranks' gradients, so the applied gradient is the single-rank one on the union: the logged norm
must be the same on both ranks and equal the single-rank norm, and the weights after each step must agree
(the same gradient, clipped at the same norm, was applied). A rank's own gradient has another norm (at
2 ranks with these trees about twice the applied one).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
ZERO_STAGES = (0, 2)  # stage 0 fp32 clips in the updater's optimizer hook; stage 2 reports DeepSpeed's norm
MAX_GRAD_NORM = 0.05  # below every step's norm: clipping acts, so the weights show which norm it used


def _tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, attn_implementation="eager",
                      pad_token_id=2, eos_token_id=2, bos_token_id=1)
    return Qwen3ForCausalLM(cfg)


def _trees():
    """Four one-turn trees of different lengths and advantages (so the two ranks' gradients differ)."""
    from trace.tree import Origin, RolloutTree

    trees = []
    for i in range(4):
        tree = RolloutTree(tree_id=f"t{i}", prompt_uid=f"p{i}", data_source="toy", example_id=str(i))
        tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=[1, 5 + i], logprobs=[0.0, 0.0],
                      loss_mask=[0, 0])
        generated = [7, 8 + i, 9, 10 + i][: 2 + i % 3]
        tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, token_ids=generated,
                      # near the initial model's log(1/32) = -3.47: ratios inside the clip range, so every
                      # token carries gradient
                      logprobs=[-3.4 - 0.05 * t for t in range(len(generated))], loss_mask=[1] * len(generated),
                      advantage=1.0 if i % 2 else -0.5 - 0.25 * i)
        trees.append(tree)
    return trees


def run_rank(folder: str) -> None:
    """Two RL steps per ZeRO stage on this rank's trees (all four at world size 1); writes the logged norms
    and the weights after each step (rank 0) to ``<folder>/<world size>ranks_stage<s>_rank<r>.json|.pt``."""
    from trace.configuration.config import UpdateConfig
    from trace.update import PolicyUpdater

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    trees = _trees()[rank::world_size]
    for stage in ZERO_STAGES:
        cfg = UpdateConfig(lr=1e-2, micro_batch_size=2, zero_stage=stage, max_grad_norm=MAX_GRAD_NORM)
        updater = PolicyUpdater(_tiny_model(), cfg, pad_token_id=2)
        norms, weights = [], []
        for _ in range(2):
            norms.append(updater.rl_step(trees)["losses/grad_norm"])
            weights.append(updater.policy_state_dict())
        name = Path(folder) / f"{world_size}ranks_stage{stage}_rank{rank}"
        name.with_suffix(".json").write_text(json.dumps(norms))
        if rank == 0:
            torch.save(weights, name.with_suffix(".pt"))


def _launch(world_size: int, folder: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO_ROOT))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", f"from tests.test_update_grad_norm import run_rank; run_rank({str(folder)!r})"],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank}/{world_size} failed:\n{log[-3000:]}"


def _first_step_gradient_norm(trees, scale: float) -> float:
    """The norm of ``scale`` times the gradient of the token-mean surrogate of ``trees`` at the initial weights,
    normalised by the token count of all four trees (as every rank normalises), computed by hand."""
    from trace.losses import clipped_surrogate_loss, token_logprobs
    from trace.update import build_training_batch

    model = _tiny_model()
    num_tokens = build_training_batch(_trees(), 2).num_tokens
    batch = build_training_batch(trees, 2)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits
    loss, _ = clipped_surrogate_loss(token_logprobs(logits, batch.input_ids), batch.old_logprobs, batch.advantages,
                                     batch.loss_mask, num_tokens=num_tokens)
    (loss * scale).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                       if p.grad is not None])))


@pytest.mark.slow
def test_at_two_ranks_the_logged_grad_norm_is_the_norm_of_the_averaged_gradient_the_optimizer_applies(tmp_path):
    _launch(2, tmp_path)
    run_rank(str(tmp_path))  # in this process: world size 1, all four trees
    for stage in ZERO_STAGES:
        single = json.loads((tmp_path / f"1ranks_stage{stage}_rank0.json").read_text())
        for rank in range(2):
            logged = json.loads((tmp_path / f"2ranks_stage{stage}_rank{rank}.json").read_text())
            assert logged == pytest.approx(single, rel=1e-5), (stage, rank)
        assert min(single) > MAX_GRAD_NORM  # every step was clipped, at the norm logged
        two_ranks = torch.load(tmp_path / f"2ranks_stage{stage}_rank0.pt")
        one_rank = torch.load(tmp_path / f"1ranks_stage{stage}_rank0.pt")
        for step, (ours, theirs) in enumerate(zip(two_ranks, one_rank)):
            for name in theirs:
                torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5,
                                           msg=f"stage {stage} step {step}: {name}")
        # the first step's gradient by hand: the union's, which is what the ranks' average is
        assert single[0] == pytest.approx(_first_step_gradient_norm(_trees(), 1.0), rel=1e-5)
    # rank 0's own gradient, as it enters the average (its share of the global token-mean loss, times 2), has
    # another norm: a rank-local norm would not pass the checks above
    local = [_first_step_gradient_norm(_trees()[rank::2], 2.0) for rank in range(2)]
    assert all(abs(norm - single[0]) > 0.2 * single[0] for norm in local), (local, single[0])
