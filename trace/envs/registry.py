"""Environments by task name: ``make_environment(task_cfg, seed)`` builds the task ``task_cfg.name`` names.

The tasks, their families and their environment modules are declared in ``trace.tasks.TASKS``. The embedded
tasks (``kgqa``, ``simulator``) need nothing but numpy. File-backed tasks live in their family's module,
imported only when chosen so that their dependencies (``bm25s`` for retrieval, ...) load lazily:

| task names                                              | module             |
|---------------------------------------------------------|--------------------|
| hotpotqa, musique, 2wikimultihopqa, bamboogle, nq       | ``trace.envs.qa``  |
| gsm8k, math, aime_amc                                   | ``trace.envs.math``|
| bfcl, api_bank                                          | ``trace.envs.fc``  |

Each of those modules provides ``from_task_config(task_cfg: TaskConfig, seed: int, *, root: Path,
allowed_roots) -> Environment``, where ``root`` is the folder the ``task.files`` paths are relative to.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

from trace.configuration.config import TaskConfig, TaskName
from trace.data_paths import DataError
from trace.envs.base import ChecksPrompts, Environment, Prompt
from trace.tasks import TASKS

FACTORY_NAME = "from_task_config"

REAL_DATA_MODULES: dict[TaskName, str] = {TaskName(spec.name): spec.env_module for spec in TASKS
                                          if not spec.is_embedded}

EMBEDDED_TASKS = tuple(TaskName(spec.name) for spec in TASKS if spec.is_embedded)


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


def _build(task: TaskName, task_cfg: TaskConfig, seed: int, root: str | Path,
           allowed_roots: Sequence[str | Path] | None) -> Environment:
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
    return factory(task_cfg, seed, root=Path(root), allowed_roots=allowed_roots)


def make_environment(task_cfg: TaskConfig, seed: int, *, root: str | Path = ".",
                     prompts: Sequence[Prompt] | None = None,
                     allowed_roots: Sequence[str | Path] | None = None) -> Environment:
    """Build the environment of ``task_cfg.name``, and check it can serve ``prompts`` when they are given.

    Args:
        task_cfg: the ``task`` section (name, ``max_turns``, the task's own subsection, data files).
        seed: generation seed (kgqa graph and questions; simulator prompts and step randomness); the
            file-backed environments are deterministic and draw no random numbers.
        root: folder that relative ``task.files`` paths resolve against (real-data tasks).
        prompts: the prompts the environment will serve, or ``None`` to skip the checks: each must belong to
            the task (``data_source``), and an environment that ``ChecksPrompts`` checks them itself (a QA
            task with neither corpus nor retrieval server needs context paragraphs in every prompt).
        allowed_roots: folders data paths may lie under (default: ``trace.data_paths.default_allowed_roots``).

    Returns:
        ``KGQAEnvironment(task_cfg.kgqa, seed, max_turns=task_cfg.max_turns)`` for ``kgqa``;
        ``SimulatorEnvironment(task_cfg.simulator, seed)`` for ``simulator`` (its turn limit is
        ``simulator.max_turns``); otherwise the real-data module's ``from_task_config``.

    Raises:
        ValueError: on an unknown task name (with the valid list) or an invalid task config.
        ImportError: if a real-data task's module (or a dependency it needs) cannot be imported, or the
            module has no ``from_task_config``.
        DataError: a prompt of another data source, or prompts the environment cannot serve.
    """
    task = _task_name(task_cfg.name)
    for prompt in prompts or ():
        if prompt.data_source != task.value:
            raise DataError(f"prompt {prompt.prompt_uid!r} belongs to {prompt.data_source!r}, not task {task.value!r}")
    env = _build(task, task_cfg, seed, root, allowed_roots)
    if prompts is not None and isinstance(env, ChecksPrompts):
        env.check_prompts(prompts)
    return env
