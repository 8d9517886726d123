"""Peak memory of one policy-update micro-batch: with and without ``update.gradient_checkpointing``.

One forward and backward of the clipped surrogate (``trace.losses``) through the preset's policy, as the RL update
computes it: the weights in bf16 (``update.bf16``), LoRA adapters when ``update.lora.enabled``, 4 right-padded rows
of 1, 3/4, 5/12 and 1/6 of ``--tokens`` (1,200 / 900 / 500 / 200 at the default: a micro-batch of
``update.micro_batch_size`` 4 with one long multi-turn trajectory), advantage 1 on every token. Each setting runs in its own process, so each peak resident
size (``ru_maxrss``) is that setting's alone. Eager attention keeps a (rows, heads, T, T) softmax per layer for
the backward; checkpointing recomputes each layer's activations in the backward instead, so they are not held.

Usage:  python -m scripts.update_memory [--params params/hotpotqa.yaml] [--tokens 1200] [--threads 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def measure(params: str, tokens: int, checkpointing: bool, threads: int, dtype: str | None = None) -> dict:
    """Run one micro-batch in this process; returns the loss, seconds and peak resident GB.

    ``dtype``: "bfloat16" or "float32" for the weights; None takes the preset's (bfloat16 when ``update.bf16``).
    A CPU without native bf16 matrix products (no AVX512-BF16 or AMX) runs bfloat16 several times slower.
    """
    import resource
    import time

    import torch

    from trace.losses import clipped_surrogate_loss, token_logprobs
    from trace.configuration.params_file import load_config
    from trace.policy.lora import apply_lora
    from trace.policy.model import load_pretrained_policy

    lengths = [round(tokens * share) for share in (1.0, 3 / 4, 5 / 12, 1 / 6)]
    if min(lengths) < 2:
        raise SystemExit(f"--tokens {tokens}: the shortest row ({min(lengths)} tokens) needs at least 2; use --tokens >= 12")
    torch.set_num_threads(threads)
    cfg = load_config(params)
    policy = load_pretrained_policy(cfg.policy)
    dtype = dtype or ("bfloat16" if cfg.update.bf16 else "float32")
    policy.model.to(getattr(torch, dtype))
    apply_lora(policy, cfg.update.lora, cfg.seed)
    model = policy.model
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()  # frozen embeddings: checkpointed layers still see a grad input
    model.train()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(100, 40000, (len(lengths), tokens), generator=generator)
    mask = torch.zeros(len(lengths), tokens)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1.0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    started = time.perf_counter()
    logits = model(input_ids=input_ids, attention_mask=mask.long()).logits
    logprobs = token_logprobs(logits, input_ids)
    loss, _ = clipped_surrogate_loss(logprobs, logprobs.detach(), torch.ones_like(mask), mask)
    loss.backward()
    return {"tokens": lengths, "gradient_checkpointing": checkpointing, "threads": threads, "dtype": dtype,
            "loss": float(loss), "seconds": time.perf_counter() - started, "rss_before_gb": before,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params/hotpotqa.yaml")
    parser.add_argument("--tokens", type=int, default=1200, help="length of the longest row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="weights' dtype (default: the preset's, bfloat16 when update.bf16)")
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # a child process: one setting
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.params, args.tokens, args.one == "on", args.threads, args.dtype)))
        return
    for setting in ("on", "off"):
        child = subprocess.run([sys.executable, "-m", "scripts.update_memory", "--params", args.params, "--tokens",
                                str(args.tokens), "--threads", str(args.threads), "--one", setting,
                                *(["--dtype", args.dtype] if args.dtype else [])],
                               capture_output=True, text=True)
        if child.returncode != 0:
            print(json.dumps({"gradient_checkpointing": setting == "on", "returncode": child.returncode,
                              "error": child.stderr.strip().splitlines()[-1:] or "killed (out of memory?)"}))
        else:
            print(child.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
