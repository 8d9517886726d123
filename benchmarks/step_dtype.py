"""The default step in float32 against bfloat16, against the machine's matrix-product peak, and a stage's start-up.

Four measurements in one run, on this machine:

- **Matrix products**: GFLOP/s of ``torch.matmul`` in float32 and in bfloat16 at the default policy's shapes
  (a batch of ``micro_batch_size`` x ``tokens`` rows against the attention and MLP projections), each the
  median of ``repeats`` timings; beside them, whether the CPU lists native bf16 instructions
  (``avx512_bf16``, ``amx_bf16`` in ``/proc/cpuinfo``). Without them torch converts bf16 to float32 around
  each product, so bf16 is no faster.
- **Default step**: ``params.yaml`` as committed, arm ``trace``, the orchestration benchmark's warm policy
  (cached under ``data/benchmarks/``), ``trace.training.loop.Trainer.step`` of two trainers built from the same
  weights and seeds, one in float32 and one with ``policy.dtype: bfloat16`` and ``update.bf16: true``;
  steps alternate between them (float32 step 0, bf16 step 0, float32 step 1, ...), so load drifts hit both.
  Step 0 (first calls, DeepSpeed set-up) is reported apart; the ratio is of the medians of the rest.
- **Against the machine's limit**: the peak GFLOP/s of ``torch.matmul`` per dtype (the best of large square
  products, at the benchmark's thread count), and per phase of the same steps (predict, rollout, expand,
  predictor fit, update, evaluation) the FLOPs that torch's ``FlopCounterMode`` counts on a second trainer per
  dtype taking the same steps (``benchmarks.flops``), the achieved GFLOP/s and its share of the peak; the
  step's time at the peak (``compute_bound_seconds``), how many times that the step takes, and the share of the
  step outside the phases and outside model compute. ``auto_precision`` is what ``policy.dtype: auto`` resolves
  to on this machine (``trace.precision``).
- **Stage start-up**: in a fresh interpreter each, the seconds to import what a stage imports (``prefect``,
  ``mlflow``, ``torch``, ``transformers``, ``deepspeed``, ``flows.train``), and to import ``trace.tracking``
  and open, log to and close an MLflow run (``trace.tracking.stage_run``) on a new SQLite store and on one
  that exists (every stage of ``make run`` after the first): the fixed cost each of ``make run``'s 30 stage
  processes pays besides its work, next to the Prefect server's own per-flow calls (the orchestration
  benchmark).

``--quick``: 2 steps each, fewer matmul repeats, tiny params; a smoke test.

Usage: ``python -m benchmarks.step_dtype [--quick] [--threads N] [--out reports/benchmarks]``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common import REPO_ROOT, figure_path, parse_args, pyplot, torch_threads, write_report
from benchmarks.flops import matmul_gflops, matmul_peak
from trace.precision import BF16_CPU_FLAGS, cpu_bf16_flags, cpu_model, native_bf16

NAME = "step_dtype"
STARTUP_PROBES = {
    "python": "pass",
    "prefect": "import prefect",
    "mlflow": "import mlflow",
    "torch": "import torch",
    "transformers": "import transformers",
    "deepspeed": "import deepspeed",
    "flows.train": "import flows.train",
}
MLFLOW_PROBE = """
import sys, time
t0 = time.perf_counter()
from trace.tracking import stage_run
with stage_run("probe", tracking_uri=f"sqlite:///{sys.argv[1]}/mlflow.db", experiment_name="probe", params={"a": 1},
               params_hash="probe") as run:
    run.log_metrics({"x": 1.0}, 0)
