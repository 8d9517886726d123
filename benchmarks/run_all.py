"""Run every benchmark, each in its own process, and write ``summary.json`` and ``summary.md`` beside them.

Each benchmark runs as ``python -m benchmarks.<name>`` (so one's imports, threads and memory do not
affect the next), in the order below, with this process's environment plus the defaults the pipeline's
stages use (offline, CPU, quiet Prefect). The summary collects each report's ``headline`` and the wall time
of each run; ``summary.md`` is the headline table. With ``--only``, the other benchmarks' reports already in
``--out`` (of the same ``--quick`` setting) stay in the summary.

Usage:
    python -m benchmarks.run_all [--quick] [--out DIR] [--only NAME ...] [--summary-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from benchmarks.common import REPO_ROOT, REPORT_DIR

BENCHMARKS = ("solver_speed", "allocation_quality", "rollout_engine", "orchestration", "lora_update", "real_task_step",
              "step_dtype")
_ENV_DEFAULTS = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                 "PREFECT_LOGGING_LEVEL": "WARNING", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                 "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, dict) and "mean" in value:
        return f"{value['mean']:{spec}} +- {value['std']:{spec}}"
    if isinstance(value, bool):
        return "met" if value else "missed"
    if isinstance(value, float):
        return f"{value:{spec}}"
    return str(value)


def headline_table(reports: dict[str, dict]) -> str:
    """Markdown table of the targets: what was measured against what was asked."""
    rows = []
    alloc = reports.get("allocation_quality", {}).get("results", {}).get("headline")
    if alloc:
        rows.append(("trace (oracle) effective ratio / grpo", _fmt(alloc["trace_oracle_vs_grpo_effective_ratio"]),
                     ">= 1.5", _fmt(alloc["targets"]["trace_oracle_at_least_1.5x_grpo"])))
        rows.append(("trace (learned) effective ratio / trace (oracle)",
                     _fmt(alloc["trace_learned_vs_oracle_effective_ratio"]), ">= 0.9",
                     _fmt(alloc["targets"]["trace_learned_at_least_0.9x_oracle"])))
    solver = reports.get("solver_speed", {}).get("results", {}).get("headline")
    if solver:
        rows.append(("root allocation B=4096, M=65536, m_max=64: seconds (1 core)",
                     _fmt(solver["root_B4096_M65536_m_max64_seconds"]), "< 0.5", ""))
        rows.append(("... certified gap", _fmt(solver["root_B4096_M65536_m_max64_certified_gap"]), "< 1e-3",
                     _fmt(solver["targets"]["root_4096_65536_under_0.5s_gap_under_0.1pct"])))
        rows.append((f"prefix allocation {solver['prefix_largest_anchors']} anchors, budget "
                     f"{solver['prefix_largest_budget']}: seconds", _fmt(solver["prefix_largest_seconds"]), "< 0.2",
                     _fmt(solver["targets"]["prefix_1e5_under_0.2s"])))
    engine = reports.get("rollout_engine", {}).get("results", {}).get("headline")
    if engine:
        for key, value in engine["engine_vs_generate"].items():
            rows.append((f"engine / model.generate tokens per s, {key}", _fmt(value), ">= 1", ""))
        rows.append(("", "", "", _fmt(engine["targets"]["engine_at_least_as_fast_as_generate"])))
        for key, value in engine["reuse_vs_new_tokens_alone"].items():
            rows.append((f"k continuations from a shared prefix / new tokens alone, {key}", _fmt(value), "<= 1.25",
                         ""))
        rows.append(("", "", "", _fmt(engine["targets"]["shared_prefix_at_most_1.25x_new_tokens"])))
    orch = reports.get("orchestration", {}).get("results", {}).get("headline")
    if orch:
        rows.append(("orchestration (Prefect + MLflow + Parquet) share of a default step",
                     _fmt(orch["orchestration_share_of_step"]), "< 0.05",
                     _fmt(orch["targets"]["orchestration_under_5pct"])))
        rows.append(("share outside model compute (incl. predictor)", _fmt(orch["outside_model_share_of_step"]),
                     "", ""))
        rows.append(("no-op dvc repro: seconds", _fmt(orch["noop_dvc_repro_seconds"]), "< 5",
                     _fmt(orch["targets"]["noop_dvc_repro_under_5s"])))
    lora = reports.get("lora_update", {}).get("results", {}).get("headline")
    if lora:
        rows.append(("LoRA / full fine-tuning: RL step time (same batch)", _fmt(lora["lora_vs_full_step_time"]),
                     "measured", ""))
        rows.append(("LoRA / full fine-tuning: AdamW state", _fmt(lora["lora_vs_full_optimizer_memory"]), "< 0.1",
                     _fmt(lora["targets"]["lora_optimizer_state_below_a_tenth_of_full"])))
    step = reports.get("real_task_step", {}).get("results", {}).get("headline")
    if step:
        rows.append(("real-task step (HotpotQA preset, trace): seconds, full fine-tuning / LoRA",
                     f"{_fmt(step['full_step_seconds'])} / {_fmt(step['lora_step_seconds'])}", "measured", ""))
        if "full_bf16_step_seconds" in step:
            rows.append(("... the same in bf16 (`update.bf16`): full fine-tuning / LoRA",
                         f"{_fmt(step['full_bf16_step_seconds'])} / {_fmt(step['lora_bf16_step_seconds'])}",
                         "measured", ""))
        rows.append(("... share of a step outside the model (profiled)", _fmt(step["outside_the_model_share"]), "< 0.1",
                     _fmt(step["targets"]["outside_the_model_under_10pct"])))
    dtype = reports.get("step_dtype", {}).get("results", {}).get("headline")
    if dtype:
        rows.append(("default step, float32 / bf16 seconds (bf16 instructions: "
                     f"{dtype.get('cpu_bf16', 'n/a')})", _fmt(dtype["float32_over_bfloat16_step"]), ">= 1.5",
                     _fmt(dtype["targets"]["bfloat16_step_at_least_1.5x_faster"])))
    lines = ["| measure | result | target | |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmarks; returns the summary (also written to ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test)")
    parser.add_argument("--out", default=str(REPORT_DIR), help=f"report folder (default {REPORT_DIR})")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    parser.add_argument("--summary-only", action="store_true",
                        help="run nothing: rewrite summary.md and summary.json from the reports already in --out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    env = {**_ENV_DEFAULTS, **os.environ, "PYTHONPATH": str(REPO_ROOT)}
    summary: dict = {"quick": args.quick, "runs": {}}
    reports: dict[str, dict] = {}
    for name in [] if args.summary_only else (args.only or BENCHMARKS):
        cmd = [sys.executable, "-m", f"benchmarks.{name}", "--out", str(out)] + (["--quick"] if args.quick else [])
        print(f"[run_all] {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env)
        seconds = time.perf_counter() - start
        summary["runs"][name] = {"seconds": round(seconds, 1), "exit_code": proc.returncode}
        report_path = out / f"{name}.json"
        if proc.returncode == 0 and report_path.is_file():
            reports[name] = json.loads(report_path.read_text())
            summary["runs"][name]["headline"] = reports[name]["results"].get("headline")
        print(f"[run_all] {name}: exit {proc.returncode} in {seconds:.0f} s", flush=True)
    for name in BENCHMARKS:  # reports of benchmarks not run now (--only) stay in the summary
        report_path = out / f"{name}.json"
        if name not in summary["runs"] and report_path.is_file():
            report = json.loads(report_path.read_text())
            if bool(report.get("quick")) == args.quick:
                reports[name] = report
                summary["runs"][name] = {"seconds": report.get("duration_s"), "exit_code": 0, "from_earlier_run": True,
                                         "headline": report["results"].get("headline")}
    table = headline_table({name: reports[name] for name in BENCHMARKS if name in reports})
    summary["total_seconds"] = round(sum(r["seconds"] or 0.0 for r in summary["runs"].values()), 1)
    machines = {name: report.get("machine") or {} for name, report in reports.items()}
    models = sorted({str(m.get("cpu_model")) for m in machines.values() if m.get("cpu_model")})
    summary["machine"] = {"cpu_model": " / ".join(models) or None,  # each report keeps its own record
                          "cpu_flags": {name: m.get("cpu_flags") for name, m in machines.items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(f"# Benchmark headlines{' (--quick: not results)' if args.quick else ''}\n\n"
                                    + table + f"\nTotal wall time: {summary['total_seconds']} s.\n")
    print(table)
    failed = [n for n, r in summary["runs"].items() if r["exit_code"] != 0]
    if failed:
        raise SystemExit(f"benchmarks failed: {', '.join(failed)}")
    return summary


if __name__ == "__main__":
    main()
