"""The whole pipeline as one Prefect flow, run now or served on a cron schedule.

The flow runs ``dvc repro`` (or ``dvc exp run -S key=value ...`` with overrides), so DVC's cache decides
what reruns and a scheduled run that finds nothing changed does no work. Prefect owns retries, logs and
schedules. The params with the overrides are validated first: a bad value stops here, before DVC writes
it into params.yaml.

Usage:
    python -m flows.pipeline run [-S train.num_steps=100 ...]
    python -m flows.pipeline serve --cron "0 3 * * *" [-S ...]   # needs a Prefect server (make serve)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.common import REPO_ROOT, setup_process_env
from trace.errors import UserError, user_errors


def _dvc() -> str:
    local = Path(sys.executable).with_name("dvc")
    return str(local) if local.exists() else (shutil.which("dvc") or "dvc")


def dvc_command(overrides: list[str] | None = None, targets: list[str] | None = None) -> list[str]:
    """``dvc repro [targets]``, or ``dvc exp run -S k=v ... [targets]`` when params are overridden."""
    if overrides:
        cmd = [_dvc(), "exp", "run"]
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} must be KEY=VALUE, e.g. train.num_steps=100")
            cmd += ["-S", item]
    else:
        cmd = [_dvc(), "repro"]
    return cmd + list(targets or [])


class StageFailedError(UserError):
    """``dvc repro`` / ``dvc exp run`` exited non-zero; the failing stage printed its own message before."""


@task(name="dvc-repro", cache_policy=NONE, retries=1, retry_delay_seconds=10)
def run_dvc(cmd: list[str]) -> int:
    """Run the DVC command in the repository.

    Raises:
        StageFailedError: it exited non-zero (names the command and status; the stage's error is above it).
    """
    env = os.environ.copy()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    status = subprocess.run(cmd, cwd=REPO_ROOT, env=env).returncode
    if status:
        raise StageFailedError(f"`dvc {' '.join(cmd[1:])}` exited with status {status}: the failing stage printed "
                               "why above; fix that and run again (stages that finished are cached)")
    return 0


@flow(name="trace-pipeline", log_prints=False)
def pipeline_flow(overrides: list[str] | None = None, targets: list[str] | None = None) -> int:
    """Reproduce the DVC pipeline (every stage whose inputs changed)."""
    cmd = dvc_command(overrides, targets)
    print("running:", " ".join(cmd[1:]))
    return run_dvc(cmd)


def main(argv: list[str] | None = None) -> None:
    setup_process_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the pipeline now")
    serve_p = sub.add_parser("serve", help="serve the pipeline on a cron schedule (blocks)")
    serve_p.add_argument("--cron", required=True, help='cron expression, e.g. "0 3 * * *"')
    serve_p.add_argument("--name", default="trace-nightly", help="deployment name")
    for p in (run_p, serve_p):
        p.add_argument("-S", "--set-param", action="append", default=[], dest="overrides",
                       help="param override KEY=VALUE (repeatable), as dvc exp run -S")
        p.add_argument("targets", nargs="*", help="DVC stages to reproduce (default: all)")
    args = parser.parse_args(argv)
    with user_errors():
        _run_or_serve(args)


def _run_or_serve(args: argparse.Namespace) -> None:
    from flows.check_params import check_params, parse_overrides

    problem = check_params(REPO_ROOT / "params.yaml", parse_overrides(args.overrides), undo_hint=False)
    if problem:  # before dvc writes the overrides into params.yaml
        raise SystemExit(problem)
    if args.command == "run":
        from flows.prefect_runs import owned_flow_runs

        with owned_flow_runs():  # flow runs of killed pipelines end Crashed; this one is tagged with its process
            pipeline_flow(args.overrides, args.targets)
    else:
        if not os.environ.get("PREFECT_API_URL"):
            raise SystemExit("schedules need a running Prefect server: start one with "
                             "`python -m flows.server ensure` and export PREFECT_API_URL (or use `make serve`)")
        pipeline_flow.serve(name=args.name, cron=args.cron,
                            parameters={"overrides": args.overrides, "targets": args.targets})


if __name__ == "__main__":
    main()
