"""How ``generate`` requests map onto vLLM: replica routing, sampling parameters and the finish kind.

Routing keeps KV reuse across data-parallel replicas: a sequence that extends one served before goes to the
replica that holds its prefix. The finish kind follows ``HFBackend``'s precedence (EOS, stop token, stop
string, length). vLLM is imported only inside ``sampling_params``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _rolling_hashes(tokens: Sequence[int]) -> list[int]:
    """Hash of every prefix ``tokens[:n]`` for n = 1 .. len(tokens)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, int(t)))
        out.append(h)
    return out


def route_requests(prefixes: Sequence[Sequence[int]], live: Sequence[int], num_replicas: int,
                   affinity: Mapping[int, int]) -> list[int]:
    """Data-parallel replica of each live request.

    In request order: a prefix identical to an earlier one of the call goes where that one went; else the
    replica recorded for its longest prefix in ``affinity`` (the replica that served that sequence, so its KV
    blocks are there); else the replica with the fewest prompt tokens assigned so far in this call (ties: the
    lowest index).

    Args:
        prefixes: all prefixes of the call (token-id lists).
        live: indices into ``prefixes`` of the requests to route.
        num_replicas: R >= 1.
        affinity: rolling hash of a served sequence (``_rolling_hashes(seq)[-1]``) -> replica index.

    Returns:
        One replica index in ``[0, R)`` per entry of ``live``.
    """
    if num_replicas == 1:
        return [0] * len(live)
    load = [0] * num_replicas
    by_prefix: dict[tuple[int, ...], int] = {}
    out: list[int] = []
    for idx in live:
        key = tuple(int(t) for t in prefixes[idx])
        replica = by_prefix.get(key)
        if replica is None:
            for h in reversed(_rolling_hashes(key)):
                if h in affinity:
                    replica = affinity[h]
                    break
        if replica is None:
            replica = min(range(num_replicas), key=lambda r: (load[r], r))
        by_prefix[key] = replica
        load[replica] += len(key)
        out.append(replica)
    return out


def sampling_params(budget: int, temperature: float, top_p: float, stop_token_ids: list[int],
                    stop_strings: list[str], seed: int | None) -> Any:
    """``vllm.SamplingParams`` of one request: one completion of at most ``budget`` tokens, the stop token
    kept in the output, one sampled-token logprob per step; detokenized only when stop strings need it.

    Args:
        budget: ``max_new_tokens`` of the request, >= 1.
        temperature: >= 0 (0 = greedy).
        top_p: nucleus mass in (0, 1].
        stop_token_ids: ids that end the completion (empty: none).
        stop_strings: texts that end the completion (empty: none).
        seed: the request's seed, ``None`` for greedy requests.

    Returns:
        ``vllm.SamplingParams``.
    """
    from vllm import SamplingParams

    return SamplingParams(
        n=1, temperature=float(temperature), top_p=float(top_p), max_tokens=int(budget), seed=seed,
        stop_token_ids=stop_token_ids or None, stop=stop_strings or None, include_stop_str_in_output=True,
        skip_special_tokens=False, detokenize=bool(stop_strings), logprobs=0)


def completion_finish(token_ids: list[int], eos_token_ids: frozenset[int], stop_ids: frozenset[int],
                      stop_reason: Any, budget: int, finish_reason: str | None = None) -> str:
    """``Generation.finish`` of one vLLM completion, with ``HFBackend``'s precedence.

    ``"eos"`` ends the episode in the rollout engine, so it is returned only for an EOS: the last token
    is one of ``eos_token_ids``, or vLLM stopped on a token of its own (an EOS id of the model's
    generation config) that is neither a requested stop token nor a stop string. A completion cut at
    the engine's length limit (``max_tokens`` or ``max_model_len``) is ``"length"``.

    Args:
        token_ids: the generated ids.
        eos_token_ids: the backend's EOS ids (``VLLMBackend.eos_token_ids``).
        stop_ids: the call's ``stop_token_ids``.
        stop_reason: vLLM's ``CompletionOutput.stop_reason`` (``None``, a token id or the stop string).
        budget: the request's ``max_new_tokens``.
        finish_reason: vLLM's ``CompletionOutput.finish_reason`` (``"stop"``, ``"length"``, ...).

    Returns:
        ``"eos"``, ``"stop"`` or ``"length"``.
    """
    if token_ids and token_ids[-1] in eos_token_ids:
        return "eos"
    if token_ids and token_ids[-1] in stop_ids:
        return "stop"
    if isinstance(stop_reason, str):
        return "stop"
    if len(token_ids) >= budget or finish_reason == "length":
        return "length"
    return "eos"  # vLLM stopped on an EOS id of the model's generation config outside eos_token_ids
