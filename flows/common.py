"""What every stage flow shares: paths of the DVC outputs, argument parsing, process environment.

The flows are thin: they load the typed config, call library functions, write the outputs that
``dvc.yaml`` declares, and log to MLflow. No method code lives here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from trace.configuration.process_env import main_repository, setup_process_env  # the stages' environment (also the Makefile's)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "data"
PREPARED = DATA / "prepared"
WARMUP_MODEL = DATA / "models" / "warmup"
SEED_TREES = DATA / "seed_trees"
PREDICTOR = DATA / "predictor"
RUNS = DATA / "runs"
EVAL = DATA / "eval"
REPORTS = REPO_ROOT / "reports"
# DVC metrics files: outside the git-ignored data/ and reports/, so `dvc exp run` commits them with each
# experiment and `dvc exp show` / `dvc metrics diff` compare them
METRICS = REPO_ROOT / "metrics"
# training checkpoints, kept out of every DVC output (see checkpoint_store)
CHECKPOINTS = Path("data") / "checkpoints"

def run_dir(ablation: str, seed: int) -> Path:
    """The train stage's output of one arm at one training seed: ``data/runs/<ablation>/s<seed>``."""
    return RUNS / ablation / f"s{seed}"


def eval_path(ablation: str, seed: int) -> Path:
    """The evaluate stage's output of one arm at one seed: ``data/eval/<ablation>/s<seed>.json``."""
    return EVAL / ablation / f"s{seed}.json"


def run_config(cfg, seed: int):
    """The config of one train or evaluate run: ``cfg`` with ``seed`` replaced by the training seed.

    Every random stream of the run (candidate prompts, sampling, updates, evaluation) derives from it
    exactly as from the global seed; the global seed's run is ``cfg`` itself. The run's ``params_hash``
    and ``resume_hash`` hold the seed and, for a seed other than the global one, the global seed the
    shared stages ran at (``train.seeds`` is left out of them), so MLflow keys and checkpoints are per
    (warmup, arm, seed).

    Raises:
        ValueError: ``seed`` is not one of the training seeds (``train.seeds``, default the global seed).
    """
    seeds = cfg.train.run_seeds(cfg.seed)
    if seed not in seeds:
        raise ValueError(f"--seed {seed} is not a training seed {list(seeds)}: add it to train.seeds "
                         "(e.g. -S 'train.seeds=[0,1,2]') or pick one of those")
    if seed == cfg.seed:
        return cfg
    run = cfg.model_copy(update={"seed": int(seed)})
    run._shared_seed = cfg.seed  # the warmup's seed: part of params_hash, so runs after another warmup differ
    return run


def checkpoint_store(checkpoint_dir: str | None = None) -> Path:
    """Folder of the training checkpoints: ``train.checkpoint_dir``, else ``data/checkpoints`` of the main
    repository.

    DVC sets ``DVC_ROOT`` for every stage command to the repository it was started in; for a queued
    experiment (``dvc exp run --queue``, run in a temporary copy under ``.dvc/tmp/exps``) it is the main
    repository, so a queued run finds the checkpoints of an earlier attempt. Outside DVC: this repository.
    The store is no DVC output, so DVC's restore of outputs before a run (``dvc exp run`` checks out every
    output from ``dvc.lock``) never replaces a checkpoint. A grid (``flows.grid``) points every worker at one
    shared folder, so a job killed on one worker resumes on another.

    Args:
        checkpoint_dir: ``train.checkpoint_dir``; ``~`` expands, a relative path resolves against the main
            repository; None = ``data/checkpoints`` there.
    """
    if checkpoint_dir is None:
        return main_repository() / CHECKPOINTS
    return main_repository() / Path(checkpoint_dir).expanduser()


def end_process(pid: int, *, group: bool = False, wait_s: float = 5.0) -> bool:
    """SIGTERM to process ``pid`` (its whole process group with ``group``), SIGKILL after ``wait_s`` seconds.

    A child of this process is reaped while it waits. Returns False when no such process (group) existed.
    """
    import signal
    import time

    kill = os.killpg if group else os.kill
    try:
        kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    try:
        kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def stage_args(description: str, *, ablation: bool = False, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the common stage options: ``--params`` (default params.yaml) and, for per-ablation stages,
    ``--ablation`` and ``--seed``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default=str(REPO_ROOT / "params.yaml"), help="params file (default params.yaml)")
    if ablation:
        parser.add_argument("--ablation", required=True, help="ablation name (see train.ablations)")
        parser.add_argument("--seed", type=int, default=None,
                            help="training seed, one of train.seeds (default: the global seed)")
    return parser.parse_args(argv)


