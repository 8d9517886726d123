"""flows.repro: DVC stages side by side, each a `dvc repro --single-item` of its own, on a share of the threads.

The scheduler is checked with a recording launcher; the whole command on a real DVC repository in a temporary
folder whose matrix stages record when they ran and on how many threads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from flows.repro import main, run_stages, stage_graph, thread_demand

BIN = Path(sys.executable).parent


class Recorder:
    """A launcher that sleeps ``seconds`` per stage and records the stages running at once and their threads."""

    def __init__(self, seconds: float = 0.05, fail: str = "", slow: str = ""):
        self.seconds, self.fail, self.slow = seconds, fail, slow
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.running: dict[str, int] = {}
        self.most_threads = 0
        self.order: list[str] = []
        self.overlaps: list[set[str]] = []
        self.lock = threading.Lock()

    def __call__(self, stage: str, threads: int) -> int:
        with self.lock:
            self.running[stage] = threads
            self.order.append(stage)
            self.started[stage] = time.monotonic()
            self.most_threads = max(self.most_threads, sum(self.running.values()))
            self.overlaps.append(set(self.running))
        time.sleep(0.0 if stage == self.fail else self.seconds * (20 if stage == self.slow else 1))
        with self.lock:
            del self.running[stage]
            self.ended[stage] = time.monotonic()
        return 1 if stage == self.fail else 0


GRAPH = {"prepare": [], "warmup": ["prepare"],
         **{f"train@{a}": ["warmup"] for a in "abcd"},
         **{f"evaluate@{a}": [f"train@{a}"] for a in "abcd"},
         "report": ["warmup", *(f"evaluate@{a}" for a in "abcd")]}


def test_thread_demand_gives_a_stage_of_its_own_every_thread_and_a_matrix_item_its_share():
    assert thread_demand("warmup", 4, 2) == 4 and thread_demand("train@a-0", 4, 2) == 2
    assert thread_demand("train@a-0", 2, 4) == 1 and thread_demand("train@a-0", 2, 1) == 2


def test_stages_start_after_what_they_read_and_never_use_more_threads_than_given():
    rec = Recorder(slow="train@a")  # evaluate@b, after it in dvc.yaml, is ready first
    status = run_stages(GRAPH, rec, threads=2, jobs=2, echo=lambda _: None)
    assert status == {stage: 0 for stage in GRAPH}
    for stage, upstream in GRAPH.items():
        assert all(rec.ended[u] <= rec.started[stage] for u in upstream), stage
    assert rec.started["evaluate@b"] < rec.ended["train@a"]
    assert rec.most_threads == 2
    assert any(len(s) == 2 for s in rec.overlaps), "no two matrix items ran at once"
    # a stage of its own runs alone
    for alone in ("prepare", "warmup", "report"):
        assert all(s == {alone} for s in rec.overlaps if alone in s)


def test_one_job_runs_the_stages_one_at_a_time_in_dvc_yaml_order():
    rec = Recorder(seconds=0.01)
    run_stages(GRAPH, rec, threads=2, jobs=1, echo=lambda _: None)
    assert rec.order == list(GRAPH) and all(len(s) == 1 for s in rec.overlaps)


def test_a_failure_stops_new_starts_and_lets_the_running_finish():
    rec = Recorder(seconds=1.0, fail="train@a")  # a fails at once, b beside it runs for a second more
    status = run_stages(GRAPH, rec, threads=2, jobs=2, echo=lambda _: None)
    assert status["train@a"] == 1 and status["train@b"] == 0  # b ran beside a and finished
    assert "report" not in status and "evaluate@a" not in status and len(status) == 4


class Changed:
    """``changed`` for ``run_stages``: the stages changed at the start, and those a launch of ``trigger`` changes."""

    def __init__(self, initial: set[str], after: dict[str, set[str]] | None = None):
        self.initial, self.after, self.asked = initial, after or {}, []
        self.launched: list[str] = []

    def __call__(self, stages):
        self.asked.append(list(stages))
        now = set(self.initial) if len(self.asked) == 1 else set()
        for stage in self.launched:
            now |= self.after.get(stage, set())
        return {s for s in stages if s in now}


def test_a_stage_dvc_would_skip_is_never_launched():
    rec = Recorder(seconds=0.01)
    assert run_stages(GRAPH, rec, 2, 2, lambda _: None, Changed(set())) == {stage: 0 for stage in GRAPH}
    assert rec.order == []  # nothing changed: no process at all
    rec, changed = Recorder(seconds=0.01), Changed({"report"})
    run_stages(GRAPH, rec, 2, 2, lambda _: None, changed)
    assert rec.order == ["report"] and len(changed.asked) == 1


def test_the_stages_after_a_launched_one_are_asked_again_once_it_has_finished():
    changed = Changed({"warmup"}, after={"warmup": {"train@a", "train@b"}, "train@a": {"evaluate@a"}})

    def launch(stage, threads):
        changed.launched.append(stage)
        return 0

    run_stages(GRAPH, launch, 2, 2, lambda _: None, changed)
    assert changed.launched[0] == "warmup" and set(changed.launched) == {"warmup", "train@a", "train@b",
                                                                         "evaluate@a"}
    assert changed.asked[1] == ["train@a", "train@b", "train@c", "train@d"]  # warmup ran: its readers again
    assert all("prepare" not in asked for asked in changed.asked[1:])  # skipped before anything ran: not again


def test_when_dvc_cannot_say_what_changed_every_stage_is_launched():
    def broken(stages):
        raise RuntimeError("dvc.lock unreadable")

    lines, rec = [], Recorder(seconds=0.01)
    run_stages(GRAPH, rec, 2, 2, lines.append, broken)
    assert sorted(rec.order) == sorted(GRAPH) and "could not ask DVC what changed" in lines[0]


def test_bad_counts_and_a_cycle_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        run_stages(GRAPH, Recorder(), threads=0, jobs=1)
    with pytest.raises(ValueError, match="never start"):
        run_stages({"a": ["b"], "b": ["a"]}, Recorder(), threads=1, jobs=1, echo=lambda _: None)


# ---- the command on a real DVC repository ----------------------------------------------------------------------
STAMP = ("python -c \"import json, os, sys, time; s = time.time(); time.sleep({sleep}); "
         "json.dump({{'start': s, 'end': time.time(), 'threads': os.environ.get('OMP_NUM_THREADS')}}, "
         "open(sys.argv[1], 'w'))\" {out}")


def _repository(root: Path, fail: bool = False) -> Path:
    subprocess.run([BIN / "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    items = ["a", "b", "c", "d"]
    stages = {
        "prepare": {"cmd": STAMP.format(sleep=0, out="prepare.json"), "outs": ["prepare.json"]},
        "work": {"matrix": {"name": items},
                 "cmd": ("exit 3; " if fail else "") + STAMP.format(sleep=2, out="work-${item.name}.json"),
                 "deps": ["prepare.json"], "outs": ["work-${item.name}.json"]},
        "final": {"cmd": STAMP.format(sleep=0, out="final.json"), "deps": [f"work-{i}.json" for i in items],
                  "outs": ["final.json"]},
    }
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return root


def _stamps(root: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in root.glob("*.json")}


def test_the_command_runs_matrix_items_side_by_side_and_dvc_records_every_stage(tmp_path, monkeypatch, capfd):
    root = _repository(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    assert list(stage_graph(root)) == ["prepare", "work@a", "work@b", "work@c", "work@d", "final"]
    assert main(["--jobs", "2"], root=root) == 0
    stamps = _stamps(root)
    assert {k: v["threads"] for k, v in stamps.items()} == {
        "prepare": "2", "final": "2", **{f"work-{i}": "1" for i in "abcd"}}
    work = sorted((v["start"], v["end"]) for k, v in stamps.items() if k.startswith("work"))
    assert sum(1 for (_, end), (start, _) in zip(work, work[1:]) if start < end) >= 2, "the items did not overlap"
    logs = root / ".dvc" / "tmp" / "repro"
    assert (logs / "work@a.log").exists() and not (logs / "prepare.log").exists()  # a stage of its own: terminal
    assert "Running stage 'prepare'" in capfd.readouterr().out
    # DVC recorded each stage: nothing left to run, and a second run changes nothing
    status = subprocess.run([BIN / "dvc", "status"], cwd=root, capture_output=True, text=True, check=True)
    assert "up to date" in status.stdout, status.stdout
    assert set(yaml.safe_load((root / "dvc.lock").read_text())["stages"]) == {
        "prepare", "final", *(f"work@{i}" for i in "abcd")}
    shutil.rmtree(logs)
    assert main(["--jobs", "2"], root=root) == 0 and _stamps(root) == stamps
    assert not logs.exists()  # nothing changed: no stage launched
    # a changed command: that stage alone runs again
    (root / "dvc.yaml").write_text((root / "dvc.yaml").read_text().replace("final.json", "final2.json"))
    assert main(["--jobs", "2"], root=root) == 0
    again = _stamps(root)
    assert {k: again[k] for k in stamps if k != "final"} == {k: v for k, v in stamps.items() if k != "final"}
    assert "final2" in again and not logs.exists()
    # a target takes its pipeline only
    assert list(stage_graph(root, ["work@b"])) == ["prepare", "work@b"]


def test_the_command_stops_at_a_failed_stage_and_names_its_log(tmp_path, monkeypatch, capsys):
    root = _repository(tmp_path, fail=True)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    assert main(["--jobs", "2"], root=root) == 1
    err = capsys.readouterr().err
    # the two items that ran side by side both failed; the others never started
    assert "failed: work@a (see .dvc/tmp/repro/work@a.log), work@b (see .dvc/tmp/repro/work@b.log); " \
           "stages not started: 3" in err, err
    assert not (root / "final.json").exists() and not list(root.glob("work-*.json"))


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sigterm_stops_the_running_stages_and_exits_130(tmp_path):
    root = _repository(tmp_path)
    (root / "dvc.yaml").write_text((root / "dvc.yaml").read_text().replace("time.sleep(2)", "time.sleep(120)"))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = f"import sys; from pathlib import Path; from flows.repro import main; sys.exit(main(['--jobs', '2'], " \
           f"root=Path({str(root)!r})))"
    runner = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    deadline = time.monotonic() + 120
    while len(list((root / ".dvc" / "tmp" / "repro").glob("work@*.log"))) < 2:  # both items started
        assert time.monotonic() < deadline and runner.poll() is None, runner.communicate()
        time.sleep(0.2)
    time.sleep(3)  # their commands running
    runner.terminate()
    out, err = runner.communicate(timeout=60)
    assert runner.returncode == 130 and "interrupted" in err, err
    left = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count("time.sleep(120)")]
    assert not left, f"stage processes left running: {left}"
    assert not list(root.glob("work-*.json"))
