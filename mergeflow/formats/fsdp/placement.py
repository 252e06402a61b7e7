"""DTensor placement maths: which block of a global tensor each rank holds (pure, no I/O)."""

from collections.abc import Sequence
from dataclasses import dataclass

REPLICATE = "replicate"
SHARD_PREFIX = "shard:"


@dataclass(frozen=True)
class Block:
    """One rank's piece of a global tensor: the rank that holds it, where it starts and its shape."""

    rank: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def shard(dim: int) -> str:
    """The placement string for `Shard(dim)`."""
    return f"{SHARD_PREFIX}{dim}"


def shard_dim(placement: str) -> int | None:
    """The tensor dim a placement string shards, or None for `replicate`."""
    if placement == REPLICATE:
        return None
    return int(placement.removeprefix(SHARD_PREFIX))


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """`[start, stop)` of chunk `index` when `torch.chunk` splits `size` into `parts` (the last ones may be short or empty)."""
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


def local_block(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[str],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offset and shape of the block a mesh coordinate holds, applying placements in mesh-dim order.

    Example:
        >>> local_block((10, 4), (4,), (3,), ("shard:0",))
        ((9, 0), (1, 4))
    """
    offset = [0] * len(global_shape)
    shape = list(global_shape)
    for mesh_size, index, placement in zip(mesh_shape, coordinate, placements, strict=True):
        dim = shard_dim(placement)
        if dim is None:
            continue
        start, stop = chunk_bounds(shape[dim], mesh_size, index)
        offset[dim] += start
        shape[dim] = stop - start
    return tuple(offset), tuple(shape)


def unique_blocks(blocks: Sequence[Block]) -> tuple[Block, ...]:
    """One block per distinct (offset, shape), from the lowest rank: replicas are read once."""
    chosen: dict[tuple, Block] = {}
    for block in sorted(blocks, key=lambda b: b.rank):
        chosen.setdefault((block.offset, block.shape), block)
    return tuple(block for block in chosen.values() if block.numel > 0)


def covers_exactly(global_shape: Sequence[int], blocks: Sequence[Block]) -> bool:
    """Whether the blocks lie inside the global tensor and add up to it.

    Blocks come from `local_block`, which partitions a tensor by construction, so counting
    elements finds a missing or a duplicated piece without comparing blocks pairwise.
    """
    total = 1
    for size in global_shape:
        total *= size
    inside = all(
        start + size <= bound
        for block in blocks
        for start, size, bound in zip(block.offset, block.shape, global_shape, strict=True)
    )
    return inside and sum(block.numel for block in blocks) == total
