"""The policy a run starts from: the tiny model built from ``policy`` params, or a pretrained one.

``policy.kind: tiny`` builds a small Qwen3 with a word-level tokenizer over the task's closed vocabulary
(nothing downloaded); ``policy.kind: pretrained`` loads ``policy.model_path`` with its own tokenizer and the
chat format that fits it, told the environment's observation marker.
"""

from __future__ import annotations

from typing import Any

from trace.configuration.config import PolicyConfig
from trace.envs.base import HasVocabulary
from trace.policy.model import Policy, build_tiny_policy, load_pretrained_policy


def build_policy(policy_cfg: PolicyConfig, env: Any, seed: int, task_name: str) -> Policy:
    """The policy ``policy_cfg`` describes, for the task whose environment is ``env``.

    Args:
        policy_cfg: the ``policy`` section (``kind``, sizes, ``model_path``, dtype, ...).
        env: the task's environment; a tiny policy reads its ``vocabulary()``, a pretrained one its
            ``observation_marker``.
        seed: seeds the tiny model's initial weights.
        task_name: ``task.name``, named in the error below.

    Returns:
        ``trace.policy.model.Policy``.

    Raises:
        ValueError: ``policy.kind=tiny`` for a task without a closed vocabulary.
    """
    if policy_cfg.kind == "tiny":
        if not isinstance(env, HasVocabulary):
            raise ValueError(f"policy.kind=tiny needs a task with a closed vocabulary; task {task_name} "
                             "has none: use policy.kind=pretrained")
        return build_tiny_policy(policy_cfg, env.vocabulary(), seed)
    return load_pretrained_policy(policy_cfg, env.observation_marker)
