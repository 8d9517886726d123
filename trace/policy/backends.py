"""Generation backends' contract: token ids in, sampled token ids and their log-probabilities out.

``GenerationBackend`` is the one interface the rollout engine uses; it is backend-agnostic (no tensors, no
text): a batch of prefixes (token id lists) goes in, one ``Generation`` per prefix comes out. A vLLM backend
fits behind the same Protocol (stop token ids, stop strings and per-request seeds map onto its
``SamplingParams``; automatic prefix caching plays the role of ``HFBackend``'s kept KV).

Implementations: ``trace.policy.hf_backend.HFBackend`` (a batched sampling loop over a Hugging Face model)
and ``trace.policy.vllm_backend.VLLMBackend``. Every request samples from its own random stream, seeded by
``request_seeds``, so a request's tokens never depend on the rest of its batch. Backends follow the policy's
announced weight updates (``trace.policy.weights``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

FinishKind = Literal["stop", "eos", "length"]
SEED_LIMIT = 1 << 63  # request seeds lie in [0, SEED_LIMIT): what torch and vLLM generators accept


@dataclass
class Generation:
    """One sampled continuation.

    Attributes:
        token_ids: (N,) generated token ids, including the stop token / EOS that ended the generation.
        logprobs: (N,) log-probabilities in nats of ``token_ids`` under the sampling distribution (after
            temperature and top-p renormalisation; see ``sample_tokens``).
        finish: ``"stop"`` (a stop token or stop string was produced), ``"eos"`` (an EOS token: the
            rollout engine ends the episode there, ``trace.rollout``), or ``"length"`` (``max_new_tokens``
            reached without either). EOS takes precedence over a stop token, a stop token over a stop string.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishKind = "length"


@runtime_checkable
class GenerationBackend(Protocol):
    """Samples continuations of token-id prefixes."""

    def generate(
        self,
        prefixes: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        seed: int | Sequence[int] = 0,
    ) -> list[Generation]:
        """Sample one continuation per prefix.

        Args:
            prefixes: B token-id lists, each non-empty.
            max_new_tokens: most tokens per continuation, one int for all or B ints (>= 0).
            temperature: > 0 samples from ``softmax(logits / temperature)``; 0 is greedy.
            top_p: nucleus mass in (0, 1].
            stop_token_ids: tokens that end a continuation (finish ``"stop"``); kept in ``token_ids``. EOS
                (the tokenizer's and the model's generation-config EOS ids) always ends one too, with
                finish ``"eos"``, also kept in ``token_ids``.
            stop_strings: texts that end a continuation once its decoded tail contains them (finish
                ``"stop"``); the token that completes the text is kept.
            seed: B ints in [0, 2**63), one random stream per request (``request_seeds``), or one int for the
                call (request ``i`` then uses ``request_seed(seed, i)``). A request's tokens depend only on the
                model, its prefix, the sampling arguments and its seed, never on the other requests.

        Returns:
            B ``Generation`` in the order of ``prefixes``.
        """
        ...

    def clear_cache(self) -> None:
        """Make sure no state computed under older weights serves the next call (see ``weights_version``)."""
        ...


def sample_tokens(logits: Any, temperature: float, top_p: float, uniforms: Any) -> tuple[Any, Any]:
    """Sample one token per row and return its log-probability under the sampling distribution.

    Sampling is Gumbel-max: ``argmax(log p + g)`` with ``g = -log(-log(u))`` is an exact draw from ``p``; the
    uniforms ``u`` come from the caller, so each sequence can own its random stream.

    Args:
        logits: (B, V) float tensor of next-token logits.
        temperature: > 0: sample from ``p = softmax(logits / temperature)``; 0: greedy (argmax), with the
            log-probability of the argmax token under ``softmax(logits)`` (``uniforms`` unused).
        top_p: nucleus sampling (Holtzman et al. 2020, arXiv 1904.09751): keep the smallest set of most
            likely tokens whose mass reaches ``top_p`` (always at least one), renormalise, sample.
        uniforms: (B, V) float tensor of independent Uniform(0, 1) draws (``None`` when greedy).

    Returns:
        ``(tokens, logprobs)``: (B,) int64 and (B,) float32; ``logprobs`` are of the renormalised truncated
        distribution actually sampled from (nats).

    Raises:
        ValueError: if ``temperature < 0`` or ``top_p`` is outside (0, 1].
    """
    import torch

    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
        sorted_logp = sorted_logp.masked_fill(mass_before >= top_p, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
        logp = torch.log_softmax(logp, dim=-1)
    tiny = torch.finfo(torch.float32).tiny
    gumbel = -torch.log(-torch.log(uniforms.float().clamp(min=tiny, max=1.0 - 1e-7)))
    tokens = (logp + gumbel).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def request_seed(seed: int, request_idx: int) -> int:
    """Seed of one request's random stream: splitmix64 of (seed, index), so streams never overlap in practice."""
    mask = (1 << 64) - 1
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(request_idx) + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


def request_seeds(seed: int | Sequence[int], num_requests: int) -> list[int]:
    """The sampling seed of each request of a ``generate`` call.

    Args:
        seed: ``num_requests`` per-request seeds in [0, 2**63), used as given; or one int, the call seed,
            from which request ``i`` gets ``request_seed(seed, i)`` (a stream tied to its position in the call).
        num_requests: B >= 0.

    Returns:
        B ints in [0, 2**63).

    Raises:
        ValueError: a per-request sequence whose length is not B, or a per-request seed outside [0, 2**63).
    """
    if not hasattr(seed, "__len__"):
        return [request_seed(int(seed), idx) for idx in range(num_requests)]
    seeds = [int(s) for s in seed]
    if len(seeds) != num_requests:
        raise ValueError(f"seed has {len(seeds)} per-request entries for {num_requests} prefixes; pass one seed "
                         "per prefix or a single int")
    for idx, value in enumerate(seeds):
        if not 0 <= value < SEED_LIMIT:
            raise ValueError(f"seed[{idx}]={value} is outside [0, 2**63); derive per-request seeds with "
                             "request_seed or numpy's SeedSequence (63 bits)")
    return seeds


def continuation_logprobs(model: Any, prefix_ids: Sequence[int], continuation_ids: Sequence[int],
                          temperature: float = 1.0) -> Any:
    """Teacher-forced log-probabilities of ``continuation_ids`` after ``prefix_ids``: one forward, no cache.

    The slow obvious reference for the backend's logprobs (and a scorer for single sequences).

    Args:
        model: causal LM.
        prefix_ids: (P,) token ids, P >= 1.
        continuation_ids: (C,) token ids.
        temperature: > 0; log-probabilities of ``softmax(logits / temperature)``.

    Returns:
        (C,) float32 CPU tensor of log-probabilities in nats.
    """
    import torch

    ids = list(prefix_ids) + list(continuation_ids)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prefix_ids)
    targets = input_ids[0, start:]
    return logp[start - 1:-1].gather(-1, targets[:, None]).squeeze(-1).cpu()
