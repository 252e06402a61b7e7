"""MoE experts stacked one projection per tensor, as VeOmni's models hold them under transformers 4:
`mlp.experts.gate_proj` and `mlp.experts.up_proj`, each (experts, ffn, hidden), where transformers 5 holds one fused
`mlp.experts.gate_up_proj` (experts, 2·ffn, hidden) whose rows are every expert's gate rows then its up rows.
`down_proj` is (experts, hidden, ffn) under both. A checkpoint that holds the two halves is planned against a spec
whose fused tensors are replaced by them, each saved per-expert tensor a view of its half."""

import dataclasses
import math
from collections.abc import Collection

from mergeflow.spec.model_spec import ModelSpec, SavedView

FUSED = "gate_up_proj"
HALVES = ("gate_proj", "up_proj")


def half_name(fused_name: str, half: str) -> str:
    return fused_name.removesuffix(FUSED) + half


def with_stacked_halves(spec: ModelSpec, names: Collection[str]) -> ModelSpec:
    """`spec` for a checkpoint holding `names`: each fused tensor the checkpoint lacks but whose two stacked halves it
    holds is replaced by them, and the views of it re-pointed into them (the spec itself where there is none)."""
    names = set(names)
    stacked = [
        name
        for name, shape in spec.expected_shapes.items()
        if name.endswith(f".{FUSED}") and name not in names and len(shape) == 3 and shape[1] % 2 == 0
        if all(half_name(name, half) in names for half in HALVES)
    ]
    views = {saved: _view_of_half(saved, view, spec) for saved, view in spec.saved_views.items() if view.source in stacked}
    if not stacked or None in views.values():
        return spec
    expected = dict(spec.expected_shapes)
    for name in stacked:
        experts, rows, columns = expected.pop(name)
        expected |= {half_name(name, half): (experts, rows // 2, columns) for half in HALVES}
    return dataclasses.replace(spec, expected_shapes=expected, saved_views={**spec.saved_views, **views})


def _view_of_half(saved: str, view: SavedView, spec: ModelSpec) -> SavedView | None:
    """The view `saved` has of a fused tensor, as a view of the half it lies in (None if it spans both)."""
    per_expert = math.prod(spec.expected_shapes[view.source][1:])
    per_half = per_expert // 2
    expert, within = divmod(view.offset, per_expert)
    half, start = divmod(within, per_half)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(spec.saved_shapes[saved], view.stride, strict=True))
    if start + extent > per_half:
        return None
    return SavedView(half_name(view.source, HALVES[half]), view.stride, expert * per_half + start)
