"""Training checkpoints of one arm: DeepSpeed state, predictor state and the train state file.

A checkpoint after ``n`` steps is the tag ``step{n:06d}``: the updater's DeepSpeed folder of that tag, the
predictor file ``predictor.pt.<tag>`` and the train state JSON (``train_state.json``: next step, tag, params
hash, arm, cumulative counters, per-step metrics history, the state of an allocator that keeps one). The state
file is written last and atomically, so it only ever names a tag whose files are complete; older tags are
removed after it is written. A
checkpoint of other params (``Config.resume_hash``) or another arm is never loaded.

Several ranks: every rank writes its DeepSpeed shards; rank 0 alone writes the predictor and state files
(after every rank's shards are complete) and removes old tags. The state file records the world size and
ZeRO stage; a ZeRO-1/2/3 checkpoint resumed at another world size is converted to a DeepSpeed universal
checkpoint first (``trace.update.convert_to_universal_checkpoint``), which loads into any number of ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from trace.errors import UserError
from trace.training.parallel import barrier, broadcast_object, is_main_process, world_size
from trace.tree_io import atomic_write_bytes

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "train_state.json"
PREDICTOR_FILE = "predictor.pt"


class CheckpointError(UserError, RuntimeError):
    """A training checkpoint cannot be read (truncated, corrupt); the message names its files and the fix."""


def _unreadable(run_dir: Path, what: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"training checkpoint {what} cannot be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
        f"the checkpoint of {Path(run_dir) / CHECKPOINT_DIR} is damaged (e.g. a disk filled up or a copy was cut "
        f"short). Delete that folder to train the run from step 0: rm -r {Path(run_dir) / CHECKPOINT_DIR}")


def state_path(run_dir: str | Path) -> Path:
    """The train state file of the arm's folder ``run_dir``: ``<run_dir>/checkpoint/train_state.json``."""
    return Path(run_dir) / CHECKPOINT_DIR / STATE_FILE


def write_checkpoint(run_dir: str | Path, step_done: int, *, updater: Any, predictor: Any, params_hash: str,
                     ablation: str, cumulative_tokens: float, cumulative_trajectories: float,
                     history: list[dict], allocator_state: dict | None = None) -> None:
    """Checkpoint after ``step_done`` steps: DeepSpeed state, predictor, counters (atomic state file last).

    Args:
        run_dir: the arm's folder; the checkpoint goes to ``<run_dir>/checkpoint``.
        step_done: steps finished (the next step to run), >= 0.
        updater: the ``trace.update.PolicyUpdater`` (``save_checkpoint(folder, tag=...)``).
        predictor: the ``trace.predictor.SuccessPredictor`` (``save(path)``).
        params_hash: ``Config.resume_hash()`` of the run.
        ablation: the arm's name.
        cumulative_tokens: generated tokens over all steps run.
        cumulative_trajectories: trajectories over all steps run.
        history: one metrics dict per step run (``{"step": s, ...}``).
        allocator_state: the arm's ``AllocatorState.state_dict()`` (greso, mopps, vip), JSON; None for arms
            whose root rule keeps no state.
    """
    ckpt = Path(run_dir) / CHECKPOINT_DIR
    tag = f"step{step_done:06d}"
    updater.save_checkpoint(ckpt, tag=tag)  # every rank: its shards
    barrier()
    if not is_main_process():
        barrier()
        return
    predictor.save(ckpt / f"{PREDICTOR_FILE}.{tag}")
    state = {"next_step": step_done, "tag": tag, "params_hash": params_hash,
             "ablation": ablation, "cumulative_tokens": cumulative_tokens,
             "cumulative_trajectories": cumulative_trajectories, "world_size": world_size(),
             "zero_stage": int(getattr(getattr(updater, "cfg", None), "zero_stage", 0)), "history": history,
             "allocator_state": allocator_state}
    atomic_write_bytes(state_path(run_dir), json.dumps(state, indent=1).encode())
    for old in ckpt.glob("step*"):  # keep the newest DeepSpeed tag only
        if old.is_dir() and old.name != tag:
            shutil.rmtree(old, ignore_errors=True)
    for old in ckpt.glob(f"{PREDICTOR_FILE}.step*"):
        if old.name != f"{PREDICTOR_FILE}.{tag}":
            old.unlink(missing_ok=True)
    barrier()


