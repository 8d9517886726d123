"""Policy losses as pure tensor functions: clipped surrogate, k3 KL penalty, SFT cross-entropy.

Every tensor here is aligned to token positions: column ``t`` of ``logprobs``, ``old_logprobs``,
``advantages`` and ``loss_mask`` (all (B, T)) describes token ``input_ids[:, t]``; ``token_logprobs``
does the one-position shift from logits to next tokens so callers never shift by hand. Column 0 has no
preceding context and always gets log-probability 0, so it must never be in ``loss_mask``.

Aggregation is the token mean over ``loss_mask`` (DAPO's token-level loss, arXiv 2503.14476, eq. 12):
``sum_{b,t} mask * value / num_tokens``. Each function takes an explicit ``num_tokens`` normaliser so a
batch split into micro-batches can divide every micro-batch by the *whole* batch's token count; the
micro-batch losses (and their gradients) then add up to the loss of the whole batch. Metrics are
aggregated the same way, so they add up too.

Numerical guards shared with verl ``core_algos``: log-ratios are clamped to [-20, 20] before ``exp``.

Positions off ``loss_mask`` cannot reach the loss, its metrics or its gradients: a NaN or inf there (padding,
an observation token's stored logprob, a reference log-prob of a prompt token) would survive a plain
``value * mask`` (``nan * 0 = nan``), so every input is first passed through ``torch.where``, which keeps the
entry where the mask is on or the entry is finite and puts 0 elsewhere. ``where`` selects rather than
multiplies, so for finite inputs the loss and its gradients are bit for bit those of ``value * mask``. Inputs
are sanitised before any arithmetic because a non-finite value that flows through ``exp`` before a
``where`` still sends NaN down the backward pass (``0 * inf``). Non-finite values on the mask are left alone:
the loss is then NaN, as it should be for a trained token without a valid log-probability.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp; exp(20) ~ 4.9e8 stays finite in float32


def _finite_off_mask(values: torch.Tensor, is_on: torch.Tensor) -> torch.Tensor:
    """``values`` with every non-finite entry off the mask replaced by 0 (entries on the mask untouched).

    Finite inputs come back bit for bit (``where`` selects, it does not multiply), and so do the gradients
    that flow back through the kept entries; a replaced entry gets gradient 0.

    Args:
        values: (B, T) float.
        is_on: (B, T) bool, True on the tokens that count.

    Returns:
        (B, T) tensor of ``values``' dtype.
    """
    return torch.where(is_on | torch.isfinite(values), values, 0.0)


def token_mean(values: torch.Tensor, loss_mask: torch.Tensor, num_tokens: int | float | None = None) -> torch.Tensor:
    """Token-mean of ``values`` over ``loss_mask``: ``sum(values * loss_mask) / num_tokens``.

    Args:
        values: (B, T) float.
        loss_mask: (B, T), 1 on tokens that count, 0 elsewhere (any numeric dtype).
        num_tokens: normaliser; ``None`` means ``loss_mask.sum()`` (this call's own tokens). Pass the whole
            batch's token count when ``values`` is one micro-batch of it. A normaliser of 0 (no tokens)
            is treated as 1, so an empty batch gives 0 rather than NaN.

    Returns:
        0-d float tensor (keeps the autograd graph of ``values``).

    Raises:
        ValueError: if shapes differ or ``num_tokens`` is negative.

    References:
        DAPO token-level policy-gradient loss, Yu et al. 2025, arXiv 2503.14476, eq. 12.
    """
    if values.shape != loss_mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != loss_mask shape {tuple(loss_mask.shape)}")
    mask = loss_mask.to(values.dtype)
    values = _finite_off_mask(values, loss_mask != 0)
    if num_tokens is None:
        denom = mask.sum().clamp(min=1.0)
    else:
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0 (the batch's count of loss_mask tokens)")
        denom = float(max(num_tokens, 1))
    return (values * mask).sum() / denom


LOGPROB_CHUNK_ELEMENTS = 1 << 24  # float32 logits per chunk of token_logprobs: 64 MiB


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token given its prefix, under temperature-scaled logits.

    ``out[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]`` for ``t >= 1`` and
    ``out[:, 0] = 0`` (the first token has no prediction). The rollout's sampling logprobs were taken
    under the same temperature, so this is what the PPO ratio compares them with.

    Computed in float32 as ``gathered - logsumexp`` over chunks of whole sequences of at most
    ``LOGPROB_CHUNK_ELEMENTS`` logits (at least one sequence): without grad a large bf16 (B, T, V) batch is never
    one float32 copy (with grad autograd keeps each chunk's copy for backward, as it kept each sequence's), and a
    small batch is one chunk. Each chunk's gradient is a slice of the logits' gradient, added into a zero (B, T, V)
    tensor in backward, so one chunk per sequence would cost B such tensors.

    Args:
        logits: (B, T, V) float, the causal LM's output for ``input_ids``.
        input_ids: (B, T) long.
        temperature: > 0; logits are divided by it.

    Returns:
        (B, T) float32 log-probabilities in nats.

    Raises:
        ValueError: on a non-positive temperature or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (use the rollout's sampling temperature)")
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} must be (B, T, V) with (B, T) = input_ids shape "
                         f"{tuple(input_ids.shape)}")
    num_seqs, num_positions = input_ids.shape
    out = torch.zeros(num_seqs, num_positions, dtype=torch.float32, device=logits.device)
    if num_positions < 2 or num_seqs == 0:
        return out
    step = max(1, LOGPROB_CHUNK_ELEMENTS // max(1, (num_positions - 1) * logits.shape[-1]))
    rows = []
    for start in range(0, num_seqs, step):
        scaled = logits[start:start + step, :-1].float() / temperature  # (b, T-1, V)
        gathered = scaled.gather(-1, input_ids[start:start + step, 1:].unsqueeze(-1)).squeeze(-1)  # (b, T-1)
        rows.append(gathered - torch.logsumexp(scaled, dim=-1))
    return torch.cat([out[:, :1], torch.cat(rows)], dim=1)


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate with an asymmetric (clip-higher) ratio range.

    Per token, with ``ratio = exp(logprobs - old_logprobs)``:
    ``loss_t = max(-A_t * ratio, -A_t * clip(ratio, 1 - clip_low, 1 + clip_high))``;
    the loss is ``token_mean(loss_t, loss_mask, num_tokens)``.

    Args:
        logprobs: (B, T) float, current policy log-probs (nats), with gradient.
        old_logprobs: (B, T) float, sampling-time log-probs (nats).
        advantages: (B, T) float, advantage of each token (0 off the mask).
        loss_mask: (B, T), 1 on generated tokens to train, 0 elsewhere. Off the mask, non-finite entries of
            the three inputs above are ignored: they change neither the loss, nor its metrics, nor its
            gradients (module docstring).
        clip_low: ratio lower bound is ``1 - clip_low``; in [0, 1).
        clip_high: ratio upper bound is ``1 + clip_high``; >= 0 (DAPO uses 0.28).
        num_tokens: normaliser (see ``token_mean``); the whole batch's count for micro-batches.

    Returns:
        ``(loss, metrics)``: 0-d loss with gradient; metrics are detached 0-d tensors aggregated like the
        loss (so micro-batch values add up): ``losses/policy`` (the loss), ``losses/clip_frac`` (share of
        tokens where the clipped term is the active one) and ``losses/approx_kl`` (k3 estimate of
        KL(old || current), ``(ratio - 1) - log ratio``, as in cleanrl).

    Raises:
        ValueError: on shapes that differ or clip ranges out of bounds.

    References:
        PPO clipped objective, Schulman et al. 2017, arXiv 1707.06347, eq. 7 (applied per token).
        Clip-higher (decoupled clip_low / clip_high), Yu et al. 2025 (DAPO), arXiv 2503.14476, eq. 10.
        Deviation: the log-ratio is clamped to [-20, 20] before ``exp`` (as verl does) for finite ratios.
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low} must be in [0, 1) so that the lower ratio bound 1 - clip_low > 0")
    if clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high} must be >= 0")
    for name, tensor in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(logprobs.shape)}")
    is_on = loss_mask != 0
    logprobs, old_logprobs, advantages = (_finite_off_mask(x, is_on) for x in (logprobs, old_logprobs, advantages))
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # (B, T)
    loss = token_mean(per_token, loss_mask, num_tokens)
    with torch.no_grad():
        clip_frac = token_mean((clipped > unclipped).to(per_token.dtype), loss_mask, num_tokens)
        approx_kl = token_mean((ratio - 1.0) - log_ratio, loss_mask, num_tokens)
    metrics = {"losses/policy": loss.detach(), "losses/clip_frac": clip_frac, "losses/approx_kl": approx_kl}
    return loss, metrics


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(current || reference) from tokens sampled by the current policy.

    ``k3 = exp(r) - r - 1`` with ``r = ref_logprobs - logprobs``; unbiased for the KL, always >= 0, and 0
    exactly where the two log-probs agree.

    Args:
        logprobs: (B, T) float, current policy log-probs (nats).
        ref_logprobs: (B, T) float, reference policy log-probs (nats).

    Returns:
        (B, T) float, same dtype as ``logprobs``.

    Raises:
        ValueError: if the shapes differ.

    References:
        J. Schulman, "Approximating KL Divergence" (2020), estimator k3; used as GRPO's KL term,
        Shao et al. 2024, arXiv 2402.03300, eq. 4. The log-ratio is clamped to [-20, 20] before ``exp``.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}")
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_penalty_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    loss_mask: torch.Tensor,
    kl_coef: float = 0.0,
    num_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL penalty to a frozen reference: ``kl_coef * token_mean(kl_k3(logprobs, ref_logprobs))``.

    Args:
        logprobs: (B, T) float, current policy log-probs, with gradient.
        ref_logprobs: (B, T) float reference log-probs; may be ``None`` when ``kl_coef == 0``.
        loss_mask: (B, T), 1 on generated tokens; off it, non-finite entries of ``logprobs`` and
            ``ref_logprobs`` are ignored (module docstring).
        kl_coef: >= 0; 0 skips the term (returns a constant 0 and no metrics, no reference needed).
        num_tokens: normaliser (see ``token_mean``).

    Returns:
        ``(loss, metrics)``; metrics ``losses/kl`` (the token-mean k3, before ``kl_coef``), detached.

    Raises:
        ValueError: on a negative coefficient, ``kl_coef > 0`` without ``ref_logprobs``, or shapes that differ.

    References:
        GRPO's KL regulariser, Shao et al. 2024, arXiv 2402.03300, eq. 3-4 (k3 estimator).
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0 (0 turns the KL penalty off)")
    if kl_coef == 0:
        return torch.zeros((), dtype=logprobs.dtype, device=logprobs.device), {}
    if ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logprobs from the reference policy")
    if ref_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} and loss_mask shape "
                         f"{tuple(loss_mask.shape)} must equal logprobs shape {tuple(logprobs.shape)}")
    is_on = loss_mask != 0
    kl = token_mean(kl_k3(_finite_off_mask(logprobs, is_on), _finite_off_mask(ref_logprobs, is_on)), loss_mask,
                    num_tokens)
    return kl_coef * kl, {"losses/kl": kl.detach()}


def sft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    num_tokens: int | float | None = None,
) -> torch.Tensor:
    """Supervised cross-entropy (nats per token) on the ``loss_mask`` tokens.

    ``-token_mean(token_logprobs(logits, labels), loss_mask, num_tokens)``: each masked token of
    ``labels`` is predicted from the logits one position earlier (temperature 1).

    Args:
        logits: (B, T, V) float, the causal LM's output for ``labels``.
        labels: (B, T) long, the same ids that were fed to the model.
        loss_mask: (B, T), 1 on tokens to imitate; column 0 must be 0.
        num_tokens: normaliser (see ``token_mean``).

    Returns:
        0-d float32 loss with gradient. Its value ignores non-finite logits off the mask, but its gradient
        is finite only for finite logits: the model's own backward carries a NaN forward value along.

    Raises:
        ValueError: on mismatched shapes.

    References:
        Standard next-token maximum likelihood; loss on action tokens only, observations masked
        (ReAct-style SFT, Yao et al. 2022, arXiv 2210.03629).
    """
    return -token_mean(token_logprobs(logits, labels, 1.0), loss_mask, num_tokens)
