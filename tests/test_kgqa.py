from collections import Counter

import pytest

from trace.configuration.config import KGQAConfig
from trace.envs.base import EpisodeFinishedError, Prompt
from trace.envs.checker import check_environment, garbage_actions
from trace.envs.kgqa import INVALID_ACTION, NO_RESULT, KGQAEnvironment, parse_action

CFG = KGQAConfig(num_entities=60, num_relations=5, facts_per_entity=3, num_distractors=2, num_train=300,
                 num_eval=60)


@pytest.fixture(scope="module")
def env():
    return KGQAEnvironment(CFG, seed=7, max_turns=5)


def all_prompts(env):
    return env.prompts("train") + env.prompts("eval")


def play(env, prompt, actions):
    state, text = env.reset(prompt)
    texts, results = [text], []
    for action in actions:
        result = env.step(state, action)
        results.append(result)
        texts += [action, result.observation]
        state = result.state
    return texts, results


def test_question_reads_outermost_relation_first_and_the_answer_follows_the_chain(env):
    for prompt in all_prompts(env)[:50]:
        start, rels = prompt.meta["start"], prompt.meta["relations"]
        assert prompt.question == " ".join(["question", ":"] + [w for r in reversed(rels) for w in (r, "of")]
                                           + [start, "?"])
        node = start
        for rel in rels:  # slow walk through the public fact lists
            node = next(o for s, r, o in env.facts(node) if r == rel)
        assert node == prompt.answer == prompt.meta["path"][-1]
        assert prompt.meta["num_hops"] == len(rels)


def test_each_entity_has_distinct_relations_and_no_self_loop(env):
    for entity in env.entities:
        facts = env.facts(entity)
        assert len(facts) == CFG.facts_per_entity
        assert len({r for _, r, _ in facts}) == CFG.facts_per_entity
        assert all(s == entity and o != entity for s, _, o in facts)


def test_splits_have_configured_sizes_unique_ids_balanced_hops_and_disjoint_questions(env):
    train, evals = env.prompts("train"), env.prompts("eval")
    assert len(train) == 300 and len(evals) == 60
    key = lambda p: (p.meta["start"], tuple(p.meta["relations"]))  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in evals}
    assert len({key(p) for p in train}) == 300
    assert len({p.prompt_uid for p in train + evals}) == 360
    assert train[42].example_id == "train-00042" and evals[7].example_id == "eval-00007"
    # 360 questions over hops 1..3 -> 120 each; eval 60 -> 20 each
    assert Counter(p.meta["num_hops"] for p in train + evals) == {1: 120, 2: 120, 3: 120}
    assert Counter(p.meta["num_hops"] for p in evals) == {1: 20, 2: 20, 3: 20}
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.prompts("test")


def test_hop_quota_moves_surplus_when_one_hop_count_is_exhausted():
    # 12 entities x 2 facts: 24 one-hop and 48 two-hop questions exist; 60 asked over hops 1..2 split 30/30,
    # one-hop is capped at 24 and its surplus 6 goes to two-hop -> 24 / 36 (eval 10 -> 5 / 5)
    env = KGQAEnvironment(KGQAConfig(num_entities=12, num_relations=2, facts_per_entity=2, max_hops=2,
                                     num_train=50, num_eval=10), seed=0, max_turns=3)
    assert Counter(p.meta["num_hops"] for p in env.prompts("train") + env.prompts("eval")) == {1: 24, 2: 36}
    assert Counter(p.meta["num_hops"] for p in env.prompts("eval")) == {1: 5, 2: 5}
    # all 72 questions: the dense path enumerates every walk
    full = KGQAEnvironment(KGQAConfig(num_entities=12, num_relations=2, facts_per_entity=2, max_hops=2,
                                      num_train=62, num_eval=10), seed=0, max_turns=3)
    assert len({(p.meta["start"], tuple(p.meta["relations"])) for p in all_prompts(full)}) == 72


