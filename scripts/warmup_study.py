"""The accuracy run over several warmups (``make run-paper``): collect each warmup's experiment, then pool them.

Each warmup seed (``warmup.seed``) is one DVC experiment of the same params: its own warmup, seed rollouts and
predictor warm start, then every arm at the same training seeds. ``collect``, run in the workspace right after an
experiment, copies what the report needs into ``<out>/w<warmup seed>/``: ``results.json.gz`` (each arm's and seed's
MLflow results with the per-question held-out results, the warmup's metrics and per-question results, the params
that define the study, the commits the train runs ran at) beside that experiment's own ``summary.md`` and
``metrics.json``.

``pool`` reads every ``<out>/w*/results.json.gz`` and writes ``<out>/summary.md``, ``<out>/study.json`` and
``<out>/metrics.json`` (the pooled tables in the report's ``reports/metrics.json`` format):

- the report of the pooled study: each (warmup, training seed) pair is a unit, so every comparison with ``grpo``
  is paired within a unit (same warmup, same seed, same questions), with the report's rule, families, margin
  verdicts and power over all units (``trace.reporting.warmups.pool_units``);
- per warmup: its held-out accuracy, each arm's difference from ``grpo`` and gain over that warmup, as its own
  experiment's report computes them;
- how much the warmup moves each primary comparison: the per-warmup means and the split of the per-unit
  variance into warmup and seed components (``trace.reporting.warmups.warmup_components``).

Usage:
    python -m scripts.warmup_study collect --warmup-seed W [--params params.yaml] [--out reports/paper]
    python -m scripts.warmup_study pool [--out reports/paper]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
from pathlib import Path

from flows.common import METRICS, REPORTS, eval_path, write_json
from flows.warmup import WARMUP_EVAL
from trace.reporting.report import column_values
from trace.reporting.statistics import mean_interval
from trace.reporting.warmups import pool_units, warmup_components

RESULTS = "results.json.gz"  # one warmup's collected results: gzip, as raw per-question data is several MB of JSON
PRIMARY = "eval mean@k"  # the primary comparison's column (docs/method.md, "Statistics over seeds")
BASELINE = "grpo"
# the params every warmup of one study must share (warmup.seed is what differs)
STUDY_KEYS = ("train.ablations", "train.seeds", "train.num_steps", "evaluate.split", "evaluate.num_prompts",
              "evaluate.pass_k", "task.kgqa.num_test", "report.margin", "report.target_accuracy")


def _lookup(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return list(value) if isinstance(value, tuple) else value


def _run_commits(cfg, results: dict) -> str:
    """The commits the train runs ran at (their ``git.commit`` tags), short, comma-separated."""
    from mlflow.tracking import MlflowClient

    from trace.tracking.experiment import resolve_tracking_uri

    client = MlflowClient(resolve_tracking_uri(cfg.tracking.tracking_uri))
    tags = {client.get_run(res["run_id"]).data.tags.get("git.commit", "unknown")[:7]
            for by_seed in results.values() for res in by_seed.values()}
    return ", ".join(sorted(tags))


def collect(params: str, warmup_seed: int, out: Path) -> Path:
    """Copy the workspace's finished experiment (arms, seeds, warmup) into ``out/w<warmup_seed>/``.

    Raises:
        ValueError: the workspace's params are of another warmup seed than ``warmup_seed``.
        RuntimeError: an arm or seed has no finished train run (``flows.report.collect``).
    """
    from flows.report import collect as collect_results
    from trace.configuration.params_file import load_config
    from trace.reporting.report_questions import attach_question_results

    cfg = load_config(params)
    if cfg.warmup_seed != warmup_seed:
        raise ValueError(f"{params} is of warmup seed {cfg.warmup_seed} (warmup.seed, else seed), not {warmup_seed}: "
                         "collect right after that warmup's `dvc exp run`")
    results = collect_results(cfg)
    missing = [f"{a}-{s}" for a in cfg.train.ablations for s in cfg.train.run_seeds(cfg.seed)
               if s not in results.get(a, {})]
    if missing:
        raise RuntimeError(f"no finished train run for (ablation-seed) {missing}: finish the experiment first")
    warmup = json.loads((METRICS / "warmup.json").read_text())
    results, warmup_questions = attach_question_results(results, eval_path, WARMUP_EVAL, warmup, cfg.evaluate.pass_k)
    target = out / f"w{warmup_seed}"
    target.mkdir(parents=True, exist_ok=True)
    _write_gzip_json(target / RESULTS, {
        "warmup_seed": warmup_seed, "commit": _run_commits(cfg, results), "study": {k: _lookup(cfg, k) for k in STUDY_KEYS},
        "warmup": warmup, "warmup_questions": warmup_questions,
        "results": {arm: {str(s): res for s, res in by_seed.items()} for arm, by_seed in results.items()}})
    for name in ("summary.md", "metrics.json"):
        if (REPORTS / name).is_file():
            shutil.copyfile(REPORTS / name, target / name)
    return target


def load_warmups(out: Path) -> dict[int, dict]:
    """Every ``out/w*/results.json.gz``, by warmup seed, seeds as ints.

    Raises:
        FileNotFoundError: none found; ValueError: two warmups of different study params (named).
    """
    found = {}
    for path in sorted(out.glob(f"w*/{RESULTS}")):
        data = json.loads(gzip.decompress(path.read_bytes()))
        data["results"] = {arm: {int(s): res for s, res in by_seed.items()} for arm, by_seed in data["results"].items()}
        found[int(data["warmup_seed"])] = data
    if not found:
        raise FileNotFoundError(f"no {out}/w*/{RESULTS}: run `python -m scripts.warmup_study collect` after each "
                                "warmup's experiment (make run-paper does)")
    first = next(iter(found.values()))
    for w, data in found.items():
        if data["study"] != first["study"]:
            diff = {k: (first["study"][k], data["study"][k]) for k in STUDY_KEYS if first["study"][k] != data["study"][k]}
            raise ValueError(f"warmup {w} differs from warmup {next(iter(found))} in {diff}: pool only warmups of "
                             "one study")
    return dict(sorted(found.items()))


def _fmt(value: float, digits: int = 3, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _iv(cell) -> str:
    if cell is None:
        return "n/a"
    return f"{_fmt(cell.mean, sign=True)} [{_fmt(cell.low, sign=True)}, {_fmt(cell.high, sign=True)}]"


def pool(out: Path) -> dict:
    """Write ``out/summary.md`` and ``out/study.json`` from every collected warmup (see the module docstring)."""
    from trace.reporting.report import arm_statistics
    from trace.reporting.report_json import design, metrics_table
    from trace.reporting.report_markdown import render_markdown

    warmups = load_warmups(out)
    study = next(iter(warmups.values()))["study"]
    pass_k, margin, target = study["evaluate.pass_k"], study["report.margin"], study["report.target_accuracy"]
    pooled, units = pool_units({w: d["results"] for w, d in warmups.items()})
    table = metrics_table(pooled, pass_k, margin=margin, target_accuracy=target)
    per_warmup, components = {}, {}
    for w, data in warmups.items():
        st = arm_statistics(data["results"], pass_k, warmup=data["warmup"], warmup_questions=data["warmup_questions"],
                            target_accuracy=target)["arms"]
        per_warmup[w] = {"commit": data["commit"], "warmup": data["warmup"], "arms": {
            arm: {versus: {c: st[arm][versus][c] for c in ("eval greedy", PRIMARY) if c in (st[arm].get(versus) or {})}
                  for versus in ("vs_grpo", "vs_warmup")} for arm in st}}
    for arm in pooled:
        if arm == BASELINE or BASELINE not in pooled:
            continue
        diffs: dict[int, list[float]] = {}
        for u in units:
            value = column_values(pooled[arm][u["unit"]], pass_k)[PRIMARY] - \
                column_values(pooled[BASELINE][u["unit"]], pass_k)[PRIMARY]
            diffs.setdefault(u["warmup_seed"], []).append(value)
        if len(units) > len(warmups):  # one seed per warmup: no seed variance to split against
            components[arm] = warmup_components(diffs)
    pooled_text = render_markdown(pooled, {}, pass_k, num_eval=study["evaluate.num_prompts"], margin=margin,
                                  target_accuracy=target).rstrip()
    mapping = ", ".join(f"{u['unit']} = w{u['warmup_seed']} s{u['seed']}" for u in units)
    head, _, rest = pooled_text.partition("\n")
    lines = [f"{head}, pooled over {len(warmups)} warmups", "",
             f"Every \"seed\" of the tables below is a unit (warmup seed w, training seed s): {mapping}. Held-out: "
             f"{study['evaluate.num_prompts']} questions of the `{study['evaluate.split']}` split. Gains over the "
             "warmup and tokens to a target accuracy are per warmup (the section Warmups, and `w<seed>/summary.md`).",
             rest, "", *_warmup_lines(warmups, per_warmup, components, units)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    payload = {"study": study, "units": units, "ablations": table,
               "design": design(margin, study["evaluate.num_prompts"], study["evaluate.split"]),
               "warmups": {str(w): {"commit": p["commit"], "warmup": p["warmup"], "arms": {
                   arm: {versus: {c: _json(iv) for c, iv in cells.items()} for versus, cells in by.items()}
                   for arm, by in p["arms"].items()}} for w, p in per_warmup.items()},
               "warmup_components": {arm: {"means": {str(w): m for w, m in c.means.items()}, "grand_mean": c.grand_mean,
                                           "ms_between": c.ms_between, "ms_within": c.ms_within,
                                           "var_warmup": c.var_warmup, "var_seed": c.var_seed,
                                           "warmup_share": _clean(c.warmup_share), "f": _clean(c.f), "p": _clean(c.p)}
                                     for arm, c in components.items()}}
    write_json(out / "study.json", payload)
    # the report's own format, so the docs tables of a run report (scripts.docs_tables) read the pooled study
    write_json(out / "metrics.json", {"warmup": {}, "ablations": table, "design": payload["design"]})
    return payload


def _write_gzip_json(path: Path, payload: dict) -> None:
    """``payload`` as gzip-compressed JSON, written atomically (no timestamp in the header: the same bytes each time)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(payload, sort_keys=True).encode(), mtime=0))
    tmp.replace(path)


