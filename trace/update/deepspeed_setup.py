"""DeepSpeed set-up for the policy update: the single-process distributed environment, the engine config,
the world size, and the conversion of ZeRO checkpoints into universal ones.

Gradient accumulation is owned by ``trace.update.updater``: the config sets ``gradient_accumulation_steps = 1``
and ``managed_gradient_accumulation = false``, so ``engine.step()`` is the accumulation boundary.
DeepSpeed itself is imported only inside functions that need it, never at module import.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from trace.configuration.config import UpdateConfig


def init_distributed_env() -> dict[str, str]:
    """Fill in the single-process distributed environment DeepSpeed expects, where a launcher did not.

    Sets ``RANK=0``, ``LOCAL_RANK=0``, ``WORLD_SIZE=1`` and ``MASTER_ADDR=127.0.0.1`` when unset, and
    ``DS_ACCELERATOR=cpu`` when unset and CUDA is not available. Call before DeepSpeed is first imported (its
    accelerator is chosen at import). Variables already set (e.g. by the ``deepspeed`` launcher or torchrun)
    are left alone.

    No ``MASTER_PORT`` is chosen: a single process needs no TCP rendezvous (``init_process_group`` gives it a
    process group over a file in a private folder), and a port found free now can be taken by another process
    before DeepSpeed listens on it (two training processes started together then fail with EADDRINUSE).
    Several ranks get their rendezvous from their launcher (``flows.launch``).

    Returns:
        The variables this call set, name -> value.
    """
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    if not torch.cuda.is_available():
        defaults["DS_ACCELERATOR"] = "cpu"
    newly_set = {}
    for name, value in defaults.items():
        if name not in os.environ:
            os.environ[name] = value
            newly_set[name] = value
    return newly_set


def init_process_group() -> bool:
    """Start this process's ``torch.distributed`` group before ``deepspeed.initialize``, where it needs no peer.

    With ``$WORLD_SIZE`` 1 (``init_distributed_env`` sets it where no launcher did) the group is built over a
    ``torch.distributed.FileStore`` in a private temporary folder (removed at exit): no port is bound, so any
    number of single-process updates started together cannot collide. DeepSpeed then adopts the group as it is
    (``deepspeed.comm.init_distributed`` skips its own rendezvous when ``torch.distributed`` is initialised).
    The backend is DeepSpeed's accelerator's (``gloo`` or ``ccl`` on CPU, ``nccl`` on CUDA).

    With several ranks nothing is done here: DeepSpeed joins the rendezvous of the launcher's environment
    (``MASTER_ADDR``/``MASTER_PORT``, or torchrun's agent store, which the agent holds from the start).

    Returns:
        True when this call created the group; False when one existed or the world has several ranks.

    Raises:
        ValueError: ``$WORLD_SIZE`` or ``$RANK`` is not an integer.
    """
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    try:
        world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError as err:
        raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} / RANK={os.environ.get('RANK')!r}: both "
                         "must be integers; unset them for one process or let the launcher set them") from err
    if world_size != 1:
        return False
    from deepspeed.accelerator import get_accelerator

    folder = Path(tempfile.mkdtemp(prefix="trace-process-group-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    store = dist.FileStore(str(folder / "store"), 1)
    dist.init_process_group(get_accelerator().communication_backend_name(), store=store, rank=rank, world_size=1)
    return True


def deepspeed_config(update_cfg: UpdateConfig, micro_batch_size: int | None = None,
                     world_size: int | None = None) -> dict[str, Any]:
    """DeepSpeed config dict for ``PolicyUpdater``.

    ``gradient_accumulation_steps`` is 1 and ``managed_gradient_accumulation`` false: the caller runs any
    number of micro-batches per step and ``engine.step()`` is the accumulation boundary, so a variable
    number of sequences per step is consistent with ``train_batch_size = micro_batch_size * world_size``.

    Args:
        update_cfg: the ``update`` section (ZeRO stage, bf16, optimizer offload, gradient clipping).
        micro_batch_size: sequences per forward/backward; ``None`` = ``update_cfg.micro_batch_size``.
        world_size: data-parallel ranks; ``None`` = ``$WORLD_SIZE`` (default 1).

    Returns:
        A JSON-serialisable dict for ``deepspeed.initialize(config=...)``.

    Raises:
        ValueError: if ``offload_optimizer`` is set with ZeRO stage 0 (offload needs stage >= 1).
    """
    micro_batch_size = update_cfg.micro_batch_size if micro_batch_size is None else int(micro_batch_size)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
    zero: dict[str, Any] = {"stage": update_cfg.zero_stage}
    if update_cfg.offload_optimizer:
        if update_cfg.zero_stage == 0:
            raise ValueError("update.offload_optimizer=true needs update.zero_stage >= 1 (ZeRO offload); "
                             "raise zero_stage or turn offload off")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": update_cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": update_cfg.bf16},
        # torch.optim.AdamW is passed in: no DeepSpeed Adam JIT build, also under ZeRO offload
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1



def convert_to_universal_checkpoint(checkpoint_dir: str | Path, tag: str, universal_tag: str | None = None) -> str:
    """Convert the ZeRO checkpoint ``<checkpoint_dir>/<tag>`` into a DeepSpeed universal checkpoint.

    Runs ``python -m deepspeed.checkpoint.ds_to_universal`` (one process, CPU only): every parameter's fp32
    weights and Adam moments are gathered from the per-rank shards into one file per parameter, which any
    number of ranks and any ZeRO stage can load (``PolicyUpdater.load_checkpoint(..., universal=True)``).
    It also writes ``<checkpoint_dir>/latest_universal``.

    Args:
        checkpoint_dir: the folder given to ``PolicyUpdater.save_checkpoint``.
        tag: the checkpoint to convert (a ZeRO stage 1-3 checkpoint written by ``save_checkpoint``).
        universal_tag: name of the converted tag; ``None`` = ``f"{tag}_universal"``.

    Returns:
        The universal tag.

    Raises:
        FileNotFoundError: ``<checkpoint_dir>/<tag>`` does not exist.
        RuntimeError: the converter failed (its output is included), e.g. on a ZeRO stage 0 checkpoint,
            which holds the whole optimizer state and loads into any number of ranks as it is.
    """
    import subprocess
    import sys

    checkpoint_dir = Path(checkpoint_dir)
    universal_tag = universal_tag or f"{tag}_universal"
    if not (checkpoint_dir / tag).is_dir():
        raise FileNotFoundError(f"no checkpoint {checkpoint_dir / tag}; pass the folder and tag given to "
                                "save_checkpoint")
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", str(checkpoint_dir / tag),
                           "--output_folder", str(checkpoint_dir / universal_tag)],
                          check=False, capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": os.environ.get(
                              "DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")})
    if proc.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed on {checkpoint_dir / tag} (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return universal_tag


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute activations in the backward pass instead of keeping them (``update.gradient_checkpointing``).

    transformers >= 5.24 names it activation checkpointing; older versions, gradient checkpointing. Non-reentrant,
    so it works with frozen inputs (LoRA) and DeepSpeed's hooks.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
