"""A spec guessed from the checkpoint while the real one is built (what the write-ahead child plans with): a plain
model's weight files are planned as the real spec plans them, and what a wrong guess wrote never reaches the
merged model."""

import pytest
import torch

from mergeflow.job import MergeJob
from mergeflow.options import MergeOptions
from mergeflow.output.save import shard_plan_digest
from mergeflow.spec import cache as spec_cache
from tests.merging import load_weights, merge_with_engine

SMALL_SHARDS = "64KB"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(spec_cache.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))


def file_digests(job: MergeJob) -> dict[str, str]:
    plan, _ = job.merge_plan()
    return {filename: shard_plan_digest(plan, filename) for filename in plan.shard_to_names}


def guessing_job(checkpoint_dir, target_dir, options: MergeOptions) -> MergeJob:
    job = MergeJob(checkpoint_dir, target_dir, options)
    assert job.guess_spec()
    return job


@pytest.mark.parametrize("name", ["qwen2-ws2", "llama-untied-ws3", "qwen2-fsdp1-ws3", "qwen2-hsdp-2x2"])
def test_a_guess_plans_a_plain_models_weight_files_as_its_real_spec_does(fixtures, name, empty_cache, tmp_path):
    checkpoint_dir, options = fixtures[name].checkpoint_dir, MergeOptions(max_shard_size=SMALL_SHARDS)

    guessed = file_digests(guessing_job(checkpoint_dir, tmp_path / "merged", options))

    assert guessed == file_digests(MergeJob(checkpoint_dir, tmp_path / "merged", options))


def test_no_guess_once_the_spec_is_stored(fixtures, empty_cache, tmp_path):
    checkpoint_dir = fixtures["qwen2-ws2"].checkpoint_dir
    MergeJob(checkpoint_dir, tmp_path / "first").spec()

    assert not MergeJob(checkpoint_dir, tmp_path / "merged").guess_spec()


def test_weight_files_a_wrong_guess_wrote_are_rewritten_or_removed_before_publishing(fixtures, empty_cache, tmp_path):
    """Qwen3-MoE holds its experts fused in memory and one tensor per expert on disk: the guess keeps the fused
    names, so it plans other files than the real spec."""
    checkpoint_dir, options = fixtures["qwen3moe-ws2"].checkpoint_dir, MergeOptions(max_shard_size=SMALL_SHARDS)
    guessing = guessing_job(checkpoint_dir, tmp_path / "merged", options)
    for filename in guessing.plan().weight_files:  # as the write-ahead child writes them
        guessing.write_shard(filename)
    real = MergeJob(checkpoint_dir, tmp_path / "merged", options)
    assert file_digests(real) != file_digests(guessing)

    real.run()

    clean = merge_with_engine(checkpoint_dir, tmp_path / "clean", max_shard_size=SMALL_SHARDS)
    assert sorted(path.name for path in (tmp_path / "merged").iterdir()) == sorted(
        path.name for path in (tmp_path / "clean").iterdir()
    )
    merged, expected = load_weights(tmp_path / "merged"), load_weights(clean.folder)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected)


def test_the_write_ahead_child_replans_once_the_real_spec_is_stored(fixtures, empty_cache, tmp_path):
    checkpoint_dir, options = fixtures["qwen3moe-ws2"].checkpoint_dir, MergeOptions(max_shard_size=SMALL_SHARDS)
    guessing = guessing_job(checkpoint_dir, tmp_path / "merged", options)
    guessed = file_digests(guessing)
    MergeJob(checkpoint_dir, tmp_path / "another").spec()  # the spec build stores it

    assert guessing.replan_with_stored_spec()
    assert file_digests(guessing) == file_digests(MergeJob(checkpoint_dir, tmp_path / "merged", options)) != guessed


def test_a_weight_file_the_plan_does_not_name_is_not_published(fixtures, tmp_path):
    """What a guess that split the weights otherwise leaves in the staging folder."""
    job = MergeJob(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "merged")
    job.plan()
    (job.staging_dir / "model-00002-of-00002.safetensors").write_bytes(b"written with a guessed spec")

    job.run()

    assert sorted(path.name for path in (tmp_path / "merged").glob("*.safetensors")) == ["model.safetensors"]
