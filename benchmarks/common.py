"""What every benchmark shares: command line, timing, summary statistics, the JSON report and the figure.

Each benchmark is a module with ``main(argv) -> dict``: it parses ``--quick`` (a tiny setting for smoke
tests) and ``--out DIR`` (default ``reports/benchmarks``), measures, and writes ``<name>.json`` and
``<name>.png`` there. Reports carry the settings they ran with and a description of the machine (cores, CPU
model and flags, memory, load: ``machine_info``), since timings and some float results depend on both; every
ratio a target is judged by is measured side by side within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
REPORT_DIR = REPO_ROOT / "reports" / "benchmarks"


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options every benchmark takes: ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny setting (seconds): a smoke test, not a result")
    parser.add_argument("--out", default=str(REPORT_DIR), help=f"folder for the JSON and PNG (default {REPORT_DIR})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared machine, 2 OpenMP threads that wait "
                             "on each other's busy cores run many times slower than one)")
    return parser.parse_args(argv)


@contextmanager
def torch_threads(num_threads: int) -> Iterator[int]:
    """Run the block with torch's intra-op thread count set to ``num_threads``; restore it afterwards.

    Yields:
        The thread count in effect.

    Raises:
        ValueError: ``num_threads < 1``.
    """
    import torch

    if num_threads < 1:
        raise ValueError(f"--threads={num_threads} must be >= 1")
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, list[float], Any]:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls.

    Returns:
        ``(median_seconds, every_timing_seconds, result_of_the_last_call)``.

    Raises:
        ValueError: ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def mean_std(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "std", "n"}`` of the finite ``values``; ``std`` is the sample standard deviation (0 for one
    value); NaN and infinite values are left out (``n`` counts the rest)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return {"mean": statistics.fmean(vals), "std": std, "n": len(vals)}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")
"""The ``/proc/cpuinfo`` flags a report records: float results (the learned predictor's fit, the warmup) differ
between CPUs with and without AVX-512, and bf16 is fast only with ``avx512_bf16`` or ``amx_bf16``."""


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_record(cpuinfo: str | None = None, meminfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name, which of ``CPU_FLAGS`` it lists, and the memory.

    Args:
        cpuinfo: text of ``/proc/cpuinfo`` (read when None).
        meminfo: text of ``/proc/meminfo`` (read when None).

    Returns:
        ``{"cpu_model", "cpu_flags", "cpu_flags_checked", "memory_gib"}``: ``cpu_model`` from the first
        ``model name`` line (else ``platform.processor()`` or ``"unknown"``); ``cpu_flags`` the ``CPU_FLAGS`` on
        the first ``flags`` line, in ``CPU_FLAGS`` order (``[]``: none of them); ``memory_gib`` ``MemTotal`` in
        GiB (None where unreadable). Without a ``flags`` line, ``cpu_flags`` is None and ``cpu_flags_note`` says
        why.
    """
    cpuinfo = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    meminfo = _read("/proc/meminfo") if meminfo is None else meminfo
    model, flags = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if model is None and key.strip() == "model name":
            model = value.strip()
        elif flags is None and key.strip() == "flags":
            flags = set(value.split())
    record: dict[str, Any] = {"cpu_model": model or platform.processor() or "unknown",
                              "cpu_flags": None if flags is None else [f for f in CPU_FLAGS if f in flags],
                              "cpu_flags_checked": list(CPU_FLAGS), "memory_gib": None}
    if flags is None:
        record["cpu_flags_note"] = "no flags line in /proc/cpuinfo: flags not recorded"
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MemTotal" and value.split() and value.split()[0].isdigit():
            kib = int(value.split()[0])  # /proc/meminfo's "kB" are KiB
            record["memory_gib"] = round(kib / 2**20, 1)
            break
    return record


def machine_info() -> dict[str, Any]:
    """Python, platform, CPU count, model and flags (``cpu_record``), memory and load, and library versions
    that set the speed of what is timed."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpu_count": os.cpu_count(), **cpu_record(),
                            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    try:
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    for name in ("torch", "transformers"):
        module = __import__("sys").modules.get(name)
        if module is not None:
            info[name] = module.__version__
    return info


def _clean(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, numpy scalars and arrays become Python values."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "tolist"):
        return _clean(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def write_report(name: str, out_dir: str | Path, settings: dict, results: dict, *, quick: bool,
                 started: float) -> Path:
    """Write ``<out_dir>/<name>.json``: benchmark name, settings, results, machine, commit and duration.

    Returns:
        The JSON path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": name, "quick": bool(quick), "settings": settings, "results": results,
              "machine": machine_info(), "git_commit": git_commit(),
              "duration_s": round(time.perf_counter() - started, 2)}
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(report), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def figure_path(name: str, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}.png"


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
