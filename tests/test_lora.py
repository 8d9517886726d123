"""LoRA adapters (update.lora): only adapters train, merged weights leave the process, the KL reference is the base."""

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.test_update import EOS, _tiny_policy, rl_trees, sft_trees
from trace.configuration.config import LoraConfig, PolicyConfig, UpdateConfig
from trace.policy.lora import ADAPTER_DIR, apply_lora, is_lora_model, merged_state_dict, save_merged
from trace.policy.model import build_tiny_policy, load_policy, save_policy
from trace.update import PolicyUpdater, init_distributed_env

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
IDS = torch.tensor([[3, 4, 5, 6, 7, 9, 11, 12]])


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_env():
    init_distributed_env()


def _lora_policy(seed: int = 0, lora: LoraConfig = LORA):
    return apply_lora(SimpleNamespace(model=_tiny_policy(seed)), lora, seed=seed)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _base_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.get_base_model().state_dict().items() if ".lora_" not in k}


def test_an_adapted_policy_starts_equal_to_its_base_and_only_the_adapters_train():
    base = _tiny_policy(0)
    policy = _lora_policy(0)
    assert is_lora_model(policy.model)
    assert torch.equal(_logits(policy.model), _logits(base))  # B starts at 0
    frozen = _base_weights(policy.model)
    updater = PolicyUpdater(policy.model, UpdateConfig(lr=1e-2, micro_batch_size=4, lora=LORA), pad_token_id=EOS)
    trainable = {id(p) for group in updater.optimizer.param_groups for p in group["params"]}
    lora_params = {id(p) for n, p in policy.model.named_parameters() if ".lora_" in n}
    assert trainable == lora_params and lora_params
    for _ in range(3):
        metrics = updater.rl_step(rl_trees(base))
    assert metrics["update/skipped"] == 0.0
    after = _base_weights(policy.model)
    assert all(torch.equal(frozen[k], after[k]) for k in frozen)  # the base never moves
    assert not torch.allclose(_logits(policy.model), _logits(base), atol=1e-4)  # the adapters did


def test_merged_weights_are_the_base_naming_and_compute_what_the_adapted_policy_computes(tmp_path):
    policy = _lora_policy(0)
    updater = PolicyUpdater(policy.model, UpdateConfig(lr=1e-2, micro_batch_size=4, lora=LORA), pad_token_id=EOS)
    for _ in range(2):
        updater.sft_step(sft_trees())
    merged = updater.serving_state_dict()
    plain = _tiny_policy(5)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(_logits(plain), _logits(policy.model), atol=1e-5, rtol=1e-5)
    # the live model is untouched by merging: it still holds separate adapters, and the same outputs
    assert is_lora_model(policy.model) and any(".lora_A." in k for k in updater.policy_state_dict())
    save_merged(policy.model, tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(reloaded), _logits(policy.model), atol=1e-5, rtol=1e-5)


def test_the_kl_reference_of_a_lora_policy_is_its_base_with_the_adapters_off():
    cfg = UpdateConfig(lr=1e-2, kl_coef=0.1, micro_batch_size=4, lora=LORA)
    trees = rl_trees(_tiny_policy(0))
    own = PolicyUpdater(_lora_policy(0).model, cfg, pad_token_id=EOS)
    assert own.reference_is_base and own.ref_model is None  # no second copy of the weights
    copied = PolicyUpdater(_lora_policy(0).model, cfg, pad_token_id=EOS, ref_model=_tiny_policy(0))
    assert copied.ref_model is not None
    for step in range(3):
        a, b = own.rl_step(trees), copied.rl_step(trees)
        assert a["losses/kl"] == pytest.approx(b["losses/kl"], rel=1e-5, abs=1e-9), step
    assert a["losses/kl"] > 0  # the adapters have moved the policy away from the base


def test_a_saved_lora_policy_loads_merged_and_its_adapters_load_on_the_base(tmp_path):
    from peft import PeftModel

    words = ["question", ":", "?", "e1", "e2", "search", "[", "]", "Observation:"]
    cfg = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    policy = build_tiny_policy(cfg, words, 0)
    base = copy.deepcopy(policy.model)
    apply_lora(policy, LORA, seed=0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.2)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5]]) % len(policy.tokenizer)
    with torch.no_grad():
        expected = policy.model(input_ids=ids).logits
    save_policy(policy, tmp_path / "policy")
    loaded = load_policy(tmp_path / "policy")
    assert not is_lora_model(loaded.model)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        adapted = PeftModel.from_pretrained(base, tmp_path / "policy" / ADAPTER_DIR).eval()
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_lora_checkpoint_resumes_bitwise_onto_fresh_adapters(tmp_path):
    cfg = UpdateConfig(lr=1e-2, micro_batch_size=4, ppo_epochs=2, lora=LORA)
    trees = rl_trees(_tiny_policy(0))
    first = PolicyUpdater(_lora_policy(0).model, cfg, pad_token_id=EOS)
    first.rl_step(trees)
    first.save_checkpoint(tmp_path / "ckpt")
    expected_metrics, expected = first.rl_step(trees), first.policy_state_dict()
    # other adapter initialisation: weights and optimizer state must come from the checkpoint
    resumed = PolicyUpdater(apply_lora(SimpleNamespace(model=_tiny_policy(0)), LORA, seed=7).model, cfg,
                            pad_token_id=EOS)
    resumed.load_checkpoint(tmp_path / "ckpt")
    metrics, params = resumed.rl_step(trees), resumed.policy_state_dict()
    for name, value in expected_metrics.items():
        if name != "update/seconds":
            assert metrics[name] == value, name
    assert all(torch.equal(params[k], v) for k, v in expected.items())


