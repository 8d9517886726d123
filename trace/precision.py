"""Which floating-point precision a run uses: ``policy.dtype: auto`` and ``update.bf16: auto``.

bf16 matrix products are several times faster than float32 where the hardware computes them natively: on CPUs
that list ``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo`` (Intel Cooper Lake, Sapphire Rapids and later,
AMD Zen 4 and later) and on CUDA GPUs that support bf16 (Ampere and later). Elsewhere torch converts bf16 to
float32 around each product, and a bf16 step was about 9 times slower than a float32 one on an AMD EPYC without
AVX-512 (``reports/benchmarks/step_dtype.json`` as committed at 50d86ab).

``auto`` resolves when a config is validated, so every stage, its MLflow params (``policy.dtype``,
``update.bf16``) and its tags (``trace.precision``, ``trace.cpu``) hold the precision it ran in:

- ``policy.dtype: auto`` follows an explicit ``update.bf16`` (``true``: bfloat16, ``false``: float32); with both
  ``auto`` it is bfloat16 where bf16 is native (``native_bf16``), float32 elsewhere.
- ``update.bf16: auto`` follows the policy's resolved dtype (DeepSpeed's bf16 mode: bf16 weights, float32
  master weights and AdamW state).

The environment variable ``TRACE_NATIVE_BF16`` (``1`` / ``0``) overrides the detection: ``0`` runs float32 on a
CPU with bf16 (the test suite sets it, so its numbers do not depend on the CPU kind), ``1`` forces bf16.
Results differ between precisions and between CPU kinds; a run is deterministic on one CPU kind in either.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of native bf16 matrix instructions (AVX512-BF16 dot products, AMX tiles)."""

ENV_OVERRIDE = "TRACE_NATIVE_BF16"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags to read
        return ""


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The native-bf16 flags (``BF16_CPU_FLAGS`` order) the CPU lists.

    Args:
        cpuinfo: the text of ``/proc/cpuinfo``; None reads it (empty where it cannot be read).
    """
    words = set((_cpuinfo() if cpuinfo is None else cpuinfo).split())
    return [flag for flag in BF16_CPU_FLAGS if flag in words]


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), or ``"unknown"``."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _cuda_bf16() -> bool | None:
    """Whether the CUDA device supports bf16; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))  # emulated bf16 (V100, T4) is slow


@functools.lru_cache(maxsize=None)
def _detected() -> bool:
    cuda = _cuda_bf16()
    return cuda if cuda is not None else bool(cpu_bf16_flags())


def native_bf16() -> bool:
    """Whether this machine computes bf16 matrix products natively.

    ``TRACE_NATIVE_BF16`` (``1`` / ``0``) decides where set; else the CUDA device's bf16 support where CUDA is
    available (the policy runs there), else whether the CPU lists ``avx512_bf16`` or ``amx_bf16``.

    Raises:
        ValueError: ``TRACE_NATIVE_BF16`` is set to something other than ``0`` or ``1``.
    """
    value = os.environ.get(ENV_OVERRIDE, "").strip()
    if value:
        if value not in ("0", "1"):
            raise ValueError(f"{ENV_OVERRIDE}={value!r}: set it to 1 (bf16) or 0 (float32), or unset it to detect")
        return value == "1"
    return _detected()


def resolve(policy_dtype: str, update_bf16: bool | str) -> tuple[str, bool]:
    """``policy.dtype`` and ``update.bf16`` with ``auto`` resolved (rules in the module docstring).

    Args:
        policy_dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        update_bf16: True, False or ``"auto"``.

    Returns:
        (dtype name, bf16 flag), neither ``auto``.
    """
    if policy_dtype == "auto":
        if isinstance(update_bf16, bool):
            policy_dtype = "bfloat16" if update_bf16 else "float32"
        else:
            policy_dtype = "bfloat16" if native_bf16() else "float32"
    if not isinstance(update_bf16, bool):
        update_bf16 = policy_dtype == "bfloat16"
    return policy_dtype, update_bf16


def resolve_params(data: Any) -> Any:
    """A raw params mapping with ``policy.dtype`` and ``update.bf16`` resolved together (``resolve``).

    Anything that is not a mapping of mappings is returned as it is, for the config's validation to name.
    """
    if not isinstance(data, dict):
        return data
    policy, update = data.get("policy") or {}, data.get("update") or {}
    if not isinstance(policy, dict) or not isinstance(update, dict):
        return data
    dtype, bf16 = policy.get("dtype", "auto"), update.get("bf16", "auto")
    if (dtype != "auto" and bf16 != "auto") or not (isinstance(bf16, bool) or bf16 == "auto"):
        return data
    dtype, bf16 = resolve(dtype, bf16)
    return {**data, "policy": {**policy, "dtype": dtype}, "update": {**update, "bf16": bf16}}


def machine_tags() -> dict[str, str]:
    """MLflow tags naming the machine a stage ran on: ``trace.cpu`` (model, native-bf16 flags) and
    ``trace.native_bf16`` (what ``auto`` resolves to here)."""
    flags = cpu_bf16_flags()
    return {"trace.cpu": f"{cpu_model()} ({', '.join(flags) if flags else 'no native bf16'})",
            "trace.native_bf16": str(native_bf16()).lower()}
