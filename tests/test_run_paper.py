import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import run_paper

VENV_BIN = Path(sys.executable).parent


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture()
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    subprocess.run([str(VENV_BIN / "dvc"), "init", "-q"], cwd=root, check=True, capture_output=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "one")
    return root


def test_a_workspace_is_a_clone_at_head_on_the_shared_cache_and_follows_head(repo, monkeypatch):
    monkeypatch.setattr(run_paper, "_tool", lambda root, name: str(VENV_BIN / name))
    path = run_paper.workspace(1, repo)
    assert path == repo / ".paper" / "w1" and (path / "dvc.yaml").is_file()
    head = lambda p: subprocess.run(["git", "rev-parse", "HEAD"], cwd=p, capture_output=True, text=True).stdout  # noqa: E731
    assert head(path) == head(repo)
    assert str(repo / ".dvc" / "cache") in (path / ".dvc" / "config.local").read_text()
    (path / "data").mkdir()
    (path / "data" / "checkpoint").write_text("kept")
    (repo / "params.yaml").write_text("seed: 0\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two")
    assert run_paper.workspace(1, repo) == path and head(path) == head(repo)
    assert (path / "params.yaml").is_file() and (path / "data" / "checkpoint").read_text() == "kept"


def _fake_dvc(tmp_path, fail_seed: int) -> str:
    script = tmp_path / "dvc"
    script.write_text(f"#!/bin/sh\necho \"$@ threads=$OMP_NUM_THREADS path=$PYTHONPATH\"\n"
                      f"case \"$*\" in *warmup.seed={fail_seed}*) exit 3;; esac\nexit 0\n")
    script.chmod(0o755)
    return str(script)


def test_jobs_run_side_by_side_each_in_its_clone_and_a_failure_is_reported(tmp_path, monkeypatch):
    dvc = _fake_dvc(tmp_path, fail_seed=1)
    monkeypatch.setattr(run_paper, "_tool", lambda root, name: dvc)
    monkeypatch.setattr(run_paper, "POLL_S", 0.05)
    (tmp_path / ".paper").mkdir()
    paths = {0: tmp_path / "w0", 1: tmp_path / "w1"}
    for path in paths.values():
        path.mkdir()
    status = run_paper._run_jobs(paths, ["-S", "x=1"], jobs=2, threads=3, api_url="http://127.0.0.1:1/api",
                                 root=tmp_path)
    assert status == 3
    log0 = (tmp_path / ".paper" / "w0.log").read_text()
    assert "exp run -S x=1 -S warmup.seed=0" in log0 and f"threads=3 path={paths[0]}" in log0
    assert "warmup.seed=1" in (tmp_path / ".paper" / "w1.log").read_text()


def test_after_a_failure_no_further_experiment_starts(tmp_path, monkeypatch):
    dvc = _fake_dvc(tmp_path, fail_seed=0)
    monkeypatch.setattr(run_paper, "_tool", lambda root, name: dvc)
    monkeypatch.setattr(run_paper, "POLL_S", 0.05)
    (tmp_path / ".paper").mkdir()
    status = run_paper._run_jobs({0: tmp_path, 1: tmp_path}, [], jobs=1, threads=1, api_url="u", root=tmp_path)
    assert status == 3 and not (tmp_path / ".paper" / "w1.log").exists()


def test_the_warmup_seed_comes_last_so_an_override_cannot_move_it():
    assert run_paper.experiment_args(2, ["-S", "warmup.seed=5"]) == ["-S", "warmup.seed=5", "-S", "warmup.seed=2"]
    env = run_paper.job_env(Path("/x"), 4, "http://a/api", base={"PATH": "/bin"})
    assert env["PYTHONPATH"] == "/x" and env["OMP_NUM_THREADS"] == "4" and env["PREFECT_API_URL"] == "http://a/api"
    assert env["PATH"].split(os.pathsep)[0] == "/x/.venv/bin"
