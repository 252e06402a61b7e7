"""verl's v2 Megatron layout: `ckpt_contents.json` says where the weights are, and marks the save complete.

The manifests are written with the fields verl 0.9.1's `MegatronCheckpointManager` writes (its trainer
needs GPUs and Ray, so it cannot save one here); the archives in them are real megatron-core saves.
"""

import json
import shutil
from pathlib import Path

import pytest

from mergeflow.errors import CheckpointError
from mergeflow.formats.megatron.contents import CONTENTS_FILE
from mergeflow.formats.megatron.layout import find_megatron_checkpoint
from mergeflow.run_layout import complete_checkpoints, is_training_file
from mergeflow.validation.validate import validate_model_dir
from tests.merging import merge_with_engine

FIXTURE = "megatron-qwen2-tp1"


@pytest.fixture
def v2_checkpoint(megatron_fixtures, tmp_path) -> Path:
    """A private copy of a v2 fixture's run directory; returns its `global_step_N/actor`."""
    fixture = megatron_fixtures[FIXTURE]
    run_dir = tmp_path / "run"
    shutil.copytree(fixture.checkpoint_dir.parent.parent, run_dir)
    return run_dir / fixture.checkpoint_dir.relative_to(fixture.checkpoint_dir.parent.parent)


def edit_manifest(checkpoint_dir: Path, edit) -> None:
    path = checkpoint_dir / CONTENTS_FILE
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_the_fixture_is_a_v2_checkpoint_with_its_manifest(megatron_fixtures):
    checkpoint_dir = megatron_fixtures[FIXTURE].checkpoint_dir

    manifest = json.loads((checkpoint_dir / CONTENTS_FILE).read_text())

    assert manifest["schema_version"] == 2
    assert (checkpoint_dir / manifest["contents"]["model"]["path"] / ".metadata").is_file()


def test_the_weights_are_read_where_the_manifest_says(megatron_fixtures, v2_checkpoint, tmp_path):
    (v2_checkpoint / "model" / "dist_ckpt").rename(v2_checkpoint / "model" / "shards")
    edit_manifest(v2_checkpoint, lambda manifest: manifest["contents"]["model"].update(path="model/shards"))

    merge_with_engine(v2_checkpoint, tmp_path / "merged", backend="megatron", dtype="keep")

    report = validate_model_dir(tmp_path / "merged", reference_dir=megatron_fixtures[FIXTURE].reference_dir)
    assert report.passed, report.failure_message()


def test_the_config_is_read_where_the_manifest_says(v2_checkpoint):
    (v2_checkpoint / "model" / "huggingface").rename(v2_checkpoint / "hf_config")
    edit_manifest(
        v2_checkpoint, lambda manifest: manifest["contents"].update(hf_config={"path": "hf_config", "format": "huggingface"})
    )

    assert find_megatron_checkpoint(v2_checkpoint).config_dir == str(v2_checkpoint / "hf_config")


def test_a_manifest_naming_huggingface_weights_is_copied_not_merged(megatron_fixtures, v2_checkpoint):
    hf_dir = v2_checkpoint / "model" / "huggingface"
    shutil.copy(megatron_fixtures[FIXTURE].reference_dir / "model.safetensors", hf_dir)
    edit_manifest(
        v2_checkpoint,
        lambda manifest: manifest["contents"].update(model={"path": "model/huggingface", "format": "huggingface"}),
    )

    assert find_megatron_checkpoint(v2_checkpoint).model_dir == str(hf_dir)


@pytest.mark.parametrize("path", ["/etc", "../../other_run/model/dist_ckpt"])
def test_a_manifest_path_outside_the_checkpoint_is_refused(v2_checkpoint, path):
    edit_manifest(v2_checkpoint, lambda manifest: manifest["contents"]["model"].update(path=path))

    with pytest.raises(CheckpointError, match=f"{CONTENTS_FILE}: path .* does not lie inside the checkpoint"):
        find_megatron_checkpoint(v2_checkpoint)


def test_an_unreadable_manifest_is_an_error_naming_it(v2_checkpoint):
    (v2_checkpoint / CONTENTS_FILE).write_text('{"schema_version": 2, "contents": ')

    with pytest.raises(CheckpointError, match=f"{CONTENTS_FILE}: not a verl checkpoint manifest"):
        find_megatron_checkpoint(v2_checkpoint)


def test_a_newer_schema_is_an_error_naming_the_version(v2_checkpoint):
    edit_manifest(v2_checkpoint, lambda manifest: manifest.update(schema_version=3))

    with pytest.raises(CheckpointError, match="schema_version 3; mergeflow reads version 2"):
        find_megatron_checkpoint(v2_checkpoint)


def test_a_manifest_without_model_weights_is_an_error(v2_checkpoint):
    edit_manifest(v2_checkpoint, lambda manifest: manifest.update(contents={}, save_contents=["optimizer"]))

    with pytest.raises(CheckpointError, match=r"holds no model weights \(save_contents: \['optimizer'\]\)"):
        find_megatron_checkpoint(v2_checkpoint)


def test_a_v2_checkpoint_is_complete_once_its_manifest_is_written(v2_checkpoint):
    run_dir = v2_checkpoint.parent.parent
    manifest = (v2_checkpoint / CONTENTS_FILE).read_bytes()
    (v2_checkpoint / CONTENTS_FILE).unlink()
    assert complete_checkpoints(run_dir) == []

    (v2_checkpoint / CONTENTS_FILE).write_bytes(manifest)

    assert [checkpoint.local_dir for checkpoint in complete_checkpoints(run_dir)] == [str(v2_checkpoint.absolute())]


def test_the_2025_layout_needs_no_manifest(megatron_fixtures):
    fixture = megatron_fixtures["megatron-qwen3-pp2-2025-layout"]

    assert len(complete_checkpoints(fixture.checkpoint_dir.parent.parent)) == 1


def test_the_manifest_counts_as_a_training_file():
    assert is_training_file(CONTENTS_FILE, is_dir=False)
