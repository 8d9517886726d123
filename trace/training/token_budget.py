"""Equal tokens instead of equal steps: the stop rule and the evaluation marks of ``train.token_budget``.

With ``train.token_budget`` = ``B`` generated tokens, an arm stops after the first step at which its cumulative
generated tokens (``tokens/cumulative``: policy tokens decoded, shared prefixes once; prompt and observation
tokens are not in it) reach ``B``, so it overshoots ``B`` by less than one step's tokens. ``train.num_steps``
stays an upper bound. With ``train.eval_every_tokens`` = ``E`` the in-training evaluation runs after each step
that crosses a mark ``E, 2E, ...`` or ``B``, the same marks for every arm, and logs the mark crossed
(``eval/token_mark``), so curves of arms that spend tokens at different rates are read at the same cumulative
tokens.
"""

from __future__ import annotations

__all__ = ["budget_spent", "crossed_marks"]


def budget_spent(cumulative_tokens: float, token_budget: int | None) -> bool:
    """Whether a run with ``cumulative_tokens`` generated has reached ``token_budget`` (never when it is None)."""
    return token_budget is not None and cumulative_tokens >= token_budget


def crossed_marks(before: float, after: float, every: int | None, token_budget: int | None) -> list[int]:
    """The evaluation marks a step crossed: ``m`` in ``{every, 2 every, ...} < token_budget`` and
    ``token_budget`` itself, with ``before < m <= after``, ascending.

    Args:
        before: cumulative generated tokens before the step.
        after: after it (``>= before``).
        every: ``train.eval_every_tokens`` (None: only the budget is a mark).
        token_budget: ``train.token_budget`` (None: no marks).

    Returns:
        The marks (usually none or one; a step that crosses two evaluates once, logging the last).

    Raises:
        ValueError: ``after < before``.
    """
    if after < before:
        raise ValueError(f"cumulative tokens went down within a step: {before} -> {after}")
    if token_budget is None:
        return []
    marks = []
    if every:  # the multiples of every in (before, min(after, budget - 1)], counted, not listed from 0
        first = (int(before) // every + 1) * every
        marks = list(range(first, min(int(after), int(token_budget) - 1) + 1, every))
    return marks + ([int(token_budget)] if before < token_budget <= after else [])
