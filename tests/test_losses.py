"""Policy losses against hand-worked values and slow per-token loops."""

import math

import pytest
import torch

from trace.losses import (
    clipped_surrogate_loss,
    kl_k3,
    kl_penalty_loss,
    sft_loss,
    token_logprobs,
    token_mean,
)


def _random_inputs(seed: int, num_seqs: int = 3, num_positions: int = 7):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(num_seqs, num_positions, generator=gen) * 3
    old_logprobs = logprobs + 0.6 * torch.randn(num_seqs, num_positions, generator=gen)  # ratios well past the clip
    advantages = torch.randn(num_seqs, num_positions, generator=gen)
    loss_mask = (torch.rand(num_seqs, num_positions, generator=gen) < 0.6).float()
    return logprobs, old_logprobs, advantages, loss_mask


def _slow_surrogate(logprobs, old_logprobs, advantages, loss_mask, clip_low, clip_high, num_tokens=None):
    """One token at a time, with Python floats."""
    total, clipped_count, kl_total, count = 0.0, 0.0, 0.0, 0.0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if loss_mask[b, t] == 0:
                continue
            log_ratio = float(logprobs[b, t] - old_logprobs[b, t])
            ratio = math.exp(log_ratio)
            adv = float(advantages[b, t])
            unclipped = -adv * ratio
            clipped = -adv * min(max(ratio, 1 - clip_low), 1 + clip_high)
            total += max(unclipped, clipped)
            clipped_count += 1.0 if clipped > unclipped else 0.0
            kl_total += (ratio - 1) - log_ratio
            count += 1
    denom = max(count if num_tokens is None else num_tokens, 1)
    return total / denom, clipped_count / denom, kl_total / denom


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip_low,clip_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_clipped_surrogate_matches_slow_loop_reference(seed, clip_low, clip_high):
    logprobs, old_logprobs, advantages, loss_mask = _random_inputs(seed)
    loss, metrics = clipped_surrogate_loss(logprobs, old_logprobs, advantages, loss_mask, clip_low, clip_high)
    ref_loss, ref_clip_frac, ref_kl = _slow_surrogate(logprobs, old_logprobs, advantages, loss_mask,
                                                      clip_low, clip_high)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert metrics["losses/policy"].item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert metrics["losses/clip_frac"].item() == pytest.approx(ref_clip_frac, abs=1e-6)
    assert metrics["losses/approx_kl"].item() == pytest.approx(ref_kl, rel=1e-5, abs=1e-6)
    assert 0.0 < metrics["losses/clip_frac"].item() < 1.0  # the inputs exercise both branches


def test_clip_keeps_or_stops_the_gradient_as_ppo_prescribes():
    # clip_low 0.2 -> lower bound 0.8; clip_high 0.28 -> upper bound 1.28.
    # token  A   ratio  unclipped  clipped  max           active     d loss_t / d logprob = -A * ratio if unclipped
    #   0   +1   1.5     -1.5      -1.28    -1.28         clipped    0
    #   1   +1   0.5     -0.5      -0.8     -0.5          unclipped  -0.5
    #   2   -2   0.5      1.0       1.6      1.6          clipped    0
    #   3   -2   1.5      3.0       2.56     3.0          unclipped  +3.0
    #   4   +5   3.0     (masked out)
    # loss = (-1.28 - 0.5 + 1.6 + 3.0) / 4 = 0.705; clip_frac = 2 / 4; gradients divided by 4 tokens.
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 3.0]])
    old_logprobs = torch.full_like(ratios, -1.0)
    logprobs = (old_logprobs + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, -2.0, -2.0, 5.0]])
    loss_mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, metrics = clipped_surrogate_loss(logprobs, old_logprobs, advantages, loss_mask, 0.2, 0.28)
    loss.backward()
    assert loss.item() == pytest.approx(0.705, abs=1e-6)
    assert metrics["losses/clip_frac"].item() == pytest.approx(0.5)
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 0.0, 3.0 / 4, 0.0], abs=1e-6)


def test_clip_higher_widens_only_the_upper_bound():
    # A = +1 at ratio 1.25: clipped at 1.2 with a symmetric 0.2 range, free with clip_high = 0.28.
    old_logprobs = torch.zeros(1, 2)
    logprobs = torch.tensor([[math.log(1.25), math.log(0.75)]])
    advantages = torch.tensor([[1.0, -1.0]])
    loss_mask = torch.ones(1, 2)
    loss_sym, m_sym = clipped_surrogate_loss(logprobs, old_logprobs, advantages, loss_mask, 0.2, 0.2)
    loss_dapo, m_dapo = clipped_surrogate_loss(logprobs, old_logprobs, advantages, loss_mask, 0.2, 0.28)
    # token 1 (A = -1, ratio 0.75 < 0.8) is clipped at 0.8 in both: -(-1) * 0.8 = 0.8
    assert loss_sym.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert loss_dapo.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert m_sym["losses/clip_frac"].item() == pytest.approx(1.0)
    assert m_dapo["losses/clip_frac"].item() == pytest.approx(0.5)