def load_checkpoint(run_dir: str | Path, *, updater: Any, predictor: Any, params_hash: str,
                    ablation: str) -> dict | None:
    """Load the last checkpoint of ``run_dir`` into ``updater`` and ``predictor`` if it belongs to these params.

    A checkpoint of other params or another arm is discarded: the whole ``run_dir`` is removed (its trees
    belong to that run too).

    Args:
        run_dir: the arm's folder.
        updater: the ``trace.update.PolicyUpdater`` (``load_checkpoint(folder, tag=...)``).
        predictor: the ``trace.predictor.SuccessPredictor`` (``load_state_dict``).
        params_hash: ``Config.resume_hash()`` of the run.
        ablation: the arm's name.

    Returns:
        The train state (``next_step``, ``tag``, ``cumulative_tokens``, ``cumulative_trajectories``,
        ``history``, ...) of the loaded checkpoint, or ``None`` when there was none to load.

    Raises:
        CheckpointError: the state file, the DeepSpeed state or the predictor file of the checkpoint cannot be
            read (names the file and how to start over).
    """
    import torch

    path = state_path(run_dir)
    # rank 0 reads and decides; every rank acts on its answer (a file another rank half-sees cannot split them)
    state = broadcast_object(_read_state(run_dir, path) if is_main_process() and path.is_file() else None)
    if state is None:
        return None
    if state.get("params_hash") != params_hash or state.get("ablation") != ablation:
        if is_main_process():
            shutil.rmtree(run_dir, ignore_errors=True)
        barrier()
        return None
    ckpt = Path(run_dir) / CHECKPOINT_DIR
    tag, universal = state["tag"], False
    if int(state.get("world_size", 1)) != world_size() and int(state.get("zero_stage", 0)) >= 1:
        # ZeRO shards are per rank: resume at another world size through a universal checkpoint
        from trace.update import convert_to_universal_checkpoint

        universal_tag = f"{tag}_universal"
        if is_main_process() and not (ckpt / universal_tag).is_dir():
            partial = ckpt / f"{universal_tag}.partial"  # renamed once complete: a killed conversion is redone
            shutil.rmtree(partial, ignore_errors=True)
            convert_to_universal_checkpoint(ckpt, tag, partial.name)
            partial.rename(ckpt / universal_tag)
        barrier()
        tag, universal = universal_tag, True
    try:
        updater.load_checkpoint(ckpt, tag=tag, **({"universal": True} if universal else {}))
    except (RuntimeError, OSError, EOFError, KeyError, ValueError) as err:
        raise _unreadable(run_dir, ckpt / tag, err) from err
    predictor_path = ckpt / f"{PREDICTOR_FILE}.{state['tag']}"
    try:
        predictor_state = torch.load(predictor_path, map_location="cpu", weights_only=False)
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise _unreadable(run_dir, predictor_path, err) from err
    predictor.load_state_dict(predictor_state)
    return state


def _read_state(run_dir: str | Path, path: Path) -> dict:
    """The train state file as a dict; a file that is not a JSON object raises ``CheckpointError``."""
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _unreadable(Path(run_dir), path, err) from err
    if not isinstance(state, dict) or "tag" not in state:
        raise _unreadable(Path(run_dir), path, ValueError("not a train state (no 'tag')"))
    return state


def load_allocator_state(allocator_state: Any, state: dict, run_dir: str | Path, ablation: str) -> None:
    """Restore an arm's allocator state (greso, mopps, vip) from a loaded checkpoint ``state``.

    Raises:
        CheckpointError: the checkpoint holds no allocator state, or one that lacks a key the allocator reads or
            does not hold its fields; names the state file, the key and the folder to delete.
    """
    run_dir = Path(run_dir)
    if state.get("allocator_state") is None:
        raise CheckpointError(f"the checkpoint of {run_dir} holds no allocator state for the arm {ablation!r}, whose "
                              f"root rule keeps one; delete its folder to train from step 0: rm -r "
                              f"{run_dir / 'checkpoint'}")
    try:
        allocator_state.load_state_dict(state["allocator_state"])
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        what = f"lacks the key {err.args[0]!r}" if isinstance(err, KeyError) and err.args else \
            f"does not hold the arm's fields ({type(err).__name__}: {err})"
        raise CheckpointError(f"the allocator state in {state_path(run_dir)} (arm {ablation!r}) {what}; the "
                              "checkpoint is damaged or was written by other code. Delete its folder to train "
                              f"from step 0: rm -r {run_dir / 'checkpoint'}") from err
