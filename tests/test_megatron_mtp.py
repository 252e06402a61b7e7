"""Multi-token-prediction layers, saved by megatron-core (`mtp.layers.0.*`), are kept under the names the model's
checkpoints use (DeepSeek-V3's `model.layers.{num_hidden_layers}.*`; Qwen3-Next's and Qwen3.5's `mtp.*`), or left
out on request.

The reference model's MTP tensors are added to its safetensors as those checkpoints hold them (transformers
builds no MTP layer); megatron-core's MTP block is filled from them and saves them into the archive."""

import json

import pytest
import torch
import transformers

from mergeflow.cli import main
from mergeflow.validation.validate import validate_model_dir
from tests.merging import load_weights, merge_with_engine, resaved_megatron_checkpoint

FIXTURE = "megatron-deepseek-v3-mla-mtp-tp2-ep2"
QWEN_STYLE = ["megatron-qwen3next-tp2-ep2-mtp", "megatron-qwen35moe-tp2-ep2-mtp"]
"""Fixtures whose MTP layer their checkpoints keep under `mtp.`: Qwen3-Next, and Qwen3.5 (a vision-language model)."""
MTP_LAYER = "model.layers.2."
"""The tiny model has two decoder layers: its MTP layer is the third."""


@pytest.fixture(scope="module")
def merged_with_mtp(megatron_fixtures, tmp_path_factory):
    target = tmp_path_factory.mktemp("mtp") / "merged"
    merge_with_engine(megatron_fixtures[FIXTURE].checkpoint_dir, target, backend="megatron", dtype="keep")
    return load_weights(target)


@pytest.fixture(scope="module")
def merged_without_mtp(megatron_fixtures, tmp_path_factory):
    target = tmp_path_factory.mktemp("mtp") / "merged"
    merge_with_engine(megatron_fixtures[FIXTURE].checkpoint_dir, target, backend="megatron", dtype="keep", drop_mtp=True)
    return target


def test_the_mtp_layer_is_kept_under_deepseeks_names(merged_with_mtp):
    names = {name.removeprefix(MTP_LAYER) for name in merged_with_mtp if name.startswith(MTP_LAYER)}

    assert {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.experts.3.down_proj.weight",
    } <= names


def test_the_mtp_tensors_equal_the_source(megatron_fixtures, merged_with_mtp):
    reference = load_weights(megatron_fixtures[FIXTURE].reference_dir)
    mtp_names = [name for name in reference if name.startswith(MTP_LAYER)]

    assert mtp_names
    assert [name for name in mtp_names if not torch.equal(merged_with_mtp[name], reference[name])] == []


def test_an_mtp_layer_keyed_as_later_megatron_core_releases_key_it_merges_the_same(megatron_fixtures, tmp_path):
    fixture = megatron_fixtures[FIXTURE]

    def renamed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key.replace(".transformer_layer.", ".mtp_model_layer."): value for key, value in state.items()}

    checkpoint_dir = resaved_megatron_checkpoint(fixture.model_dir, tmp_path / "run" / "global_step_1" / "actor", renamed)
    merge_with_engine(checkpoint_dir, tmp_path / "out", backend="megatron", dtype="keep")

    assert validate_model_dir(tmp_path / "out", reference_dir=fixture.reference_dir).passed


def test_the_mtp_layer_holds_copies_of_the_models_embedding_and_head(merged_with_mtp):
    assert torch.equal(merged_with_mtp[f"{MTP_LAYER}embed_tokens.weight"], merged_with_mtp["model.embed_tokens.weight"])
    assert torch.equal(merged_with_mtp[f"{MTP_LAYER}shared_head.head.weight"], merged_with_mtp["lm_head.weight"])


def test_dropping_mtp_writes_no_mtp_tensor(merged_without_mtp):
    assert [name for name in load_weights(merged_without_mtp) if name.startswith(MTP_LAYER)] == []


def test_a_model_without_mtp_validates_against_a_reference_with_it(megatron_fixtures, merged_without_mtp):
    report = validate_model_dir(merged_without_mtp, reference_dir=megatron_fixtures[FIXTURE].reference_dir, mtp_dropped=True)

    assert report.passed, report.failure_message()


def test_the_model_without_mtp_loads_in_transformers_with_no_unexpected_or_missing_keys(merged_without_mtp):
    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(merged_without_mtp, output_loading_info=True)

    assert (set(info["unexpected_keys"]), set(info["missing_keys"])) == (set(), set())


def test_inspect_reports_the_mtp_layer_the_layout_and_the_parallel_sizes(megatron_fixtures, capsys):
    main(["inspect", "--backend", "megatron", str(megatron_fixtures[FIXTURE].checkpoint_dir), "--json"])

    description = json.loads(capsys.readouterr().out)
    assert description["mtp_layers"] == 1
    assert description["model_type"] == "deepseek_v3"
    assert description["layout"] == "verl v2 (ckpt_contents.json)"
    assert (description["expert_model_parallel_size"], description["pipeline_model_parallel_size"]) == (2, 1)


@pytest.mark.parametrize("name", QWEN_STYLE)
def test_a_qwen_mtp_layer_is_kept_under_its_checkpoints_mtp_names(megatron_fixtures, tmp_path, name):
    merge_with_engine(megatron_fixtures[name].checkpoint_dir, tmp_path, backend="megatron", dtype="keep")

    reference = load_weights(megatron_fixtures[name].reference_dir)
    merged = load_weights(tmp_path)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= merged.keys()
    assert {n for n in merged if n.startswith("mtp.")} == {n for n in reference if n.startswith("mtp.")}


@pytest.mark.parametrize("name", QWEN_STYLE)
def test_dropping_mtp_leaves_out_a_qwen_mtp_layer(megatron_fixtures, tmp_path, name):
    merge_with_engine(megatron_fixtures[name].checkpoint_dir, tmp_path, backend="megatron", dtype="keep", drop_mtp=True)

    assert [n for n in load_weights(tmp_path) if n.startswith("mtp.")] == []
