"""The stage params table (trace/configuration/stages.py) against dvc.yaml and against what the stages really read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace.configuration.params_file import load_config
from trace.configuration.stages import (NON_RESULT_PARAMS, STAGE_PARAMS, deps_digest, dvc_stage_params, record_param_reads,
                          stage_deps, stage_params, uncovered)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "params_tiny.yaml"


def test_dvc_yaml_lists_every_param_of_each_stage_in_the_table():
    listed = dvc_stage_params(ROOT / "dvc.yaml")
    for stage, keys in STAGE_PARAMS.items():
        assert stage in listed, f"dvc.yaml has no stage {stage}"
        assert uncovered(keys, listed[stage]) == [], f"dvc.yaml stage {stage} does not list these params"


def test_every_dvc_stage_but_the_params_check_has_a_table_entry():
    assert set(dvc_stage_params(ROOT / "dvc.yaml")) - set(STAGE_PARAMS) == {"check_params"}


def test_the_params_check_stage_tracks_every_param():
    assert dvc_stage_params(ROOT / "dvc.yaml")["check_params"] == [""]


def test_params_a_stage_need_not_list_are_those_the_params_hash_ignores():
    cfg = load_config(TINY)
    changed = load_config(TINY, overrides={"train.ablations": ["grpo"], "train.steps_per_task": 7,
                                           "tracking.experiment_name": "other", "train.seeds": [0, 4],
                                           "train.checkpoint_dir": "/shared/checkpoints",
                                           "launch": {"launcher": "torchrun", "num_processes": 2}})
    assert NON_RESULT_PARAMS == ("train.ablations", "train.seeds", "train.steps_per_task", "train.checkpoint_dir",
                                 "tracking", "launch")
    assert changed.params_hash() == cfg.params_hash()


def test_recorder_sees_field_reads_properties_and_whole_section_dumps():
    with record_param_reads() as reads:
        cfg = load_config(TINY)  # its validation reads allocation.*: not a stage's read
        with reads.stage("s"):
            _ = cfg.seed, cfg.task.kgqa.num_entities
            _ = cfg.allocation.root_budget  # a property: reads trajectory_budget and expansion_ratio
            cfg.evaluate.model_dump()
    assert reads["s"] == {"seed", "task.kgqa.num_entities", "allocation.trajectory_budget",
                          "allocation.expansion_ratio", "evaluate"}


def test_recorder_leaves_out_replaced_fields_of_a_copy_and_reads_inside_the_params_hash():
    with record_param_reads() as reads:
        with reads.stage("s"):
            cfg = load_config(TINY)
            copy = cfg.update.model_copy(update={"lr": 1.0, "kl_coef": 0.0})
            _ = copy.lr, copy.kl_coef, copy.max_grad_norm
            cfg.params_hash()
            cfg.resume_hash()
    assert reads["s"] == {"update.max_grad_norm"}


def test_recorder_attributes_no_read_to_a_stage_while_paused():
    with record_param_reads() as reads:
        cfg = load_config(TINY)
        with reads.stage("s"):
            with reads.paused():
                _ = cfg.seed
            _ = cfg.policy.dtype
    assert reads["s"] == {"policy.dtype"}


def test_recorder_watches_only_configs_loaded_inside_the_block_and_is_removed_after_it():
    before = load_config(TINY)
    with record_param_reads() as reads:
        inside = load_config(TINY)
        with reads.stage("s"):
            _ = before.seed, before.policy.hidden_size
    with reads.stage("after"):
        _ = inside.seed
    assert reads["s"] == set() and reads["after"] == set()


def test_stage_params_holds_the_table_values_nested_like_params_yaml():
    cfg = load_config(TINY)
    params = stage_params(cfg, "warmup")
    lora = {"enabled": False, "rank": 16, "alpha": 32.0, "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    assert params["update"] == {"weight_decay": 0.0, "micro_batch_size": 16, "max_grad_norm": 1.0,
                                "zero_stage": 0, "bf16": False, "offload_optimizer": False, "lora": lora}
    assert params["policy"]["hidden_size"] == 32 and params["seed"] == 0
    assert stage_params(cfg, "report")["train"] == {"ablations": ["grpo", "dapo", "trace"], "seeds": [0]}
    with pytest.raises(KeyError, match="stages with a params table"):
        stage_params(cfg, "train@grpo")


def test_stage_deps_substitute_the_matrix_item(tmp_path):
    deps = stage_deps(ROOT / "dvc.yaml", "evaluate", {"ablation": "trace", "seed": 2})
    assert "data/runs/trace/s2" in deps and "flows/evaluate.py" in deps
    assert "data/runs/${item.ablation}/s${item.seed}" in stage_deps(ROOT / "dvc.yaml", "evaluate")
    (tmp_path / "dvc.yaml").write_text("stages:\n  a:\n    foreach: [x]\n    do:\n      cmd: c\n"
                                       "      deps: ['data/${item}']\n")
    assert stage_deps(tmp_path / "dvc.yaml", "a", "x") == ["data/x"]  # a foreach stage's item


def test_train_and_evaluate_run_over_every_arm_and_training_seed():
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name in ("train", "evaluate"):
        assert stages[name]["matrix"] == {"ablation": "${train.ablations}", "seed": "${train.seeds}"}
        assert "--ablation ${item.ablation} --seed ${item.seed}" in stages[name]["cmd"]
    assert stages["train"]["outs"] == ["data/runs/${item.ablation}/s${item.seed}"]


def test_deps_digest_follows_contents_and_ignores_bytecode(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    first = deps_digest(tmp_path, ["pkg"])
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0bytecode")
    assert deps_digest(tmp_path, ["pkg"]) == first
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert deps_digest(tmp_path, ["pkg"]) != first


# ---- what the stages really read ------------------------------------------------------------------------
RECORD = r"""
import json, sys
from flows.common import setup_process_env
setup_process_env()
import flows.prepare, flows.warmup, flows.seed_rollouts, flows.fit_predictor, flows.train, flows.evaluate, flows.report
from trace.configuration.params_file import load_config
from trace.configuration.stages import record_param_reads

