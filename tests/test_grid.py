"""The grid across workers (flows.grid): one Prefect flow run per (arm, seed), stage results through DVC.

The fast tests check the pieces; the slow ones run the real thing on 127.0.0.1: a Prefect server, two process
workers in two copies of the project (two machines), a DVC remote in a temporary folder and an MLflow server on
PostgreSQL, and compare the grid with `dvc repro` in one folder.
"""

from pathlib import Path

from flows.train import checkpoint_dir
from trace.params_file import load_config

TINY = Path(__file__).resolve().parent / "params_tiny.yaml"


def test_a_shared_checkpoint_dir_moves_the_checkpoint_folder_but_changes_no_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "worker"))
    cfg = load_config(TINY)
    shared = load_config(TINY, overrides={"train.checkpoint_dir": str(tmp_path / "shared")})
    local = checkpoint_dir(cfg, "trace")
    assert local.parent == tmp_path / "worker" / "data" / "checkpoints" / "trace"
    assert checkpoint_dir(shared, "trace") == tmp_path / "shared" / "trace" / local.name  # same key, other place
    assert (shared.params_hash(), shared.resume_hash()) == (cfg.params_hash(), cfg.resume_hash())
    relative = load_config(TINY, overrides={"train.checkpoint_dir": "../ckpt"})
    assert checkpoint_dir(relative, "trace").parent == tmp_path / "worker" / ".." / "ckpt" / "trace"
