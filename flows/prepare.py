"""Stage ``prepare``: materialise the task's train and eval (dev) prompts, and its test prompts where the task
generates them (``task.kgqa.num_test > 0``), as JSON lines under data/prepared."""

from __future__ import annotations

from collections import Counter

from prefect import flow

from flows.common import stage_main, PREPARED, build_environment, open_run, stage_params, write_json


def prepared_splits(cfg) -> tuple[str, ...]:
    """The splits the stage writes: train and eval, and test where ``task.kgqa.num_test > 0``."""
    has_test = cfg.task.name.value == "kgqa" and cfg.task.kgqa.num_test > 0
    return ("train", "eval", "test") if has_test else ("train", "eval")


def task_prompts(cfg, env, split: str):
    """Prompts of a split: the environment's own (generated tasks) or the task's data files."""
    from trace.envs.base import GeneratesPrompts

    if isinstance(env, GeneratesPrompts):
        return list(env.prompts(split))
    from trace.data.splits import load_prompts

    return load_prompts(cfg.task, split)


@flow(name="prepare", log_prints=False)
def prepare_flow(params: str) -> dict:
    from trace.data_paths import DataError
    from trace.configuration.params_file import load_config
    from trace.prepared import check_unique_prompt_uids, save_prompts

    cfg = load_config(params)
    env = build_environment(cfg)
    summary = {}
    with open_run(cfg, "prepare", stage_params(cfg, "prepare")) as run:
        splits = {split: task_prompts(cfg, env, split) for split in prepared_splits(cfg)}
        for split, prompts in splits.items():  # a real task's loader names the file and skipped rows itself
            if not prompts:
                raise DataError(f"task {cfg.task.name.value!r} gave no {split} prompt; raise its prompt counts "
                                f"in the task section of {params}")
        check_unique_prompt_uids(splits)  # before writing: a clash names both places and leaves no half output
        for split, prompts in splits.items():
            save_prompts(prompts, PREPARED / f"{split}.jsonl")
            summary[f"{split}/num_prompts"] = len(prompts)
            hops = Counter(p.meta.get("num_hops") for p in prompts if p.meta.get("num_hops") is not None)
            summary.update({f"{split}/hops{h}": n for h, n in sorted(hops.items())})
        write_json(PREPARED / "summary.json", summary)
        run.log_metrics({f"prepare/{k}": v for k, v in summary.items()})
    print(f"prepared {summary}")
    return summary


def main(argv=None) -> None:
    stage_main(prepare_flow, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
