"""Where the train stage keeps its checkpoints, and how it logs steps to MLflow on resume."""

from pathlib import Path

import pytest

from flows.common import REPO_ROOT, checkpoint_store, eval_path, run_config, run_dir, stage_args
from flows.train import checkpoint_dir, log_checkpointed_steps
from trace.configuration.params_file import load_config

TINY = Path(__file__).resolve().parent / "params_tiny.yaml"


class _Run:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def test_checkpoint_store_is_the_main_repository_dvc_names_even_from_a_queued_temporary_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "main"))
    assert checkpoint_store() == tmp_path / "main" / "data" / "checkpoints"
    monkeypatch.delenv("DVC_ROOT")
    assert checkpoint_store() == REPO_ROOT / "data" / "checkpoints"


def test_checkpoint_folder_is_keyed_by_the_resume_hash_and_the_arm(monkeypatch, tmp_path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    cfg = load_config(TINY)
    longer = load_config(TINY, overrides={"train.num_steps": 9})
    other = load_config(TINY, overrides={"advantages.clip": 4.0})
    folder = checkpoint_dir(cfg, "trace")
    assert folder.parent == tmp_path / "data" / "checkpoints" / "trace"
    assert folder.name.startswith(cfg.resume_hash() + "-")
    assert checkpoint_dir(longer, "trace") == folder  # more steps continue the same checkpoint
    assert checkpoint_dir(other, "trace") != folder
    assert checkpoint_dir(cfg, "grpo").name == folder.name


def test_only_checkpointed_steps_are_logged_and_each_once():
    history = [{"step": s, "tokens/cumulative": 10.0 * (s + 1), "reward/mean": 0.5} for s in range(5)]
    run, logged = _Run(), {0}  # step 0 was logged before the kill
    log_checkpointed_steps(run, history, 3, logged)  # checkpoint after 3 steps: steps 1 and 2 go out
    log_checkpointed_steps(run, history, 3, logged)  # nothing new
    log_checkpointed_steps(run, history, 5, logged)
    assert [step for step, _ in run.logged] == [1, 2, 3, 4]
    assert run.logged[0][1] == {"tokens/cumulative": 20.0, "reward/mean": 0.5}
    assert logged == {0, 1, 2, 3, 4}


def test_each_training_seed_has_its_own_checkpoint_folder_output_and_evaluation(monkeypatch, tmp_path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    cfg = load_config(TINY, overrides={"train.seeds": [0, 1]})
    seed0, seed1 = run_config(cfg, 0), run_config(cfg, 1)
    assert checkpoint_dir(seed0, "trace") == checkpoint_dir(load_config(TINY), "trace")  # the global seed's as before
    assert checkpoint_dir(seed1, "trace") != checkpoint_dir(seed0, "trace")
    assert checkpoint_dir(seed1, "trace").parent == checkpoint_dir(seed0, "trace").parent
    assert run_dir("trace", 1) == REPO_ROOT / "data" / "runs" / "trace" / "s1"
    assert eval_path("trace", 1) == REPO_ROOT / "data" / "eval" / "trace" / "s1.json"


def test_a_run_config_changes_only_the_seed_and_the_global_seed_is_the_default(monkeypatch):
    cfg = load_config(TINY, overrides={"train.seeds": [3, 0]})
    other = run_config(cfg, 3)
    assert other.seed == 3 and other.model_dump(exclude={"seed"}) == cfg.model_dump(exclude={"seed"})
    assert load_config(TINY).train.run_seeds(0) == (0,) and cfg.train.run_seeds(0) == (3, 0)
    assert stage_args("x", ablation=True, argv=["--ablation", "trace"]).seed is None
    assert stage_args("x", ablation=True, argv=["--ablation", "trace", "--seed", "3"]).seed == 3


def test_a_seed_run_after_another_warmup_is_another_run():
    """Seed 1 trained from the global seed 0's warmup is not seed 1 trained from the global seed 1's."""
    from_warmup0 = run_config(load_config(TINY, overrides={"train.seeds": [0, 1]}), 1)
    from_warmup1 = run_config(load_config(TINY, overrides={"seed": 1, "train.seeds": [0, 1]}), 1)
    assert from_warmup0.model_dump() == from_warmup1.model_dump()
    assert from_warmup0.params_hash() != from_warmup1.params_hash()
    assert from_warmup0.resume_hash() != from_warmup1.resume_hash()
    assert from_warmup1.params_hash() == load_config(TINY, overrides={"seed": 1}).params_hash()


def test_a_seed_outside_train_seeds_stops_the_stage_with_the_fix(capsys):
    from flows.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--params", str(TINY), "--ablation", "trace", "--seed", "7"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert err.startswith("error: --seed 7 is not a training seed [0]: add it to train.seeds")