def test_lora_params_are_checked_and_an_unmatched_target_names_the_layers():
    with pytest.raises(ValueError, match="all-linear"):
        LoraConfig(target_modules="q")
    with pytest.raises(ValueError, match="at least one module"):
        LoraConfig(target_modules=[])
    with pytest.raises(ValueError, match=r"matches no layer.*q_proj"):
        apply_lora(SimpleNamespace(model=_tiny_policy(0)), LoraConfig(enabled=True, target_modules=["qkv"]), 0)
    off = SimpleNamespace(model=_tiny_policy(0))
    assert not is_lora_model(apply_lora(off, LoraConfig(), 0).model)  # disabled: the policy as it was
    assert set(merged_state_dict(off.model)) == set(off.model.state_dict())


def _load_honouring_ties(folder):
    """A saved checkpoint loaded as vLLM loads it: built from its config, which ties the output layer to the
    embeddings when ``tie_word_embeddings`` says so, the output layer's own tensor then skipped."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings
    state = load_file(str(folder / "model.safetensors"))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return model


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_lora_on_a_tied_embedding_saves_an_untied_policy_that_serves_what_the_adapted_model_computes(tmp_path,
                                                                                                      target):
    import json

    from trace.policy.lora import merged_copy

    cfg = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    policy = build_tiny_policy(cfg, ["question", ":", "?", "e1", "e2"], 0)
    assert policy.model.config.tie_word_embeddings
    base = copy.deepcopy(policy.model)
    apply_lora(policy, LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", target]), seed=0)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(policy.model(input_ids=ids).logits, base(input_ids=ids).logits)  # untying is exact
        for name, param in policy.model.named_parameters():
            if ".lora_" in name:  # peft starts B (of a linear) or A (of an embedding) at 0: move both
                param.normal_(0.0, 0.2)
        expected = policy.model(input_ids=ids).logits
    merged = merged_state_dict(policy.model)
    assert not torch.equal(merged["lm_head.weight"], merged["model.embed_tokens.weight"])
    save_policy(policy, tmp_path / "policy")
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["tie_word_embeddings"] is False
    with torch.no_grad():
        served = _load_honouring_ties(tmp_path / "policy")
        torch.testing.assert_close(served(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        # the weights pushed to a vLLM engine started from that folder, and the HF backend's merged copy
        served.load_state_dict(merged, strict=True)
        torch.testing.assert_close(served(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged_copy(policy.model).module()(input_ids=ids).logits, expected,
                                   atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(),
                                                 _base_weights(policy.model).values()))  # the base is frozen


def test_lora_off_the_embeddings_keeps_a_tied_policy_tied(tmp_path):
    import json

    from safetensors import safe_open

    cfg = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    policy = apply_lora(build_tiny_policy(cfg, ["question", ":", "?"], 0), LORA, seed=0)
    model = policy.model.get_base_model()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.2)
        ids = torch.tensor([[0, 1, 2, 3, 4, 5]])
        expected = policy.model(input_ids=ids).logits
    save_policy(policy, tmp_path / "policy")
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(tmp_path / "policy" / "model.safetensors"), "pt") as saved:
        assert "lm_head.weight" not in saved.keys()  # one tensor for both
    with torch.no_grad():
        torch.testing.assert_close(_load_honouring_ties(tmp_path / "policy")(input_ids=ids).logits, expected,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_lora_train_stage_samples_with_the_adapters_and_writes_the_merged_policy(tmp_path, monkeypatch):
    import dataclasses
    import zlib
    from pathlib import Path

    from flows.train import write_outputs
    from trace.envs.registry import make_environment
    from trace.training.loop import Trainer
    from trace.configuration.params_file import load_config
    from trace.predictor import make_predictor

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "tests" / "params_tiny.yaml", overrides={
        "train.eval_every": 100, "predictor.kind": "policy_head", "update.lr": 1e-2,
        "update.lora.enabled": True, "update.lora.rank": 4})
    env = make_environment(cfg.task, cfg.seed)
    policy = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
    base = copy.deepcopy(policy.model)
    predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=cfg.seed)
    trainer = Trainer(cfg, "trace", policy=policy, env=env, train_prompts=env.prompts("train"),
                      eval_prompts=env.prompts("eval"), predictor=predictor, run_dir=tmp_path / "run", progress=False)
    assert is_lora_model(policy.model) and trainer.policy is policy
    real_step = env.step  # an untrained policy never succeeds: end every episode, rewarded by the action's text

    def step_by_text(state, action):
        return dataclasses.replace(real_step(state, action), observation="", terminated=True, truncated=False,
                                   reward=float(zlib.crc32(action.encode()) % 2))

    monkeypatch.setattr(env, "step", step_by_text)
    history = [trainer.step(step) for step in range(2)]
    assert all(m["update/skipped"] == 0.0 for m in history) and max(m["losses/grad_norm"] for m in history) > 0
    frozen = {k: v for k, v in base.state_dict().items()}
    live = {k.replace(".base_layer.", "."): v for k, v in policy.model.get_base_model().state_dict().items()
            if ".lora_" not in k}
    assert all(torch.equal(frozen[k], live[k]) for k in frozen)  # the base weights never moved
    ids = torch.tensor([policy.tokenizer.convert_tokens_to_ids(["question", ":", "?"])])
    with torch.no_grad():
        expected, before = policy.model(input_ids=ids).logits, base(input_ids=ids).logits
    assert not torch.allclose(expected, before, atol=1e-4)
    write_outputs(trainer, policy, tmp_path / "out", {}, "trace", cfg.seed)
    final = load_policy(tmp_path / "out" / "final")
    assert (tmp_path / "out" / "final" / ADAPTER_DIR / "adapter_config.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(final.model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_warmup_snapshot_of_a_lora_policy_holds_only_the_adapters_and_restores_them():
    from trace.training.warmup import restore_snapshot, trainable_snapshot

    model = _lora_policy().model
    snapshot = trainable_snapshot(model)
    assert snapshot and all(".lora_" in name for name in snapshot)
    kept = _logits(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in snapshot:
                p.add_(0.5)
    assert not torch.allclose(_logits(model), kept)
    restore_snapshot(model, snapshot)
    assert torch.equal(_logits(model), kept)
    with pytest.raises(KeyError, match="not parameters of the model"):
        restore_snapshot(_tiny_policy(0), snapshot)


def test_a_warmup_snapshot_of_a_full_policy_holds_every_weight():
    from trace.training.warmup import trainable_snapshot

    model = _tiny_policy(0)
    assert set(trainable_snapshot(model)) == {name for name, _ in model.named_parameters()}


def test_a_lora_policy_generates_through_a_merged_copy_reloaded_at_each_announced_update():
    from pathlib import Path

    from trace.envs.registry import make_environment
    from trace.configuration.params_file import load_config
    from trace.policy.hf_backend import HFBackend
    from trace.policy.lora import merged_copy
    from trace.policy.weights import mark_weights_updated

    cfg = load_config(Path(__file__).resolve().parent / "params_tiny.yaml")
    env = make_environment(cfg.task, cfg.seed)
    plain = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
    assert merged_copy(plain.model) is None
    policy = apply_lora(build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed), LORA, seed=0)

    def move_adapters(scale: float) -> None:
        torch.manual_seed(int(scale * 10))
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if ".lora_B." in name:
                    param.add_(torch.randn_like(param) * scale)

    move_adapters(1.0)  # B starts at 0: move it so that merging matters
    merged = HFBackend(policy.model, policy.tokenizer)
    adapted = HFBackend(policy.model, policy.tokenizer, merge_lora=False)
    assert adapted.merged is None
    prefixes = [policy.tokenizer.convert_tokens_to_ids(["[BOS]", "question", ":"]),
                policy.tokenizer.convert_tokens_to_ids(["[BOS]", "question", ":", "?"])]

    def generate(backend, seed=3):
        return backend.generate(prefixes, max_new_tokens=8, temperature=1.0, seed=seed)

    def assert_same(ours, theirs):
        assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)

    first = generate(merged)
    assert_same(first, generate(adapted))
    copy_model = merged.merged.copy
    assert merged.merged.num_loads == 1 and not is_lora_model(copy_model)
    assert not any(".lora_" in name for name, _ in copy_model.named_parameters())
    generate(merged, seed=4)
    assert merged.merged.num_loads == 1  # same weights version: no reload
    move_adapters(2.0)
    mark_weights_updated(policy.model)
    moved = generate(merged)
    assert merged.merged.num_loads == 2 and merged.merged.copy is copy_model
    assert_same(moved, generate(adapted))
    assert [g.token_ids for g in moved] != [g.token_ids for g in first]
