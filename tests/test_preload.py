"""flows.preload and flows.forward: stage commands run in forks of a preloaded interpreter, or plain.

The server runs as its own process on a socket in a temporary folder; the commands are real processes, so
descriptors, signals and exit statuses cross real process boundaries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from flows.forward import STAGE_MODULES, mismatch, stage_module

REPO = Path(__file__).resolve().parents[1]
PROBE = '''
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv[1:],
                  "marker": os.environ.get("PROBE_MARKER"), "name": __name__}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("probe failed")
if mode == "threads":
    import torch
    print(json.dumps({"threads": torch.get_num_threads()}), flush=True)
if mode == "spawn":
    import subprocess
    sleeper = subprocess.Popen(["sleep", "120"])
    with open(sys.argv[2], "w") as f:
        f.write(f"{os.getpid()} {sleeper.pid}")
    sleeper.wait()
if mode == "sleep":
    print("sleeping")  # not flushed: a terminal sees it at once only when stdout is line-buffered
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
'''
# the command's side in its own process: run_forwarded's status, 100 when the stage would run plain
CLIENT = ("import sys; from flows.forward import run_forwarded; "
          "s = run_forwarded(sys.argv[1], sys.argv[2], sys.argv[3:], log=lambda m: print(m, file=sys.stderr)); "
          "sys.exit(100 if s is None else s)")


def test_stage_module_reads_python_dash_m_of_a_stage_only():
    assert stage_module(["python", "-m", "flows.train", "--seed", "1"]) == ("flows.train", ["--seed", "1"])
    # an interpreter option would not reach a forked child: such a command runs plain
    assert stage_module(["python", "-X", "importtime", "-m", "flows.evaluate"]) is None
    assert stage_module(["python", "-u", "-m", "flows.evaluate"]) is None
    assert stage_module(["python", "-m", "flows.grid", "worker"]) is None
    assert stage_module(["python", "-c", "import flows", "-m", "flows.train"]) is None
    assert stage_module(["python", "script.py", "-m", "flows.train"]) is None


def test_the_stage_modules_are_those_of_dvc_yaml():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    modules = {stage["cmd"].split()[2] for stage in stages.values()}
    assert modules == STAGE_MODULES


def test_a_message_right_behind_another_is_not_lost():
    """The stage's pid and its exit status can arrive in one read: each receive takes one frame."""
    import socket

    from flows.forward import receive_message, send_message

    left, right = socket.socketpair()
    with left, right:
        send_message(left, {"pid": 1})
        send_message(left, {"exit": 3})
        left.close()
        assert receive_message(right) == ({"pid": 1}, [])
        assert receive_message(right) == ({"exit": 3}, [])
        assert receive_message(right) == (None, [])


def test_a_preloaded_file_changed_on_disk_is_stale(tmp_path):
    from flows.preload import _stale

    module = tmp_path / "m.py"
    module.write_text("x = 1\n")
    info = module.stat()
    code = {str(module): (info.st_mtime_ns, info.st_size)}
    assert _stale(code) == ""
    module.write_text("x = 22\n")
    assert _stale(code) == str(module)


def test_mismatch_names_what_differs():
    ours = {"executable": "/v/python", "prefix": "/v", "root": "/r", "cwd": "/r", "env": {"A": "1", "B": "2"}}
    assert mismatch(ours, {**ours}) == ""
    assert "OMP_NUM_THREADS" in mismatch(ours, {**ours, "env": {"A": "1", "B": "2", "OMP_NUM_THREADS": "1"}})
    assert "B" in mismatch(ours, {**ours, "env": {"A": "1"}})
    assert "cwd" in mismatch(ours, {**ours, "cwd": "/elsewhere"})


