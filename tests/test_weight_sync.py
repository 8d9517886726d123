"""Generation backends follow the real ``PolicyUpdater``'s weight updates at every ZeRO stage and in bf16.

DeepSpeed's ZeRO-1, 2 and 3 steps, and its bf16 stage-0 step, write the weights through ``.data``, so the
tensors' in-place version counters do not move; the updater announces every optimizer step instead
(``mark_weights_updated``) and the backends compare the announced version. Each case warms the Hugging Face
backend's kept KV, runs one real RL step on CPU (gloo, one rank), and samples the next turn of every
trajectory: an extension of a cached prefix, which a backend that missed the update would serve from KV
computed by the old weights. vLLM cannot run here, so its weight push is checked with a recording stand-in
for the engine (the push, the file it writes and the cache reset are this project's code).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trace.configuration.config import PolicyConfig, UpdateConfig
from trace.policy.hf_backend import HFBackend
from trace.policy.weights import weights_version
from trace.policy.model import build_tiny_policy
from trace.tree import Origin, RolloutTree, make_prompt_uid
from trace.update import PolicyUpdater, init_distributed_env

WORDS = ["question", ":", "of", "?", "search", "finish", "[", "]", ";", "Observation:", "e1", "e2", "e3", "r1", "r2"]
TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
PREFIXES = [[1, 4, 5, 17, 6, 14, 7], [1, 4, 5, 18, 6, 15, 7, 8], [1, 4, 5, 17, 6, 14, 7], [1, 15, 16, 12]]
OBSERVATION = [13, 16, 17, 8]  # words standing in for a tool observation
SEEDS_TURN0, SEEDS_TURN1 = [11, 12, 13, 14], [21, 22, 23, 24]
NEW_TOKENS = 5


@pytest.fixture(scope="module", autouse=True)
def single_process_deepspeed():
    init_distributed_env()


def make_updater(zero_stage: int, bf16: bool) -> tuple[PolicyUpdater, object]:
    policy = build_tiny_policy(TINY, WORDS, seed=0)
    cfg = UpdateConfig(lr=1e-2, micro_batch_size=8, zero_stage=zero_stage, bf16=bf16)
    return PolicyUpdater(policy.model, cfg, pad_token_id=policy.tokenizer.pad_token_id), policy.tokenizer


def turn_trees(generations, advantages) -> list[RolloutTree]:
    """One tree per prefix: the prompt, then the sampled turn with its sampling logprobs and an advantage."""
    trees = []
    for idx, (prefix, gen, advantage) in enumerate(zip(PREFIXES, generations, advantages)):
        tree = RolloutTree(tree_id=f"sync/{idx}", prompt_uid=make_prompt_uid("toy", str(idx)), data_source="toy",
                           example_id=str(idx))
        tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=list(prefix), logprobs=[0.0] * len(prefix),
                      loss_mask=[0] * len(prefix))
        tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, token_ids=list(gen.token_ids),
                      logprobs=list(gen.logprobs), loss_mask=[1] * len(gen.token_ids), advantage=advantage)
        trees.append(tree)
    return trees


CASES = [pytest.param(0, False, id="zero0"), pytest.param(1, False, id="zero1"),
         pytest.param(2, False, id="zero2"), pytest.param(3, False, id="zero3"),
         pytest.param(0, True, id="zero0-bf16")]


@pytest.mark.parametrize("zero_stage,bf16", CASES)
def test_after_a_real_update_the_cached_backend_samples_like_a_fresh_one(zero_stage, bf16):
    updater, tokenizer = make_updater(zero_stage, bf16)
    backend = HFBackend(updater.module, tokenizer)
    turn0 = backend.generate(PREFIXES, max_new_tokens=NEW_TOKENS, seed=SEEDS_TURN0)  # fills the kept KV
    turn1 = [p + g.token_ids + OBSERVATION for p, g in zip(PREFIXES, turn0)]
    stale = HFBackend(updater.module, tokenizer, keep_cache_between_calls=False).generate(
        turn1, max_new_tokens=NEW_TOKENS, seed=SEEDS_TURN1)  # what the old weights give

    version = updater.weights_version
    metrics = updater.rl_step(turn_trees(turn0, [1.0, -1.0, -1.0, 1.0]))
    assert metrics["update/skipped"] == 0.0 and updater.num_optimizer_steps == 1
    assert updater.weights_version == version + 1

    reused_before = backend.stats["reused_tokens"]
    after = backend.generate(turn1, max_new_tokens=NEW_TOKENS, seed=SEEDS_TURN1)
    assert backend.stats["reused_tokens"] == reused_before  # KV of the old weights is never served
    expected = HFBackend(updater.module, tokenizer).generate(turn1, max_new_tokens=NEW_TOKENS, seed=SEEDS_TURN1)
    assert [g.token_ids for g in after] == [g.token_ids for g in expected]
    for got, want in zip(after, expected):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    # the update mattered: the first sampled token of some turn is clearly more or less likely than before
    assert max(abs(g.logprobs[0] - s.logprobs[0]) for g, s in zip(after, stale)) > 0.05


def test_a_step_without_trainable_tokens_moves_no_version_and_the_kept_kv_still_serves():
    updater, tokenizer = make_updater(1, False)
    backend = HFBackend(updater.module, tokenizer)
    turn0 = backend.generate(PREFIXES, max_new_tokens=NEW_TOKENS, seed=SEEDS_TURN0)
    prompt_only = RolloutTree(tree_id="sync/empty", prompt_uid=make_prompt_uid("toy", "empty"), data_source="toy",
                              example_id="empty")
    prompt_only.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=[1, 4], logprobs=[0.0, 0.0],
                         loss_mask=[0, 0])
    assert updater.rl_step([prompt_only])["update/skipped"] == 1.0
    assert updater.weights_version == 0 and updater.num_optimizer_steps == 0
    reused_before = backend.stats["reused_tokens"]
    backend.generate([p + g.token_ids + OBSERVATION for p, g in zip(PREFIXES, turn0)], max_new_tokens=2,
                     seed=SEEDS_TURN1)
    assert backend.stats["reused_tokens"] > reused_before


# ---- vLLM: the weight push, with a recording stand-in for the engine ------------------------------------
class RecordingEngine:
    """Stands in for ``vllm.LLM``: records weight reloads and prefix-cache resets."""

    def __init__(self) -> None:
        self.reloads: list[dict] = []
        self.resets = 0

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> None:
        assert method == "reload_weights"
        self.reloads.append(dict(kwargs or {}))

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


def vllm_backend_over(source_model, workdir, weights_fn=None):
    """A ``VLLMBackend`` whose engine is a ``RecordingEngine`` (vLLM itself is not installed here)."""
    from trace.policy import vllm_backend

    backend = object.__new__(vllm_backend.VLLMBackend)
    backend.engines = [RecordingEngine()]
    backend.source_model, backend.weights_fn = source_model, weights_fn
    backend.workdir, backend._owns_workdir = workdir, False
    backend._synced_version = weights_version(source_model)  # as __init__ records it
    backend._affinity = {}
    backend.stats = {"weight_refreshes": 0, "prefix_cache_resets": 0}
    return backend


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_vllm_sync_pushes_exactly_when_the_updater_stepped(zero_stage, tmp_path):
    updater, tokenizer = make_updater(zero_stage, False)
    weights_fn = updater.serving_state_dict if zero_stage == 3 else None
    vllm = vllm_backend_over(updater.module, tmp_path, weights_fn)
    engine = vllm.engines[0]
    assert vllm.sync_weights() is False and engine.reloads == []
    turn0 = HFBackend(updater.module, tokenizer).generate(PREFIXES, max_new_tokens=NEW_TOKENS, seed=SEEDS_TURN0)
    updater.rl_step(turn_trees(turn0, [1.0, -1.0, -1.0, 1.0]))
    assert vllm.sync_weights() is True
    assert len(engine.reloads) == 1 and engine.resets == 1 and vllm.stats["weight_refreshes"] == 1
    # the pushed file holds the full updated weights (gathered from the shards under ZeRO-3)
    pushed = load_file(f"{engine.reloads[0]['weights_path']}/model.safetensors")
    full = updater.policy_state_dict()
    assert pushed.keys() == full.keys()
    for name, value in full.items():
        assert value.numel() > 0 and torch.equal(pushed[name], value), name
    assert vllm.sync_weights() is False and len(engine.reloads) == 1  # nothing new: no second push
    vllm.clear_cache()  # the rollout engine's call between rollouts: keeps the cache while weights stand
    assert engine.resets == 1
    updater.rl_step(turn_trees(turn0, [-1.0, 1.0, 1.0, -1.0]))
    vllm.clear_cache()
    assert len(engine.reloads) == 2 and engine.resets == 2


def test_vllm_refresh_of_a_zero3_policy_without_weights_fn_says_how_to_gather(tmp_path):
    updater, _ = make_updater(3, False)
    vllm = vllm_backend_over(updater.module, tmp_path)
    from trace.policy.weights import mark_weights_updated

    mark_weights_updated(updater.module)
    with pytest.raises(ValueError, match="weights_fn=updater.serving_state_dict"):
        vllm.sync_weights()
