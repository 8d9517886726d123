"""Prefect flow runs of dead processes are closed as Crashed, at the next start at the latest.

Prefect itself ends a flow run that raises (Failed) or gets SIGTERM or Ctrl-C (Crashed); a process killed
outright (SIGKILL, out of memory, power) leaves its flow run, and the task run it was in, RUNNING for ever.
So every flow a stage starts is tagged ``trace.process=<host>:<pid>:<start>`` (``trace.tracking``'s
``process_identity``) from its creation on, and each stage start first sets the RUNNING and PENDING flow
runs whose tagged process is gone, and their RUNNING and PENDING task runs, to Crashed. Flow runs of
other hosts, and untagged ones, are left alone: whether their process lives cannot be told from here.
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Iterator
from uuid import UUID

PROCESS_TAG_PREFIX = "trace.process="


def process_tag() -> str:
    """The Prefect tag naming this process: ``trace.process=<host>:<pid>:<start>``."""
    from trace.tracking import process_identity

    return PROCESS_TAG_PREFIX + process_identity()


def _tagged_process(tags) -> str | None:
    for tag in tags or ():
        if tag.startswith(PROCESS_TAG_PREFIX):
            return tag[len(PROCESS_TAG_PREFIX):]
    return None


def close_stale_flow_runs(client=None) -> list[UUID]:
    """Set to Crashed the RUNNING and PENDING flow runs whose ``trace.process`` tag names a process that is
    gone, and their unfinished task runs.

    Args:
        client: a ``prefect.client.orchestration.SyncPrefectClient``; None opens one on the configured API
            (``PREFECT_API_URL``, or Prefect's temporary local server).

    Returns:
        Ids of the flow runs set to Crashed.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, FlowRunFilterState,
                                                FlowRunFilterStateType, FlowRunFilterTags, TaskRunFilter,
                                                TaskRunFilterState, TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    from trace.tracking import process_is_gone

    unfinished = [StateType.RUNNING, StateType.PENDING]
    with contextlib.ExitStack() as stack:
        if client is None:
            client = stack.enter_context(get_client(sync_client=True))
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=unfinished)),
            tags=FlowRunFilterTags(is_null_=False)), limit=200)
        closed = []
        for flow_run in flow_runs:
            identity = _tagged_process(flow_run.tags)
            if identity is None or not process_is_gone(identity):
                continue
            message = (f"process {identity} was gone when a stage started on {socket.gethostname()} at "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
            task_runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
                task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished))))
            for task_run in task_runs:
                client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
            client.set_flow_run_state(flow_run.id, Crashed(message=message), force=True)
            closed.append(flow_run.id)
        return closed


@contextlib.contextmanager
def owned_flow_runs() -> Iterator[None]:
    """Close the flow runs of dead processes (``close_stale_flow_runs``), then tag every flow run created
    inside with this process (``process_tag``)."""
    from prefect import tags

    close_stale_flow_runs()
    with tags(process_tag()):
        yield
