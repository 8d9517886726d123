"""Training batches from rollout trees, and the DeepSpeed policy update on a tiny Qwen3."""

import math
import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trace.configuration.config import UpdateConfig
from trace.losses import clipped_surrogate_loss, token_logprobs
from trace.tree import Origin, RolloutTree, make_prompt_uid
from trace.update import (
    PolicyUpdater,
    TrainingBatch,
    build_training_batch,
    deepspeed_config,
    init_distributed_env,
)

VOCAB = 32
EOS = 2  # also the pad id: masks must come from lengths


# ---- tree helpers --------------------------------------------------------------------------------------
def new_tree(tree_id: str, prompt_ids: list[int]) -> RolloutTree:
    tree = RolloutTree(tree_id=tree_id, prompt_uid=make_prompt_uid("toy", tree_id), data_source="toy",
                       example_id=tree_id)
    n = len(prompt_ids)
    tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=list(prompt_ids), logprobs=[0.0] * n,
                  loss_mask=[0] * n)
    return tree


def add_turn(tree: RolloutTree, parent_id: int, generated: list[int], observation: list[int] = (),
             advantage: float | None = None):
    generated, observation = list(generated), list(observation)
    logprobs = [-1.0 - 0.25 * i - 0.01 * parent_id for i in range(len(generated))] + [0.0] * len(observation)
    return tree.add_node(parent_id, turn_idx=tree.depth(parent_id), origin=Origin.ROLLOUT,
                         token_ids=generated + observation, logprobs=logprobs,
                         loss_mask=[1] * len(generated) + [0] * len(observation), advantage=advantage)


def assign_summed_advantages(tree: RolloutTree, leaf_advantages: dict[int, float]) -> None:
    """Slow reference: each non-root node's advantage = sum over the leaves below it (leaf included)."""
    for node in tree.nodes[1:]:
        node.advantage = 0.0
    for leaf_id, advantage in leaf_advantages.items():
        for node in tree.path(leaf_id)[1:]:
            node.advantage += advantage


