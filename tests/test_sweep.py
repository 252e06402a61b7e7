"""The sweep merges exactly the complete checkpoints of a run directory that are not merged yet."""

import pytest

from mergeflow.errors import MergeflowError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.flows.sweep import sweep_checkpoints
from tests.run_dirs import save_step

pytestmark = pytest.mark.usefixtures("prefect_server")


@pytest.fixture
def run_dir(fixtures, tmp_path):
    """Steps 1-3 saved (actor; a critic at step 2), step 4 being written (not yet in the tracker)."""
    run_dir = tmp_path / "run-a"
    save_step(fixtures["qwen2-ws2"], run_dir, 1)
    save_step(fixtures["value-ws2"], run_dir, 2, update_tracker=False)
    save_step(fixtures["qwen2-ws2"], run_dir, 2)
    save_step(fixtures["qwen2-ws2"], run_dir, 3)
    save_step(fixtures["qwen2-ws2"], run_dir, 4, update_tracker=False)
    return run_dir


def test_sweep_merges_exactly_the_unmerged_checkpoints(run_dir, tmp_path):
    output_dir = tmp_path / "out"
    step_1 = output_dir / "run-a" / "global_step_1" / "actor"
    merge_checkpoint(local_dir=str(run_dir / "global_step_1" / "actor"), target_dir=str(step_1), progress=False)
    untouched = {path.name: path.stat().st_mtime_ns for path in step_1.iterdir()}

    merged = sweep_checkpoints(run_dirs=[str(run_dir)], output_dir=str(output_dir))

    assert merged == [
        str(output_dir / "run-a" / "global_step_2" / "actor"),
        str(output_dir / "run-a" / "global_step_2" / "critic"),
        str(output_dir / "run-a" / "global_step_3" / "actor"),
    ]
    assert {path.name: path.stat().st_mtime_ns for path in step_1.iterdir()} == untouched
    assert not (output_dir / "run-a" / "global_step_4").exists()


def test_second_sweep_merges_nothing(run_dir, tmp_path):
    output_dir = tmp_path / "out"
    sweep_checkpoints(run_dirs=[str(run_dir)], output_dir=str(output_dir))

    assert sweep_checkpoints(run_dirs=[str(run_dir)], output_dir=str(output_dir)) == []


def test_a_failed_merge_fails_the_sweep_after_the_others(run_dir, tmp_path):
    (run_dir / "global_step_2" / "actor" / "model_world_size_2_rank_1.pt").unlink()
    output_dir = tmp_path / "out"

    state = sweep_checkpoints(run_dirs=[str(run_dir)], output_dir=str(output_dir), return_state=True)

    assert state.is_failed()
    with pytest.raises(MergeflowError, match="1 of 4 merges failed: run-a/step-2/actor"):
        state.result()
    assert (output_dir / "run-a" / "global_step_3" / "actor" / "model.safetensors").is_file()