def test_construction_is_deterministic_and_seed_dependent():
    a, b = KGQAEnvironment(CFG, seed=7), KGQAEnvironment(CFG, seed=7)
    assert all_prompts(a) == all_prompts(b)
    p = a.prompts("train")[3]
    assert all(a.fact_sheet(p, e) == b.fact_sheet(p, e) for e in a.entities)
    assert all_prompts(KGQAEnvironment(CFG, seed=8)) != all_prompts(a)


def test_solver_reaches_reward_one_on_every_prompt(env):
    for prompt in all_prompts(env):
        actions = env.solve(prompt)
        assert len(actions) == prompt.meta["num_hops"] + 1
        assert all(a.endswith(" Observation:") for a in actions[:-1]) and not actions[-1].endswith("Observation:")
        _, results = play(env, prompt, actions)
        assert results[-1].terminated and results[-1].reward == 1.0
        assert not any(r.state.done for r in results[:-1])


def test_noisy_demonstrations_make_one_wrong_search_then_still_succeed(env):
    prompts = all_prompts(env)[:100]
    for prompt in prompts:
        clean, noisy = env.solve(prompt), env.solve(prompt, demo_noise=1.0, seed=1)
        assert len(noisy) == len(clean) + 1 and set(clean) <= set(noisy)
        _, results = play(env, prompt, noisy)
        assert results[-1].reward == 1.0
    assert env.solve(prompts[0], demo_noise=1.0, seed=1) == env.solve(prompts[0], demo_noise=1.0, seed=1)
    noisy_share = sum(len(env.solve(p, demo_noise=0.3)) > p.meta["num_hops"] + 1 for p in prompts) / len(prompts)
    assert 0.15 < noisy_share < 0.45


def test_vocabulary_covers_every_word_of_solver_episodes_and_error_observations(env):
    vocab = env.vocabulary()
    assert len(vocab) == len(set(vocab)) == 14 + CFG.num_entities + CFG.num_relations
    assert "Observation:" in vocab and vocab == KGQAEnvironment(CFG, seed=7).vocabulary()
    words = set(INVALID_ACTION.split() + NO_RESULT.split())
    for prompt in all_prompts(env):
        for actions in (env.solve(prompt), env.solve(prompt, demo_noise=1.0)):
            texts, _ = play(env, prompt, actions)
            words.update(w for t in texts for w in t.split())
    assert words <= set(vocab), sorted(words - set(vocab))


def test_fact_sheet_holds_the_entity_facts_and_distractors_in_a_per_prompt_order(env):
    p1 = env.prompts("train")[0]
    sheet = env.fact_sheet(p1, "e5")
    words = sheet.split()
    lines = [tuple(words[i:i + 3]) for i in range(0, len(words), 4)]
    assert words[3::4] == [";"] * len(lines)
    assert set(env.facts("e5")) <= set(lines)
    others = [line for line in lines if line[0] != "e5"]
    assert len(others) == CFG.num_distractors and len({s for s, _, _ in others}) == CFG.num_distractors
    own_relations = {r for _, r, _ in env.facts("e5")}
    assert all(line in env.facts(line[0]) for line in others)  # distractors are true facts of other entities
    assert all(r in own_relations or not own_relations & {rr for _, rr, _ in env.facts(s)} for s, r, _ in others)
    assert env.fact_sheet(p1, "e5") == sheet
    orders = {env.fact_sheet(p, "e5") for p in env.prompts("train")[:20]}
    assert len(orders) > 1  # the order (and the distractors) vary with the prompt


@pytest.mark.parametrize("text, expected", [
    ("search [ e1 ]", ("search", "e1")),
    ("search [ e1 ] Observation:", ("search", "e1")),
    ("I think search [ e1 ] then finish [ e2 ]", ("search", "e1")),
    ("finish [ e2 ] search [ e1 ]", ("finish", "e2")),
    ("search [ ] finish [ e3 ]", ("finish", "e3")),
    ("Observation: search [ e1 ]", None),
    ("foo Observation: finish [ e1 ]", None),
    ("search [ e1 e2 ]", None),
    ("search [e1]", None),
    ("search[ e1 ]", None),
    ("lookup [ e1 ]", None),
    ("", None),
])
def test_parse_action_takes_the_first_well_formed_action_before_the_marker(text, expected):
    assert parse_action(text) == expected


