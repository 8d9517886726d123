"""Stage processes started from a preloaded interpreter: torch, transformers, DeepSpeed, Prefect and MLflow
imported once per run instead of once per stage.

DVC starts every stage as a new process (``python -m flows.train ...``), and each spends seconds importing its
libraries before its first line of work, most of the work of an ``evaluate@`` stage. ``make run`` therefore
starts one server (``python -m flows.preload ensure``) that imports those libraries once and listens on a Unix
socket of the repository (``.prefect/preload.sock``, mode 0600), and exports its path as ``TRACE_PRELOAD``. A
stage command then forwards itself (``flows.forward.forward_stage``, called by ``flows/__init__.py`` before any
other import): it sends its arguments, working directory, environment and its standard input, output and error
(the file descriptors themselves) to the server, which forks a child that runs the stage module as
``__main__`` exactly as ``python -m`` would, with that environment and those descriptors. The command passes on
the signals it gets (Ctrl-C, ``kill``) to the child and exits with the child's status; the child ends when the
command dies.

A stage runs as a plain process instead, the same code in a new interpreter, whenever forwarding could change
what it computes or where it writes: ``TRACE_PRELOAD`` unset or no server answering; a module that is not a
stage of ``dvc.yaml``; another interpreter, checkout or working directory than the server's; or an environment
that differs from the server's in any variable other than DVC's own (``DVC_*``) and the shell's bookkeeping,
since libraries read some (DeepSpeed's accelerator) when they are imported. The thread count is the exception:
a stage whose ``OMP_NUM_THREADS`` is another whole number than the server's forks, and the child sets torch's
threads to it (``torch.set_num_threads``, what torch takes from the variable as it starts), so ``flows.repro``
can run stages on different thread counts against one server. Nothing is preloaded where
a GPU is visible (CUDA does not survive a fork) or outside Linux. The child reseeds Python's and NumPy's global
generators from the OS, as a new process would; every stream the pipeline's results depend on is seeded from the
params.

Usage:
    python -m flows.preload ensure    # start unless one serves this checkout; prints the socket path ("" if none)
    python -m flows.preload stop
    python -m flows.preload status
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import Sequence

from flows.forward import (ENV_KEY, REPO_ROOT, mismatch, receive_message, request_identity, send_message,
                           stage_identity, thread_count)

STATE_DIR = REPO_ROOT / ".prefect"  # preload.sock, preload.pid, preload.log
SOCKET_PATH = STATE_DIR / "preload.sock"
# imported by the server before it serves: what the stages import (never a stage module itself, so each runs
# from its first line as python -m runs it)
PRELOAD = ("torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "peft", "deepspeed", "prefect",
           "prefect.flow_engine", "mlflow", "mlflow.store.tracking.sqlalchemy_store", "flows.common",
           "flows.prefect_runs", "trace.configuration.params_file", "trace.training.loop", "trace.training.warmup",
           "trace.training.evaluation", "trace.update", "trace.tracking", "trace.reporting.report",
           # imported inside the functions that need them (a second each for sklearn and matplotlib)
           "sklearn.metrics", "scipy.stats", "scipy.optimize", "scipy.special", "matplotlib", "matplotlib.pyplot")


# ---- the server's side ---------------------------------------------------------------------------------------
def serve(socket_path: Path = SOCKET_PATH, preload=PRELOAD) -> None:
    """Import ``preload``, then fork one child per stage command at ``socket_path`` until SIGTERM.

    One thread only: the server forks from the thread that imported everything, so no lock of another thread
    can be held in a child. Children are reaped between requests. Once the code it imported from the checkout
    changes on disk, the server refuses (the stages run plain) and ``ensure`` replaces it.
    """
    import importlib

    os.environ.pop(ENV_KEY, None)
    identity = stage_identity(os.environ)
    before = dict(os.environ)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as err:
            _log(f"not preloaded: {name} ({err})")
    # what the imports set (e.g. sklearn's KMP_DUPLICATE_LIB_OK): a new process that imports them has it too
    added = {k: v for k, v in os.environ.items() if k not in before}
    code = _code_state()
    socket_path = Path(socket_path)
    socket_path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is this user's only: a client hands over its descriptors
    try:
        server.bind(str(socket_path))
    finally:
        os.umask(old_umask)
    bound = socket_path.stat().st_ino
    server.listen(64)
    server.settimeout(1.0)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    _log(f"serving {socket_path} (pid {os.getpid()})")
    try:
        while True:
            _reap()
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            with conn:
                try:
                    _handle(conn, server, identity, code, added)
                except Exception as err:  # noqa: BLE001 - one bad or vanished command: serve the next one
                    _log(f"request dropped: {err!r}")
    finally:
        server.close()
        try:
            if socket_path.stat().st_ino == bound:  # a successor's socket at the same path stays
                socket_path.unlink()
        except FileNotFoundError:
            pass


def _code_state() -> dict[str, tuple[int, int]]:
    """``{file: (mtime_ns, size)}`` of every module imported from the checkout."""
    state = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).is_relative_to(REPO_ROOT):
            try:
                info = os.stat(path)
            except OSError:
                continue
            state[path] = (info.st_mtime_ns, info.st_size)
    return state


def _stale(code: dict[str, tuple[int, int]]) -> str:
    """The first preloaded file of the checkout changed on disk since the server imported it ("" = none)."""
    for path, seen in code.items():
        try:
            info = os.stat(path)
        except OSError:
            return path
        if (info.st_mtime_ns, info.st_size) != seen:
            return path
    return ""


def _handle(conn: socket.socket, server: socket.socket, identity: dict, code: dict, added: dict) -> None:
    conn.settimeout(10.0)
    request, fds = receive_message(conn, max_fds=3)
    try:
        if request is None:
            return
        changed = _stale(code)
        if "ping" in request:
            send_message(conn, {"pong": os.getpid(), "stale": changed, **identity})
            return
        if changed:
            reason = f"{changed} changed since the server imported it (`python -m flows.preload ensure` restarts it)"
        elif len(fds) != 3:
            reason = "not given three descriptors"
        else:
            reason = mismatch(identity, request_identity(request))
        if reason:
            _log(f"{request.get('module')}: plain ({reason})")
            send_message(conn, {"plain": reason})
            return
        sys.stdout.flush()  # nothing of the server's own output may reach the child's descriptors
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the server's handler must not run in the child
        pid = -1
        try:
            pid = os.fork()
        finally:
            if pid != 0:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if pid == 0:
            try:
                server.close()
                _child(conn, request, fds, added)
            finally:
                os._exit(1)
        _log(f"{request['module']} {' '.join(request['args'])}: pid {pid}")
    finally:
        for fd in fds:
            os.close(fd)


def _child(conn: socket.socket, request: dict, fds: list[int], added: dict) -> None:
    """The stage, run in the forked child as ``python -m`` runs it; never returns."""
    import atexit
    import ctypes
    import random
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # its own group: the command passes signals on to the stage and what it starts
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in request.get("ignored", []):  # what the command ignores (nohup), the stage ignores
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        fds.clear()
        # buffered as a new interpreter buffers them: stdout by line on a terminal, stderr always by line
        sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
        sys.stderr.reconfigure(line_buffering=True)
        os.environ.clear()
        os.environ.update({k: v for k, v in request["environ"].items() if k != ENV_KEY})
        for key, value in added.items():
            os.environ.setdefault(key, value)
        threads = thread_count(os.environ)
        if threads is not None and "torch" in sys.modules and sys.modules["torch"].get_num_threads() != threads:
            sys.modules["torch"].set_num_threads(threads)  # what torch reads from OMP_NUM_THREADS as it starts
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        conn.settimeout(None)
        send_message(conn, {"pid": os.getpid()})
        # the command died (its socket closed): end the stage as its own process would have ended with it
        threading.Thread(target=_end_with_peer, args=(conn,), daemon=True).start()
        sys.argv = [request["module"], *request["args"]]
        sys.orig_argv = [sys.executable, "-m", request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 130
        except BaseException:  # noqa: BLE001 - a stage's uncaught error: its traceback, status 1, as python -m
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as interpreter exit does: wait for the stage's non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            ctypes.CDLL(None).fflush(None)  # C-level output of extensions, as interpreter exit flushes it
        except (OSError, AttributeError):
            pass
        try:
            send_message(conn, {"exit": code})
        except OSError:
            pass
        os._exit(code)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _end_with_peer(conn: socket.socket) -> None:
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.killpg(os.getpid(), signal.SIGTERM)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _log(line: str) -> None:
    import time

    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


# ---- start, check, stop ------------------------------------------------------------------------------------
def ping(socket_path: Path = SOCKET_PATH, timeout: float = 2.0) -> dict | None:
    """The identity of the server answering at ``socket_path`` (with its pid as ``pong``), or None."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(str(socket_path))
            send_message(conn, {"ping": 1})
            reply, _ = receive_message(conn)
            return reply
    except (OSError, ValueError):
        return None


