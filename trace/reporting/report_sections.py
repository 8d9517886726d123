"""Sections of ``reports/summary.md`` beyond the verdicts: how the arms were held equal (trajectories or
tokens), and the predictor against Monte-Carlo truth with what the truth and the oracle arm cost."""

from __future__ import annotations

import math
from typing import Sequence

from trace.predictor.reliability import diagram_ece
from trace.reporting.report import TRUTH_SCORES
from trace.reporting.statistics import Interval

__all__ = ["accounting_lines", "allocator_state_section", "format_interval", "predictor_section"]

# what each per-step allocator metric means, in the report's words
ALLOCATOR_WORDS = {
    "greso/skipped": "candidates skipped a step", "greso/refilled": "skipped candidates given rollouts back a step",
    "greso/p_easy": "keep probability of all-correct prompts", "greso/p_hard": "keep probability of all-wrong prompts",
    "mopps/known_prompts": "prompts with a posterior", "mopps/selected_seen": "share of the chosen prompts seen before",
    "mopps/selected_posterior_mean": "posterior mean success of the chosen prompts",
    "vip/forecast_brier": "Brier score of its forecasts on the step's outcomes",
    "vip/mean_forecast": "mean forecast success", "vip/active_prompts": "prompts given rollouts a step",
    "allocation/explore_groups": "exploration groups a step (`allocation.explore_groups`)",
}


def _num(value: float, digits: int, sign: bool = False) -> str:
    if not math.isfinite(value):
        return "nan"
    return f"{value:{'+' if sign else ''},.{digits}f}"


def format_interval(iv: Interval, digits: int, sign: bool = False, brackets: bool = False) -> str:
    """``mean ± half`` (or ``mean [low, high]`` with ``brackets``); the mean alone without an interval."""
    if not iv.has_interval:
        return _num(iv.mean, digits, sign)
    if brackets:
        return f"{_num(iv.mean, digits, sign)} [{_num(iv.low, digits, sign)}, {_num(iv.high, digits, sign)}]"
    return f"{_num(iv.mean, digits, sign)} ± {_num(iv.half_width, digits)}"


