"""Docs tables of the benchmarks (``reports/benchmarks/<name>.json``), the studies (warmup sweep, learning study)
and the real tasks' data files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scripts.docs_tables_common import BENCHMARKS, RUNS, Context, _diff, _finite, _num, _table

def _near(value: Any, target: float, digits: int = 3) -> str:
    """``value`` at ``digits`` decimals, or at more (up to 6) when that rounding would land on ``target`` from
    the other side: 0.8996 against 0.9 reads 0.8996, not 0.900."""
    if not _finite(value):
        return _num(value, digits)
    while digits < 6 and round(value, digits) == target and value != target:
        digits += 1
    return _num(value, digits)


def _met(flag: Any) -> str:
    return "met" if flag is True else "missed" if flag is False else ""


def benchmarks_table(ctx: Context) -> str:
    """The benchmarks' headline numbers against their targets (``reports/benchmarks/<name>.json``)."""
    rows = []
    alloc = ctx.benchmark("allocation_quality")["results"]["headline"]
    ratio, learned = alloc["trace_oracle_vs_grpo_effective_ratio"], alloc["trace_learned_vs_oracle_effective_ratio"]
    rows.append(["`trace` (oracle predictor) / `grpo`, effective ratio on the simulator",
                 f"{_num(ratio['mean'], 2)} (sd {_num(ratio['std'], 2)}, {ratio['n']} seeds)", ">= 1.5",
                 _met(alloc["targets"]["trace_oracle_at_least_1.5x_grpo"])])
    rows.append(["`trace` (learned predictor) / `trace` (oracle)",
                 f"{_near(learned['mean'], 0.9)} (sd {_num(learned['std'])})", ">= 0.9",
                 _met(alloc["targets"]["trace_learned_at_least_0.9x_oracle"])])
    solver = ctx.benchmark("solver_speed")["results"]["headline"]
    rows.append(["root allocation, B = 4,096 prompts, M = 65,536, m_max = 64: seconds; certified gap",
                 f"{_num(solver['root_B4096_M65536_m_max64_seconds'], 2)} s; "
                 f"{solver['root_B4096_M65536_m_max64_certified_gap']:.1e}", "< 0.5 s; < 0.1 %",
                 _met(solver["targets"]["root_4096_65536_under_0.5s_gap_under_0.1pct"])])
    rows.append([f"prefix allocation, {solver['prefix_largest_anchors']:,} anchors: seconds",
                 f"{_num(solver['prefix_largest_seconds'], 4)} s", "< 0.2 s",
                 _met(solver["targets"]["prefix_1e5_under_0.2s"])])
    engine = ctx.benchmark("rollout_engine")["results"]["headline"]
    speed = engine["engine_vs_generate"]
    rows.append(["our engine / `model.generate`, tokens per second (" + ", ".join(speed) + ")",
                 " / ".join(_num(v, 2) for v in speed.values()), ">= 1",
                 _met(engine["targets"]["engine_at_least_as_fast_as_generate"])])
    reuse = engine["reuse_vs_new_tokens_alone"]
    rows.append(["k continuations from a shared prefix / their new tokens alone (" + ", ".join(reuse) + ")",
                 " / ".join(_num(v, 2) for v in reuse.values()), "<= 1.25",
                 _met(engine["targets"]["shared_prefix_at_most_1.25x_new_tokens"])])
    orch = ctx.benchmark("orchestration")["results"]["headline"]
    rows.append([f"Prefect + MLflow + Parquet share of a default step ({_num(orch['step_seconds'], 2)} s)",
                 f"{_num(100 * orch['orchestration_share_of_step'], 2)} %", "< 5 %",
                 _met(orch["targets"]["orchestration_under_5pct"])])
    rows.append(["no-op `dvc repro`: seconds", f"{_num(orch['noop_dvc_repro_seconds'], 2)} s", "< 5 s",
                 _met(orch["targets"]["noop_dvc_repro_under_5s"])])
    lora = ctx.benchmark("lora_update")["results"]["headline"]
    rows.append(["LoRA / full fine-tuning, SmolLM2-135M RL step: AdamW state; step time",
                 f"{_num(lora['lora_vs_full_optimizer_memory'])}; {_num(lora['lora_vs_full_step_time'], 2)}",
                 "< 0.1; measured", _met(lora["targets"]["lora_optimizer_state_below_a_tenth_of_full"])])
    step = ctx.benchmark("real_task_step")["results"]["headline"]
    rows.append(["HotpotQA preset step (`trace`, SmolLM2-135M): seconds, full / LoRA in float32, full / LoRA in bf16; "
                 "share outside the model",
                 f"{_num(step['full_step_seconds'], 1)} / {_num(step['lora_step_seconds'], 1)}, "
                 f"{_num(step['full_bf16_step_seconds'], 1)} / {_num(step['lora_bf16_step_seconds'], 1)}; "
                 f"{_num(100 * step['outside_the_model_share'], 1)} %", "measured; < 10 %",
                 _met(step["targets"]["outside_the_model_under_10pct"])])
    dtype_results = ctx.benchmark("step_dtype")["results"]
    dtype = dtype_results["headline"]
    cpu = dtype_results.get("cpu_model", "this CPU")
    rows.append([f"default step, float32 / bf16 seconds ({cpu}; native bf16 instructions: {dtype['cpu_bf16']})",
                 f"{_num(dtype['step_seconds_float32'], 2)} s / {_num(dtype['step_seconds_bfloat16'], 2)} s = "
                 f"{_num(dtype['float32_over_bfloat16_step'], 2)}", ">= 1.5",
                 _met(dtype["targets"]["bfloat16_step_at_least_1.5x_faster"])])
    return _table(["measure", "result", "target", ""], rows, ["---", "---:", "---", "---"])