def test_surrogate_at_ratio_one_is_minus_mean_advantage_with_zero_kl_and_no_clipping():
    logprobs = torch.tensor([[-0.3, -1.2, -2.0]])
    advantages = torch.tensor([[0.0, 2.0, -1.0]])
    loss_mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, metrics = clipped_surrogate_loss(logprobs, logprobs.clone(), advantages, loss_mask)
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    assert metrics["losses/clip_frac"].item() == 0.0
    assert metrics["losses/approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_micro_batches_normalised_by_the_batch_token_count_add_up_to_the_batch_loss():
    logprobs, old_logprobs, advantages, loss_mask = _random_inputs(seed=5, num_seqs=4)
    full_loss, full_metrics = clipped_surrogate_loss(logprobs, old_logprobs, advantages, loss_mask)
    num_tokens = int(loss_mask.sum())
    parts = [clipped_surrogate_loss(logprobs[rows], old_logprobs[rows], advantages[rows], loss_mask[rows],
                                    num_tokens=num_tokens) for rows in (slice(0, 1), slice(1, 4))]
    assert sum(p[0] for p in parts).item() == pytest.approx(full_loss.item(), rel=1e-6)
    for name in full_metrics:
        assert sum(p[1][name] for p in parts).item() == pytest.approx(full_metrics[name].item(), rel=1e-6, abs=1e-7)
    # the slow reference with the explicit normaliser agrees too
    ref_loss, _, _ = _slow_surrogate(logprobs[1:], old_logprobs[1:], advantages[1:], loss_mask[1:], 0.2, 0.2,
                                     num_tokens=num_tokens)
    assert parts[1][0].item() == pytest.approx(ref_loss, rel=1e-5)


def test_token_mean_of_an_empty_mask_is_zero_not_nan():
    values = torch.randn(2, 3, requires_grad=True)
    assert token_mean(values, torch.zeros(2, 3)).item() == 0.0
    assert token_mean(values, torch.zeros(2, 3), num_tokens=0).item() == 0.0


def test_invalid_clip_range_and_shapes_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_low"):
        clipped_surrogate_loss(x, x, x, x, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        clipped_surrogate_loss(x, x, x, x, clip_high=-0.1)
    with pytest.raises(ValueError, match="advantages shape"):
        clipped_surrogate_loss(x, x, torch.zeros(2, 2), x)


def test_kl_k3_is_nonnegative_and_zero_at_equality():
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 9, generator=gen) * 5
    ref_logprobs = -torch.rand(4, 9, generator=gen) * 5
    assert (kl_k3(logprobs, ref_logprobs) >= 0).all()
    assert torch.equal(kl_k3(logprobs, logprobs), torch.zeros_like(logprobs))
    # hand-worked: r = ref - logp = log 2 -> k3 = 2 - log 2 - 1 = 0.30685
    assert kl_k3(torch.zeros(1, 1), torch.full((1, 1), math.log(2.0))).item() == pytest.approx(1 - math.log(2.0))


def test_kl_k3_is_unbiased_for_the_exact_kl_of_a_categorical():
    # E_{x ~ p}[k3(x)] = E_p[q/p - 1 - log(q/p)] = KL(p || q) exactly
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    expected = float((p * (p / q).log()).sum())
    estimate = float((p * kl_k3(p.log()[None], q.log()[None])[0]).sum())
    assert estimate == pytest.approx(expected, rel=1e-6)


def test_kl_penalty_is_skipped_at_zero_coefficient_and_scaled_otherwise():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.0 + math.log(2.0), -2.0]])
    mask = torch.tensor([[1.0, 1.0]])
    loss, metrics = kl_penalty_loss(logprobs, None, mask, kl_coef=0.0)
    assert loss.item() == 0.0 and metrics == {}
    loss, metrics = kl_penalty_loss(logprobs, ref_logprobs, mask, kl_coef=0.5)
    kl = (1 - math.log(2.0) + 0.0) / 2  # token-mean of k3 over the 2 tokens
    assert metrics["losses/kl"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.5 * kl)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty_loss(logprobs, None, mask, kl_coef=0.1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_a_per_position_log_softmax_loop(temperature):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=gen)
    input_ids = torch.randint(0, 11, (2, 5), generator=gen)
    out = token_logprobs(logits, input_ids, temperature)
    assert out.shape == (2, 5) and out.dtype == torch.float32
    for b in range(2):
        assert out[b, 0].item() == 0.0
        for t in range(1, 5):
            expected = torch.log_softmax(logits[b, t - 1] / temperature, dim=-1)[input_ids[b, t]].item()
            assert out[b, t].item() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, input_ids, 0.0)


def test_token_logprobs_of_bf16_logits_are_float32():
    logits = torch.randn(1, 4, 7).to(torch.bfloat16)
    out = token_logprobs(logits, torch.tensor([[1, 2, 3, 4]]))
    expected = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, torch.tensor([[2], [3], [4]]))[:, 0]
    assert out.dtype == torch.float32
    assert torch.allclose(out[0, 1:], expected, atol=1e-6)


def test_sft_loss_is_cross_entropy_on_masked_tokens_only():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 9, generator=gen)
    labels = torch.randint(0, 9, (2, 6), generator=gen)
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]], dtype=torch.float32)
    terms = [torch.nn.functional.cross_entropy(logits[b, t - 1], labels[b, t])
             for b in range(2) for t in range(1, 6) if loss_mask[b, t]]
    expected = torch.stack(terms).mean()
    assert sft_loss(logits, labels, loss_mask).item() == pytest.approx(expected.item(), rel=1e-6)
    # with the whole batch's count (3 + 2 = 5 tokens) as normaliser, the two rows add up
    halves = [sft_loss(logits[b:b + 1], labels[b:b + 1], loss_mask[b:b + 1], num_tokens=5) for b in range(2)]
    assert (halves[0] + halves[1]).item() == pytest.approx(expected.item(), rel=1e-6)
