"""scripts/kgqa_decisions.py: the probability of the right entity at ambiguous and plain turns."""

import math

import torch

from scripts.kgqa_decisions import decision_probabilities
from trace.configuration.config import KGQAConfig, PolicyConfig
from trace.envs.kgqa import KGQAEnvironment
from trace.policy.model import build_tiny_policy

CFG = KGQAConfig(num_entities=40, num_relations=4, facts_per_entity=3, num_train=60, num_eval=20,
                 ambiguous_relations=1, demo_confusion=1.0)


def test_each_hop_is_counted_once_as_ambiguous_or_plain_with_the_policys_probability_of_the_right_entity():
    env = KGQAEnvironment(CFG, seed=3, max_turns=5)
    policy = build_tiny_policy(PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                            intermediate_size=64), env.vocabulary(), seed=0)
    prompts = env.prompts("eval")[:8]
    probs = decision_probabilities(policy, env, prompts)
    hops = [r for p in prompts for r in p.meta["relations"]]
    assert len(probs["ambiguous"]) == sum(r == "r0" for r in hops)
    assert len(probs["plain"]) == sum(r != "r0" for r in hops)
    # the first hop's value is the model's softmax at the entity after "search [" / "finish [" on the right path
    prompt = prompts[0]
    tok, fmt = policy.tokenizer, policy.format
    state, text = env.reset(prompt)
    ids = list(fmt.prompt_token_ids(tok, text))
    first = f"search [ {prompt.meta['start']} ] Observation:"
    ids += fmt.encode(tok, first) + fmt.encode(tok, " " + env.step(state, first).observation)
    nxt = prompt.meta["path"][1]
    tool = "finish" if len(prompt.meta["relations"]) == 1 else "search"
    ids += fmt.encode(tok, f"{tool} [")
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids])).logits[0, -1]
    want = torch.softmax(logits.double(), -1)[tok.convert_tokens_to_ids(nxt)].item()
    kind = "ambiguous" if prompt.meta["relations"][0] == "r0" else "plain"
    assert math.isclose(probs[kind][0], want, rel_tol=1e-4), (probs[kind][0], want)