def flat_leaf_rows(trees: list[RolloutTree], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Slow reference: every leaf row trains all its generated tokens with the leaf's advantage."""
    rows = []
    for tree in trees:
        for leaf in tree.leaves():
            path = tree.path(leaf.node_id)
            ids = [t for n in path for t in n.token_ids]
            mask = [m for n in path for m in n.loss_mask]
            logprobs = [lp for n in path for lp in n.logprobs]
            rows.append((ids, mask, logprobs, [leaf.advantage * m for m in mask]))
    width = max(len(r[0]) for r in rows)
    out = {"input_ids": torch.full((len(rows), width), pad_token_id, dtype=torch.long),
           "loss_mask": torch.zeros(len(rows), width), "old_logprobs": torch.zeros(len(rows), width),
           "advantages": torch.zeros(len(rows), width),
           "attention_mask": torch.zeros(len(rows), width, dtype=torch.long)}
    for b, (ids, mask, logprobs, advantages) in enumerate(rows):
        for t in range(len(ids)):
            out["input_ids"][b, t] = ids[t]
            out["loss_mask"][b, t] = mask[t]
            out["old_logprobs"][b, t] = logprobs[t]
            out["advantages"][b, t] = advantages[t]
            out["attention_mask"][b, t] = 1
    return out


def branched_tree() -> RolloutTree:
    """root [5, 6]
       n1 gen [7, 8] obs [9]          advantage 1.0 + (-0.5) = 0.5
          n2 gen [10, EOS]  leaf      advantage 1.0
          n3 gen [11]       leaf      advantage -0.5
       n4 gen [12, 13] obs [14]       advantage 2.0
          n5 gen [15]       leaf      advantage 2.0
    """
    tree = new_tree("toy/branched", [5, 6])
    n1 = add_turn(tree, 0, [7, 8], [9])
    add_turn(tree, n1.node_id, [10, EOS])
    add_turn(tree, n1.node_id, [11])
    n4 = add_turn(tree, 0, [12, 13], [14])
    add_turn(tree, n4.node_id, [15])
    assign_summed_advantages(tree, {2: 1.0, 3: -0.5, 5: 2.0})
    return tree


def chain_trees(seed: int) -> list[RolloutTree]:
    """Trees without branching below the root: each turn lies on exactly one leaf path."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    trees = []
    for k in range(3):
        tree = new_tree(f"toy/chain{k}", rand(2 + k))
        leaf_advantages = {}
        for _ in range(2 + k % 2):
            parent = 0
            num_turns = int(torch.randint(1, 4, (1,), generator=gen))
            for turn in range(num_turns):
                last = turn == num_turns - 1
                parent = add_turn(tree, parent, rand(int(torch.randint(1, 4, (1,), generator=gen))),
                                  [] if last else rand(2)).node_id
            leaf_advantages[parent] = float(torch.randn(1, generator=gen))
        assign_summed_advantages(tree, leaf_advantages)
        trees.append(tree)
    return trees


# ---- batch construction --------------------------------------------------------------------------------
def test_branched_tree_trains_each_node_once_with_its_summed_advantage():
    batch = build_training_batch([branched_tree()], pad_token_id=EOS)
    # rows follow leaves() order: n2, n3, n5; width 7 (row 0), rows 1-2 padded with EOS (= pad)
    assert batch.sequence_ids == [("toy/branched", 2), ("toy/branched", 3), ("toy/branched", 5)]
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, EOS],
                                        [5, 6, 7, 8, 9, 11, EOS],
                                        [5, 6, 12, 13, 14, 15, EOS]]
    assert batch.lengths.tolist() == [7, 6, 6]
    assert batch.attention_mask.tolist() == [[1] * 7, [1] * 6 + [0], [1] * 6 + [0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 4, 5, 0]]
    # n1's tokens train in row 0 only (context in row 1); the EOS ending row 0 is a generated token
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1, 1],
                                        [0, 0, 0, 0, 0, 1, 0],
                                        [0, 0, 1, 1, 0, 1, 0]]
    assert batch.advantages.tolist() == [[0, 0, 0.5, 0.5, 0, 1.0, 1.0],
                                         [0, 0, 0, 0, 0, -0.5, 0],
                                         [0, 0, 2.0, 2.0, 0, 2.0, 0]]
    # generated tokens: n1 2 + n2 2 + n3 1 + n4 2 + n5 1 = 8, each trained once; the token-mean normaliser
    # counts them per leaf row as flat training does: (n1 + n2) 4 + (n1 + n3) 3 + (n4 + n5) 3 = 10
    assert batch.num_trained_tokens == 8
    assert batch.row_tokens.tolist() == [4, 3, 3] and batch.num_tokens == 10
    micro = batch.micro_batches(2)
    assert [m.num_tokens for m in micro] == [7, 3] and [m.num_trained_tokens for m in micro] == [5, 3]
    # sampling logprobs stay on their tokens (n1's are context in row 1 but still aligned)
    n1_logprobs = [-1.0 - 0.25 * i for i in range(2)]
    assert batch.old_logprobs[0, 2:4].tolist() == pytest.approx(n1_logprobs)
    assert batch.old_logprobs[1, 2:4].tolist() == pytest.approx(n1_logprobs)
    assert batch.old_logprobs[0, 4].item() == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_batch_without_branching_equals_flat_leaf_rows(seed):
    trees = chain_trees(seed)
    batch = build_training_batch(trees, pad_token_id=EOS)
    flat = flat_leaf_rows(trees, pad_token_id=EOS)
    for name, expected in flat.items():
        assert torch.equal(getattr(batch, name).to(expected.dtype), expected), name
    assert batch.num_tokens == sum(t.num_generated_tokens() for t in trees)


def _tiny_policy(seed: int = 0, attention_dropout: float = 0.0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         pad_token_id=EOS, eos_token_id=EOS, bos_token_id=1, tie_word_embeddings=False,
                         attention_dropout=attention_dropout)
    return Qwen3ForCausalLM(config)


def test_shared_prefix_gradient_equals_flat_leaf_row_gradient_at_ratio_one():
    # At ratio 1 the surrogate's gradient is -sum_t A_t grad logp_t: training a shared node once with the
    # sum of its leaves' advantages equals training it in every leaf row with that leaf's advantage.
    tree = branched_tree()
    model = _tiny_policy()

    # The token-mean normaliser is flat training's too, so the two losses are equal, not just proportional.
    def token_mean_loss_gradient(input_ids, attention_mask, loss_mask, advantages, num_tokens):
        model.zero_grad()
        logprobs = token_logprobs(model(input_ids=input_ids, attention_mask=attention_mask).logits, input_ids)
        loss, _ = clipped_surrogate_loss(logprobs, logprobs.detach(), advantages, loss_mask, num_tokens=num_tokens)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    batch = build_training_batch([tree], pad_token_id=EOS)
    flat = flat_leaf_rows([tree], pad_token_id=EOS)
    assert batch.num_tokens == int(flat["loss_mask"].sum()) > batch.num_trained_tokens
    tree_grads = token_mean_loss_gradient(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                          batch.advantages, batch.num_tokens)
    flat_grads = token_mean_loss_gradient(flat["input_ids"], flat["attention_mask"], flat["loss_mask"],
                                          flat["advantages"], None)
    for g_tree, g_flat in zip(tree_grads, flat_grads):
        assert torch.allclose(g_tree, g_flat, atol=1e-6, rtol=1e-4)
    assert any(g.abs().max() > 1e-4 for g in tree_grads)


def test_micro_batches_trim_padding_and_keep_row_order():
    batch = build_training_batch(chain_trees(0), pad_token_id=EOS)
    micro = batch.micro_batches(2)
    assert [m.num_sequences for m in micro] == [2] * (batch.num_sequences // 2) + [1] * (batch.num_sequences % 2)
    assert sum(m.num_tokens for m in micro) == batch.num_tokens
    start = 0
    for m in micro:
        width = int(batch.lengths[start:start + m.num_sequences].max())
        assert m.input_ids.shape == (m.num_sequences, width)
        assert torch.equal(m.input_ids, batch.input_ids[start:start + m.num_sequences, :width])
        assert m.sequence_ids == batch.sequence_ids[start:start + m.num_sequences]
        start += m.num_sequences


def test_max_tokens_cuts_rows_at_the_same_position_for_shared_nodes():
    batch = build_training_batch([branched_tree()], pad_token_id=EOS, max_tokens=4)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 12, 13]]
    assert batch.num_truncated == 3
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert batch.num_trained_tokens == 4
    assert batch.num_tokens == 6  # the cut rows still count n1's two tokens once each, as flat rows would


def test_missing_advantage_raises_naming_tree_and_node():
    tree = branched_tree()
    tree.nodes[3].advantage = None
    with pytest.raises(ValueError, match=r"tree 'toy/branched' node 3 .*advantage None"):
        build_training_batch([tree], pad_token_id=EOS)
    # SFT does not need advantages
    assert build_training_batch([tree], pad_token_id=EOS, require_advantages=False).num_trained_tokens == 8


def test_malformed_inputs_raise_with_the_offending_ids():
    with pytest.raises(ValueError, match="appears twice"):
        build_training_batch([branched_tree(), branched_tree()], pad_token_id=EOS)
    tree = branched_tree()
    tree.nodes[2].logprobs = tree.nodes[2].logprobs[:-1]
    with pytest.raises(ValueError, match=r"node 2: token_ids has 2 entries, logprobs 1"):
        build_training_batch([tree], pad_token_id=EOS)
    tree = branched_tree()
    tree.nodes[0].loss_mask = [0, 1]
    with pytest.raises(ValueError, match="root"):
        build_training_batch([tree], pad_token_id=EOS)
    tree = new_tree("toy/empty_prompt", [])
    add_turn(tree, 0, [7, 8], advantage=1.0)
    with pytest.raises(ValueError, match="first token"):
        build_training_batch([tree], pad_token_id=EOS)
    tree = branched_tree()
    tree.nodes[5].logprobs = [float("nan")]
    with pytest.raises(ValueError, match=r"tree 'toy/branched' node 5: logprobs\[0\] = nan on a generated token"):
        build_training_batch([tree], pad_token_id=EOS)


def test_a_non_finite_logprob_off_the_loss_mask_is_refused_too():
    # n1's observation token (index 2) is context in every row; a NaN there must not slip into old_logprobs
    for bad in (float("nan"), float("-inf")):
        tree = branched_tree()
        tree.nodes[1].logprobs = tree.nodes[1].logprobs[:2] + [bad]
        with pytest.raises(ValueError, match=r"node 1: logprobs\[2\] = .* on a context \(prompt or observation\)"):
            build_training_batch([tree], pad_token_id=EOS)
    tree = branched_tree()
    tree.nodes[0].logprobs = [0.0, float("inf")]  # the prompt
    with pytest.raises(ValueError, match=r"node 0: logprobs\[1\] = inf"):
        build_training_batch([tree], pad_token_id=EOS, require_advantages=False)


def test_empty_input_gives_an_empty_batch():
    batch = build_training_batch([new_tree("toy/no_rollouts", [5, 6])], pad_token_id=EOS)
    assert batch.input_ids.shape == (0, 0) and batch.num_tokens == 0 and batch.micro_batches(4) == []


# ---- DeepSpeed set-up ----------------------------------------------------------------------------------
def test_init_distributed_env_fills_only_missing_variables(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    newly_set = init_distributed_env()
    assert os.environ["RANK"] == "0" and os.environ["LOCAL_RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert os.environ["MASTER_ADDR"] == "10.0.0.7" and "MASTER_ADDR" not in newly_set
    assert "MASTER_PORT" not in os.environ  # one process binds no port (init_process_group: a file store)
    if not torch.cuda.is_available():
        assert os.environ["DS_ACCELERATOR"] == "cpu"


def test_deepspeed_config_uses_unmanaged_accumulation_and_the_update_params():
    cfg = UpdateConfig(zero_stage=2, bf16=True, offload_optimizer=True, max_grad_norm=0.5, micro_batch_size=8)
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 8 and ds["gradient_accumulation_steps"] == 1
    assert ds["train_batch_size"] == 16 and ds["managed_gradient_accumulation"] is False
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 0.5
    assert deepspeed_config(cfg, micro_batch_size=3, world_size=1)["train_batch_size"] == 3
    with pytest.raises(ValueError, match="zero_stage"):
        deepspeed_config(UpdateConfig(zero_stage=0, offload_optimizer=True))


# ---- the update ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepspeed_module():
    """DeepSpeed imported once for the module, after the single-process environment is set."""
    init_distributed_env()
    import deepspeed

    return deepspeed


def rl_trees(model: torch.nn.Module, temperature: float = 1.0) -> list[RolloutTree]:
    """Two prompts; rollout A branches into a success (+1) and a failure (-1), rollout B fails (-1).

    Sampling logprobs are the model's own, so the first update starts at ratio 1.
    """
    trees = []
    for k in range(2):
        tree = new_tree(f"toy/rl{k}", [3, 4, 5 + k])
        a = add_turn(tree, 0, [6 + k, 7], [9])
        success = add_turn(tree, a.node_id, [11, 12, EOS])
        failure = add_turn(tree, a.node_id, [13, 14, EOS])
        b = add_turn(tree, 0, [15, 16], [9])
        b_leaf = add_turn(tree, b.node_id, [17, EOS])
        assign_summed_advantages(tree, {success.node_id: 1.0, failure.node_id: -1.0, b_leaf.node_id: -1.0})
        trees.append(tree)
    with torch.no_grad():
        for tree in trees:
            for leaf, path in tree.iter_leaf_paths():
                ids = torch.tensor([tree.prefix_token_ids(leaf.node_id)])
                logprobs = token_logprobs(model(input_ids=ids).logits, ids, temperature)[0].tolist()
                offset = 0
                for node in path:
                    node.logprobs = [logprobs[offset + i] if m else 0.0 for i, m in enumerate(node.loss_mask)]
                    offset += len(node.token_ids)
    return trees


@pytest.fixture(scope="module")
def trees() -> list[RolloutTree]:
    """``rl_trees`` with the initial tiny policy's logprobs at temperature 1 (never mutated by updates)."""
    return rl_trees(_tiny_policy())


def sft_trees() -> list[RolloutTree]:
    trees = []
    for k in range(3):
        tree = new_tree(f"toy/demo{k}", [3, 4 + k])
        turn = add_turn(tree, 0, [10 + k, 11, 12], [9, 9])
        add_turn(tree, turn.node_id, [20 + k, EOS])
        trees.append(tree)
    return trees


def _masked_mean_logprob(updater: PolicyUpdater, trees: list[RolloutTree], sign: float) -> float:
    batch = build_training_batch(trees, EOS)
    logprobs = updater.compute_logprobs(batch)
    selected = (batch.loss_mask > 0) & (batch.advantages * sign > 0)
    return float(logprobs[selected].mean())


def _params(updater: PolicyUpdater) -> dict[str, torch.Tensor]:
    return updater.policy_state_dict()


def test_rl_step_raises_positive_advantage_logprobs_and_lowers_the_loss(deepspeed_module):
    temperature = 0.8
    trees = rl_trees(_tiny_policy(), temperature)
    updater = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-2, micro_batch_size=4), pad_token_id=EOS)
    positive_before = _masked_mean_logprob(updater, trees, +1.0)
    negative_before = _masked_mean_logprob(updater, trees, -1.0)
    history = [updater.rl_step(trees, temperature) for _ in range(4)]
    assert _masked_mean_logprob(updater, trees, +1.0) > positive_before + 0.05
    assert _masked_mean_logprob(updater, trees, -1.0) < negative_before - 0.05
    losses = [m["losses/policy"] for m in history]
    assert losses[-1] < losses[0]
    # step 1 runs at ratio 1: loss = -mean token advantage, no clipping, no KL between old and current
    tokens = build_training_batch(trees, EOS)
    assert losses[0] == pytest.approx(-float(tokens.advantages.sum()) / tokens.num_tokens, abs=1e-5)
    assert history[0]["losses/clip_frac"] == 0.0 and history[0]["losses/approx_kl"] == pytest.approx(0, abs=1e-6)
    assert history[0]["update/num_tokens"] == tokens.num_tokens and history[0]["update/num_micro_batches"] == 2
    assert history[0]["losses/grad_norm"] > 0 and history[0]["update/skipped"] == 0.0
    assert updater.num_optimizer_steps == 4


