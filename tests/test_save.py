"""What a merge writes besides the tensors: files, index, config, generation config, side files."""

import json

import pytest

from mergeflow.demo.models import CHAT_TEMPLATE
from tests.merging import load_weights, merge_with_engine


@pytest.fixture(scope="module")
def sharded(fixtures, tmp_path_factory):
    target = tmp_path_factory.mktemp("sharded") / "out"
    saved = merge_with_engine(
        fixtures["qwen2-ws2"].checkpoint_dir, target, dtype="bf16", max_shard_size="8KB"
    )
    return saved, target


def test_output_is_split_into_files_no_larger_than_max_shard_size(sharded):
    saved, target = sharded
    index = json.loads((target / "model.safetensors.index.json").read_text())

    assert len(saved.weight_files) > 1
    assert set(index["weight_map"].values()) == set(saved.weight_files)
    assert saved.weight_files[0] == f"model-00001-of-{len(saved.weight_files):05d}.safetensors"


def test_index_names_every_tensor_and_counts_total_size_in_bytes(sharded):
    _, target = sharded
    index = json.loads((target / "model.safetensors.index.json").read_text())
    weights = load_weights(target)

    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())


def test_small_model_is_one_model_safetensors_file(fixtures, tmp_path):
    saved = merge_with_engine(fixtures["qwen2-ws1"].checkpoint_dir, tmp_path / "out")

    assert saved.weight_files == ("model.safetensors",)


def test_config_json_records_the_output_dtype_and_keeps_everything_else(fixtures, sharded):
    _, target = sharded
    source = json.loads((fixtures["qwen2-ws2"].checkpoint_dir / "huggingface" / "config.json").read_text())
    written = json.loads((target / "config.json").read_text())

    assert written.pop("dtype") == "bfloat16"
    source.pop("dtype", None)
    assert written == source


def test_keep_dtype_records_the_source_dtype(fixtures, tmp_path):
    merge_with_engine(fixtures["qwen2-fsdp1-ws3"].checkpoint_dir, tmp_path / "out", dtype="keep")

    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("filename", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_tokenizer_files_are_copied_byte_for_byte(fixtures, sharded, filename):
    _, target = sharded
    source = fixtures["qwen2-ws2"].checkpoint_dir / "huggingface" / filename

    assert (target / filename).read_bytes() == source.read_bytes()


def test_chat_template_survives(sharded):
    _, target = sharded

    assert (target / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_generation_config_is_copied_from_the_checkpoint(fixtures, sharded):
    _, target = sharded
    source = fixtures["qwen2-ws2"].checkpoint_dir / "huggingface" / "generation_config.json"

    assert (target / "generation_config.json").read_bytes() == source.read_bytes()


def test_generation_config_is_derived_from_the_model_config_when_absent(fixtures, tmp_path):
    merge_with_engine(fixtures["qwen2-ws1"].checkpoint_dir, tmp_path / "out")

    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1


def test_value_model_gets_no_generation_config(fixtures, tmp_path):
    merge_with_engine(fixtures["value-ws2"].checkpoint_dir, tmp_path / "out")

    assert not (tmp_path / "out" / "generation_config.json").exists()
