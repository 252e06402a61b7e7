"""How megatron-core's stored tensors are cut into Hugging Face's: each cut a name (what a key table says a stored
tensor's part is), with its shape and its split together in one table, `CUTS`. A cut may carry a parameter in its
name: the piece a key holds of a tensor saved in pieces (`joined`), or the TP ranks it was split over (`per_rank`)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mergeflow.errors import PlanError

COPY, VOCAB, Q, K, V, GATE, UP = "copy", "vocab", "q", "k", "v", "gate", "up"
QKV = "qkv"
"""A fused QKV kept fused: megatron-core's rows, [q, k, v] per query group, regrouped as [all q; all k; all v]
(the vision blocks of Qwen2.5-VL and Qwen3-VL)."""
GATE_UP_INTERLEAVED, GATE_UP_INTERLEAVED_T, TRANSPOSED = "gate_up_interleaved", "gate_up_interleaved_t", "transposed"
"""gpt-oss's expert layout: gate and up rows interleaved (and, for weights, stored input-major: transposed)."""
QKVZ_BY_KEY_HEAD, BA_BY_KEY_HEAD = "qkvz_by_key_head", "ba_by_key_head"
"""Qwen3-Next's fused gated delta net projections: megatron-core's pieces ([all q; all k; all v; all z], and
[all beta; all alpha]) regrouped per key head, as `in_proj_qkvz` and `in_proj_ba` hold them."""
ZERO_CENTERED = "zero_centered"
"""A norm weight megatron-core keeps zero-centred (its scale is 1 + weight) where the HF model keeps the scale:
the gated delta net's output norm in Qwen3.5 and Qwen3-Next."""
RANK_HALVES = "rank_halves"
"""mbridge's Qwen2.5-VL vision projector fc1 (weight and bias). mbridge splits every `linear_fc1` across TP ranks as
gate|up when the language model is gated (`_weight_split_across_tp` consults the language model's config for every
key), this ungated one included: TP rank r holds its share of the first half of the rows, then its share of the
second half, and megatron-core saves the ranks' rows one after the other. mbridge's export joins them back
(`_weight_merge_across_tp`), and that export is what verl serves and saves: the HF rows are every rank's first
halves, then every rank's second halves. The cut needs the number of ranks, `per_rank(RANK_HALVES, ranks)`."""
PER_RANK = "/"
"""Separates a cut from the number of TP ranks it depends on (`per_rank`)."""
JOINED = "@"
"""Separates a part from the position of the piece a key holds (`joined`)."""


def joined(part: str, position: int) -> str:
    """The part of a tensor that megatron-core saves in pieces (several keys): this key holds piece `position`,
    and the pieces, joined along their rows in order, are cut as `part` says."""
    return f"{part}{JOINED}{position}"


def per_rank(part: str, ranks: int) -> str:
    """A cut that depends on how many TP ranks the stored tensor was split over (`RANK_HALVES`)."""
    return f"{part}{PER_RANK}{ranks}"


def split_per_rank(part: str) -> tuple[str, int]:
    """(cut, TP ranks), or (cut, 1) for a cut that does not depend on them."""
    part, _, ranks = part.partition(PER_RANK)
    return part, int(ranks) if ranks else 1


def split_joined(part: str) -> tuple[str, int | None]:
    """(part, position of the piece), or (part, None) for a tensor saved whole."""
    part, _, position = part.partition(JOINED)
    return part, int(position) if position else None


@dataclass(frozen=True)
class Geometry:
    """What the fused tensors need from the HF config."""

    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    num_experts: int
    num_deepstack_mergers: int = 0
    output_gate: bool = False
    """The attention's query projection also gives a sigmoid gate on its output (Qwen3.5, Qwen3-Next): per head,
    HF keeps the gate's rows after the query's, megatron-core after a query group's."""
    linear_key_heads: int = 0
    linear_key_dim: int = 0
    """The gated delta net's key heads, and their rows in all (Qwen3-Next regroups its projections by key head)."""

    @property
    def query_rows(self) -> int:
        """Rows (in heads) of a query group's queries, with their output gates."""
        per_group = self.num_heads // self.num_query_groups
        return 2 * per_group if self.output_gate else per_group


Shape = tuple[int, ...]


class Cut(NamedTuple):
    shape: Callable[[Shape, Geometry, int, str], Shape]
    """The HF tensor's shape from the stored one's, the geometry, the TP ranks and the key (for errors)."""
    split: Callable[[torch.Tensor, Geometry, int], torch.Tensor]
    """The HF tensor from one layer's stored value."""


def _same(shape: Shape, geometry: Geometry, ranks: int, key: str) -> Shape:
    return shape


def _reversed(shape: Shape, geometry: Geometry, ranks: int, key: str) -> Shape:
    return tuple(reversed(shape))