def test_invalid_and_unknown_actions_give_observations_and_the_episode_goes_on(env):
    prompt = env.prompts("train")[0]
    state, _ = env.reset(prompt)
    bad = env.step(state, "search [ e1 e2 ]")
    assert (bad.observation, bad.reward, bad.terminated, bad.truncated) == ("invalid action", 0.0, False, False)
    assert bad.info["parse_error"] and bad.num_tool_calls == 0
    unknown = env.step(state, "search [ e999 ] Observation:")
    assert unknown.observation == "no result" and unknown.num_tool_calls == 1 and not unknown.state.done
    for action in garbage_actions(env.observation_marker):
        result = env.step(state, action)
        assert result.observation in ("invalid action", "no result") and not result.state.done


def test_fake_observation_inside_the_action_is_not_read(env):
    prompt = env.prompts("train")[0]
    state, _ = env.reset(prompt)
    result = env.step(state, f"search [ {prompt.meta['start']} ] Observation: finish [ {prompt.answer} ]")
    assert not result.terminated and result.observation == env.fact_sheet(prompt, prompt.meta["start"])


def test_wrong_finish_terminates_with_reward_zero_and_turn_limit_truncates(env):
    prompt = env.prompts("train")[0]
    wrong = next(e for e in env.entities if e != prompt.answer)
    _, results = play(env, prompt, [f"finish [ {wrong} ]"])
    assert results[0].terminated and results[0].reward == 0.0 and results[0].state.data == (f"finish {wrong}",)
    _, results = play(env, prompt, ["search [ e1 ] Observation:"] * 5)
    assert [r.truncated for r in results] == [False] * 4 + [True]
    assert results[-1].observation == "" and results[-1].reward == 0.0 and results[-1].state.num_turns == 5
    with pytest.raises(EpisodeFinishedError):
        env.step(results[-1].state, f"finish [ {prompt.answer} ]")


def test_kgqa_passes_the_environment_checker(env):
    check_environment(env, env.prompts("train")[:6] + env.prompts("eval")[:3], num_random_episodes=40, seed=2)


def test_default_config_builds_quickly_and_passes_the_checker():
    env = KGQAEnvironment(KGQAConfig(), seed=0, max_turns=5)
    assert len(env.prompts("train")) == 2000 and len(env.prompts("eval")) == 200
    check_environment(env, env.prompts("eval")[:4], num_random_episodes=12)


def test_impossible_configs_raise_with_a_fix():
    with pytest.raises(ValueError, match="raise kgqa.num_entities or kgqa.facts_per_entity"):
        KGQAEnvironment(KGQAConfig(num_entities=10, num_relations=2, facts_per_entity=1, num_train=100), seed=0)
    with pytest.raises(ValueError, match="set task.max_turns >= 4"):
        KGQAEnvironment(CFG, seed=0, max_turns=3)
    with pytest.raises(ValueError, match="is not a kgqa question"):
        KGQAEnvironment(CFG, seed=0).reset(Prompt("simulator", "x", "task", answer=None))


AMBIGUOUS = CFG.model_copy(update={"ambiguous_relations": 2, "num_lookalikes": 2})


def asks_ambiguous(prompt, k=2):
    return any(int(r[1:]) < k for r in prompt.meta["relations"])


def test_sheets_on_an_ambiguous_chain_list_lookalikes_of_other_entities_on_the_asked_relation():
    env = KGQAEnvironment(AMBIGUOUS, seed=7, max_turns=5)
    checked = 0
    for prompt in env.prompts("train")[:200]:
        path, rels = prompt.meta["path"], prompt.meta["relations"]
        for entity, rel in zip(path[:-1], rels):
            words = env.fact_sheet(prompt, entity).split()
            lines = [tuple(words[i:i + 3]) for i in range(0, len(words), 4)]
            looks = [line for line in lines if line[1] == rel and line[0] != entity]
            if int(rel[1:]) < 2:
                checked += 1
                assert len(set(looks)) >= 2, (prompt.question, entity, lines)
            for s, r, o in looks:  # look-alikes are true facts of their own subjects
                assert (s, r, o) in env.facts(s)
    assert checked > 50


