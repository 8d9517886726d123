"""Start the train stage under a launcher when the ``launch`` params ask for ranks (``torchrun``, ``deepspeed``).

``dvc.yaml`` runs ``python -m flows.train ...`` whatever the launch params say. With ``launch.launcher`` set,
that process does not train: it starts the launcher on the same module and arguments and exits with its exit
code, and each rank the launcher starts (``$WORLD_SIZE`` set, or ``TRACE_LAUNCHED=1``) trains. So one param
change (``dvc exp run -S launch.launcher=torchrun -S launch.num_processes=2``) runs a stage on several ranks,
with no edit of ``dvc.yaml``.

- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc_per_node N`` on this node (a free
  port is chosen; pass ``--nnodes``/``--rdzv-endpoint`` in ``launch.args`` to join a multi-node group).
- ``deepspeed``: DeepSpeed's runner with ``--no_local_rank`` (the stage parses ``--params``, ``--ablation``,
  ``--seed`` only): ``--num_gpus N`` on this node, or every node of ``launch.hostfile`` (reached over
  passwordless ssh/pdsh; the run folder must be on a file system every node sees). On CPU it sets
  ``LOCAL_SIZE=N``, the CPU accelerator's device count, so the runner accepts N local ranks.
  On one node without ``--master_port`` in ``launch.args`` it passes a port that was free (the runner's own
  default, 29500, is the same for every stage on the machine); rank 0 listens on it only seconds later, so
  where another process took it meanwhile (EADDRINUSE in the ranks' output) the launch is repeated on a new
  port, at most ``PORT_TRIES`` launches in all, each retry logged. A failed rendezvous ends the ranks before any step.

torchrun's ``--standalone`` rendezvous needs no such retry: its agent binds port 0 and holds the store the
ranks join. A single process binds no port at all (``trace.update.deepspeed_setup.init_process_group``).

On CPU the ranks share the cores: each rank gets ``OMP_NUM_THREADS // N`` threads (at least 1).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Sequence

LAUNCHED_VAR = "TRACE_LAUNCHED"
PORT_TRIES = 4  # launches of the deepspeed runner on new ports before a lost rendezvous port ends the stage
_PORT_IN_USE = ("EADDRINUSE", "address already in use")


def inside_launcher() -> bool:
    """This process is a rank a launcher started (or was told it is one)."""
    return os.environ.get(LAUNCHED_VAR) == "1" or "WORLD_SIZE" in os.environ


def launch_command(launch_cfg, module: str, argv: Sequence[str]) -> list[str] | None:
    """The launcher command line that runs ``python -m <module> <argv>`` on every rank, or None for one process.

    Args:
        launch_cfg: the ``launch`` section (``trace.configuration.config.LaunchConfig``).
        module: the stage module (``"flows.train"``).
        argv: the stage's own arguments (``--params``, ``--ablation``, ``--seed``).

    Returns:
        argv of the launcher (``sys.executable -m ...``), or None when ``launch.launcher`` is ``none``.
    """
    n = str(launch_cfg.num_processes)
    if launch_cfg.launcher == "none":
        return None
    if launch_cfg.launcher == "torchrun":
        args = list(launch_cfg.args)
        placement = [] if any(a.startswith(("--nnodes", "--rdzv")) for a in args) else ["--standalone"]
        return [sys.executable, "-m", "torch.distributed.run", *placement, "--nproc_per_node", n, *args,
                "-m", module, *argv]
    where = (["--hostfile", launch_cfg.hostfile] if launch_cfg.hostfile else []) + ["--num_gpus", n]
    return [sys.executable, "-m", "deepspeed.launcher.runner", *where, "--no_local_rank", *launch_cfg.args,
            "--module", module, *argv]


def relaunch(launch_cfg, module: str, argv: Sequence[str]) -> int | None:
    """Run the stage under its launcher and return the launcher's exit code; None when this process should
    train itself (no launcher asked, or already a rank)."""
    cmd = None if inside_launcher() else launch_command(launch_cfg, module, argv)
    if cmd is None:
        return None
    env = {**os.environ, LAUNCHED_VAR: "1"}
    if not _has_cuda():
        # CPU ranks share the cores: each gets its share of the threads this process was given
        threads = int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, threads // launch_cfg.num_processes))
        if launch_cfg.launcher == "deepspeed":
            env.setdefault("LOCAL_SIZE", str(launch_cfg.num_processes))
            env.setdefault("DS_ACCELERATOR", "cpu")
    if launch_cfg.launcher != "deepspeed" or launch_cfg.hostfile or _has_option(cmd, "--master_port"):
        print("launching:", " ".join(cmd), flush=True)
        return subprocess.run(cmd, env=env, check=False).returncode
    for attempt in range(1, PORT_TRIES + 1):
        port = _free_port()
        cmd_on_port = with_master_port(cmd, port)
        print("launching:", " ".join(cmd_on_port), flush=True)
        returncode, port_lost = _run_watching_for_port_in_use(cmd_on_port, env)
        if returncode == 0 or not port_lost:
            return returncode
        print(f"launch: port {port} was taken by another process before rank 0 listened on it (EADDRINUSE); "
              + (f"launching again on a new port ({attempt + 1} of {PORT_TRIES})" if attempt < PORT_TRIES
                 else f"giving up after {PORT_TRIES} ports; pass a port in launch.args: [--master_port, N]"),
              file=sys.stderr, flush=True)
    return returncode


def with_master_port(cmd: Sequence[str], port: int) -> list[str]:
    """The deepspeed runner command ``cmd`` with ``--master_port <port>`` before its ``--module``."""
    cmd = list(cmd)
    at = cmd.index("--module")
    return [*cmd[:at], "--master_port", str(port), *cmd[at:]]


def _has_option(cmd: Sequence[str], option: str) -> bool:
    return any(arg == option or arg.startswith(option + "=") for arg in cmd)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_watching_for_port_in_use(cmd: Sequence[str], env: dict[str, str]) -> tuple[int, bool]:
    """Run ``cmd``, passing its output (stderr merged into stdout) through line by line.

    Returns:
        The exit code, and whether the output reported a port already in use.
    """
    port_lost = False
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            port_lost = port_lost or any(marker in line for marker in _PORT_IN_USE)
    return proc.returncode, port_lost


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
