"""The report reads the arms' results per seed from the MLflow runs under the names the UI shows, and links to
them."""

from pathlib import Path

import json

from mlflow.tracking import MlflowClient

import pytest

from flows.common import run_config
from flows.report import collect
from trace.configuration.params_file import load_config
from trace.reporting.report import evaluate_run_ids, first_runs, mlflow_links
from trace.reporting.report_markdown import render_markdown
from trace.tracking import SHARED_VIEW_TAG_PREFIX, arm_result_metrics, share_arms_view, stage_run, summary_metrics

PARAMS = Path(__file__).resolve().parent / "params_tiny.yaml"


def _log_arm(cfg, ablation: str, summary: dict, eval_metrics: dict, seed: int | None = None) -> tuple[str, str]:
    """Runs of one arm at one seed (default the global seed) as the train and evaluate stages log them."""
    cfg = run_config(cfg, cfg.seed if seed is None else seed)
    common = dict(tracking_uri=cfg.tracking.tracking_uri, experiment_name=cfg.tracking.experiment_name,
                  ablation=ablation, seed=cfg.seed)
    with stage_run("train", params={}, params_hash=cfg.resume_hash(), resume=True, **common) as train:
        for step in range(3):
            train.log_metrics({"effective_ratio": 0.5 + 0.1 * step, "tokens/cumulative": 100.0 * (step + 1)}, step)
        train.log_metrics(summary_metrics(summary), 3)
    with stage_run("evaluate", params={}, params_hash=cfg.params_hash(), **common) as evaluate:
        evaluate.log_metrics({**arm_result_metrics(eval_metrics, summary, cfg.evaluate.pass_k), **eval_metrics})
    return train.run_id, evaluate.run_id