def ensure(folder: Path = STATE_DIR, wait_s: float = 120.0, preload: Sequence[str] | None = None) -> str:
    """Start a server unless one with this process's identity answers at ``folder/preload.sock``; return the socket.

    A server of another interpreter, checkout or environment, or one whose code changed on disk, is replaced. Returns "" (stages then run
    as plain processes) on an operating system other than Linux, where a GPU is visible, where the socket's path is
    too long for a Unix socket, or when the server did not answer within ``wait_s`` (``folder/preload.log`` says
    why).

    Args:
        folder: where the socket, ``preload.pid`` and ``preload.log`` live.
        preload: the modules to import (default ``PRELOAD``).
    """
    import subprocess
    import time

    socket_path = folder / "preload.sock"
    if sys.platform != "linux" or Path("/dev/nvidiactl").exists() or len(str(socket_path)) > 100:
        return ""  # macOS: a fork of a process that loaded system frameworks may crash; GPUs: CUDA and fork
    environ = {k: v for k, v in os.environ.items() if k != ENV_KEY}
    running = ping(socket_path)
    if running is not None:
        theirs = {k: running.get(k) for k in ("executable", "prefix", "root", "cwd", "env")}
        if not running.get("stale") and not mismatch(stage_identity(environ, str(REPO_ROOT)), theirs):
            return str(socket_path)
        stop(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flows.preload", "serve", "--socket", str(socket_path)]
    if preload is not None:
        cmd += ["--preload", ",".join(preload)]
    with open(folder / "preload.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=environ, cwd=REPO_ROOT)
    (folder / "preload.pid").write_text(f"{proc.pid}\n")
    deadline = time.time() + wait_s
    while time.time() < deadline and proc.poll() is None:
        if ping(socket_path) is not None:
            return str(socket_path)
        time.sleep(0.2)
    stop(folder)
    print(f"flows.preload: the server did not start, stages run as plain processes; see {folder / 'preload.log'}",
          file=sys.stderr)
    return ""


def stop(folder: Path = STATE_DIR) -> bool:
    """Stop the server that ``ensure`` started in ``folder`` (stages it runs carry on). Returns whether one ran."""
    pid_file = folder / "preload.pid"
    if not pid_file.exists():
        return False
    from flows.common import end_process

    pid = int(pid_file.read_text().split()[0])
    pid_file.unlink(missing_ok=True)
    return end_process(pid)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["ensure", "stop", "status", "serve"])
    parser.add_argument("--socket", default=str(SOCKET_PATH), help="serve: the socket's path")
    parser.add_argument("--preload", default=None, help="serve: modules to import, comma-separated (default PRELOAD)")
    args = parser.parse_args(argv)
    if args.action == "ensure":
        print(ensure())
    elif args.action == "stop":
        print("stopped" if stop() else "no server started by flows.preload")
    elif args.action == "status":
        print("up" if ping() is not None else "down")
    else:
        serve(Path(args.socket), PRELOAD if args.preload is None else tuple(filter(None, args.preload.split(","))))


if __name__ == "__main__":
    main()