BENCHMARK_NAMES = ("allocation_quality", "allocation_objectives", "solver_speed", "rollout_engine", "orchestration",
                   "lora_update", "real_task_step", "step_dtype")


def benchmark_runs_table(ctx: Context) -> str:
    """Where each benchmark report was measured: commit, threads, cores, machine load, wall time."""
    rows = []
    for name in BENCHMARK_NAMES:
        report = ctx.benchmark(name)
        machine, settings = report.get("machine", {}), report.get("settings", {})
        threads = settings.get("torch_threads", settings.get("threads"))
        rows.append([f"[`{name}`]({ctx.link(BENCHMARKS / f'{name}.json')})", f"`{report.get('git_commit', '')[:7]}`",
                     "no torch" if threads is None else str(threads), machine.get("omp_num_threads") or "unset",
                     str(machine.get("cpu_count", "")), _num(machine.get("load_average_1m"), 2),
                     _num(report.get("duration_s"), 0)])
    return _table(["report", "commit", "torch threads", "OMP_NUM_THREADS", "CPU cores", "load (1 min) at start",
                   "seconds"], rows, ["---", "---", "---:", "---:", "---:", "---:", "---:"])


_PREDICTORS = ("oracle", "noisy_0.5", "noisy_1.0", "history", "learned")


def allocation_quality_table(ctx: Context) -> str:
    """Effective ratio of every arm on the simulator, per predictor (mean and sd over seeds)."""
    summary = ctx.benchmark("allocation_quality")["results"]["summary"]
    rows = []
    for arm, by_pred in summary.items():
        cells = []
        for pred in ("none",) + _PREDICTORS:
            stat = by_pred.get(pred, {}).get("metrics", {}).get("effective_ratio")
            cells.append("" if stat is None else f"{_num(stat['mean'])} ({_num(stat['std'])})")
        rows.append([f"`{arm}`"] + cells)
    return _table(["arm", "no predictor"] + list(_PREDICTORS), rows)


def allocation_objectives_table(ctx: Context) -> str:
    """Effective ratio of ``allocation.root_objective: leaves`` minus ``groups``, paired over seeds."""
    diffs = ctx.benchmark("allocation_objectives")["results"]["headline"]["effective_ratio_leaves_minus_groups"]
    rows = []
    for name, iv in diffs.items():
        arm, pred, m_min = name.split("/")
        rows.append([f"`{arm}`", pred, m_min.split("=")[1], _diff({**iv, "real": iv["low"] > 0 or iv["high"] < 0})])
    return _table(["arm", "predictor", "m_min", "leaves minus groups, effective ratio (95 % t-interval)"], rows,
                  ["---", "---", "---:", "---:"])


