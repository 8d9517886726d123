"""Weight files for vLLM engines: the policy's state dict written as one safetensors file that every
engine worker reloads in place (``trace.policy.vllm_backend.VLLMBackend.refresh_weights``).

The file is replaced atomically, so a worker never reads a half-written file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"


def _is_zero3_partitioned(model: Any) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())



def save_weights_file(state_dict: Mapping[str, Any], folder: str | os.PathLike) -> Path:
    """Write a state dict as ``<folder>/model.safetensors`` atomically (temporary file, then rename).

    Tensors are copied to contiguous CPU tensors first, so tied weights (which share storage) are written as
    separate entries; vLLM's loaders skip the ones the model ties.

    Returns:
        The folder.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{WEIGHTS_FILE}.tmp"
    save_file({name: t.detach().to("cpu").clone().contiguous() for name, t in state_dict.items()}, str(tmp))
    os.replace(tmp, folder / WEIGHTS_FILE)
    return folder
