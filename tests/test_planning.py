"""Merge planning on literal names and shapes (no checkpoint is read)."""

import pytest

from mergeflow.errors import OptionError, PlanError
from mergeflow.formats.fsdp.index import ShardIndex, SourceTensor
from mergeflow.formats.fsdp.placement import Block
from mergeflow.planning import plan_merge
from mergeflow.spec.model_spec import ModelSpec, SavedView


def index_of(shapes: dict[str, tuple[int, ...]], dtype: str = "float32") -> ShardIndex:
    tensors = {
        name: SourceTensor(name, dtype, shape, ("shard:0",), (Block(0, (0,) * len(shape), shape),))
        for name, shape in shapes.items()
    }
    return ShardIndex("/ckpt", 1, ("/ckpt/model_world_size_1_rank_0.pt",), (1,), ("fsdp",), tensors, {})


def spec_of(
    shapes: dict[str, tuple[int, ...]],
    tied: dict[str, str] | None = None,
    saved: dict[str, tuple[tuple[int, ...], SavedView]] | None = None,
) -> ModelSpec:
    """A spec whose model holds `shapes`; `saved` gives the names it saves under, with their views."""
    return ModelSpec(
        config_dir="/ckpt/huggingface",
        architecture="TinyForCausalLM",
        model_class="TinyForCausalLM",
        trust_remote_code=False,
        expected_shapes=shapes,
        saved_shapes={name: shape for name, (shape, _) in saved.items()} if saved else shapes,
        saved_views={name: view for name, (_, view) in saved.items()} if saved else {},
        tied=tied or {},
        is_value_model=False,
    )


FUSED = {"experts.gate_up": (2, 6, 4), "norm.weight": (4,)}
PER_EXPERT = {
    "experts.0.gate.weight": ((3, 4), SavedView("experts.gate_up", (4, 1), 0)),
    "experts.0.up.weight": ((3, 4), SavedView("experts.gate_up", (4, 1), 12)),
    "experts.1.gate.weight": ((3, 4), SavedView("experts.gate_up", (4, 1), 24)),
    "experts.1.up.weight": ((3, 4), SavedView("experts.gate_up", (4, 1), 36)),
    "norm.weight": ((4,), SavedView("norm.weight", (1,), 0)),
}


SHAPES = {"embed.weight": (10, 4), "norm.weight": (4,), "head.weight": (10, 4)}


def test_every_tensor_is_written_in_the_chosen_dtype():
    plan = plan_merge(index_of(SHAPES), spec_of(SHAPES), dtype="bf16")

    assert {name: t.dtype for name, t in plan.tensors.items()} == dict.fromkeys(SHAPES, "bfloat16")
    assert plan.total_size == (40 + 4 + 40) * 2


def test_keep_writes_the_source_dtype():
    plan = plan_merge(index_of(SHAPES), spec_of(SHAPES), dtype="keep")

    assert plan.config_dtype == "float32"
    assert plan.total_size == (40 + 4 + 40) * 4


def test_tied_alias_is_dropped():
    spec = spec_of({"embed.weight": (10, 4), "norm.weight": (4,)}, tied={"head.weight": "embed.weight"})

    plan = plan_merge(index_of(SHAPES), spec)

    assert list(plan.tensors) == ["embed.weight", "norm.weight"]
    assert plan.dropped_aliases == {"head.weight": "embed.weight"}


def test_small_max_shard_size_splits_files_in_order():
    plan = plan_merge(index_of(SHAPES), spec_of(SHAPES), dtype="fp32", max_shard_size=200)

    assert plan.shard_to_names == {
        "model-00001-of-00002.safetensors": ("embed.weight", "norm.weight"),
        "model-00002-of-00002.safetensors": ("head.weight",),
    }


def test_missing_tensor_is_named():
    with pytest.raises(PlanError, match=r'lacks tensor.*"head\.weight"'):
        plan_merge(index_of({"embed.weight": (10, 4), "norm.weight": (4,)}), spec_of(SHAPES))


def test_shape_mismatch_names_the_tensor_and_both_shapes():
    with pytest.raises(PlanError, match=r"norm.weight: got \(5,\), expected \(4,\)"):
        plan_merge(index_of({**SHAPES, "norm.weight": (5,)}), spec_of(SHAPES))


