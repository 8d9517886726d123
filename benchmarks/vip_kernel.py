"""VIP's kernel between training questions of the default task: are its features informative?

The GP of ``trace.allocation.vip`` carries what it learns of one prompt to another through the RBF kernel
``exp(-d^2 / (2 l^2))`` of their features. When almost every pair of training questions sits at a kernel value
near 0, an observation informs no other prompt and every unseen prompt is forecast at the prior. This measures,
for the first ``--questions`` training questions of the default task (``params.yaml``'s ``task``, seed
``seed``), the median and the 99th percentile of the kernel value over all distinct pairs, for each feature kind
(``hashed``: 256 hashed word uni/bigrams; ``minilm``: all-MiniLM-L6-v2) and length scale (0.27 and 0.4, the two
values of the original's code, and a few around them), with the median pairwise distance.

Usage: ``python -m benchmarks.vip_kernel [--quick]``; writes ``reports/benchmarks/vip_kernel.json``.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from benchmarks.common import parse_args, write_report

LENGTH_SCALES = (0.1, 0.27, 0.4, 0.6, 1.0)
FEATURES = ("hashed", "minilm")


def pairwise_kernel_statistics(x: np.ndarray, length_scale: float) -> dict[str, float]:
    """Median and 99th percentile of the RBF kernel over the distinct pairs of the rows of ``x``.

    Args:
        x: (N, D) float64 features, N >= 2.
        length_scale: the kernel's ``l``.

    Returns:
        ``{"median", "p99", "share_above_0.1"}`` of ``exp(-|x_i - x_j|^2 / (2 l^2))`` over ``i < j``.
    """
    from trace.allocation.vip import rbf_kernel

    k = rbf_kernel(x, x, length_scale)[np.triu_indices(x.shape[0], k=1)]
    return {"median": float(np.median(k)), "p99": float(np.percentile(k, 99)),
            "share_above_0.1": float(np.mean(k > 0.1))}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args("VIP's kernel statistics between training questions of the default task", argv)
    started = time.perf_counter()
    from trace.allocation.vip import embed_prompts, minilm_features
    from trace.configuration.params_file import load_config
    from trace.envs.registry import make_environment

    cfg = load_config("params.yaml")
    num_questions = 20 if args.quick else 200
    prompts = make_environment(cfg.task, cfg.seed).prompts("train")[:num_questions]
    texts = [p.question for p in prompts]
    features = {"hashed": embed_prompts(texts, cfg.allocation.vip.embedding_dim), "minilm": minilm_features(texts)}
    results: dict = {}
    for kind in FEATURES:
        x = features[kind]
        d = np.sqrt(np.maximum(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1), 0.0))[np.triu_indices(len(x), k=1)]
        results[kind] = {"median_distance": float(np.median(d)),
                         "by_length_scale": {str(ls): pairwise_kernel_statistics(x, ls) for ls in LENGTH_SCALES}}
    settings = {"task": cfg.task.name, "seed": cfg.seed, "questions": num_questions, "pairs":
                num_questions * (num_questions - 1) // 2, "length_scales": list(LENGTH_SCALES),
                "embedding_dim": cfg.allocation.vip.embedding_dim, "example_questions": texts[:3]}
    path = write_report("vip_kernel", args.out, settings, results, quick=args.quick, started=started)
    for kind in FEATURES:
        stats = results[kind]["by_length_scale"]
        print(kind, f"median distance {results[kind]['median_distance']:.3f}",
              {ls: (round(v["median"], 5), round(v["p99"], 5)) for ls, v in stats.items()})
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
