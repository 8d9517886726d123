import math

from mlflow.tracking import MlflowClient

from trace.tracking import finished_runs, metric_key, stage_run


def test_stage_run_is_tagged_and_a_resumed_run_continues_without_relogging_params(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    kwargs = dict(tracking_uri=uri, experiment_name="exp", params_hash="abc", ablation="trace")
    with stage_run("train", params={"update": {"lr": 1e-3}}, resume=True, **kwargs) as run:
        run.log_metrics({"effective_ratio": 0.5, "accuracy/pass@4": 1.0, "bad": math.nan}, step=0)
        first_id = run.run_id
    # a changed value of an existing param would be refused by MLflow: resuming must not log params again
    with stage_run("train", params={"update": {"lr": 5e-4}}, resume=True, **kwargs) as run:
        run.log_metrics({"effective_ratio": 0.75}, step=1)
        assert run.run_id == first_id
    client = MlflowClient(uri)
    data = client.get_run(first_id).data
    assert data.params["update.lr"] == "0.001"
    assert data.tags["trace.ablation"] == "trace" and data.tags["trace.stage"] == "train"
    assert "git.commit" in data.tags and data.tags["trace.params_hash"] == "abc"
    assert [m.value for m in client.get_metric_history(first_id, "effective_ratio")] == [0.5, 0.75]
    assert "accuracy/pass_at_4" in data.metrics and "bad" not in data.metrics
    assert [r.info.run_id for r in finished_runs(uri, "exp", "train")] == [first_id]


def test_metric_keys_are_made_acceptable_to_mlflow():
    assert metric_key("accuracy/pass@4") == "accuracy/pass_at_4"
    assert metric_key("accuracy/greedy_hops=2") == "accuracy/greedy_hops_2"


def test_a_failing_stage_marks_its_run_failed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    try:
        with stage_run("warmup", tracking_uri=uri, experiment_name="exp", params={}, params_hash="h") as run:
            run_id = run.run_id
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"
