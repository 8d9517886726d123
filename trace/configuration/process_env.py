"""The process environment of the pipeline: one table of defaults for the stages, the tests and ``make``.

``PROCESS_ENV`` holds what every stage process needs: DeepSpeed's accelerator, Prefect kept quiet and its state in
the repository, telemetry off, Hugging Face offline, tokenizers single-threaded. ``interpreter_env`` adds what
depends on the running Python: DeepSpeed's compiled ops kept in its virtual environment. ``LAUNCHER_ENV``
adds the thread count, which only a launcher can set (``make`` and the test session, before any process
imports torch); a stage started by hand keeps the machine's default. Every value is a default: a variable
already set is never replaced.

Standard library only, so the Makefile can read the table with the system Python before the virtual
environment exists: ``python -m trace.configuration.process_env --make`` prints one ``NAME?=value`` word per variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

PROCESS_ENV: dict[str, str] = {
    "DS_ACCELERATOR": "cpu",  # "cuda" where a GPU is visible: see select_accelerator
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_HOME": str(REPO_ROOT / ".prefect"),
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
LAUNCHER_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "2",
}


def apply_process_env(defaults: Mapping[str, str] = PROCESS_ENV,
                      environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each variable of ``defaults`` that ``environ`` lacks (``setdefault``); set ones are kept.

    Args:
        defaults: name -> value, e.g. ``PROCESS_ENV`` or ``{**PROCESS_ENV, **LAUNCHER_ENV}``.
        environ: the environment to fill; ``None`` = ``os.environ``.

    Returns:
        The variables this call set, name -> value.
    """
    environ = os.environ if environ is None else environ
    newly_set = {}
    for key, value in defaults.items():
        if key not in environ:
            environ[key] = value
            newly_set[key] = value
    return newly_set


def select_accelerator(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Switch ``DS_ACCELERATOR`` from ``cpu`` to ``cuda`` when torch sees a GPU.

    DeepSpeed picks its accelerator when it is first imported, so this runs before any DeepSpeed import.
    Without torch, or with any other value, nothing changes.

    Args:
        environ: the environment to update; ``None`` = ``os.environ``.

    Returns:
        ``DS_ACCELERATOR`` afterwards (``None`` when unset).
    """
    environ = os.environ if environ is None else environ
    if environ.get("DS_ACCELERATOR") == "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                environ["DS_ACCELERATOR"] = "cuda"
        except ImportError:
            pass
    return environ.get("DS_ACCELERATOR")


def main_repository(environ: Mapping[str, str] | None = None) -> Path:
    """The repository whose shared state a stage reads and writes: ``$DVC_ROOT``, else this repository.

    DVC sets ``DVC_ROOT`` for every stage command to the repository it was started in; a queued experiment
    (``dvc exp run --queue``) runs in a temporary copy under ``.dvc/tmp/exps``, and DVC points ``DVC_ROOT`` at
    the main repository there too. Everything outside DVC's outputs resolves against it: relative data paths
    (``task.files``, and the allowed ``../shared/data`` next to it), training checkpoints, the default MLflow
    database.

    Args:
        environ: the environment to read; ``None`` = ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    return Path(environ.get("DVC_ROOT") or REPO_ROOT).resolve()


def interpreter_env() -> dict[str, str]:
    """``TORCH_EXTENSIONS_DIR``: ``<sys.prefix>/torch_extensions``, the running virtual environment's folder for the
    C++ ops DeepSpeed compiles on first use (its CPU shared-memory op).

    torch's default, ``~/.cache/torch_extensions``, is one folder for every environment of the user, and its build
    files name the environment's source paths: a stage run from another environment recompiles the op there, and
    the next stage of the first recompiles it back. Keyed to the environment, every clone and queued experiment
    that runs with it shares one build, which ``build_ops`` (``make venv``) makes once. An environment this process
    cannot write to (a shared, read-only install) gives nothing: torch's default stays.
    """
    if not os.access(sys.prefix, os.W_OK):
        return {}
    return {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}


def build_ops() -> None:
    """Compile DeepSpeed's CPU shared-memory op into ``interpreter_env``'s folder now (``make venv``), so no stage
    of a run compiles it; an op already built there is only loaded."""
    apply_process_env({**PROCESS_ENV, **interpreter_env()})
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def setup_process_env() -> None:
    """Set the environment the stages need (``PROCESS_ENV`` and ``interpreter_env``, then
    ``select_accelerator``), keeping anything the user already set."""
    apply_process_env({**PROCESS_ENV, **interpreter_env()})
    select_accelerator()


def make_assignments(defaults: Mapping[str, str]) -> list[str]:
    """``NAME?=value`` words for ``make`` (``$(eval export <word>)``: a default the caller's environment
    overrides).

    Raises:
        ValueError: a value with whitespace, which one make word cannot carry.
    """
    words = []
    for key, value in defaults.items():
        if any(c.isspace() for c in value):
            raise ValueError(f"{key}={value!r} contains whitespace; make reads one word per variable")
        words.append(f"{key}?={value}")
    return words


def main(argv: list[str] | None = None) -> int:
    """``--make``: print the launcher's assignments (``PROCESS_ENV`` and ``LAUNCHER_ENV``), one per line."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["--make"]:
        print("usage: python -m trace.configuration.process_env --make", file=sys.stderr)
        return 2
    print("\n".join(make_assignments({**PROCESS_ENV, **LAUNCHER_ENV})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
