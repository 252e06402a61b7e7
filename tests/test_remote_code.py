"""A model whose classes are custom code beside its config: merged only with --trust-remote-code, and
its code carried over byte for byte."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mergeflow.cli import EXIT_BAD_INPUT, main
from mergeflow.demo.remote_code import remote_code_files
from tests.merging import INPUT_IDS, load_weights

pytestmark = pytest.mark.usefixtures("prefect_server")
NAME = "remote-code-ws2"


def merge_cli(checkpoint_dir, target_dir, *extra) -> int:
    return main(["merge", "--local-dir", str(checkpoint_dir), "--target-dir", str(target_dir), "--no-progress", *extra])


def remote_logits(model_dir, dtype: torch.dtype) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=dtype).eval()
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.fixture(scope="module")
def merged_remote(fixtures, tmp_path_factory):
    target = tmp_path_factory.mktemp("remote") / "merged"
    assert merge_cli(fixtures[NAME].checkpoint_dir, target, "--trust-remote-code") == 0
    return target


def test_custom_code_is_refused_without_trust_remote_code(fixtures, target_dir, capsys):
    code = merge_cli(fixtures[NAME].checkpoint_dir, target_dir)

    assert code == EXIT_BAD_INPUT
    assert "--trust-remote-code" in capsys.readouterr().err
    assert not target_dir.exists()


def test_custom_code_is_copied_byte_for_byte(fixtures, merged_remote):
    for source in remote_code_files(fixtures[NAME].reference_dir):
        assert (merged_remote / source.name).read_bytes() == source.read_bytes()


def test_custom_code_model_holds_the_original_tensors(fixtures, merged_remote):
    reference = load_weights(fixtures[NAME].reference_dir)
    merged = load_weights(merged_remote)

    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[key], tensor.to(merged[key].dtype)) for key, tensor in reference.items())


def test_custom_code_model_gives_the_original_logits_in_the_merged_dtype(fixtures, merged_remote):
    expected = remote_logits(fixtures[NAME].reference_dir, torch.bfloat16)

    assert torch.equal(remote_logits(merged_remote, torch.bfloat16), expected)
