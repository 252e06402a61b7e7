"""LoRA checkpoints give a PEFT adapter that reproduces the trained model, or a base model with LoRA folded in."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from mergeflow.demo.models import tiny_config
from mergeflow.errors import CheckpointError, OptionError
from mergeflow.lora import infer_lora_config
from mergeflow.options import Reference
from mergeflow.validation.validate import validate_model_dir
from tests.merging import INPUT_IDS, load_weights, merge_with_engine, model_class

ADAPTER_FIXTURES = ["lora-ws2", "dora-llama-ws3", "lora-value-ws2", "lora-moe-ws2", "lora-vl-ws2"]
FOLDED_LOGITS_ATOL = {torch.float32: 1e-5}
"""Folding reorders float32 arithmetic (W + s·BA once, instead of x·W + s·(x·A)·B per input)."""


@pytest.fixture(scope="session")
def merged_lora(fixtures, tmp_path_factory):
    """Merge each (fixture, dtype, fold) once per session, on first use."""
    outputs: dict[tuple, Path] = {}

    def get(name: str, dtype: str = "keep", *, merge_lora: bool = False, **options) -> Path:
        key = (name, dtype, merge_lora, *sorted(options.items()))
        if key not in outputs:
            target = tmp_path_factory.mktemp("merged-lora") / name
            merge_with_engine(fixtures[name].checkpoint_dir, target, dtype=dtype, merge_lora=merge_lora, **options)
            outputs[key] = target
        return outputs[key]

    return get


def run(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(INPUT_IDS).logits


def trained_model(fixture) -> PeftModel:
    """The model verl trained: the base model with the original adapter, as PEFT loads it."""
    base = model_class(fixture.reference_dir).from_pretrained(fixture.reference_dir)
    return PeftModel.from_pretrained(base, fixture.adapter_dir)


def with_adapter(model_dir: Path, adapter_dir: Path) -> PeftModel:
    return PeftModel.from_pretrained(model_class(model_dir).from_pretrained(model_dir), adapter_dir)


@pytest.mark.parametrize("name", ADAPTER_FIXTURES)
def test_extracted_adapter_on_the_merged_base_gives_the_trained_models_logits(fixtures, merged_lora, name):
    output = merged_lora(name)

    assert torch.equal(run(with_adapter(output, output / "lora_adapter")), run(trained_model(fixtures[name])))


@pytest.mark.parametrize("name", ADAPTER_FIXTURES)
def test_adapter_tensors_equal_the_trained_adapters(fixtures, merged_lora, name):
    ours = load_file(merged_lora(name) / "lora_adapter" / "adapter_model.safetensors")
    theirs = load_file(fixtures[name].adapter_dir / "adapter_model.safetensors")

    assert ours.keys() == theirs.keys()
    assert all(torch.equal(tensor, theirs[key]) for key, tensor in ours.items())


def test_adapter_config_records_rank_pattern_alpha_and_targets(merged_lora):
    output = merged_lora("lora-ws2")

    config = json.loads((output / "lora_adapter" / "adapter_config.json").read_text())

    assert (config["r"], config["lora_alpha"], config["rank_pattern"]) == (4, 16, {"v_proj": 2})
    assert sorted(config["target_modules"]) == ["down_proj", "embed_tokens", "q_proj", "v_proj"]
    assert config["task_type"] == "CAUSAL_LM"


def test_an_adapter_names_no_local_path_as_its_base_model(merged_lora):
    config = json.loads((merged_lora("lora-ws2") / "lora_adapter" / "adapter_config.json").read_text())

    assert config["base_model_name_or_path"] is None


def test_an_adapter_names_the_base_model_given_with_base_model(merged_lora):
    output = merged_lora("lora-ws2", base_model="my-org/my-base")

    config = json.loads((output / "lora_adapter" / "adapter_config.json").read_text())

    assert config["base_model_name_or_path"] == "my-org/my-base"


def test_an_adapter_names_the_hub_model_its_config_was_saved_from(copy_checkpoint, target_dir):
    fixture = copy_checkpoint("lora-ws2")
    config_path = fixture.checkpoint_dir / "huggingface" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "_name_or_path": "Qwen/Qwen2.5-0.5B"}))

    merge_with_engine(fixture.checkpoint_dir, target_dir)

    config = json.loads((target_dir / "lora_adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B"


def test_dora_adapter_says_so(merged_lora):
    config = json.loads((merged_lora("dora-llama-ws3") / "lora_adapter" / "adapter_config.json").read_text())

    assert config["use_dora"] is True


@pytest.mark.parametrize("name", ADAPTER_FIXTURES)
def test_base_model_equals_the_original_base_bit_for_bit(fixtures, merged_lora, name):
    report = validate_model_dir(merged_lora(name), reference_dir=fixtures[name].reference_dir)

    assert report.passed, report.failure_message()


def test_base_model_loads_with_plain_hugging_face_names(merged_lora):
    output = merged_lora("lora-ws2")

    _, info = model_class(output).from_pretrained(output, output_loading_info=True)

    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not [key for key in load_weights(output) if "lora_" in key or "base_layer" in key]


@pytest.mark.parametrize("name", ADAPTER_FIXTURES)
def test_folded_model_gives_the_trained_models_logits(fixtures, merged_lora, name):
    output = merged_lora(name, merge_lora=True)

    folded = run(model_class(output).from_pretrained(output))

    torch.testing.assert_close(folded, run(trained_model(fixtures[name])), atol=FOLDED_LOGITS_ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("name", ADAPTER_FIXTURES)
def test_folded_bf16_weights_are_peft_merge_and_unload_rounded_to_bf16(fixtures, merged_lora, name, tmp_path):
    ours = load_weights(merged_lora(name, "bf16", merge_lora=True))

    trained_model(fixtures[name]).merge_and_unload().save_pretrained(tmp_path)  # under the names it saves
    theirs = load_weights(tmp_path)

    for key, tensor in ours.items():
        expected = theirs[key].to(torch.bfloat16).float()
        torch.testing.assert_close(tensor.float(), expected, atol=0, rtol=2**-7, msg=key)  # one bf16 step


def test_folded_model_has_no_adapter(fixtures, merged_lora):
    output = merged_lora("lora-ws2", merge_lora=True)

    assert load_weights(output).keys() == load_weights(fixtures["lora-ws2"].reference_dir).keys()
    assert not (output / "lora_adapter").exists()


def test_missing_alpha_is_an_error_that_names_the_flag(fixtures, target_dir):
    with pytest.raises(CheckpointError, match=r"records no lora_alpha.*pass --lora-alpha"):
        merge_with_engine(fixtures["lora-no-meta-fsdp1-ws2"].checkpoint_dir, target_dir)
    assert not target_dir.exists()


def test_alpha_flag_supplies_a_missing_alpha(fixtures, merged_lora):
    output = merged_lora("lora-no-meta-fsdp1-ws2", lora_alpha=16)

    fixture = fixtures["lora-no-meta-fsdp1-ws2"]
    assert torch.equal(run(with_adapter(output, output / "lora_adapter")), run(trained_model(fixture)))


def test_alpha_flag_that_contradicts_the_checkpoint_is_an_error(fixtures, target_dir):
    with pytest.raises(OptionError, match=r"--lora-alpha 8 contradicts lora_alpha=16 in .*lora_train_meta.json"):
        merge_with_engine(fixtures["lora-ws2"].checkpoint_dir, target_dir, lora_alpha=8)


def test_lora_only_checkpoint_gives_an_adapter_without_a_base_model(fixtures, merged_lora):
    output = merged_lora("lora-only-ws2")
    fixture = fixtures["lora-only-ws2"]

    adapted = with_adapter(fixture.reference_dir, output / "lora_adapter")

    assert sorted(path.name for path in output.iterdir()) == ["lora_adapter"]
    assert torch.equal(run(adapted), run(trained_model(fixture)))
    assert validate_model_dir(output).passed


def test_a_lone_adapter_carries_the_tokenizer_files_byte_for_byte(fixtures, merged_lora):
    config_dir = fixtures["lora-only-ws2"].checkpoint_dir / "huggingface"
    adapter_dir = merged_lora("lora-only-ws2") / "lora_adapter"
    tokenizer_files = [path for path in config_dir.iterdir() if path.name.startswith("tokenizer")]

    assert tokenizer_files
    assert all((adapter_dir / path.name).read_bytes() == path.read_bytes() for path in tokenizer_files)


def test_folding_a_lora_only_checkpoint_is_an_error(fixtures, target_dir):
    with pytest.raises(OptionError, match="LoRA-only checkpoint"):
        merge_with_engine(fixtures["lora-only-ws2"].checkpoint_dir, target_dir, merge_lora=True)


def test_merge_lora_on_a_checkpoint_without_lora_is_an_error(fixtures, target_dir):
    with pytest.raises(OptionError, match=r"--merge-lora given, but checkpoint .* holds no LoRA tensors"):
        merge_with_engine(fixtures["qwen2-ws2"].checkpoint_dir, target_dir, merge_lora=True)


def test_truncated_adapter_fails_validation(merged_lora, tmp_path):
    output = merged_lora("lora-ws2")
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in output.rglob("*"):
        if path.is_file():
            (broken / path.relative_to(output)).parent.mkdir(parents=True, exist_ok=True)
            (broken / path.relative_to(output)).write_bytes(path.read_bytes())
    weights = broken / "lora_adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])

    report = validate_model_dir(broken)

    assert not report.passed
    assert "adapter_model.safetensors" in report.failure_message()


class TestInferLoraConfig:
    @staticmethod
    def base_model() -> torch.nn.Module:
        import transformers

        with torch.device("meta"):
            return transformers.Qwen2ForCausalLM(tiny_config("qwen2", tie=False))

    def test_a_leaf_adapted_in_every_layer_is_named_by_its_leaf(self):
        ranks = {f"model.layers.{i}.self_attn.q_proj": 8 for i in range(2)}

        config = infer_lora_config(self.base_model(), ranks, alpha=16)

        assert sorted(config.target_modules) == ["q_proj"]
        assert config.rank_pattern == {}

    def test_a_leaf_adapted_in_some_layers_is_named_by_full_path(self):
        ranks = {"model.layers.0.self_attn.q_proj": 8, "model.layers.0.mlp.up_proj": 8, "model.layers.1.mlp.up_proj": 8}

        config = infer_lora_config(self.base_model(), ranks, alpha=16)

        assert sorted(config.target_modules) == ["model.layers.0.self_attn.q_proj", "up_proj"]

    def test_ranks_that_differ_by_leaf_go_to_the_rank_pattern_by_leaf(self):
        ranks = {f"model.layers.{i}.self_attn.{leaf}": r for i in range(2) for leaf, r in (("q_proj", 8), ("v_proj", 2))}
        ranks["model.layers.0.mlp.down_proj"] = 8

        config = infer_lora_config(self.base_model(), ranks, alpha=16)

        assert (config.r, config.rank_pattern) == (8, {"v_proj": 2})

    def test_ranks_that_differ_within_a_leaf_go_to_the_rank_pattern_by_path(self):
        ranks = {"model.layers.0.self_attn.q_proj": 8, "model.layers.1.self_attn.q_proj": 4, "model.layers.0.mlp.up_proj": 8}

        config = infer_lora_config(self.base_model(), ranks, alpha=16)

        assert config.rank_pattern == {"model.layers.1.self_attn.q_proj": 4}


@pytest.mark.usefixtures("prefect_server")
def test_test_operation_compares_the_base_of_a_lora_checkpoint_with_its_reference(fixtures):
    from mergeflow.flows.verify import verify_checkpoint

    fixture = fixtures["lora-ws2"]
    report = verify_checkpoint(local_dir=str(fixture.checkpoint_dir), reference=Reference(str(fixture.reference_dir)))

    assert report.passed and report.tensors_compared == len(load_weights(fixture.reference_dir))