def test_two_micro_batches_give_the_same_update_as_one_big_batch(deepspeed_module, trees):
    big = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-3, micro_batch_size=8), pad_token_id=EOS)
    small = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-3, micro_batch_size=4), pad_token_id=EOS)
    for _ in range(2):
        m_big, m_small = big.rl_step(trees), small.rl_step(trees)
        assert (m_big["update/num_micro_batches"], m_small["update/num_micro_batches"]) == (1, 2)
        # the gradient norm is sensitive to how micro-batch losses are scaled, unlike Adam's update
        assert m_small["losses/grad_norm"] == pytest.approx(m_big["losses/grad_norm"], rel=1e-5)
        for name in ("losses/policy", "losses/clip_frac", "losses/approx_kl"):
            assert m_small[name] == pytest.approx(m_big[name], rel=1e-5, abs=1e-7)
    for name, value in _params(big).items():
        assert torch.allclose(_params(small)[name], value, atol=1e-6), name
    assert any(not torch.equal(v, _tiny_policy().state_dict()[k]) for k, v in _params(big).items())


def test_zero3_update_matches_stage0(deepspeed_module, trees):
    stage0 = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-3, micro_batch_size=8), pad_token_id=EOS)
    stage3 = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-3, micro_batch_size=4, zero_stage=3),
                           pad_token_id=EOS)
    m0, m3 = stage0.rl_step(trees), stage3.rl_step(trees)
    assert m3["losses/grad_norm"] == pytest.approx(m0["losses/grad_norm"], rel=1e-5)
    p0, p3 = _params(stage0), _params(stage3)
    assert p0.keys() == p3.keys()
    # Adam's first step is lr * g / (|g| + eps): where |g| is near eps, float summation order (ZeRO-3 gathers
    # and reduces in its own order) moves the step by a few 1e-6; 1e-5 is 1 % of the lr 1e-3 step
    for name in p0:
        assert p3[name].shape == p0[name].shape and torch.allclose(p3[name], p0[name], atol=1e-5), name


