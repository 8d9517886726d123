"""LoRA adapters on the policy (``update.lora``), through ``peft``.

``apply_lora`` wraps ``policy.model`` in a ``peft.PeftModel`` in place: only the adapters train (the
``PolicyUpdater`` optimises parameters with ``requires_grad``), generation and the predictor run the adapted
model, and the KL reference is the same model with its adapters switched off (``PeftModel.disable_adapter``),
so no second copy is kept. Whatever leaves the process sees plain weights in the Hugging Face naming:
``merged_state_dict`` gives ``W + (alpha / r) B A`` per adapted layer (computed out of place, the live
model untouched), which ``save_merged`` writes as an ordinary checkpoint (the next stage and the vLLM backend
load it with ``from_pretrained``) and the vLLM backend pushes after each update. ``trace.policy.model.save_policy``
also writes the adapters alone under ``<policy>/adapter`` (``PeftModel.from_pretrained`` on the base).

Invariant: the model's ``config.tie_word_embeddings`` says what its merged weights are. Adapting either side
of tied input/output embeddings (``target_modules`` naming ``lm_head`` or ``embed_tokens``) makes the output
layer differ from the embeddings, so ``apply_lora`` first unties them: the output layer gets its own frozen
copy of the embedding matrix and the config says ``tie_word_embeddings: false``. Every merged export (the
saved policy, the HF backend's merged copy, the vLLM engine's checkpoint and its pushed weights) then holds
both tensors under an untied config; a loader that honours the flag (vLLM skips a tied model's output layer)
computes what the adapted model computes. Any other model stays tied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace.configuration.config_update import LoraConfig

ADAPTER_DIR = "adapter"  # adapters of a LoRA policy, inside the saved policy folder
_ADAPTER = "default"  # peft's name of the one adapter


def is_lora_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (the policy after ``apply_lora``)."""
    try:
        from peft import PeftModel
    except ImportError:  # peft not installed: nothing can be a LoRA model
        return False
    return isinstance(model, PeftModel)


def apply_lora(policy: Any, lora_cfg: LoraConfig, seed: int) -> Any:
    """Wrap ``policy.model`` in LoRA adapters in place, when ``lora_cfg.enabled``.

    The adapter matrices ``A`` get peft's Kaiming init under ``torch.manual_seed(seed)`` and ``B`` zeros, so the
    adapted model computes exactly what the base does until the first update. The base weights are frozen.

    Args:
        policy: ``trace.policy.model.Policy``; its ``model`` is replaced by the ``PeftModel``. A model with tied
            embeddings whose ``lm_head`` or ``embed_tokens`` is a target is untied first (see the module
            docstring; costs one embedding matrix of memory).
        lora_cfg: the ``update.lora`` section.
        seed: seeds the adapters' initial weights.

    Returns:
        ``policy`` (changed in place; unchanged when LoRA is off or the model already has adapters).

    Raises:
        ValueError: no module of the model matches ``target_modules`` (names the model's linear layers).
    """
    if not lora_cfg.enabled or is_lora_model(policy.model):
        return policy
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = lora_cfg.target_modules if isinstance(lora_cfg.target_modules, str) else list(lora_cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                              target_modules=targets, bias="none", task_type="CAUSAL_LM")
    _untie_adapted_embeddings(policy.model, targets)
    torch.manual_seed(seed)
    try:
        policy.model = get_peft_model(policy.model, peft_cfg)
    except ValueError as err:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in policy.model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"update.lora.target_modules={targets} matches no layer of the policy ({err}); its "
                         f"linear layers are {linear}") from err
    return policy


def _untie_adapted_embeddings(model: Any, targets: str | list[str]) -> bool:
    """Untie ``model``'s input and output embeddings in place when LoRA will adapt either of them.

    An adapter on one side of a tied pair changes that side only: the merged output layer is no longer the
    embedding matrix, and a checkpoint still flagged ``tie_word_embeddings: true`` would be served by a loader
    that honours the flag (vLLM) with the unadapted embeddings as its output layer. The output layer gets its
    own copy of the matrix (same values, frozen like every base weight under LoRA) and the config is set to
    ``tie_word_embeddings = False``, so the model computes exactly what it did and says what its weights are.

    Args:
        model: a ``transformers`` causal LM, before ``get_peft_model``.
        targets: ``update.lora.target_modules``: module-name suffixes, matched as peft matches them (the name
            itself or ``.<target>`` at its end), or ``"all-linear"`` (which peft applies to no embedding).

    Returns:
        Whether it untied.
    """
    import torch

    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or isinstance(targets, str):
        return False
    embeddings = (model.get_input_embeddings(), model.get_output_embeddings())
    names = [name for name, module in model.named_modules() if any(module is e for e in embeddings)]
    if not any(name == target or name.endswith(f".{target}") for name in names for target in targets):
        return False
    output = model.get_output_embeddings()
    output.weight = torch.nn.Parameter(output.weight.detach().clone(), requires_grad=output.weight.requires_grad)
    config.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        # transformers >= 5 caches the tied pairs at init; a later tie_weights() must not re-tie them
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return True


