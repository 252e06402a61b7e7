"""A merge is cached by its checkpoint's fingerprint, options, target and engine version: every step is cached
under that key, and reused only while the output the merge published is still in place, unchanged."""

import dataclasses
import os
import subprocess
import sys
from datetime import UTC, datetime

import pytest
import torch

from mergeflow.errors import OutputError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.options import MergeOptions
from tests.merging import load_weights
from tests.prefect_runs import task_runs_named, task_runs_of

pytestmark = pytest.mark.usefixtures("prefect_server")


def merge(checkpoint_dir, target_dir, **options):
    return merge_checkpoint(
        local_dir=str(checkpoint_dir), target_dir=str(target_dir), progress=False, return_state=True, **options
    )


STEPS = 11
"""Task runs of a merge of a one-file model: fingerprint, ten steps (one weight file)."""


def publish_run(flow_state):
    runs = task_runs_of(flow_state.state_details.flow_run_id, count=STEPS)
    return next(run for run in runs if run.name.startswith("publish"))


def file_times(folder):
    return {path.name: path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


def test_second_run_on_an_unchanged_checkpoint_is_a_cache_hit(fixtures, target_dir):
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    merge(checkpoint, target_dir)

    second = merge(checkpoint, target_dir)

    assert second.is_completed()
    assert publish_run(second).state.name == "Cached"


def test_cache_hit_runs_no_step_beyond_the_fingerprint(fixtures, target_dir):
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    merge(checkpoint, target_dir)
    written = file_times(target_dir)

    second = merge(checkpoint, target_dir)

    runs = task_runs_of(second.state_details.flow_run_id, count=STEPS)
    assert [run.state.name for run in runs if not run.name.startswith("fingerprint")] == ["Cached"] * (STEPS - 1)
    assert file_times(target_dir) == written


def test_cache_hit_returns_the_recorded_manifest(fixtures, target_dir):
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    first = merge(checkpoint, target_dir).result()

    second = merge(checkpoint, target_dir).result()

    assert (first.up_to_date, second.up_to_date) == (False, True)
    assert dataclasses.replace(second, up_to_date=False) == first
    assert {file.name for file in second.files} == {path.name for path in target_dir.iterdir()}


def test_deleted_output_is_merged_again(fixtures, target_dir):
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    merge(checkpoint, target_dir)
    expected = load_weights(target_dir)
    (target_dir / "model.safetensors").unlink()

    again = merge(checkpoint, target_dir)

    assert publish_run(again).state.name == "Completed"
    assert load_weights(target_dir).keys() == expected.keys()
    assert all(load_weights(target_dir)[name].equal(tensor) for name, tensor in expected.items())


def test_changed_output_is_merged_again(fixtures, target_dir):
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    merge(checkpoint, target_dir)
    original = (target_dir / "config.json").read_text()
    (target_dir / "config.json").write_text("{}")

    again = merge(checkpoint, target_dir)

    assert publish_run(again).state.name == "Completed"
    assert (target_dir / "config.json").read_text() == original


def test_touched_shard_invalidates_the_cache(copy_checkpoint, target_dir):
    checkpoint = copy_checkpoint("qwen2-ws2").checkpoint_dir
    merge(checkpoint, target_dir)
    shard = checkpoint / "model_world_size_2_rank_1.pt"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))

    again = merge(checkpoint, target_dir, overwrite=True)

    assert publish_run(again).state.name == "Completed"


def test_an_option_that_changes_the_output_is_a_new_merge(fixtures, target_dir):
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    merge(checkpoint, target_dir)

    again = merge(checkpoint, target_dir, options=MergeOptions(dtype="fp32"), overwrite=True)

    assert publish_run(again).state.name == "Completed"
    assert {tensor.dtype for tensor in load_weights(target_dir).values()} == {torch.float32}


def test_refresh_cache_merges_again(fixtures, target_dir):
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    merge(checkpoint, target_dir)

    again = merge(checkpoint, target_dir, refresh_cache=True)

    assert publish_run(again).state.name == "Completed"


def test_a_target_this_merge_did_not_write_is_still_refused(fixtures, target_dir):
    target_dir.mkdir()
    (target_dir / "notes.txt").write_text("mine")

    state = merge(fixtures["qwen2-ws2"].checkpoint_dir, target_dir)

    assert state.is_failed()
    with pytest.raises(OutputError, match="not empty"):
        state.result()
    assert [path.name for path in target_dir.iterdir()] == ["notes.txt"]


def test_concurrent_runs_on_the_same_checkpoint_merge_once(fixtures, tmp_path):
    target_dir = tmp_path / "concurrent"
    command = [
        sys.executable, "-m", "mergeflow", "merge", "--no-progress",
        "--local_dir", str(fixtures["qwen2-ws2"].checkpoint_dir), "--target_dir", str(target_dir),
    ]  # fmt: skip
    started = datetime.now(UTC)
    runs = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [run.communicate(timeout=300)[1] for run in runs]

    assert [run.returncode for run in runs] == [0, 0], errors
    publishes = task_runs_named("publish", count=2, since=started)
    assert sorted(run.state.name for run in publishes) == ["Cached", "Completed"]
