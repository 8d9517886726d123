from pathlib import Path

import pytest

from trace.allocation.arms import ARMS
from trace.configuration.config import Config, ConfigError, config_from_dict
from trace.configuration.params_file import load_config, parse_params_yaml, read_params_file

ROOT = Path(__file__).resolve().parents[1]


def test_repository_params_file_loads():
    cfg = load_config(ROOT / "params.yaml")
    assert isinstance(cfg, Config)
    assert cfg.allocation.root_budget >= cfg.allocation.m_min


def test_unknown_key_is_refused_with_key_and_fix():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"allocation": {"root_budgett": 5}})
    msg = str(err.value)
    assert "allocation.root_budgett" in msg and "unknown key" in msg


@pytest.mark.parametrize("section,key,value,needle", [
    ("allocation", "trajectory_budget", 0, "allocation.trajectory_budget"),
    ("allocation", "trajectory_budget", -4, "allocation.trajectory_budget"),
    ("allocation", "m_min", 1, "allocation.m_min"),
    ("allocation", "expansion_ratio", -0.5, "allocation.expansion_ratio"),
    ("advantages", "estimator", "gae", "advantages.estimator"),
    ("predictor", "kind", "crystal_ball", "predictor.kind"),
    ("update", "zero_stage", 4, "update.zero_stage"),
    ("task", "name", "chess", "task.name"),
])
def test_invalid_values_are_refused_naming_the_key_and_value(section, key, value, needle):
    with pytest.raises(ConfigError) as err:
        config_from_dict({section: {key: value}})
    assert needle in str(err.value) and repr(value) in str(err.value)


def test_m_max_below_m_min_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="m_max >= m_min"):
        config_from_dict({"allocation": {"m_min": 4, "m_max": 3}})


def test_unknown_ablation_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"train": {"ablations": ["grpo", "magic"]}})
    assert "magic" in str(err.value) and "trace_prefix" in str(err.value)


def test_enum_valued_estimator_lists_valid_choices():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"advantages": {"estimator": "gae"}})
    assert "tree_grpo" in str(err.value)


def test_overrides_apply_dotted_keys(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  num_steps: 5\n")
    cfg = load_config(p, overrides={"train.num_steps": 2, "allocation.m_max": 8})
    assert cfg.train.num_steps == 2 and cfg.allocation.m_max == 8


def test_missing_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_params_hash_changes_with_a_param_and_is_stable():
    a, b = config_from_dict({}), config_from_dict({"train": {"num_steps": 7}})
    assert a.params_hash() == config_from_dict({}).params_hash()
    assert a.params_hash() != b.params_hash()


def test_default_ablations_are_every_arm():
    assert set(config_from_dict({}).train.ablations) == set(ARMS)


def test_params_hash_ignores_the_arm_list_and_orchestration():
    a = config_from_dict({"train": {"ablations": ["grpo"]}})
    b = config_from_dict({"train": {"ablations": ["grpo", "trace"], "steps_per_task": 3}})
    assert a.params_hash() == b.params_hash()


def test_a_section_given_twice_is_refused_naming_the_key_both_lines_and_the_file(tmp_path):
    p = tmp_path / "params.yaml"
    # safe_load would keep only the second section: update.lr would silently fall back to its default
    p.write_text("update:\n  lr: 0.5\ntrain:\n  num_steps: 3\nupdate:\n  zero_stage: 1\n")
    with pytest.raises(ConfigError, match=r"params.yaml: key 'update' is given twice \(lines 1 and 5\)"):
        load_config(p)


def test_a_nested_key_given_twice_is_refused_with_its_dotted_name(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  num_steps: 3\n  ablations: [grpo]\n  num_steps: 4\n")
    with pytest.raises(ConfigError, match=r"key 'train.num_steps' is given twice \(lines 2 and 4\)"):
        read_params_file(p)
    with pytest.raises(ConfigError, match=r"'allocation.m_max' is given twice \(lines 1 and 1\)"):
        parse_params_yaml("allocation: {m_max: 4, m_max: 8}\n")


def test_keys_that_differ_or_override_a_yaml_merge_are_not_duplicates():
    text = "base: &base {lr: 0.1, zero_stage: 0}\nupdate:\n  <<: *base\n  lr: 0.2\nmapping: {1: a, '1': b}\n"
    assert parse_params_yaml(text) == {"base": {"lr": 0.1, "zero_stage": 0}, "update": {"lr": 0.2, "zero_stage": 0},
                                       "mapping": {1: "a", "1": "b"}}
    assert parse_params_yaml("shared: &s {k: 1}\na: *s\nloop: &l [1, *l]\n")["a"] == {"k": 1}  # aliases, once each


@pytest.mark.parametrize("path", [ROOT / "params.yaml", ROOT / "tests" / "params_tiny.yaml",
                                  *sorted((ROOT / "params").glob("*.yaml"))], ids=lambda p: p.name)
def test_every_committed_params_file_reads_strictly(path):
    import yaml

    assert read_params_file(path) == yaml.safe_load(path.read_text())


def test_the_test_split_and_warmup_seed_keys_at_their_defaults_keep_the_params_hash():
    # runs from before evaluate.split, task.kgqa.num_test and warmup.seed existed keep their hash
    fixed = {"policy": {"dtype": "float32"}, "update": {"bf16": False}}  # not the CPU's precision
    base = config_from_dict(fixed)
    same = config_from_dict({**fixed, "evaluate": {"split": "eval"}, "task": {"kgqa": {"num_test": 0}},
                             "warmup": {"seed": None}})
    assert base.params_hash() == same.params_hash() == "1d1ea06a8418"  # these params' hash before the keys
    for changed in ({"warmup": {"seed": 1}}, {"task": {"kgqa": {"num_test": 300}}},
                    {"task": {"kgqa": {"num_test": 300}}, "evaluate": {"split": "test"}}):
        assert config_from_dict({**fixed, **changed}).params_hash() != base.params_hash(), changed


def test_warmup_seed_is_the_global_seed_unless_set():
    assert config_from_dict({"seed": 3}).warmup_seed == 3
    assert config_from_dict({"seed": 3, "warmup": {"seed": 1}}).warmup_seed == 1


def test_evaluating_on_a_test_split_needs_one_big_enough():
    with pytest.raises(ConfigError, match=r"task.kgqa.num_test=0: raise task.kgqa.num_test to at least 200"):
        config_from_dict({"evaluate": {"split": "test"}})
    with pytest.raises(ConfigError, match=r"evaluate.split=test needs a test split.*task 'simulator'"):
        config_from_dict({"evaluate": {"split": "test"}, "task": {"name": "simulator"}})
    cfg = config_from_dict({"evaluate": {"split": "test", "num_prompts": 300}, "task": {"kgqa": {"num_test": 300}}})
    assert cfg.evaluate.split == "test"
