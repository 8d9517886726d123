"""The task registry (trace/tasks.py): one declaration per task, and everything derived from it."""

import importlib

import pytest

from trace.configuration.config import TaskConfig, TaskName
from trace.data_paths import DEFAULT_FILES
from trace.data.splits import REAL_TASKS, TASK_FORMATS
from trace.envs import fc, math, qa, registry
from trace.tasks import EMBEDDED, FAMILIES, FUNCTION_CALLING, MATH, QA, TASKS, file_task_names, task_names, task_spec


def test_task_names_are_unique_and_free_of_slashes():
    names = [spec.name for spec in TASKS]
    assert len(set(names)) == len(names) and not any("/" in n for n in names)
    assert all(spec.family in FAMILIES for spec in TASKS)


def test_the_task_name_enum_is_the_table_in_its_order():
    assert [(t.name, t.value) for t in TaskName] == [(spec.member, spec.name) for spec in TASKS]
    assert TaskName("2wikimultihopqa") is TaskName.TWOWIKI and isinstance(TaskName.KGQA, str)


def test_family_lists_are_derived_from_the_table():
    assert qa.QA_TASKS == task_names(QA) == ("hotpotqa", "musique", "2wikimultihopqa", "bamboogle", "nq")
    assert math.MATH_TASKS == task_names(MATH) == ("gsm8k", "math", "aime_amc")
    assert fc.FC_TASKS == task_names(FUNCTION_CALLING) == ("bfcl", "api_bank")
    assert REAL_TASKS == file_task_names() == task_names(QA) + task_names(MATH) + task_names(FUNCTION_CALLING)
    assert registry.EMBEDDED_TASKS == tuple(TaskName(n) for n in task_names(EMBEDDED))
    assert list(registry.REAL_DATA_MODULES) == [TaskName(n) for n in file_task_names()]


def test_every_file_backed_task_has_formats_default_files_and_a_factory():
    assert list(TASK_FORMATS) == list(file_task_names())
    for name in file_task_names():
        spec = task_spec(name)
        assert TASK_FORMATS[name], name
        assert name in DEFAULT_FILES or name == "math", name  # MATH has no offline copy
        assert registry.REAL_DATA_MODULES[TaskName(name)] == spec.env_module
        assert callable(getattr(importlib.import_module(spec.env_module), registry.FACTORY_NAME))


@pytest.mark.parametrize("spec", TASKS, ids=lambda s: s.name)
def test_each_declared_environment_class_exists(spec):
    assert isinstance(getattr(importlib.import_module(spec.env_module), spec.env_class), type)


@pytest.mark.parametrize("name", ["kgqa", "simulator", "hotpotqa", "gsm8k", "math", "aime_amc", "bfcl", "api_bank"])
def test_the_registry_builds_the_declared_class(name):
    # tasks whose environment is built without reading a data file
    spec = task_spec(name)
    env = registry.make_environment(TaskConfig(name=name), 0)
    assert type(env).__name__ == spec.env_class and type(env).__module__ == spec.env_module


def test_unknown_names_and_families_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown task name 'chess'; valid names: \['kgqa', 'simulator', "):
        task_spec("chess")
    assert task_spec(TaskName.NQ).family == QA
    with pytest.raises(ValueError, match="valid families"):
        task_names("vision")
