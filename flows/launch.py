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

On CPU the ranks share the cores: each rank gets ``OMP_NUM_THREADS // N`` threads (at least 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

LAUNCHED_VAR = "TRACE_LAUNCHED"


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
    print("launching:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, check=False).returncode


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
