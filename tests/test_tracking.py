import math
import socket
import time

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from trace.tracking import (EXPERIMENT_KIND_TAG, HEADLINE_METRICS, MODEL_TRAINING_KIND, PROCESS_TAG,
                            SUMMARY_METRIC_NAMES, UI_COLUMN_CHARS, arm_result_metrics, close_stale_runs,
                            compare_url, ensure_experiment, experiment_url, finished_runs, heldout_pass_name,
                            metric_key, process_identity, process_is_gone, run_name, stage_run, summary_metrics)


def _uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _dead_identity() -> str:
    """This host and pid with an earlier start time: the identity of a process that is gone."""
    host, pid, started = process_identity().rsplit(":", 2)
    return f"{host}:{pid}:{float(started) - 3600:.2f}"


def test_stage_run_is_tagged_named_and_logs_the_arm_and_experiment_as_params(tmp_path):
    uri = _uri(tmp_path)
    with stage_run("train", tracking_uri=uri, experiment_name="exp", params={"update": {"lr": 1e-3}},
                   params_hash="abc123def456", ablation="trace", seed=3, dvc_experiment="lr-sweep") as run:
        run.log_metrics({"effective_ratio": 0.5, "accuracy/pass@4": 1.0, "bad": math.nan}, step=0)
    data = MlflowClient(uri).get_run(run.run_id).data
    assert data.tags["mlflow.runName"] == "train-trace-s3-lr-sweep"
    assert data.params["update.lr"] == "0.001" and data.params["ablation"] == "trace"
    assert data.params["dvc.exp_name"] == "lr-sweep"
    assert data.tags["trace.ablation"] == "trace" and data.tags["trace.stage"] == "train"
    assert "git.commit" in data.tags and data.tags["trace.params_hash"] == "abc123def456"
    assert data.tags[PROCESS_TAG] == process_identity()
    assert "accuracy/pass_at_4" in data.metrics and "bad" not in data.metrics
    assert [r.info.run_id for r in finished_runs(uri, "exp", "train")] == [run.run_id]


