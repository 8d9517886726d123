"""Announced weight updates: how generation backends learn that the policy's weights changed.

Weight updates are announced, never inferred: ``weights_version(model)`` counts the ``mark_weights_updated``
calls on a model, and every backend compares it with the version its cached KV (or, for vLLM, its engine
weights) was computed under. The parameters' in-place version counters cannot serve: DeepSpeed's ZeRO-1, 2
and 3 steps and its bf16 steps write the weights through ``.data``, which leaves those counters unchanged.
The registry holds models weakly: a model's entry goes when the model does.
"""

from __future__ import annotations

import weakref
from typing import Any

# model -> number of announced weight updates (held weakly: a model's entry goes when the model does)
_WEIGHTS_VERSIONS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def weights_version(model: Any) -> int:
    """How many weight updates of ``model`` have been announced with ``mark_weights_updated`` (0 if none).

    Backends compare it with the version their cached state was computed under: a different value means the
    cache (HF kept KV, vLLM engine weights and prefix cache) belongs to older weights.

    Args:
        model: the policy module (``torch.nn.Module``; under DeepSpeed, ``engine.module``, the same object).

    Returns:
        The count, >= 0.
    """
    return _WEIGHTS_VERSIONS.get(model, 0)


def mark_weights_updated(model: Any) -> int:
    """Announce that ``model``'s weights changed: every backend serving it refreshes before its next generation.

    ``trace.update.PolicyUpdater`` calls it after every optimizer step and checkpoint load; any other code that
    writes a policy's weights (``load_state_dict``, edits through ``.data``) must call it too.

    Args:
        model: the policy module whose weights changed.

    Returns:
        The new ``weights_version(model)``.

    Raises:
        TypeError: ``model`` cannot be referenced weakly (pass the ``torch.nn.Module`` itself).
    """
    try:
        version = _WEIGHTS_VERSIONS.get(model, 0) + 1
        _WEIGHTS_VERSIONS[model] = version
    except TypeError as err:
        raise TypeError(f"mark_weights_updated needs the policy module (a torch.nn.Module), got "
                        f"{type(model).__name__}, which cannot be tracked: {err}") from err
    return version
