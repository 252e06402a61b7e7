"""LoRA adapters trained with verl's Megatron backend give a PEFT adapter, or a model with the LoRA folded in.

Megatron-Bridge, which trains them for verl, needs Python 3.12 and cannot run here: the adapters' layout is
derived from its source (`tests.writers.megatron_lora`), beside a base model that megatron-core saved.
"""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mergeflow.errors import CheckpointError
from tests.merging import INPUT_IDS, merge_with_engine
from tests.writers.megatron_lora import trained_lora, write_lora_run

BASE_FIXTURE = "megatron-qwen2-tp1"
ALPHA = 8


@pytest.fixture(scope="session")
def lora_runs(megatron_fixtures, tmp_path_factory) -> dict[str, Path]:
    """The trained adapter (as PEFT saves it), and verl's two saves of the run: the model's archive with the
    adapters in it, and the adapters' archive alone beside Megatron-Bridge's PEFT export."""
    fixture = megatron_fixtures[BASE_FIXTURE]
    model = trained_lora(fixture, rank=4, alpha=ALPHA, seed=3)
    root = tmp_path_factory.mktemp("megatron-lora")
    model.save_pretrained(root / "trained")
    return {
        "reference": fixture.reference_dir,
        "trained": root / "trained",
        "with model": write_lora_run(fixture, model, root / "with-model", with_model=True),
        "adapters alone": write_lora_run(fixture, model, root / "adapters-alone", with_model=False),
    }


def run(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(INPUT_IDS).logits


def with_adapter(base_dir: Path, adapter_dir: Path) -> PeftModel:
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)


@pytest.fixture(scope="session")
def trained_logits(lora_runs) -> torch.Tensor:
    return run(with_adapter(lora_runs["reference"], lora_runs["trained"]))


def test_adapter_on_the_merged_base_gives_the_trained_models_logits(lora_runs, trained_logits, tmp_path):
    merge_with_engine(lora_runs["with model"], tmp_path, backend="megatron", dtype="keep", lora_alpha=ALPHA)

    assert torch.equal(run(with_adapter(tmp_path, tmp_path / "lora_adapter")), trained_logits)


def test_adapter_tensors_equal_the_trained_ones_under_pefts_names(lora_runs, tmp_path):
    merge_with_engine(lora_runs["with model"], tmp_path, backend="megatron", dtype="keep", lora_alpha=ALPHA)

    ours = load_file(tmp_path / "lora_adapter" / "adapter_model.safetensors")
    theirs = load_file(lora_runs["trained"] / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in ours.items())


def test_folded_model_gives_the_trained_models_logits(lora_runs, trained_logits, tmp_path):
    merge_with_engine(
        lora_runs["with model"], tmp_path, backend="megatron", dtype="keep", lora_alpha=ALPHA, merge_lora=True
    )

    folded = run(AutoModelForCausalLM.from_pretrained(tmp_path))
    torch.testing.assert_close(folded, trained_logits, rtol=0, atol=1e-5)


def test_adapters_saved_alone_give_the_adapter_alone(lora_runs, trained_logits, tmp_path):
    merge_with_engine(lora_runs["adapters alone"], tmp_path, backend="megatron", dtype="keep")

    assert [path.name for path in tmp_path.iterdir()] == ["lora_adapter"]
    assert torch.equal(run(with_adapter(lora_runs["reference"], tmp_path / "lora_adapter")), trained_logits)


def test_alpha_is_read_from_the_peft_folder_verl_exported(lora_runs, tmp_path):
    merge_with_engine(lora_runs["adapters alone"], tmp_path, backend="megatron", dtype="keep")

    config = json.loads((tmp_path / "lora_adapter" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == ALPHA


def test_a_run_that_records_no_alpha_asks_for_lora_alpha(lora_runs, tmp_path):
    with pytest.raises(CheckpointError, match=r"records no lora_alpha .*model/huggingface/adapter/adapter_config.json"):
        merge_with_engine(lora_runs["with model"], tmp_path / "out", backend="megatron", dtype="keep")
