"""Merging real FSDP checkpoints gives back the original model: tensors, keys and logits."""

from pathlib import Path

import pytest
import torch
import transformers

from mergeflow.validation.validate import validate_model_dir
from tests.conftest import FIXTURE_NAMES
from tests.merging import load_weights, logits, merge_with_engine, model_class

OUTPUT_DTYPES = {"keep": None, "bf16": torch.bfloat16}


@pytest.fixture(scope="session")
def merged(fixtures, tmp_path_factory):
    """Merge each (fixture, dtype) once per session, on first use."""
    outputs: dict[tuple[str, str], Path] = {}

    def get(name: str, dtype: str) -> Path:
        if (name, dtype) not in outputs:
            target = tmp_path_factory.mktemp("merged") / f"{name}-{dtype}"
            merge_with_engine(fixtures[name].checkpoint_dir, target, dtype=dtype)
            outputs[name, dtype] = target
        return outputs[name, dtype]

    return get


def expected_tensor(reference: torch.Tensor, dtype: str) -> torch.Tensor:
    cast = OUTPUT_DTYPES[dtype]
    return reference.to(cast) if cast is not None and reference.is_floating_point() else reference


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_merged_tensors_equal_the_original_state_dict(fixtures, merged, name, dtype):
    reference = load_weights(fixtures[name].reference_dir)
    output = load_weights(merged(name, dtype))

    assert output.keys() == reference.keys()
    for key, tensor in reference.items():
        expected = expected_tensor(tensor, dtype)
        assert output[key].dtype == expected.dtype, key
        assert torch.equal(output[key], expected), key


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_merged_model_loads_with_no_missing_or_unexpected_keys(merged, name):
    output = merged(name, "bf16")

    _, info = model_class(output).from_pretrained(output, output_loading_info=True)

    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_merged_model_gives_the_original_logits(fixtures, merged, name, dtype):
    compute_dtype = OUTPUT_DTYPES[dtype] or torch.float32
    if dtype == "keep" and fixtures[name].spec.dtype == "bf16":
        compute_dtype = torch.bfloat16

    original = logits(fixtures[name].reference_dir, compute_dtype)

    assert torch.equal(logits(merged(name, dtype), compute_dtype), original)


def test_tied_lm_head_is_not_written(merged):
    assert "lm_head.weight" not in load_weights(merged("qwen2-ws2", "bf16"))


def test_untied_lm_head_is_written(merged):
    assert "lm_head.weight" in load_weights(merged("qwen2-untied-ws4", "bf16"))


def test_value_model_keeps_its_score_head(merged):
    output = merged("value-ws2", "bf16")

    assert load_weights(output)["score.weight"].shape == (1, 24)
    assert model_class(output).__name__ == "Qwen2ForTokenClassification"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_weights_file_is_byte_identical_to_what_save_pretrained_writes(fixtures, merged, name):
    written = merged(name, "keep") / "model.safetensors"

    assert written.read_bytes() == (fixtures[name].reference_dir / "model.safetensors").read_bytes()


def test_qwen3_vl_moe_experts_are_written_input_major_as_its_checkpoints_hold_them(merged):
    experts = load_weights(merged("qwen3vlmoe-ws2", "bf16"))["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    config = transformers.AutoConfig.from_pretrained(merged("qwen3vlmoe-ws2", "bf16")).text_config

    assert experts.shape == (config.num_experts, config.hidden_size, 2 * config.moe_intermediate_size)


def test_a_merge_validates_against_a_reference_saved_output_major(fixtures, merged, tmp_path):
    reference = fixtures["qwen3vlmoe-ws2"].reference_dir
    model_class(reference).from_pretrained(reference).save_pretrained(tmp_path)  # transformers 5 saves output-major

    report = validate_model_dir(merged("qwen3vlmoe-ws2", "keep"), reference_dir=tmp_path)

    assert report.passed, report.failure_message()
