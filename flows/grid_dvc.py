"""Git and DVC in one checkout of the grid (``flows.grid``): commands, the commit, params, the remote, the run-cache.

A grid's coordinator and its workers are checkouts of one commit. What they share travels through git (the
code), the job's parameters (params.yaml and the pointer file dvc.lock) and the default DVC remote (stage
outputs and run-cache entries, with the files those entries name).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

from trace.errors import UserError

K = TypeVar("K")
# the last line of a Python traceback: "ValueError: ...", "trace.tree.RewardError: ...", under a launcher
# "[rank0]: ValueError: ..."
_EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b: ")
# written by every run, so they differ between checkouts of one commit without changing what a job computes
RUN_WRITTEN = ("params.yaml", "dvc.lock", "metrics/", "reports/")
TAIL_LINES = 40


class GridError(UserError):
    """The grid cannot start or finish: the message says what is missing and how to provide it."""


# ---- processes ------------------------------------------------------------------------------------------
def executable(name: str) -> str:
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else (shutil.which(name) or name)


def command_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a DVC command in checkout ``root``: this one without Prefect's per-run variables
    (``PREFECT__*``: a stage's own flows are runs of their own), this interpreter's folder first on PATH (the
    stages run ``python -m ...``), ``root`` on PYTHONPATH (the ``trace`` package over the standard library's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT__") and k != "DVC_ROOT"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(root)
    env.update(extra or {})
    return env


def run_command(cmd: list[str], root: Path, env: dict[str, str], echo: Callable[[str], None] | None = print,
                ) -> tuple[int, list[str]]:
    """Run ``cmd`` in ``root``, passing each output line to ``echo``; returns the exit status and the last
    ``TAIL_LINES`` lines (standard error merged into standard output)."""
    tail: list[str] = []
    with subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if echo is not None:
                echo(line)
            tail = (tail + [line])[-TAIL_LINES:]
    return proc.returncode, tail


def dvc(root: Path, env: dict[str, str], *args: str, echo: Callable[[str], None] | None = print) -> list[str]:
    """Run ``dvc <args>`` in ``root``; returns its last output lines.

    Raises:
        GridError: it exited non-zero (the command and its last lines).
    """
    status, tail = run_command([executable("dvc"), *args], root, env, echo)
    if status:
        raise GridError(f"`dvc {' '.join(args)}` in {root} exited with status {status}:\n" + "\n".join(tail[-15:]))
    return tail


def failure_line(tail: list[str]) -> str:
    """The line that says why a stage failed: its ``error:`` line (an expected error, ``trace.errors``), else the
    last exception line of a traceback (``ValueError: ...``), else DVC's ``ERROR:`` line, else the last
    non-empty line."""
    lines = [line.strip() for line in tail if line.strip()]
    expected = [line for line in lines if line.startswith("error:")]
    if expected:
        return expected[0]
    raised = [line for line in lines if _EXCEPTION_LINE.match(line)]
    if raised:
        return re.sub(r"^\[rank\d+\]:\s*", "", raised[-1])
    dvc_error = [line for line in lines if line.startswith("ERROR:")]
    if dvc_error:
        return dvc_error[0]
    return lines[-1] if lines else "(no output)"


# ---- git --------------------------------------------------------------------------------------------------
def git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if out.returncode:
        raise GridError(f"`git {' '.join(args)}` in {root} failed: {out.stderr.strip()}")
    return out.stdout


def head_commit(root: Path) -> str:
    """The commit checked out in ``root``.

    Raises:
        GridError: ``root`` is no git checkout with a commit (workers run a commit).
    """
    try:
        return git(root, "rev-parse", "HEAD").strip()
    except GridError as err:
        raise GridError(f"{root} has no commit ({err}); the workers run a commit: commit the code first") from None


def uncommitted_code(root: Path) -> list[str]:
    """Files that differ from the commit, untracked ones (not git-ignored) included, apart from what runs write
    (``RUN_WRITTEN``): a checkout of the commit elsewhere would not have them."""
    lines = git(root, "status", "--porcelain").splitlines()
    paths = [line[3:].split(" -> ")[-1] for line in lines if line.strip()]
    return [p for p in paths if not any(p == w or p.startswith(w) for w in RUN_WRITTEN)]


# ---- params -------------------------------------------------------------------------------------------------
def grid_params(root: Path, overrides: list[str], commit: str) -> str:
    """The params.yaml text the grid runs: the workspace's with the ``-S`` overrides applied (as ``dvc exp run
    -S`` does), written back to ``root/params.yaml``.

    Raises:
        GridError: an override is invalid, or params.yaml holds changes that are neither in the commit nor among
            the overrides (workers would not see them).
    """
    import yaml
    from dvc.utils.hydra import apply_overrides

    from flows.check_params import check_params, parse_overrides

    path = root / "params.yaml"
    problem = check_params(path, parse_overrides(overrides), undo_hint=False)  # reads +key=value as key=value
    if problem:
        raise GridError(problem)
    committed = git(root, "show", f"{commit}:params.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        head, work = Path(tmp) / "head.yaml", Path(tmp) / "params.yaml"
        head.write_text(committed)
        shutil.copyfile(path, work)
        if overrides:
            from dvc.exceptions import DvcException

            # +key=value adds a key params.yaml lacks; the same command again finds it there, so apply it as
            # hydra's ++key=value (add or replace): the same params either way
            again = [f"+{item}" if item.startswith("+") and not item.startswith("++") else item
                     for item in overrides]
            try:
                apply_overrides(head, again)
                apply_overrides(work, again)
            except DvcException as err:
                cause = err.__cause__.__cause__ if err.__cause__ is not None else None
                raise GridError(f"-S {' -S '.join(overrides)}: {cause or err}".rstrip() + " (as for `dvc exp run "
                                "-S`: a key params.yaml lacks is added with +key=value)") from None
        if yaml.safe_load(head.read_text()) != yaml.safe_load(work.read_text()):
            raise GridError(f"{path} has changes that are neither in commit {commit[:12]} (which the workers run) "
                            "nor among the -S overrides: commit them, pass them as -S key=value, or drop them "
                            "with `git checkout params.yaml` (an earlier grid's or experiment's -S stays in it)")
        text = work.read_text()
    if overrides:
        path.write_text(text)
    return text


# ---- DVC remote and run-cache ----------------------------------------------------------------------------
def check_remote(root: Path) -> str:
    """The default DVC remote's URL, once it answers.

    Raises:
        GridError: no default remote, or it cannot be reached (the error says which and how to fix it).
    """
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        name = repo.config["core"].get("remote")
        if not name:
            raise GridError("the grid moves stage results through a DVC remote and this repository has no default "
                            "one: `dvc remote add -d storage s3://bucket/trace` (or ssh://, gs://, a shared "
                            "folder), committed so every worker has it")
        url = repo.config["remote"][name].get("url", "?")
        try:
            remote = repo.cloud.get_remote(name)
            reachable = remote.fs.exists(remote.path)
        except Exception as err:  # any backend's error: the reason is shown  # noqa: BLE001
            raise GridError(f"DVC remote {name!r} ({url}) cannot be reached: {type(err).__name__}: {err}") from None
        if not reachable:
            raise GridError(f"DVC remote {name!r} ({url}) cannot be reached: {remote.path} does not exist there "
                            "(create it, mount the shared folder, or fix the URL with `dvc remote modify`)")
    return url


def run_cache_entries(repo) -> list[tuple[str, str]]:
    """The local run-cache's entries as ``(key, value)`` (``.dvc/cache/runs/<k2>/<key>/<value>``)."""
    root = Path(repo.stage_cache.cache_dir)
    return [(entry.parent.name, entry.name) for entry in sorted(root.glob("*/*/*")) if entry.is_file()]