def test_gradient_checkpointing_gives_the_same_update(deepspeed_module, trees):
    plain = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-3), pad_token_id=EOS)
    recompute = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-3, gradient_checkpointing=True), pad_token_id=EOS)
    assert recompute.module.is_activation_checkpointing
    m_plain, m_recompute = plain.rl_step(trees), recompute.rl_step(trees)
    assert m_recompute["losses/grad_norm"] == pytest.approx(m_plain["losses/grad_norm"], rel=1e-5)
    for name, value in _params(plain).items():
        assert torch.allclose(_params(recompute)[name], value, atol=1e-6), name


def test_sft_step_lowers_cross_entropy(deepspeed_module):
    trees = sft_trees()
    updater = PolicyUpdater(_tiny_policy(), UpdateConfig(lr=1e-2), pad_token_id=EOS)
    losses = [updater.sft_step(trees)["losses/sft"] for _ in range(6)]
    # a fresh model is near uniform over the vocabulary: CE ~ log(32) = 3.47 nats
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.3)
    assert losses[-1] < losses[0] - 0.3
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))


def test_step_without_trainable_tokens_takes_no_optimizer_step(deepspeed_module):
    updater = PolicyUpdater(_tiny_policy(), UpdateConfig(), pad_token_id=EOS)
    before = _params(updater)
    metrics = updater.rl_step([new_tree("toy/no_rollouts", [5, 6])])
    assert metrics["update/skipped"] == 1.0 and metrics["update/num_tokens"] == 0
    assert updater.num_optimizer_steps == 0
    assert all(torch.equal(v, _params(updater)[k]) for k, v in before.items())


