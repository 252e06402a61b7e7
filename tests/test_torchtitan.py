"""TorchTitan checkpoints (verl's TorchTitan engine: torchtitan's DCP archive in `global_step_N/step-N/`) merge to the
model they hold, under Hugging Face names, with the config of the model the run started from."""

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint

from mergeflow.errors import CheckpointError, PlanError
from mergeflow.flows.sweep import sweep_checkpoints
from mergeflow.formats.dcp import read_metadata, read_slice
from mergeflow.formats.registry import find_checkpoint
from mergeflow.options import MergeOptions
from mergeflow.run_layout import complete_checkpoints
from tests.conftest import TORCHTITAN_FIXTURE_SPECS
from tests.merging import load_weights, logits, merge_with_engine

pytestmark = pytest.mark.slow

TORCHTITAN_FIXTURE_NAMES = [spec.name for spec in TORCHTITAN_FIXTURE_SPECS]
MOE = "torchtitan-qwen3moe-ws2"


@pytest.fixture(scope="module")
def merged(torchtitan_fixtures, tmp_path_factory):
    """Each fixture merged once in float32 (`keep`), by the engine, with the reference's config."""
    root = tmp_path_factory.mktemp("torchtitan-merged")
    return {
        name: merge_with_engine(
            fixture.checkpoint_dir, root / name, backend="torchtitan", hf_model_config_path=str(fixture.reference_dir), dtype="keep"
        ).folder
        for name, fixture in torchtitan_fixtures.items()
    }


def resaved(fixture, checkpoint_dir: Path, edit) -> Path:
    """The fixture's archive with its tensors as `edit` returns them, saved again by torch DCP's own writer."""
    archive = next(fixture.checkpoint_dir.glob("step-*"))
    state = edit({key: read_slice(archive, entry) for key, entry in read_metadata(archive).items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves from one process
        torch.distributed.checkpoint.save(state, checkpoint_id=checkpoint_dir / archive.name, no_dist=True)
    return checkpoint_dir


@pytest.mark.parametrize("name", TORCHTITAN_FIXTURE_NAMES)
def test_merged_tensors_equal_the_original_state_dict(torchtitan_fixtures, merged, name):
    reference = load_weights(torchtitan_fixtures[name].reference_dir)
    output = load_weights(merged[name])

    assert output.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(output[key], tensor), key


@pytest.mark.parametrize("name", TORCHTITAN_FIXTURE_NAMES)
def test_merged_model_gives_the_original_logits(torchtitan_fixtures, merged, name):
    expected = logits(torchtitan_fixtures[name].reference_dir, torch.float32)

    assert torch.equal(logits(merged[name], torch.float32), expected)


def test_without_the_models_config_the_error_says_to_pass_it(torchtitan_fixtures, tmp_path):
    with pytest.raises(CheckpointError, match=r"missing .*huggingface/config\.json") as refused:
        merge_with_engine(torchtitan_fixtures[MOE].checkpoint_dir, tmp_path / "out", backend="torchtitan")

    assert "--hf_model_config_path" in refused.value.hint
    assert not (tmp_path / "out").exists()


def test_the_role_folder_points_to_the_step_folder_that_holds_the_archive(torchtitan_fixtures):
    step_dir = torchtitan_fixtures[MOE].checkpoint_dir

    with pytest.raises(CheckpointError, match="not a TorchTitan checkpoint") as refused:
        find_checkpoint(step_dir / "actor", "torchtitan")

    assert refused.value.hint.endswith(f"pass {step_dir}")


def test_a_torchtitan_checkpoint_merged_as_fsdp_says_which_backend_to_pass(torchtitan_fixtures):
    with pytest.raises(CheckpointError) as refused:
        find_checkpoint(torchtitan_fixtures[MOE].checkpoint_dir, "fsdp")

    assert refused.value.hint.endswith(": pass --backend torchtitan")


def test_a_load_balancing_bias_that_is_not_zero_is_refused(torchtitan_fixtures, tmp_path):
    fixture = torchtitan_fixtures[MOE]
    bias = "layers.1.moe.expert_bias_E"
    checkpoint_dir = resaved(fixture, tmp_path / "run" / "global_step_1", lambda state: state | {bias: torch.ones_like(state[bias])})

    with pytest.raises(CheckpointError, match=rf'"{bias}" is not zero'):
        merge_with_engine(checkpoint_dir, tmp_path / "out", backend="torchtitan", hf_model_config_path=str(fixture.reference_dir))


def test_a_key_the_table_does_not_map_is_an_error_that_names_it(torchtitan_fixtures, tmp_path):
    fixture = torchtitan_fixtures[MOE]
    extra = "layers.0.attention.sinks"
    checkpoint_dir = resaved(fixture, tmp_path / "run" / "global_step_1", lambda state: state | {extra: torch.zeros(4)})

    with pytest.raises(PlanError, match=rf'unmapped key\(s\) in .*"{extra}"'):
        merge_with_engine(checkpoint_dir, tmp_path / "out", backend="torchtitan", hf_model_config_path=str(fixture.reference_dir))
    shutil.rmtree(checkpoint_dir)


def test_the_watcher_finds_the_archive_in_the_step_directory_as_the_actors(torchtitan_fixtures):
    fixture = torchtitan_fixtures[MOE]

    (checkpoint,) = complete_checkpoints(fixture.run_dir)

    assert (checkpoint.backend, checkpoint.role, checkpoint.local_dir) == ("torchtitan", "actor", str(fixture.checkpoint_dir.absolute()))


@pytest.mark.usefixtures("prefect_server")
def test_a_sweep_merges_the_run_with_the_models_config(torchtitan_fixtures, tmp_path):
    fixture = torchtitan_fixtures[MOE]

    merged = sweep_checkpoints(
        run_dirs=[str(fixture.run_dir)],
        output_dir=str(tmp_path / "out"),
        options=MergeOptions(dtype="keep", hf_model_config_path=str(fixture.reference_dir)),
    )

    assert merged == [str(tmp_path / "out" / "run" / "global_step_1" / "actor")]
    reference = load_weights(fixture.reference_dir)
    assert all(torch.equal(load_weights(merged[0])[key], tensor) for key, tensor in reference.items())