def test_sheets_of_questions_without_an_ambiguous_relation_are_unchanged():
    plain, env = KGQAEnvironment(CFG, seed=7, max_turns=5), KGQAEnvironment(AMBIGUOUS, seed=7, max_turns=5)
    assert [env.is_ambiguous(r) for r in ("r0", "r1", "r2", "r9")] == [True, True, False, False]
    prompts = [p for p in env.prompts("train")[:200] if not asks_ambiguous(p)]
    assert len(prompts) > 20
    for prompt in prompts:
        for entity in prompt.meta["path"]:
            assert env.fact_sheet(prompt, entity) == plain.fact_sheet(prompt, entity)


def test_a_confused_solver_errs_only_on_ambiguous_questions_and_at_the_configured_rate():
    sure = KGQAEnvironment(AMBIGUOUS, seed=7, max_turns=5)
    always = KGQAEnvironment(AMBIGUOUS.model_copy(update={"demo_confusion": 1.0}), seed=7, max_turns=5)
    half = KGQAEnvironment(AMBIGUOUS.model_copy(update={"demo_confusion": 0.5}), seed=7, max_turns=5)
    prompts = always.prompts("train")
    right = {name: [e.solve(p, seed=i)[-1] == f"finish [ {p.answer} ]" for i, p in enumerate(prompts)]
             for name, e in (("sure", sure), ("always", always), ("half", half))}
    amb = [asks_ambiguous(p) for p in prompts]
    assert all(right["sure"])
    assert all(r for r, a in zip(right["always"], amb) if not a)
    wrong_always = sum(not r for r, a in zip(right["always"], amb) if a) / sum(amb)
    wrong_half = sum(not r for r, a in zip(right["half"], amb) if a) / sum(amb)
    assert wrong_always > 0.9  # a look-alike's object can coincide with the right one
    assert 0.3 < wrong_half < 0.7
    for prompt in prompts[:100]:  # every demonstration is a well-formed episode of the environment
        _, results = play(always, prompt, always.solve(prompt))
        assert results[-1].terminated


def test_more_ambiguous_relations_than_relations_is_refused():
    with pytest.raises(ValueError, match="ambiguous_relations"):
        KGQAConfig(num_relations=3, facts_per_entity=2, ambiguous_relations=4)


def test_a_test_split_is_held_out_balanced_and_disjoint_from_train_and_eval():
    env = KGQAEnvironment(CFG.model_copy(update={"num_test": 90}), seed=7, max_turns=5)
    train, evals, tests = env.prompts("train"), env.prompts("eval"), env.prompts("test")
    assert (len(train), len(evals), len(tests)) == (300, 60, 90)
    key = lambda p: (p.meta["start"], tuple(p.meta["relations"]))  # noqa: E731
    assert len({key(p) for p in train + evals + tests}) == 450  # three disjoint splits
    assert Counter(p.meta["num_hops"] for p in tests) == {1: 30, 2: 30, 3: 30}
    assert Counter(p.meta["num_hops"] for p in evals) == {1: 20, 2: 20, 3: 20}
    assert tests[5].example_id == "test-00005"
    assert len({p.prompt_uid for p in train + evals + tests}) == 450


def test_no_test_split_leaves_the_default_task_as_it_was():
    # params.yaml's questions as generated before task.kgqa.num_test existed: the committed runs rest on them
    from pathlib import Path

    from trace.configuration.params_file import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "params.yaml")
    assert cfg.task.kgqa.num_test == 0
    env = KGQAEnvironment(cfg.task.kgqa, seed=cfg.seed, max_turns=cfg.task.max_turns)
    train, evals = env.prompts("train"), env.prompts("eval")
    assert (len(train), len(evals)) == (8000, 200)
    assert (train[0].question, train[-1].question, evals[0].question, evals[-1].question) == (
        "question : r4 of e34 ?", "question : r0 of r5 of r2 of e128 ?", "question : r3 of r4 of e10 ?",
        "question : r5 of e95 ?")
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.prompts("test")
