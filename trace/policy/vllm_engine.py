"""vLLM engine replicas: whether vLLM is installed, how each replica is started and on which GPUs.

Each replica is one ``vllm.LLM`` with automatic prefix caching on and ``logprobs_mode="processed_logprobs"``
(the log-probabilities of the distribution a token was sampled from). With ``data_parallel_size > 1`` the
replicas get consecutive slices of the visible GPUs through ``CUDA_VISIBLE_DEVICES``. vLLM and torch are
imported only inside functions, never at module import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

VLLM_LOGPROBS_MODE = "processed_logprobs"  # logprobs of the sampling distribution (after temperature, top-p)


def vllm_available() -> bool:
    """Whether the ``vllm`` package (CUDA wheel or the CPU build) is importable in this environment."""
    return importlib.util.find_spec("vllm") is not None



@dataclass(frozen=True)
class VLLMEngineSettings:
    """How each vLLM engine replica is started.

    Attributes:
        tensor_parallel_size: GPUs per engine replica (vLLM tensor parallelism), >= 1.
        data_parallel_size: independent engine replicas, >= 1; replica ``r`` gets GPUs
            ``[r * tp, (r + 1) * tp)`` of the visible devices.
        gpu_memory_utilization: share of each GPU's memory vLLM may take (weights + KV cache), in (0, 1];
            leave room for the DeepSpeed policy when both share a GPU.
        dtype: engine weights dtype (``"float32"``, ``"bfloat16"``, ...; vLLM's ``"auto"`` runs float32 checkpoints
            in 16-bit, and ``from_policy`` replaces it by the policy's dtype).
        max_model_len: longest sequence (prompt + generation) in tokens; ``None`` = the model's limit.
        seed: engine seed (requests carry their own seeds; this only seeds unseeded requests).
        enforce_eager: skip CUDA graph capture and ``torch.compile`` (faster start, slower decode).
        block_size: KV block size in tokens (prefix caching shares whole blocks); ``None`` = vLLM's
            default. The CPU attention backend needs a multiple of 32.
        extra: further ``vllm.LLM`` keyword arguments, passed as given.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    block_size: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} and data_parallel_size="
                             f"{self.data_parallel_size} must both be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    @classmethod
    def from_rollout_config(cls, rollout_cfg: Any, **overrides: Any) -> VLLMEngineSettings:
        """Settings from the ``rollout`` config section (``vllm_tensor_parallel_size``,
        ``vllm_data_parallel_size``, ``vllm_gpu_memory_utilization``) plus explicit overrides.

        Without CUDA (the CPU build) engines run eagerly: compiling the CPU graph costs minutes of start-up."""
        import torch

        values = dict(tensor_parallel_size=rollout_cfg.vllm_tensor_parallel_size,
                      data_parallel_size=rollout_cfg.vllm_data_parallel_size,
                      gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization,
                      enforce_eager=not torch.cuda.is_available())
        values.update(overrides)
        return cls(**values)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` for one replica (prefix caching and processed logprobs on)."""
        kwargs: dict[str, Any] = dict(
            tensor_parallel_size=self.tensor_parallel_size, gpu_memory_utilization=self.gpu_memory_utilization,
            dtype=self.dtype, seed=self.seed, enforce_eager=self.enforce_eager, enable_prefix_caching=True,
            logprobs_mode=VLLM_LOGPROBS_MODE)
        if self.max_model_len is not None:
            kwargs["max_model_len"] = int(self.max_model_len)
        if self.block_size is not None:
            kwargs["block_size"] = int(self.block_size)
        kwargs.update(self.extra)
        return kwargs


def replica_devices(data_parallel_size: int, tensor_parallel_size: int,
                    visible: Sequence[str] | None = None) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` value of each engine replica: consecutive slices of ``tensor_parallel_size``.

    Args:
        data_parallel_size: replicas R >= 1.
        tensor_parallel_size: GPUs per replica >= 1.
        visible: the visible device ids; ``None`` = ``$CUDA_VISIBLE_DEVICES`` or ``0 .. device_count - 1``.

    Under a launcher with several ranks on the node (``trace.training.parallel``: each training rank samples its own
    trees), each rank starts one engine on its own GPU, the visible device ``LOCAL_RANK``, which its DeepSpeed
    engine uses too.

    Returns:
        R entries; all ``None`` with one replica or without CUDA (engines inherit the environment).

    Raises:
        ValueError: fewer visible GPUs than ``data_parallel_size * tensor_parallel_size`` (or than the ranks
            on the node); replicas or tensor parallelism asked for on a data-parallel training rank.
    """
    local_rank, local_ranks = _launcher_local_rank()
    if local_ranks > 1:  # a data-parallel training rank: its one engine shares the rank's own GPU
        if data_parallel_size * tensor_parallel_size > 1:
            raise ValueError(f"{local_ranks} training ranks on this node each start one vLLM engine on their own "
                             "GPU; set rollout.vllm_data_parallel_size and vllm_tensor_parallel_size to 1 (the "
                             "ranks are the data parallelism)")
        devices = _visible_devices(visible)
        if not devices:
            return [None]
        if len(devices) < local_ranks:
            raise ValueError(f"{local_ranks} training ranks on this node but {len(devices)} GPUs are visible "
                             f"({devices}); lower launch.num_processes or expose more GPUs")
        return [devices[local_rank]]
    if data_parallel_size == 1:
        return [None]
    visible = _visible_devices(visible)
    if not visible:
        return [None] * data_parallel_size
    need = data_parallel_size * tensor_parallel_size
    if len(visible) < need:
        raise ValueError(f"rollout.vllm_data_parallel_size={data_parallel_size} x vllm_tensor_parallel_size="
                         f"{tensor_parallel_size} needs {need} GPUs but {len(visible)} are visible ({visible}); "
                         "lower the parallel sizes or expose more GPUs")
    return [",".join(visible[r * tensor_parallel_size:(r + 1) * tensor_parallel_size])
            for r in range(data_parallel_size)]


def _launcher_local_rank() -> tuple[int, int]:
    """``(LOCAL_RANK, ranks on this node)`` under torchrun (``LOCAL_WORLD_SIZE``) or DeepSpeed's launcher
    (``LOCAL_SIZE``); ``(0, 1)`` in a single process."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    ranks = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return int(os.environ.get("LOCAL_RANK", "0")), int(ranks or 1)


def _visible_devices(visible: Sequence[str] | None) -> list[str]:
    if visible is not None:
        return list(visible)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """Temporarily set (or, for ``None``, leave) environment variables; engine processes inherit them."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