WARMUP_SWEEP = RUNS / "warmup-sweep-e9ec8a3" / "sweep.json"  # scripts.warmup_sweep at that commit


def warmup_sweep_table(ctx: Context) -> str:
    """``scripts.warmup_sweep``: per SFT checkpoint what it measures before RL, and ``grpo``'s gain from it."""
    from scripts.warmup_sweep import markdown_table

    sweep = json.loads((ctx.root / WARMUP_SWEEP).read_text())
    return (markdown_table(sweep["rows"]) + "\n\n"
            f"`grpo` for {sweep['rl_steps']} steps at training seed {sweep['seed']} from each checkpoint of one "
            f"warmup ({sweep['params']}); held-out columns on the same {sweep['held_out_questions']} questions; gain in held-out greedy "
            f"with its paired standard error over the questions. Measured at `{sweep['commit']}`. From "
            f"[`{WARMUP_SWEEP.as_posix()}`]({ctx.link(WARMUP_SWEEP)}).")


LEARNING_STUDY = RUNS / "learning-study-e794799" / "study.json"  # scripts.learning_study, library code of e794799
PRECISION_STUDY = RUNS / "precision-study-8f9027e" / "study.json"  # scripts.learning_study: float32 against bf16


def _study_table(ctx: Context, path: Path) -> str:
    """A ``scripts.learning_study`` summary: per candidate setting, the held-out gain over the warmup, its
    difference from the reference candidate and the probe's gain over the frozen policy."""
    from scripts.learning_study import markdown

    study = json.loads((ctx.root / path).read_text())
    reference = study["order"][0]
    avgk = (f", avg@{study['eval_samples']} {study['warmup_avgk']:.3f}" if study.get("eval_samples") else "")
    rule = ("the paired bootstrap over questions and seeds and the t-interval over seeds, `*` the one that decides; "
            "*real* only when both exclude 0; the margin verdict against "
            f"±{study['margin']} reads both" if "margin" in study else
            "95 % paired bootstrap over questions and seeds; *real* only when it excludes 0")
    return (markdown(study["summary"], reference, study["order"]) + "\n\n"
            f"`{study['arm']}` for {study['rl_steps']} steps at training seeds {', '.join(map(str, study['seeds']))} "
            f"from one warmup policy (held-out greedy {study['warmup_held_out']:.3f}{avgk} on the same "
            f"{study['held_out_questions']} questions), {study['params']} with each candidate's overrides. Intervals: "
            f"{rule}. Probe: mean success of "
            f"{study['probe_samples']} sampled rollouts on each of the first {study['probe_prompts']} training prompts, "
            f"after minus before, same seeds. On {study['machine']['cpu']} ({study['machine']['cores']} cores); the "
            f"summary written at `{study['commit'][:7]}`, the runs' commit and times in the folder's README.md. From "
            f"[`{path.as_posix()}`]({ctx.link(path)}).")


def learning_study_table(ctx: Context) -> str:
    """``scripts.learning_study`` over the candidate settings of ``grpo`` (reports/runs/learning-study-e794799)."""
    return _study_table(ctx, LEARNING_STUDY)


def precision_study_table(ctx: Context) -> str:
    """``scripts.learning_study`` of ``grpo`` in float32 against bf16 (reports/runs/precision-study-8f9027e)."""
    return _study_table(ctx, PRECISION_STUDY)


