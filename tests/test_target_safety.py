"""No command destroys or writes into what the user trained: a target that is, contains or lies inside the
checkpoint, its config or its run is refused whatever the flags, and so is one holding training files."""

import hashlib
import shutil

import pytest

from mergeflow.cli import EXIT_BAD_INPUT
from mergeflow.demo.fsdp import Fixture
from mergeflow.errors import OutputError
from mergeflow.flows.merge import merge_checkpoint
from tests.cli_runs import run_cli

CHECKPOINT = "qwen2-ws2"
TARGETS = {
    "the checkpoint itself": lambda f: f.checkpoint_dir,
    "its step directory": lambda f: f.checkpoint_dir.parent,
    "its run directory": lambda f: f.run_dir,
    "the directory holding the run": lambda f: f.run_dir.parent,
    "a folder inside the checkpoint": lambda f: f.checkpoint_dir / "merged",
    "a folder inside the run": lambda f: f.run_dir / "merged",
    "its config directory": lambda f: f.checkpoint_dir / "huggingface",
}


def tree_digest(folder) -> dict[str, str]:
    """Every file under `folder` by relative path, with its SHA-256."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def run_copy(copy_checkpoint) -> Fixture:
    return copy_checkpoint(CHECKPOINT)


@pytest.mark.parametrize("target", list(TARGETS))
def test_overlapping_target_is_refused_and_leaves_every_source_file_as_it_was(run_copy, target):
    before = tree_digest(run_copy.run_dir.parent)

    run = run_cli(
        "merge", "--local_dir", run_copy.checkpoint_dir, "--target_dir", TARGETS[target](run_copy), "--overwrite"
    )

    assert run.returncode == EXIT_BAD_INPUT
    assert "writing there could destroy what was trained" in run.error_lines[0]
    assert tree_digest(run_copy.run_dir.parent) == before


def test_a_config_directory_given_elsewhere_is_protected_too(run_copy, tmp_path):
    config_dir = tmp_path / "hf-config"
    shutil.copytree(run_copy.checkpoint_dir / "huggingface", config_dir)
    before = tree_digest(config_dir)

    run = run_cli(
        "merge", "--local_dir", run_copy.checkpoint_dir, "--hf_model_config_path", config_dir,
        "--target_dir", config_dir, "--overwrite",
    )  # fmt: skip

    assert run.returncode == EXIT_BAD_INPUT
    assert f"is its config directory ({config_dir})" in run.error_lines[0]
    assert tree_digest(config_dir) == before


def test_a_target_holding_another_runs_checkpoint_files_is_refused_even_with_overwrite(run_copy, fixtures, tmp_path):
    other_run = tmp_path / "other-run"
    shutil.copytree(fixtures["qwen2-ws1"].run_dir, other_run)
    before = tree_digest(other_run)

    run = run_cli("merge", "--local_dir", run_copy.checkpoint_dir, "--target_dir", other_run, "--overwrite")

    assert run.returncode == EXIT_BAD_INPUT
    assert "holds training checkpoint files" in run.error_lines[0]
    assert tree_digest(other_run) == before


@pytest.mark.usefixtures("prefect_server")
def test_the_flow_refuses_an_overlapping_target_without_the_cli(run_copy):
    before = tree_digest(run_copy.run_dir)

    state = merge_checkpoint(
        local_dir=str(run_copy.checkpoint_dir),
        target_dir=str(run_copy.checkpoint_dir.parent),
        overwrite=True,
        progress=False,
        return_state=True,
    )

    assert state.is_failed()
    with pytest.raises(OutputError, match="contains the checkpoint"):
        state.result()
    assert tree_digest(run_copy.run_dir) == before


def test_the_engine_refuses_an_overlapping_target(run_copy):
    from tests.merging import merge_with_engine

    with pytest.raises(OutputError, match="lies inside the checkpoint"):
        merge_with_engine(run_copy.checkpoint_dir, run_copy.checkpoint_dir / "out", overwrite=True)
    assert not (run_copy.checkpoint_dir / "out").exists()


@pytest.mark.usefixtures("prefect_server")
def test_overwrite_still_replaces_an_ordinary_folder(fixtures, tmp_path):
    target = tmp_path / "ordinary"
    target.mkdir()
    (target / "notes.txt").write_text("old")

    saved = merge_checkpoint(
        local_dir=str(fixtures[CHECKPOINT].checkpoint_dir), target_dir=str(target), overwrite=True, progress=False
    )

    assert not (target / "notes.txt").exists()
    assert "model.safetensors" in saved.weight_files
