"""Docs table of the field's prompt-level allocators on one budget: what each method is and spends, what its paper
claims, and what this project measured (the simulator benchmark and the all-arms run of the default task)."""

from __future__ import annotations

from scripts.docs_tables_common import Context, _finite, _missing, _num, _table
from scripts.docs_tables_runs import _diff, _judged, _verdict_rule

__all__ = ["ACTED", "ALLOCATORS", "acted_cell", "allocators_table"]

# arm -> (method and paper, state across steps, what the original spends per step, the paper's claim (its abstract))
ALLOCATORS = {
    "reinforce_ada": ("Reinforce-Ada (arXiv 2510.04996)", "none",
                      "8 to 32 rollouts per prompt in rounds of 8, trains on 4 kept per prompt",
                      "faster convergence and higher final accuracy than GRPO on math reasoning"),
    "greso": ("GRESO (arXiv 2506.02177)", "per prompt its run of agreed groups; two skip probabilities",
              "n per prompt kept by a pre-rollout skip, on dynamic sampling (zero-variance groups dropped, "
              "batches drawn until the batch is full)",
              "up to 2.4x faster rollout and 2.0x faster training without accuracy loss"),
    "mopps": ("MoPPS (arXiv 2507.04632)", "per prompt a Beta posterior of its success",
              "B groups of n chosen from ts_ratio x B candidates (8-16)",
              "predicts prompt difficulty online; faster training with far fewer rollouts"),
    "vip": ("VIP (arXiv 2602.01601)", "a GP mean of every prompt's success, corrected by every step's observations",
            "its batch_budget over the batch (2048 over 256 prompts), 0 or 4 to 32 per prompt",
            "better sampling efficiency and accuracy than uniform or heuristic allocation"),
}


# arm -> what its state did, from the report's allocator_state: (metric, words after its per-step mean, digits)
ACTED = {
    "greso": (("greso/skipped", "candidates skipped", 1), ("greso/refilled", "refilled", 1),
              ("greso/p_easy", "keep probability of all-correct prompts", 2)),
    "mopps": (("mopps/selected_seen", "of the chosen prompts seen before", 2),
              ("mopps/known_prompts", "prompts with a posterior", 0)),
    "vip": (("vip/active_prompts", "prompts given rollouts", 1), ("vip/forecast_brier", "Brier of its forecasts", 3)),
}


def acted_cell(arm: str, entry: dict) -> str:
    """What an allocator's state across steps did, as the mean per step (mean over steps, then seeds) of its
    ``ACTED`` metrics in its report entry; ``no state`` for an arm without any, ``not logged`` for a report
    without them."""
    if arm not in ACTED:
        return "no state"
    state = entry.get("allocator_state", {})
    parts = [f"{_num(state[key]['mean'], digits)} {words}" for key, words, digits in ACTED[arm]
             if _finite((state.get(key) or {}).get("mean"))]
    return "; ".join(parts) if parts else "not logged"


def allocators_table(ctx: Context, key: str = "all-arms") -> str:
    """Per field allocator: method, state, spending (the original's, and this project's measured trajectories per
    step), the paper's claim, its effective ratio against ``grpo`` on the simulator (ratio, 95 % t-interval over
    the benchmark's seeds) and on the default task (difference, paired by seed), and its held-out avg@k against
    ``grpo``."""
    bench = ctx.benchmark("allocation_quality")["results"]["headline"].get("allocators_on_one_budget", {})
    folder, metrics = ctx.report(key)
    if metrics is None:
        return _missing(ctx, key)
    abl = metrics["ablations"]
    verdicts = _judged(abl)["verdicts"]
    rows = []
    for arm, (method, state, original, claim) in ALLOCATORS.items():
        sim = bench.get(arm, {}).get("ratio_vs_grpo")
        sim_cell = (f"{_num(sim['mean'], 2)} [{_num(sim['low'], 2)}, {_num(sim['high'], 2)}]"
                    if sim and _finite(sim.get("low")) else "n/a")
        entry = abl.get(arm, {})
        traj = (entry.get("mean", {}).get("trajectories/step") or {}).get("mean")
        vs = entry.get("vs_grpo", {})
        rows.append([f"`{arm}`", method, state, original, f"{_num(traj, 0)}" if _finite(traj) else "n/a",
                     acted_cell(arm, entry) if entry else "n/a", claim,
                     sim_cell, _diff(vs.get("effective ratio"), verdicts.get((arm, "vs_grpo", "effective ratio"))),
                     _diff(vs.get("eval mean@k"), verdicts.get((arm, "vs_grpo", "eval mean@k")))])
    note = (f"Simulator: `reports/benchmarks/allocation_quality.json` (`allocators_on_one_budget`, the ratio of effective "
            f"ratios to `grpo`'s, same seeds). Default task: [`reports/runs/{folder}/metrics.json`]"
            f"({ctx.link(f'reports/runs/{folder}/metrics.json')}), arm minus `grpo` at the same seed ({_verdict_rule(ctx)}). "
            "What its state did: the mean per step over steps, then seeds, of its logged state (the report's "
            "Allocator state section); state keyed by prompt acts only on prompts that recur. Claims paraphrase each "
            "paper's abstract; none of the four reads the success predictor.")
    return _table(["arm", "method", "state across steps", "the original spends per step", "here, trajectories/step",
                   "here, what its state did a step", "paper's claim", "simulator: effective ratio / grpo",
                   "default task: effective ratio - grpo", "default task: held-out avg@k - grpo"], rows,
                  ["---", "---", "---", "---", "---:", "---", "---", "---:", "---:", "---:"]) + "\n\n" + note
