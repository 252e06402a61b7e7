"""A merge killed part way resumes: the next run writes only the shards the killed one had not finished."""

import signal
import subprocess
import sys

import pytest

from mergeflow.flows.merge import merge_checkpoint
from mergeflow.options import MergeOptions
from mergeflow.output.staging import STAGING_PREFIX
from tests.merging import merge_with_engine

pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.slow]

SHARD_SIZE = "12KB"
SHARDS_BEFORE_KILL = 2


@pytest.fixture
def killed_merge(fixtures, tmp_path):
    """A merge of qwen2-ws2 into many small shards, SIGKILLed once two shards are written."""
    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir
    target_dir = tmp_path / "merged"
    killed = subprocess.run(
        [
            sys.executable, "-m", "tests.killed_merge", str(SHARDS_BEFORE_KILL),
            "merge", "--no-progress", "--max-shard-size", SHARD_SIZE,
            "--local_dir", str(checkpoint), "--target_dir", str(target_dir),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (staging,) = tmp_path.glob(f"{STAGING_PREFIX}merged-*")
    return checkpoint, target_dir, staging


def finished_shards(staging):
    """The shards the killed run finished, by name, with their (inode, mtime)."""
    return {
        marker.name[1 : -len(".done")]: _identity(staging / marker.name[1 : -len(".done")])
        for marker in staging.glob(".*.done")
    }


def _identity(path):
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


def resume(checkpoint, target_dir):
    return merge_checkpoint(
        local_dir=str(checkpoint), target_dir=str(target_dir), options=MergeOptions(max_shard_size=SHARD_SIZE), progress=False
    )


def test_killed_merge_leaves_the_target_untouched(killed_merge):
    _, target_dir, staging = killed_merge

    assert not target_dir.exists()
    assert len(finished_shards(staging)) >= SHARDS_BEFORE_KILL


def test_next_run_keeps_the_shards_the_killed_run_finished(killed_merge):
    checkpoint, target_dir, staging = killed_merge
    kept = finished_shards(staging)

    saved = resume(checkpoint, target_dir)

    assert len(saved.weight_files) > len(kept)
    assert {name: _identity(target_dir / name) for name in kept} == kept


def test_resumed_merge_equals_a_clean_merge(killed_merge, tmp_path):
    checkpoint, target_dir, _ = killed_merge
    clean_dir = tmp_path / "clean"
    merge_with_engine(checkpoint, clean_dir, max_shard_size=SHARD_SIZE)

    resume(checkpoint, target_dir)

    clean_files = sorted(path.name for path in clean_dir.iterdir())
    assert sorted(path.name for path in target_dir.iterdir()) == sorted([*clean_files, "README.md"])
    assert all((target_dir / name).read_bytes() == (clean_dir / name).read_bytes() for name in clean_files)


def test_resumed_merge_leaves_no_staging_directory(killed_merge):
    checkpoint, target_dir, staging = killed_merge

    resume(checkpoint, target_dir)

    assert not staging.exists()
    assert not list(target_dir.glob(".*"))