def test_checkpoint_resumes_bitwise_with_optimizer_state_and_kl_reference(deepspeed_module, trees, tmp_path):
    cfg = UpdateConfig(lr=1e-2, kl_coef=0.1, ppo_epochs=2, micro_batch_size=4)
    # attention dropout makes the next update depend on the RNG state, which the checkpoint carries
    first = PolicyUpdater(_tiny_policy(0, attention_dropout=0.1), cfg, pad_token_id=EOS)
    first.rl_step(trees)
    first.save_checkpoint(tmp_path / "ckpt")
    expected_metrics = first.rl_step(trees)
    expected_params = _params(first)
    assert expected_metrics["losses/kl"] > 0  # the policy has moved away from its reference

    # different initial weights, hence a different reference copy: both must come from the checkpoint
    resumed = PolicyUpdater(_tiny_policy(1, attention_dropout=0.1), cfg, pad_token_id=EOS, seed=1)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.num_optimizer_steps == 2
    metrics = resumed.rl_step(trees)
    for name, value in expected_metrics.items():
        if name != "update/seconds":
            assert metrics[name] == value, name
    params = _params(resumed)
    for name, value in expected_params.items():
        assert torch.equal(params[name], value), name


def test_load_checkpoint_from_a_folder_without_one_raises(deepspeed_module, tmp_path):
    updater = PolicyUpdater(_tiny_policy(), UpdateConfig(), pad_token_id=EOS)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        updater.load_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no DeepSpeed checkpoint"):
        updater.load_checkpoint(tmp_path / "empty")


