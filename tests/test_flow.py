"""The merge runs as a Prefect flow whose task runs are visible through the API."""

import time

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.merge import merge_checkpoint

pytestmark = pytest.mark.usefixtures("prefect_server")

PIPELINE_STEPS = [
    "detect-world-size",
    "load-config",
    "load-shards",
    "extract-lora",
    "merge",
    "save",
    "validate",
    "publish-report",
    "write-model-card",
]


API_WAIT_SECONDS = 30


def task_runs_of(flow_run_id, *, count: int):
    """The flow run's task runs, once the API has all `count` of them in a final state.

    Task runs reach the server as events, processed asynchronously: poll, within a bound.
    """
    deadline = time.monotonic() + API_WAIT_SECONDS
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
        if (len(runs) >= count and all(run.state and run.state.is_final() for run in runs)) or (
            time.monotonic() > deadline
        ):
            return sorted(runs, key=lambda run: run.expected_start_time)
        time.sleep(0.5)


def test_each_pipeline_step_is_a_completed_task_run(fixtures, target_dir):
    state = merge_checkpoint(
        local_dir=str(fixtures["qwen2-ws2"].checkpoint_dir),
        target_dir=str(target_dir),
        progress=False,
        return_state=True,
    )

    runs = task_runs_of(state.state_details.flow_run_id, count=len(PIPELINE_STEPS))

    assert state.is_completed()
    assert [run.name.rsplit("-", 1)[0] for run in runs] == PIPELINE_STEPS
    assert all(run.state.is_completed() for run in runs)


def test_flow_returns_a_manifest_of_the_written_files(fixtures, target_dir):
    saved = merge_checkpoint(
        local_dir=str(fixtures["qwen2-ws2"].checkpoint_dir), target_dir=str(target_dir), progress=False
    )

    assert {file.name for file in saved.files} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert saved.target_dir == str(target_dir.absolute())


def test_failing_step_fails_the_flow_run_at_that_task(copy_checkpoint, target_dir):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "model_world_size_2_rank_1.pt").unlink()

    state = merge_checkpoint(local_dir=str(checkpoint), target_dir=str(target_dir), return_state=True)

    runs = task_runs_of(state.state_details.flow_run_id, count=2)
    assert state.is_failed()
    assert [run.name.rsplit("-", 1)[0] for run in runs if run.state.is_failed()] == ["detect-world-size"]
