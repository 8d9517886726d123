"""TraceGRPOTrainer (trace/integrations/trl_grpo.py) on TRL 1.16 with a tiny Qwen3 built from a config, on CPU."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402

from examples import trl_trace  # noqa: E402
from trace.integrations import RolloutAllocator  # noqa: E402
from trace.integrations.trl_grpo import ALLOCATOR_STATE_FILE, TraceGRPOTrainer  # noqa: E402

WIDTH = trl_trace.NUM_GENERATIONS


def _trainer(tmp_path, arm="grpo", reward_funcs=trl_trace.repeat_reward, plain=False, allocation=None, **overrides):
    model, tokenizer = trl_trace.build_policy(seed=0)
    kwargs = dict(model=model, processing_class=tokenizer, reward_funcs=reward_funcs,
                  args=trl_trace.grpo_config(str(tmp_path), overrides.pop("max_steps", 1), **overrides),
                  train_dataset=trl_trace.toy_dataset())
    if plain:
        return GRPOTrainer(**kwargs)
    allocator = RolloutAllocator(arm, allocation or trl_trace.allocation_config(), seed=0)
    return TraceGRPOTrainer(allocator=allocator, **kwargs)


def _scored_batch(trainer, seed=1):
    """One generation batch scored by the trainer (rows in group order, before TRL shuffles them)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, read by compute_loss
    batch = next(iter(trainer.get_train_dataloader()))
    torch.manual_seed(seed)
    return batch, trainer._generate_and_score_completions(copy.deepcopy(batch))


def _real_rows(output) -> np.ndarray:
    return (output["completion_mask"] * output["tool_mask"]).sum(dim=1).numpy() > 0


def test_each_prompt_gets_the_allocators_count_and_the_step_spends_exactly_the_budget(tmp_path):
    scored = []

    def counting_reward(completions, target, **kwargs):
        scored.append(len(completions))
        return trl_trace.repeat_reward(completions, target)

    trainer = _trainer(tmp_path, arm="trace", reward_funcs=counting_reward)
    batch = next(iter(trainer.get_train_dataloader()))
    ids = [row["prompt_id"] for row in batch[::WIDTH]]
    # a history that makes the candidates differ: some always solved, some never, some half the time
    trainer.allocator.observe(ids, [[1.0] * 30 if i % 3 == 0 else [0.0] * 30 if i % 3 == 1 else [1.0, 0.0] * 3
                                    for i in range(len(ids))])
    _, output = _scored_batch(trainer)
    counts = trainer.allocator.last.counts
    assert len(set(counts.tolist())) > 1  # the allocation is not uniform, so the check below means something
    real = _real_rows(output).reshape(-1, WIDTH)
    np.testing.assert_array_equal(real.sum(axis=1), counts)
    assert all(row[:c].all() and not row[c:].any() for row, c in zip(real, counts))  # first counts[i] rows
    assert counts.sum() == sum(scored) == trl_trace.TRAJECTORY_BUDGET


def test_pad_rows_get_zero_advantage_and_zero_loss(tmp_path):
    trainer = _trainer(tmp_path, arm="grpo")  # 4 real rows + 4 pads per prompt
    _, output = _scored_batch(trainer)
    counts = trainer.allocator.last.counts
    pad = torch.tensor([j >= c for c in counts for j in range(WIDTH)])
    assert int(pad.sum()) == len(pad) - trl_trace.TRAJECTORY_BUDGET
    assert torch.all(output["advantages"][pad] == 0)
    # the loss of the padded batch is the loss of its real rows alone, numerator and token count alike
    real_only = {k: v[~pad] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in output.items()}
    real_only["num_items_in_batch"] = (output["completion_mask"] * output["tool_mask"])[~pad].sum()
    # and other tokens in the pads leave loss and gradients unchanged
    changed = dict(output)
    changed["completion_ids"] = output["completion_ids"].clone()
    changed["completion_ids"][pad, 0] = trainer.processing_class.convert_tokens_to_ids("red")
    results = []
    for inputs in (output, changed, real_only):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]))
    (loss, grads), (changed_loss, changed_grads), (real_loss, real_grads) = results
    assert loss != 0 and torch.equal(loss, changed_loss) and torch.allclose(loss, real_loss, rtol=1e-6, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(grads, changed_grads))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-9) for a, b in zip(grads, real_grads))


def test_a_prompt_with_all_equal_rewards_contributes_no_gradient(tmp_path):
    def reward(completions, target, prompt_id, **kwargs):
        # the first candidate is always solved, the others by the toy task's rule
        return [1.0 if pid == solved[0] else float(t in c.split()) for c, t, pid in zip(completions, target, prompt_id)]

    solved: list[str] = []
    trainer = _trainer(tmp_path, arm="grpo", reward_funcs=reward)
    batch = next(iter(trainer.get_train_dataloader()))
    solved.append(batch[0]["prompt_id"])
    _, output = _scored_batch(trainer)
    rows = slice(0, WIDTH)  # the first candidate's group: 4 real rows, all rewarded 1, and 4 pads
    assert torch.all(output["advantages"][rows] == 0)
    group = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in output.items()}
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, group).backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in trainer.model.parameters())