def push_run_cache_files(root: Path) -> int:
    """Push to the default remote every file the local run-cache entries name, metrics files (``cache: false``)
    included; returns how many were sent.

    ``dvc push --run-cache`` sends the entries and the stages' cached outputs, but not the copies of uncached
    outputs that DVC keeps for its entries (DVC 2 pushed them too); without them another checkout cannot
    restore the stage and runs it instead.
    """
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        sent = 0
        for objs in repo.stage_cache.get_used_objs(run_cache_entries(repo)).values():
            result = repo.cloud.push(objs)
            if result.failed:
                raise GridError(f"pushing {len(result.failed)} run-cache files to the DVC remote failed")
            sent += len(result.transferred)
        return sent


def restore_from_run_cache(root: Path, groups: Mapping[K, Sequence[str]]) -> dict[K, str | None]:
    """Check out each group's stages here, in order, from ``dvc.lock`` or the default remote's run-cache.

    Args:
        root: the checkout.
        groups: key -> stage names, e.g. a job -> ``("train@grpo-0", "evaluate@grpo-0")`` (a later stage may read
            an earlier one's outputs).

    Returns:
        key -> None when every stage of the group was restored, else why not (no entry for those params, its
        files are not in the remote). Nothing runs: a stage that cannot be restored is left as it is.
    """
    from dvc.repo import Repo
    from dvc.stage.cache import RunCacheNotFoundError

    out: dict[K, str | None] = {}
    with Repo(str(root)) as repo, repo.lock:
        with contextlib.suppress(Exception):  # no run-cache on the remote yet
            repo.stage_cache.pull(None)
        for key, stages in groups.items():
            out[key] = None
            for name in stages:
                try:
                    stage = repo.stage.collect(name)[0]
                    repo.stage_cache.restore(stage, pull=True)
                except RunCacheNotFoundError:
                    out[key] = f"{name} has no run-cache entry for these params"
                    break
                except Exception as err:  # noqa: BLE001  a missing dependency, a failed download: not restorable
                    out[key] = f"{name} cannot be restored: {type(err).__name__}: {err}"
                    break
    return out


def stage_inputs(root: Path, stage: str, item: Mapping[str, object], lock_text: str) -> list[str]:
    """The dependencies of one item of a ``dvc.yaml`` stage (e.g. ``train`` at ``{"ablation": "grpo", "seed":
    0}``) that are outputs of stages in ``lock_text``: what a checkout pulls before running it."""
    import yaml

    from trace.configuration.stages import stage_deps

    lock = yaml.safe_load(lock_text) or {}
    outs = {out["path"] for stage in (lock.get("stages") or {}).values() for out in stage.get("outs", [])}
    return [dep for dep in stage_deps(root / "dvc.yaml", stage, item) if dep in outs]