def test_training_batch_moves_to_a_device_unchanged():
    batch = build_training_batch([branched_tree()], pad_token_id=EOS)
    moved = batch.to("cpu")
    assert isinstance(moved, TrainingBatch) and moved.num_tokens == batch.num_tokens
    assert torch.equal(moved.advantages, batch.advantages)


def _nan_at_padding(module, args, kwargs, output):
    """Forward hook: the logits of padding positions become NaN (a model is free to emit anything there)."""
    output.logits[~kwargs["attention_mask"].bool()] = float("nan")
    return output


def with_a_short_row(trees: list[RolloutTree]) -> list[RolloutTree]:
    """``trees`` plus a one-turn tree of 4 tokens, so its row has several padding positions (the logits of
    a padding position feed the log-prob of the next one)."""
    tree = new_tree("toy/short", [3, 4])
    add_turn(tree, 0, [6, EOS], advantage=0.5)
    return list(trees) + [tree]


def test_compute_logprobs_is_zero_on_padding_whatever_the_model_emits_there(deepspeed_module, trees):
    updater = PolicyUpdater(_tiny_policy(), UpdateConfig(micro_batch_size=8), pad_token_id=EOS)
    batch = build_training_batch(with_a_short_row(trees), EOS)
    assert int((batch.attention_mask == 0).sum(dim=1).max()) >= 2
    clean = updater.compute_logprobs(batch)
    handle = updater.module.register_forward_hook(_nan_at_padding, with_kwargs=True)
    try:
        poisoned = updater.compute_logprobs(batch)
    finally:
        handle.remove()
    assert torch.equal(poisoned, clean) and (poisoned[batch.attention_mask == 0] == 0).all()


def test_a_reference_policy_emitting_nan_on_padding_leaves_the_kl_update_unchanged(deepspeed_module, trees):
    cfg = UpdateConfig(lr=1e-2, kl_coef=0.1, ppo_epochs=2, micro_batch_size=8)
    clean = PolicyUpdater(_tiny_policy(), cfg, pad_token_id=EOS)
    poisoned = PolicyUpdater(_tiny_policy(), cfg, pad_token_id=EOS)
    poisoned.ref_model.register_forward_hook(_nan_at_padding, with_kwargs=True)
    trees = with_a_short_row(trees)
    assert int((build_training_batch(trees, EOS).attention_mask == 0).sum(dim=1).max()) >= 2
    want, got = clean.rl_step(trees), poisoned.rl_step(trees)
    for name in ("losses/policy", "losses/kl", "losses/clip_frac", "losses/approx_kl", "losses/grad_norm"):
        assert math.isfinite(got[name]) and got[name] == want[name], name
    assert want["losses/kl"] > 0  # the second epoch moved the policy away from its reference
    for name, value in _params(clean).items():
        assert torch.equal(_params(poisoned)[name], value), name