params, out = sys.argv[1], sys.argv[2]
ablations = list(load_config(params).train.ablations)
flows.train.train_steps = flows.train.train_steps.fn  # the task's body, without a Prefect run
calls = [("prepare", flows.prepare.prepare_flow.fn, [()]), ("warmup", flows.warmup.warmup_flow.fn, [()]),
         ("seed_rollouts", flows.seed_rollouts.seed_rollouts_flow.fn, [()]),
         ("fit_predictor", flows.fit_predictor.fit_predictor_flow.fn, [()]),
         ("train", flows.train.train_flow.fn, [(a,) for a in ablations]),
         ("evaluate", flows.evaluate.evaluate_flow.fn, [(a,) for a in ablations]),
         ("report", flows.report.report_flow.fn, [()])]
with record_param_reads() as reads:
    def unrecorded(fn):
        def call(*args, **kwargs):
            with reads.paused():
                return fn(*args, **kwargs)
        return call
    for module in (flows.prepare, flows.warmup, flows.seed_rollouts, flows.fit_predictor, flows.train,
                   flows.evaluate):
        module.stage_params = unrecorded(module.stage_params)  # logs the table's values: not the stage's reads
    for stage, fn, arg_sets in calls:
        for args in arg_sets:
            with reads.stage(stage):
                fn(params, *args)
json.dump({stage: sorted(keys) for stage, keys in reads.by_stage.items()}, open(out, "w"), indent=1)
"""

_SKIP = {".git", ".venv", "data", "mlruns", ".prefect", "__pycache__", ".hypothesis", "reports", ".pytest_cache",
         "metrics"}


@pytest.fixture(scope="module")
def recorded_reads(tmp_path_factory):
    """Params each stage read while the real stage flows ran, in order, on the tiny params file."""
    tmp = tmp_path_factory.mktemp("reads")
    project = tmp / "trace"
    from tests.test_pipeline_e2e import copy_project

    copy_project(project, _SKIP)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "DVC_ROOT")}
    env.update({"PYTHONPATH": str(project), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"})
    out = subprocess.run([sys.executable, "-c", RECORD, str(project / "tests" / "params_tiny.yaml"),
                          str(tmp / "reads.json")], cwd=project, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp / "reads.json").read_text())


@pytest.mark.slow
def test_each_stage_reads_no_param_outside_its_table_entry(recorded_reads):
    assert set(recorded_reads) == set(STAGE_PARAMS)
    for stage, keys in recorded_reads.items():
        assert uncovered(keys, STAGE_PARAMS[stage], NON_RESULT_PARAMS) == [], \
            f"stage {stage} reads params missing from trace.configuration.stages.STAGE_PARAMS[{stage!r}]"


@pytest.mark.slow
def test_each_stage_reads_no_param_that_dvc_yaml_does_not_list_for_it(recorded_reads):
    listed = dvc_stage_params(ROOT / "dvc.yaml")
    for stage, keys in recorded_reads.items():
        assert uncovered(keys, listed[stage], NON_RESULT_PARAMS) == [], \
            f"dvc.yaml stage {stage} reads params it does not list: a change to them would keep it stale"


@pytest.mark.slow
def test_every_table_entry_is_read_by_its_stage(recorded_reads):
    for stage, entries in STAGE_PARAMS.items():
        unread = [e for e in entries if uncovered([e], recorded_reads[stage]) and
                  not any(k == e or k.startswith(e + ".") for k in recorded_reads[stage])]
        assert unread == [], f"STAGE_PARAMS[{stage!r}] lists params the stage never reads"
