"""The grid across workers (flows.grid): one Prefect flow run per (arm, seed), stage results through DVC.

The fast tests check the pieces; the slow ones run the real thing on 127.0.0.1: a Prefect server, two process
workers in two copies of the project (two machines), a DVC remote in a temporary folder and an MLflow server on
PostgreSQL, and compare the grid with `dvc repro` in one folder.
"""

from pathlib import Path

from flows.train import checkpoint_dir
from trace.configuration.params_file import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "params_tiny.yaml"


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


def test_every_train_and_evaluate_stage_can_be_restored_from_the_run_cache():
    """DVC saves a run-cache entry only for a stage whose outputs are cached, metrics or plots (an uncached
    plain output, `cache: false`, makes it skip the entry): the grid's coordinator restores these stages from
    the entries its workers push."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        stages = [s for s in repo.index.stages if s.name.split("@")[0] in ("train", "evaluate")]
        assert stages
        for stage in stages:
            blocking = [str(out) for out in stage.outs if not out.use_cache and not (out.is_metric or out.is_plot)]
            assert not blocking, f"{stage.addressing}: uncached outputs {blocking} keep it out of the run-cache"