def load_stage_config(args: argparse.Namespace):
    from trace.configuration.params_file import load_config

    return load_config(args.params)


def build_environment(cfg):
    """The task's environment (``trace.envs.registry``); relative data paths resolve against ``main_repository()``."""
    from trace.envs.registry import make_environment

    return make_environment(cfg.task, cfg.seed, root=main_repository())


def read_split(split: str):
    """The prepared prompts of ``split`` (``train``, ``eval``, ``test``) from data/prepared.

    Raises:
        FileNotFoundError: the split was never prepared (a test split needs ``task.kgqa.num_test > 0``).
    """
    from trace.prepared import read_prompts

    path = PREPARED / f"{split}.jsonl"
    if not path.is_file():
        hint = "set task.kgqa.num_test > 0 and " if split == "test" else ""
        raise FileNotFoundError(f"{path} does not exist: {hint}run `dvc repro prepare` first")
    return read_prompts(path)


def open_run(cfg, stage: str, params: dict, ablation: str = "", resume: bool = False,
             continue_run: bool | None = None):
    """MLflow run of this stage execution (see ``trace.tracking.stage_run``).

    Args:
        resume: the stage is resumable: its run is keyed by ``cfg.resume_hash()`` (not ``params_hash``), so a
            run extended with more steps continues the earlier MLflow run.
        continue_run: continue the newest run with that key in a new run that carries its history
            (default: ``resume``); False starts a new run under the same key (a resumable stage that starts
            from step 0).
    """
    from trace.tracking import stage_run

    return stage_run(stage, tracking_uri=cfg.tracking.tracking_uri, experiment_name=cfg.tracking.experiment_name,
                     params=params, params_hash=cfg.resume_hash() if resume else cfg.params_hash(),
                     ablation=ablation, resume=resume if continue_run is None else continue_run, seed=cfg.seed)


def stage_params(cfg, stage: str) -> dict:
    """The params ``stage`` reads (``trace.configuration.stages.STAGE_PARAMS``): its MLflow params."""
    from trace.configuration.stages import stage_params as params_of

    return params_of(cfg, stage)


def write_json(path: Path, data: dict) -> None:
    import json

    from trace.tree_io import atomic_write_bytes

    import math

    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}
    atomic_write_bytes(path, (json.dumps(clean, indent=2, sort_keys=True) + "\n").encode())


def load_stage_policy(cfg, path: Path):
    from trace.policy.model import load_policy

    return load_policy(path, dtype=cfg.policy.dtype)


def stage_main(flow_fn, description: str, *, ablation: bool = False, argv: list[str] | None = None,
               orchestrate: bool = True):
    """Command-line entry of a stage: parse ``--params`` (and ``--ablation``, ``--seed``), validate the params, set
    the environment, run the stage's flow. ``orchestrate=False`` (a training rank other than 0, which runs
    ``flow.fn``): no Prefect API calls.

    An expected error (``trace.errors.UserError``: a bad param, data, prompt, tree or checkpoint file, a retriever
    that does not answer) ends the process with its one message naming the key, file or row and the fix, and
    exit status 1; ``TRACE_DEBUG=1`` shows its traceback. Any other error keeps its traceback.
    """
    from trace.errors import user_errors

    args = stage_args(description, ablation=ablation, argv=argv)
    with user_errors():
        return _run_stage(flow_fn, args, ablation=ablation, orchestrate=orchestrate)


def _run_stage(flow_fn, args: argparse.Namespace, *, ablation: bool, orchestrate: bool):
    from trace.configuration.config import ConfigError

    cfg = load_stage_config(args)
    setup_process_env()
    from flows.prefect_runs import owned_flow_runs

    if not ablation:
        with owned_flow_runs():  # flow runs of killed stages end Crashed; this one is tagged with its process
            return flow_fn(args.params)
    valid = list(cfg.train.ablations)
    if args.ablation not in valid:
        raise ConfigError(f"--ablation {args.ablation!r} is not in train.ablations {valid} of {args.params}")
    seed = cfg.seed if args.seed is None else args.seed
    try:
        run_config(cfg, seed)
    except ValueError as err:
        raise ConfigError(f"{err} ({args.params})") from None
    with owned_flow_runs() if orchestrate else contextlib.nullcontext():
        return flow_fn(args.params, args.ablation, seed)
