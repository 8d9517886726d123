"""TRACE, GRPO and MoPPS allocating TRL's rollouts at equal budget, on CPU, in about a minute.

A toy verifiable task: the prompt ``repeat <colour> <colour>`` is solved when the first ``<colour>``
appears among the completion's words. The policy is a tiny Qwen3 built from a config over the task's
words (``trace.policy.model.build_tiny_policy``: nothing is downloaded). Each arm trains the same
randomly initialised policy for a few steps with ``TraceGRPOTrainer`` (``trace.integrations.trl_grpo``):
``num_candidates`` prompts per step, ``num_generations`` rows per prompt, ``trajectory_budget`` real
completions per step, and prints per arm the mean effective ratio (share of trajectories in groups whose
rewards are not all equal), the mean reward and the forecast vs realised mixed groups.

Simplifications: one process, transformers generation, four completion tokens, no evaluation.

Usage: ``python -m examples.trl_trace [--steps 6] [--arms trace,grpo,mopps]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

COLOURS = ("red", "blue", "green", "gold", "gray", "pink", "teal", "navy")
VOCABULARY = ("repeat",) + COLOURS
NUM_CANDIDATES = 8  # prompts per step
NUM_GENERATIONS = 8  # TRL's fixed group width: the most trajectories one prompt can get
TRAJECTORY_BUDGET = 32  # real completions per step, every arm
GROUP_SIZE = 4  # grpo: 4 trajectories to each of the 8 candidates


def toy_dataset(num_prompts: int = 24, seed: int = 0):
    """``datasets.Dataset`` of ``num_prompts`` distinct prompts: columns ``prompt``, ``prompt_id``, ``target``."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    pairs = [(a, b) for a in COLOURS for b in COLOURS if a != b]
    chosen = [pairs[i] for i in rng.choice(len(pairs), size=num_prompts, replace=False)]
    return Dataset.from_dict({"prompt": [f"repeat {a} {b}" for a, b in chosen],
                              "prompt_id": [f"toy/{i}" for i in range(num_prompts)],
                              "target": [a for a, _ in chosen]})


def repeat_reward(completions, target, **kwargs) -> list[float]:
    """1.0 when the prompt's first colour is among the completion's words, else 0.0 (TRL reward function)."""
    return [float(t in c.split()) for c, t in zip(completions, target)]


def build_policy(seed: int = 0):
    """(model, tokenizer): a 1-layer Qwen3 over ``VOCABULARY``, built from a config, random weights."""
    from trace.configuration.config import PolicyConfig
    from trace.policy.model import build_tiny_policy

    cfg = PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    policy = build_tiny_policy(cfg, VOCABULARY, seed)
    return policy.model, policy.tokenizer


def grpo_config(output_dir: str, max_steps: int, seed: int = 0, **overrides):
    """``GRPOConfig`` of the example: one generation batch of ``NUM_CANDIDATES x NUM_GENERATIONS`` rows per step."""
    from trl import GRPOConfig

    settings = dict(output_dir=output_dir, per_device_train_batch_size=NUM_CANDIDATES * NUM_GENERATIONS,
                    num_generations=NUM_GENERATIONS, max_completion_length=4, max_steps=max_steps,
                    learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                    seed=seed, data_seed=seed, dataloader_num_workers=0, disable_tqdm=True)
    settings.update(overrides)
    return GRPOConfig(**settings)


def allocation_config():
    """The arms' shared settings: T = 32, 2..8 trajectories per active prompt, no stage 2."""
    from trace.configuration.config import AllocationConfig

    return AllocationConfig(trajectory_budget=TRAJECTORY_BUDGET, num_candidates=NUM_CANDIDATES,
                            group_size=GROUP_SIZE, m_min=2, m_max=NUM_GENERATIONS, expansion_ratio=0.0)


def make_trainer(arm: str, output_dir: str, max_steps: int, seed: int = 0, **overrides):
    """A ``TraceGRPOTrainer`` of ``arm`` on the toy task, with a fresh policy and allocator."""
    from trace.integrations import RolloutAllocator
    from trace.integrations.trl_grpo import TraceGRPOTrainer

    model, tokenizer = build_policy(seed)
    return TraceGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=repeat_reward,
                            args=grpo_config(output_dir, max_steps, seed, **overrides), train_dataset=toy_dataset(),
                            allocator=RolloutAllocator(arm, allocation_config(), seed=seed))


def run_arm(arm: str, steps: int, seed: int = 0) -> dict[str, float]:
    """Train ``arm`` for ``steps`` steps; the means over steps of its logged metrics."""
    from transformers import PrinterCallback

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(arm, output_dir, steps, seed)
        trainer.remove_callback(PrinterCallback)  # the table below is the output
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    logs = [row for row in trainer.state.log_history if "allocation/effective_ratio" in row]

    def mean(key: str) -> float:  # NaN (logged as None) where the arm has no forecast
        values = [row[key] for row in logs if row.get(key) is not None]
        return float(np.mean(values)) if values else float("nan")

    return {"steps": len(logs), "trajectories": mean("allocation/trajectories"),
            "effective_ratio": mean("allocation/effective_ratio"), "reward": mean("reward"),
            "forecast_mixed": mean("allocation/forecast_mixed_groups"),
            "realised_mixed": mean("allocation/realised_mixed_groups"), "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per arm")
    parser.add_argument("--arms", default="trace,grpo,mopps", help="comma-separated arm names")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import importlib.util
    import warnings

    import torch
    import trl

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed checkpointing options
    torch.set_num_threads(2)
    if importlib.util.find_spec("deepspeed") is not None:
        # the trainer imports it and it logs its accelerator choice once: here, not inside the table
        import deepspeed.accelerator  # noqa: F401
    print(f"trl {trl.__version__}, torch {torch.__version__}, {NUM_CANDIDATES} candidates x {NUM_GENERATIONS} "
          f"rows, budget {TRAJECTORY_BUDGET} trajectories per step, {args.steps} steps, seed {args.seed}")
    print(f"{'arm':<8} {'steps':>5} {'traj/step':>9} {'effective':>9} {'reward':>7} {'forecast':>8} "
          f"{'realised':>8} {'seconds':>7}")
    for arm in args.arms.split(","):
        r = run_arm(arm, args.steps, args.seed)
        print(f"{arm:<8} {r['steps']:>5} {r['trajectories']:>9.0f} {r['effective_ratio']:>9.3f} {r['reward']:>7.3f} "
              f"{r['forecast_mixed']:>8.2f} {r['realised_mixed']:>8.2f} {r['seconds']:>7.1f}".replace("nan", "  -"))


if __name__ == "__main__":
    main()
