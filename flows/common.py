"""What every stage flow shares: paths of the DVC outputs, argument parsing, process environment.

The flows are thin: they load the typed config, call library functions, write the outputs that
``dvc.yaml`` declares, and log to MLflow. No method code lives here.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "data"
PREPARED = DATA / "prepared"
WARMUP_MODEL = DATA / "models" / "warmup"
SEED_TREES = DATA / "seed_trees"
PREDICTOR = DATA / "predictor"
RUNS = DATA / "runs"
EVAL = DATA / "eval"
REPORTS = REPO_ROOT / "reports"

_DEFAULT_ENV = {
    "DS_ACCELERATOR": "cpu",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_HOME": str(REPO_ROOT / ".prefect"),
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def setup_process_env() -> None:
    """Set the environment the stages need, keeping anything the user already set."""
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                os.environ["DS_ACCELERATOR"] = "cuda"
        except ImportError:
            pass


def run_dir(ablation: str) -> Path:
    return RUNS / ablation


def stage_args(description: str, *, ablation: bool = False, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the common stage options: ``--params`` (default params.yaml) and, for per-ablation stages,
    ``--ablation``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default=str(REPO_ROOT / "params.yaml"), help="params file (default params.yaml)")
    if ablation:
        parser.add_argument("--ablation", required=True, help="ablation name (see train.ablations)")
    return parser.parse_args(argv)


def load_stage_config(args: argparse.Namespace):
    from trace.config import load_config

    return load_config(args.params)


def build_environment(cfg):
    """The task's environment (``trace.envs.registry``)."""
    from trace.envs.registry import make_environment

    return make_environment(cfg.task, cfg.seed, root=REPO_ROOT)


def read_split(split: str):
    from trace.prepared import read_prompts

    return read_prompts(PREPARED / f"{split}.jsonl")


def open_run(cfg, stage: str, params: dict, ablation: str = "", resume: bool = False):
    """MLflow run of this stage execution (see ``trace.tracking.stage_run``).

    A resumable stage is keyed by ``cfg.resume_hash()`` so a run extended with more steps continues the
    same MLflow run.
    """
    from trace.tracking import stage_run

    return stage_run(stage, tracking_uri=cfg.tracking.tracking_uri, experiment_name=cfg.tracking.experiment_name,
                     params=params, params_hash=cfg.resume_hash() if resume else cfg.params_hash(),
                     ablation=ablation, resume=resume)


def section_params(cfg, *sections: str) -> dict:
    dumped = cfg.model_dump(mode="json")
    return {name: dumped[name] for name in sections}


def write_json(path: Path, data: dict) -> None:
    import json

    from trace.tree_io import atomic_write_bytes

    import math

    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}
    atomic_write_bytes(path, (json.dumps(clean, indent=2, sort_keys=True) + "\n").encode())


def load_stage_policy(cfg, path: Path):
    from trace.policy.model import load_policy

    return load_policy(path, dtype=cfg.policy.dtype)


def stage_main(flow_fn, description: str, *, ablation: bool = False, argv: list[str] | None = None):
    """Command-line entry of a stage: set the environment, parse ``--params`` (and ``--ablation``), validate
    the params before Prefect starts, then run the stage's flow."""
    setup_process_env()
    args = stage_args(description, ablation=ablation, argv=argv)
    cfg = load_stage_config(args)
    if not ablation:
        return flow_fn(args.params)
    valid = [a.value for a in cfg.train.ablations]
    if args.ablation not in valid:
        raise SystemExit(f"--ablation {args.ablation!r} is not in train.ablations {valid} of {args.params}")
    return flow_fn(args.params, args.ablation)
