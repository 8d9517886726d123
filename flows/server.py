"""Start, check and stop a local Prefect server on 127.0.0.1 for the pipeline's stages.

Each DVC stage is a separate process; without a server configured, every process would start its own
temporary Prefect server (5-20 s each). ``ensure`` starts one server in the background (state under
``PREFECT_HOME``), waits until it answers, and prints the ``PREFECT_API_URL`` to export; ``stop`` ends it.
Schedules (``flows.pipeline serve``) need such a real server too.

Usage:
    python -m flows.server ensure [--port 4200]   # start if not running; prints the API URL
    python -m flows.server stop
    python -m flows.server status
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows.common import REPO_ROOT, end_process, setup_process_env

PID_FILE = REPO_ROOT / ".prefect" / "server.pid"
LOG_FILE = REPO_ROOT / ".prefect" / "server.log"


def api_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api"


def is_healthy(port: int, timeout: float = 2.0) -> bool:
    """True when a Prefect server answers ``/api/health`` on 127.0.0.1:port."""
    try:
        with urllib.request.urlopen(f"{api_url(port)}/health", timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


def ensure(port: int, wait_s: float = 120.0) -> str:
    """Start a server on 127.0.0.1:port unless one answers there; return its API URL.

    Raises:
        RuntimeError: the server did not answer within ``wait_s`` (its log file is named).
    """
    setup_process_env()
    if is_healthy(port):
        return api_url(port)
    PID_FILE.parent.mkdir(parents=True, exist_ok=True)
    prefect = Path(sys.executable).with_name("prefect")
    cmd = [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with open(LOG_FILE, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=os.environ.copy())
    PID_FILE.write_text(f"{proc.pid} {port}\n")
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if is_healthy(port):
            return api_url(port)
        if proc.poll() is not None:
            break
        time.sleep(1.0)
    stop()
    raise RuntimeError(f"Prefect server on 127.0.0.1:{port} did not start; see {LOG_FILE}")


def stop() -> bool:
    """Stop the server started by ``ensure`` (its whole process group). Returns whether one was running."""
    if not PID_FILE.exists():
        return False
    pid = int(PID_FILE.read_text().split()[0])
    PID_FILE.unlink(missing_ok=True)
    return end_process(pid, group=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["ensure", "stop", "status"])
    parser.add_argument("--port", type=int, default=int(os.environ.get("TRACE_PREFECT_PORT", "4200")))
    args = parser.parse_args(argv)
    if args.action == "ensure":
        print(ensure(args.port))
    elif args.action == "stop":
        print("stopped" if stop() else "no server started by flows.server")
    else:
        print("up" if is_healthy(args.port) else "down")


if __name__ == "__main__":
    main()
