"""The ``update`` params section: the DeepSpeed policy update and its optional LoRA adapters.

Re-exported by ``trace.configuration.config`` (``from trace.configuration.config import UpdateConfig``), like every other section.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, field_validator

from trace.configuration.config_tasks import Section
from trace.precision import resolve as resolve_precision

# every linear projection of a Llama/Qwen/SmolLM decoder layer (attention and MLP); not embeddings or lm_head
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """LoRA adapters (Hu et al. 2021, arXiv 2106.09685) trained instead of the full weights (``trace.policy.lora``).

    A target linear layer ``W`` becomes ``W + (alpha / rank) * B @ A`` with ``A`` (rank x in) and ``B``
    (out x rank) trainable and ``B`` starting at 0, so the adapted policy starts equal to the base.
    """

    enabled: bool = Field(False, description="train LoRA adapters through peft instead of every weight")
    rank: int = Field(16, ge=1, description="adapter rank r")
    alpha: float = Field(32.0, gt=0, description="scale numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (0 keeps steps deterministic)")
    target_modules: Union[tuple[str, ...], str] = Field(
        DEFAULT_LORA_TARGETS, description="module name suffixes that get adapters, or \"all-linear\" (peft)")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: Any) -> Any:
        if isinstance(v, str) and v != "all-linear":
            raise ValueError(f"update.lora.target_modules must be a list of module names or \"all-linear\", got "
                             f"{v!r}; e.g. [q_proj, v_proj]")
        if not isinstance(v, str) and (not v or any(not name for name in v)):
            raise ValueError(f"update.lora.target_modules must name at least one module, got {list(v)}; "
                             "e.g. [q_proj, k_proj, v_proj, o_proj]")
        return v


class UpdateConfig(Section):
    lr: float = Field(3e-4, gt=0, description="policy learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    clip_low: float = Field(0.2, ge=0, description="ratio clip below: 1 - clip_low (PPO, arXiv 1707.06347)")
    clip_high: float = Field(0.2, ge=0, description="ratio clip above: 1 + clip_high (DAPO clip-higher: 0.28)")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the reference policy (0 = off, no reference kept; "
                           "with LoRA the reference is the base with adapters off)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage")
    bf16: Union[bool, Literal["auto"]] = Field(
        "auto", validate_default=True,
        description="DeepSpeed bf16; auto: as policy.dtype resolves in the whole config, bf16 where native alone "
                    "(trace/precision.py)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward")
    offload_optimizer: bool = Field(False, description="ZeRO optimizer offload to CPU")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters instead of full fine-tuning")

    @field_validator("bf16", mode="after")
    @classmethod
    def _resolve_bf16(cls, value: Union[bool, str]) -> bool:
        return resolve_precision("auto", value)[1]
