"""The target directory is written atomically: refused when not empty, replaced only on success."""

import os

import pytest

from mergeflow.cli import EXIT_BAD_INPUT, main
from mergeflow.errors import OutputError
from mergeflow.output.staging import STAGING_PREFIX, check_target
from tests.merging import merge_with_engine

pytestmark = pytest.mark.usefixtures("prefect_server")


def merge_cli(checkpoint_dir, target_dir, *extra) -> int:
    return main(
        [
            "merge",
            "--local-dir",
            str(checkpoint_dir),
            "--target-dir",
            str(target_dir),
            "--no-progress",
            *extra,
        ]
    )


def test_non_empty_target_is_refused_without_overwrite(fixtures, target_dir, capsys):
    target_dir.mkdir()
    (target_dir / "keep.txt").write_text("mine")

    code = merge_cli(fixtures["qwen2-ws1"].checkpoint_dir, target_dir)

    assert code == EXIT_BAD_INPUT
    assert "--overwrite" in capsys.readouterr().err
    assert os.listdir(target_dir) == ["keep.txt"]


def test_overwrite_replaces_the_target(fixtures, target_dir):
    target_dir.mkdir()
    (target_dir / "old.txt").write_text("old")

    assert merge_cli(fixtures["qwen2-ws1"].checkpoint_dir, target_dir, "--overwrite") == 0
    assert not (target_dir / "old.txt").exists()
    assert (target_dir / "model.safetensors").exists()


def test_empty_target_directory_is_used(fixtures, target_dir):
    target_dir.mkdir()

    assert merge_cli(fixtures["qwen2-ws1"].checkpoint_dir, target_dir) == 0
    assert (target_dir / "config.json").exists()


def test_failed_merge_leaves_the_target_as_it_was(fixtures, target_dir, monkeypatch):
    target_dir.mkdir()
    (target_dir / "old.txt").write_text("old")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("mergeflow.output.save.copy_side_files", disk_full)

    with pytest.raises(OSError, match="No space left"):
        merge_with_engine(fixtures["qwen2-ws2"].checkpoint_dir, target_dir, overwrite=True)

    assert os.listdir(target_dir) == ["old.txt"]
    assert not [p for p in target_dir.parent.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_target_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "out"
    target.write_text("file")

    with pytest.raises(OutputError, match="is a file"):
        check_target(target, overwrite=True)


def test_every_file_is_flushed_to_the_device_before_the_model_appears(fixtures, tmp_path, monkeypatch):
    flushed = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        flushed.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)

    merge_with_engine(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "out")

    assert set(os.listdir(tmp_path / "out")) <= set(flushed)
