"""Every committed result says where it came from.

- Each run folder ``reports/runs/<name>-<commit>/`` has a ``README.md`` that names its commit and gives the
  command, the machine, the CPU (at least whether it had AVX-512; "not recorded" where it was not) and the time
  (a duration, or "not recorded").
- Each benchmark report ``reports/benchmarks/<name>.json`` has ``machine.cpu_model`` and ``machine.cpu_flags``
  (the float results of some benchmarks and the bf16 timings depend on the CPU kind); ``summary.json`` (written
  by ``benchmarks.run_all``) only gathers reports, so every report it lists must have them.
- The benchmark writer (``benchmarks.common.write_report`` through ``machine_info``) records them going forward.

The checks are functions of a repository root, run here on this repository and on broken scratch copies, so
that each one is seen to fail.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.common import CPU_FLAGS, cpu_record, machine_info, write_report

REPO = Path(__file__).resolve().parents[1]

README_WORDS = ("Command", "Machine", "CPU")
_DURATION = re.compile(r"\d[\d,.]*\s*(?:s|min|h|hours?|minutes?|seconds?)\b")


def run_folder_problems(root: Path) -> list[str]:
    """What the run folders under ``root/reports/runs/`` lack, one line per problem (empty: none)."""
    problems = []
    runs = root / "reports" / "runs"
    for folder in sorted(p for p in runs.iterdir() if p.is_dir()):
        readme = folder / "README.md"
        if not readme.is_file():
            problems.append(f"{folder.name}: no README.md")
            continue
        text = readme.read_text()
        commit = folder.name.rsplit("-", 1)[-1]
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            problems.append(f"{folder.name}: the folder name does not end in -<commit>")
        elif commit not in text:
            problems.append(f"{folder.name}: README.md does not name the commit {commit}")
        problems += [f"{folder.name}: README.md lacks {word!r}" for word in README_WORDS if word not in text]
        if not re.search(r"avx", text, re.IGNORECASE):
            problems.append(f"{folder.name}: README.md does not say whether the CPU had AVX-512 (or 'not recorded')")
        if not any(re.search(r"\btime\b", line, re.IGNORECASE)
                   and (_DURATION.search(line) or "not recorded" in line) for line in text.splitlines()):
            problems.append(f"{folder.name}: README.md has no line giving the time (a duration or 'not recorded')")
    return problems


def machine_problems(machine: object, where: str) -> list[str]:
    """What a report's ``machine`` record lacks: a CPU model, and the CPU flags as a list of flag names (``[]``
    only with ``cpu_flags_checked`` or ``cpu_flags_note`` saying which were looked for; None only with a note)."""
    if not isinstance(machine, dict):
        return [f"{where}: no machine record"]
    problems = []
    model = machine.get("cpu_model")
    if not isinstance(model, str) or not model.strip() or model == "unknown":
        problems.append(f"{where}: no machine.cpu_model")
    if "cpu_flags" not in machine:
        problems.append(f"{where}: no machine.cpu_flags")
        return problems
    flags = machine["cpu_flags"]
    if flags is None:
        if not machine.get("cpu_flags_note"):
            problems.append(f"{where}: machine.cpu_flags is null without a cpu_flags_note")
    elif not isinstance(flags, list) or not all(isinstance(f, str) and re.fullmatch(r"[a-z0-9_]+", f) for f in flags):
        problems.append(f"{where}: machine.cpu_flags is not a list of flag names: {flags!r}")
    elif not flags and not (machine.get("cpu_flags_checked") or machine.get("cpu_flags_note")):
        problems.append(f"{where}: machine.cpu_flags is empty without cpu_flags_checked or a cpu_flags_note")
    # machine_info always writes cpu_flags_checked: a record without it was filled in after the run, and says so
    if "cpu_flags_checked" not in machine and not str(machine.get("cpu_source", "")).startswith("back-filled"):
        problems.append(f"{where}: the CPU fields were not written by the run (no cpu_flags_checked) and "
                        "machine.cpu_source does not say they were back-filled, and from where")
    return problems


def benchmark_problems(root: Path) -> list[str]:
    """What the JSON files under ``root/reports/benchmarks/`` lack, one line per problem (empty: none)."""
    problems = []
    folder = root / "reports" / "benchmarks"
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "benchmark" in data:  # a report of benchmarks.common.write_report
            problems += machine_problems(data.get("machine"), path.name)
        elif isinstance(data, dict) and isinstance(data.get("runs"), dict):  # benchmarks.run_all's summary
            for name in data["runs"]:
                report = folder / f"{name}.json"
                if not report.is_file():
                    problems.append(f"{path.name}: lists {name}, whose report {report.name} is missing")
        else:
            problems.append(f"{path.name}: neither a benchmark report nor run_all's summary")
    return problems


# ---- this repository --------------------------------------------------------------------------------------
def test_every_run_folder_has_a_readme_with_command_commit_cpu_and_time():
    problems = run_folder_problems(REPO)
    assert not problems, "run folders without their provenance (see reports/runs/paper-7b664da/README.md):\n" + \
        "\n".join(problems)


def test_every_benchmark_report_records_the_cpu_model_and_flags():
    problems = benchmark_problems(REPO)
    assert not problems, "benchmark JSON without the CPU it ran on:\n" + "\n".join(problems)


# ---- the checks fail where they should: broken scratch copies of reports/ -----------------------------------
@pytest.fixture
def scratch(tmp_path):
    """A copy of this repository's reports/ (READMEs, JSON, Markdown; no plots) under ``tmp_path``."""
    shutil.copytree(REPO / "reports" / "runs", tmp_path / "reports" / "runs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(REPO / "reports" / "benchmarks", tmp_path / "reports" / "benchmarks",
                    ignore=shutil.ignore_patterns("*.png"))
    return tmp_path