def _default_signals(*ignored: int):
    """A command's signals as a terminal starts one (a shell's background job inherits SIGINT ignored, and the
    stage would then rightly ignore Ctrl-C too), except ``ignored``."""
    def reset():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
    return reset


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class Server:
    """A preload server on a socket of a short temporary folder, started with ``env`` from the repository."""

    def __init__(self, env: dict, preload: tuple[str, ...]):
        self.dir = Path(tempfile.mkdtemp(prefix="pl-", dir="/tmp"))
        self.socket = str(self.dir / "s.sock")
        self.log = self.dir / "server.log"
        self.env = env
        code = f"from flows.preload import serve; serve({self.socket!r}, preload={preload!r})"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        from flows.preload import ping

        self.identity = _wait_for(lambda: ping(Path(self.socket)), 180, f"the server ({self.log.read_text()})")

    def client(self, module: str, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
        popen.setdefault("preexec_fn", _default_signals())
        return subprocess.Popen([sys.executable, "-c", CLIENT, self.socket, module, *args], cwd=REPO,
                                env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def probe_server():
    folder = Path(tempfile.mkdtemp(prefix="probe-", dir="/tmp"))
    (folder / "probe_stage.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(folder)]), "PROBE_MARKER": "m1"}
    env.pop("TRACE_PRELOAD", None)
    env.pop("PYTHONUNBUFFERED", None)  # streams buffered as by default, so the buffering test can fail
    server = Server(env, preload=("json",))
    yield server
    server.close()


def test_a_forwarded_stage_runs_in_a_child_of_the_server_with_the_commands_directory_environment_and_output(
        probe_server):
    proc = probe_server.client("probe_stage", "ok", "--flag")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = json.loads(out.splitlines()[0])
    assert seen["ppid"] == probe_server.identity["pong"] and seen["pid"] != proc.pid
    assert seen["cwd"] == str(REPO) and seen["argv"] == ["ok", "--flag"] and seen["name"] == "__main__"
    assert seen["marker"] == "m1" and "to stderr" in err


@pytest.mark.parametrize("mode, status, message", [("exit3", 3, ""), ("raise", 1, "RuntimeError: probe failed")])
def test_the_commands_exit_status_is_the_stages(probe_server, mode, status, message):
    proc = probe_server.client("probe_stage", mode)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status and message in err


def test_a_command_whose_environment_differs_runs_plain_and_says_why(probe_server):
    proc = probe_server.client("probe_stage", "ok", env={**probe_server.env, "PROBE_MARKER": "m2"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 100 and out == "" and "environment differs in PROBE_MARKER" in err, err
    # a thread count that is no whole number >= 1 is a difference like any other
    proc = probe_server.client("probe_stage", "ok", env={**probe_server.env, "OMP_NUM_THREADS": "two"})
    assert proc.communicate(timeout=60)[0] == "" and proc.returncode == 100
    # DVC's own variables and the shell's bookkeeping do not count
    proc = probe_server.client("probe_stage", "ok", env={**probe_server.env, "DVC_ROOT": "/x", "PWD": "/y"})
    assert proc.communicate(timeout=60)[0] and proc.returncode == 0


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 1)])
def test_signals_to_the_command_reach_the_stage(probe_server, tmp_path, signum, status):
    marker = tmp_path / "pid"
    proc = probe_server.client("probe_stage", "sleep", str(marker))
    child = int(_wait_for(lambda: marker.exists() and marker.read_text(), 60, "the stage to start"))
    proc.send_signal(signum)
    proc.communicate(timeout=60)
    assert proc.returncode == status
    _wait_for(lambda: not _alive(child), 30, "the stage to end")


def test_a_signal_reaches_what_the_stage_started_and_an_ignored_one_nothing(probe_server, tmp_path):
    """The stage leads its own process group, which gets the command's signals (a terminal's Ctrl-C reaches a plain
    stage's children too); a signal the command ignores (nohup) the stage ignores as well."""
    marker = tmp_path / "pids"
    proc = probe_server.client("probe_stage", "spawn", str(marker),
                               preexec_fn=_default_signals(signal.SIGHUP))
    stage, sleeper = map(int, _wait_for(lambda: marker.exists() and marker.read_text(), 60, "the stage").split())
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None and _alive(stage) and _alive(sleeper)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    _wait_for(lambda: not _alive(stage) and not _alive(sleeper), 30, "the stage and its child to end")


def test_the_stage_ends_when_its_command_is_killed(probe_server, tmp_path):
    marker = tmp_path / "pid"
    proc = probe_server.client("probe_stage", "sleep", str(marker))
    child = int(_wait_for(lambda: marker.exists() and marker.read_text(), 60, "the stage to start"))
    proc.kill()
    proc.wait(timeout=30)
    _wait_for(lambda: not _alive(child), 30, "the orphaned stage to end")


@pytest.mark.slow
def test_a_real_stage_forwarded_writes_what_it_writes_as_a_plain_process(tmp_path):
    """``python -m flows.check_params`` with ``TRACE_PRELOAD`` set runs in the server (its log says so) with the
    default preload list (every module imports), and writes the same file as without it; a bad param exits 1
    with the same message either way."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRACE_PRELOAD", None)
    server = Server(env, preload=__import__("flows.preload", fromlist=["PRELOAD"]).PRELOAD)
    try:
        outputs = {}
        for how, extra in (("plain", {}), ("forwarded", {"TRACE_PRELOAD": server.socket})):
            out = tmp_path / how
            proc = subprocess.run([sys.executable, "-m", "flows.check_params", "--params",
                                   str(REPO / "tests" / "params_tiny.yaml"), "--out", str(out)], cwd=REPO,
                                  env={**env, **extra}, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr
            outputs[how] = out.read_bytes()
            bad = subprocess.run([sys.executable, "-m", "flows.check_params", "--params",
                                  str(REPO / "tests" / "params_tiny.yaml"), "-S", "update.lr=-1"], cwd=REPO,
                                 env={**env, **extra}, capture_output=True, text=True, timeout=300)
            outputs[how + " error"] = (bad.returncode, bad.stderr.strip().splitlines()[-1:])
        log = server.log.read_text()
        assert "flows.check_params --params" in log and "not preloaded" not in log, log
        assert outputs["plain"] == outputs["forwarded"]
        assert outputs["plain error"] == outputs["forwarded error"] and outputs["plain error"][0] == 1
    finally:
        server.close()


@pytest.mark.skipif(sys.platform != "linux" or Path("/dev/nvidiactl").exists(),
                    reason="ensure starts no server outside Linux or where a GPU is visible")
def test_a_command_with_another_thread_count_forks_and_its_stage_runs_on_that_many_threads(tmp_path):
    """flows.repro runs stages on 1 and on 2 threads against one server: each child takes its command's count."""
    (tmp_path / "probe_stage.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]), "OMP_NUM_THREADS": "2"}
    env.pop("TRACE_PRELOAD", None)
    server = Server(env, preload=("torch",))
    try:
        for threads in ("1", "2", "1"):
            proc = server.client("probe_stage", "threads", env={**env, "OMP_NUM_THREADS": threads})
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            lines = [json.loads(line) for line in out.splitlines()]
            assert lines[0]["ppid"] == server.identity["pong"], "ran plain, not forked"
            assert lines[1] == {"threads": int(threads)}
    finally:
        server.close()


def test_ensure_starts_one_server_reuses_it_and_replaces_one_of_another_environment(monkeypatch):
    from flows.preload import ensure, ping, stop

    folder = Path(tempfile.mkdtemp(prefix="en-", dir="/tmp"))
    socket_path = folder / "preload.sock"
    monkeypatch.delenv("TRACE_PRELOAD", raising=False)
    assert ensure(folder, preload=("json",)) == str(socket_path)
    first = ping(socket_path)["pong"]
    assert ensure(folder, preload=("json",)) == str(socket_path) and ping(socket_path)["pong"] == first
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # another thread count: the children set it, the server stays
    assert ensure(folder, preload=("json",)) == str(socket_path) and ping(socket_path)["pong"] == first
    monkeypatch.setenv("PROBE_OTHER", "7")  # what the stages would now run with: the server must match it
    assert ensure(folder, preload=("json",)) == str(socket_path)
    second = ping(socket_path)
    assert second["pong"] != first and second["env"]["PROBE_OTHER"] == "7"
    _wait_for(lambda: not _alive(first), 30, "the replaced server to end")
    assert stop(folder) and ping(socket_path) is None and not (folder / "preload.pid").exists()


def test_a_terminal_sees_each_line_of_the_stage_as_it_is_printed(probe_server, tmp_path):
    """stdout on a terminal is line-buffered in a new interpreter; the forked stage's must be too (the server's
    own stdout is a file, block-buffered)."""
    import pty
    import select

    controller, terminal = pty.openpty()
    marker = tmp_path / "pid"
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, probe_server.socket, "probe_stage", "sleep", str(marker)],
                            cwd=REPO, env=probe_server.env, stdout=terminal, stderr=subprocess.DEVNULL,
                            preexec_fn=_default_signals())
    os.close(terminal)
    try:
        seen = b""
        while b"sleeping" not in seen:
            ready, _, _ = select.select([controller], [], [], 30)
            assert ready, f"the stage's line did not reach the terminal while it runs: {seen!r}"
            seen += os.read(controller, 4096)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        os.close(controller)