def test_report_groups_the_arms_from_their_mlflow_runs_and_links_the_compare_view(tmp_path):
    cfg = load_config(PARAMS, overrides={"tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                         "train.ablations": ["grpo", "trace"]})
    ids = {}
    for ablation, eff, acc in (("grpo", 0.6, 0.40), ("trace", 0.9, 0.55)):
        summary = {"mean/effective_ratio": eff, "mean/effective_token_ratio": eff - 0.05,
                   "mean/active_prompt_ratio": 0.3, "mean/reward/mean": 0.5, "tokens/cumulative": 300.0,
                   "mean/rollout/trajectories": 16.0, "mean/time/step": 0.25, "train/steps": 3.0}
        ids[ablation] = _log_arm(cfg, ablation, summary, {"accuracy/greedy": acc, "accuracy/pass@2": acc + 0.1})

    results = collect(cfg)
    assert list(results["trace"]) == [0]  # one seed: the global one
    assert results["trace"][0]["summary"]["arm/eff_ratio"] == 0.9
    assert [v for _, v in results["trace"][0]["history"]["effective_ratio"]] == [0.5, 0.6, 0.7]
    experiment_id = results["trace"][0]["experiment_id"]
    client = MlflowClient(cfg.tracking.tracking_uri)
    view_key = share_arms_view(client, experiment_id, evaluate_run_ids(results), cfg.evaluate.pass_k)
    links = mlflow_links(results, "http://127.0.0.1:5000", view_key)
    text = render_markdown(results, {"accuracy/greedy": 0.3}, cfg.evaluate.pass_k, links)

    # trace first (held-out 0.55 > 0.40): greedy, mean@2 (not logged here), pass@2, effective ratio, token
    # ratio, active prompts, reward, generated tokens, trajectories per step, seconds per step
    assert "| as grpo | trace | 0.550 | nan | 0.650 | 0.900 | 0.850 | 0.300 | 0.500 | 300 | 16 | 0.25 |" in text
    assert "| as grpo | grpo | 0.400 | nan | 0.500 | 0.600 |" in text
    assert "one seed, no interval" in text
    assert links["runs"] == (f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs?"
                             f"workflowType=machine_learning&viewStateShareKey={view_key}")
    assert ids["trace"][1] in links["compare"] and ids["grpo"][1] in links["compare"]  # the evaluate runs
    assert f"[compare the arms]({links['compare']})" in text


def test_the_shared_arms_view_lists_the_evaluate_runs_best_first_with_the_headline_columns_in_front(tmp_path):
    cfg = load_config(PARAMS, overrides={"tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    summary = {"mean/effective_ratio": 0.7, "mean/effective_token_ratio": 0.6, "mean/active_prompt_ratio": 0.3,
               "mean/reward/mean": 0.5, "tokens/cumulative": 100.0, "mean/time/step": 0.2}
    evaluate_ids = [_log_arm(cfg, ablation, summary, {"accuracy/greedy": acc, "accuracy/pass@2": acc})[1]
                    for ablation, acc in (("grpo", 0.2), ("trace", 0.6))]
    client = MlflowClient(cfg.tracking.tracking_uri)
    experiment_id = client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id
    key = share_arms_view(client, experiment_id, evaluate_ids, cfg.evaluate.pass_k)
    view = json.loads(client.get_experiment(experiment_id).tags[SHARED_VIEW_TAG_PREFIX + key])
    # the view's filter and order, run by MLflow itself: the two evaluate runs, not the train runs, best first
    shown = client.search_runs([experiment_id], view["searchFilter"], order_by=["metrics.`arm/acc` DESC"])
    assert [r.info.run_id for r in shown] == evaluate_ids[::-1]
    assert view["orderByKey"] == "metrics.`arm/acc`" and view["orderByAsc"] is False
    assert view["columnOrder"][:3] == ["metrics.`arm/acc`", "metrics.`arm/eff_ratio`", "metrics.`arm/pass_2`"]
    logged = set(shown[0].data.metrics)
    assert all(c[len("metrics.`"):-1] in logged for c in view["selectedColumns"] if c.startswith("metrics."))


def test_the_report_reads_one_run_per_arm_and_seed_and_pairs_the_seeds(tmp_path):
    cfg = load_config(PARAMS, overrides={"tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                         "train.ablations": ["grpo", "trace"], "train.seeds": [0, 1, 2]})
    # trace beats grpo by 0.10, 0.12, 0.11 at seeds 0, 1, 2: mean 0.11, s = 0.01, half = 4.303 * 0.01 / sqrt(3)
    for seed, (grpo_acc, trace_acc) in enumerate(((0.40, 0.50), (0.30, 0.42), (0.35, 0.46))):
        for ablation, acc in (("grpo", grpo_acc), ("trace", trace_acc)):
            _log_arm(cfg, ablation, {"mean/effective_ratio": 0.5, "tokens/cumulative": 300.0},
                     {"accuracy/greedy": acc}, seed=seed)
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seeds": (5,)})})
    _log_arm(other, "trace", {"mean/effective_ratio": 0.5}, {"accuracy/greedy": 0.99}, seed=5)  # not reported
    results = collect(cfg)
    assert {abl: list(by_seed) for abl, by_seed in results.items()} == {"grpo": [0, 1, 2], "trace": [0, 1, 2]}
    assert [results["trace"][s]["eval"]["accuracy/greedy"] for s in (0, 1, 2)] == [0.50, 0.42, 0.46]
    client = MlflowClient(cfg.tracking.tracking_uri)
    assert client.get_run(results["trace"][1]["run_id"]).data.tags["trace.seed"] == "1"
    assert client.get_run(results["trace"][2]["eval_run_id"]).data.tags["trace.seed"] == "2"
    assert first_runs(results)["grpo"] is results["grpo"][0]
    text = render_markdown(results, {}, cfg.evaluate.pass_k)
    half = 4.302653 * 0.01 / 3 ** 0.5
    assert f"held-out greedy accuracy +0.110, t over seeds [{0.11 - half:+.3f}, {0.11 + half:+.3f}]; decided by t" in text
    assert "Seeds 0, 1, 2 (3 runs per arm)" in text
    assert "| above grpo | trace | 0.460 ± 0.099 |" in text  # 0.50, 0.42, 0.46: s = 0.04, half = 4.303 * 0.04 / sqrt(3)


def _view_of_link(client, experiment_id: str, url: str) -> dict:
    """The shared runs-table view a runs-table link opens (its ``viewStateShareKey``)."""
    from urllib.parse import parse_qs, unquote

    key = parse_qs(url.split("?", 1)[1])["viewStateShareKey"][0]
    return json.loads(client.get_experiment(experiment_id).tags[SHARED_VIEW_TAG_PREFIX + unquote(key)])


def test_the_arms_results_link_shows_every_seeds_evaluate_run_grouped_by_arm(tmp_path):
    import mlflow

    cfg = load_config(PARAMS, overrides={"tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                         "train.ablations": ["grpo", "trace"], "train.seeds": [0, 1, 2]})
    for seed in range(3):
        for ablation, acc in (("grpo", 0.3 + 0.01 * seed), ("trace", 0.4 + 0.01 * seed)):
            _log_arm(cfg, ablation, {"mean/effective_ratio": 0.5}, {"accuracy/greedy": acc}, seed=seed)
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seeds": (5,)})})
    _log_arm(other, "trace", {"mean/effective_ratio": 0.5}, {"accuracy/greedy": 0.99}, seed=5)  # another grid
    results = collect(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    experiment_id = results["grpo"][0]["experiment_id"]
    key = share_arms_view(client, experiment_id, evaluate_run_ids(results), cfg.evaluate.pass_k)
    link = mlflow_links(results, "http://127.0.0.1:5000", key)["runs"]
    view = _view_of_link(client, experiment_id, link)

    # the link's filter, run by MLflow itself: the 2 arms x 3 seeds of this report, nothing else
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    shown = mlflow.search_runs([experiment_id], view["searchFilter"], output_format="list")
    assert sorted((r.data.tags["trace.ablation"], r.data.tags["trace.seed"], r.data.tags["trace.stage"])
                  for r in shown) == [(a, str(s), "evaluate") for a in ("grpo", "trace") for s in range(3)]
    assert {r.info.run_id for r in shown} == {results[a][s]["eval_run_id"] for a in results for s in range(3)}
    # grouped by arm, the group row the mean over seeds (the report's table); each run's seed in a column
    assert view["groupBy"] == {"aggregateFunction": "average",
                               "groupByKeys": [{"mode": "param", "groupByData": "ablation"}]}
    assert "tags.`trace.seed`" in view["selectedColumns"]
    # the same runs give the same key: a report rebuilt from the same MLflow data links the same view
    assert share_arms_view(client, experiment_id, evaluate_run_ids(results)[::-1], cfg.evaluate.pass_k) == key


def test_the_global_seeds_run_keeps_the_hashes_of_a_config_without_seeds():
    cfg = load_config(PARAMS)
    seeded = load_config(PARAMS, overrides={"train.seeds": [0, 1]})
    assert seeded.params_hash() == cfg.params_hash() and run_config(seeded, 0) is seeded
    assert run_config(seeded, 1).seed == 1 and run_config(seeded, 1).resume_hash() != cfg.resume_hash()
    with pytest.raises(ValueError, match=r"--seed 3 is not a training seed \[0, 1\]: add it to train.seeds"):
        run_config(seeded, 3)
