"""Checkpoints that already hold a Hugging Face model (the `hf` backend): an FSDP save whose `save_contents` is
`hf_model` only, and verl's Automodel engine's `model/consolidated/` (`tests.writers.hf_tree`, whose layouts are
derived from verl's source)."""

import pytest

from mergeflow.cli import main
from mergeflow.errors import CheckpointError
from mergeflow.formats.registry import find_checkpoint
from mergeflow.run_layout import complete_checkpoints
from mergeflow.spec.config_files import WEIGHT_INDEX_FILE
from tests.merging import load_weights
from tests.writers.hf_tree import automodel, hf_model_only

FIXTURE = "qwen2-ws2"
TOKENIZER_FILE = "tokenizer.json"


def merge(checkpoint, target, *flags: str) -> int:
    return main(["merge", "--backend", "hf", "--local_dir", str(checkpoint), "--target_dir", str(target), "--no-progress", *flags])


@pytest.mark.usefixtures("prefect_server")
def test_an_hf_model_only_save_is_copied_bit_for_bit_and_validated(fixtures, tmp_path):
    fixture = fixtures[FIXTURE]
    checkpoint = hf_model_only(fixture, tmp_path / "run")

    assert merge(checkpoint, tmp_path / "out", "--test_hf_dir", str(fixture.reference_dir)) == 0

    merged, reference = load_weights(tmp_path / "out"), load_weights(fixture.reference_dir)
    assert merged.keys() == reference.keys() and all(merged[name].equal(reference[name]) for name in reference)
    assert (tmp_path / "out" / TOKENIZER_FILE).read_bytes() == (checkpoint / "huggingface" / TOKENIZER_FILE).read_bytes()
    assert (tmp_path / "out" / "README.md").is_file()


@pytest.mark.usefixtures("prefect_server")
def test_an_automodel_consolidated_model_takes_its_tokenizer_from_the_config_path(fixtures, tmp_path):
    fixture = fixtures[FIXTURE]
    checkpoint = automodel(fixture, tmp_path / "run")
    config_path = fixture.checkpoint_dir / "huggingface"

    assert merge(checkpoint, tmp_path / "out", "--hf_model_config_path", str(config_path)) == 0

    assert (tmp_path / "out" / TOKENIZER_FILE).read_bytes() == (config_path / TOKENIZER_FILE).read_bytes()
    merged, reference = load_weights(tmp_path / "out"), load_weights(fixture.reference_dir)
    assert all(merged[name].equal(reference[name]) for name in reference)
    assert not (tmp_path / "out" / "optim").exists()


def test_an_hf_model_only_save_given_as_fsdp_says_to_pass_backend_hf(fixtures, tmp_path):
    checkpoint = hf_model_only(fixtures[FIXTURE], tmp_path / "run")

    with pytest.raises(CheckpointError, match="not an FSDP checkpoint") as refused:
        find_checkpoint(checkpoint, "fsdp")

    assert refused.value.hint.endswith("pass --backend hf")


def test_a_tree_whose_index_names_a_missing_weight_file_is_an_error_naming_it(fixtures, tmp_path):
    checkpoint = hf_model_only(fixtures[FIXTURE], tmp_path / "run")
    (checkpoint / "huggingface" / WEIGHT_INDEX_FILE).write_text('{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}')

    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        find_checkpoint(checkpoint, "hf")


def test_a_directory_without_a_model_is_refused_naming_where_it_looked(tmp_path):
    with pytest.raises(CheckpointError, match=r"no Hugging Face model in .*model/consolidated/"):
        find_checkpoint(tmp_path, "hf")


@pytest.mark.parametrize("layout", [hf_model_only, automodel], ids=["hf_model only", "automodel"])
def test_the_watcher_finds_a_saved_tree_as_an_hf_checkpoint(fixtures, tmp_path, layout):
    layout(fixtures[FIXTURE], tmp_path / "run")

    (found,) = complete_checkpoints(tmp_path / "run")

    assert (found.step, found.role, found.backend) == (1, "actor", "hf")


def test_a_tree_still_missing_an_indexed_weight_file_is_not_complete(fixtures, tmp_path):
    checkpoint = hf_model_only(fixtures[FIXTURE], tmp_path / "run")
    (checkpoint / "huggingface" / WEIGHT_INDEX_FILE).write_text('{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}')

    assert complete_checkpoints(tmp_path / "run") == []


def test_inspect_describes_a_tree_without_merging_it(fixtures, tmp_path, capsys):
    checkpoint = hf_model_only(fixtures[FIXTURE], tmp_path / "run")

    assert main(["inspect", str(checkpoint), "--backend", "hf"]) == 0

    assert "the model is copied as it is" in capsys.readouterr().out
