"""How a stored megatron-core key is located in its family's table, on literal keys and shapes."""

import pytest
import torch

from mergeflow.errors import PlanError
from mergeflow.formats.dcp import StoredTensor
from mergeflow.formats.megatron.cuts import COPY, GATE_UP_INTERLEAVED_T, Geometry, joined
from mergeflow.formats.megatron.families import FAMILIES
from mergeflow.formats.megatron.names import locate, targets

GEOMETRY = Geometry(num_layers=2, num_heads=4, num_query_groups=2, head_dim=8, vocab_size=16, num_experts=3)


def stored(key: str, *shape: int) -> StoredTensor:
    return StoredTensor(key, torch.bfloat16, shape, ())


def test_a_stacked_layer_key_is_one_placement_per_layer():
    key = "decoder.layers.mlp.linear_fc2.weight"

    template, placements = locate(key, stored(key, 2, 4, 4), GEOMETRY)

    assert template == "decoder.layers.{layer}.mlp.linear_fc2.weight"
    assert placements == [((0,), {"layer": 0}), ((1,), {"layer": 1})]


def test_a_stacked_expert_axis_follows_the_layer_axis():
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"

    template, placements = locate(key, stored(key, 2, 3, 4, 4), GEOMETRY)

    assert template == "decoder.layers.{layer}.mlp.experts.{expert}.linear_fc2.weight"
    assert placements[4] == ((1, 1), {"layer": 1, "expert": 1})


def test_one_layers_key_names_its_layer():
    key = "decoder.layers.1.self_attention.linear_proj.weight"

    assert locate(key, stored(key, 4, 4), GEOMETRY) == ("decoder.layers.{layer}.self_attention.linear_proj.weight", [((), {"layer": 1})])


def test_an_mtp_layers_decoder_layer_is_the_layer_after_the_last():
    key = "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight"

    assert locate(key, stored(key, 4, 4), GEOMETRY) == ("decoder.layers.{layer}.mlp.linear_fc2.weight", [((), {"layer": 2})])


def test_a_stacked_axis_of_another_length_than_the_config_says_is_an_error():
    key = "decoder.layers.mlp.linear_fc2.weight"

    with pytest.raises(PlanError, match="expected 2 layers first"):
        locate(key, stored(key, 3, 4, 4), GEOMETRY)


def test_the_gate_half_of_a_fused_gate_up_is_the_gate_projection():
    table = FAMILIES["qwen2"].table

    assert targets("decoder.layers.{layer}.mlp.linear_fc1.weight_w", table) == [("model.layers.{layer}.mlp.gate_proj.weight", COPY)]


def test_a_half_of_gpt_oss_interleaved_experts_is_a_piece_of_their_one_tensor():
    table = FAMILIES["gpt_oss"].table

    assert targets("decoder.layers.{layer}.mlp.experts.{expert}.linear_fc1.weight_v", table) == [
        ("model.layers.{layer}.mlp.experts.gate_up_proj", joined(GATE_UP_INTERLEAVED_T, 1))
    ]


def test_a_key_no_table_line_names_has_no_targets():
    assert targets("decoder.layers.{layer}.unknown.weight", FAMILIES["qwen2"].table) is None
