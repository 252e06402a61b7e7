"""Reading flow and task runs back from the Prefect API, which receives task runs as events: poll, within a bound."""

import time
from collections.abc import Callable
from datetime import datetime

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterName,
)
from prefect.client.schemas.objects import TaskRun

API_WAIT_SECONDS = 30


def _poll(read: Callable[[], list[TaskRun]], done: Callable[[list[TaskRun]], bool]) -> list[TaskRun]:
    deadline = time.monotonic() + API_WAIT_SECONDS
    while True:
        runs = read()
        if done(runs) or time.monotonic() > deadline:
            return sorted(runs, key=lambda run: run.expected_start_time)
        time.sleep(0.5)


def _all_final(runs: list[TaskRun], count: int) -> bool:
    return len(runs) >= count and all(run.state and run.state.is_final() for run in runs)


def task_runs_of(flow_run_id, *, count: int, named: str = "") -> list[TaskRun]:
    """The flow run's task runs (those whose name contains `named`), once the API has all `count` of them in a final
    state."""

    def read() -> list[TaskRun]:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return [run for run in runs if named in run.name]

    return _poll(read, lambda runs: _all_final(runs, count))


def task_runs_named(fragment: str, *, count: int, since: datetime) -> list[TaskRun]:
    """Every task run since `since` whose name contains `fragment`, once `count` of them are in a final state."""

    def read() -> list[TaskRun]:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=fragment)))
        return [run for run in runs if run.expected_start_time >= since]

    return _poll(read, lambda runs: _all_final(runs, count))