def test_tensors_the_config_does_not_declare_are_written_and_reported():
    plan = plan_merge(index_of({**SHAPES, "extra.bias": (3,)}), spec_of(SHAPES))

    assert plan.unexpected == ("extra.bias",)
    assert "extra.bias" in plan.tensors


def test_unknown_dtype_is_refused():
    with pytest.raises(OptionError, match="unknown dtype 'int4'"):
        plan_merge(index_of(SHAPES), spec_of(SHAPES), dtype="int4")


def test_unreadable_max_shard_size_is_refused():
    with pytest.raises(OptionError, match="invalid max shard size"):
        plan_merge(index_of(SHAPES), spec_of(SHAPES), max_shard_size="lots")


def test_in_memory_names_are_written_under_the_names_the_model_saves():
    plan = plan_merge(index_of(FUSED), spec_of(FUSED, saved=PER_EXPERT), dtype="keep")

    assert {name: (t.source, t.shape) for name, t in plan.tensors.items()} == {
        name: (view.source, shape) for name, (shape, view) in PER_EXPERT.items()
    }
    assert plan.tensors["experts.1.up.weight"].view == SavedView("experts.gate_up", (4, 1), 36)
    assert plan.tensors["norm.weight"].view is None
    assert plan.total_size == (48 + 4) * 4


def test_a_checkpoint_in_saved_names_is_written_as_it_is():
    saved_names = {name: shape for name, (shape, _) in PER_EXPERT.items()}

    plan = plan_merge(index_of(saved_names), spec_of(FUSED, saved=PER_EXPERT), dtype="keep")

    assert {name: (t.source, t.view) for name, t in plan.tensors.items()} == {name: (name, None) for name in saved_names}


def test_a_tensor_the_config_does_not_declare_keeps_its_name_beside_saved_names():
    plan = plan_merge(index_of({**FUSED, "extra.bias": (2,)}), spec_of(FUSED, saved=PER_EXPERT), dtype="keep")

    assert plan.tensors["extra.bias"].source == "extra.bias"
    assert plan.unexpected == ("extra.bias",)


FUSED_MOE = {"mlp.experts.gate_up_proj": (2, 6, 4), "mlp.experts.down_proj": (2, 4, 3)}
PER_EXPERT_MOE = {
    f"mlp.experts.{expert}.{half}.weight": ((3, 4), SavedView("mlp.experts.gate_up_proj", (4, 1), 24 * expert + 12 * part))
    for expert in range(2)
    for part, half in enumerate(("gate_proj", "up_proj"))
} | {
    f"mlp.experts.{expert}.down_proj.weight": ((4, 3), SavedView("mlp.experts.down_proj", (3, 1), 12 * expert))
    for expert in range(2)
}
STACKED_HALVES = {"mlp.experts.gate_proj": (2, 3, 4), "mlp.experts.up_proj": (2, 3, 4), "mlp.experts.down_proj": (2, 4, 3)}
"""VeOmni's experts under transformers 4: gate and up stacked apart, where transformers 5 fuses them."""


def test_experts_stacked_as_separate_halves_are_written_one_tensor_per_expert():
    plan = plan_merge(index_of(STACKED_HALVES), spec_of(FUSED_MOE, saved=PER_EXPERT_MOE), dtype="keep")

    assert plan.tensors.keys() == PER_EXPERT_MOE.keys()
    assert plan.tensors["mlp.experts.1.up_proj.weight"].view == SavedView("mlp.experts.up_proj", (4, 1), 12)
    assert plan.tensors["mlp.experts.1.gate_proj.weight"].view == SavedView("mlp.experts.gate_proj", (4, 1), 12)
    assert plan.tensors["mlp.experts.0.down_proj.weight"].view == SavedView("mlp.experts.down_proj", (3, 1), 0)


def test_a_stacked_half_of_the_wrong_shape_is_named():
    with pytest.raises(PlanError, match=r"mlp\.experts\.up_proj: got \(2, 4, 4\), expected \(2, 3, 4\)"):
        plan_merge(index_of({**STACKED_HALVES, "mlp.experts.up_proj": (2, 4, 4)}), spec_of(FUSED_MOE, saved=PER_EXPERT_MOE))