def _half(shape: Shape, geometry: Geometry, ranks: int, key: str) -> Shape:
    return (shape[0] // 2, *shape[1:])


def _vocab_shape(shape: Shape, geometry: Geometry, ranks: int, key: str) -> Shape:
    """megatron-core pads the vocabulary to a multiple of its TP size; HF's has the config's size."""
    return (min(shape[0], geometry.vocab_size), *shape[1:])


def _checked_qkv(shape: Shape, geometry: Geometry, key: str) -> None:
    expected = geometry.num_query_groups * (geometry.query_rows + 2) * geometry.head_dim
    if shape[0] != expected:
        raise PlanError(
            f"{key} has {shape[0]} rows, but {geometry.num_heads} heads in {geometry.num_query_groups} query "
            f"groups of head_dim {geometry.head_dim} make {expected}"
        )


def _qkv_part_shape(part: str) -> Callable[[Shape, Geometry, int, str], Shape]:
    def shape_of(shape: Shape, geometry: Geometry, ranks: int, key: str) -> Shape:
        _checked_qkv(shape, geometry, key)
        if part == QKV:
            return shape
        heads = geometry.query_rows * geometry.num_query_groups if part == Q else geometry.num_query_groups
        return (heads * geometry.head_dim, *shape[1:])

    return shape_of


def _qkv_part(part: str) -> Callable[[torch.Tensor, Geometry, int], torch.Tensor]:
    """q, k or v of megatron-core's fused QKV, whose rows are [q (and its gates), k, v] per query group."""

    def split(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
        per_group, query_rows = geometry.num_heads // geometry.num_query_groups, geometry.query_rows
        groups = value.reshape(geometry.num_query_groups, query_rows + 2, geometry.head_dim, *value.shape[1:])
        if part == Q and geometry.output_gate:
            query, gate = groups[:, :per_group], groups[:, per_group:query_rows]
            return torch.stack([query, gate], dim=2).reshape(-1, *value.shape[1:])
        picked = {Q: groups[:, :per_group], K: groups[:, query_rows], V: groups[:, query_rows + 1]}[part]
        return picked.reshape(-1, *value.shape[1:])

    return split


def _qkv_regrouped(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return torch.cat([_qkv_part(one)(value, geometry, ranks) for one in (Q, K, V)])


def _by_key_head(value: torch.Tensor, geometry: Geometry, pieces: list[torch.Tensor]) -> torch.Tensor:
    per_head = [piece.reshape(geometry.linear_key_heads, -1, *value.shape[1:]) for piece in pieces]
    return torch.cat(per_head, dim=1).reshape(value.shape)


def _qkvz_by_key_head(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    key_dim = geometry.linear_key_dim
    value_dim = (value.shape[0] - 2 * key_dim) // 2
    return _by_key_head(value, geometry, list(value.split([key_dim, key_dim, value_dim, value_dim])))


def _rank_halves_shape(shape: Shape, geometry: Geometry, ranks: int, key: str) -> Shape:
    if shape[0] % (2 * ranks):
        raise PlanError(f"{key} has {shape[0]} rows, which {ranks} TP ranks cannot each hold a share of both halves of")
    return shape


def _whole(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return value


def _vocab(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return value[: geometry.vocab_size]


def _gate(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return value[: value.shape[0] // 2]


def _up(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return value[value.shape[0] // 2 :]


def _transposed(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return value.T.contiguous()


def _gate_up_interleaved(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    """gpt-oss's experts: gate and up rows alternate."""
    gate, up = value.chunk(2)
    return torch.stack([gate, up], dim=1).reshape(value.shape)


def _gate_up_interleaved_t(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return _gate_up_interleaved(value, geometry, ranks).T.contiguous()


def _zero_centered(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return (value.float() + 1).to(value.dtype)


def _ba_by_key_head(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return _by_key_head(value, geometry, list(value.chunk(2)))


def _rank_halves(value: torch.Tensor, geometry: Geometry, ranks: int) -> torch.Tensor:
    return value.reshape(ranks, 2, -1, *value.shape[1:]).transpose(0, 1).reshape(value.shape)


CUTS: dict[str, Cut] = {
    COPY: Cut(_same, _whole),
    VOCAB: Cut(_vocab_shape, _vocab),
    Q: Cut(_qkv_part_shape(Q), _qkv_part(Q)),
    K: Cut(_qkv_part_shape(K), _qkv_part(K)),
    V: Cut(_qkv_part_shape(V), _qkv_part(V)),
    QKV: Cut(_qkv_part_shape(QKV), _qkv_regrouped),
    GATE: Cut(_half, _gate),
    UP: Cut(_half, _up),
    TRANSPOSED: Cut(_reversed, _transposed),
    GATE_UP_INTERLEAVED: Cut(_same, _gate_up_interleaved),
    GATE_UP_INTERLEAVED_T: Cut(_reversed, _gate_up_interleaved_t),
    ZERO_CENTERED: Cut(_same, _zero_centered),
    QKVZ_BY_KEY_HEAD: Cut(_same, _qkvz_by_key_head),
    BA_BY_KEY_HEAD: Cut(_same, _ba_by_key_head),
    RANK_HALVES: Cut(_rank_halves_shape, _rank_halves),
}
"""Every cut: the HF tensor's shape, and how to cut it from one layer's stored value."""


def part_shape(part: str, shape: Shape, geometry: Geometry, key: str) -> Shape:
    """The HF tensor's shape, for a stored tensor of `shape` cut as `part` says.

    Raises:
        PlanError: a stored shape the config's geometry cannot be cut from.
    """
    cut, ranks = split_per_rank(part)
    return CUTS[cut].shape(shape, geometry, ranks, key)


def split_part(value: torch.Tensor, part: str, geometry: Geometry) -> torch.Tensor:
    """The HF tensor `part` of one layer of a stored tensor."""
    cut, ranks = split_per_rank(part)
    return CUTS[cut].split(value, geometry, ranks)
