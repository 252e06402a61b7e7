"""Every cut of `formats.megatron.cuts` on literal tensors (`arange`): what the HF tensor holds, and its shape."""

import pytest
import torch

from mergeflow.errors import PlanError
from mergeflow.formats.megatron import cuts
from mergeflow.formats.megatron.cuts import CUTS, Geometry, part_shape, per_rank, split_part

ATTENTION = Geometry(num_layers=1, num_heads=4, num_query_groups=2, head_dim=1, vocab_size=3, num_experts=0)
"""Two query groups of two heads, head_dim 1: megatron-core's fused QKV rows are [q0 q1 k v] per group."""
GATED_ATTENTION = Geometry(
    num_layers=1, num_heads=2, num_query_groups=1, head_dim=1, vocab_size=3, num_experts=0, output_gate=True
)
"""One query group of two heads, each with its output gate: megatron-core's rows are [q0 q1 g0 g1 k v]."""
DELTA_NET = Geometry(
    num_layers=1, num_heads=1, num_query_groups=1, head_dim=1, vocab_size=3, num_experts=0, linear_key_heads=2, linear_key_dim=2
)
"""The gated delta net's two key heads of one row each."""


def rows(count: int) -> torch.Tensor:
    return torch.arange(count)


def cut(part: str, value: torch.Tensor, geometry: Geometry = ATTENTION) -> list[int]:
    piece = split_part(value, part, geometry)
    assert piece.shape == part_shape(part, tuple(value.shape), geometry, "key")
    return piece.tolist()


EXPECTED = {
    cuts.COPY: (rows(4), ATTENTION, [0, 1, 2, 3]),
    cuts.VOCAB: (rows(4), ATTENTION, [0, 1, 2]),
    cuts.Q: (rows(8), ATTENTION, [0, 1, 4, 5]),
    cuts.K: (rows(8), ATTENTION, [2, 6]),
    cuts.V: (rows(8), ATTENTION, [3, 7]),
    cuts.QKV: (rows(8), ATTENTION, [0, 1, 4, 5, 2, 6, 3, 7]),
    cuts.GATE: (rows(4), ATTENTION, [0, 1]),
    cuts.UP: (rows(4), ATTENTION, [2, 3]),
    cuts.GATE_UP_INTERLEAVED: (rows(4), ATTENTION, [0, 2, 1, 3]),
    cuts.ZERO_CENTERED: (torch.tensor([0.0, -0.5]), ATTENTION, [1.0, 0.5]),
    cuts.QKVZ_BY_KEY_HEAD: (rows(8), DELTA_NET, [0, 2, 4, 6, 1, 3, 5, 7]),
    cuts.BA_BY_KEY_HEAD: (rows(4), DELTA_NET, [0, 2, 1, 3]),
}
"""Each one-dimensional cut: the stored value, the geometry, and the HF tensor it gives."""


@pytest.mark.parametrize("part", sorted(EXPECTED))
def test_each_cut_takes_the_rows_the_hf_tensor_holds(part):
    value, geometry, expected = EXPECTED[part]

    assert cut(part, value, geometry) == expected


def test_the_query_of_an_output_gated_attention_interleaves_each_heads_gate_after_it():
    assert cut(cuts.Q, rows(6), GATED_ATTENTION) == [0, 2, 1, 3]


def test_transposed_swaps_the_two_axes():
    assert cut(cuts.TRANSPOSED, rows(6).reshape(2, 3)) == [[0, 3], [1, 4], [2, 5]]


def test_the_transposed_interleaved_gate_up_interleaves_rows_then_swaps_axes():
    assert cut(cuts.GATE_UP_INTERLEAVED_T, rows(4).reshape(4, 1)) == [[0, 2, 1, 3]]


def test_rank_halves_puts_every_ranks_first_half_before_the_second_halves():
    assert cut(per_rank(cuts.RANK_HALVES, 2), rows(8)) == [0, 1, 4, 5, 2, 3, 6, 7]


def test_rank_halves_refuses_rows_the_ranks_cannot_share():
    with pytest.raises(PlanError, match="3 TP ranks"):
        part_shape(per_rank(cuts.RANK_HALVES, 3), (8,), ATTENTION, "key")


def test_a_fused_qkv_of_the_wrong_size_is_an_error_naming_the_heads():
    with pytest.raises(PlanError, match="4 heads in 2 query groups of head_dim 1 make 8"):
        part_shape(cuts.Q, (6,), ATTENTION, "key")


def test_every_cut_is_checked_here():
    checked = {*EXPECTED, cuts.TRANSPOSED, cuts.GATE_UP_INTERLEAVED_T, cuts.RANK_HALVES}

    assert checked == set(CUTS)
