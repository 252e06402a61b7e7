"""Shards written while the spec builds: the output is what waiting for the spec writes, or an error."""

import json
import shutil
import time
from pathlib import Path

import pytest

from mergeflow.early_write import EarlyWrite, early_write, guessed_plan, save_model_early
from mergeflow.errors import OptionError, PlanError
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.formats.fsdp.index import index_shards
from mergeflow.formats.fsdp.layout import default_config_dir, find_rank_files
from mergeflow.output.save import write_shard, write_weights
from mergeflow.planning import plan_merge
from mergeflow.spec import cache as spec_cache
from mergeflow.spec.build import SpecBuild
from mergeflow.spec.model_spec import load_model_spec
from tests.merging import merge_with_engine

SMALL_SHARDS = "8KB"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(spec_cache.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def index_of(checkpoint_dir: Path):
    return index_shards(find_rank_files(checkpoint_dir))


def merge_early(checkpoint_dir: Path, target_dir: Path, **options):
    build = SpecBuild(default_config_dir(checkpoint_dir))
    return save_model_early(index_of(checkpoint_dir), build, target_dir, progress=False, **options)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def wait_until(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def early_write_of(checkpoint_dir: Path, staging: Path, **options) -> tuple[EarlyWrite, object]:
    """An early write of the checkpoint's guess into `staging`, and the plan the spec gives."""
    index = index_of(checkpoint_dir)
    config_dir = default_config_dir(checkpoint_dir)
    plan = plan_merge(index, load_model_spec(config_dir), **options)
    return EarlyWrite(index, guessed_plan(index, config_dir, "bf16", options["max_shard_size"]), staging), plan


@pytest.mark.parametrize("name", ["qwen2-ws2", "llama-untied-ws3", "qwen3moe-ws2", "qwen25vl-ws2"])
def test_early_save_writes_the_files_save_model_writes(name, fixtures, empty_cache, tmp_path):
    checkpoint_dir = fixtures[name].checkpoint_dir

    merge_early(checkpoint_dir, tmp_path / "early", dtype="bf16", max_shard_size=SMALL_SHARDS)
    merge_with_engine(checkpoint_dir, tmp_path / "waited", dtype="bf16", max_shard_size=SMALL_SHARDS)

    assert folder_bytes(tmp_path / "early") == folder_bytes(tmp_path / "waited")


def test_a_guess_the_spec_agrees_with_is_kept_whole(fixtures, tmp_path):
    early, plan = early_write_of(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "staging", max_shard_size=SMALL_SHARDS)
    wait_until(lambda: len(early.finished) == len(early.guess.shard_to_names))

    kept = early.settle(plan)

    assert len(kept) > 1
    assert kept == tuple(plan.shard_to_names)


def test_early_save_writes_only_what_the_plan_holds_as_guessed(fixtures, empty_cache, tmp_path):
    saved, kept = merge_early(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "out", max_shard_size=SMALL_SHARDS)

    assert set(kept) <= set(saved.weight_files)


def test_a_guess_the_spec_contradicts_keeps_nothing(fixtures, empty_cache, tmp_path):
    """A vision-language checkpoint holds its tensors under other names than the model saves."""
    _, kept = merge_early(fixtures["qwen25vl-ws2"].checkpoint_dir, tmp_path / "out")

    assert kept == ()


def test_a_spec_already_built_writes_nothing_early(fixtures, empty_cache, tmp_path):
    checkpoint_dir = fixtures["qwen2-ws2"].checkpoint_dir
    load_model_spec(default_config_dir(checkpoint_dir))

    _, kept = merge_early(checkpoint_dir, tmp_path / "out")

    assert kept == ()


def test_settling_on_a_contradicting_plan_leaves_no_guessed_file(fixtures, tmp_path):
    early, plan = early_write_of(fixtures["qwen25vl-ws2"].checkpoint_dir, tmp_path / "staging", max_shard_size=SMALL_SHARDS)

    assert early.settle(plan) == ()
    assert list((tmp_path / "staging").iterdir()) == []


def test_shards_kept_by_settling_are_not_written_again(fixtures, tmp_path):
    checkpoint_dir = fixtures["llama-untied-ws3"].checkpoint_dir
    early, plan = early_write_of(checkpoint_dir, tmp_path / "staging", max_shard_size=SMALL_SHARDS)

    wait_until(lambda: early.finished)

    kept = early.settle(plan)
    written = write_weights(plan, index_of(checkpoint_dir), tmp_path / "staging", progress=False)

    assert kept
    assert [shard.name for shard in written if shard.resumed] == list(kept)


def test_a_finished_shard_of_another_plan_is_written_again_even_at_the_same_size(fixtures, tmp_path):
    checkpoint_dir = fixtures["qwen2-ws2"].checkpoint_dir
    index, spec = index_of(checkpoint_dir), load_model_spec(default_config_dir(checkpoint_dir))
    as_bf16, as_fp16 = (plan_merge(index, spec, dtype=dtype) for dtype in ("bf16", "fp16"))
    write_shard(as_bf16, index, tmp_path, "model.safetensors")

    rewritten = write_shard(as_fp16, index, tmp_path, "model.safetensors")

    assert not rewritten.resumed


def test_a_config_the_shards_contradict_raises_and_writes_no_target(fixtures, empty_cache, tmp_path):
    checkpoint_dir = shutil.copytree(fixtures["qwen2-ws2"].checkpoint_dir, tmp_path / "checkpoint")
    config_path = default_config_dir(checkpoint_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 1}))

    with pytest.raises(PlanError, match="shape mismatch"):
        merge_early(checkpoint_dir, tmp_path / "out")

    assert sorted(path.name for path in tmp_path.iterdir()) == ["cache", "checkpoint"]


def test_a_lora_checkpoint_is_refused_before_anything_is_written(fixtures, empty_cache, tmp_path):
    with pytest.raises(OptionError, match="LoRA"):
        merge_early(fixtures["lora-ws2"].checkpoint_dir, tmp_path / "out")

    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("prefect_server")
def test_the_flow_keeps_the_shards_it_wrote_while_a_new_config_was_read(fixtures, empty_cache, tmp_path, monkeypatch):
    checkpoint_dir = fixtures["llama-untied-ws3"].checkpoint_dir
    settled = []
    settle = EarlyWrite.settle
    monkeypatch.setattr(EarlyWrite, "settle", lambda early, plan: settled.append(settle(early, plan)) or settled[-1])

    merge_checkpoint(
        local_dir=str(checkpoint_dir), target_dir=str(tmp_path / "flow"), max_shard_size=SMALL_SHARDS, progress=False
    )
    merge_with_engine(checkpoint_dir, tmp_path / "engine", max_shard_size=SMALL_SHARDS)

    assert settled[0]
    flow_files = folder_bytes(tmp_path / "flow")
    del flow_files["README.md"]
    assert flow_files == folder_bytes(tmp_path / "engine")


def test_custom_code_that_may_not_run_writes_nothing_early(fixtures, empty_cache, tmp_path):
    checkpoint_dir = fixtures["remote-code-ws2"].checkpoint_dir

    with early_write(index_of(checkpoint_dir), SpecBuild(default_config_dir(checkpoint_dir)), tmp_path / "staging") as early:
        early.settle(None)

    assert early.guess is None
    assert not (tmp_path / "staging").exists()
