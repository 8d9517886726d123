"""The format's turn prefix (``policy.turn_prefix``, e.g. ``"Thought:"``) opens every turn once, as context.

For every task family's solver (kgqa, math, qa, fc) and every format (chat and plain with the prefix the
presets use; words, which has none), a warmup demonstration (``trace.training.warmup.demonstration_trees``) is
built into its real token sequence and loss mask: the prefix occurs exactly once before each turn, on
tokens with loss mask 0, and the tokens the demonstration trains are those a rollout generates after it.
The rollout side uses a scripted backend that writes the turns a policy writes after the prefix (sampling
itself is not under test: ``tests/test_rollout.py`` covers it with a real model).

The chat and plain formats use a byte-level BPE tokenizer trained here on the conversations' own text, with a
ChatML template (as SmolLM2's), so the checks see real BPE merges at turn boundaries in seconds on CPU.
"""

import re

import pytest

from trace.configuration.config import KGQAConfig, PolicyConfig
from trace.envs.base import Prompt
from trace.envs.fc import FunctionCallingEnvironment
from trace.envs.kgqa import KGQAEnvironment
from trace.envs.math import MathEnvironment
from trace.envs.qa import QAEnvironment
from trace.envs.retrieval import ContextBM25Retriever
from trace.policy.backends import Generation
from trace.policy.format import ChatFormat, FormatKind
from trace.policy.model import Policy, build_tiny_policy
from trace.rollout import rollout_roots
from trace.sampling import SamplingSpec
from trace.tree import FinishReason
from trace.training.warmup import demonstration_trees

PREFIX = "Thought:"  # params/gsm8k.yaml, params/hotpotqa.yaml, params/bfcl.yaml
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


# ---- one small task per solver -------------------------------------------------------------------------------
def kgqa_task():
    env = KGQAEnvironment(KGQAConfig(num_entities=30, num_relations=4, facts_per_entity=2, num_distractors=1,
                                     num_train=10, num_eval=4), seed=3, max_turns=4)
    return env, env.prompts("train")[:2]


def math_task():
    question = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?")
    return MathEnvironment("gsm8k", max_turns=4), [Prompt("gsm8k", "0", question, "72",
                                                          {"calculations": ["48/2", "48+24"]})]


def qa_task():
    context = [["Tinted Windows (album)", "Tinted Windows is the only album by the band Tinted Windows."],
               ["Tinted Windows (band)", "Tinted Windows was a supergroup. Their first performance was in Tulsa."],
               ["Hanson", "Hanson is a band from Tulsa, Oklahoma."]]
    prompt = Prompt("hotpotqa", "0", "Where did the band of the album Tinted Windows first perform?", ["Tulsa"],
                    {"context": context, "support": ["Tinted Windows (album)", "Tinted Windows (band)"]})
    return QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=2, max_turns=4), [prompt]


def fc_task():
    factorial = {"name": "math.factorial", "description": "Calculate the factorial of a given number.",
                 "parameters": {"type": "dict", "properties": {"number": {"type": "integer", "description": "n"}},
                                "required": ["number"]}}
    prompts = [Prompt("bfcl", "simple_python_1", "Calculate the factorial of 5 using math functions.",
                      [{"math.factorial": {"number": [5]}}], {"category": "simple_python", "functions": [factorial]}),
               Prompt("bfcl", "irrelevance_0", "What is the weather in Paris?", [],
                      {"category": "irrelevance", "functions": [factorial]})]
    return FunctionCallingEnvironment("bfcl"), prompts


TASKS = {"kgqa": kgqa_task, "math": math_task, "qa": qa_task, "fc": fc_task}


