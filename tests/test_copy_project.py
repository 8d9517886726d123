"""The project copy that the end-to-end tests run in holds the source only, whatever a run left in the folder."""

import subprocess

import tests.test_pipeline_e2e as e2e


def test_a_copy_leaves_behind_every_output_a_run_leaves_in_the_folder(tmp_path, monkeypatch):
    src = tmp_path / "src"
    for rel, text in {"flows/x.py": "tracked", "trace/data/__init__.py": "code under a data folder",
                      ".gitignore": "/data/\n/mlruns/\n/reports/*\n!/reports/runs/\n", "reports/runs/r/README.md": "kept",
                      "tests/new_test.py": "untracked, not ignored"}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=src, check=True)
    subprocess.run(["git", "add", "flows", "trace", ".gitignore", "reports"], cwd=src, check=True)
    # what `make run` leaves: DVC's lock file and metrics (not ignored by git), outputs git ignores, a database
    for rel in ("dvc.lock", "metrics/warmup.json", "data/prepared/train.jsonl", "mlruns/0/meta.yaml",
                "reports/summary.md", "mlflow.db"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("output")
    monkeypatch.setattr(e2e, "ROOT", src)
    dst = tmp_path / "copy"
    e2e.copy_project(dst)
    copied = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())
    assert copied == [".gitignore", "flows/x.py", "tests/new_test.py", "trace/data/__init__.py"]
