"""A Qwen2.5-VL Megatron checkpoint merges into what its writer's own export gives.

verl trains Qwen2.5-VL on Megatron through one of two bridges, and sends its rollout engine what that bridge exports.
mbridge (verl's `vanilla_mbridge=True` path) fills its own model through its own HF → megatron-core conversion and
splits every `linear_fc1` across TP ranks as a gate|up, the vision projector's ungated one included; its export joins
the rows back. The fixtures here are mbridge's model filled by mbridge's own `load_weights` and exported by its own
`export_weights`, at TP=1, 2 and 4. Megatron-Bridge (verl's default) keeps HF's vision module under `visual.*`,
replicated: that layout is derived from its source (`Qwen25VLBridge`'s `ReplicatedMapping("visual.**")`; it needs
Python 3.12 and cannot run here) by re-saving the mbridge fixture's archive with the tower under its HF names.
"""

import re

import pytest
import torch
from safetensors.torch import load_file

from mergeflow.formats.megatron.cuts import RANK_HALVES, Geometry, per_rank, split_part
from mergeflow.validation.validate import validate_model_dir
from tests.merging import load_weights, merge_with_engine, resaved_megatron_checkpoint

MBRIDGE_FIXTURES = ["megatron-qwen25vl-tp1", "megatron-qwen25vl-tp2", "megatron-qwen25vl-tp4"]
GEOMETRY = Geometry(num_layers=1, num_heads=1, num_query_groups=1, head_dim=1, vocab_size=0, num_experts=0)


@pytest.mark.parametrize("name", MBRIDGE_FIXTURES)
def test_an_mbridge_qwen2_5_vl_merges_into_mbridges_own_export_of_it(megatron_fixtures, tmp_path, name):
    fixture = megatron_fixtures[name]
    merge_with_engine(fixture.checkpoint_dir, tmp_path / "out", backend="megatron", dtype="keep")

    merged, exported = load_weights(tmp_path / "out"), load_file(fixture.writer_export_file)

    assert merged.keys() == exported.keys()
    assert [name for name in exported if not torch.equal(merged[name], exported[name])] == []


def test_mbridges_vision_projector_rows_are_joined_as_its_export_joins_them():
    saved = torch.arange(8)  # two TP ranks: [rank 0's first half, its second half, rank 1's first, its second]

    assert split_part(saved, per_rank(RANK_HALVES, 2), GEOMETRY).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_a_vision_projector_saved_by_one_rank_is_kept_as_it_is():
    assert split_part(torch.arange(8), per_rank(RANK_HALVES, 1), GEOMETRY).tolist() == list(range(8))


def test_a_megatron_bridge_qwen2_5_vl_with_hfs_vision_module_merges_its_tower_as_stored(megatron_fixtures, tmp_path):
    fixture = megatron_fixtures["megatron-qwen25vl-tp2"]
    tower = {name: value for name, value in load_weights(fixture.reference_dir).items() if name.startswith("visual.")}

    def hf_vision_module(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value for key, value in state.items() if not re.match(r"^vision_model\.", key)} | tower

    run = tmp_path / "run"
    checkpoint_dir = resaved_megatron_checkpoint(fixture.model_dir, run / "global_step_1" / "actor", hf_vision_module)
    merge_with_engine(checkpoint_dir, tmp_path / "out", backend="megatron", dtype="keep")

    report = validate_model_dir(tmp_path / "out", reference_dir=fixture.reference_dir)
    assert report.passed, report.failure_message()
    assert report.tensors_compared == len(load_weights(fixture.reference_dir))
