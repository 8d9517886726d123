"""Stage ``train@<ablation>-<seed>``: RL steps of one arm at one training seed, resumable; chunks of steps run
as Prefect tasks.

Seeds: ``dvc.yaml`` runs the stage over ``train.ablations`` x ``train.seeds`` (``--seed``, default the global
seed). The run's config is the params with ``seed`` replaced by the training seed (``run_config``), so every
arm at one seed sees the same candidate prompts, and the global seed's run draws what a run without
``train.seeds`` draws. The warmup policy and the fitted predictor are shared by every seed.

A Prefect task costs ~0.15 s on a local server against ~1-2 s for a default step, so each task runs
``train.steps_per_task`` steps; the share of a step spent outside model compute is measured by the
orchestration benchmark.

Resume: the trainer works in a checkpoint folder outside every DVC output,
``data/checkpoints/<ablation>/<params hash>-<deps hash>`` of the main repository, or of ``train.checkpoint_dir``
(``checkpoint_store``; a grid's workers share one),
keyed by the run's params (``Config.resume_hash`` of the run config, so per seed: all but the step count and
checkpoint cadence) and the contents
of the stage's ``deps`` in ``dvc.yaml`` (code, prepared prompts, warmup policy, predictor). A killed run
started again with the same command (``make run``, ``dvc repro``, ``dvc exp run``, a queued experiment)
continues from its last checkpoint, even after DVC restored the stage's outputs of another run from
``dvc.lock``. The stage's output ``data/runs/<ablation>/s<seed>`` (trees, final policy, summary) is written
from the checkpoint folder at the end.

MLflow gets a step's metrics once the checkpoint that holds the step is saved (from the trainer's history),
so a resumed run logs every step exactly once. At each evaluation step the run also shows a bounded sample of
that step's rollouts (the table ``rollouts.json``) and a picture of its first trees (image key ``rollout_trees``),
read back from the step's Parquet trees (``log_rollouts``, ``trace.tracking.rollouts``).

Ranks: with ``launch.launcher`` set, the stage command starts its launcher (``flows.launch``) and every rank
runs this flow's code (``trace.training.parallel``: data-parallel rollouts and update). Rank 0 alone holds the
folder's lock, runs the Prefect flow, and writes MLflow, the trees and the stage's outputs; the other ranks
run the same steps as plain functions.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.common import REPO_ROOT, stage_main, PREDICTOR, WARMUP_MODEL, build_environment, checkpoint_store, \
    load_stage_policy, open_run, read_split, run_config, run_dir, stage_params, write_json
from trace.training.parallel import is_main_process as main_rank  # $RANK before the process group exists

# logged at every step, in the same batch as the step's other metrics: marks a step as logged
STEP_MARKER = "tokens/cumulative"
ROLLOUT_LOG_SECONDS = "tracking/rollout_log_seconds"  # seconds the run spent logging rollouts and trees


def checkpoint_dir(cfg, ablation: str) -> Path:
    """The arm's checkpoint folder for these params (a run config: its ``seed`` is the training seed) and the
    current contents of the stage's deps."""
    from trace.configuration.stages import deps_digest, stage_deps

    deps = stage_deps(REPO_ROOT / "dvc.yaml", "train", {"ablation": ablation, "seed": cfg.seed})
    store = checkpoint_store(cfg.train.checkpoint_dir)
    return store / ablation / f"{cfg.resume_hash()}-{deps_digest(REPO_ROOT, deps)}"


@contextlib.contextmanager
def exclusive(folder: Path):
    """Hold an exclusive lock on ``folder`` (one run trains into a checkpoint folder at a time; the
    operating system drops the lock of a killed process). Under a launcher rank 0 holds it for its group."""
    import fcntl

    if not main_rank():
        yield
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process training into {folder}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def log_checkpointed_steps(run, history: list[dict], until_step: int, logged: set[int]) -> None:
    """Log the metrics of each step ``< until_step`` of ``history`` that ``logged`` lacks, one batch a step."""
    for entry in history:
        step = int(entry["step"])
        if step < until_step and step not in logged:
            run.log_metrics({k: v for k, v in entry.items() if k != "step"}, step)
            logged.add(step)


def log_rollouts(run, trainer, ablation: str, history: list[dict], until_step: int, shown: set[int]) -> float:
    """For each evaluation step ``< until_step`` of ``history`` not in ``shown``: a bounded sample of its
    trajectories into the run's ``rollouts.json`` table and a picture of its first trees (``tracking.*``,
    ``trace.tracking.rollouts``), read from the step's Parquet trees. Returns the seconds it took."""
    t0 = time.perf_counter()
    from trace.tracking.names import EVAL_ACCURACY
    from trace.tracking.rollouts import ROLLOUT_TABLE, TREE_IMAGE_KEY, rollout_rows, tree_image
    from trace.tree_io import read_trees, tree_path

    tcfg = trainer.cfg.tracking
    for entry in history:
        step = int(entry["step"])
        if step >= until_step or step in shown or EVAL_ACCURACY not in entry:
            continue
        shown.add(step)
        path = tree_path(trainer.trees_root, ablation, step)
        if not path.is_file() or not (tcfg.rollout_rows or tcfg.tree_images):
            continue
        trees = read_trees(path)
        rows = rollout_rows(trees, step, tcfg.rollout_rows, tcfg.rollout_chars)
        if rows:
            import pandas as pd

            run.client.log_table(run.run_id, pd.DataFrame(rows), ROLLOUT_TABLE)
        image = tree_image(trees, step, tcfg.tree_images, title=ablation) if tcfg.tree_images else None
        if image is not None:
            run.client.log_image(run.run_id, image, key=TREE_IMAGE_KEY, step=step)
    return time.perf_counter() - t0