def _clean(value: float):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _json(iv) -> dict:
    return {"mean": _clean(iv.mean), "low": _clean(iv.low), "high": _clean(iv.high), "n": iv.n,
            "estimator": iv.estimator}


def _warmup_lines(warmups: dict, per_warmup: dict, components: dict, units: list[dict]) -> list[str]:
    lines = ["## Warmups", "",
             f"{len(warmups)} warmups (`warmup.seed` {', '.join(str(w) for w in warmups)}), each with its own seed "
             f"rollouts and predictor warm start; {len(units)} units (warmup, training seed). The tables above pool "
             "the units, each arm paired with `grpo` within a unit. Each warmup's own report: `w<seed>/summary.md`.",
             "", "| warmup seed | commit | SFT step kept | held-out greedy | held-out avg@k |", "|---|---|---|---|---|"]
    for w, p in per_warmup.items():
        wm = p["warmup"]
        sampled = next((v for k, v in wm.items() if k.startswith("accuracy/mean")), float("nan"))
        lines.append(f"| {w} | {p['commit']} | {wm.get('warmup/chosen_step', 'n/a')} | "
                     f"{_fmt(wm.get('accuracy/greedy', float('nan')))} | {_fmt(sampled)} |")
    lines += ["", "Per warmup, paired by seed and question within it (bootstrap, 95 %): avg@k minus `grpo`, and "
              "each arm's avg@k gain over its own warmup.", "",
              "| arm | " + " | ".join(f"w{w} minus grpo | w{w} gain" for w in per_warmup) + " |",
              "|---|" + "---|---|" * len(per_warmup)]
    for arm in next(iter(per_warmup.values()))["arms"]:
        cells = []
        for p in per_warmup.values():
            by = p["arms"].get(arm, {})
            cells += [_iv((by.get("vs_grpo") or {}).get(PRIMARY)), _iv((by.get("vs_warmup") or {}).get(PRIMARY))]
        lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
    if components:
        lines += ["", "How much the warmup moves the primary comparison (avg@k minus `grpo` per unit; one-way "
                  "random-effects analysis of variance, `trace.reporting.warmups.warmup_components`): the "
                  "per-warmup means, the standard deviation between warmups and between seeds within a warmup, "
                  "and the test of no warmup effect. The pooled intervals above treat the units as independent; "
                  "the t-interval over the warmups' means is the one that holds for a new warmup when the warmup "
                  "share is large (with 2 warmups it has 1 degree of freedom).", "",
                  "| arm | " + " | ".join(f"w{w} mean" for w in warmups) +
                  " | sd warmup | sd seed | warmup share | F | p | t over warmups |",
                  "|---|" + "---|" * len(warmups) + "---|---|---|---|---|---|"]
        for arm, c in components.items():
            over = mean_interval(list(c.means.values()))
            lines.append(f"| `{arm}` | " + " | ".join(_fmt(c.means[w], sign=True) for w in warmups) +
                         f" | {_fmt(math.sqrt(c.var_warmup))} | {_fmt(math.sqrt(c.var_seed))} | "
                         f"{_fmt(c.warmup_share, 2)} | {_fmt(c.f, 2)} | {_fmt(c.p, 3)} | {_iv(over)} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="copy this workspace's finished experiment into OUT/w<seed>")
    c.add_argument("--warmup-seed", type=int, required=True)
    c.add_argument("--params", default="params.yaml")
    c.add_argument("--out", type=Path, default=REPORTS / "paper")
    p = sub.add_parser("pool", help="pool every OUT/w*/ into OUT/summary.md and OUT/study.json")
    p.add_argument("--out", type=Path, default=REPORTS / "paper")
    args = parser.parse_args(argv)
    if args.command == "collect":
        print(f"collected {collect(args.params, args.warmup_seed, args.out)}")
    else:
        pool(args.out)
        print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
