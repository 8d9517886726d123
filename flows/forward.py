"""The stage command's side of ``flows.preload``: offer the stage to the preloaded server, or run it here.

``forward_stage`` runs first in every ``python -m flows.<stage>`` (``flows/__init__.py``). Standard library only
(``socket``, ``struct``, ``signal``), and it returns at once when ``TRACE_PRELOAD`` is unset, so a plain stage pays
nothing for it. The rules of when a
stage runs forked and when plain are ``flows.preload``'s.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_KEY = "TRACE_PRELOAD"
# the stage modules of dvc.yaml (tests/test_preload.py checks the two agree)
STAGE_MODULES = frozenset({"flows.check_params", "flows.prepare", "flows.warmup", "flows.seed_rollouts",
                           "flows.fit_predictor", "flows.train", "flows.evaluate", "flows.report"})
# variables that differ between stages without changing what an import does
_IGNORED_ENV = ("PWD", "OLDPWD", "SHLVL", "_", ENV_KEY)
# the thread count the forked child sets itself (torch.set_num_threads) when it is a whole number >= 1 on both sides
THREADS_ENV = "OMP_NUM_THREADS"


def thread_count(environ) -> int | None:
    """``OMP_NUM_THREADS`` of ``environ`` as a whole number >= 1; ``None`` when unset or anything else."""
    value = environ.get(THREADS_ENV, "")
    return int(value) if value.isdigit() and int(value) >= 1 else None


def _fingerprint_env(environ) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in _IGNORED_ENV and not k.startswith("DVC_")}
    if thread_count(environ) is not None:
        env[THREADS_ENV] = "a count"  # any count forks: the child sets it (flows.preload)
    return env


def stage_identity(environ, cwd: str | None = None) -> dict:
    """What must equal between a stage command and the server for the stage to run forked: the interpreter,
    the checkout, the working directory (``python -m`` puts it first on ``sys.path``) and the environment."""
    return {"executable": sys.executable, "prefix": sys.prefix, "root": str(REPO_ROOT), "cwd": cwd or os.getcwd(),
            "env": _fingerprint_env(environ)}


def request_identity(request: dict) -> dict:
    """``stage_identity`` of the command that sent ``request``."""
    return {**{k: request.get(k) for k in ("executable", "prefix", "root", "cwd")},
            "env": _fingerprint_env(request.get("environ") or {})}


def mismatch(ours: dict, theirs: dict) -> str:
    """Why a command of identity ``theirs`` must run plain on a server of identity ``ours`` ("" = it may fork)."""
    for key in ("executable", "prefix", "root", "cwd"):
        if ours[key] != theirs[key]:
            return f"another {key}: {theirs[key]} (server: {ours[key]})"
    differ = sorted(k for k in set(ours["env"]) | set(theirs["env"]) if ours["env"].get(k) != theirs["env"].get(k))
    return f"environment differs in {', '.join(differ[:5])}" if differ else ""


# ---- the wire: an 8-byte length, then JSON; descriptors ride on the first message -------------------------
def send_message(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    import json

    data = json.dumps(message).encode()
    frame = struct.pack("!Q", len(data)) + data
    sent = socket.send_fds(conn, [frame], list(fds)) if fds else conn.send(frame)
    if sent < len(frame):
        conn.sendall(frame[sent:])


def _receive_exactly(conn: socket.socket, size: int, fds: list[int], max_fds: int) -> bytes | None:
    """``size`` bytes, no more (a later message may follow in the stream); None when the peer closed first."""
    buffer = b""
    while len(buffer) < size:
        if max_fds and not fds:
            chunk, got, _, _ = socket.recv_fds(conn, size - len(buffer), max_fds)
            fds.extend(got)
        else:
            chunk = conn.recv(size - len(buffer))
        if not chunk:
            return None
        buffer += chunk
    return buffer


def receive_message(conn: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors that came with it; ``(None, [])`` when the peer closed first.

    Reads exactly one frame, so a message sent right after it stays in the stream for the next call. The
    descriptors received are closed when the message is incomplete or not valid JSON (which is raised).
    """
    import json

    fds: list[int] = []
    try:
        header = _receive_exactly(conn, 8, fds, max_fds)
        data = header and _receive_exactly(conn, struct.unpack("!Q", header)[0], fds, max_fds)
        if data is None:
            raise EOFError
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError(f"a message must be a JSON object, got {type(message).__name__}")
        return message, fds
    except BaseException as err:
        for fd in fds:
            os.close(fd)
        if isinstance(err, EOFError):
            return None, []
        raise


# ---- the stage command's side --------------------------------------------------------------------------------
def stage_module(orig_argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module, arguments)`` when ``orig_argv`` is ``python -m <stage module> [arguments]``.

    An interpreter option before ``-m`` (``-u``, ``-O``, ``-W error``, ``-X dev``, ...) changes how the stage runs,
    and a forked child has the server's: such a command runs plain (None).
    """
    if len(orig_argv) >= 3 and orig_argv[1] == "-m" and orig_argv[2] in STAGE_MODULES:
        return orig_argv[2], orig_argv[3:]
    return None


def run_forwarded(socket_path: str, module: str, args: list[str], *, environ=None, cwd: str | None = None,
                  log=None, timeout: float = 30.0) -> int | None:
    """Run ``module`` with ``args`` in a child of the server at ``socket_path``; return its exit status.

    This process's standard input, output and error become the child's. The child leads its own process group;
    SIGINT, SIGTERM and SIGHUP received meanwhile go to that group (the stage and what it started, as a
    terminal's Ctrl-C reaches a plain process and its children), except those this process ignores, which the
    child ignores too (``nohup``).

    Returns:
        The child's exit status (130 after Ctrl-C; 1 when it died without reporting one, e.g. SIGKILL), or None
        when the stage must run here instead: no server answers within ``timeout`` seconds, or it refused (``log``
        gets the reason).
    """
    environ = os.environ if environ is None else environ
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    ignored = [int(sig) for sig in forwarded if signal.getsignal(sig) == signal.SIG_IGN]
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(timeout)
        conn.connect(socket_path)
        request = {"module": module, "args": list(args), "cwd": cwd or os.getcwd(), "executable": sys.executable,
                   "prefix": sys.prefix, "root": str(REPO_ROOT), "environ": dict(environ), "ignored": ignored}
        send_message(conn, request, [0, 1, 2])
        reply, _ = receive_message(conn)
    except (OSError, ValueError):  # no server, a wedged one, or a garbled reply: run here
        return None
    with conn:
        if reply is None or "plain" in reply:
            if log and reply:
                log(f"flows.preload: {module} runs in its own process: {reply['plain']}")
            return None
        pid = reply["pid"]
        conn.settimeout(None)
        handlers = {sig: signal.signal(sig, lambda signum, frame: _pass_on(pid, signum))
                    for sig in forwarded if int(sig) not in ignored}
        try:
            reply, _ = receive_message(conn)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    if reply is None:
        print(f"flows.preload: the stage process {pid} of {module} ended without an exit status (killed)",
              file=sys.stderr)
        return 1
    return int(reply["exit"])


def _pass_on(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def forward_stage() -> None:
    """Called first by ``flows/__init__.py``: with ``TRACE_PRELOAD`` set and this process started as ``python -m
    <stage module>``, run the stage in the server and exit with its status; otherwise return at once."""
    socket_path = os.environ.get(ENV_KEY)
    if not socket_path:
        return
    target = stage_module(list(getattr(sys, "orig_argv", [])))
    if target is None:
        return
    status = run_forwarded(socket_path, *target, log=lambda line: print(line, file=sys.stderr))
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
