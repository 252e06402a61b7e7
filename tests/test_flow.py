"""The merge runs as a Prefect flow whose steps are task runs of the flow, joined by the data they pass, so the
UI draws the pipeline; a re-run of an unchanged merge shows every step Cached."""

import pytest

from mergeflow.flows.merge import merge_checkpoint
from tests.prefect_runs import task_runs_of

pytestmark = pytest.mark.usefixtures("prefect_server")

PIPELINE_STEPS = [
    "fingerprint",
    "detect-world-size",
    "load-config",
    "load-shards",
    "extract-lora",
    "plan-merge",
    "write model.safetensors",
    "save",
    "validate",
    "write-model-card",
    "publish",
]
UPSTREAM = {
    "detect-world-size": "fingerprint",
    "load-config": "detect-world-size",
    "load-shards": "load-config",
    "extract-lora": "load-shards",
    "plan-merge": "extract-lora",
    "write model.safetensors": "plan-merge",
    "save": "write model.safetensors",
    "validate": "save",
    "write-model-card": "validate",
    "publish": "write-model-card",
}
"""Each step after the first, and one step whose result it takes as input."""


def step_name(run) -> str:
    """A task run's step: its name less the suffix Prefect adds (`load-config-3af` -> `load-config`)."""
    return run.name if run.name.startswith("write ") else run.name.rsplit("-", 1)[0]


def merge(fixtures, target_dir, **options):
    return merge_checkpoint(
        local_dir=str(fixtures["qwen2-ws2"].checkpoint_dir), target_dir=str(target_dir), progress=False,
        return_state=True, **options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def first_and_cached_runs(fixtures, tmp_path_factory):
    """A merge, and the same merge again: the task runs of each, by step."""
    target_dir = tmp_path_factory.mktemp("flow") / "merged"
    first, second = merge(fixtures, target_dir), merge(fixtures, target_dir)
    assert first.is_completed() and second.is_completed()
    return [
        {step_name(run): run for run in task_runs_of(state.state_details.flow_run_id, count=len(PIPELINE_STEPS))}
        for state in (first, second)
    ]


def test_each_pipeline_step_is_a_completed_task_run_of_the_flow(first_and_cached_runs):
    runs, _ = first_and_cached_runs

    assert sorted(runs) == sorted(PIPELINE_STEPS)
    assert {name: run.state.name for name, run in runs.items()} == dict.fromkeys(PIPELINE_STEPS, "Completed")


def test_no_step_runs_inside_another_step(first_and_cached_runs):
    runs, _ = first_and_cached_runs

    assert {name for name, run in runs.items() if run.task_inputs.get("__parents__")} == set()


@pytest.mark.parametrize("step", list(UPSTREAM))
def test_a_step_takes_its_upstream_steps_result_as_input(first_and_cached_runs, step):
    runs, _ = first_and_cached_runs

    inputs = {entry.id for value in runs[step].task_inputs.values() for entry in value if entry.input_type == "task_run"}

    assert runs[UPSTREAM[step]].id in inputs


def test_a_re_run_of_the_same_merge_shows_every_step_cached(first_and_cached_runs):
    _, cached = first_and_cached_runs

    assert {name: run.state.name for name, run in cached.items()} == {
        "fingerprint": "Completed",
        **dict.fromkeys(PIPELINE_STEPS[1:], "Cached"),
    }


def test_flow_returns_a_manifest_of_the_written_files(fixtures, target_dir):
    saved = merge(fixtures, target_dir).result()

    assert {file.name for file in saved.files} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert saved.folder == str(target_dir.absolute())


def test_failing_step_fails_the_flow_run_at_that_task(copy_checkpoint, target_dir):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    (checkpoint / "model_world_size_2_rank_1.pt").unlink()

    state = merge_checkpoint(local_dir=str(checkpoint), target_dir=str(target_dir), return_state=True)

    runs = task_runs_of(state.state_details.flow_run_id, count=2)
    assert state.is_failed()
    assert [step_name(run) for run in runs if run.state.is_failed()] == ["detect-world-size"]


def test_a_merge_run_is_named_by_its_checkpoint_and_its_target(fixtures, tmp_path):
    from prefect.client.orchestration import get_client

    target = tmp_path / "models" / "qwen2" / "step-1"
    state = merge_checkpoint(
        local_dir=str(fixtures["qwen2-ws2"].checkpoint_dir), target_dir=str(target), progress=False, return_state=True
    )

    with get_client(sync_client=True) as client:
        name = client.read_flow_run(state.state_details.flow_run_id).name
    assert name == f"merge run/step-1/actor into {tmp_path.name}/models/qwen2/step-1"
