"""``policy.dtype: auto`` / ``update.bf16: auto``: bf16 only where the hardware computes it natively, a bf16 loss
and gradient close to float32's, and a bf16 run as deterministic as a float32 one on one CPU kind."""

import copy
from pathlib import Path

import numpy as np
import pytest

from trace import precision
from trace.configuration.config import Config, PolicyConfig, UpdateConfig, config_from_dict
from trace.configuration.params_file import load_config, read_params_file

ROOT = Path(__file__).resolve().parents[1]

SAPPHIRE_RAPIDS = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                   "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8\n")
ZEN4 = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
ICE_LAKE = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold 6338\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
ZEN2 = "processor\t: 0\nmodel name\t: AMD EPYC 7R32\nflags\t\t: fpu sse2 avx2 fma\n"


@pytest.fixture
def cpu(monkeypatch):
    """Fake the CPU: ``cpu(text)`` makes ``/proc/cpuinfo`` read ``text``, with no CUDA and no override."""
    def fake(text, cuda=None):
        monkeypatch.delenv(precision.ENV_OVERRIDE, raising=False)
        monkeypatch.setattr(precision, "_cpuinfo", lambda: text)
        monkeypatch.setattr(precision, "_cuda_bf16", lambda: cuda)
        precision._detected.cache_clear()
    yield fake
    precision._detected.cache_clear()


@pytest.mark.parametrize("text,flags", [(SAPPHIRE_RAPIDS, ["avx512_bf16", "amx_bf16"]), (ZEN4, ["avx512_bf16"]),
                                        (ICE_LAKE, []), (ZEN2, []), ("", [])])
def test_the_bf16_flags_are_read_from_cpuinfo(text, flags):
    assert precision.cpu_bf16_flags(text) == flags


@pytest.mark.parametrize("text,cuda,native", [(SAPPHIRE_RAPIDS, None, True), (ZEN4, None, True),
                                              (ICE_LAKE, None, False), (ZEN2, None, False),
                                              (ZEN2, True, True),  # an Ampere GPU on an old CPU: bf16
                                              (SAPPHIRE_RAPIDS, False, False)])  # a V100: its CPU does not run the policy
def test_auto_picks_bf16_only_where_the_hardware_has_it(cpu, text, cuda, native):
    cpu(text, cuda)
    assert precision.native_bf16() is native
    cfg = Config()
    assert (cfg.policy.dtype, cfg.update.bf16) == (("bfloat16", True) if native else ("float32", False))
    assert PolicyConfig().dtype == ("bfloat16" if native else "float32")
    assert UpdateConfig().bf16 is native


def test_the_environment_overrides_the_detection(cpu, monkeypatch):
    cpu(SAPPHIRE_RAPIDS)
    monkeypatch.setenv(precision.ENV_OVERRIDE, "0")
    assert Config().policy.dtype == "float32"
    cpu(ZEN2)
    monkeypatch.setenv(precision.ENV_OVERRIDE, "1")
    assert Config().update.bf16 is True
    monkeypatch.setenv(precision.ENV_OVERRIDE, "yes")
    with pytest.raises(ValueError, match="TRACE_NATIVE_BF16='yes'"):
        precision.native_bf16()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("policy,update,expected", [
    ({}, {"bf16": True}, ("bfloat16", True)),  # an explicit update precision decides the weights' too
    ({}, {"bf16": False}, ("float32", False)),
    ({"dtype": "float32"}, {}, ("float32", False)),  # and explicit weights decide the update's
    ({"dtype": "bfloat16"}, {"bf16": "auto"}, ("bfloat16", True)),
    ({"dtype": "float32"}, {"bf16": True}, ("float32", True)),  # both explicit: as written (the presets)
])
def test_an_explicit_setting_is_followed_on_every_cpu(cpu, native, policy, update, expected):
    cpu(SAPPHIRE_RAPIDS if native else ZEN2)
    cfg = config_from_dict({"policy": policy, "update": update})
    assert (cfg.policy.dtype, cfg.update.bf16) == expected


def test_the_default_params_ask_for_auto_and_the_presets_keep_their_weights_in_float32(cpu):
    raw = read_params_file(ROOT / "params.yaml")
    assert raw["policy"]["dtype"] == "auto" and raw["update"]["bf16"] == "auto"
    cpu(SAPPHIRE_RAPIDS)
    assert load_config(ROOT / "params.yaml").policy.dtype == "bfloat16"
    for preset in sorted((ROOT / "params").glob("*.yaml")):
        cfg = load_config(preset)
        assert (cfg.policy.dtype, cfg.update.bf16) == ("float32", True), preset.name


