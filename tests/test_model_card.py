"""Every merged folder gets a README.md model card, unless the checkpoint brought one."""

import pytest
from huggingface_hub import ModelCard

from mergeflow.flows.merge import merge_checkpoint

pytestmark = pytest.mark.usefixtures("prefect_server")


def test_merge_writes_a_model_card_with_the_merge_facts_as_front_matter(fixtures, target_dir):
    merge_checkpoint(local_dir=str(fixtures["qwen2-ws2"].checkpoint_dir), target_dir=str(target_dir), progress=False)

    card = ModelCard.load(target_dir / "README.md")

    facts = card.data.to_dict()["mergeflow"]
    assert (facts["step"], facts["backend"], facts["world_size"], facts["dtype"]) == (1, "fsdp", 2, "bfloat16")
    assert facts["validation"].startswith("passed")
    assert "| training step | 1 |" in card.text


def test_the_model_card_of_a_lora_merge_describes_the_lora(fixtures, target_dir):
    merge_checkpoint(local_dir=str(fixtures["lora-ws2"].checkpoint_dir), target_dir=str(target_dir), progress=False)

    card = ModelCard.load(target_dir / "README.md")

    assert "lora" in card.data.tags
    assert card.data.to_dict()["mergeflow"]["lora"].startswith("LoRA r=4, alpha=16")


def test_a_model_card_the_checkpoint_brought_is_kept_byte_for_byte(copy_checkpoint, target_dir):
    fixture = copy_checkpoint("qwen2-ws2")
    theirs = fixture.checkpoint_dir / "huggingface" / "README.md"
    theirs.write_text("---\nlicense: apache-2.0\n---\n# Our model\n")

    merge_checkpoint(local_dir=str(fixture.checkpoint_dir), target_dir=str(target_dir), progress=False)

    assert (target_dir / "README.md").read_bytes() == theirs.read_bytes()
