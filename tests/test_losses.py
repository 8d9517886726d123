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


@pytest.mark.parametrize("chunk", [1, 2 * 4 * 11, 3 * 4 * 11, 1 << 24])  # a sequence, 2, 3 of 7, all at once
def test_token_logprobs_and_their_gradient_do_not_depend_on_the_chunking(chunk, monkeypatch):
    import trace.losses as losses

    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(7, 5, 11, generator=gen)).to(torch.bfloat16)
    input_ids = torch.randint(0, 11, (7, 5), generator=gen)
    weight = torch.randn(7, 5, generator=gen)

    def run():
        x = logits.clone().requires_grad_(True)
        out = token_logprobs(x, input_ids, 0.7)
        (out * weight).sum().backward()
        return out.detach(), x.grad

    reference = run()  # the default: the whole batch in one chunk
    monkeypatch.setattr(losses, "LOGPROB_CHUNK_ELEMENTS", chunk)
    chunked = run()
    assert torch.equal(chunked[0], reference[0]) and torch.equal(chunked[1], reference[1])  # bit for bit
    expected = torch.log_softmax(logits[:, :-1].float() / 0.7, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    assert torch.allclose(chunked[0][:, 1:], expected, atol=1e-6)


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


# ---- positions off the mask ------------------------------------------------------------------------------
def _plain_product_losses(logprobs, old_logprobs, advantages, ref_logprobs, loss_mask, num_tokens, kl_coef):
    """The losses written as plain ``value * mask`` products (no guard): the reference for finite inputs."""
    mask = loss_mask.to(logprobs.dtype)
    denom = float(max(num_tokens, 1))
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(0.8, 1.2)
    per_token = torch.maximum(unclipped, clipped)
    policy = (per_token * mask).sum() / denom
    with torch.no_grad():
        clip_frac = ((clipped > unclipped).to(per_token.dtype) * mask).sum() / denom
        approx_kl = (((ratio - 1.0) - log_ratio) * mask).sum() / denom
    kl_log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    kl = ((torch.exp(kl_log_ratio) - kl_log_ratio - 1.0) * mask).sum() / denom
    return policy + kl_coef * kl, {"losses/policy": policy.detach(), "losses/clip_frac": clip_frac,
                                   "losses/approx_kl": approx_kl, "losses/kl": kl.detach()}


def _guarded_losses(logprobs, old_logprobs, advantages, ref_logprobs, loss_mask, num_tokens, kl_coef):
    loss, metrics = clipped_surrogate_loss(logprobs, old_logprobs, advantages, loss_mask, num_tokens=num_tokens)
    kl_loss, kl_metrics = kl_penalty_loss(logprobs, ref_logprobs, loss_mask, kl_coef=kl_coef, num_tokens=num_tokens)
    return loss + kl_loss, {**metrics, **kl_metrics}


def _tiny_lm():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        max_position_embeddings=32))


def _loss_and_gradients(model, loss_fn, input_ids, old_logprobs, advantages, ref_logprobs, loss_mask,
                        logprob_offset=None):
    """Loss, metrics and parameter gradients of ``loss_fn`` on the model's log-probs of ``input_ids``."""
    model.zero_grad()
    logprobs = token_logprobs(model(input_ids=input_ids).logits, input_ids)
    if logprob_offset is not None:
        logprobs = logprobs + logprob_offset
    loss, metrics = loss_fn(logprobs, old_logprobs, advantages, ref_logprobs, loss_mask, int(loss_mask.sum()), 0.1)
    loss.backward()
    return loss.detach(), metrics, {name: p.grad.clone() for name, p in model.named_parameters()}


def _lm_inputs(seed: int, zero_advantages: bool = False):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 16, (3, 9), generator=gen)
    loss_mask = (torch.rand(3, 9, generator=gen) < 0.6).float()
    loss_mask[:, 0] = 0.0
    old_logprobs = -torch.rand(3, 9, generator=gen) * 4  # arbitrary finite values on and off the mask
    ref_logprobs = -torch.rand(3, 9, generator=gen) * 4
    advantages = torch.zeros(3, 9) if zero_advantages else torch.randn(3, 9, generator=gen) * loss_mask
    return input_ids, old_logprobs, advantages, ref_logprobs, loss_mask


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of float32 tensors (tells -0.0 from 0.0, unlike ==)."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("seed,zero_advantages", [(0, False), (1, False), (2, True)])
def test_finite_inputs_give_bit_identical_losses_metrics_and_gradients_to_the_plain_masked_product(
        seed, zero_advantages):
    # zero advantages make every per-token loss -0.0: the sign of the zero loss must survive too
    model = _tiny_lm()
    inputs = _lm_inputs(seed, zero_advantages)
    want_loss, want_metrics, want_grads = _loss_and_gradients(model, _plain_product_losses, *inputs)
    got_loss, got_metrics, got_grads = _loss_and_gradients(model, _guarded_losses, *inputs)
    assert _same_bits(got_loss, want_loss)
    assert set(got_metrics) == set(want_metrics)
    for name in want_metrics:
        assert _same_bits(got_metrics[name], want_metrics[name]), name
    for name in want_grads:
        assert _same_bits(got_grads[name], want_grads[name]), name
    assert any(g.abs().sum() > 0 for g in got_grads.values())


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("poisoned_input", ["old_logprobs", "advantages", "ref_logprobs", "logprobs"])
def test_non_finite_values_off_the_mask_change_neither_the_loss_nor_its_gradients(poisoned_input, poison):
    # one input at a time: a NaN log-ratio is stopped by the clamp's backward, which would hide a NaN advantage
    model = _tiny_lm()
    input_ids, old_logprobs, advantages, ref_logprobs, loss_mask = _lm_inputs(3)
    off = loss_mask == 0
    assert off.any() and (~off).any()
    clean_loss, clean_metrics, clean_grads = _loss_and_gradients(
        model, _guarded_losses, input_ids, old_logprobs, advantages, ref_logprobs, loss_mask)
    inputs = {"old_logprobs": old_logprobs, "advantages": advantages, "ref_logprobs": ref_logprobs,
              "logprobs": torch.zeros_like(old_logprobs)}  # the current policy's, poisoned through an offset
    inputs[poisoned_input] = torch.where(off, torch.full_like(old_logprobs, poison), inputs[poisoned_input])
    loss, metrics, grads = _loss_and_gradients(
        model, _guarded_losses, input_ids, inputs["old_logprobs"], inputs["advantages"], inputs["ref_logprobs"],
        loss_mask, logprob_offset=inputs["logprobs"])
    assert torch.isfinite(loss) and loss == clean_loss
    for name, value in clean_metrics.items():
        assert metrics[name] == value, name
    for name, value in clean_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        assert torch.equal(grads[name], value), name


def test_token_mean_ignores_non_finite_values_off_the_mask_but_not_on_it():
    values = torch.tensor([[1.0, float("nan"), 3.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    mean = token_mean(values, mask)
    mean.backward()
    assert mean.item() == 2.0
    assert values.grad.tolist() == [[0.5, 0.0, 0.5, 0.0]]
    assert math.isnan(token_mean(values.detach(), torch.ones(1, 4)).item())  # a trained NaN is not hidden
