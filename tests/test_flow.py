"""The merge runs as a Prefect flow whose task runs are visible through the API."""

import pytest

from mergeflow.flows.merge import merge_checkpoint
from tests.prefect_runs import task_runs_of

pytestmark = pytest.mark.usefixtures("prefect_server")

PIPELINE_STEPS = [
    "fingerprint",
    "merge-model",
    "detect-world-size",
    "load-config",
    "load-shards",
    "extract-lora",
    "merge",
    "save",
    "write model.safetensors",
    "validate",
    "publish-report",
    "write-model-card",
    "publish",
]


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

    runs = task_runs_of(state.state_details.flow_run_id, count=3)
    assert state.is_failed()
    assert [run.name.rsplit("-", 1)[0] for run in runs if run.state.is_failed()] == ["merge-model", "detect-world-size"]
