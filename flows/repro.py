"""``dvc repro`` with independent stages run side by side: ``make run``'s driver.

DVC runs a pipeline's stages one after another. The items of a ``matrix`` stage (``train@grpo-0``,
``train@trace-1``, ...) depend only on the shared stages before them, so on a machine with more cores than one stage
uses they can run at the same time: each is one ``dvc --wait-for-lock repro --single-item <stage>`` process, as
DVC's documentation of ``repro`` describes for parallel stage execution (DVC releases its repository lock while a
stage's command runs and takes it again to record the stage in ``dvc.lock``). Each process still decides for its
stage alone: skipped when unchanged, restored from the run-cache, or run; nothing is recorded but by DVC. A stage
that DVC reports unchanged (``Stage.changed``, asked at the start and again once a stage it reads from has run)
starts no process, so a run with nothing changed takes about as long as ``dvc repro``'s.

Threads: the run has ``threads`` (``OMP_NUM_THREADS``, ``make``'s default 2) to share. A stage that is not a
matrix item (``prepare``, ``warmup``, ``report``, ...) takes all of them and runs alone; a matrix item takes
``max(1, threads // jobs)``, so up to ``jobs`` of them run at once, and never more threads than ``threads`` in
all. Each stage gets its count as its ``OMP_NUM_THREADS``. A stage starts once every stage it depends on has
finished, in the order ``dvc.yaml`` lists them. The first failure stops new starts; the stages already running
finish, and the command exits with status 1 after naming every failed stage and its log.

Output: a stage of its own writes to this terminal as under ``dvc repro`` (the warmup's progress, the report's
summary); with more than one job, each matrix item writes to its own log, ``.dvc/tmp/repro/<stage>.log``, and this
command prints a line as each starts and ends.

Where a GPU is visible the default is one job: stages on one device would contend for its memory.

Usage:
    python -m flows.repro [--jobs N] [stage ...]   # no stage: every stage of dvc.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from flows.common import REPO_ROOT

LOG_DIR = Path(".dvc") / "tmp" / "repro"


def stage_graph(root: Path = REPO_ROOT, targets: Sequence[str] = ()) -> dict[str, list[str]]:
    """The stages to reproduce and what each waits for, from DVC's own view of ``dvc.yaml``.

    Args:
        root: the DVC repository.
        targets: stage names (``train@grpo-0``) whose pipelines to take; empty = every stage.

    Returns:
        ``{stage: [stages it depends on]}`` in ``dvc.yaml``'s order (topological: a stage after what it reads).

    Raises:
        dvc.exceptions.DvcException (its subclasses): ``dvc.yaml`` does not parse, or a target is no stage.
    """
    import networkx as nx
    from dvc.repo import Repo

    with contextlib.chdir(root), Repo(str(root)) as repo:  # stage names are relative to the working directory
        graph = repo.index.graph  # edges: stage -> the stages whose outputs it reads
        if targets:
            keep = set()
            for target in targets:
                for stage in repo.stage.collect(target):
                    keep |= {stage, *nx.descendants(graph, stage)}
            graph = graph.subgraph(keep)
        position = {stage: i for i, stage in enumerate(repo.index.stages)}
        # a stable order: dvc.yaml's, among the stages a topological order allows at each point
        order = list(nx.lexicographical_topological_sort(graph.reverse(copy=True),
                                                         key=lambda s: position.get(s, len(position))))
        return {stage.addressing: [up.addressing for up in graph.successors(stage)] for stage in order}


def thread_demand(stage: str, threads: int, jobs: int) -> int:
    """Threads of ``stage``: all ``threads`` for a stage of its own, ``max(1, threads // jobs)`` for a matrix item."""
    return max(1, threads // jobs) if "@" in stage else threads


def changed_stages(root: Path, stages: Sequence[str]) -> set[str]:
    """Which of ``stages`` ``dvc repro`` would not skip now (``Stage.changed``: a dependency, output, param or
    command differs from ``dvc.lock``, or an output is missing), read under DVC's repository lock."""
    from dvc.repo import Repo

    with contextlib.chdir(root), Repo(str(root), _wait_for_lock=True) as repo, repo.lock:
        wanted = set(stages)
        return {stage.addressing for stage in repo.index.stages if stage.addressing in wanted and stage.changed()}


def run_stages(graph: Mapping[str, Sequence[str]], launch: Callable[[str, int], int], threads: int, jobs: int,
               echo: Callable[[str], None] = print,
               changed: Callable[[Sequence[str]], set[str]] | None = None) -> dict[str, int]:
    """Run every stage of ``graph`` through ``launch`` once all its upstream stages succeeded.

    Args:
        graph: ``{stage: [upstream stages]}`` (``stage_graph``); upstream stages outside it count as done.
        launch: ``launch(stage, num_threads) -> exit status``; called from worker threads, so it blocks.
        threads: threads to share (>= 1).
        jobs: matrix items at most at once (>= 1).
        echo: where the start and end lines go.
        changed: ``changed(stages) -> those that need a run`` (``changed_stages``), asked for every stage at the
            start and again for a stage when it is ready and one of its upstream stages was launched; a stage it
            leaves out counts as done without a launch, as ``dvc repro`` skips it (so a run with nothing changed
            starts no process). An error in it launches the stages asked about. ``None``: launch every stage.

    Returns:
        ``{stage: exit status}`` of each stage that ran or was up to date (0); after a failure the stages not yet
        started are absent.

    Raises:
        ValueError: ``threads`` or ``jobs`` below 1, or a cycle (a stage that can never start).
    """
    if threads < 1 or jobs < 1:
        raise ValueError(f"threads ({threads}) and jobs ({jobs}) must be at least 1")
    pending = list(graph)
    status: dict[str, int] = {}
    running: dict[str, int] = {}  # stage -> its threads
    done = threading.Condition()
    failed = False

    def work(stage: str, num_threads: int) -> None:
        started = time.monotonic()
        try:
            code = launch(stage, num_threads)
        except Exception as err:  # noqa: BLE001 - a launch that cannot start is that stage's failure
            echo(f"{stage}: {err}")
            code = 1
        with done:
            status[stage] = code
            running.pop(stage)
            echo(f"{'done' if code == 0 else 'FAILED'} {stage} ({time.monotonic() - started:.0f} s"
                 f"{'' if code == 0 else f', exit status {code}'})")
            done.notify_all()

    def ask(stages: list[str]) -> set[str]:
        try:
            return set(changed(stages)) if stages else set()
        except Exception as err:  # noqa: BLE001 - unsure: let each stage's dvc repro decide
            echo(f"could not ask DVC what changed ({err}); running {len(stages)} stage(s) to let it decide")
            return set(stages)

    # asked once for all: a stage none of whose upstream stages is launched keeps this answer
    initial = ask(list(graph)) if changed is not None else set()
    checked: set[str] = set()
    launched: set[str] = set()
    with done:
        while pending and not failed:
            free = threads - sum(running.values())
            ready = [s for s in pending if all(status.get(u, 0 if u not in graph else None) == 0 for u in graph[s])]
            fresh = [s for s in ready if s not in checked] if changed is not None else []
            if fresh:
                checked.update(fresh)
                again = [s for s in fresh if any(u in launched for u in graph[s])]
                to_run = {s for s in fresh if s in initial and s not in again} | ask(again)
                skipped = [s for s in fresh if s not in to_run]
                for stage in skipped:
                    pending.remove(stage)
                    status[stage] = 0
                if skipped:
                    echo(f"up to date: {', '.join(skipped)}")
                    continue
            started = False
            for stage in ready:
                need = thread_demand(stage, threads, jobs)
                if need > free:  # a stage of its own (need == threads) waits until nothing runs
                    break  # in order: a stage that must wait holds back those after it
                pending.remove(stage)
                launched.add(stage)
                running[stage] = need
                free -= need
                echo(f"start {stage} ({need} thread{'s' if need > 1 else ''})")
                threading.Thread(target=work, args=(stage, need), daemon=True).start()
                started = True
            if not started:
                if not running:
                    raise ValueError(f"stages that can never start (a cycle?): {pending}")
                done.wait()
            failed = any(code != 0 for code in status.values())
        while running:
            done.wait()
    return status


def log_path(stage: str) -> Path:
    """Where a matrix item run side by side writes its output, relative to the repository:
    ``.dvc/tmp/repro/<stage>.log`` (a ``/`` of a stage in another folder's ``dvc.yaml`` becomes ``_``)."""
    return LOG_DIR / f"{stage.replace('/', '_')}.log"


class DvcLauncher:
    """``launch`` for ``run_stages``: ``dvc --wait-for-lock repro --single-item <stage>`` with ``OMP_NUM_THREADS``.

    With ``parallel``, each matrix item's output goes to ``log_path(stage)`` (replaced each run); a stage of its
    own, which runs alone, writes to this process's own streams, as every stage does without ``parallel``. Each
    stage runs in its own session; ``interrupt`` sends ``SIGINT`` to every running one's process group, so each
    ``dvc repro`` stops as on Ctrl-C.
    """

    def __init__(self, root: Path, parallel: bool):
        self.root, self.parallel = root, parallel
        dvc = Path(sys.executable).with_name("dvc")
        self.command = str(dvc) if dvc.exists() else "dvc"
        self.procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def __call__(self, stage: str, num_threads: int) -> int:
        env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
        args = [self.command, "--wait-for-lock", "repro", "--single-item", stage]
        out = None
        if self.parallel and "@" in stage:  # a stage of its own runs alone: its output to this terminal
            log = self.root / log_path(stage)
            log.parent.mkdir(parents=True, exist_ok=True)
            out = open(log, "wb")
        try:
            with self._lock:
                proc = subprocess.Popen(args, cwd=self.root, env=env, stdout=out,
                                        stderr=subprocess.STDOUT if out else None,
                                        stdin=subprocess.DEVNULL if out else None, start_new_session=True)
                self.procs[stage] = proc
            return proc.wait()
        finally:
            if out is not None:
                out.close()

    def interrupt(self, signum: int = signal.SIGINT, grace_s: float = 30.0) -> None:
        """``signum`` to every running stage's process group; ``SIGKILL`` to a group still running ``grace_s``
        later (a stage started with ``SIGINT`` ignored, as a shell's background job is, ignores Ctrl-C)."""
        with self._lock:
            procs = [p for p in self.procs.values() if p.poll() is None]
        for proc in procs:
            _signal_group(proc, signum)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def main(argv: Sequence[str] | None = None, root: Path = REPO_ROOT) -> int:
    """The command line (module docstring); ``root``: the DVC repository. Returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help="stages whose pipelines to reproduce (default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="matrix items at once (default: OMP_NUM_THREADS, or 1 where a GPU is visible)")
    args = parser.parse_args(argv)
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    jobs = args.jobs if args.jobs is not None else (1 if _gpu_visible() else threads)
    if jobs < 1 or threads < 1:
        parser.error(f"--jobs ({jobs}) and OMP_NUM_THREADS ({threads}) must be at least 1")
    graph = stage_graph(root, args.stages)
    per_item = thread_demand("@", threads, jobs)
    parallel = min(jobs, threads // per_item) > 1
    if parallel:
        print(f"{len(graph)} stages: matrix items {min(jobs, threads // per_item)} at a time on {per_item} "
              f"thread(s) each, the others alone on {threads}; logs: {LOG_DIR}/<stage>.log", flush=True)
    echo = (lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)) if parallel else (lambda _: None)
    launcher = DvcLauncher(root, parallel)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        status = run_stages(graph, launcher, threads, jobs, echo, lambda stages: changed_stages(root, stages))
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (_Terminated): passed on to the running stages
        launcher.interrupt(getattr(stop, "signum", signal.SIGINT))
        print("interrupted: the running stages were stopped; run again to resume", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [stage for stage in graph if status.get(stage, 0) != 0]
    if failed:
        named = [f"{s} (see {log_path(s)})" if parallel and "@" in s else s for s in failed]
        print(f"failed: {', '.join(named)}; stages not started: {len([s for s in graph if s not in status])}; "
              "fix the cause and run again (finished stages are cached)", file=sys.stderr)
        return 1
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises ``KeyboardInterrupt``; the running stages get SIGTERM too."""

    signum = signal.SIGTERM


def _interrupted(signum, frame) -> None:
    raise _Terminated


def _gpu_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