def test_the_scratch_copy_passes_as_the_repository_does(scratch):
    assert run_folder_problems(scratch) == run_folder_problems(REPO)
    assert benchmark_problems(scratch) == benchmark_problems(REPO)


def test_a_run_folder_without_readme_fails(scratch):
    (scratch / "reports" / "runs" / "default-f314046" / "README.md").unlink()
    (scratch / "reports" / "runs" / "new-run-1234567").mkdir()
    assert set(run_folder_problems(scratch)) >= {"default-f314046: no README.md", "new-run-1234567: no README.md"}


@pytest.mark.parametrize("pattern, new, problem", [
    ("62d82c7", "<the commit>", "README.md does not name the commit 62d82c7"),
    ("Command", "Run", "README.md lacks 'Command'"),
    ("Machine", "Host", "README.md lacks 'Machine'"),
    ("CPU", "processor", "README.md lacks 'CPU'"),
    (r"avx[\w-]*", "vector units", "does not say whether the CPU had AVX-512"),
    (_DURATION.pattern + "|not recorded", "unknown", "has no line giving the time"),
])
def test_a_readme_without_commit_command_cpu_or_time_fails(scratch, pattern, new, problem):
    readme = scratch / "reports" / "runs" / "long-62d82c7" / "README.md"
    text, count = re.subn(pattern, new, readme.read_text(), flags=re.IGNORECASE)
    assert count
    readme.write_text(text)
    found = [p for p in run_folder_problems(scratch) if p.startswith("long-62d82c7:")]
    assert any(problem in p for p in found), found


@pytest.mark.parametrize("change, problem", [
    (lambda m: m.pop("cpu_model"), "no machine.cpu_model"),
    (lambda m: m.pop("cpu_flags"), "no machine.cpu_flags"),
    (lambda m: m.update(cpu_flags="avx512f"), "is not a list of flag names"),
    (lambda m: (m.update(cpu_flags=[]), m.pop("cpu_flags_note", None), m.pop("cpu_flags_checked", None)), "is empty without cpu_flags_checked"),
    (lambda m: (m.update(cpu_flags=None), m.pop("cpu_flags_note", None)), "is null without a cpu_flags_note"),
])
def test_a_benchmark_report_without_cpu_model_or_flags_fails(scratch, change, problem):
    path = scratch / "reports" / "benchmarks" / "orchestration.json"
    report = json.loads(path.read_text())
    change(report["machine"])
    path.write_text(json.dumps(report, indent=2) + "\n")
    assert any(p.startswith("orchestration.json:") and problem in p for p in benchmark_problems(scratch)), \
        benchmark_problems(scratch)


