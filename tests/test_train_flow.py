"""Where the train stage keeps its checkpoints, and how it logs steps to MLflow on resume."""

from pathlib import Path

from flows.common import REPO_ROOT, checkpoint_store
from flows.train import checkpoint_dir, log_checkpointed_steps
from trace.params_file import load_config

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
