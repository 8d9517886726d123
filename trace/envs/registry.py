"""Environments by task name: ``make_environment(task_cfg, seed)`` builds the task ``task_cfg.name`` names.

The embedded tasks (``kgqa``, ``simulator``) need nothing but numpy. Real-data tasks live in their own
modules, imported only when chosen so that their dependencies (``bm25s`` for retrieval, ...) load lazily:

| task names                                              | module             |
|---------------------------------------------------------|--------------------|
| hotpotqa, musique, 2wikimultihopqa, bamboogle, nq       | ``trace.envs.qa``  |
| gsm8k, math, aime_amc                                   | ``trace.envs.math``|
| bfcl, api_bank                                          | ``trace.envs.fc``  |

Each of those modules provides ``from_task_config(task_cfg: TaskConfig, seed: int, *, root: Path)
-> Environment``, where ``root`` is the folder the ``task.files`` paths are relative to.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from trace.config import TaskConfig, TaskName
from trace.envs.base import Environment

FACTORY_NAME = "from_task_config"

REAL_DATA_MODULES: dict[TaskName, str] = {
    TaskName.HOTPOTQA: "trace.envs.qa",
    TaskName.MUSIQUE: "trace.envs.qa",
    TaskName.TWOWIKI: "trace.envs.qa",
    TaskName.BAMBOOGLE: "trace.envs.qa",
    TaskName.NQ: "trace.envs.qa",
    TaskName.GSM8K: "trace.envs.math",
    TaskName.MATH: "trace.envs.math",
    TaskName.AIME_AMC: "trace.envs.math",
    TaskName.BFCL: "trace.envs.fc",
    TaskName.API_BANK: "trace.envs.fc",
}

EMBEDDED_TASKS = (TaskName.KGQA, TaskName.SIMULATOR)


def valid_task_names() -> list[str]:
    """Every task name ``make_environment`` accepts, in ``TaskName`` order."""
    known = set(EMBEDDED_TASKS) | set(REAL_DATA_MODULES)
    return [t.value for t in TaskName if t in known]


def _task_name(name: TaskName | str) -> TaskName:
    try:
        task = TaskName(name)
    except ValueError:
        raise ValueError(f"unknown task name {name!r}; valid names: {valid_task_names()}") from None
    if task not in EMBEDDED_TASKS and task not in REAL_DATA_MODULES:
        raise ValueError(f"task {task.value!r} has no environment; valid names: {valid_task_names()}")
    return task


def make_environment(task_cfg: TaskConfig, seed: int, *, root: str | Path = ".") -> Environment:
    """Build the environment of ``task_cfg.name``.

    Args:
        task_cfg: the ``task`` section (name, ``max_turns``, the task's own subsection, data files).
        seed: generation seed (kgqa graph and questions; simulator prompts and step randomness).
        root: folder that relative ``task.files`` paths resolve against (real-data tasks).

    Returns:
        ``KGQAEnvironment(task_cfg.kgqa, seed, max_turns=task_cfg.max_turns)`` for ``kgqa``;
        ``SimulatorEnvironment(task_cfg.simulator, seed)`` for ``simulator`` (its turn limit is
        ``simulator.max_turns``); otherwise the real-data module's ``from_task_config``.

    Raises:
        ValueError: on an unknown task name (with the valid list) or an invalid task config.
        ImportError: if a real-data task's module (or a dependency it needs) cannot be imported, or the
            module has no ``from_task_config``.
    """
    task = _task_name(task_cfg.name)
    if task == TaskName.KGQA:
        from trace.envs.kgqa import KGQAEnvironment

        return KGQAEnvironment(task_cfg.kgqa, seed=seed, max_turns=task_cfg.max_turns)
    if task == TaskName.SIMULATOR:
        from trace.envs.simulator import SimulatorEnvironment

        return SimulatorEnvironment(task_cfg.simulator, seed=seed)
    module_name = REAL_DATA_MODULES[task]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"task {task.value!r} needs the module {module_name} ({module_name.replace('.', '/')}.py), which "
            f"could not be imported: {err}. Install the pinned requirements (requirements.txt) or choose an "
            f"embedded task (task.name: kgqa or simulator)") from err
    factory = getattr(module, FACTORY_NAME, None)
    if not callable(factory):
        raise ImportError(f"module {module_name} has no {FACTORY_NAME}(task_cfg, seed, *, root) to build the "
                          f"{task.value!r} environment")
    return factory(task_cfg, seed, root=Path(root))
