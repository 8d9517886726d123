"""``make run-paper``: one DVC experiment per warmup seed, up to ``--jobs`` of them side by side, then pooled.

Each warmup seed's experiment runs in its own clone of the committed ``HEAD`` under ``.paper/w<seed>/`` (ignored by
git and DVC), with the repository's ``.venv`` linked in and the repository's DVC cache as its cache, so stages
already run (any warmup's, from another clone or the repository) come from the run-cache, and a killed run
resumes from its clone's checkpoints when started again. Uncommitted changes are not run: commit them first. All of them use one local Prefect server. Each job gets
``cpus // jobs`` torch threads (at least one); its log is ``.paper/w<seed>.log``. After every experiment finished,
``scripts.warmup_study collect`` copies each into ``--out``/w<seed>/ and ``scripts.warmup_study pool`` writes the
pooled study there (docs/experiments.md, "What the warmup moves").

Usage:
    python -m scripts.run_paper [--warmup-seeds 0 1] [--jobs 2] [--port 4200] [--out reports/paper] -- -S KEY=VALUE ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
POLL_S = 5.0


def workspace(seed: int, root: Path = REPO_ROOT) -> Path:
    """The workspace of warmup ``seed``: a git clone of the repository at its ``HEAD`` (a plain clone, since DVC
    experiments need a repository of their own), made on first use and moved to ``HEAD`` when the repository moved
    (its checkpoints and outputs stay; DVC reruns what changed), with the repository's ``.venv`` linked in and the
    repository's DVC cache as its cache.

    Raises:
        subprocess.CalledProcessError: a git or dvc command failed (its output is kept on the exception).
    """
    path = root / ".paper" / f"w{seed}"
    head = _git(root, "rev-parse", "HEAD")
    if not (path / ".git").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _git(root, "clone", "--quiet", "--no-checkout", str(root), str(path))
    elif _git(path, "rev-parse", "HEAD") != head:
        _git(path, "fetch", "--quiet", "origin")
    if _git(path, "rev-parse", "HEAD") != head or not (path / "dvc.yaml").exists():
        _git(path, "checkout", "--quiet", "--force", "--detach", head)
    venv = path / ".venv"
    if not venv.exists() and (root / ".venv").exists():
        venv.symlink_to(root / ".venv", target_is_directory=True)
    subprocess.run([_tool(root, "dvc"), "config", "--local", "cache.dir", str(root / ".dvc" / "cache")], cwd=path,
                   check=True, capture_output=True, text=True)
    return path


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise subprocess.CalledProcessError(out.returncode, ["git", *args], out.stdout, out.stderr)
    return out.stdout.strip()


def _tool(root: Path, name: str) -> str:
    found = root / ".venv" / "bin" / name
    return str(found) if found.exists() else (shutil.which(name) or name)


def job_env(path: Path, threads: int, api_url: str | None, base: dict | None = None) -> dict[str, str]:
    """The environment of one warmup's experiment: its clone on ``PYTHONPATH`` and ``PATH``, ``threads`` torch
    threads, the shared Prefect server."""
    env = dict(os.environ if base is None else base)
    env.update({"PYTHONPATH": str(path), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "PATH": f"{path / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"})
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def experiment_args(seed: int, overrides: Sequence[str]) -> list[str]:
    """``dvc exp run``'s ``-S`` options of one warmup: ``overrides``, then ``warmup.seed`` (the last of a key wins,
    so an override cannot move a workspace to another warmup)."""
    return [*overrides, "-S", f"warmup.seed={seed}"]


def run(seeds: Sequence[int], overrides: Sequence[str], jobs: int, port: int, out: Path, root: Path = REPO_ROOT) -> int:
    """Run every warmup's experiment, ``jobs`` at a time, then collect and pool them into ``out``; 0 when every
    step succeeded, else the first failing exit status (the logs are named)."""
    python = _tool(root, "python")
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    paths = {seed: workspace(seed, root) for seed in seeds}
    for seed, path in paths.items():  # a bad override fails here, before any stage runs
        check = subprocess.run([python, "-m", "flows.check_params", "--out", str(path / "data" / "params_checked"),
                                *experiment_args(seed, overrides)], cwd=path, env=job_env(path, 1, None))
        if check.returncode:
            return check.returncode
    server = subprocess.run([python, "-m", "flows.server", "ensure", "--port", str(port)], cwd=root,
                            capture_output=True, text=True, env=job_env(root, 1, None))
    if server.returncode:
        print(server.stderr, file=sys.stderr)
        return server.returncode
    api_url = server.stdout.strip().splitlines()[-1]
    try:
        status = _run_jobs(paths, overrides, jobs, threads, api_url, root)
    finally:
        subprocess.run([python, "-m", "flows.server", "stop"], cwd=root, capture_output=True, env=job_env(root, 1, None))
    if status:
        return status
    for seed, path in paths.items():
        collected = subprocess.run([python, "-m", "scripts.warmup_study", "collect", "--warmup-seed", str(seed),
                                    "--out", str(out.resolve())], cwd=path, env=job_env(path, 1, None))
        if collected.returncode:
            return collected.returncode
    return subprocess.run([python, "-m", "scripts.warmup_study", "pool", "--out", str(out.resolve())], cwd=root,
                          env=job_env(root, 1, None)).returncode


def _run_jobs(paths: dict[int, Path], overrides: Sequence[str], jobs: int, threads: int, api_url: str,
              root: Path) -> int:
    """Start the experiments ``jobs`` at a time; after a failure start no more and wait for those running."""
    pending, running, status = list(paths), {}, 0
    while running or (pending and not status):
        while pending and not status and len(running) < jobs:
            seed = pending.pop(0)
            log = open(root / ".paper" / f"w{seed}.log", "ab")
            cmd = [_tool(root, "dvc"), "exp", "run", *experiment_args(seed, overrides)]
            print(f"warmup {seed}: {' '.join(cmd)} (log .paper/w{seed}.log, {threads} thread(s))", flush=True)
            running[seed] = (subprocess.Popen(cmd, cwd=paths[seed], env=job_env(paths[seed], threads, api_url),
                                              stdout=log, stderr=subprocess.STDOUT), log)
        time.sleep(POLL_S)
        for seed, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[seed]
            print(f"warmup {seed}: exit {proc.returncode}", flush=True)
            if proc.returncode and not status:
                status = proc.returncode
                print(f"warmup {seed} failed: see .paper/w{seed}.log", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=None, help="experiments at once (default: one per CPU core, "
                        "at most one per warmup)")
    parser.add_argument("--port", type=int, default=4200, help="the local Prefect server's port")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "paper")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: dvc exp run's -S options")
    args = parser.parse_args(argv)
    overrides = [a for a in args.overrides if a != "--"]
    jobs = args.jobs or max(1, min(len(args.warmup_seeds), os.cpu_count() or 1))
    return run(args.warmup_seeds, overrides, jobs, args.port, args.out)


if __name__ == "__main__":
    sys.exit(main())
