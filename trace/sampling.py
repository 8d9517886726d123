"""How turns are sampled: the sampling spec, the per-trajectory seed and the generation backend factory.

A ``SamplingSpec`` fixes temperature, nucleus mass, the per-turn token limit and the seed; each turn of each
trajectory is sampled with ``trajectory_seed`` of its identity alone, so the same policy, prompts and seed
give the same token ids whatever the batch. ``make_backend`` builds the generation backend (Hugging Face,
or the shared vLLM engine) without importing either at module level.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

from trace.configuration.config import RolloutConfig


@dataclass(frozen=True)
class SamplingSpec:
    """How turns are sampled.

    Attributes:
        temperature: softmax temperature (> 0 samples; 0 is greedy).
        top_p: nucleus mass in (0, 1].
        max_new_tokens: most generated tokens per turn; a turn that reaches it without stopping truncates
            its trajectory (``MAX_TOKENS``).
        seed: sampling seed; the same policy, prompts and seed give the same token ids.
        batch_size: most sequences the backend decodes together.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    seed: int = 0
    batch_size: int = 256

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig, seed: int) -> "SamplingSpec":
        """The ``rollout`` config section plus a seed."""
        return cls(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                   max_new_tokens=rollout_cfg.max_new_tokens, seed=int(seed), batch_size=rollout_cfg.batch_size)


def trajectory_seed(seed: int, tree_id: str, stream_key: Sequence[int], turn_idx: int) -> int:
    """The sampling seed of one turn of one trajectory: a function of its identity only.

    A trajectory is named by its tree and its key within the tree: ``(0, j)`` for the ``j``-th root rollout of
    the prompt, ``(1, anchor_id, k)`` for the ``k``-th branch ever sampled from anchor ``anchor_id``. Its
    tokens therefore do not depend on which other trajectories share the batch, on their order, on which of
    them ended early, or on which rank sampled the tree (docs/architecture.md#seeding).

    Args:
        seed: the ``SamplingSpec`` seed (>= 0).
        tree_id: the tree's ``tree_id`` (unique within a step).
        stream_key: the trajectory's key within the tree (non-negative ints, see above).
        turn_idx: the turn being sampled (>= 0).

    Returns:
        A seed in [0, 2**63): 63 bits of the BLAKE2b hash of the identity, stable across processes and
        Python versions (unlike ``hash``).
    """
    identity = repr((int(seed), str(tree_id), tuple(int(k) for k in stream_key), int(turn_idx)))
    return int.from_bytes(hashlib.blake2b(identity.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def make_backend(policy: Any, sampling: SamplingSpec, *, reuse_prefix_cache: bool = True,
                 rollout_cfg: RolloutConfig | None = None) -> Any:
    """The generation backend for ``policy``: ``HFBackend`` with ``sampling.batch_size`` rows, or, when
    ``rollout_cfg.backend == "vllm"``, the process-wide ``VLLMBackend`` of the policy (started on first use,
    following the policy's weight updates; see ``trace.policy.vllm_backend``).

    Args:
        policy: ``trace.policy.model.Policy`` (model and tokenizer).
        sampling: the ``SamplingSpec``; its ``batch_size`` bounds the HF backend's rows.
        reuse_prefix_cache: the HF backend keeps the KV of shared prefixes between calls.
        rollout_cfg: the ``rollout`` section; ``backend: vllm`` selects the shared vLLM engine.

    Returns:
        A ``GenerationBackend``.
    """
    if rollout_cfg is not None and rollout_cfg.backend == "vllm":
        from trace.policy.vllm_backend import VLLMEngineSettings, shared_vllm_backend

        return shared_vllm_backend(policy, VLLMEngineSettings.from_rollout_config(rollout_cfg))
    from trace.policy.hf_backend import HFBackend

    return HFBackend(policy.model, policy.tokenizer, max_batch_size=sampling.batch_size,
                     reuse_prefix_cache=reuse_prefix_cache)


def sampling_spec(rollout_cfg: RolloutConfig, seed: int, temperature: float | None = None) -> SamplingSpec:
    """The ``SamplingSpec`` of the ``rollout`` section with ``seed``, at ``temperature`` if given.

    Args:
        rollout_cfg: the ``rollout`` config section.
        seed: the sampling seed (``step_seed`` of the step and purpose).
        temperature: overrides ``rollout.temperature`` (``0.0``: greedy); ``None`` keeps it.

    Returns:
        A ``SamplingSpec``.

    Raises:
        ValueError: a temperature below 0 (``SamplingSpec``).
    """
    return SamplingSpec(temperature=rollout_cfg.temperature if temperature is None else temperature,
                        top_p=rollout_cfg.top_p, max_new_tokens=rollout_cfg.max_new_tokens, seed=seed,
                        batch_size=rollout_cfg.batch_size)


def make_rollout_backend(policy: Any, rollout_cfg: RolloutConfig, backend: Any = None) -> Any:
    """``backend`` if given, else the backend ``rollout.backend`` names (HF, or the shared vLLM engine).

    Args:
        policy: ``trace.policy.model.Policy``.
        rollout_cfg: the ``rollout`` config section (``backend``, ``batch_size``, ``reuse_prefix_cache``).
        backend: a ``GenerationBackend`` to use as is, or ``None``.

    Returns:
        A ``GenerationBackend`` (``make_backend``).
    """
    if backend is not None:
        return backend
    return make_backend(policy, sampling_spec(rollout_cfg, 0), reuse_prefix_cache=rollout_cfg.reuse_prefix_cache,
                        rollout_cfg=rollout_cfg)