# ---- policies ---------------------------------------------------------------------------------------------
def bpe_chat_tokenizer(corpus):
    """A byte-level BPE tokenizer trained on ``corpus``, with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def policy_for(env, prompts, kind):
    """The policy of a format: words (kgqa only) or chat / plain over a BPE tokenizer, with the preset prefix."""
    if kind == "words":
        return build_tiny_policy(TINY, env.vocabulary(), seed=0)
    corpus = [env.reset(p)[1] for p in prompts] + [a for p in prompts for a in env.solve(p)]
    # the model is never run: demonstrations are teacher-forced without logprobs, rollouts use the script below
    return Policy(model=None, tokenizer=bpe_chat_tokenizer(corpus),
                  format=ChatFormat(kind=FormatKind(kind), turn_prefix=PREFIX))


CASES = [("kgqa", "words")] + [(task, kind) for task in TASKS for kind in ("chat", "plain")]


# ---- checks ---------------------------------------------------------------------------------------------------
def trajectory(tree):
    """Token ids and loss mask of the tree's one trajectory, and each turn's (start, end) of generated tokens."""
    ids, mask, turns = [], [], []
    for node in tree.path(tree.leaves()[0].node_id):
        if not node.is_root:
            turns.append((len(ids), len(ids) + node.num_generated_tokens))
        ids += node.token_ids
        mask += node.loss_mask
    return ids, mask, turns


def assert_prefix_opens_each_turn_once_as_context(policy, tree):
    tok, fmt = policy.tokenizer, policy.format
    ids, mask, turns = trajectory(tree)
    assert mask == [int(any(s <= k < e for s, e in turns)) for k in range(len(ids))]  # 1 exactly on turns
    text = fmt.decode(tok, ids)
    assert text.isascii()  # character offsets below are byte offsets
    assert tok(text, add_special_tokens=False)["input_ids"] == ids  # no merge across a turn boundary
    if not fmt.turn_prefix:
        return
    char_end = [len(fmt.decode(tok, ids[:k + 1])) for k in range(len(ids))]
    turn_start = [char_end[start - 1] for start, _ in turns]
    after_user = text.index(tree.root.text) + len(tree.root.text)  # the task's instructions may quote the prefix
    found = [m.start() for m in re.finditer(re.escape(PREFIX), text) if m.start() >= after_user]
    assert found == [start - len(PREFIX) for start in turn_start], text  # once, right before each turn
    for begin in found:  # every token that spells a prefix is context
        assert all(mask[k] == 0 for k in range(len(ids)) if char_end[k] > begin and
                   (k == 0 or char_end[k - 1] < begin + len(PREFIX)))
    for start, end in turns:
        assert PREFIX not in fmt.decode(tok, ids[start:end])


class ScriptedPolicyBackend:
    """A ``GenerationBackend`` that writes ``turns[i]`` as the i-th turn of its one trajectory.

    Each turn must be asked for right after the format's prefix (the prompt or an observation ends with it).
    A non-final turn ends at the observation marker (finish ``"stop"``), the last one with EOS.
    """

    def __init__(self, policy, turns):
        self.policy, self.turns, self.calls = policy, list(turns), 0

    def generate(self, prefixes, *, max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=(), stop_strings=(),
                 seed=0):
        tok, fmt = self.policy.tokenizer, self.policy.format
        assert len(prefixes) == 1 and fmt.decode(tok, prefixes[0]).endswith(fmt.turn_prefix)
        text, last = self.turns[self.calls], self.calls == len(self.turns) - 1
        self.calls += 1
        ids = fmt.encode(tok, text) + (fmt.end_of_turn_token_ids(tok) if last else [])
        return [Generation(token_ids=ids, logprobs=[-1.0] * len(ids), finish="eos" if last else "stop")]


@pytest.mark.parametrize("task, kind", CASES)
def test_a_demonstration_opens_each_turn_with_the_prefix_once_and_trains_only_what_follows(task, kind):
    env, prompts = TASKS[task]()
    policy = policy_for(env, prompts, kind)
    demos = demonstration_trees(policy, env, prompts, demo_noise=0.0, seed=0)
    assert len(demos) == len(prompts)
    for prompt, tree in zip(prompts, demos):
        leaf = tree.leaves()[0]
        assert (leaf.finish_reason, leaf.reward) == (FinishReason.TERMINATED, 1.0)
        assert_prefix_opens_each_turn_once_as_context(policy, tree)
        for node, written in zip(tree.nodes[1:], env.solve(prompt)):
            gen = node.token_ids[:node.num_generated_tokens]
            # the environment read the text the trained tokens spell, as it reads a rollout's
            assert node.action_text == policy.format.action_text(policy.tokenizer, gen)
            if not policy.format.turn_prefix:  # words: the solver's turn is trained as written
                assert node.action_text == written


@pytest.mark.parametrize("task, kind", CASES)
def test_a_rolled_out_turn_after_the_prefix_builds_the_demonstrations_tokens_and_masks(task, kind):
    env, prompts = TASKS[task]()
    policy = policy_for(env, prompts, kind)
    for prompt, demo in zip(prompts, demonstration_trees(policy, env, prompts, demo_noise=0.0, seed=0)):
        # the policy writes each turn after the prefix the context already holds
        turns = [a[len(PREFIX):] if kind != "words" and a.startswith(PREFIX) else a for a in env.solve(prompt)]
        backend = ScriptedPolicyBackend(policy, turns)
        tree = rollout_roots(policy, env, [prompt], [1], SamplingSpec(max_new_tokens=512), backend=backend,
                             max_context_tokens=8192)[0]
        assert backend.calls == len(turns)
        assert_prefix_opens_each_turn_once_as_context(policy, tree)
        assert [n.token_ids for n in tree.nodes] == [n.token_ids for n in demo.nodes]
        assert [n.loss_mask for n in tree.nodes] == [n.loss_mask for n in demo.nodes]
        assert [n.action_text for n in tree.nodes] == [n.action_text for n in demo.nodes]
        assert [(n.reward, n.finish_reason) for n in tree.nodes] == [(n.reward, n.finish_reason) for n in demo.nodes]


def test_turn_text_drops_one_leading_copy_of_the_prefix():
    fmt = ChatFormat(kind=FormatKind.CHAT, turn_prefix=PREFIX)
    assert fmt.turn_text("Thought: compute 48/2. Action: calculate[48/2]") == " compute 48/2. Action: calculate[48/2]"
    assert fmt.turn_text("Thought:Thought: x") == "Thought: x"  # one copy: a policy may write it again
    assert fmt.turn_text("Action: finish[]") == "Action: finish[]"
    assert ChatFormat(kind=FormatKind.CHAT).turn_text("Thought: x") == "Thought: x"  # no prefix, nothing dropped