def merged_state_dict(model: Any) -> dict[str, Any]:
    """The weights the model computes with, in the base model's Hugging Face naming.

    For a ``PeftModel`` every adapted layer's weight (linear or embedding) is ``W + delta`` with peft's
    ``get_delta_weight`` (``(alpha / r) B A``, Hu et al. 2021, eq. 3), computed out of place; adapter tensors are
    left out. Other tensors are the model's own (not copied: tied weights stay tied; ``apply_lora`` unties a
    tied pair it adapts). Any other model: its ``state_dict()``. Under ZeRO-3 gather the parameters first
    (``PolicyUpdater.serving_state_dict``).

    Args:
        model: a ``transformers`` causal LM, or one wrapped by ``apply_lora``.

    Returns:
        name -> tensor (on the model's device and dtype).
    """
    if not is_lora_model(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {f"{name}.weight": module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    merged: dict[str, Any] = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        layer = deltas.get(key)
        # peft keeps a linear layer's adapter in lora_A, an embedding's in lora_embedding_A
        if layer is not None and (_ADAPTER in layer.lora_A or _ADAPTER in layer.lora_embedding_A):
            tensor = tensor + layer.get_delta_weight(_ADAPTER).to(tensor.dtype)
        merged[key] = tensor
    return merged


def save_merged(model: Any, folder: str | Path) -> None:
    """Write ``model`` as a plain Hugging Face checkpoint (``save_pretrained``), adapters merged in.

    Args:
        model: a ``transformers`` causal LM, or one wrapped by ``apply_lora``.
        folder: the target folder (created).
    """
    folder = Path(folder)
    if not is_lora_model(model):
        model.save_pretrained(folder)
        return
    model.get_base_model().save_pretrained(folder, state_dict=merged_state_dict(model))


def save_adapter(model: Any, folder: str | Path) -> None:
    """Write the adapters of a LoRA policy alone (``adapter_config.json``, ``adapter_model.safetensors``).

    Raises:
        ValueError: ``model`` has no adapters.
    """
    if not is_lora_model(model):
        raise ValueError(f"save_adapter needs a model wrapped by apply_lora, got {type(model).__name__}")
    model.save_pretrained(Path(folder))


class MergedCopy:
    """A plain copy of a LoRA policy with its adapters merged in, refreshed when the policy's weights move.

    The HF backend generates with it: decoding a ``PeftModel`` runs two adapter matmuls and an add beside every
    adapted projection, which for a small batch on CPU costs as much as the projection itself (about a third
    of a rollout of SmolLM2-135M, ``benchmarks/real_task_step.py``); the copy computes ``W + (alpha / r) B A``
    directly. It is built on first use from the base model's config (eager attention, the policy's dtype and
    device) and reloaded from ``merged_state_dict`` whenever ``weights_version(policy)`` differs from the one it
    was loaded at, and when the policy's dtype changes (DeepSpeed's bf16 casts the policy in place). Costs one
    base-sized copy of memory. Its logits match the adapted model's within rounding (float32: about 1e-6).

    Args:
        model: the ``peft.PeftModel`` policy (not partitioned by ZeRO-3: ``merged_state_dict`` needs the full
            weights in place).

    Raises:
        TypeError: ``model`` is not a LoRA policy.
    """

    def __init__(self, model: Any) -> None:
        if not is_lora_model(model):
            raise TypeError(f"MergedCopy needs a LoRA policy (peft.PeftModel), got {type(model).__name__}")
        self.policy = model
        self.copy: Any = None
        self._loaded_version: int | None = None
        self.num_loads = 0

    def module(self) -> Any:
        """The merged copy at the policy's current weights (loaded now if they moved since the last call)."""
        import torch
        from transformers import AutoModelForCausalLM

        from trace.policy.weights import weights_version

        ref = next(self.policy.parameters())
        if self.copy is None:
            base = self.policy.get_base_model()
            self.copy = AutoModelForCausalLM.from_config(base.config, attn_implementation="eager",
                                                         dtype=ref.dtype).to(ref.device).eval()
            self.copy.requires_grad_(False)
        version = weights_version(self.policy)
        if next(self.copy.parameters()).dtype != ref.dtype:
            self.copy.to(dtype=ref.dtype)
            self._loaded_version = None
        if version != self._loaded_version:
            with torch.no_grad():
                self.copy.load_state_dict(merged_state_dict(self.policy), strict=True)
            self._loaded_version = version
            self.num_loads += 1
        return self.copy


def merged_copy(model: Any) -> MergedCopy | None:
    """``MergedCopy(model)`` for a LoRA policy whose weights are in place; ``None`` for any other model and under
    ZeRO-3, whose partitioned parameters (``ds_id``) hold no full weights to merge."""
    if not is_lora_model(model) or any(hasattr(p, "ds_id") for p in model.parameters()):
        return None
    return MergedCopy(model)