def log_reliability(run, history: list[dict], ablation: str) -> bool:
    """The run's reliability diagrams (``predictor.truth``), pooled over its audited steps, as the MLflow image
    ``truth/reliability.png`` (``trace.predictor.reliability``). Returns whether the run audited any."""
    from trace.predictor.reliability import STAGES, draw_reliability, history_diagram, is_diagram_key

    series: dict[str, list[tuple[int, float]]] = {}
    for entry in history:
        for key, value in entry.items():
            if is_diagram_key(key):
                series.setdefault(key, []).append((int(entry["step"]), float(value)))
    diagrams = {stage: history_diagram(series, stage) for stage in STAGES}
    if not any(diagrams.values()):
        return False
    import matplotlib.pyplot as plt

    fig = draw_reliability({ablation: diagrams}, title=f"{len({s for pts in series.values() for s, _ in pts})} audits")
    run.client.log_figure(run.run_id, fig, "truth/reliability.png")
    plt.close(fig)
    return True


def logged_steps(run) -> set[int]:
    """Steps the MLflow run already holds (by ``STEP_MARKER``)."""
    from trace.tracking import metric_key

    return {m.step for m in run.client.get_metric_history(run.run_id, metric_key(STEP_MARKER))}


def write_outputs(trainer, policy, out_dir: Path, summary: dict, ablation: str, seed: int) -> None:
    """The stage's DVC output: the trees of every step, the final policy and the summary."""
    from trace.policy.model import save_policy

    weights = trainer.updater.policy_state_dict()  # every rank: a collective under ZeRO-3
    if not main_rank():
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    if trainer.trees_root.is_dir():
        shutil.copytree(trainer.trees_root, out_dir / "trees")
    policy.model.load_state_dict(weights)
    save_policy(policy, out_dir / "final")
    write_json(out_dir / "summary.json", {"ablation": ablation, "seed": seed, **summary})


@task(name="train-steps", cache_policy=NONE)
def train_steps(trainer, until_step: int) -> int:
    trainer.run(until_step=until_step)
    return trainer.next_step


@flow(name="train", log_prints=False)
def train_flow(params: str, ablation: str, seed: int | None = None) -> dict:
    from trace.configuration.params_file import load_config
    from trace.training.loop import Trainer
    from trace.predictor import load_predictor
    from trace.prepared import rl_prompt_pool
    from trace.training.seeding import check_candidate_pool
    from trace.tracking import metric_key, summary_metrics

    base = load_config(params)
    env = build_environment(base)  # the task as prepared: built from the global seed
    cfg = run_config(base, base.seed if seed is None else seed)
    train, evals = read_split("train"), read_split("eval")
    train = rl_prompt_pool(train, cfg.train.prompt_pool)
    check_candidate_pool(len(train), cfg.allocation.num_candidates)  # before the policy loads
    policy = load_stage_policy(cfg, WARMUP_MODEL)
    predictor = load_predictor(PREDICTOR / "predictor.pt", cfg.predictor, env=env, policy=policy, seed=cfg.seed)
    work = checkpoint_dir(cfg, ablation)
    with exclusive(work):
        trainer = Trainer(cfg, ablation, policy=policy, env=env, train_prompts=train, eval_prompts=evals,
                          predictor=predictor, run_dir=work, progress=main_rank())
        start = trainer.resume()
        if start and main_rank():
            print(f"resuming {ablation} at step {start} from {work}")
        steps_task = train_steps if main_rank() else train_steps.fn  # one Prefect flow: rank 0's
        with (open_run(cfg, "train", stage_params(cfg, "train"), ablation=ablation, resume=True,
                       continue_run=start > 0) if main_rank() else contextlib.nullcontext()) as run:
            logged = logged_steps(run) if start and run else set()
            shown: set[int] = set()  # evaluation steps whose rollouts this run shows (a resumed run: a new run)
            shown_seconds = 0.0  # what showing them cost (the run's tracking/rollout_log_seconds)
            if run:
                log_checkpointed_steps(run, trainer.history, start, logged)
                shown_seconds += log_rollouts(run, trainer, ablation, trainer.history, start, shown)
            step = start
            while step < cfg.train.num_steps and not trainer.budget_spent:  # train.token_budget may stop it first
                step = steps_task(trainer, min(step + cfg.train.steps_per_task, cfg.train.num_steps))
                if run:
                    log_checkpointed_steps(run, trainer.history, trainer.checkpoint_step, logged)
                    shown_seconds += log_rollouts(run, trainer, ablation, trainer.history, trainer.checkpoint_step,
                                                  shown)
            summary = trainer.summary()
            write_outputs(trainer, policy, run_dir(ablation, cfg.seed), summary, ablation, cfg.seed)
            if run:
                known = run.client.get_run(run.run_id).data.metrics  # a resumed finished run: log nothing twice
                run.log_metrics({k: v for k, v in summary_metrics(summary).items()
                                 if known.get(metric_key(k)) != v}, trainer.next_step)
                run.log_metrics({ROLLOUT_LOG_SECONDS: shown_seconds}, trainer.next_step)
                log_reliability(run, trainer.history, ablation)
    if main_rank():
        print({k: round(v, 4) for k, v in summary.items()})
    return summary


def main(argv=None) -> None:
    from flows.common import load_stage_config, stage_args
    from flows.launch import relaunch
    from trace.configuration.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        launch_cfg = load_stage_config(stage_args(__doc__.splitlines()[0], ablation=True, argv=argv)).launch
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    code = relaunch(launch_cfg, "flows.train", argv)
    if code is not None:
        raise SystemExit(code)
    stage_main(train_flow if main_rank() else train_flow.fn, __doc__.splitlines()[0], ablation=True, argv=argv,
               orchestrate=main_rank())


if __name__ == "__main__":
    main()
