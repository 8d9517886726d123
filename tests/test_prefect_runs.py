"""Prefect flow runs left RUNNING by a killed stage end Crashed at the next start; live ones are left alone."""

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.states import Running
from prefect.testing.utilities import prefect_test_harness

from flows.prefect_runs import PROCESS_TAG_PREFIX, close_stale_flow_runs, owned_flow_runs, process_tag
from trace.tracking import process_identity


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@flow(name="stage-under-test")
def stage_under_test() -> list[str]:
    from prefect.runtime import flow_run

    return list(flow_run.tags)


@task(name="steps-under-test")
def steps_under_test() -> None:
    return None


def _dead_identity() -> str:
    host, pid, started = process_identity().rsplit(":", 2)
    return f"{host}:{pid}:{float(started) - 3600:.2f}"  # this pid, started an hour ago: a process now gone


def test_flow_and_task_runs_of_a_gone_process_end_crashed_and_live_or_untagged_ones_stay_running(prefect_api):
    with get_client(sync_client=True) as client:
        dead = client.create_flow_run(stage_under_test, tags=[PROCESS_TAG_PREFIX + _dead_identity()],
                                      state=Running())
        dead_task = client.create_task_run(steps_under_test, flow_run_id=dead.id, dynamic_key="0", state=Running())
        live = client.create_flow_run(stage_under_test, tags=[process_tag()], state=Running())
        untagged = client.create_flow_run(stage_under_test, tags=["nightly"], state=Running())

        assert close_stale_flow_runs(client) == [dead.id]

        crashed = client.read_flow_run(dead.id).state
        assert crashed.type == StateType.CRASHED and "was gone" in crashed.message
        assert client.read_task_run(dead_task.id).state.type == StateType.CRASHED
        assert client.read_flow_run(live.id).state.type == StateType.RUNNING
        assert client.read_flow_run(untagged.id).state.type == StateType.RUNNING
        assert close_stale_flow_runs(client) == []


def test_a_flow_started_inside_owned_flow_runs_is_tagged_with_its_process(prefect_api):
    with owned_flow_runs():
        tags = stage_under_test()
    assert process_tag() in tags