def test_allocator_state_survives_a_trl_checkpoint_and_resume(tmp_path):
    straight = _trainer(tmp_path / "straight", arm="mopps", max_steps=3)
    straight.train()
    first = _trainer(tmp_path / "killed", arm="mopps", max_steps=3, save_strategy="steps", save_steps=1)
    first.train()
    checkpoint = tmp_path / "killed" / "checkpoint-2"
    saved = json.loads((checkpoint / ALLOCATOR_STATE_FILE).read_text())
    assert saved["step"] == 2 and saved["rule_state"]
    resumed = _trainer(tmp_path / "killed", arm="mopps", max_steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.allocator.state_dict() == straight.allocator.state_dict()
    assert resumed.allocator.step == 3


def test_with_all_counts_equal_the_loss_is_plain_grpotrainers(tmp_path):
    allocation = trl_trace.allocation_config().model_copy(
        update={"group_size": WIDTH, "trajectory_budget": WIDTH * trl_trace.NUM_CANDIDATES})
    adapter = _trainer(tmp_path / "a", arm="grpo", allocation=allocation)
    plain = _trainer(tmp_path / "b", plain=True)
    results = []
    for trainer in (adapter, plain):
        _, output = _scored_batch(trainer, seed=7)
        results.append((output, trainer.compute_loss(trainer.model, output)))
    (ours, our_loss), (theirs, their_loss) = results
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    assert torch.equal(ours["advantages"], theirs["advantages"])
    assert our_loss.item() != 0 and torch.equal(our_loss, their_loss)


@pytest.mark.parametrize("arm, update, match", [
    ("trace", {"expansion_ratio": 1.0}, r"leaves 16 of trajectory_budget=32 to stage 2"),
    ("tree_random", {"expansion_ratio": 1.0}, r"leaves 16 of trajectory_budget=32 to stage 2"),
    ("grpo", {"m_max": 2 * WIDTH}, rf"up to 16 trajectories \(allocation.m_max=16.*num_generations={WIDTH}"),
    ("vip", {}, rf"allocation.vip.n_max=32.*more than num_generations={WIDTH}"),
    ("grpo", {"trajectory_budget": 1}, r"trajectory_budget=1 is below allocation.m_min=2"),
])
def test_what_the_settings_alone_rule_out_is_refused_when_the_trainer_is_built(tmp_path, arm, update, match):
    allocation = trl_trace.allocation_config().model_copy(update=update)
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, arm=arm, allocation=allocation)


def test_a_fractional_budget_is_refused_at_build_not_truncated(tmp_path):
    model, tokenizer = trl_trace.build_policy(seed=0)
    with pytest.raises(ValueError, match=r"trajectory_budget=31.7 is not a whole number"):
        TraceGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=trl_trace.repeat_reward,
                         args=trl_trace.grpo_config(str(tmp_path), 1), train_dataset=trl_trace.toy_dataset(),
                         allocator=RolloutAllocator("grpo", trl_trace.allocation_config()), trajectory_budget=31.7)


def test_without_trl_the_import_error_names_the_pins_of_requirements(monkeypatch):
    import importlib
    import sys

    pins = [line.strip() for line in (Path(__file__).resolve().parents[1] / "requirements.txt").read_text().splitlines()
            if line.startswith(("trl==", "datasets=="))]
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "trace.integrations.trl_grpo")
    with pytest.raises(ImportError) as err:
        importlib.import_module("trace.integrations.trl_grpo")
    assert len(pins) == 2 and f"pip install {' '.join(pins)}" in str(err.value)
    assert "-e" not in str(err.value)


def test_the_example_loads_deepspeeds_accelerator_before_its_table(monkeypatch, capsys):
    # DeepSpeed logs "Setting accelerator to CPU" when its accelerator module first loads (inside the trainer):
    # the example loads it before the header so that the line does not fall between the header and the rows
    import importlib.util
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed, so nothing logs")
    loaded_at_header: list[bool] = []

    def recording_print(*args, **kwargs):
        if str(args[0]).startswith("arm "):
            loaded_at_header.append("deepspeed.accelerator" in sys.modules)
        print(*args, **kwargs)

    monkeypatch.delitem(sys.modules, "deepspeed.accelerator", raising=False)
    monkeypatch.setattr(trl_trace, "print", recording_print, raising=False)
    monkeypatch.setattr(trl_trace, "run_arm", lambda arm, steps, seed: dict.fromkeys(
        ("steps", "trajectories", "effective_ratio", "reward", "forecast_mixed", "realised_mixed", "seconds"), 1.0))
    trl_trace.main(["--steps", "1", "--arms", "grpo"])
    assert loaded_at_header == [True]
    assert capsys.readouterr().out.splitlines()[-1].split()[0] == "grpo"