def predictor_section(arms: dict, order: Sequence[str]) -> list[str]:
    """The "Predictor" section: each arm's forecasts against Monte-Carlo truth on the unselected sample
    (``predictor.truth``), roots and prefixes apart, and what the truth and the oracle's estimates cost; no lines
    when no arm logged ``truth/*`` or ``oracle/*``."""
    scored = [a for a in order if any(k.startswith("truth/") and not k.endswith("rollouts") for k in arms[a]["audit"])]
    oracle = [a for a in order if "oracle/rollouts" in arms[a]["audit"]]
    if not scored and not oracle:
        return []
    lines = ["", "## Predictor", ""]
    ratios = {a: arms[a]["flips_vs_random"] for a in order if arms[a].get("flips_vs_random") is not None}
    if ratios:
        lines += ["Stage 2 against random anchors: each arm's flips per step over `tree_random`'s at the same seed "
                  "(the same continuations a step, so flips per continuation), mean over seeds and 95 % t-interval: "
                  + "; ".join(f"`{a}` {format_interval(iv, 2, brackets=True)}" for a, iv in ratios.items()) + ".", ""]
    if scored:
        lines += ["What each arm's allocator reads (its predictor; `trace_oracle`: its Monte-Carlo estimates) against "
                  "Monte-Carlo truth on an unselected sample of the step's candidate prompts and visited prefixes "
                  "(`predictor.truth`), scored before the predictor's refit: mean over the audited steps, then over "
                  "seeds. Brier = reliability - resolution + uncertainty (+ a within-bin residual); a predictor "
                  "that predicts has resolution well above 0 and AUC above 0.5.", "",
                  "| ablation | stage | ECE | Brier | reliability | resolution | AUC | forecast mean | realised mean |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for abl in scored:
            au = arms[abl]["audit"]
            for stage in ("root", "prefix"):
                cells = [format_interval(au[k], 3) if (k := f"truth/{stage}_{n}") in au else "nan"
                         for n in TRUTH_SCORES]
                lines.append(f"| {abl} | {stage} | " + " | ".join(cells) + " |")
    lines += _reliability_lines(arms, scored)
    costs = [f"`{a}` audit {_num(arms[a]['audit']['truth/rollouts'].mean, 0)}" for a in scored
             if "truth/rollouts" in arms[a]["audit"]]
    costs += [f"`{a}` estimates {_num(arms[a]['audit']['oracle/rollouts'].mean, 0)} per step "
              f"({_num(arms[a]['audit']['oracle/tokens'].mean, 0)} tokens)" for a in oracle]
    if costs:
        lines += ["", "Rollouts outside the budget, never trained on (mean per step that ran them): " + "; ".join(costs)
                  + "."]
    return lines


def allocator_state_section(arms: dict, order: Sequence[str]) -> list[str]:
    """The "Allocator state" section: what the allocators that keep per-prompt state (``greso``, ``mopps``,
    ``vip``) and the exploration groups did, as the mean per step of their logged metrics (mean over steps, then
    over seeds ± 95 % t half-width); no lines when no arm logged one."""
    rows = [(a, key, iv) for a in order for key, iv in arms[a].get("allocator_state", {}).items()]
    if not rows:
        return []
    lines = ["", "## Allocator state", "",
             "What the allocators that read a prompt's own past outcomes did (they act only on prompts that recur: "
             "`train.prompt_pool`), and the exploration groups (`allocation.explore_groups`): mean per step over the "
             "steps, then over seeds.", "",
             "| ablation | metric | what it counts | per step |", "|---|---|---|---:|"]
    for abl, key, iv in rows:
        lines.append(f"| {abl} | `{key}` | {ALLOCATOR_WORDS.get(key, '')} | {format_interval(iv, 3)} |")
    return lines


def _reliability_lines(arms: dict, scored: Sequence[str]) -> list[str]:
    """The reliability diagrams (``reliability.png``) as numbers: per arm and stage, each bin's mean forecast ->
    realised rate (outcomes), pooled over the audits and seeds."""
    rows = [(a, stage, diagram) for a in scored if arms[a].get("reliability")
            for stage, diagram in arms[a]["reliability"].items() if diagram]
    if not rows:
        return []
    lines = ["", "Reliability diagrams (`reliability.png`), pooled over the audited steps and seeds: per forecast bin, "
             "mean forecast -> realised rate (outcomes). A calibrated predictor has the two equal in every bin. "
             "Pooled ECE: the ECE of that union (the table above averages per-audit ECEs, each over a few dozen "
             "items, which a calibrated but unsharp predictor also scores well above 0), with a 95 % percentile "
             "bootstrap interval that resamples the seeds, then each drawn seed's audits (`pooled_ece_interval`). "
             "Floor: the pooled ECE a predictor calibrated in every bin reads with this sample's noise (each bin's "
             "gap varies over the seeds as clusters); debiased: the pooled ECE with that noise taken out, with its "
             "interval from the same bootstrap (`calibration_noise`). Per seed, the floor is about sqrt(seeds) "
             "times higher.", "",
             "| ablation | stage | pooled ECE | floor | debiased | per seed | bins |", "|---|---|---:|---:|---:|---|---|"]
    for abl, stage, diagram in rows:
        cells = "; ".join(f"{_num(r['mean_forecast'], 2)} -> {_num(r['realised_rate'], 2)} ({_num(r['count'], 0)})"
                          for r in diagram)
        seeds = ", ".join(f"s{s} {_num(v, 3)}" for s, v in arms[abl]["pooled_ece_seeds"][stage].items())
        interval = (arms[abl].get("pooled_ece_interval") or {}).get(stage)
        pooled = _num(diagram_ece(diagram), 3) + (f" [{_num(interval[0], 3)}, {_num(interval[1], 3)}]"
                                                  if interval and math.isfinite(interval[0]) else "")
        noise = (arms[abl].get("ece_noise") or {}).get(stage) or {}
        low, high = noise.get("debiased_interval", (math.nan, math.nan))
        debiased = _num(noise.get("debiased", math.nan), 3) + (f" [{_num(low, 3)}, {_num(high, 3)}]"
                                                               if math.isfinite(low) else "")
        lines.append(f"| {abl} | {stage} | {pooled} | {_num(noise.get('floor', math.nan), 3)} | {debiased} | {seeds} "
                     f"| {cells} |")
    return lines


def accounting_lines(results: dict) -> list[str]:
    """The lines stating equal tokens (``train.token_budget``: the runs logged ``tokens/budget``), with each arm's
    steps, the runs that stopped at ``train.num_steps`` short of the budget, and the prompt and observation tokens
    (outside the budget); none for equal steps."""
    def per_arm(key: str, reduce) -> dict[str, float]:
        out = {}
        for abl, by_seed in results.items():
            values = [reduce([v for _, v in res["history"][key]]) for res in by_seed.values()
                      if res["history"].get(key)]
            if values:
                out[abl] = sum(values) / len(values)
        return out

    budget = max(per_arm("tokens/budget", max).values(), default=None)
    if budget is None:  # equal trajectories and steps: the report's line above says so
        return []
    steps = per_arm("tokens/cumulative", len)
    prompt, observation = per_arm("tokens/prompt", sum), per_arm("tokens/observation", sum)
    short = [f"{a} s{seed} ({_num(res['history']['tokens/cumulative'][-1][1], 0)})"
             for a, by_seed in results.items() for seed, res in by_seed.items()
             if res["history"].get("tokens/cumulative") and res["history"]["tokens/cumulative"][-1][1] < budget]
    reached = ("every arm stopped at the first step whose generated tokens reached" if not short else
               "the arms stopped at the first step whose generated tokens reached")
    lines = [f"Accounting: **equal tokens**, {reached} `train.token_budget` = {_num(budget, 0)}, evaluated at the same "
             "token marks; the differences below are at equal generated tokens. Steps taken (mean over seeds): "
             + ", ".join(f"{a} {_num(v, 1)}" for a, v in steps.items()) + "."]
    if short:
        lines.append("**Not at equal tokens**: these runs stopped at `train.num_steps` before the budget (their "
                     "generated tokens): " + ", ".join(short) + "; raise `train.num_steps` and resume them.")
    if prompt or observation:
        lines.append("Prompt and observation tokens are outside the budget (their totals, mean over seeds): "
                     + ", ".join(f"{a} {_num(prompt.get(a, math.nan), 0)} prompt, "
                                 f"{_num(observation.get(a, math.nan), 0)} observation" for a in results) + ".")
    return lines