def step_dtype_table(ctx: Context) -> str:
    """The default step in float32 and bf16 (medians of its timers), the products under it, a stage's start-up."""
    res = ctx.benchmark("step_dtype")["results"]
    summary = res["default_step"]["summary"]
    parts = (("step", "time/step"), ("rollouts", "time/rollout"), ("expansion", "time/expand"),
             ("update", "time/update"), ("predictor", "time/predict"))
    rows = [[label] + [f"{_num(summary[d].get(key), 2)} s" for d in ("float32", "bfloat16")]
            + [_num(summary["float32_over_bfloat16"].get(key), 2)] for label, key in parts]
    rate = lambda m, d: _num(m[f"{d}_gflops"], 1)  # noqa: E731
    rows += [[f"matmul {' x '.join(f'{v:,}' for v in m['shape'])}: GFLOP/s", rate(m, "float32"), rate(m, "bfloat16"),
              _num(m["ratio"], 3)] for m in res["matmul"]]  # bf16 / float32 GFLOP/s = float32 / bf16 seconds
    limits = res.get("roofline")
    if limits:  # reports written before the roofline have none
        peaks = res["matmul_peak"]
        rows.append(["matmul peak (best of large square products): GFLOP/s", _num(peaks["float32"]["gflops"], 1),
                     _num(peaks["bfloat16"]["gflops"], 1),
                     _num(peaks["bfloat16"]["gflops"] / peaks["float32"]["gflops"], 3)])
        for phase in ("rollout", "expand", "update", "eval"):
            if all(phase in limits[d]["phases"] for d in ("float32", "bfloat16")):
                cells = [limits[d]["phases"][phase] for d in ("float32", "bfloat16")]
                rows.append([f"{phase}: achieved GFLOP/s (share of the dtype's peak)"]
                            + [f"{_num(c['gflops'], 2)} ({_num(100 * c['share_of_peak'], 2)} %)" for c in cells] + [""])
        rows.append(["step / its FLOPs at the peak (share outside model compute)"]
                    + [f"{_num(limits[d]['step_over_compute_bound'], 0)}x "
                       f"({_num(100 * limits[d]['outside_model_compute_share'], 1)} %)" for d in ("float32", "bfloat16")]
                    + [""])
    flags = ", ".join(f"`{k}` {'yes' if v else 'no'}" for k, v in res["cpu_bf16_flags"].items())
    if "cpu_model" in res:
        flags = f"{res['cpu_model']}: {flags}; `policy.dtype: auto` runs {res['auto_precision']} here"
    startup = res["startup_seconds"]
    imports = "; ".join(f"{k.removeprefix('import ')} {_num(v, 1)} s" for k, v in startup.items()
                        if k.startswith("import ") and k != "import python")
    return (_table(["default step (median of steps 1..)", "float32", "bf16", "float32 / bf16 seconds"], rows) + "\n\n"
            f"CPU: {flags}. Stage start-up, each in a fresh interpreter (median): {imports}; an MLflow run "
            f"opened, logged and closed on an existing SQLite store {_num(startup['mlflow run on an existing SQLite store'], 1)} s "
            f"(on a new one {_num(startup['mlflow run on a new SQLite store'], 1)} s).")


def real_task_step_table(ctx: Context) -> str:
    """One HotpotQA preset step per trainer: step, rollout and update seconds (medians), generated tokens."""
    res = ctx.benchmark("real_task_step")["results"]
    labels = {"full": "full fine-tuning, float32", "lora": "LoRA, float32", "full_bf16": "full fine-tuning, bf16",
              "lora_bf16": "LoRA, bf16"}
    rows = []
    for key, label in labels.items():
        sec = res[key]["seconds_median"]
        tokens = res[key].get("generated_tokens") or []
        rows.append([label, _num(sec["time/step"], 1), _num(sec["time/rollout"], 1), _num(sec["time/update"], 1),
                     " / ".join(_num(t, 0) for t in tokens)])
    table = _table(["trainer", "step s", "rollouts s", "update s", "generated tokens (each repeat)"], rows)
    prof = res["profile_full_step"]
    parts = "; ".join(f"{name} {_num(100 * share, 1)} %" for name, share in prof["share"].items())
    return table + f"\n\nOne profiled full float32 step ({_num(prof['step_seconds'], 1)} s): {parts}."


# ---- the data files of the real tasks (code, not a report: generated so it cannot drift) ------------------
def data_files_table(ctx: Context) -> str:
    """``trace.data_paths.DEFAULT_FILES``: the files each real task reads when ``task.files.train_path`` is unset."""
    from trace.data_paths import DEFAULT_FILES, FILE_KEYS

    rows = [[f"`{task}`"] + [f"`{files[k]}`" if k in files else "" for k in FILE_KEYS]
            for task, files in DEFAULT_FILES.items()]
    return _table(["`task.name`"] + [f"`{k}`" for k in FILE_KEYS], rows, ["---"] * (len(FILE_KEYS) + 1))
