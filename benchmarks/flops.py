"""FLOPs of each phase of a training step, and the machine's measured matrix-product peak to hold them against.

``PhaseFlops`` counts with torch's own ``torch.utils.flop_counter.FlopCounterMode`` (matrix products,
convolutions and attention kernels, forward and backward; elementwise work counts nothing) and attributes each
count to the phase of ``trace.training.loop.Trainer.step`` that ran it, by the same boundaries as the step's
``time/*`` timers:

- ``predict``: the predictor's scores of prompts and anchors (``PolicySampler.score_prompts`` / ``score_anchors``);
- ``rollout``: rollouts from the roots (``sample_roots``, and ``sample_continuations`` of the ``extra_roots`` salt);
- ``expand``: continuations from chosen prefixes (every other ``sample_continuations``);
- ``predictor_fit``: the predictor's evaluation and fit on the step's trees;
- ``update``: the policy update (``PolicyUpdater.rl_step``);
- ``eval``: the held-out evaluation (``evaluate_policy``), on the steps that evaluate.

A counting dispatch mode slows every operation, so counts come from a second trainer that takes the same steps
as the timed one (same config, weights and seeds: a step's work is the same on one CPU kind), never from the
timed trainer itself.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

PHASES = ("predict", "rollout", "expand", "predictor_fit", "update", "eval")


class PhaseFlops:
    """Per-phase FLOP totals of the steps taken inside ``counting()`` (see the module docstring)."""

    def __init__(self) -> None:
        self.flops: dict[str, int] = defaultdict(int)
        self._counter: Any = None
        self._inside = False

    def _wrap(self, fn: Callable, phase: str | Callable[..., str]) -> Callable:
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._counter is None or self._inside:  # not counting, or a phase inside a phase
                return fn(*args, **kwargs)
            name = phase(*args, **kwargs) if callable(phase) else phase
            before = self._counter.get_total_flops()
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False
                self.flops[name] += self._counter.get_total_flops() - before
        return counted

    @contextlib.contextmanager
    def attributed(self, trainer: Any) -> Iterator["PhaseFlops"]:
        """Attribute the FLOPs of ``trainer``'s steps to phases while the block runs (patches the sampler class,
        ``evaluate_policy`` and the trainer's predictor and updater; each put back on exit)."""
        from unittest import mock

        from trace.allocation import samplers
        from trace.training import loop

        def continuation_phase(_self, _trees, _counts, salt, *args, **kwargs) -> str:
            return "rollout" if salt == "extra_roots" else "expand"

        cls = samplers.PolicySampler
        patches = [
            mock.patch.object(cls, "score_prompts", self._wrap(cls.score_prompts, "predict")),
            mock.patch.object(cls, "score_anchors", self._wrap(cls.score_anchors, "predict")),
            mock.patch.object(cls, "sample_roots", self._wrap(cls.sample_roots, "rollout")),
            mock.patch.object(cls, "sample_continuations", self._wrap(cls.sample_continuations, continuation_phase)),
            mock.patch.object(loop, "evaluate_policy", self._wrap(loop.evaluate_policy, "eval")),
            mock.patch.object(trainer.predictor, "fit", self._wrap(trainer.predictor.fit, "predictor_fit")),
            mock.patch.object(trainer.predictor, "evaluate", self._wrap(trainer.predictor.evaluate, "predictor_fit")),
            mock.patch.object(trainer.updater, "rl_step", self._wrap(trainer.updater.rl_step, "update")),
        ]
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            yield self

    @contextlib.contextmanager
    def counting(self) -> Iterator["PhaseFlops"]:
        """Count while the block runs; ``flops["total"]`` gets everything counted, phases or not."""
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            self._counter = counter
            try:
                yield self
            finally:
                self._counter = None
                self.flops["total"] += counter.get_total_flops()


def matmul_gflops(m: int, k: int, n: int, dtype_name: str, repeats: int) -> float:
    """GFLOP/s of one (m, k) x (k, n) ``torch.matmul`` in ``dtype_name`` (``2 m k n`` FLOPs over the median of
    ``repeats`` timings after one warm-up product), at the current thread count."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.matmul(a, b)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        seconds.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(seconds) / 1e9


def matmul_peak(dtype_name: str, repeats: int, shapes: tuple[tuple[int, int, int], ...]) -> dict:
    """The highest GFLOP/s ``torch.matmul`` reaches in ``dtype_name`` over ``shapes`` (median of ``repeats``
    timings each): the machine's measured limit for a phase's achieved rate, at the current thread count.

    Returns:
        ``{"gflops": best, "shape": [M, K, N] of the best, "by_shape": [{"shape", "gflops"}, ...]}``.
    """
    by_shape = [{"shape": [m, k, n], "gflops": matmul_gflops(m, k, n, dtype_name, repeats)} for m, k, n in shapes]
    best = max(by_shape, key=lambda r: r["gflops"])
    return {"gflops": best["gflops"], "shape": best["shape"], "by_shape": by_shape}


def roofline(flops: dict[str, int], seconds: dict[str, float], step_seconds: float, peak_gflops: float) -> dict:
    """Each phase's achieved GFLOP/s and share of ``peak_gflops``, and where the step's time goes.

    Args:
        flops: phase -> FLOPs over the measured steps (``PhaseFlops.flops``; ``total`` included).
        seconds: phase -> seconds over the same steps (the ``time/<phase>`` timers summed).
        step_seconds: ``time/step`` summed over the same steps.
        peak_gflops: ``matmul_peak``'s ``gflops`` for the dtype the phases ran in.

    Returns:
        ``phases``: {phase: {"gflop", "seconds", "gflops", "share_of_peak"}} for phases with seconds;
        ``compute_bound_seconds``: total FLOPs at the peak (the step's time if every FLOP ran at the peak);
        ``step_over_compute_bound``: how many times that the step takes; ``outside_phases_share``: the share of
        the step in none of the phases (allocation, advantages, tree writes, bookkeeping); ``outside_model_compute_share``:
        the share of the step not explained by its FLOPs at the peak (1 - compute_bound / step).
    """
    phases = {}
    for phase in PHASES:
        if seconds.get(phase, 0.0) > 0:
            gflop = flops.get(phase, 0) / 1e9
            rate = gflop / seconds[phase]
            phases[phase] = {"gflop": gflop, "seconds": seconds[phase], "gflops": rate,
                             "share_of_peak": rate / peak_gflops}
    bound = flops.get("total", 0) / 1e9 / peak_gflops
    return {"phases": phases, "compute_bound_seconds": bound,
            "step_over_compute_bound": step_seconds / bound if bound > 0 else float("inf"),
            "outside_phases_share": 1.0 - sum(p["seconds"] for p in phases.values()) / step_seconds,
            "outside_model_compute_share": 1.0 - bound / step_seconds}
