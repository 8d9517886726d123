"""The SFT step of the warmup with ``token_logprobs`` over chunks of whole sequences against one sequence at a time.

``trace.losses.token_logprobs`` takes the float32 log-softmax over chunks of up to ``LOGPROB_CHUNK_ELEMENTS``
logits (at the default policy's shapes, the whole micro-batch at once). Taken one sequence at a time, as it was
before, the backward pass of each sequence's slice writes a zero tensor of the whole (B, T, V) logits and adds
its slice into it: B such tensors a micro-batch. This times ``PolicyUpdater.sft_step`` on batches of the default
task's solver demonstrations (``warmup.batch_size``, the default policy and precision of ``params.yaml``), each way
in its own processes, alternating (chunked, per sequence, chunked, per sequence), as a warmup stage runs one of
them. Each process checks on one batch, after its timed steps, that both ways give the same log-probs and
gradients bit for bit.

Usage: ``python -m benchmarks.logprob_chunks [--quick] [--threads N]``; writes
``reports/benchmarks/logprob_chunks.json``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
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


def same_bits(logits, input_ids, chunked=None) -> bool:
    """Whether ``chunked`` (default ``trace.losses.token_logprobs``) and ``per_sequence_logprobs`` give equal
    log-probs and gradients, bit for bit."""
    import torch

    if chunked is None:
        from trace.losses import token_logprobs as chunked
    results = []
    weight = torch.randn(input_ids.shape, generator=torch.Generator().manual_seed(0))
    for fn in (chunked, per_sequence_logprobs):
        x = logits.detach().clone().requires_grad_(True)
        out = fn(x, input_ids)
        (out * weight).sum().backward()
        results.append((out.detach(), x.grad))
    return all(torch.equal(a, b) for a, b in zip(*results))


def time_sft_steps(variant: str, threads: int, quick: bool) -> dict:
    """One process's share: ``PolicyUpdater.sft_step`` timed on demonstration batches with ``variant``'s log-probs.

    Args:
        variant: ``chunked`` (``trace.losses.token_logprobs``) or ``per_sequence`` (``per_sequence_logprobs``).
        threads: torch intra-op threads.
        quick: 200 demonstration prompts and 2 timed steps instead of 2,000 and 10.

    Returns:
        ``{"seconds": [...], "same_bits": bool, "per_sequence_calls": int (the steps' calls of the reference: 0
        when chunked), "logits_shape": [B, T, V], "dtype": str, "batch_size": int, "demonstration_prompts": int}``;
        the first two steps (untimed) warm up.
    """
    import numpy as np
    import torch

    import trace.losses as losses_module
    import trace.update.updater as updater_module
    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment
    from trace.policy.build import build_policy
    from trace.training.warmup import demonstration_trees
    from trace.update import PolicyUpdater
    from trace.update.batch import build_training_batch

    chunked, calls = losses_module.token_logprobs, {"per_sequence": 0}

    def counted(*args, **kwargs):
        calls["per_sequence"] += 1
        return per_sequence_logprobs(*args, **kwargs)

    if variant == "per_sequence":  # sft_loss reads trace.losses' global; the RL losses, the updater's import
        losses_module.token_logprobs = updater_module.token_logprobs = counted
    elif variant != "chunked":
        raise ValueError(f"variant={variant!r} is not chunked or per_sequence")
    cfg = load_config("params.yaml")
    env = make_environment(cfg.task, cfg.seed)
    prompts = env.prompts("train")[: 200 if quick else 2000]
    repeats = 2 if quick else 10
    with torch_threads(threads):
        policy = build_policy(cfg.policy, env, cfg.seed, cfg.task.name.value)
        demos = demonstration_trees(policy, env, prompts, cfg.warmup.demo_noise, cfg.seed)
        w = cfg.warmup
        updater = PolicyUpdater(policy.model, cfg.update.model_copy(update={
            "lr": w.lr, "ppo_epochs": 1, "kl_coef": 0.0, "gradient_checkpointing": False}), seed=cfg.seed,
            pad_token_id=policy.tokenizer.pad_token_id, max_tokens=cfg.policy.max_context_tokens)
        rng = np.random.default_rng(cfg.seed)
        size = min(w.batch_size, len(demos))
        batches = [[demos[i] for i in rng.choice(len(demos), size, replace=False)] for _ in range(repeats + 2)]
        seconds = []
        for trees in batches:
            start = time.perf_counter()
            updater.sft_step(trees)
            seconds.append(time.perf_counter() - start)
        # the bit-for-bit check, after the timed steps
        batch = build_training_batch(batches[0], policy.tokenizer.pad_token_id, cfg.policy.max_context_tokens,
                                     require_advantages=False)
        with torch.no_grad():
            logits = policy.model(input_ids=batch.input_ids).logits
        timed_calls = calls["per_sequence"]
        equal = same_bits(logits, batch.input_ids, chunked)
    return {"seconds": seconds[2:], "same_bits": equal, "per_sequence_calls": timed_calls,
            "logits_shape": list(logits.shape),
            "dtype": str(logits.dtype).replace("torch.", ""), "batch_size": size, "demonstration_prompts": len(prompts)}


def _in_fresh_process(variant: str, threads: int, quick: bool) -> dict:
    """``time_sft_steps`` in a new interpreter, as a stage runs: one way per process (the per-sequence way patches
    module globals)."""
    code = ("import json; from benchmarks.logprob_chunks import time_sft_steps; "
            f"print('RESULT ' + json.dumps(time_sft_steps({variant!r}, {threads}, {quick})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the {variant} process failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args("the warmup's SFT step: token_logprobs in chunks against one sequence at a time", argv)
    started = time.perf_counter()
    rounds = 1 if args.quick else 2
    order = ["chunked", "per_sequence"] * rounds  # alternating processes
    runs = [(variant, _in_fresh_process(variant, args.threads, args.quick)) for variant in order]
    seconds = {variant: [t for v, r in runs if v == variant for t in r["seconds"]] for variant in order[:2]}
    medians = {variant: statistics.median(values) for variant, values in seconds.items()}
    process_medians = {variant: [statistics.median(r["seconds"]) for v, r in runs if v == variant]
                       for variant in order[:2]}
    first = runs[0][1]
    results = {"same_bits": all(r["same_bits"] for _, r in runs), "logits_shape": first["logits_shape"],
               "per_sequence_calls": {variant: [r["per_sequence_calls"] for v, r in runs if v == variant]
                                      for variant in order[:2]},
               "dtype": first["dtype"], "median_seconds": medians, "process_median_seconds": process_medians,
               "seconds": seconds, "speedup": medians["per_sequence"] / medians["chunked"]}
    settings = {"params": "params.yaml", "demonstration_prompts": first["demonstration_prompts"],
                "batch_size": first["batch_size"], "timed_steps_per_process": len(first["seconds"]),
                "processes": order, "torch_threads": args.threads}
    path = write_report("logprob_chunks", args.out, settings, results, quick=args.quick, started=started)
    print(f"SFT step: chunked {medians['chunked']:.3f} s, one sequence at a time {medians['per_sequence']:.3f} s "
          f"({results['speedup']:.2f}x; per process {process_medians}), same bits: {results['same_bits']}; "
          f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