def test_outside_a_dvc_experiment_the_run_name_carries_the_params_hash(tmp_path, monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    with stage_run("warmup", tracking_uri=_uri(tmp_path), experiment_name="exp", params={"seed": 0},
                   params_hash="0f1e2d3c4b5a", seed=0) as run:
        pass
    monkeypatch.setenv("DVC_EXP_NAME", "fussy-barb")  # what `dvc exp run` sets for every stage command
    with stage_run("warmup", tracking_uri=_uri(tmp_path), experiment_name="exp", params={"seed": 0},
                   params_hash="0f1e2d3c4b5a", seed=0) as in_exp:
        pass
    client = MlflowClient(_uri(tmp_path))
    assert client.get_run(run.run_id).info.run_name == "warmup-s0-0f1e2d"
    assert client.get_run(run.run_id).data.params["dvc.exp_name"] == "workspace"
    assert client.get_run(in_exp.run_id).info.run_name == "warmup-s0-fussy-barb"
    assert client.get_run(in_exp.run_id).data.params["dvc.exp_name"] == "fussy-barb"


def test_run_name_leaves_out_the_parts_a_stage_lacks():
    assert run_name("train", "trace_prefix", 0, "exp-1") == "train-trace_prefix-s0-exp-1"
    assert run_name("report", "", None, "3f2a9c") == "report-3f2a9c"


def test_a_new_experiment_is_marked_as_model_training_and_an_existing_one_gets_the_mark(tmp_path):
    client = MlflowClient(_uri(tmp_path))
    created = client.get_experiment(ensure_experiment(client, "fresh"))
    assert created.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    assert "evaluate-*" in created.tags["mlflow.note.content"]
    old_id = client.create_experiment("made-before")  # as an older version created it: no kind
    assert ensure_experiment(client, "made-before") == old_id
    assert client.get_experiment(old_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    chosen_id = client.create_experiment("user-chose", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    ensure_experiment(client, "user-chose")
    assert client.get_experiment(chosen_id).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_a_deleted_experiment_stops_the_stage_with_how_to_restore_it(tmp_path):
    client = MlflowClient(_uri(tmp_path))
    exp_id = client.create_experiment("gone")
    client.delete_experiment(exp_id)
    with pytest.raises(RuntimeError, match=f"mlflow experiments restore --experiment-id {exp_id}"):
        ensure_experiment(client, "gone")


def test_ui_links_open_the_runs_table_in_the_model_training_view_and_the_compare_view():
    assert experiment_url("http://127.0.0.1:5000", "7") == \
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert compare_url("http://h:5000", "7", ["a1", "b2"]) == \
        "http://h:5000/#/compare-runs?runs=%5B%22a1%22%2C%20%22b2%22%5D&experiments=%5B%227%22%5D"


def test_process_identity_tells_a_live_process_from_a_gone_one():
    assert not process_is_gone(process_identity())
    assert process_is_gone(_dead_identity())  # same pid, started earlier: that process ended
    host, pid, started = process_identity().rsplit(":", 2)
    assert not process_is_gone(f"another-{host}:{pid}:{float(started) - 3600}")  # cannot tell: left alone
    assert not process_is_gone("not an identity") and not process_is_gone(None)


def _stale_run(client, exp_id: str, run_key: str, identity: str | None, start_ms: int, last_ms: int) -> str:
    tags = {"trace.run_key": run_key, "trace.stage": run_key.split("/")[0],
            "trace.ablation": run_key.split("/")[1], "trace.params_hash": run_key.split("/")[2]}
    if identity:
        tags[PROCESS_TAG] = identity
    run_id = client.create_run(exp_id, start_time=start_ms, tags=tags, run_name="killed").info.run_id
    client.log_batch(run_id, metrics=[Metric("tokens/cumulative", 10.0, start_ms + 500, 0),
                                      Metric("tokens/cumulative", 20.0, last_ms, 1)])
    return run_id


def test_the_next_stage_start_closes_runs_of_dead_processes_as_killed_at_their_last_metric(tmp_path):
    uri = _uri(tmp_path)
    client = MlflowClient(uri)
    exp_id = ensure_experiment(client, "exp")
    now = int(time.time() * 1000)
    dead = _stale_run(client, exp_id, "warmup//h1", _dead_identity(), now - 3_600_000, now - 3_500_000)
    alive = _stale_run(client, exp_id, "warmup//h2", process_identity(), now - 60_000, now - 1_000)
    elsewhere = _stale_run(client, exp_id, "warmup//h3", f"other-{socket.gethostname()}:1:1.0", now - 9, now)
    untagged_same_key = _stale_run(client, exp_id, "prepare//h4", None, now - 5_000, now - 4_000)
    untagged_other_key = _stale_run(client, exp_id, "seed_rollouts//h5", None, now - 5_000, now - 4_000)
    with stage_run("prepare", tracking_uri=uri, experiment_name="exp", params={}, params_hash="h4"):
        pass
    killed = client.get_run(dead).info
    assert killed.status == "KILLED" and killed.end_time == now - 3_500_000  # not the restart time
    assert "was gone" in client.get_run(dead).data.tags["trace.killed"]
    assert client.get_run(untagged_same_key).info.status == "KILLED"
    for run_id in (alive, elsewhere, untagged_other_key):
        assert client.get_run(run_id).info.status == "RUNNING"
    assert close_stale_runs(client, exp_id) == []


def test_a_resumed_stage_continues_in_a_new_run_whose_duration_leaves_out_the_dead_time(tmp_path):
    uri = _uri(tmp_path)
    client = MlflowClient(uri)
    exp_id = ensure_experiment(client, "exp")
    now = int(time.time() * 1000)
    # ran 100 s an hour ago, then was killed: 100 s alive, an hour dead
    old = _stale_run(client, exp_id, "train/trace/abc", _dead_identity(), now - 3_600_000, now - 3_500_000)
    client.set_tag(old, "warmup.reason", "kept step 600")
    kwargs = dict(tracking_uri=uri, experiment_name="exp", params_hash="abc", ablation="trace")
    with stage_run("train", params={"update": {"lr": 5e-4}}, resume=True, **kwargs) as run:
        run.log_metrics({"tokens/cumulative": 30.0}, step=2)
    new = client.get_run(run.run_id)
    assert run.run_id != old and new.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "tokens/cumulative")] == \
        [(0, 10.0), (1, 20.0), (2, 30.0)]
    duration_s = (new.info.end_time - new.info.start_time) / 1000
    assert 100 <= duration_s < 130, duration_s
    assert new.data.params["update.lr"] == "0.0005"  # a new run logs this execution's params
    assert new.data.tags["trace.continues"] == old and new.data.tags["warmup.reason"] == "kept step 600"
    earlier = client.get_run(old)
    assert earlier.info.status == "KILLED" and earlier.info.lifecycle_stage == "deleted"
    assert earlier.data.tags["trace.continued_in"] == run.run_id
    assert [r.info.run_id for r in finished_runs(uri, "exp", "train")] == [run.run_id]


def test_a_resumable_stage_without_an_earlier_run_starts_a_fresh_one(tmp_path):
    with stage_run("train", tracking_uri=_uri(tmp_path), experiment_name="exp", params={}, params_hash="h",
                   ablation="grpo", resume=True) as run:
        pass
    info = MlflowClient(_uri(tmp_path)).get_run(run.run_id)
    assert info.info.status == "FINISHED" and "trace.continues" not in info.data.tags


def test_metric_keys_are_made_acceptable_to_mlflow():
    assert metric_key("accuracy/pass@4") == "accuracy/pass_at_4"
    assert metric_key("accuracy/greedy_hops=2") == "accuracy/greedy_hops_2"


def test_a_failing_stage_ends_failed_and_an_interrupted_one_killed(tmp_path):
    uri = _uri(tmp_path)
    ids = {}
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with stage_run("warmup", tracking_uri=uri, experiment_name="exp", params={}, params_hash="h") as run:
                ids[type(exc)] = run.run_id
                raise exc
    client = MlflowClient(uri)
    assert client.get_run(ids[RuntimeError]).info.status == "FAILED"
    assert client.get_run(ids[KeyboardInterrupt]).info.status == "KILLED"


def _truncated(names) -> list[str]:
    return [name[:UI_COLUMN_CHARS] for name in names]


def test_run_level_metric_names_stay_distinct_when_the_ui_cuts_them_to_its_column_width():
    names = [*SUMMARY_METRIC_NAMES.values(), *HEADLINE_METRICS, heldout_pass_name(4), heldout_pass_name(16)]
    names = list(dict.fromkeys(names))
    assert len(set(_truncated(names))) == len(names), sorted(_truncated(names))
    # the names these replace did not: three columns all read "summary/mean"
    old = ["summary/" + key for key in SUMMARY_METRIC_NAMES]
    assert len(set(_truncated(old))) < len(old)


def test_evaluate_run_results_start_with_held_out_accuracy_and_mean_effective_ratio():
    summary = {"train/steps": 20.0, "mean/effective_ratio": 0.9, "mean/reward/mean": 0.6,
               "tokens/cumulative": 3e4, "mean/new_thing": 2.0, "ablation": "trace"}
    out = arm_result_metrics({"accuracy/greedy": 0.93, "accuracy/pass@4": 0.95, "accuracy/truncated": 0.0},
                             summary, pass_k=4)
    assert list(out)[:3] == ["arm/acc", "arm/eff_ratio", "arm/pass_4"]
    assert out["arm/acc"] == 0.93 and out["arm/eff_ratio"] == 0.9 and out["arm/reward"] == 0.6
    assert out["arm/tokens"] == 3e4 and out["arm/mean_new_thing"] == 2.0 and "ablation" not in str(out)
    assert list(summary_metrics(summary))[0] == "arm/eff_ratio"


def test_stage_runs_of_this_process_are_not_closed_by_a_stage_start_while_open(tmp_path):
    uri = _uri(tmp_path)
    with stage_run("train", tracking_uri=uri, experiment_name="exp", params={}, params_hash="h",
                   ablation="trace") as outer:
        with stage_run("evaluate", tracking_uri=uri, experiment_name="exp", params={}, params_hash="h",
                       ablation="trace"):
            pass
        assert MlflowClient(uri).get_run(outer.run_id).info.status == "RUNNING"


def test_without_a_tracking_uri_a_queued_experiment_logs_into_the_main_repositorys_database(monkeypatch, tmp_path):
    from trace.tracking import REPO_ROOT, resolve_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert resolve_tracking_uri(None) == f"sqlite:///{REPO_ROOT / 'mlflow.db'}"
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # DVC sets it to the main repository, even in a queued copy
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere.db")
    assert resolve_tracking_uri(None) == "sqlite:////elsewhere.db"
