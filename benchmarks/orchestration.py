"""Orchestration overhead: the share of a default training step spent outside model compute, and no-op DVC.

A default step: ``params.yaml`` as committed (kgqa, the tiny default policy, the predictor it names, 128
trajectories per step), arm ``trace``, run by ``trace.training.loop.Trainer.step`` with its own ``time/*`` metrics
and the predictor's own split of its refit (``predictor/feature_seconds``, ``predictor/fit_seconds``). The
policy is the default tiny model after a short SFT on solver demonstrations (``run_warmup`` with
``sft_steps`` steps), enough for multi-turn ReAct rollouts; it is cached under ``data/benchmarks/``
(ignored by git) because SFT takes minutes on a busy CPU. The predictor starts untrained (the step refits it
on its sliding window, as in training); step 0 also loads the predictor's encoder where it has one and is
reported apart. Torch runs ``--threads`` intra-op threads (default 1). Around each step:
- MLflow: the step's metrics logged with ``trace.tracking.StageRun.log_metrics`` (one ``log_batch``) to a
  SQLite store in a temporary folder, timed;
- Parquet: ``time/write`` (the step's trees) plus a timed read of the predictor's window
  (``Trainer.window_trees``, which the step also does inside ``time/predictor_fit``);
- Prefect: a no-op task called inside a flow against a local server (``flows.server``), timed; the
  ``train`` flow runs one task per ``train.steps_per_task`` steps, so a step carries ``1 / steps_per_task``
  of it.
Model compute is ``time/rollout + time/expand + time/update`` (rollout time includes environment steps and
tree records); the predictor (``time/predict + time/predictor_fit``) and the rest of the step (planning,
advantages, metrics) are reported apart. Shares are of ``time/step + MLflow + Prefect per step``.

DVC: the repository is cloned to a temporary folder (``git clone``: committed files only),
``tests/params_tiny.yaml`` is copied over ``params.yaml``, a Prefect server is started with
``flows.server ensure``, ``dvc repro`` runs the whole tiny pipeline once (timed), then ``dvc repro`` with
nothing to do is timed ``dvc_repeats`` times; the server is stopped at the end.

``--quick``: the tiny params, a random-weight policy, 2 steps, the ``history`` predictor; no Prefect and
no DVC (they need a server and minutes).

Usage: ``python -m benchmarks.orchestration [--quick]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common import REPO_ROOT, figure_path, parse_args, pyplot, torch_threads, write_report

NAME = "orchestration"
CACHE_DIR = REPO_ROOT / "data" / "benchmarks"
MODEL_KEYS = ("time/rollout", "time/expand", "time/update")
PREDICTOR_KEYS = ("time/predict", "time/predictor_fit")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stage_env(repo: Path) -> dict[str, str]:
    """Environment of the pipeline's processes in ``repo``: the current interpreter's folder first on PATH."""
    env = os.environ.copy()
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": str(repo), "PREFECT_HOME": str(repo / ".prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING", "DO_NOT_TRACK": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"),
    })
    # a Trainer built in this process set these for its own process group (init_distributed_env); a stage
    # that inherited MASTER_PORT would try to listen on the port this process holds
    for key in ("PREFECT_API_URL", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


# ================================================================================================
# The default step
# ================================================================================================
def warm_policy(cfg: Any, env: Any, sft_steps: int, sft_batch: int, sft_lr: float, cache: bool) -> tuple[Any, dict]:
    """The default tiny policy after ``sft_steps`` SFT steps (``run_warmup``), from the cache when present."""
    from trace.training.warmup import run_warmup
    from trace.policy.model import build_tiny_policy, load_policy, save_policy

    # the sections the warm weights depend on (not the predictor's or the allocation's)
    blob = json.dumps({k: cfg.model_dump(mode="json")[k] for k in ("seed", "task", "policy", "update")}, sort_keys=True)
    key = f"policy-{hashlib.sha256(blob.encode()).hexdigest()[:12]}-sft{sft_steps}-b{sft_batch}-lr{sft_lr:g}"
    path = CACHE_DIR / key
    if cache and path.is_dir():
        return load_policy(path), {"sft_steps": sft_steps, "cached": str(path.relative_to(REPO_ROOT))}
    policy = build_tiny_policy(cfg.policy, env.vocabulary(), cfg.seed)
    info: dict = {"sft_steps": sft_steps, "cached": None}
    if sft_steps > 0:
        warm_cfg = cfg.model_copy(update={"warmup": cfg.warmup.model_copy(update={
            "max_steps": sft_steps, "batch_size": sft_batch, "lr": sft_lr, "eval_every": 10**9, "eval_prompts": 16})})
        t0 = time.perf_counter()
        result = run_warmup(policy, env, env.prompts("train"), warm_cfg, progress=False)
        info.update(sft_seconds=time.perf_counter() - t0, sampled_success=result.chosen_success)
        if cache:
            save_policy(policy, path)
            info["cached"] = str(path.relative_to(REPO_ROOT))
    # a fresh load, as the train stage reads the warmup stage's output (and no DeepSpeed engine holds it)
    tmp = Path(tempfile.mkdtemp(prefix="trace-bench-policy-"))
    try:
        save_policy(policy, tmp / "policy")
        return load_policy(tmp / "policy"), info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_steps(params: Path, num_steps: int, *, sft_steps: int, sft_batch: int, sft_lr: float, cache: bool,
                  predictor_kind: str | None = None, ablation: str = "trace") -> dict:
    """Run ``num_steps`` Trainer steps with MLflow logging; per-step ``time/*``, MLflow and Parquet timings."""
    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment
    from trace.training.loop import Trainer
    from trace.predictor import make_predictor
    from trace.tracking import stage_run

    overrides = {"predictor.kind": predictor_kind} if predictor_kind else None
    cfg = load_config(params, overrides=overrides)
    env = make_environment(cfg.task, cfg.seed, root=REPO_ROOT)
    policy, policy_info = warm_policy(cfg, env, sft_steps, sft_batch, sft_lr, cache)
    predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=cfg.seed)
    work = Path(tempfile.mkdtemp(prefix="trace-bench-orch-"))
    steps: list[dict] = []
    try:
        t0 = time.perf_counter()
        with stage_run("train", tracking_uri=f"sqlite:///{work / 'mlflow.db'}", experiment_name="benchmark",
                       params={"allocation": cfg.allocation.model_dump(mode="json")}, params_hash=cfg.params_hash(),
                       ablation=ablation) as run:
            mlflow_setup = time.perf_counter() - t0
            log_seconds: list[float] = []

            def log_metrics(metrics, step):
                start = time.perf_counter()
                run.log_metrics(metrics, step)
                log_seconds.append(time.perf_counter() - start)

            trainer = Trainer(cfg, ablation, policy=policy, env=env, train_prompts=env.prompts("train"),
                              eval_prompts=env.prompts("eval"), predictor=predictor, run_dir=work / "run",
                              log_metrics=log_metrics, progress=False)
            for step in range(num_steps):
                metrics = trainer.step(step)
                start = time.perf_counter()
                window = trainer.window_trees(step)
                read_seconds = time.perf_counter() - start
                row = {k: float(v) for k, v in metrics.items() if k.startswith("time/")}
                row.update({"step": step, "mlflow_log_seconds": log_seconds[-1], "parquet_read_window_seconds":
                            read_seconds, "window_trees": len(window), "num_metrics": len(metrics)})
                for key, value in metrics.items():  # the predictor's own split: features vs head training
                    if key.startswith("predictor/") and key.endswith("seconds"):
                        row[key] = float(value)
                for key in ("turns/mean", "tokens/generated", "rollout/trajectories", "rollout/branches",
                            "effective_ratio", "reward/mean"):
                    if key in metrics:
                        row[key] = float(metrics[key])
                steps.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"params": str(params.relative_to(REPO_ROOT) if params.is_relative_to(REPO_ROOT) else params),
            "ablation": ablation, "predictor": cfg.predictor.kind.value, "steps_per_task": cfg.train.steps_per_task,
            "train_steps": cfg.train.num_steps, "policy": policy_info, "policy_parameters": policy.num_parameters,
            "mlflow_run_setup_seconds": mlflow_setup, "steps": steps}


def shares(steps: list[dict], prefect_task_seconds: float | None, steps_per_task: int) -> dict:
    """Median seconds per component over ``steps`` and their shares of a step."""
    def median(key: str) -> float:
        values = [s.get(key, 0.0) for s in steps]
        return float(statistics.median(values)) if values else float("nan")

    step = median("time/step")
    model = float(statistics.median([sum(s.get(k, 0.0) for k in MODEL_KEYS) for s in steps]))
    predictor = float(statistics.median([sum(s.get(k, 0.0) for k in PREDICTOR_KEYS) for s in steps]))
    parquet_write = median("time/write")
    mlflow = median("mlflow_log_seconds")
    prefect = (prefect_task_seconds / steps_per_task) if prefect_task_seconds is not None else 0.0
    rest = float(statistics.median([s["time/step"] - sum(s.get(k, 0.0) for k in MODEL_KEYS + PREDICTOR_KEYS)
                                    - s.get("time/write", 0.0) - s.get("time/eval", 0.0) for s in steps]))
    total = step + mlflow + prefect
    orchestration = prefect + mlflow + parquet_write
    return {
        "step_seconds": step, "total_seconds": total, "model_seconds": model, "predictor_seconds": predictor,
        "parquet_write_seconds": parquet_write, "parquet_read_window_seconds": median("parquet_read_window_seconds"),
        "mlflow_seconds": mlflow, "prefect_seconds_per_step": prefect if prefect_task_seconds is not None else None,
        "other_seconds": rest,
        "orchestration_share": orchestration / total, "predictor_share": predictor / total,
        "model_share": model / total, "other_share": rest / total,
        "outside_model_share": (orchestration + predictor + rest) / total,
    }


# ================================================================================================
# Prefect and DVC
# ================================================================================================
def prefect_overhead(num_calls: int) -> dict:
    """Wall time of a no-op Prefect task call inside a flow, and of an empty flow run (needs PREFECT_API_URL)."""
    from prefect import flow, task
    from prefect.cache_policies import NONE

    @task(name="bench-noop", cache_policy=NONE)
    def noop(value: int) -> int:
        return value

    @flow(name="bench-task-calls")
    def task_calls(count: int) -> list[float]:
        times = []
        for i in range(count):
            start = time.perf_counter()
            noop(i)
            times.append(time.perf_counter() - start)
        return times

    @flow(name="bench-empty")
    def empty() -> None:
        return None

    empty()  # first flow run of the process: client and server warm-up
    flow_times = []
    for _ in range(3):
        start = time.perf_counter()
        empty()
        flow_times.append(time.perf_counter() - start)
    times = task_calls(num_calls)
    return {"task_call_seconds": statistics.median(times), "task_call_all_seconds": times,
            "empty_flow_run_seconds": statistics.median(flow_times)}


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - start, proc


def dvc_and_prefect(dvc_repeats: int, prefect_calls: int, timeout: float = 1800) -> dict:
    """Clone, tiny params, Prefect server; Prefect timings; full then no-op ``dvc repro`` timings."""
    work = Path(tempfile.mkdtemp(prefix="trace-bench-dvc-"))
    repo = work / "trace"
    out: dict = {}
    env = stage_env(repo)
    python = sys.executable
    server_up = False
    try:
        subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(repo)], check=True, timeout=120,
                       capture_output=True)
        shutil.copy(repo / "tests" / "params_tiny.yaml", repo / "params.yaml")
        port = _free_port()
        seconds, proc = _run([python, "-m", "flows.server", "ensure", "--port", str(port)], repo, env, 300)
        if proc.returncode != 0:
            return {"error": f"Prefect server did not start: {proc.stderr[-2000:]}"}
        server_up = True
        env["PREFECT_API_URL"] = proc.stdout.strip().splitlines()[-1]
        out["prefect_server_start_seconds"] = seconds
        # this process talks to the same server for the task timings
        for key in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_ANALYTICS_ENABLED"):
            os.environ[key] = env[key]
        out["prefect"] = prefect_overhead(prefect_calls)
        seconds, proc = _run(["dvc", "repro"], repo, env, timeout)
        out["first_repro_seconds"] = seconds
        if proc.returncode != 0:
            out["error"] = f"dvc repro failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}"
            return out
        noop_times, last = [], None
        for _ in range(dvc_repeats):
            seconds, last = _run(["dvc", "repro"], repo, env, 600)
            noop_times.append(seconds)
        out.update(noop_repro_seconds=statistics.median(noop_times), noop_repro_all_seconds=noop_times,
                   noop_repro_output=(last.stdout.strip().splitlines() or [""])[-1],
                   noop_repro_ran_nothing="up to date" in last.stdout)
        seconds, proc = _run(["dvc", "version"], repo, env, 120)
        out["dvc_version_command_seconds"] = seconds  # the floor: starting the dvc executable
    finally:
        if server_up:
            subprocess.run([python, "-m", "flows.server", "stop"], cwd=repo, env=env, capture_output=True, timeout=120)
        os.environ.pop("PREFECT_API_URL", None)
        shutil.rmtree(work, ignore_errors=True)
    return out


# ================================================================================================
# Figure and entry point
# ================================================================================================
def plot(step_share: dict, steps: list[dict], dvc: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    ax = axes[0]
    parts = [("model (rollout, expand, update)", "model_seconds"), ("predictor (score, refit)", "predictor_seconds"),
             ("other step work", "other_seconds"), ("Parquet write", "parquet_write_seconds"),
             ("MLflow log_batch", "mlflow_seconds"), ("Prefect task / step", "prefect_seconds_per_step")]
    left = 0.0
    for i, (label, key) in enumerate(parts):
        value = step_share.get(key) or 0.0
        ax.barh([0], [value], left=left, color=f"C{i}", label=f"{label}: {value:.3f} s")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("seconds per step (median over measured steps)")
    ax.set_title(f"Default step: orchestration {100 * step_share['orchestration_share']:.2f}%, "
                 f"outside model {100 * step_share['outside_model_share']:.1f}%")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
    ax = axes[1]
    labels, values = [], []
    if "noop_repro_seconds" in dvc:
        labels += ["no-op dvc repro", "dvc version"]
        values += [dvc["noop_repro_seconds"], dvc.get("dvc_version_command_seconds", 0.0)]
    if labels:
        ax.bar(labels, values, color=["C0", "C7"])
        ax.axhline(5.0, color="grey", linestyle=":", label="target 5 s")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "DVC not measured", ha="center", va="center")
    ax.set_ylabel("seconds")
    ax.set_title("DVC with nothing to do")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; returns the results (also written to ``--out``)."""
    args = parse_args(__doc__.splitlines()[0], argv)
    with torch_threads(args.threads) as threads:
        return run(args, threads)


def run(args: Any, threads: int) -> dict:
    """The measurements of ``main`` with torch's thread count already set to ``threads``."""
    started = time.perf_counter()
    if args.quick:
        settings = {"params": REPO_ROOT / "tests" / "params_tiny.yaml", "steps": 2, "sft_steps": 0,
                    "predictor": "history", "dvc_repeats": 0, "prefect_calls": 0, "cache": False}
    else:
        settings = {"params": REPO_ROOT / "params.yaml", "steps": 5, "sft_steps": 80, "predictor": None,
                    "dvc_repeats": 3, "prefect_calls": 20, "cache": True}
    settings.update(sft_batch=16, sft_lr=3e-3, torch_threads=threads)
    default = default_steps(settings["params"], settings["steps"], sft_steps=settings["sft_steps"],
                            sft_batch=settings["sft_batch"], sft_lr=settings["sft_lr"], cache=settings["cache"],
                            predictor_kind=settings["predictor"])
    dvc = dvc_and_prefect(settings["dvc_repeats"], settings["prefect_calls"]) if settings["dvc_repeats"] else \
        {"skipped": "--quick"}
    prefect_task = dvc.get("prefect", {}).get("task_call_seconds")
    measured = default["steps"][1:] if len(default["steps"]) > 1 else default["steps"]
    step_share = shares(measured, prefect_task, default["steps_per_task"])
    headline = {
        "orchestration_share_of_step": step_share["orchestration_share"],
        "outside_model_share_of_step": step_share["outside_model_share"],
        "predictor_share_of_step": step_share["predictor_share"],
        "step_seconds": step_share["total_seconds"],
        "prefect_task_call_seconds": prefect_task,
        "mlflow_log_batch_seconds": step_share["mlflow_seconds"],
        "noop_dvc_repro_seconds": dvc.get("noop_repro_seconds"),
        "targets": {"orchestration_under_5pct": bool(step_share["orchestration_share"] < 0.05),
                    "noop_dvc_repro_under_5s": (None if "noop_repro_seconds" not in dvc
                                                else bool(dvc["noop_repro_seconds"] < 5.0))},
    }
    settings["params"] = str(Path(settings["params"]).relative_to(REPO_ROOT))
    results = {"headline": headline, "step_breakdown": step_share, "default_step": default,
               "first_step_excluded": default["steps"][0] if len(default["steps"]) > 1 else None, "dvc": dvc}
    plot(step_share, default["steps"], dvc, figure_path(NAME, args.out))
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


if __name__ == "__main__":
    main()
