"""The SFT step of the warmup with ``token_logprobs`` over chunks of whole sequences against one sequence at a time.

``trace.losses.token_logprobs`` takes the float32 log-softmax over chunks of up to ``LOGPROB_CHUNK_ELEMENTS``
logits (at the default policy's shapes, the whole micro-batch at once). Taken one sequence at a time, as it was
before, the backward pass of each sequence's slice writes a zero tensor of the whole (B, T, V) logits and adds
its slice into it: B such tensors a micro-batch. This times ``PolicyUpdater.sft_step`` on batches of the default
task's solver demonstrations (``warmup.batch_size``, the default policy and precision of ``params.yaml``), the two
ways alternating on the same updater, and checks on one batch that both give the same log-probs and gradients
bit for bit.

Usage: ``python -m benchmarks.logprob_chunks [--quick] [--threads N]``; writes
``reports/benchmarks/logprob_chunks.json``.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

from benchmarks.common import parse_args, torch_threads, write_report


def per_sequence_logprobs(logits, input_ids, temperature: float = 1.0):
    """``token_logprobs`` one sequence at a time (the reference): (B, T) float32."""
    import torch

    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    if input_ids.shape[1] < 2 or input_ids.shape[0] == 0:
        return out
    rows = []
    for b in range(input_ids.shape[0]):
        scaled = logits[b, :-1].float() / temperature
        rows.append(scaled.gather(-1, input_ids[b, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1))
    return torch.cat([out[:, :1], torch.stack(rows)], dim=1)


def same_bits(logits, input_ids) -> bool:
    """Whether ``token_logprobs`` and ``per_sequence_logprobs`` give equal log-probs and gradients, bit for bit."""
    import torch

    from trace.losses import token_logprobs

    results = []
    weight = torch.randn(input_ids.shape, generator=torch.Generator().manual_seed(0))
    for fn in (token_logprobs, per_sequence_logprobs):
        x = logits.detach().clone().requires_grad_(True)
        out = fn(x, input_ids)
        (out * weight).sum().backward()
        results.append((out.detach(), x.grad))
    return all(torch.equal(a, b) for a, b in zip(*results))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args("the warmup's SFT step: token_logprobs in chunks against one sequence at a time", argv)
    started = time.perf_counter()
    import numpy as np
    import torch

    import trace.update.updater as updater_module
    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment
    from trace.policy.build import build_policy
    from trace.training.warmup import demonstration_trees
    from trace.update import PolicyUpdater
    from trace.update.batch import build_training_batch

    cfg = load_config("params.yaml")
    env = make_environment(cfg.task, cfg.seed)
    prompts = env.prompts("train")[: 200 if args.quick else 2000]
    repeats = 2 if args.quick else 10
    with torch_threads(args.threads) as threads:
        policy = build_policy(cfg.policy, env, cfg.seed, cfg.task.name.value)
        demos = demonstration_trees(policy, env, prompts, cfg.warmup.demo_noise, cfg.seed)
        w = cfg.warmup
        updater = PolicyUpdater(policy.model, cfg.update.model_copy(update={
            "lr": w.lr, "ppo_epochs": 1, "kl_coef": 0.0, "gradient_checkpointing": False}), seed=cfg.seed,
            pad_token_id=policy.tokenizer.pad_token_id, max_tokens=cfg.policy.max_context_tokens)
        rng = np.random.default_rng(cfg.seed)
        size = min(w.batch_size, len(demos))
        batches = [[demos[i] for i in rng.choice(len(demos), size, replace=False)] for _ in range(2 * repeats + 2)]
        batch = build_training_batch(batches[0], policy.tokenizer.pad_token_id, cfg.policy.max_context_tokens,
                                     require_advantages=False)
        with torch.no_grad():
            logits = policy.model(input_ids=batch.input_ids).logits
        equal = same_bits(logits, batch.input_ids)
        chunked_fn = updater_module.token_logprobs
        seconds: dict[str, list[float]] = {"chunked": [], "per_sequence": []}
        for i, trees in enumerate(batches):
            kind = "chunked" if i % 2 == 0 else "per_sequence"
            updater_module.token_logprobs = chunked_fn if kind == "chunked" else per_sequence_logprobs
            try:
                start = time.perf_counter()
                updater.sft_step(trees)
                elapsed = time.perf_counter() - start
            finally:
                updater_module.token_logprobs = chunked_fn
            if i >= 2:  # the first of each kind warms up
                seconds[kind].append(elapsed)
    medians = {kind: statistics.median(values) for kind, values in seconds.items()}
    results = {"same_bits": equal, "logits_shape": list(logits.shape), "dtype": str(logits.dtype).replace("torch.", ""),
               "median_seconds": medians, "seconds": seconds,
               "speedup": medians["per_sequence"] / medians["chunked"]}
    settings = {"params": "params.yaml", "demonstration_prompts": len(prompts), "batch_size": size,
                "repeats_each": repeats, "torch_threads": threads, "order": "alternating, chunked first"}
    path = write_report("logprob_chunks", args.out, settings, results, quick=args.quick, started=started)
    print(f"SFT step: chunked {medians['chunked']:.3f} s, one sequence at a time {medians['per_sequence']:.3f} s "
          f"({results['speedup']:.2f}x), same bits: {equal}; wrote {path}")
    return results


if __name__ == "__main__":
    main()
