"""A GGUF model, converted once: its de-quantised float32 weights and its tokenizer as a plain checkpoint folder.

Loading a GGUF file through ``transformers`` parses the file in Python twice (once for the tokenizer, once for
the weights) and de-quantises every tensor: about 16 s for SmolLM2-135M on 2 cores, paid by every process that
loads it (the warmup stage, each test, each benchmark). The folder written here loads in under a second and holds
the same values: the float32 weights exactly as de-quantised, the tokenizer (vocabulary, merges, special tokens,
chat template) as ``save_pretrained`` writes it. A load in another dtype casts from those float32 weights, as the
GGUF loader casts its de-quantised ones.

Where: ``$TRACE_GGUF_CACHE`` if set, else ``$XDG_CACHE_HOME/trace/gguf`` (``~/.cache/trace/gguf``). One folder per
GGUF content and ``transformers`` version (the key hashes both), so an updated wheel or library converts anew.
``TRACE_GGUF_CACHE=off`` loads the GGUF file every time, as ``transformers`` alone does; so does a cache folder
that cannot be written, with a warning that says so. SmolLM2-135M takes
517 MB there. A folder appears complete or not at all (written beside, then renamed), so processes that convert
at once (two ranks) each read a whole one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import warnings
from pathlib import Path

CACHE_ENV = "TRACE_GGUF_CACHE"
OFF = "off"
_DONE_FILE = "converted_from.txt"  # written last: a folder without it is not used


def gguf_cache_root() -> Path | None:
    """The folder of converted GGUF models, or None when ``TRACE_GGUF_CACHE=off``."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() == OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trace" / "gguf"


def gguf_key(gguf_path: Path) -> str:
    """Hex key of a GGUF file: SHA-256 of its bytes and the ``transformers`` version, first 20 digits."""
    import transformers

    digest = hashlib.sha256(f"transformers {transformers.__version__}\n".encode())
    with open(gguf_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:20]


def load_gguf(folder: str | os.PathLike, gguf_file: str):
    """``transformers``' own load of a GGUF file: ``(tokenizer, model)``, the weights de-quantised to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    return tokenizer, AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)


def detach_dequantised(model, source: str | os.PathLike) -> None:
    """Drop the GGUF marker of a model whose GGUF weights were de-quantised on load, so that it trains and saves
    (``save_pretrained``) as any float checkpoint; a model without the marker is left as it is.

    Raises:
        ValueError: the weights stayed in GGUF blocks (a GGUF matmul kernel is installed): they can be neither
            trained nor saved (names ``source`` and the fix).
    """
    if any(not param.dtype.is_floating_point for param in model.parameters()):
        raise ValueError(f"{source} was loaded with its weights kept in GGUF blocks (a GGUF matmul kernel is "
                         "installed), which cannot be trained or saved; uninstall the `kernels` package, or set "
                         "policy.model_path to a float checkpoint")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def converted_gguf(folder: str | os.PathLike, gguf_file: str, root: Path | None = None) -> Path | None:
    """The plain checkpoint folder of ``folder/gguf_file``: converted now if not yet done.

    Args:
        folder: the folder holding the GGUF file.
        gguf_file: the GGUF file's name in ``folder``.
        root: the cache folder (default ``gguf_cache_root()``).

    Returns:
        A folder that ``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` read (float32
        weights as ``model.safetensors``), or None when the cache is off or cannot be written (a warning names the
        folder, the reason and ``TRACE_GGUF_CACHE``; the caller then loads the GGUF file itself).

    Raises:
        ValueError: ``transformers`` kept the weights in GGUF blocks (a GGUF matmul kernel is installed), so
            they cannot be written as float tensors.
    """
    root = gguf_cache_root() if root is None else root
    if root is None:
        return None
    source = Path(folder) / gguf_file
    target = root / f"{Path(gguf_file).stem}-{gguf_key(source)}"
    if (target / _DONE_FILE).is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return _unwritable(root, source, err)
    tokenizer, model = load_gguf(folder, gguf_file)
    detach_dequantised(model, source)
    tmp = root / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_FILE).write_text(f"{source}\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another process renamed its copy first (or left an unfinished one): keep a whole one
            if not (target / _DONE_FILE).is_file():
                shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
    except OSError as err:  # a full disk, a folder turned read-only
        return _unwritable(root, source, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _unwritable(root: Path, source: Path, err: OSError) -> None:
    warnings.warn(f"cannot write the GGUF cache folder {root} ({err}); {source} is loaded from the GGUF file, "
                  f"which takes longer: set {CACHE_ENV} to a writable folder, or to {OFF} to skip this warning",
                  stacklevel=3)
    return None