def test_a_back_filled_cpu_record_that_does_not_say_so_fails(scratch):
    path = scratch / "reports" / "benchmarks" / "lora_update.json"
    report = json.loads(path.read_text())
    assert report["machine"]["cpu_source"].startswith("back-filled") and "cpu_flags_checked" not in report["machine"]
    report["machine"].pop("cpu_source")
    path.write_text(json.dumps(report, indent=2) + "\n")
    assert any(p.startswith("lora_update.json:") and "does not say they were back-filled" in p
               for p in benchmark_problems(scratch)), benchmark_problems(scratch)


def test_a_run_readme_does_not_take_its_cpu_time_or_load_from_the_docs():
    """The docs quote the run folders; a folder that cites the docs for its own CPU, time or load cites itself."""
    cited = []
    for readme in sorted((REPO / "reports" / "runs").glob("*/README.md")):
        for line in readme.read_text().split("\n- "):
            if re.match(r"(CPU|Time|Load):", line) and re.search(r"docs/(results|benchmarks)\.md", line):
                cited.append(f"{readme.parent.name}: {line.splitlines()[0]}")
    assert not cited, cited


def test_a_summary_listing_a_missing_report_fails(scratch):
    (scratch / "reports" / "benchmarks" / "step_dtype.json").unlink()
    assert "summary.json: lists step_dtype, whose report step_dtype.json is missing" in benchmark_problems(scratch)


# ---- the writer records the CPU going forward ---------------------------------------------------------------
def test_cpu_record_reads_model_flags_and_memory():
    cpuinfo = ("processor\t: 0\nmodel name\t: Example CPU 1234 (32 cores)\n"
               "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile\nprocessor\t: 1\n"
               "model name\t: other\nflags\t\t: fpu\n")
    record = cpu_record(cpuinfo, "MemTotal:       24683784 kB\nMemFree: 1 kB\n")
    assert record["cpu_model"] == "Example CPU 1234 (32 cores)"
    assert record["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "avx512_vnni"]  # CPU_FLAGS order
    assert record["cpu_flags_checked"] == list(CPU_FLAGS) and record["memory_gib"] == 23.5
    assert cpu_record("model name : X\nflags : fpu sse2\n", "")["cpu_flags"] == []  # none of them: an empty list
    unreadable = cpu_record("", "")
    assert unreadable["cpu_flags"] is None and unreadable["cpu_flags_note"] and unreadable["memory_gib"] is None


def test_machine_info_on_this_machine_holds_its_cpu_model_and_flags():
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    machine = machine_info()
    assert not machine_problems(machine, "machine_info()")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    if names:
        assert machine["cpu_model"] == names[0]
    flags_line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags_line is not None:
        present = set(flags_line.split(":", 1)[1].split())
        assert machine["cpu_flags"] == [f for f in CPU_FLAGS if f in present]
    assert machine["cpu_count"] >= 1
    if Path("/proc/meminfo").is_file():
        assert machine["memory_gib"] > 0


def test_write_report_records_the_cpu_in_every_benchmark_json(tmp_path):
    """``write_report`` is where every benchmark writes its JSON: its machine record passes the checks above."""
    path = write_report("probe", tmp_path, {"n": 1}, {"headline": {}}, quick=True, started=0.0)
    report = json.loads(path.read_text())
    assert not machine_problems(report["machine"], path.name)
    assert set(report["machine"]) >= {"cpu_count", "cpu_model", "cpu_flags", "cpu_flags_checked", "memory_gib"}