print(time.perf_counter() - t0)
"""


def cpu_flags() -> dict[str, bool]:
    """Which of the native-bf16 flags (``trace.precision.BF16_CPU_FLAGS``) the CPU lists."""
    listed = cpu_bf16_flags()
    return {flag: flag in listed for flag in BF16_CPU_FLAGS}


def matmul_rates(cfg: Any, tokens: int, repeats: int) -> list[dict]:
    """GFLOP/s of float32 and bfloat16 products at the policy's projection shapes.

    Args:
        cfg: the config (``policy.hidden_size``, ``policy.intermediate_size``, ``update.micro_batch_size``).
        tokens: tokens per sequence; rows = micro batch x tokens.
        repeats: timings per shape and dtype (the median is kept).

    Returns:
        One dict per shape: ``shape`` (M, K, N), ``float32_gflops``, ``bfloat16_gflops``, ``ratio`` (bf16 / fp32).
    """
    rows = cfg.update.micro_batch_size * tokens
    h, f = cfg.policy.hidden_size, cfg.policy.intermediate_size
    out = []
    for m, k, n in ((rows, h, h), (rows, h, f), (rows, f, h)):
        rates = {dtype: matmul_gflops(m, k, n, dtype, repeats) for dtype in ("float32", "bfloat16")}
        out.append({"shape": [m, k, n], "float32_gflops": rates["float32"], "bfloat16_gflops": rates["bfloat16"],
                    "ratio": rates["bfloat16"] / rates["float32"]})
    return out


def _trainer(cfg: Any, policy_dir: Path, env: Any, run_dir: Path) -> Any:
    from trace.policy.model import load_policy
    from trace.predictor import make_predictor
    from trace.training.loop import Trainer

    p = load_policy(policy_dir, dtype=cfg.policy.dtype)
    return Trainer(cfg, "trace", policy=p, env=env, train_prompts=env.prompts("train"),
                   eval_prompts=env.prompts("eval"), predictor=make_predictor(cfg.predictor, env=env, policy=p,
                                                                              seed=cfg.seed),
                   run_dir=run_dir, progress=False)


def alternating_steps(params: Path, num_steps: int, quick: bool) -> dict:
    """``num_steps`` default steps of a float32 and a bfloat16 trainer, alternating; per-step ``time/*``; and
    the FLOPs of each phase of the same steps, counted on a second trainer per dtype (``benchmarks.flops``)."""
    from benchmarks.flops import PhaseFlops
    from benchmarks.orchestration import warm_policy
    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment
    from trace.policy.model import save_policy

    base = load_config(params)
    env = make_environment(base.task, base.seed, root=REPO_ROOT)
    policy, policy_info = warm_policy(base, env, 0 if quick else 80, 16, 0.003, cache=not quick)
    work = Path(tempfile.mkdtemp(prefix="trace-bench-dtype-"))
    save_policy(policy, work / "policy")
    trainers, counted, steps = {}, {}, {"float32": [], "bfloat16": []}
    for dtype in steps:
        cfg = load_config(params, overrides={"policy.dtype": dtype, "update.bf16": dtype == "bfloat16"})
        trainers[dtype] = _trainer(cfg, work / "policy", env, work / dtype)
        counted[dtype] = (_trainer(cfg, work / "policy", env, work / f"{dtype}-counted"), PhaseFlops())
    for step in range(num_steps):
        for dtype, trainer in trainers.items():
            metrics = trainer.step(step)
            steps[dtype].append({k: float(v) for k, v in metrics.items()
                                 if k.startswith("time/") or k in ("reward/mean", "effective_ratio",
                                                                    "tokens/generated", "losses/grad_norm")})
    flops: dict[str, list[dict]] = {dtype: [] for dtype in steps}
    for dtype, (trainer, counter) in counted.items():
        with counter.attributed(trainer):
            for step in range(num_steps):
                before = dict(counter.flops)
                with counter.counting():
                    trainer.step(step)
                flops[dtype].append({k: v - before.get(k, 0) for k, v in counter.flops.items()})
    return {"policy": policy_info, "policy_parameters": policy.num_parameters, "steps": steps, "flops": flops}


def roofline_by_dtype(run: dict, peaks: dict) -> dict:
    """``benchmarks.flops.roofline`` of steps 1.. (step 0 holds the first calls' set-up) per dtype."""
    from benchmarks.flops import PHASES, roofline

    out = {}
    for dtype, rows in run["steps"].items():
        first = 1 if len(rows) > 1 else 0
        counts = run["flops"][dtype][first:]
        flops = {k: sum(c.get(k, 0) for c in counts) for k in (*PHASES, "total")}
        seconds = {p: sum(r.get(f"time/{p}", 0.0) for r in rows[first:]) for p in PHASES}
        out[dtype] = roofline(flops, seconds, sum(r["time/step"] for r in rows[first:]), peaks[dtype]["gflops"])
    return out


def startup_seconds(repeats: int) -> dict:
    """Median seconds of a fresh interpreter for each probe of ``STARTUP_PROBES`` (the import alone, measured
    inside the process after the interpreter started) and of ``MLFLOW_PROBE``."""
    out: dict[str, float] = {}
    for name, stmt in STARTUP_PROBES.items():
        code = f"import time; t0 = time.perf_counter(); {stmt}; print(time.perf_counter() - t0)"
        values = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                                    check=True, timeout=300)
            wall = time.perf_counter() - t0
            values.append((float(result.stdout.split()[-1]), wall))
        out[f"import {name}"] = statistics.median(v[0] for v in values)
        out[f"process with {name}"] = statistics.median(v[1] for v in values)
    values = []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeats + 1):  # the first creates the store (its schema migrations), as make run's first stage
            result = subprocess.run([sys.executable, "-c", MLFLOW_PROBE, folder], cwd=REPO_ROOT, capture_output=True,
                                    text=True, check=True, timeout=300)
            values.append(float(result.stdout.split()[-1]))
    out["mlflow run on a new SQLite store"] = values[0]
    out["mlflow run on an existing SQLite store"] = statistics.median(values[1:])
    return out


def summarize(steps: dict) -> dict:
    """Medians over steps 1.. of ``time/step`` and its parts, per dtype, and the float32 / bf16 ratios."""
    keys = ("time/step", "time/rollout", "time/expand", "time/update", "time/predict", "time/predictor_fit")
    out: dict = {}
    for dtype, rows in steps.items():
        rest = rows[1:] or rows
        out[dtype] = {k: statistics.median(r[k] for r in rest if k in r) for k in keys if any(k in r for r in rest)}
        out[dtype]["step0_seconds"] = rows[0]["time/step"]
    out["float32_over_bfloat16"] = {k: out["float32"][k] / out["bfloat16"][k]
                                    for k in out["float32"] if k in out["bfloat16"] and out["bfloat16"][k] > 0}
    return out


def plot(summary: dict, startup: dict, limits: dict, out_dir: str) -> None:
    plt = pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4))
    parts = ("time/rollout", "time/expand", "time/update", "time/predict", "time/predictor_fit")
    bottom = {"float32": 0.0, "bfloat16": 0.0}
    for part in parts:
        values = [summary[d].get(part, 0.0) for d in bottom]
        left.bar(list(bottom), values, bottom=list(bottom.values()), label=part.removeprefix("time/"))
        for d, v in zip(bottom, values):
            bottom[d] += v
    left.set_ylabel("seconds per default step (median)")
    left.legend(fontsize=8)
    phases = sorted({p for d in limits.values() for p in d["phases"]})
    width = 0.4
    for i, (dtype, lim) in enumerate(limits.items()):
        middle.bar([x + i * width for x in range(len(phases))],
                   [100 * lim["phases"].get(p, {}).get("share_of_peak", 0.0) for p in phases], width, label=dtype)
    middle.set_xticks([x + width / 2 for x in range(len(phases))], phases, fontsize=8)
    middle.set_ylabel("achieved GFLOP/s, % of the dtype's matmul peak")
    middle.legend(fontsize=8)
    names = [k for k in startup if k.startswith("import ")]
    right.barh(names, [startup[k] for k in names])
    right.set_xlabel("seconds in a fresh interpreter (median)")
    fig.tight_layout()
    fig.savefig(figure_path(NAME, out_dir), dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    started = time.perf_counter()
    params = REPO_ROOT / ("tests/params_tiny.yaml" if args.quick else "params.yaml")
    num_steps, repeats = (2, 3) if args.quick else (8, 20)
    from trace.configuration.params_file import load_config

    cfg = load_config(params)
    peak_shapes = ((256, 256, 256), (1024, 1024, 1024)) if args.quick else ((1024, 1024, 1024), (2048, 2048, 2048),
                                                                           (4096, 4096, 4096))
    with torch_threads(args.threads):
        matmul = matmul_rates(cfg, tokens=64 if args.quick else 200, repeats=repeats)
        peaks = {dtype: matmul_peak(dtype, 3 if args.quick else 5, peak_shapes) for dtype in ("float32", "bfloat16")}
        run = alternating_steps(params, num_steps, args.quick)
    startup = startup_seconds(1 if args.quick else 3)
    summary = summarize(run["steps"])
    limits = roofline_by_dtype(run, peaks)
    auto = "bfloat16" if native_bf16() else "float32"
    results = {"cpu_bf16_flags": cpu_flags(), "cpu_model": cpu_model(), "auto_precision": auto, "matmul": matmul,
               "matmul_peak": peaks, "roofline": limits, "default_step": {**run, "summary": summary},
               "startup_seconds": startup,
               "headline": {"cpu_bf16": "yes" if any(cpu_flags().values()) else "no", "auto_precision": auto,
                            "step_seconds_float32": summary["float32"]["time/step"],
                            "step_seconds_bfloat16": summary["bfloat16"]["time/step"],
                            "step_seconds_auto": summary[auto]["time/step"],
                            "float32_over_bfloat16_step": summary["float32_over_bfloat16"]["time/step"],
                            "float32_over_auto_step": summary["float32"]["time/step"] / summary[auto]["time/step"],
                            "peak_gflops_float32": peaks["float32"]["gflops"],
                            "peak_gflops_bfloat16": peaks["bfloat16"]["gflops"],
                            "auto_step_over_compute_bound": limits[auto]["step_over_compute_bound"],
                            "auto_outside_model_compute_share": limits[auto]["outside_model_compute_share"],
                            "matmul_bfloat16_over_float32": statistics.median(m["ratio"] for m in matmul),
                            "import_flows_train_seconds": startup["import flows.train"],
                            "mlflow_run_seconds": startup["mlflow run on an existing SQLite store"],
                            "targets": {"bfloat16_step_at_least_1.5x_faster":
                                        summary["float32_over_bfloat16"]["time/step"] >= 1.5}}}
    plot(summary, startup, limits, args.out)
    settings = {"params": str(params.relative_to(REPO_ROOT)), "ablation": "trace", "steps_each": num_steps,
                "matmul_repeats": repeats, "torch_threads": args.threads}
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


if __name__ == "__main__":
    print(json.dumps(main()["headline"], indent=2))