def test_a_run_records_its_precision_and_cpu(cpu, tmp_path):
    from mlflow.tracking import MlflowClient

    from trace.tracking import stage_run

    cpu(SAPPHIRE_RAPIDS)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = Config()
    with stage_run("train", tracking_uri=uri, experiment_name="precision", params=cfg.model_dump(mode="json"),
                   params_hash=cfg.params_hash(), ablation="grpo", seed=0) as run:
        run_id = run.run_id
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["trace.precision"] == "bfloat16"
    assert tags["trace.cpu"] == "Intel(R) Xeon(R) Platinum 8480+ (avx512_bf16, amx_bf16)"
    assert tags["trace.native_bf16"] == "true"


def _loss_and_grads(model, batch):
    import torch

    from trace.losses import clipped_surrogate_loss, token_logprobs

    input_ids, old_logprobs, advantages, mask = batch
    model.zero_grad()
    logprobs = token_logprobs(model(input_ids=input_ids).logits, input_ids)
    loss, _ = clipped_surrogate_loss(logprobs, old_logprobs, advantages, mask)
    loss.backward()
    return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def test_a_bf16_loss_and_gradient_match_float32_on_a_fixed_batch():
    """The default policy's shapes, 16 sequences of 48 tokens, advantages of either sign, the current policy
    1e-2 nats off the sampling one: bf16's loss is within 1e-2 x mean |advantage| of float32's (measured:
    5e-5 at a mean |advantage| of 0.98) and its gradient within 5 % in norm and 0.995 in cosine (measured: 1.3 %,
    1.0000) on an Intel Xeon with AMX."""
    import torch

    from trace.policy.model import build_tiny_policy

    vocabulary = [f"w{i}" for i in range(300)]
    policy = build_tiny_policy(PolicyConfig(dtype="float32"), vocabulary, seed=0)
    model = policy.model.train()
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, model.config.vocab_size, (16, 48), generator=gen)
    mask = torch.zeros(16, 48)
    mask[:, 16:] = 1.0
    with torch.no_grad():
        from trace.losses import token_logprobs

        old = token_logprobs(model(input_ids=input_ids).logits, input_ids)
    old = old + 1e-2 * torch.randn(old.shape, generator=gen)
    advantages = torch.randn(16, 1, generator=gen).expand(16, 48) * mask
    batch = (input_ids, old, advantages, mask)
    loss32, grad32 = _loss_and_grads(model, batch)
    loss16, grad16 = _loss_and_grads(copy.deepcopy(model).to(torch.bfloat16), batch)
    scale = advantages[mask.bool()].abs().mean().item()  # the loss is a mean of -A ratio, ratios near 1
    rel_grad = ((grad16 - grad32).norm() / grad32.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(grad16, grad32, dim=0).item()
    print(f"loss {loss32:.6f} / {loss16:.6f} (scale {scale:.3f}); gradient: relative error {rel_grad:.4f}, "
          f"cosine {cosine:.5f}")
    assert abs(loss16 - loss32) <= 1e-2 * scale, (loss16, loss32)
    assert rel_grad <= 0.05
    assert cosine >= 0.995


@pytest.mark.slow
def test_two_bf16_runs_on_one_cpu_give_the_same_numbers(tmp_path, monkeypatch):
    """Two tiny ``trace`` runs of 2 steps from the same seed in bf16 (DeepSpeed's bf16 update, bf16 rollouts):
    identical metrics and weights."""
    import torch

    from tests.test_loop import tiny_trainer

    monkeypatch.setenv(precision.ENV_OVERRIDE, "1")
    metrics, weights = [], []
    for run in range(2):
        trainer = tiny_trainer("trace", tmp_path / f"run{run}", {"update.bf16": "auto"})
        assert trainer.cfg.policy.dtype == "bfloat16" and trainer.cfg.update.bf16 is True
        metrics.append([{k: float(v) for k, v in trainer.step(step).items() if not k.startswith("time/") and "seconds" not in k}
                        for step in range(2)])
        weights.append({k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()})
        assert next(iter(weights[-1].values())).dtype == torch.bfloat16
    np.testing.assert_equal(metrics[0], metrics[1])  # nan (an undefined AUC) equals nan here
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_report_names_the_precision_and_cpu_of_the_train_runs():
    from trace.reporting.report_markdown import _machine_line

    amx = {"precision": "bfloat16", "cpu": "Intel(R) Xeon(R) Platinum 8480+ (avx512_bf16, amx_bf16)"}
    zen2 = {"precision": "float32", "cpu": "AMD EPYC 7R32 (no native bf16)"}
    same = {"grpo": {0: {"machine": amx}, 1: {"machine": amx}}, "trace": {0: {"machine": amx}}}
    assert _machine_line(same) == f"Train runs in **bfloat16** on {amx['cpu']} (`trace.precision`, `trace.cpu` tags)."
    mixed = {"grpo": {0: {"machine": amx}, 1: {"machine": zen2}}, "trace": {0: {"machine": zen2}}}
    assert _machine_line(mixed) == (f"Train runs on mixed machines: 1 in bfloat16 on {amx['cpu']}; "
                                    f"2 in float32 on {zen2['cpu']}.")
    assert _machine_line({"grpo": {0: {}}}) == ""  # runs logged before the tags existed
