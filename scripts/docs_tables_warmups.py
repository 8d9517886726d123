"""Docs table of the accuracy run over several warmups (``make run-paper``, index key ``paper-warmups``): each warmup's
starting point and each arm's held-out avg@k minus ``grpo`` within it, then how much the warmup moves that difference
(``study.json`` of ``scripts.warmup_study pool``: ``warmups`` and ``warmup_components``). The pooled comparisons
themselves are the run tables of the same key (``paper-warmups-primary``, ``-vs-grpo``, ...), read from the study's
``metrics.json``."""

from __future__ import annotations

import json
import math

from scripts.docs_tables_common import RUNS, Context, _missing, _num, _source, _table
from trace.reporting.statistics import mean_interval

__all__ = ["KEY", "warmups_table"]

KEY = "paper-warmups"
PRIMARY = "eval mean@k"


def _cell(iv: dict | None) -> str:
    if not iv or iv.get("mean") is None:
        return "n/a"
    return f"{_num(iv['mean'], 3, True)} [{_num(iv['low'], 3, True)}, {_num(iv['high'], 3, True)}]"


def warmups_table(ctx: Context) -> str:
    """Per warmup: SFT step kept and held-out greedy and avg@k; per arm and warmup: avg@k minus ``grpo`` (paired
    bootstrap within the warmup); per arm: the warmup and seed standard deviations of that difference, the warmup's
    share, the F-test's p and the t-interval over the warmups' means."""
    folder, metrics = ctx.report(KEY)
    if metrics is None:
        return _missing(ctx, KEY)
    study = json.loads((ctx.root / RUNS / folder / "study.json").read_text())
    warmups = study["warmups"]
    k = study["study"]["evaluate.pass_k"]
    start = _table(["warmup seed", "SFT step kept", "held-out greedy", f"held-out avg@{k}"],
                   [[w, str(p["warmup"].get("warmup/chosen_step", "n/a")), _num(p["warmup"].get("accuracy/greedy")),
                     _num(p["warmup"].get(f"accuracy/mean@{k}", p["warmup"].get(f"accuracy/mean_at_{k}")))] for w, p in warmups.items()])
    arms = [a for a in study["warmup_components"]]
    rows = []
    for arm in arms:
        c = study["warmup_components"][arm]
        over = mean_interval([c["means"][w] for w in warmups])
        rows.append([f"`{arm}`", *[_cell(warmups[w]["arms"][arm]["vs_grpo"].get(PRIMARY)) for w in warmups],
                     _num(math.sqrt(c["var_warmup"])), _num(math.sqrt(c["var_seed"])), _num(c["warmup_share"], 2),
                     _num(c["p"], 3), f"{_num(over.mean, 3, True)} [{_num(over.low, 3, True)}, {_num(over.high, 3, True)}]"])
    moved = _table(["arm", *[f"w{w}: avg@{k} minus `grpo`" for w in warmups], "sd warmup", "sd seed", "warmup share",
                    "p (no warmup effect)", "t over warmups"], rows)
    units = len(study["units"])
    return (f"{start}\n\n{moved}\n\nEach warmup (`warmup.seed`) with its own seed rollouts and predictor warm start; "
            f"{units} units (warmup, training seed). Per warmup: the difference paired by seed and question within it "
            "(bootstrap, 95 %). sd warmup and sd seed: the one-way random-effects split of the per-unit difference "
            "(`trace.reporting.warmups.warmup_components`); p: the F-test of no warmup effect; t over warmups: the "
            "95 % t-interval over the warmups' means, the one a new warmup's result falls in when the warmup share "
            f"is large. {_source(ctx, folder, 'study.json')}")
