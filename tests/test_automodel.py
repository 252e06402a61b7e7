"""Checkpoints of verl's Automodel engine, as nemo-automodel's own checkpointer writes them (`tests.writers.automodel`):
the consolidated model is copied byte for byte, validated, and given the tokenizer of the run's model path."""

import pytest
import torch

from mergeflow.errors import CheckpointError
from mergeflow.formats.registry import find_checkpoint
from mergeflow.run_layout import complete_checkpoints
from tests.merging import load_weights, logits, merge_with_engine

pytestmark = pytest.mark.slow

TOKENIZER_FILE = "tokenizer.json"


def test_the_consolidated_model_is_copied_with_the_tokenizer_of_the_model_path(automodel_fixture, tmp_path):
    fixture = automodel_fixture

    output = tmp_path / "out"
    merge_with_engine(fixture.checkpoint_dir, output, backend="hf", hf_model_config_path=str(fixture.reference_dir))

    reference, merged = load_weights(fixture.reference_dir), load_weights(output)
    assert merged.keys() == reference.keys()
    assert all(merged[name].equal(tensor) for name, tensor in reference.items())
    assert (output / TOKENIZER_FILE).read_bytes() == (fixture.reference_dir / TOKENIZER_FILE).read_bytes()
    assert not (output / "optim").exists()
    assert logits(output, torch.float32).equal(logits(fixture.reference_dir, torch.float32))


def test_given_as_fsdp_the_error_says_to_pass_backend_hf(automodel_fixture):
    with pytest.raises(CheckpointError, match="not an FSDP checkpoint") as refused:
        find_checkpoint(automodel_fixture.checkpoint_dir, "fsdp")

    assert refused.value.hint.endswith("pass --backend hf")


def test_the_watcher_finds_the_save_as_an_hf_checkpoint(automodel_fixture):
    (checkpoint,) = complete_checkpoints(automodel_fixture.run_dir)

    assert (checkpoint.backend, checkpoint.local_dir) == ("hf", str(automodel_fixture.checkpoint_dir.absolute()))
