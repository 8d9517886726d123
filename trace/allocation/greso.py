"""GRESO as a root rule: skip, before any rollout, the prompts whose recent groups all agreed.

Each prompt keeps the run of its most recent groups (the trees it was sampled in): ``z_easy``, how many of its
latest groups in a row were all correct (mean reward >= ``easy_mean``, 0.98), and ``z_hard``, all wrong (mean
<= ``hard_mean``, 0.11: the original's math reward gives 0.1 to a formatted wrong answer); any other group
resets both. At a step, candidate ``i`` is kept with probability

    max(p_easy ** z_easy * p_hard ** z_hard, keep_floor)

(one exponent is always 0; a prompt never seen, or whose last group was neither, is always kept), from one
uniform draw per candidate (``rng_for("greso")``). The kept candidates, in candidate order, get ``n`` each as
``grpo`` spreads ``R`` (``uniform_root_counts``); when fewer than ``R // n`` are kept, the skipped ones fill the
rest in candidate order (the original draws further batches of prompts until the batch is full; here the step's
candidates are the pool), so the step spends exactly its budget.

After the step, once the run is past its first epoch (``adapt_after_first_epoch``, default true, as the
original's ``epoch > 0``), ``p_easy`` moves by ``p_step`` toward the target share of all-correct groups among those
sampled (``target_zero_variance x easy_share``): down (skip more) when the observed share is at or above it, up
otherwise; ``p_hard`` likewise with ``target_zero_variance x (1 - easy_share)``; both clipped to
``[p_min, p_max]``. An epoch is one pass of the candidates over the training prompts
(``trace.training.seeding.candidate_indices`` draws each epoch as a permutation of the pool, ``B`` a step): the
first step whose candidates include a prompt that was a candidate before starts the second epoch (step
``ceil(P / B) - 1`` or ``P / B``, ``P`` prompts), so the state needs no pool size. The streaks are kept from the
first step (no prompt recurs within the first epoch, so nothing is skipped there either way).

The original runs on a dynamic-sampling base (DAPO's: zero-variance groups are dropped after rollout and
further prompts drawn until the batch is full); here the arm trains on every group it sampled, as every other
arm does, so GRESO's effect is its pre-rollout skip alone.

References:
    Li et al., "Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective
    Rollouts" (GRESO, arXiv 2506.02177), Sec. 4 (probabilistic pre-rollout filtering from the temporal
    consistency of zero-variance prompts, self-adjusting base probabilities); public code Infini-AI-Lab/GRESO.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from trace.allocation.registry import RootDecision, RootRequest, register_root_rule
from trace.allocation.root import uniform_root_counts

__all__ = ["GresoState", "group_outcome", "greso_root_rule"]


def _settings(config):
    from trace.configuration.config_allocators import GresoConfig

    return getattr(config, "greso", None) or GresoConfig()


def group_outcome(rewards: np.ndarray, easy_mean: float = 0.98, hard_mean: float = 0.11) -> str:
    """What one group's outcome says of its prompt: all correct, all wrong, or neither.

    Args:
        rewards: (k,) float64 the group's leaf rewards, in [0, 1].
        easy_mean, hard_mean: the bounds on the mean reward (GRESO's code: 0.98 and 0.11).

    Returns:
        ``"easy"`` (mean >= ``easy_mean``), ``"hard"`` (mean <= ``hard_mean``) or ``"mixed"`` (also for no rewards).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return "mixed"
    mean = float(r.mean())
    return "easy" if mean >= easy_mean else "hard" if mean <= hard_mean else "mixed"


class GresoState:
    """Per prompt ``(z_easy, z_hard)`` and the run's ``p_easy``, ``p_hard`` (``AllocatorState``).

    Args:
        config: the allocation section (its ``greso`` settings) or None for the defaults.
    """

    def __init__(self, config=None) -> None:
        self.settings = _settings(config)
        self.p_easy = float(self.settings.p_easy)
        self.p_hard = float(self.settings.p_hard)
        self.streaks: dict[str, tuple[int, int]] = {}  # prompt id -> (z_easy, z_hard)
        self.seen: set[str] = set()  # candidates of the first epoch so far (emptied once it ends)
        self.past_first_epoch = False

    def see_candidates(self, prompt_uids: Sequence[str]) -> None:
        """Record a step's candidates; the first repeat of a candidate marks the start of the second epoch."""
        if self.past_first_epoch:
            return
        if any(uid in self.seen for uid in prompt_uids):
            self.past_first_epoch, self.seen = True, set()
        else:
            self.seen.update(prompt_uids)

    def keep_probability(self, prompt_uids: Sequence[str]) -> np.ndarray:
        """(B,) float64 probability that each prompt is sampled this step, ``max(p_easy ** z_easy * p_hard **
        z_hard, keep_floor)`` (1 for a prompt never seen)."""
        out = np.empty(len(prompt_uids), dtype=np.float64)
        for i, uid in enumerate(prompt_uids):
            z_easy, z_hard = self.streaks.get(uid, (0, 0))
            out[i] = max(self.p_easy ** z_easy * self.p_hard ** z_hard, self.settings.keep_floor)
        return out

    def observe(self, prompt_uids: Sequence[str], rewards: Sequence[np.ndarray],
                prompt_texts: Sequence[str] = ()) -> dict[str, float]:
        """Extend each sampled prompt's streak, then (past the first epoch, by default) move ``p_easy`` and
        ``p_hard`` toward their targets.

        Args:
            prompt_uids: one id per sampled tree.
            rewards: that tree's (k,) leaf rewards.
            prompt_texts: unused (the ``AllocatorState`` signature).

        Returns:
            ``{"greso/p_easy", "greso/p_hard"}`` after the move.
        """
        s = self.settings
        outcomes = [group_outcome(r, s.easy_mean, s.hard_mean) for r in rewards]
        for uid, outcome in zip(prompt_uids, outcomes):
            z_easy, z_hard = self.streaks.get(uid, (0, 0))
            self.streaks[uid] = ((z_easy + 1, 0) if outcome == "easy" else (0, z_hard + 1) if outcome == "hard"
                                 else (0, 0))
        if outcomes and (self.past_first_epoch or not s.adapt_after_first_epoch):
            easy = outcomes.count("easy") / len(outcomes)
            hard = outcomes.count("hard") / len(outcomes)
            target_easy = s.target_zero_variance * s.easy_share
            target_hard = s.target_zero_variance * (1 - s.easy_share)
            self.p_easy = float(np.clip(self.p_easy + (-s.p_step if easy >= target_easy else s.p_step), s.p_min,
                                        s.p_max))
            self.p_hard = float(np.clip(self.p_hard + (-s.p_step if hard >= target_hard else s.p_step), s.p_min,
                                        s.p_max))
        return {"greso/p_easy": self.p_easy, "greso/p_hard": self.p_hard}

    def state_dict(self) -> dict:
        return {"p_easy": self.p_easy, "p_hard": self.p_hard,
                "streaks": {uid: list(z) for uid, z in self.streaks.items()},
                "seen": sorted(self.seen), "past_first_epoch": self.past_first_epoch}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()``'s output.

        Raises:
            ValueError: a key of ``state_dict()`` is missing (a checkpoint of an older ``greso`` state), naming it.
        """
        for key in ("p_easy", "p_hard", "streaks", "seen", "past_first_epoch"):
            if key not in state:
                raise ValueError(f"the greso allocator state lacks {key!r} (it has {sorted(state)}): it was saved "
                                 "by an older greso state; start the run afresh")
        self.p_easy, self.p_hard = float(state["p_easy"]), float(state["p_hard"])
        self.streaks = {str(uid): (int(z[0]), int(z[1])) for uid, z in state["streaks"].items()}
        self.seen = {str(uid) for uid in state["seen"]}
        self.past_first_epoch = bool(state["past_first_epoch"])


@register_root_rule("greso", make_state=GresoState)
def greso_root_rule(request: RootRequest) -> RootDecision:
    """GRESO: keep each candidate with its keep probability, then ``n`` each to the kept, in candidate order.

    Returns:
        ``RootDecision`` with ``counts`` (B,) int64 summing to ``R``; metrics ``greso/skipped`` (candidates the
        draw skipped) and ``greso/refilled`` (skipped candidates sampled anyway to fill the budget).

    Raises:
        ValueError: no ``state``, ``prompt_uids`` or ``rng_for``.
    """
    if request.state is None or request.prompt_uids is None or request.rng_for is None:
        raise ValueError("the greso arm skips prompts by their history: call trace.allocation.step.allocate_step "
                         "with state=make_allocator_state(arm) and the candidates' prompt ids")
    request.state.see_candidates(request.prompt_uids)
    keep = request.rng_for("greso").random(request.num_candidates) < request.state.keep_probability(
        request.prompt_uids)
    order = np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)])
    counts = uniform_root_counts(request.num_candidates, request.root_budget, request.group_size, order)
    return RootDecision(counts, info={"method": "skip"},
                        metrics={"greso/skipped": float((~keep).sum()),
                                 "greso/refilled": float(np.count_nonzero(counts[~keep]))})
